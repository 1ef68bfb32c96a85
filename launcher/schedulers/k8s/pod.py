"""``fleetrun pod``: the container command of every pod the Kubernetes scheduler renders.

A pod knows only what its manifest gives it: its role, the job's sizes and DNS-name patterns
(arguments rendered by :mod:`launcher.schedulers.k8s.render`) and its index — the Indexed Job's
completion index (FLEET_POD_INDEX from the downward API, or JOB_COMPLETION_INDEX), or for a
StatefulSet the ordinal at the end of the pod name (FLEET_POD_NAME / HOSTNAME). From that it
builds the env contract with :mod:`collective.env` (``make_worker_env`` / ``make_ps_*_env``) —
rank, TRAINING_ROLE, MASTER_ADDR (trainer 0's DNS name), PADDLE_* endpoint lists — and runs the
user's entrypoint like the local agent runs one node (``launcher.attempt.worker_argv``, error
files, the root-cause-first summary on failure, also written to the pod's termination log).

Restarts are Kubernetes' business (the Job's backoffLimit), so a pod runs one attempt; in a PS
job with automatic checkpoints the pod first decides, with the others, what its restart means
(a server or an async/half-async/GEO trainer restarted alone, every pod restarted, or the job
failed with exit 3: the budget and the checkpoint are checked on the volume,
:mod:`launcher.schedulers.k8s.ps_recovery`); a trainer restarted alone gets
FLEET_PS_RESUME_POSITION, and the PS processes' restart count is the generation (the attempt the
trainers' coordinator serves). A StatefulSet restarts any container that exits, even with code
0, so a server that stopped cleanly (the trainers called ``fleet.stop_worker``) holds until its
pod is deleted; so does a heter worker (``--role heter``: its own StatefulSet, restarted alone on
its DNS name when it dies, outside the checkpoint generations).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace

from collective.env import (
    FLEET_PS_COORDINATOR,
    Backend,
    NodeLayout,
    PSLayout,
    make_ps_heter_env,
    make_ps_server_env,
    make_ps_trainer_env,
    make_worker_env,
)
from collective.errors import ConfigError, LaunchError
from launcher.attempt import (
    SERVER,
    TRAINER,
    Interrupted,
    ProcSpec,
    Running,
    failure_of,
    install_signal_handlers,
    start_all,
    warm_pool,
    watch,
    worker_argv,
)
from launcher.heter_spec import HETER
from launcher.process import ConsoleWriter, terminate_all, wait_any
from launcher.schedulers.k8s import ps_recovery
from launcher.spec import Entrypoint, JobSpec, Mode, WarmStart
from launcher.summary import Failure, format_summary

logger = logging.getLogger(__name__)

TERMINATION_LOG = "/dev/termination-log"
"""Kubernetes shows what a container wrote here in the pod's status (terminationMessagePath)."""


@dataclass(frozen=True)
class PodConfig:
    """What ``fleetrun pod`` is told by its manifest (see render.pod_args)."""

    role: str
    """``trainer``, ``server`` or ``heter``."""
    job: str
    """Job name (FLEET_JOB_NAME)."""
    mode: Mode
    """collective or ps."""
    trainer_host: str
    """DNS name of trainer pod ``{index}`` (a ``str.format`` pattern)."""
    master_port: int
    """Trainer 0's rendezvous port (collective endpoints use the ports after it)."""
    trainers: int
    """Trainer pods (collective: nodes)."""
    nproc_per_node: int
    """Trainer processes per pod (collective)."""
    entrypoint: Entrypoint
    """The user's program."""
    server_host: str = ""
    """DNS name of server pod ``{index}`` (PS)."""
    server_port: int = 0
    """Port every server serves on (PS)."""
    servers: int = 0
    """Server pods (PS)."""
    heter_host: str = ""
    """DNS name of heter pod ``{index}`` (heterogeneous PS; they serve on ``server_port``)."""
    heter_port: int = 0
    """Port every heter worker serves on (heterogeneous PS)."""
    heters: int = 0
    """Heter worker pods (heterogeneous PS)."""
    heter_devices: tuple[str, ...] = ()
    """Each heter worker's device, by index."""
    backend: Backend = Backend.AUTO
    log_dir: str = "log"
    run_id: str = "none"
    strategy: str | None = None
    """DistributedStrategy YAML (the ConfigMap mount), given as FLEET_STRATEGY."""
    grace_period_s: float = 5.0
    rdzv_timeout_s: float = 300.0
    """How long to wait for the job's DNS names to resolve."""
    index: int | None = None
    """This pod's index; none = from the environment (see :func:`pod_index`)."""
    warm_start: WarmStart = WarmStart.OFF
    """``on``: a pod running several Python processes forks them from one warm process."""
    warm_imports: tuple[str, ...] = ()
    """Modules the warm process imports after torch and fleet."""

    def __post_init__(self) -> None:
        if self.role not in (TRAINER, SERVER, HETER):
            raise ConfigError(
                f"--role must be trainer, server or heter, got {self.role!r}", key="role"
            )
        if self.role != TRAINER and self.mode is not Mode.PS:
            raise ConfigError(f"--role {self.role} needs --mode ps", key="role")
        if (self.role == HETER or self.heters) and (
            self.heters < 1 or not self.heter_host or not self.heter_port
        ):
            raise ConfigError(
                "heter workers need --heters >= 1, --heter_host and --heter_port", key="heters"
            )
        if self.mode is Mode.PS and (
            self.servers < 1 or not self.server_host or not self.server_port
        ):
            raise ConfigError(
                "--mode ps needs --servers >= 1, --server_host and --server_port", key="servers"
            )
        if self.trainers < 1 or self.nproc_per_node < 1:
            raise ConfigError(
                f"--trainers and --nproc_per_node must be >= 1 (got {self.trainers}, "
                f"{self.nproc_per_node})",
                key="trainers",
            )


