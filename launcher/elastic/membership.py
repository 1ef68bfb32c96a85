"""Who is in a round of an elastic job, and how a round differs from the one before.

After torch's handler forms a round (group rank, group world size, a store private to the
round), every agent publishes a :class:`NodeRecord` under ``fleet/node/<group rank>`` in that
store and reads all of them: the workers' ``PADDLE_TRAINER_ENDPOINTS`` and ``MASTER_ADDR/PORT``
(group rank 0's) come from there, and :func:`diff` names who left and who joined
(:class:`MembershipChange`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from collective.errors import ConfigError, RendezvousError

NODE_KEY = "fleet/node/{}"


@dataclass(frozen=True)
class NodeRecord:
    """What one agent publishes at the start of a round."""

    node_id: str
    """``host/pid`` of the agent: stable for the agent's life, new for a restarted agent."""
    host: str
    ip: str
    """Address this node's workers are reachable on."""
    nproc: int
    """Workers on this node."""
    ports: tuple[int, ...]
    """One free port per worker (``PADDLE_TRAINER_ENDPOINTS``)."""
    fingerprint: str
    """:func:`launcher.elastic.config.job_fingerprint` of the agent's job."""
    job: str
    """Human form of the job (named when fingerprints differ)."""
    hosts_store: bool = False
    """Whether this agent hosts the c10d rendezvous store."""
    master_port: int = 0
    """Group rank 0 only: the workers' MASTER_PORT on its ``ip``."""
    liveness_port: int = 0
    """The agent's liveness socket on ``ip`` (:mod:`launcher.elastic.liveness`); 0: none."""
    rdzv_node: str = ""
    """The agent in torch's rendezvous state (``addr_pid_localid``); empty for etcd (v1)."""


@dataclass(frozen=True)
class Membership:
    """One formed round, as every agent sees it (records by group rank)."""

    round: int
    """Rounds this agent has joined (0 = the first)."""
    group_rank: int
    nodes: tuple[NodeRecord, ...]

    @property
    def group_world_size(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def me(self) -> NodeRecord:
        return self.nodes[self.group_rank]

    def first_rank(self, group_rank: int) -> int:
        """Global rank of local rank 0 on node ``group_rank``."""
        return sum(n.nproc for n in self.nodes[:group_rank])

    def endpoints(self) -> tuple[str, ...]:
        """``ip:port`` per global rank."""
        return tuple(f"{n.ip}:{p}" for n in self.nodes for p in n.ports)

    def liveness_targets(self) -> list[tuple[str, str, int]]:
        """``(node_id, ip, liveness_port)`` of the other nodes that publish a liveness port."""
        return [
            (n.node_id, n.ip, n.liveness_port)
            for i, n in enumerate(self.nodes)
            if i != self.group_rank and n.liveness_port
        ]

    def store_host(self) -> str | None:
        """``host/pid`` of the agent hosting the c10d store, if it is a member."""
        return next((n.node_id for n in self.nodes if n.hosts_store), None)


@dataclass(frozen=True)
class MembershipChange:
    """How one round differs from the previous one of this agent."""

    round: int
    left: tuple[str, ...]
    """node_ids gone since the previous round."""
    joined: tuple[str, ...]
    """node_ids new since the previous round."""
    old_world_size: int
    new_world_size: int
    cause: str
    """Why the agents re-formed: ``failure`` (spent a restart) or ``join`` (a node waited)."""
    at: float = field(default_factory=time.time)

    def text(self) -> str:
        """``round 2 (failure): left h/12; world 2 -> 1``."""
        parts = []
        if self.left:
            parts.append("left " + ", ".join(self.left))
        if self.joined:
            parts.append("joined " + ", ".join(self.joined))
        who = "; ".join(parts) or "same nodes"
        return f"round {self.round} ({self.cause}): {who}; world {self.old_world_size} -> {self.new_world_size}"


def diff(before: Membership | None, after: Membership, cause: str) -> MembershipChange | None:
    """The change from ``before`` to ``after`` (None for the first round)."""
    if before is None:
        return None
    old = {n.node_id for n in before.nodes}
    new = {n.node_id for n in after.nodes}
    return MembershipChange(
        round=after.round,
        left=tuple(n.node_id for n in before.nodes if n.node_id not in new),
        joined=tuple(n.node_id for n in after.nodes if n.node_id not in old),
        old_world_size=before.world_size,
        new_world_size=after.world_size,
        cause=cause,
    )


def exchange(
    store: Any,
    group_rank: int,
    group_world_size: int,
    mine: NodeRecord,
    timeout_s: float,
    round_no: int,
    where: str,
) -> Membership:
    """Publish ``mine`` in the round's store and read every node's record."""
    try:
        store.set(NODE_KEY.format(group_rank), json.dumps(asdict(mine)))
        keys = [NODE_KEY.format(r) for r in range(group_world_size)]
        store.wait(keys, timedelta(seconds=timeout_s))
        raw = [bytes(store.get(k)).decode() for k in keys]
    except (RuntimeError, TimeoutError, ValueError) as err:
        raise RendezvousError(
            f"round {round_no}: the other agents' records did not arrive in the rendezvous store "
            f"at {where} within {timeout_s:.0f} s ({err}); an agent died while the round formed"
        ) from None
    nodes = []
    for text in raw:
        d = json.loads(text)
        d["ports"] = tuple(d["ports"])
        nodes.append(NodeRecord(**d))
    first = nodes[0]
    for n in nodes:
        if n.fingerprint != first.fingerprint:
            raise ConfigError(
                f"two different jobs share one rendezvous id: agent {n.node_id} runs {n.job!r} "
                f"but agent {first.node_id} runs {first.job!r}; give each job its own --rdzv_id",
                key="run_id",
            )
    return Membership(round_no, group_rank, tuple(nodes))


__all__ = ["Membership", "MembershipChange", "NodeRecord", "diff", "exchange"]
