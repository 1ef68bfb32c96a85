"""One attempt of a job on this node: start its processes, watch them, report how it ended.

Shared by every scheduler: the local agent, the elastic agent, the Kubernetes pod and the Ray
driver build :class:`ProcSpec` lists with :func:`worker_argv`, :func:`base_env` and
:func:`console_prefix`, decide after an attempt with :func:`decide`, and stop on fleetrun's own
signals (:class:`Interrupted`, :func:`install_signal_handlers`).

Mode-agnostic: a collective job is a list of trainer :class:`ProcSpec`; a parameter-server job
adds server specs. The rules, in :func:`watch`:

* any process exiting non-zero (or by a signal) is a failure;
* a server (or heter worker) exiting 0 is not a failure by itself (``run_server`` returns once every trainer called
  ``stop_worker``, possibly before the last trainer exits); trainers that lose their servers fail
  on their own and become the root cause;
* all trainers exiting 0 is success; servers and heter workers then get ``server_grace_s`` to
  stop on their own (``fleet.stop_worker`` tells them to) before they are terminated — that is a
  clean stop: the job's result is the trainers'.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from collective.errors import LaunchError
from launcher.heter_spec import HETER
from launcher.process import ConsoleWriter, WorkerProcess, terminate_all, wait_any
from launcher.spec import JobSpec, Mode, SchedulerKind, Tee, WarmStart
from launcher.summary import Failure, lost_a_peer, read_error_file, role_label
from launcher.warm import WarmPool, close_early, keep_early, node_env, take_begun, take_early
from launcher.warm import supported as warm_supported

logger = logging.getLogger(__name__)

TRAINER = "trainer"
SERVER = "server"
SERVING_ROLES = (SERVER, HETER)
"""Roles that serve the trainers (parameter servers, heter workers): started first, and given
``server_grace_s`` to stop once the trainers are done."""


@dataclass(frozen=True)
class ProcSpec:
    """One process of this node in this attempt."""

    role: str
    """``trainer``, ``server`` or ``heter``."""
    rank: int
    """Trainer rank, or server / heter worker index."""
    local_rank: int
    node_rank: int
    env: dict[str, str]
    """The complete environment of the process."""
    log_path: str
    error_file: str
    show: bool
    """Whether its output also goes to the console."""
    prefix: bytes
    """Console prefix (``[rank N] ``) when shown."""
    metrics_port: int = 0
    """Port of its ``/metrics`` endpoint (FLEET_METRICS_PORT in ``env``); 0 = none."""

    @property
    def label(self) -> str:
        return role_label(self.role, self.rank)


@dataclass
class Running:
    """A started :class:`ProcSpec`."""

    spec: ProcSpec
    proc: WorkerProcess


def start_all(
    specs: Sequence[ProcSpec],
    argv: Sequence[str],
    attempt: int,
    console: ConsoleWriter,
    warm: WarmPool | None = None,
) -> list[Running]:
    """Start every spec (servers and heter workers first, so trainers find them sooner); forked
    from ``warm``'s warm process where it can."""
    running: list[Running] = []
    for spec in sorted(specs, key=lambda s: s.role not in SERVING_ROLES):
        if os.path.exists(spec.error_file):
            os.remove(spec.error_file)
        os.makedirs(os.path.dirname(spec.error_file), exist_ok=True)
        header = f"==== fleetrun: attempt {attempt}, {spec.label}, {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n"
        try:
            proc = WorkerProcess(
                argv,
                spec.env,
                spec.log_path,
                console if spec.show else None,
                spec.prefix,
                header,
                append=attempt > 0,
                warm=warm,
            )
        except OSError as err:
            terminate_all([r.proc for r in running], 0.0)
            raise LaunchError(f"could not start {argv[0]!r} for {spec.label}: {err}") from None
        running.append(Running(spec, proc))
    return running


def failure_of(r: Running, attempt: int) -> Failure:
    """The :class:`Failure` record of an exited process (its error file read if it wrote one)."""
    assert r.proc.exit is not None
    parsed = read_error_file(r.spec.error_file)
    return Failure(
        role=r.spec.role,
        rank=r.spec.rank,
        local_rank=r.spec.local_rank,
        node_rank=r.spec.node_rank,
        host=socket.gethostname(),
        pid=r.proc.pid,
        exit_desc=r.proc.exit.describe(),
        time=r.proc.exit.time,
        attempt=attempt,
        log_path=r.proc.log_path,
        error_file=r.spec.error_file if parsed else None,
        message=parsed[0] if parsed else "",
        traceback=parsed[1] if parsed else "",
    )


