"""The gRPC parameter server: :class:`PSServer`, the blocking :func:`serve`, and
:func:`serve_from_env` (what ``fleet.run_server()`` and ``python -m ps_server`` end in).

A server holds only the shards :func:`ps_server.core.routing.shards_of_server` gives it (tables
are built with ``make_table(config, server_index, num_servers)``), binds only the host it is given
(default 127.0.0.1; ``SO_REUSEPORT`` off, so a busy port is an error rather than a silently
shared one), serves the ``fleetrun.ps.v1.ParameterServer`` service (:mod:`ps_server.rpc.service`)
and the standard ``grpc.health.v1.Health`` service (SERVING while up, NOT_SERVING while stopping).

Threads: each request runs on a pool thread (``threads``, default 32). A Barrier call holds its
thread while it waits, so ``threads`` must exceed the number of callers that can wait at once
(trainers) — otherwise the last arrivals queue behind the waiters until these time out. Inside
one request, the compiled table kernels split a large batch (parts of >= 8192 keys) over
``table_threads`` threads (:func:`ps_server.core.kernels.set_threads`; default
FLEET_PS_TABLE_THREADS, else the usable CPUs up to 8): a server with idle cores answers one big
pull or push sooner. Processes sharing a host split its cores: ``fleetrun`` sets
FLEET_PS_TABLE_THREADS on each server to the node's CPUs divided by its local processes
(servers and trainers), as it sets OMP_NUM_THREADS, or on Ray to the CPUs of the server's
bundle; in a Kubernetes pod the default follows the container's CPU limit.

Who may call it: with a token (``token=``, else FLEET_PS_TOKEN; fleetrun gives every job its
own) every RPC but the health check must carry it, or is refused UNAUTHENTICATED and changes
nothing (:mod:`ps_server.rpc.auth`); without one, the server binds only loopback addresses unless
``insecure``. TLS or mutual TLS with ``tls=`` (:mod:`ps_server.rpc.tls`; default from the
FLEET_PS_TLS_* variables). Save / Load requests may only name directories under the server's
checkpoint roots (:mod:`ps_server.checkpoint.roots`; ``checkpoint_root=``, else
FLEET_PS_CHECKPOINT_ROOT, else the working directory); the graph files a LoadEdges / LoadNodes
request names, under its data roots (``data_root=``, else FLEET_PS_DATA_ROOT, else the working
directory, the checkpoint roots and the temporary directory).

Checkpoints: a job checkpoint or serving export locks the tables only while their rows are
copied and is written on a background thread (:mod:`ps_server.rpc.checkpoint_service`); a
stopping server lets a write in progress finish. :meth:`PSServer.serve_export` (``python -m
ps_server --serve``) makes a read-only serving server: pulls answer from the export, calls that
would change it get FAILED_PRECONDITION.

Stopping is graceful in every path (``stop()``, the Stop RPC, SIGTERM/SIGINT under
:func:`serve`): health turns NOT_SERVING, barrier waiters are released with UNAVAILABLE, new
calls are refused and in-flight calls get ``grace_s`` seconds to finish; then the tables that hold
files are closed (an SSD table's RocksDB, its eviction thread and its directory lock).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from collective.cpu_share import format_cpus
from collective.env import (
    FLEET_PS_SSD_ROOT,
    FLEET_PS_TABLE_THREADS,
    TrainingRole,
    read_metrics_endpoint,
    read_worker_env,
    usable_cpus,
)
from collective.errors import ConfigError, EnvContractError, PSError
from ps_server import telemetry
from ps_server.checkpoint.roots import resolve_data_roots, resolve_roots
from ps_server.checkpoint.serving import load_serving
from ps_server.core import kernels
from ps_server.rpc.auth import (
    TokenInterceptor,
    check_bind_allowed,
    insecure_from_env,
    resolve_token,
)
from ps_server.rpc.channel_options import (
    DEFAULT_MAX_MESSAGE_MB,
    grpc_message_options,
)
from ps_server.rpc.graph_service import GraphState, add_graph_service
from ps_server.rpc.service import SERVICE_NAME, ServerState, load_dir
from ps_server.rpc.servicer import ParameterServerServicer, add_servicer_to_server
from ps_server.rpc.tls import TLSConfig, server_credentials

logger = logging.getLogger(__name__)

DEFAULT_THREADS = 32
"""Default request threads per server."""
MAX_DEFAULT_TABLE_THREADS = 8


def default_table_threads() -> int:
    """FLEET_PS_TABLE_THREADS when set (fleetrun sets it), else the usable CPUs up to 8."""
    raw = os.environ.get(FLEET_PS_TABLE_THREADS, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"must be an integer >= 1, got {raw!r}", key=FLEET_PS_TABLE_THREADS)
        return value
    return min(MAX_DEFAULT_TABLE_THREADS, usable_cpus())


def _check_ssd_root(ssd_root: str | None) -> str | None:
    """The real path of ``--ssd_root`` (None stays None); ConfigError unless it is an existing
    writable directory."""
    if ssd_root is None:
        return None
    path = os.path.realpath(ssd_root)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"must be an existing directory this process can write, got {ssd_root!r} "
            "(create it first)",
            key="ssd_root",
        )
    return path


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class PSServer:
    """One parameter server (shards ``shards_of_server(server_index, num_servers, ...)`` of every
    table). ``start()`` returns the bound port; ``wait()`` blocks until stopped."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        server_index: int = 0,
        num_servers: int = 1,
        max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
        threads: int = DEFAULT_THREADS,
        grace_s: float = 5.0,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        table_threads: int | None = None,
        token: str | None = None,
        insecure: bool | None = None,
        tls: TLSConfig | None = None,
        checkpoint_root: str | Sequence[str] | None = None,
        ssd_root: str | None = None,
        data_root: str | Sequence[str] | None = None,
    ) -> None:
        """``port=0`` picks a free port (``start()`` returns it). ``metrics_port``: serve
        Prometheus ``/metrics`` there from ``start()`` (0 = no endpoint; None = the env
        contract's FLEET_METRICS_PORT / FLEET_METRICS_HOST, as fleetrun sets them).
        ``table_threads``: threads one large request's table work is split over (None:
        :func:`default_table_threads`; process-wide, set by ``start()``). ``token``: the job's
        token every call must carry (None: FLEET_PS_TOKEN, else no token); ``insecure``: allow
        a non-loopback ``host`` without a token (None: FLEET_PS_INSECURE=1); ``tls``: TLS
        settings (None: from the FLEET_PS_TLS_* variables); ``checkpoint_root``: the
        directories Save / Load requests may name (None: FLEET_PS_CHECKPOINT_ROOT, else the
        working directory); ``ssd_root``: an existing writable directory where
        ``storage="ssd"`` tables keep their cold rows (scratch, emptied per table at creation;
        None: such tables are refused); ``data_root``: the directories graph files a LoadEdges /
        LoadNodes request names may lie under (None: FLEET_PS_DATA_ROOT, else the working
        directory, the checkpoint roots and the temporary directory). See the module
        docstring."""
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ConfigError(f"must be an integer >= 1, got {num_servers!r}", key="num_servers")
        if not isinstance(server_index, int) or not 0 <= server_index < num_servers:
            raise ConfigError(
                f"must be in [0, {num_servers}), got {server_index!r}", key="server_index"
            )
        if not isinstance(threads, int) or threads < 2:
            raise ConfigError(f"must be an integer >= 2, got {threads!r}", key="threads")
        if table_threads is None:
            table_threads = default_table_threads()
        if not isinstance(table_threads, int) or table_threads < 1:
            raise ConfigError(
                f"must be an integer >= 1, got {table_threads!r}", key="table_threads"
            )
        self.table_threads = table_threads
        self.host = host
        self.port = int(port)
        self.max_message_mb = max_message_mb
        self.threads = threads
        self.grace_s = grace_s
        self._options = grpc_message_options(max_message_mb)
        self.token = resolve_token(token)
        self.insecure = insecure_from_env() if insecure is None else bool(insecure)
        self.tls = TLSConfig.resolve() if tls is None else tls
        checkpoint_roots = resolve_roots(checkpoint_root)
        self.state = ServerState(
            server_index=server_index,
            num_servers=num_servers,
            checkpoint_roots=checkpoint_roots,
            data_roots=resolve_data_roots(data_root, checkpoint_roots),
            ssd_root=_check_ssd_root(ssd_root),
        )
        self.state.on_stop = self._stop_soon
        if metrics_port is None:
            endpoint = read_metrics_endpoint()
            metrics_port, metrics_host = (
                endpoint["metrics_port"],
                metrics_host or endpoint["metrics_host"],
            )
        self.metrics_port, self.metrics_host = int(metrics_port), metrics_host or "127.0.0.1"
        telemetry.TABLES.add(self.state)
        self._server: grpc.Server | None = None
        self.graph: GraphState | None = None
        self._health: health.HealthServicer | None = None
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()

    @property
    def endpoint(self) -> str:
        """``host:port`` (the port is known after ``start()``)."""
        return _address(self.host, self.port)

    def load_checkpoint(self, directory: str) -> dict[str, int]:
        """Load this server's shards of a checkpoint (before or after ``start()``); tables it
        does not hold are created from the checkpoint. Returns rows read per table."""
        t0 = time.perf_counter()
        rows, _ = load_dir(self.state, directory)
        telemetry.CHECKPOINT_SECONDS.labels(op="load").observe(time.perf_counter() - t0)
        return rows

    def restore_latest(self, root: str) -> str | None:
        """Load this server's shards of the newest good job checkpoint of ``root`` (before
        ``start()``): a server restarted alone while the other servers and the trainers go on
        (fleetrun's in-place recovery of async/GEO jobs, :data:`RESTORE_LATEST_ENV`). Newest
        first, a checkpoint that is not committed or whose manifests are wrong is passed over, as
        is one whose shards of this server fail to load (CRC, size): the previous one is tried,
        as ``latest_good`` does. Returns the checkpoint's name, None when ``root`` holds none
        that loads (the server then starts empty and says so)."""
        from ps_server.checkpoint.series import list_checkpoints

        for status in list_checkpoints(root):
            if status.record is None:
                logger.warning(
                    "server %d: checkpoint %s skipped: %s",
                    self.state.server_index,
                    status.name,
                    status.reason,
                )
                continue
            try:
                rows = self.load_checkpoint(str(status.directory))
            except PSError as err:
                logger.warning(
                    "server %d: checkpoint %s skipped: %s",
                    self.state.server_index,
                    status.name,
                    err,
                )
                continue
            logger.warning(
                "server %d restored its shards from %s (step %d): %s",
                self.state.server_index,
                status.name,
                status.step,
                rows,
            )
            return status.name
        logger.warning(
            "server %d: no checkpoint of %s loads; starting empty", self.state.server_index, root
        )
        return None

    def serve_export(self, directories: Sequence[str]) -> dict[str, int]:
        """Serve a read-only serving export (before ``start()``): a base export, then its deltas
        in order (``python -m ps_server --serve DIR [DELTA ...]``; the operator's choice, not
        confined to the checkpoint roots). From then on every call that would change the server
        is refused (FAILED_PRECONDITION naming read-only serving); Load loads the next delta.
        Returns rows held per table."""
        tables, records = load_serving(directories, self.state.server_index, self.state.num_servers)
        with self.state.lock:
            if self.state.tables:
                raise PSError(
                    f"server {self.state.server_index} already holds tables "
                    f"{sorted(self.state.tables)}: serve an export on a fresh server"
                )
            self.state.tables.update(tables)
            self.state.serving = list(records)
        return {name: t.num_rows for name, t in sorted(tables.items())}

    def _count_refusal(self, op: str, cause: str) -> None:
        """A call refused by the token check (in Stats' errors, as other failed calls)."""
        with self.state.counter_lock:
            self.state.errors[f"{op}:UNAUTHENTICATED"] += 1

    def start(self) -> int:
        """Bind and start serving; returns the port (PSError if the address cannot be bound;
        ConfigError, before binding, for a non-loopback host without a token or ``insecure``)."""
        if self._server is not None:
            raise PSError(f"server {self.state.server_index} is already started on {self.endpoint}")
        check_bind_allowed(self.host, self.token is not None, self.insecure)
        interceptors = (
            [TokenInterceptor(self.token, self.state.server_index, self._count_refusal)]
            if self.token is not None
            else []
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=self.threads, thread_name_prefix=f"ps{self.state.server_index}"
            ),
            interceptors=interceptors,
            options=[*self._options, ("grpc.so_reuseport", 0)],
        )
        add_servicer_to_server(ParameterServerServicer(self.state), server)
        self.graph = add_graph_service(server, self.state, self.token, self.tls)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = _address(self.host, self.port)
        try:
            if self.tls.server_enabled:
                port = server.add_secure_port(address, server_credentials(self.tls))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as err:
            raise PSError(
                f"parameter server {self.state.server_index} cannot listen on {address}: {err} "
                "(port busy, or the host is not an address of this machine)"
            ) from err
        if port == 0:
            raise PSError(f"parameter server {self.state.server_index} cannot listen on {address}")
        server.start()
        kernels.set_threads(self.table_threads)
        self._server = server
        self.port = port
        self.state.endpoint = self.endpoint
        if self.metrics_port:
            self.metrics_port = telemetry.start(self.metrics_port, self.metrics_host)
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        tls = (
            "mutual TLS"
            if self.tls.ca and self.tls.server_enabled
            else ("TLS" if self.tls.server_enabled else "no TLS")
        )
        logger.info(
            "parameter server %d/%d serving on %s (max message %s MiB, %d threads, %d table "
            "threads, CPUs %s; %s, %s, checkpoints under %s)",
            self.state.server_index,
            self.state.num_servers,
            self.endpoint,
            self.max_message_mb,
            self.threads,
            self.table_threads,
            format_cpus(sorted(os.sched_getaffinity(0))),
            "job token required" if self.token is not None else "NO token (anyone may call)",
            tls,
            ", ".join(self.state.checkpoint_roots),
        )
        return port

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stopped (Stop RPC, ``stop()``, a signal under ``serve``);
        returns False if ``timeout_s`` passed first."""
        if self._server is None and not self._stopped.is_set():
            raise PSError("wait(): the server was not started")
        return self._stopped.wait(timeout_s)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop gracefully (idempotent; see the module docstring)."""
        with self._stop_lock:
            if self._stopping:
                first = False
            else:
                self._stopping = first = True
        if not first:
            self._stopped.wait()
            return
        grace = self.grace_s if grace_s is None else grace_s
        logger.info("parameter server %d stopping (grace %.1fs)", self.state.server_index, grace)
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        self.state.barriers.stop()
        if self._server is not None:
            self._server.stop(grace).wait()
        if self.graph is not None:
            self.graph.close()
        self.state.checkpoints.close()  # a checkpoint being written is finished, not cut
        self.state.shm.close()
        self._close_tables()
        self._stopped.set()
        logger.info("parameter server %d stopped", self.state.server_index)

    def _close_tables(self) -> None:
        """Close the tables that hold files (an SSD table stops its eviction thread, closes its
        RocksDB and releases its directory lock); the table objects are unusable afterwards."""
        with self.state.lock:
            tables = list(self.state.tables.values())
        for table in tables:
            close = getattr(table, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception:  # noqa: BLE001 - one table's failure must not keep the others open
                logger.exception("closing table %r failed", table.name)

    def _stop_soon(self) -> None:
        """Stop from another thread, so the Stop RPC that asked can reply first."""
        threading.Thread(target=self.stop, name="ps-stop", daemon=True).start()

    def __enter__(self) -> PSServer:  # noqa: PYI034 - py3.10 has no typing.Self
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


RESTORE_LATEST_ENV = "FLEET_PS_RESTORE_LATEST"
"""Set by fleetrun on a server it restarts alone (async/GEO in-place recovery): the job's
checkpoint directory, whose newest good checkpoint the server restores its shards from."""


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    server_index: int = 0,
    num_servers: int = 1,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    threads: int = DEFAULT_THREADS,
    checkpoint_dir: str | None = None,
    on_ready: Any = None,
    metrics_port: int | None = None,
    table_threads: int | None = None,
    serving_dirs: Sequence[str] | None = None,
    restore_latest: str | None = None,
    **security: Any,
) -> None:
    """Run one server until a Stop RPC or SIGTERM/SIGINT (graceful either way), then return.

    ``checkpoint_dir`` loads a checkpoint before serving, ``serving_dirs`` serves a read-only
    serving export (a base, then its deltas; :meth:`PSServer.serve_export`) — paths of the
    caller's, not confined to the checkpoint roots; ``restore_latest`` (default
    FLEET_PS_RESTORE_LATEST) restores this server's shards from the newest good job checkpoint
    of that directory (:meth:`PSServer.restore_latest`); ``on_ready(server)`` is called once it listens (``python -m
    ps_server`` prints the endpoint there). ``metrics_port``, ``table_threads`` and
    ``security`` (``token``, ``insecure``, ``tls``, ``checkpoint_root``, ``ssd_root``,
    ``data_root``): as :class:`PSServer`'s.
    Signal handlers are installed only when called from the main thread; SIGUSR1, unless the
    process handles it already, then prints every thread's stack to stderr.
    """
    server = PSServer(
        host,
        port,
        server_index,
        num_servers,
        max_message_mb,
        threads,
        metrics_port=metrics_port,
        table_threads=table_threads,
        **security,
    )
    if checkpoint_dir and serving_dirs:
        raise ConfigError("give a checkpoint to load or an export to serve, not both", key="serve")
    if checkpoint_dir:
        server.load_checkpoint(checkpoint_dir)
    restore = restore_latest or os.environ.get(RESTORE_LATEST_ENV)
    if restore and not checkpoint_dir and not serving_dirs:
        server.restore_latest(restore)
    if serving_dirs:
        server.serve_export(serving_dirs)
    server.start()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: FrameType | None) -> None:
            logger.info(
                "parameter server %d: %s received", server_index, signal.Signals(signum).name
            )
            server._stop_soon()

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
        if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:  # nobody else's: stack dumps
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        if on_ready is not None:
            on_ready(server)
        # Wake up now and then: a signal the kernel hands to another thread (gRPC's) only sets
        # a flag, and its Python handler runs once the main thread executes bytecode again.
        while not server.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()


