"""Pure planning for the Ray scheduler: bundles, and the env contract from where actors landed.

No ray import, no processes: unit-tested with made-up placements.

* :func:`make_slots` — one :class:`Slot` per process of the job (PS: servers, heter workers,
  then trainers; collective: trainers), each with its placement-group bundle
  (:func:`make_bundle`; a heter worker's asks for the GPUs its device needs, none for cpu).
* :func:`make_proc_specs` — once the actors run and report their node (:class:`Placed`), the
  :class:`launcher.attempt.ProcSpec` of every process, with exactly the env of the local
  scheduler built by ``collective.env`` (``NodeLayout``/``make_worker_env`` or
  ``PSLayout``/``make_ps_*_env``). Trainers are numbered node by node (the node of bundle 0
  first), so ``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK`` holds as under torchrun; when
  the nodes hold different numbers of trainers no such layout exists, and every trainer is its
  own node of one (LOCAL_RANK 0, each actor seeing only its own GPUs) — logged as a warning.
  With GPUs, the trainers of a node all see the node's GPUs of the job (``CUDA_VISIBLE_DEVICES``
  = their Ray GPU ids in local-rank order), so ``cuda:LOCAL_RANK`` is the rank's own GPU.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from collective.env import (
    FLEET_PS_TABLE_THREADS,
    NodeLayout,
    PSLayout,
    make_ps_heter_env,
    make_ps_server_env,
    make_ps_trainer_env,
    make_worker_env,
)
from collective.errors import ConfigError
from launcher.attempt import SERVER, TRAINER, ProcSpec, console_prefix
from launcher.heter_spec import HETER, device_gpus, heter_devices
from launcher.ps_env import (
    FLEET_PS_TOKEN,
    ps_checkpoint_root_env,
    ps_cpu_share_env,
    ps_ssd_root_env,
)
from launcher.spec import JobSpec, Mode, RoleResources

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(Ki|Mi|Gi|Ti|k|M|G|T)?\s*$")


def parse_memory(value: str, key: str) -> int:
    """Bytes of a Kubernetes memory quantity (``512Mi``, ``2Gi``, ``1G``, ``1048576``)."""
    m = _QUANTITY.match(str(value))
    if not m:
        raise ConfigError(f"{value!r} is not a memory quantity; use e.g. 512Mi, 2Gi or 1G", key=key)
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def make_bundle(res: RoleResources, key: str) -> dict[str, float]:
    """Placement-group bundle of one process: ``{"CPU": .., "memory": bytes[, "GPU": ..]}``."""
    bundle = {"CPU": float(res.cpu), "memory": float(parse_memory(res.memory, f"{key}.memory"))}
    if res.gpu:
        bundle["GPU"] = float(res.gpu)
    return bundle


@dataclass(frozen=True)
class Slot:
    """One process of the job and its bundle (index = bundle index = actor index)."""

    role: str
    """``trainer``, ``server`` or ``heter``."""
    index: int
    """Trainer number in bundle order (the final rank may differ, see module doc), or server index."""
    bundle: dict[str, float]


def make_slots(spec: JobSpec) -> list[Slot]:
    """Every process of the job in bundle order (PS: servers first)."""
    trainer = make_bundle(spec.resources.trainer, "resources.trainer")
    if spec.mode is Mode.PS:
        if spec.ps.servers:
            raise ConfigError(
                "static ps.servers/ps.workers lists pin processes to IPs; on Ray the placement group "
                "places them: use sizes.server_num and sizes.worker_num",
                key="ps.servers",
            )
        server = make_bundle(spec.resources.server, "resources.server")
        return [
            *(Slot(SERVER, i, dict(server)) for i in range(spec.sizes.server_num)),
            *(Slot(HETER, i, b) for i, b in enumerate(heter_bundles(spec))),
            *(Slot(TRAINER, i, dict(trainer)) for i in range(spec.sizes.worker_num)),
        ]
    if spec.rendezvous.ips or spec.rendezvous.node_rank is not None:
        raise ConfigError(
            "rendezvous.ips / node_rank describe hand-started nodes; on Ray the "
            "placement group picks the nodes: drop them",
            key="rendezvous",
        )
    return [Slot(TRAINER, i, dict(trainer)) for i in range(spec.world_size)]


def heter_bundles(spec: JobSpec) -> list[dict[str, float]]:
    """One bundle per heter worker: ``resources.heter``, with the GPUs its device needs
    (``num_gpus`` 1 for ``cuda``, N+1 for ``cuda:N``; none for cpu)."""
    out = []
    for device in heter_devices(spec):
        bundle = make_bundle(spec.resources.heter, "resources.heter")
        bundle.pop("GPU", None)
        gpus = device_gpus(device) and max(device_gpus(device), spec.resources.heter.gpu)
        if gpus:
            bundle["GPU"] = float(gpus)
        out.append(bundle)
    return out


@dataclass(frozen=True)
class Placed:
    """Where the actor of a slot runs, and the free ports it found on its node."""

    slot: Slot
    node_ip: str
    node_id: str
    gpu_ids: tuple[str, ...]
    port: int
    """Its endpoint port (PADDLE_CURRENT_ENDPOINT / PADDLE_PORT)."""


@dataclass(frozen=True)
class AttemptPaths:
    """Per-attempt inputs common to every process."""

    run_id: str
    attempt: int
    max_restarts: int
    log_dir: str
    """Absolute log directory on the driver (logs are written there by the driver)."""
    strategy_file: str | None
    ps_token: str = ""
    """The PS job's token (FLEET_PS_TOKEN of every server and trainer; made once per job)."""
    cwd: str = "."
    """The processes' working directory (the driver's, or ``.`` under a runtime_env
    working_dir): the first checkpoint root of the servers."""