EXITING_WAIT_S = 2.0
"""How long a node whose failures all read as a lost peer waits for its processes that have
written an error file (they are exiting) before it reports."""
PEER_REPORT_WAIT_S = 2.0
"""How long a node whose first failure reads as a lost peer waits for another node to report a
failure seen before it (the root cause), before reporting its own."""


SEEN_WAIT_S = 5.0
"""How long node 0, whose fleetrun holds the rendezvous store, waits before it ends a failed job
for the other nodes to have read the failure."""


def watch(
    running: Sequence[Running],
    attempt: int,
    tick_s: float,
    remote_check: Callable[[], str | None] | None = None,
    server_grace_s: float = 10.0,
    on_change: Callable[[], None] | None = None,
) -> tuple[list[Failure], str | None]:
    """Block until the attempt ends: ``([], None)`` success, ``(failures, None)`` local failure,
    ``([], text)`` another node's failure (``remote_check``). ``on_change`` is called after
    every wake-up (a process exited, or a tick passed): the job-state file follows exits."""
    procs = [r.proc for r in running]
    trainers = [r for r in running if r.spec.role == TRAINER]
    servers = [r for r in running if r.spec.role in SERVING_ROLES]
    while True:
        wait_any(procs, tick_s)
        if on_change is not None:
            on_change()
        failed = [
            failure_of(r, attempt)
            for r in running
            if r.proc.exit is not None and not r.proc.exit.ok
        ]
        if failed:
            if all(lost_a_peer(f) for f in failed):
                failed += _exiting_failures(running, attempt)
            return failed, None
        if all(r.proc.exit is not None for r in trainers):
            _let_servers_stop(servers, server_grace_s)
            late = [
                failure_of(r, attempt)
                for r in servers
                if r.proc.exit is not None and not r.proc.exit.ok
            ]
            return late, None
        if remote_check is not None:
            remote = remote_check()
            if remote:
                return [], remote


def _exiting_failures(running: Sequence[Running], attempt: int) -> list[Failure]:
    """The failures of the processes still running that have written their error file: they
    are exiting with an error of their own (the bootstrap writes it before the process's
    teardown closes its connections, and that closing is what its peers lost), so they are
    waited for (up to :data:`EXITING_WAIT_S`) and are the root cause
    (:func:`~launcher.summary.root_first`), not the peers that noticed first."""
    exiting = [
        r
        for r in running
        if r.proc.exit is None and r.spec.error_file and os.path.exists(r.spec.error_file)
    ]
    deadline = time.monotonic() + EXITING_WAIT_S
    while any(r.proc.poll() is None for r in exiting) and time.monotonic() < deadline:
        wait_any([r.proc for r in exiting if r.proc.exit is None], deadline - time.monotonic())
    return [
        failure_of(r, attempt) for r in exiting if r.proc.exit is not None and not r.proc.exit.ok
    ]


