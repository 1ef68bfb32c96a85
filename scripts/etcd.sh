#!/usr/bin/env bash
# Start a throw-away single-member etcd on 127.0.0.1 for elastic fleetrun jobs, in the foreground.
#
#   scripts/etcd.sh [DATA_DIR]
#
# DATA_DIR : etcd's data directory (default: a new mktemp -d directory); private to this etcd.
#
# Installs Debian's `etcd-server` package with apt-get when /usr/bin/etcd is missing (sudo only
# when not root; the package's system service is stopped: this script does not need it).
# Binds 127.0.0.1 on two free ports (client, peer), with the v2 API on (--enable-v2): torch's
# `etcd` and `etcd-v2` rendezvous handlers talk to etcd through python-etcd, a v2 client
# (`pip install python-etcd`, in fleetrun's test extra). Prints `ETCD_ENDPOINT=127.0.0.1:PORT`
# and `ETCD_DIR=...` on stdout, then execs etcd (same pid: kill it to stop it; Ctrl-C works).
#
#   fleetrun --nnodes 1:2 --rdzv_backend etcd --rdzv_endpoint $ETCD_ENDPOINT --rdzv_id job1 train.py
#   fleetrun --elastic_server etcd://$ETCD_ENDPOINT --job_id job1 --np 1:2 train.py   # Paddle
set -euo pipefail

data_dir=${1:-$(mktemp -d -t fleetrun-etcd.XXXXXX)}
mkdir -p "$data_dir"
chmod 700 "$data_dir"

etcd_bin=${ETCD_BIN:-/usr/bin/etcd}
if [[ ! -x "$etcd_bin" ]]; then
  if command -v etcd >/dev/null 2>&1; then
    etcd_bin=$(command -v etcd)
  else
    echo "$0: installing Debian's etcd-server package (apt-get)" >&2
    sudo_cmd=""
    [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq etcd-server >&2
    etcd_bin=/usr/bin/etcd
    $sudo_cmd systemctl stop etcd >/dev/null 2>&1 || true
  fi
fi

python=${PYTHON:-python3}
read -r client_port peer_port < <("$python" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

echo "ETCD_ENDPOINT=127.0.0.1:$client_port"
echo "ETCD_DIR=$data_dir"
exec "$etcd_bin" \
  --name fleetrun-etcd \
  --data-dir "$data_dir" \
  --listen-client-urls "http://127.0.0.1:$client_port" \
  --advertise-client-urls "http://127.0.0.1:$client_port" \
  --listen-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
  --initial-cluster "fleetrun-etcd=http://127.0.0.1:$peer_port" \
  --initial-cluster-state new \
  --enable-v2=true \
  --logger zap --log-level error