def serve_from_env(**kwargs: Any) -> None:
    """:func:`serve` as the env contract says (TRAINING_ROLE=PSERVER: POD_IP, PADDLE_PORT, this
    server's index in PADDLE_PSERVERS_IP_PORT_LIST and their count); ``kwargs`` go to
    :func:`serve` (``max_message_mb``, ``threads``, ``table_threads``, ``checkpoint_dir``,
    ``on_ready``, ``token``, ``insecure``, ``tls``, ``checkpoint_root``, ``ssd_root``)."""
    env = read_worker_env()
    if env.training_role is not TrainingRole.PSERVER:
        raise EnvContractError(
            f"serve_from_env() needs TRAINING_ROLE=PSERVER, got {env.training_role.value} "
            "(start the job with fleetrun --server_num N, or call ps_server.serve(...))"
        )
    host, _, port = env.current_endpoint.rpartition(":")
    if not kwargs.get("ssd_root") and os.environ.get(FLEET_PS_SSD_ROOT):
        kwargs["ssd_root"] = ssd_root_from_env()
    serve(
        host=host.strip("[]"),
        port=int(port),
        server_index=env.server_index,
        num_servers=len(env.pserver_endpoints),
        **kwargs,
    )


def ssd_root_from_env() -> str | None:
    """This server's SSD directory from FLEET_PS_SSD_ROOT (fleetrun ``--ps_ssd_dir``), created
    when missing; None without the variable (``storage="ssd"`` tables are then refused)."""
    root = os.environ.get(FLEET_PS_SSD_ROOT)
    if not root:
        return None
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot create this server's SSD directory {root!r} ({err.strerror}); give "
            "fleetrun a --ps_ssd_dir on a local disk this user can write",
            key=FLEET_PS_SSD_ROOT,
        ) from None
    return root


__all__ = [
    "DEFAULT_MAX_MESSAGE_MB",
    "DEFAULT_THREADS",
    "RESTORE_LATEST_ENV",
    "PSServer",
    "default_table_threads",
    "grpc_message_options",
    "serve",
    "serve_from_env",
    "ssd_root_from_env",
]