def _let_servers_stop(servers: Sequence[Running], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    procs = [r.proc for r in servers]
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        wait_any([p for p in procs if p.exit is None], min(0.2, deadline - time.monotonic()))


class Interrupted(Exception):
    """fleetrun itself got SIGINT/SIGTERM/SIGHUP."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def install_signal_handlers() -> None:
    """SIGINT/SIGTERM/SIGHUP raise Interrupted once; later ones are ignored while we tear down
    (teardown is bounded: SIGTERM, grace period, SIGKILL)."""
    fired = False

    def handler(signum: int, _frame: object) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


class Decision(Enum):
    """What a scheduler does after an attempt ended."""

    SUCCEED = "succeed"
    RESTART = "restart"
    FAIL = "fail"


def decide(failed: bool, attempt: int, max_restarts: int) -> Decision:
    """Restart while the job-global budget lasts (attempt N means N restarts used)."""
    if not failed:
        return Decision.SUCCEED
    return Decision.RESTART if attempt < max_restarts else Decision.FAIL


def worker_argv(spec: JobSpec) -> list[str]:
    """The command every process runs (Python scripts go through collective.bootstrap so an
    uncaught exception is written to the error file)."""
    entry = spec.entrypoint
    if entry.module:
        return [sys.executable, "-u", "-m", "collective.bootstrap", "-m", entry.module, *entry.args]
    assert entry.script
    if entry.no_python:
        return [entry.script, *entry.args]
    return [sys.executable, "-u", "-m", "collective.bootstrap", entry.script, *entry.args]


def warm_pool(
    spec: JobSpec, env: dict[str, str], node: str = "0", workers: int = 1
) -> WarmPool | None:
    """The job's warm process on this node when ``warm_start`` is on and the entry point is
    Python (its output in ``log_dir/warmlog.<node>``); None otherwise, or where the platform
    cannot fork workers from one (said once). ``env``: the environment the node's workers share
    (a worker's own is applied when it is forked); ``workers``: how many processes the node's
    first attempt starts."""
    if spec.warm_start is not WarmStart.ON or spec.entrypoint.no_python:
        return None
    ok, why = warm_supported()
    if not ok:
        logger.warning("fleetrun: warm start unavailable, starting workers afresh: %s", why)
        return None
    log_path = os.path.join(spec.log_dir, f"warmlog.{node}")
    early = take_early(log_path)
    if early is not None:
        return early
    return WarmPool(env, log_path, spec.warm_imports, workers=workers)


def start_warm_early(spec: JobSpec) -> None:
    """Start the warm process of a one-node local job now, before fleetrun imports its
    scheduler and sets the job up (about 0.1 s sooner): its ``import torch`` is what the first
    workers wait for; or adopt the one :mod:`launcher.prestart` began before the command line
    was read, when it is exactly the one this job needs. The node's agent takes it over
    (:func:`warm_pool`); one that is never taken is closed by :func:`close_warm_early`. Jobs
    on several nodes, elastic and non-local jobs start theirs as before."""
    began = take_begun()
    if (
        spec.scheduler is not SchedulerKind.LOCAL
        or spec.elastic.enabled
        or spec.num_nodes != 1
        or (spec.entrypoint.script and not os.path.isfile(spec.entrypoint.script))
    ):
        n = 0
    elif spec.mode is Mode.PS:
        n = spec.sizes.server_num + spec.sizes.worker_num + spec.sizes.heter_worker_num
        if spec.ps.servers or spec.ps.workers or spec.ps.heter_workers:
            n = 0  # a static layout: which of them run here is the agent's to say
    else:
        n = spec.sizes.nproc_per_node
    env = base_env(spec, n)
    if began is not None:
        wanted = n and spec.warm_start is WarmStart.ON and not spec.entrypoint.no_python
        if wanted and began.serves(env, spec.warm_imports, n):
            began.attach_log(os.path.join(spec.log_dir, "warmlog.0"))
            keep_early(began)  # until the node's agent asks for it
            return
        began.close()
    if n:
        pool = warm_pool(spec, env, "0", n)
        if pool is not None:
            keep_early(pool)


def close_warm_early() -> None:
    """Close the early warm processes no agent took (the launch stopped before its workers)."""
    close_early()


def base_env(spec: JobSpec, nproc_here: int) -> dict[str, str]:
    """fleetrun's environment plus the job's ``env:``, for a node running ``nproc_here``
    processes (OMP_NUM_THREADS=1 when several share it, unless set)."""
    return node_env(spec.env, nproc_here)


def console_prefix(spec: JobSpec, role: str, rank: int) -> tuple[bool, bytes]:
    """Whether a process's output also goes to the console (``tee``), and its line prefix."""
    tag = f"[rank {rank}] " if role == TRAINER else f"[{role} {rank}] "
    show = spec.tee is Tee.ALL or (spec.tee is Tee.RANK0 and role == TRAINER and rank == 0)
    return show, (tag.encode() if spec.tee is Tee.ALL else b"")


def write_endpoints(
    log_dir: str,
    attempt: int,
    head: str,
    servers: tuple[str, ...] | list[str],
    trainers: tuple[str, ...],
    name: str = "endpoints.log",
    heters: tuple[str, ...] = (),
) -> None:
    """Append the attempt's endpoints to ``log_dir/name`` (node-scoped on several nodes)."""
    with open(os.path.join(log_dir, name), "a" if attempt else "w", encoding="utf-8") as f:
        f.write(f"# attempt {attempt} {head}\n")
        f.writelines(f"server {i} {ep}\n" for i, ep in enumerate(servers))
        f.writelines(f"heter {i} {ep}\n" for i, ep in enumerate(heters))
        f.writelines(f"trainer {i} {ep}\n" for i, ep in enumerate(trainers))
