"""``python -m ps_server``: run one parameter server until a Stop RPC or SIGTERM/SIGINT.

Examples::

    python -m ps_server --port 8500                                  # one server, 127.0.0.1
    python -m ps_server --host 10.0.0.5 --port 8500 --server_index 1 --num_servers 4
    python -m ps_server --from_env      # TRAINING_ROLE=PSERVER env contract (as fleetrun sets)
    python -m ps_server --port 8600 --serve exports/day3 exports/day3-h01  # read-only serving
    python -m ps_server --host 10.0.0.5 --port 8500 --token_file /run/secrets/ps-token \
        --tls_cert server.pem --tls_key server.key --tls_ca ca.pem --checkpoint_root /data/ckpt

Security: with a token (``--token_file`` or FLEET_PS_TOKEN) every RPC but the health check must
carry it; without one the server binds only loopback addresses unless ``--insecure``. TLS with
``--tls_cert``/``--tls_key``, mutual TLS with ``--tls_ca`` too. Save / Load requests may only name
directories under ``--checkpoint_root`` (default: FLEET_PS_CHECKPOINT_ROOT, else the working
directory); ``--load DIR`` and ``--serve DIR`` are the operator's own choice and are not confined.

``--serve DIR [DELTA ...]`` serves a serving export read-only (``fleet.ps.export_serving``): pulls
answer from it (zeros for unknown keys), every call that would change it is refused
(FAILED_PRECONDITION), and a Load RPC applies the next delta export.

Once listening it prints one line ``ps_server <index>/<num> serving on <host>:<port>`` to stdout
(with ``--port 0`` this is how a caller learns the port). Exit code 0 after a graceful stop, 2 for
a bad flag, 1 when the server cannot start (busy port, unreadable checkpoint).

``kill -USR1 <pid>`` prints every thread's stack to stderr (the server keeps serving). Once the
server has stopped (its tables closed, its checkpoints written), the interpreter's own shutdown
gets ``EXIT_WATCHDOG_S`` seconds; past that the threads' stacks go to stderr and the process
exits with code 1, so a stuck library thread can neither keep a stopped server alive nor hide
where it stuck.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys

from collective.cpu_share import apply_cpu_share, format_cpus
from collective.errors import ConfigError, FleetError
from ps_server.rpc.auth import resolve_token
from ps_server.rpc.tls import TLSConfig
from ps_server.server import (
    DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_THREADS,
    PSServer,
    serve,
    serve_from_env,
)

logger = logging.getLogger("ps_server")

EXIT_WATCHDOG_S = 15.0
"""Seconds the interpreter's shutdown may take after a graceful stop (see the module docstring)."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags (both ``_`` and ``-`` spellings)."""
    p = argparse.ArgumentParser(
        prog="python -m ps_server",
        description="Run one fleetrun parameter server (gRPC) until Stop or SIGTERM/SIGINT.",
    )

    def add(name: str, **kw: object) -> None:
        p.add_argument(f"--{name}", *([f"--{name.replace('_', '-')}"] if "_" in name else []), **kw)

    add("host", default="127.0.0.1", help="address to bind (only this one; default 127.0.0.1)")
    add("port", type=int, default=0, help="port to bind (0: a free one, printed)")
    add("server_index", type=int, default=0, help="this server's index (default 0)")
    add("num_servers", type=int, default=1, help="number of servers of the job (default 1)")
    add(
        "max_message_mb",
        type=float,
        default=DEFAULT_MAX_MESSAGE_MB,
        help=f"largest request/response in MiB (default {DEFAULT_MAX_MESSAGE_MB})",
    )
    add(
        "threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"request threads (default {DEFAULT_THREADS}; more than the trainers that may wait "
        "in a barrier at once)",
    )
    add(
        "table_threads",
        type=int,
        default=None,
        help="threads one large pull/push is split over (default: FLEET_PS_TABLE_THREADS, else "
        "the CPU count up to 8)",
    )
    add("load", default=None, metavar="DIR", help="load this checkpoint before serving")
    add(
        "restore_latest",
        default=None,
        metavar="ROOT",
        help="restore this server's shards from the newest good job checkpoint under ROOT, "
        "falling back past one that does not load (default: FLEET_PS_RESTORE_LATEST; a server "
        "restarted alone while its job goes on)",
    )
    add(
        "serve",
        nargs="+",
        default=None,
        metavar="DIR",
        help="serve a read-only serving export: a base export, then its deltas in order (pushes "
        "and other changes are refused; unknown keys pull zeros)",
    )
    add(
        "token_file",
        default=None,
        metavar="PATH",
        help="file holding the job's token, which every RPC must carry (default: "
        "FLEET_PS_TOKEN; none: anyone who reaches the port may call)",
    )
    add(
        "insecure",
        action="store_true",
        default=None,
        help="serve without a token on a non-loopback address (refused otherwise)",
    )
    add(
        "checkpoint_root",
        default=None,
        metavar="DIR",
        help="directory (or os.pathsep-separated list) Save / Load requests may name; relative "
        "paths resolve under the first (default: FLEET_PS_CHECKPOINT_ROOT, else the working "
        "directory)",
    )
    add(
        "data_root",
        default=None,
        metavar="DIR",
        help="directory (or os.pathsep-separated list) the graph files a LoadEdges / LoadNodes "
        "request names may lie under (default: FLEET_PS_DATA_ROOT, else the working directory, "
        "the checkpoint roots and the temporary directory)",
    )
    add(
        "ssd_root",
        default=None,
        metavar="DIR",
        help="existing writable directory where storage='ssd' tables keep their cold rows "
        "(<DIR>/<table>/shards-<first shard>; scratch, emptied at table creation, rebuilt from "
        "the checkpoint a restarted server loads)",
    )
    add(
        "tls_cert",
        default=None,
        metavar="PEM",
        help="serve TLS with this certificate chain (default: FLEET_PS_TLS_CERT)",
    )
    add(
        "tls_key",
        default=None,
        metavar="PEM",
        help="private key of --tls_cert (default: FLEET_PS_TLS_KEY)",
    )
    add(
        "tls_ca",
        default=None,
        metavar="PEM",
        help="mutual TLS: clients must present a "
        "certificate signed by this CA (default: FLEET_PS_TLS_CA)",
    )
    add(
        "metrics_port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus /metrics on this port, on 127.0.0.1 or FLEET_METRICS_HOST (0: none; default: "
        "FLEET_METRICS_PORT when set, else none)",
    )
    add(
        "from_env",
        action="store_true",
        help="take host, port, index and count from the PSERVER env contract (TRAINING_ROLE, "
        "POD_IP, PADDLE_PORT, PADDLE_PSERVERS_IP_PORT_LIST)",
    )
    add(
        "cpu_share",
        default=None,
        metavar="I/N",
        help="bind the server to the I-th of N equal blocks of the CPUs it may use (default: "
        "FLEET_PS_CPU_SHARE, as fleetrun --ps_bind_cpus sets it; else unbound)",
    )
    add("log_level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _announce(server: PSServer) -> None:
    print(
        f"ps_server {server.state.server_index}/{server.state.num_servers} serving on "
        f"{server.endpoint}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse flags, serve until stopped; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cpus = apply_cpu_share(value=args.cpu_share, name="--cpu_share")
        if cpus is not None:
            logger.info("bound to CPUs %s", format_cpus(cpus))
        security = {
            "token": resolve_token(token_file=args.token_file),
            "insecure": args.insecure,
            "tls": TLSConfig.resolve(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca),
            "checkpoint_root": args.checkpoint_root,
            "ssd_root": args.ssd_root,
            "data_root": args.data_root,
        }
        if args.from_env:
            serve_from_env(
                max_message_mb=args.max_message_mb,
                threads=args.threads,
                table_threads=args.table_threads,
                checkpoint_dir=args.load,
                restore_latest=args.restore_latest,
                on_ready=_announce,
                metrics_port=args.metrics_port,
                serving_dirs=args.serve,
                **security,
            )
        else:
            serve(
                host=args.host,
                port=args.port,
                server_index=args.server_index,
                num_servers=args.num_servers,
                max_message_mb=args.max_message_mb,
                threads=args.threads,
                table_threads=args.table_threads,
                checkpoint_dir=args.load,
                restore_latest=args.restore_latest,
                on_ready=_announce,
                metrics_port=args.metrics_port,
                serving_dirs=args.serve,
                **security,
            )
    except ConfigError as err:
        logger.error("ps_server: %s", err)
        return 2
    except FleetError as err:
        logger.error("ps_server: %s", err)
        return 1
    return 0


def _exit(code: int) -> None:
    """``sys.exit(code)`` with the exit watchdog armed (see the module docstring)."""
    sys.stdout.flush()
    faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True, file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
