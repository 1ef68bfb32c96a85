"""Elastic collective jobs on Ray (``--scheduler ray --nnodes MIN:MAX``): the Ray driver forms
each round itself, from the actors it can place.

No torch rendezvous on Ray: the driver already sees every actor, so it is the rendezvous. Each
round (an attempt of :class:`launcher.schedulers.ray.job.RayJob`):

1. :func:`place_round` asks for a placement group of ``MAX`` nodes' bundles (``nproc_per_node``
   trainer bundles per node), and when the cluster cannot place it within
   :data:`PLACE_PROBE_S`, one node fewer, down to ``MIN`` (which waits the whole
   ``ray.placement_timeout_s``); the round's world size is what was placed.
2. The round runs with the env contract of that world size (``TORCHELASTIC_RESTART_COUNT`` =
   the round); the script resumes from its checkpoint (``fleet.elastic.Checkpointer``).
3. While fewer than ``MAX`` nodes run, a *growth probe* — a placement group of one more node's
   bundles — waits in Ray's queue (:func:`arm_growth_probe`); once Ray places it (resources
   returned: a node joined, another job ended) the round ends and the next one forms bigger. This
   spends no restart.
4. A failure — a process that exits non-zero, or an actor or its node lost — ends the round as
   for a fixed job and spends one restart (``max_restarts``), as torchrun does when a node is lost;
   the next round forms with what can still be placed (``MIN`` .. ``MAX``).

The console and ``job_state.json`` list each membership change (``round 2 (failure): left rank 1
(Ray actor died); world 2 -> 1``). Rendezvous flags (``--rdzv_backend``, ``--rdzv_endpoint``) are
not used on Ray: give ``--nnodes MIN:MAX --standalone``.
"""

from __future__ import annotations

import logging
from typing import Any

from collective.errors import LaunchError
from launcher.attempt import TRAINER
from launcher.schedulers.ray.plan import Slot, make_bundle
from launcher.spec import JobSpec

logger = logging.getLogger(__name__)

PLACE_PROBE_S = 5.0
"""How long a round waits for a placement group bigger than MIN before trying one node fewer."""


def _slots(spec: JobSpec, nodes: int) -> list[Slot]:
    bundle = make_bundle(spec.resources.trainer, "resources.trainer")
    return [Slot(TRAINER, i, dict(bundle)) for i in range(nodes * spec.sizes.nproc_per_node)]


def _remove(pg: Any) -> None:
    from ray.exceptions import RayError
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except (RayError, ValueError):
        pass


def place_round(ray: Any, spec: JobSpec, run_id: str, attempt: int) -> tuple[Any, list[Slot]]:
    """The round's placement group (ready) and its slots: as many nodes as the cluster places,
    from MAX down to MIN; LaunchError when not even MIN fit."""
    from ray.util.placement_group import placement_group

    e = spec.elastic
    assert e.min_nodes is not None and e.max_nodes is not None
    for nodes in range(e.max_nodes, e.min_nodes - 1, -1):
        slots = _slots(spec, nodes)
        pg = placement_group(
            [s.bundle for s in slots],
            strategy=str(spec.ray.placement_strategy),
            name=f"fleetrun-{spec.name}-{run_id}-{attempt}",
        )
        wait_s = spec.ray.placement_timeout_s if nodes == e.min_nodes else PLACE_PROBE_S
        ready, _ = ray.wait([pg.ready()], timeout=wait_s)
        if ready:
            return pg, slots
        _remove(pg)
        logger.info(
            "round %d: %d node(s) of %d trainer(s) cannot be placed now; trying %d",
            attempt,
            nodes,
            spec.sizes.nproc_per_node,
            nodes - 1,
        )
    bundle = make_bundle(spec.resources.trainer, "resources.trainer")
    raise LaunchError(
        f"the Ray cluster could not place even MIN={e.min_nodes} node(s) of "
        f"{spec.sizes.nproc_per_node} trainer bundle(s) ({bundle}) within "
        f"{spec.ray.placement_timeout_s:g} s (ray.placement_timeout_s); available: "
        f"{ray.available_resources()}. Lower MIN in --nnodes MIN:MAX or resources.trainer, or "
        "add nodes"
    )


def arm_growth_probe(
    ray: Any, spec: JobSpec, run_id: str, attempt: int, nodes: int
) -> tuple[Any, Any] | None:
    """``(placement group, its ready ref)`` for one more node's bundles, queued in Ray until it
    fits; None when the round already has MAX nodes."""
    from ray.util.placement_group import placement_group

    if nodes >= int(spec.elastic.max_nodes or nodes):
        return None
    pg = placement_group(
        [s.bundle for s in _slots(spec, 1)],
        strategy="PACK",
        name=f"fleetrun-{spec.name}-{run_id}-{attempt}-growth",
    )
    return pg, pg.ready()


def probe_placed(ray: Any, probe: tuple[Any, Any] | None) -> bool:
    """Whether the growth probe was placed (more resources than the round uses are there)."""
    if probe is None:
        return False
    ready, _ = ray.wait([probe[1]], timeout=0)
    return bool(ready)


def disarm_growth_probe(probe: tuple[Any, Any] | None) -> None:
    """Remove the probe's placement group (its resources go to the next round)."""
    if probe is not None:
        _remove(probe[0])


def change_text(round_no: int, cause: str, left: list[str], old: int, new: int) -> str:
    """``round 2 (failure): left rank 1 (Ray actor died); world 2 -> 1``, as the elastic agent
    words its membership changes."""
    who = ("left " + ", ".join(left)) if left else ("joined" if new > old else "same nodes")
    return f"round {round_no} ({cause}): {who}; world {old} -> {new}"


__all__ = [
    "PLACE_PROBE_S",
    "arm_growth_probe",
    "change_text",
    "disarm_growth_probe",
    "place_round",
    "probe_placed",
]