def _error_dir(paths: AttemptPaths) -> str:
    return os.path.join(paths.log_dir, "errors", f"attempt{paths.attempt}")


def _base_env(spec: JobSpec, local_count: int) -> dict[str, str]:
    env = dict(spec.env)
    if local_count > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = (
            "1"  # as torchrun: N processes of a node must not each take all cores
        )
    return env


def _table_threads_env(env: dict[str, str], bundle: dict[str, float]) -> dict[str, str]:
    """A server's FLEET_PS_TABLE_THREADS: the CPUs of its bundle (what Ray reserved for it; at
    least 1), unless the job's env sets it."""
    if FLEET_PS_TABLE_THREADS in env:
        return {}
    return {FLEET_PS_TABLE_THREADS: str(max(1, int(bundle["CPU"])))}


def _by_node(placed: Sequence[Placed]) -> dict[str, list[Placed]]:
    """Node id -> its placed slots, nodes in order of first appearance (dicts keep order)."""
    nodes: dict[str, list[Placed]] = {}
    for p in placed:
        nodes.setdefault(p.node_id, []).append(p)
    return nodes


def _gpu_env(members: Sequence[Placed]) -> dict[str, str]:
    ids = [g for p in members for g in p.gpu_ids]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)} if ids else {}


def _spec(
    spec: JobSpec,
    role: str,
    rank: int,
    local_rank: int,
    node_rank: int,
    env: dict[str, str],
    paths: AttemptPaths,
    error_file: str,
) -> ProcSpec:
    show, prefix = console_prefix(spec, role, rank)
    name = {TRAINER: "workerlog", HETER: "heterlog"}.get(role, "serverlog") + f".{rank}"
    return ProcSpec(
        role,
        rank,
        local_rank,
        node_rank,
        env,
        os.path.join(paths.log_dir, name),
        error_file,
        show,
        prefix,
    )


def make_proc_specs(
    spec: JobSpec, placed: Sequence[Placed], master_port: int, paths: AttemptPaths
) -> tuple[list[ProcSpec], str]:
    """``(one ProcSpec per placed slot, in the order of placed; the endpoints.log header)``."""
    if spec.mode is Mode.PS:
        return _ps_specs(spec, placed, paths)
    return _collective_specs(spec, placed, master_port, paths)