def pod_index(environ: dict[str, str] | os._Environ[str], role: str) -> int:
    """This pod's index: FLEET_POD_INDEX, JOB_COMPLETION_INDEX, else the ordinal suffix of the pod
    name (StatefulSet pods are NAME-0, NAME-1, ...)."""
    for var in ("FLEET_POD_INDEX", "JOB_COMPLETION_INDEX"):
        raw = environ.get(var, "")
        if raw:
            if not raw.isdigit():
                raise LaunchError(f"{var}={raw!r} is not a pod index (a whole number >= 0)")
            return int(raw)
    name = environ.get("FLEET_POD_NAME") or environ.get("HOSTNAME") or socket.gethostname()
    head, _, ordinal = name.rpartition("-")
    if not head or not ordinal.isdigit():
        raise LaunchError(
            f"cannot tell this {role} pod's index: no FLEET_POD_INDEX / JOB_COMPLETION_INDEX "
            f"and the pod name {name!r} does not end in -ORDINAL; run it from an Indexed Job "
            "or a StatefulSet"
        )
    return int(ordinal)


def wait_resolvable(hosts: list[str], timeout_s: float) -> None:
    """Block until every host name resolves (headless-Service records appear when pods get IPs)."""
    deadline = time.monotonic() + timeout_s
    for host in hosts:
        while True:
            try:
                socket.getaddrinfo(host, None)
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"{host} did not resolve within {timeout_s:g} s ({err}); is the job's "
                        "headless "
                        "Service there (kubectl get svc) and are its pods scheduled?"
                    ) from None
                time.sleep(1.0)


def _metrics(env: dict[str, str], local_rank: int) -> dict[str, str]:
    """FLEET_METRICS_PORT of local rank r = the pod's port + r. Host: FLEET_METRICS_HOST as the
    pod says (the rendered pods set it to the pod IP), else FLEET_POD_IP (downward API, what
    Prometheus scrapes), else 127.0.0.1 — never every interface."""
    base = os.environ.get("FLEET_METRICS_PORT", "")
    if not base.isdigit() or int(base) == 0:
        return env
    host = os.environ.get("FLEET_METRICS_HOST") or os.environ.get("FLEET_POD_IP") or "127.0.0.1"
    return {**env, "FLEET_METRICS_PORT": str(int(base) + local_rank), "FLEET_METRICS_HOST": host}


