#!/usr/bin/env bash
# Start a throw-away Prometheus that scrapes a local fleetrun job, in the foreground.
#
#   scripts/prometheus.sh LOG_DIR [WORK_DIR]
#
# LOG_DIR  : the job's log_dir; Prometheus discovers its targets from LOG_DIR/metrics_targets*.json
#            (file_sd, re-read on change: metrics_targets.json of a one-node job, and every
#            node's metrics_targets.node<R>.json of a job of several nodes sharing LOG_DIR)
#            and scrapes them every 1 s.
# WORK_DIR : where the config and the TSDB go (default: a new mktemp -d directory).
#
# Installs Debian's `prometheus` package with apt-get when /usr/bin/prometheus is missing.
# Binds 127.0.0.1 on a free port. Prints `PROMETHEUS_URL=http://127.0.0.1:PORT` and
# `PROMETHEUS_DIR=...` on stdout, then execs Prometheus (same pid: kill it to stop it; Ctrl-C works).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 LOG_DIR [WORK_DIR]" >&2
  exit 2
fi
log_dir=$(cd "$1" 2>/dev/null && pwd) || { echo "$0: log dir '$1' does not exist" >&2; exit 2; }
work_dir=${2:-$(mktemp -d -t fleetrun-prometheus.XXXXXX)}
mkdir -p "$work_dir/data"

prom=${PROMETHEUS_BIN:-/usr/bin/prometheus}
if [[ ! -x "$prom" ]]; then
  if command -v prometheus >/dev/null 2>&1; then
    prom=$(command -v prometheus)
  else
    echo "$0: installing Debian's prometheus package (apt-get)" >&2
    sudo_cmd=""
    [[ $(id -u) -ne 0 ]] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq prometheus >&2
    prom=/usr/bin/prometheus
    # the package starts a system service on :9090; this script does not need it
    $sudo_cmd systemctl stop prometheus >/dev/null 2>&1 || true
  fi
fi

python=${PYTHON:-python3}
port=$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

cat >"$work_dir/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: fleetrun
    file_sd_configs:
      - files: ["$log_dir/metrics_targets*.json"]
        refresh_interval: 1s
YAML

echo "PROMETHEUS_URL=http://127.0.0.1:$port"
echo "PROMETHEUS_DIR=$work_dir"
exec "$prom" \
  --config.file="$work_dir/prometheus.yml" \
  --storage.tsdb.path="$work_dir/data" \
  --web.listen-address="127.0.0.1:$port" \
  --log.level=warn