def _collective_specs(
    spec: JobSpec, placed: Sequence[Placed], master_port: int, paths: AttemptPaths
) -> tuple[list[ProcSpec], str]:
    nodes = _by_node(placed)
    counts = {len(m) for m in nodes.values()}
    uniform = len(counts) == 1
    if not uniform:
        logger.warning(
            "the placement group put %s trainers on its %d nodes (uneven): every trainer gets "
            "LOCAL_RANK 0 / LOCAL_WORLD_SIZE 1 and only its own GPUs; use STRICT_SPREAD or "
            "STRICT_PACK for a torchrun-like layout",
            "/".join(str(len(m)) for m in nodes.values()),
            len(nodes),
        )
    ordered = [p for members in nodes.values() for p in members]  # ranks node by node
    endpoints = tuple(f"{p.node_ip}:{p.port}" for p in ordered)
    master_addr = ordered[0].node_ip
    nproc = counts.pop() if uniform else 1
    num_nodes = len(nodes) if uniform else len(ordered)
    rank_of = {id(p): r for r, p in enumerate(ordered)}
    out: dict[int, ProcSpec] = {}
    for node_rank_u, members in enumerate(nodes.values()):
        for local_u, p in enumerate(members):
            rank = rank_of[id(p)]
            node_rank, local_rank = (node_rank_u, local_u) if uniform else (rank, 0)
            layout = NodeLayout(
                run_id=paths.run_id,
                num_nodes=num_nodes,
                nproc_per_node=nproc,
                node_rank=node_rank,
                master_addr=master_addr,
                master_port=master_port,
                trainer_endpoints=endpoints,
                node_ip=p.node_ip,
                restart_count=paths.attempt,
                max_restarts=paths.max_restarts,
                backend=spec.backend,
                log_dir=paths.log_dir,
                error_dir=_error_dir(paths),
                job_name=spec.name,
                strategy_file=paths.strategy_file,
            )
            env = {
                **_base_env(spec, len(members)),
                **(_gpu_env(members) if uniform else {}),
                **make_worker_env(layout, local_rank),
            }
            out[id(p)] = _spec(
                spec,
                TRAINER,
                rank,
                local_rank,
                node_rank,
                env,
                paths,
                layout.error_file(local_rank),
            )
    head = f"run_id {paths.run_id} master {master_addr}:{master_port} (ray)"
    return [out[id(p)] for p in placed], head


def _ps_specs(
    spec: JobSpec, placed: Sequence[Placed], paths: AttemptPaths
) -> tuple[list[ProcSpec], str]:
    servers = [p for p in placed if p.slot.role == SERVER]
    trainers = [p for p in placed if p.slot.role == TRAINER]
    heters = [p for p in placed if p.slot.role == HETER]
    layout = PSLayout(
        run_id=paths.run_id,
        server_endpoints=tuple(f"{p.node_ip}:{p.port}" for p in servers),
        trainer_endpoints=tuple(f"{p.node_ip}:{p.port}" for p in trainers),
        restart_count=paths.attempt,
        max_restarts=paths.max_restarts,
        backend=spec.backend,
        log_dir=paths.log_dir,
        error_dir=_error_dir(paths),
        job_name=spec.name,
        strategy_file=paths.strategy_file,
        heter_endpoints=tuple(f"{p.node_ip}:{p.port}" for p in heters),
        heter_devices=heter_devices(spec),
    )
    per_node = _by_node(placed)
    trainers_on = {
        node: [p for p in members if p.slot.role == TRAINER] for node, members in per_node.items()
    }
    node_rank = {node: i for i, node in enumerate(per_node)}
    servers_on = {
        node: [p.slot.index for p in members if p.slot.role == SERVER]
        for node, members in per_node.items()
    }
    out = []
    for p in placed:
        base = _base_env(spec, len(per_node[p.node_id]))
        if paths.ps_token:
            base[FLEET_PS_TOKEN] = paths.ps_token
        if p.slot.role == SERVER:
            i = p.slot.index
            env = {
                **base,
                **_table_threads_env(base, p.slot.bundle),
                **ps_checkpoint_root_env(base, paths.log_dir, paths.cwd),
                **ps_ssd_root_env(spec, i),
                **ps_cpu_share_env(
                    spec, servers_on[p.node_id].index(i), len(servers_on[p.node_id])
                ),
                **make_ps_server_env(layout, i),
            }
            out.append(
                _spec(
                    spec,
                    SERVER,
                    i,
                    i,
                    node_rank[p.node_id],
                    env,
                    paths,
                    layout.server_error_file(i),
                )
            )
        elif p.slot.role == HETER:
            i = p.slot.index
            env = {**base, **_gpu_env([p]), **make_ps_heter_env(layout, i)}
            out.append(
                _spec(
                    spec, HETER, i, 0, node_rank[p.node_id], env, paths, layout.heter_error_file(i)
                )
            )
        else:
            t = p.slot.index
            mates = trainers_on[p.node_id]
            local = mates.index(p)
            env = {**base, **_gpu_env(mates), **make_ps_trainer_env(layout, t, local, len(mates))}
            out.append(
                _spec(
                    spec,
                    TRAINER,
                    t,
                    local,
                    node_rank[p.node_id],
                    env,
                    paths,
                    layout.trainer_error_file(t),
                )
            )
    return out, f"run_id {paths.run_id} (ray)"