def build_proc_specs(cfg: PodConfig, index: int, attempt: int = 0) -> list[ProcSpec]:
    """The processes of this pod, each with its full environment (the env contract); PS
    ``attempt``: the job's generation (a PS job with automatic checkpoints), the trainers'
    restart count, as the local agent's attempt."""
    base = dict(os.environ)
    base.pop("FLEET_METRICS_HOST", None)
    error_dir = os.path.join(cfg.log_dir, "errors", "attempt0")
    trainer_hosts = [cfg.trainer_host.format(index=i) for i in range(cfg.trainers)]
    if cfg.mode is Mode.COLLECTIVE:
        if index >= cfg.trainers:
            raise LaunchError(f"pod index {index} is outside the job's {cfg.trainers} trainer pods")
        nproc = cfg.nproc_per_node
        if nproc > 1 and "OMP_NUM_THREADS" not in base:
            base["OMP_NUM_THREADS"] = "1"
        layout = NodeLayout(
            run_id=cfg.run_id,
            num_nodes=cfg.trainers,
            nproc_per_node=nproc,
            node_rank=index,
            master_addr=trainer_hosts[0],
            master_port=cfg.master_port,
            trainer_endpoints=tuple(
                f"{h}:{cfg.master_port + 1 + r}" for h in trainer_hosts for r in range(nproc)
            ),
            node_ip=trainer_hosts[index],
            restart_count=0,
            max_restarts=0,
            backend=cfg.backend,
            log_dir=cfg.log_dir,
            error_dir=error_dir,
            job_name=cfg.job,
            strategy_file=cfg.strategy,
        )
        out = []
        for r in range(nproc):
            rank = layout.global_rank(r)
            env = _metrics({**base, **make_worker_env(layout, r)}, r)
            out.append(
                ProcSpec(
                    TRAINER,
                    rank,
                    r,
                    index,
                    env,
                    os.path.join(cfg.log_dir, f"workerlog.{rank}"),
                    layout.error_file(r),
                    True,
                    f"[rank {rank}] ".encode() if nproc > 1 else b"",
                )
            )
        return out
    server_hosts = [cfg.server_host.format(index=i) for i in range(cfg.servers)]
    ps_layout = PSLayout(
        run_id=cfg.run_id,
        server_endpoints=tuple(f"{h}:{cfg.server_port}" for h in server_hosts),
        trainer_endpoints=tuple(f"{h}:{cfg.master_port}" for h in trainer_hosts),
        restart_count=attempt,
        max_restarts=0,
        backend=cfg.backend,
        log_dir=cfg.log_dir,
        error_dir=error_dir,
        job_name=cfg.job,
        strategy_file=cfg.strategy,
        heter_endpoints=tuple(f"{h}:{cfg.heter_port}" for h in _heter_hosts(cfg)),
        heter_devices=cfg.heter_devices,
    )
    count = {SERVER: cfg.servers, HETER: cfg.heters}.get(cfg.role, cfg.trainers)
    if index >= count:
        raise LaunchError(f"pod index {index} is outside the job's {count} {cfg.role} pods")
    if cfg.role == HETER:
        env = _metrics({**base, **make_ps_heter_env(ps_layout, index)}, 0)
        return [
            ProcSpec(
                HETER,
                index,
                0,
                0,
                env,
                os.path.join(cfg.log_dir, f"heterlog.{index}"),
                ps_layout.heter_error_file(index),
                True,
                b"",
            )
        ]
    if cfg.role == SERVER:
        env = _metrics({**base, **make_ps_server_env(ps_layout, index)}, 0)
        return [
            ProcSpec(
                SERVER,
                index,
                0,
                0,
                env,
                os.path.join(cfg.log_dir, f"serverlog.{index}"),
                ps_layout.server_error_file(index),
                True,
                b"",
            )
        ]
    env = _metrics({**base, **make_ps_trainer_env(ps_layout, index, 0, 1)}, 0)
    return [
        ProcSpec(
            TRAINER,
            index,
            0,
            0,
            env,
            os.path.join(cfg.log_dir, f"workerlog.{index}"),
            ps_layout.trainer_error_file(index),
            True,
            b"",
        )
    ]


def _heter_hosts(cfg: PodConfig) -> list[str]:
    return [cfg.heter_host.format(index=i) for i in range(cfg.heters)]


def _hosts_needed(cfg: PodConfig, index: int) -> list[str]:
    pattern = {SERVER: cfg.server_host, HETER: cfg.heter_host}.get(cfg.role, cfg.trainer_host)
    hosts = [pattern.format(index=index), cfg.trainer_host.format(index=0)]
    if cfg.mode is Mode.PS and cfg.role in (TRAINER, HETER):
        hosts += [cfg.server_host.format(index=i) for i in range(cfg.servers)]
    if cfg.mode is Mode.PS and cfg.role == TRAINER:
        hosts += _heter_hosts(cfg)
        coordinator = os.environ.get(FLEET_PS_COORDINATOR, "")  # the trainers' coordinator pod
        if coordinator:
            hosts.append(coordinator.rpartition(":")[0])
    return list(dict.fromkeys(hosts))


def _supervise(cfg: PodConfig, running: list[Running]) -> list[Failure]:
    """Wait for this pod's processes; return the failures (trainers: ``watch``'s rules;
    servers: any non-zero exit)."""
    if cfg.role == TRAINER:
        failures, _ = watch(running, 0, 3600.0, None, 0.0)
        return failures
    procs = [r.proc for r in running]
    while any(p.exit is None for p in procs):
        wait_any([p for p in procs if p.exit is None], 3600.0)
        failed = [
            failure_of(r, 0) for r in running if r.proc.exit is not None and not r.proc.exit.ok
        ]
        if failed:
            return failed
    return []


def _hold_until_signal(role: str = SERVER) -> int:
    logger.info(
        "%s stopped cleanly; holding until the pod is deleted (a StatefulSet restarts "
        "exited containers)",
        role,
    )
    try:
        while True:
            signal.pause()
    except Interrupted:
        return 0


def _write_termination_log(text: str) -> None:
    if os.path.exists(TERMINATION_LOG):
        try:
            with open(TERMINATION_LOG, "w", encoding="utf-8") as f:
                f.write(text[-4000:])  # the kubelet keeps at most 4 KiB
        except OSError as err:
            logger.warning("could not write %s: %s", TERMINATION_LOG, err.strerror)


def _refused(reason: str) -> None:
    text = f"fleetrun pod: {reason}"
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    _write_termination_log(text)


def run_pod(cfg: PodConfig) -> int:
    """Run this pod's share of the job; return the container's exit code."""
    index = cfg.index if cfg.index is not None else pod_index(os.environ, cfg.role)
    os.makedirs(cfg.log_dir, exist_ok=True)
    install_signal_handlers()  # as PID 1 we get no default signal actions
    running: list[Running] = []
    generation = None
    warm = None
    try:
        wait_resolvable(_hosts_needed(cfg, index), cfg.rdzv_timeout_s)
        if cfg.mode is Mode.PS and cfg.role != HETER:  # automatic checkpoints: pods restart
            # each other (see the module); a heter pod is restarted alone by its StatefulSet
            generation = ps_recovery.enter(
                cfg.role,
                index,
                cfg.run_id,
                cfg.servers,
                cfg.trainers,
                cfg.rdzv_timeout_s,
                cfg.log_dir,
            )
        specs = build_proc_specs(cfg, index, generation.generation if generation is not None else 0)
        if generation is not None and generation.process_env():  # a pod restarted alone
            specs = [replace(s, env={**s.env, **generation.process_env()}) for s in specs]
        logger.info(
            "pod %s %d of job '%s': %d process(es), %s",
            cfg.role,
            index,
            cfg.job,
            len(specs),
            ", ".join(s.label for s in specs),
        )
        job = JobSpec(
            name=cfg.job,
            entrypoint=cfg.entrypoint,
            log_dir=cfg.log_dir,
            warm_start=cfg.warm_start if len(specs) > 1 else WarmStart.OFF,
            warm_imports=list(cfg.warm_imports),
        )  # one process gains nothing from a warm process: Kubernetes restarts the pod
        warm = warm_pool(job, specs[0].env, f"{cfg.role}{index}", len(specs))
        running = start_all(specs, worker_argv(job), 0, ConsoleWriter(), warm)
        failures = _supervise(cfg, running)
        stopped = [(r.spec.role, r.spec.rank) for r in running if r.proc.exit is None]
    except ps_recovery.RecoveryRefused as err:  # the job cannot recover: it fails
        _refused(str(err))
        return ps_recovery.REFUSED_EXIT
    except Interrupted as sig:
        if generation is not None and generation.refused:  # the job cannot recover (a pod said)
            _refused(generation.refused)
            return ps_recovery.REFUSED_EXIT
        sys.stderr.write(f"fleetrun pod: got {sig}; stopped this pod's processes\n")
        return 128 + sig.signum
    finally:
        if generation is not None:
            generation.close()
        terminate_all([r.proc for r in running], cfg.grace_period_s)
        if warm is not None:
            warm.close()
    if failures:
        text = format_summary(cfg.job, failures, stopped, cfg.log_dir, 0, 0, "")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        _write_termination_log(text)
        return 1
    logger.info("pod %s %d of job '%s' finished", cfg.role, index, cfg.job)
    return _hold_until_signal(cfg.role) if cfg.role in (SERVER, HETER) else 0


__all__ = ["PodConfig", "build_proc_specs", "pod_index", "run_pod"]
