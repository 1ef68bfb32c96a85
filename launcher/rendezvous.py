"""Static multi-node rendezvous of the fleetrun agents over a torch TCPStore.

Node 0's agent hosts the store on ``master_addr:master_port``; every agent joins it. Per attempt
``a`` (0 = first run, then one per restart) the agents:

1. publish ``a/node/<r>`` = {ip, trainer ports, host} and wait for all nodes (a node that never
   arrives → :class:`RendezvousError` naming the missing node ranks after ``timeout_s``);
2. read ``a/worker_port``: a free port node 0 picked for the workers' own process group (so the
   workers never collide with this store, and each attempt gets a fresh port);
3. while training, watch ``a/failed``: the first node whose worker fails writes it
   (compare-and-set, so the first failure wins) and every node tears down;
4. on success, write ``a/done/<r>`` and wait for all; node 0 keeps the store up until every
   node has acknowledged (``a/exit/<r>``).

The restart budget is node 0's ``max_restarts`` (stored once), so it is global for the job.
torch is imported here only: single-node jobs never load it in the launcher.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from collective.env import find_free_port
from collective.errors import RendezvousError

logger = logging.getLogger(__name__)

POLL_S = 0.2


@dataclass(frozen=True)
class NodeInfo:
    """What one node publishes at the start of an attempt."""

    node_rank: int
    ip: str
    host: str
    ports: tuple[int, ...]


class NodeRendezvous:
    """This node's handle on the job's rendezvous store."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        num_nodes: int,
        node_rank: int,
        timeout_s: float,
        max_restarts: int,
        run_id: str,
    ) -> None:
        from collective.store import make_store  # lazy: only multi-node jobs pay for torch

        self.num_nodes = num_nodes
        self.node_rank = node_rank
        self.timeout_s = timeout_s
        self.where = f"{master_addr}:{master_port}"
        self.master_addr = master_addr
        is_master = node_rank == 0
        try:
            self._store: Any = make_store(master_addr, master_port, is_master, timeout_s)
        except (RuntimeError, OSError) as err:
            if is_master:
                raise RendezvousError(
                    f"node 0 could not open the rendezvous store on {self.where}: {err}. "
                    "Is the port busy? Pick another --master_port."
                ) from None
            raise RendezvousError(
                f"node {node_rank} could not reach the master at {self.where} within "
                f"{timeout_s:.0f} s: {err}. Start node 0 with the same --master_addr/--master_port, "
                "check the address is reachable from this node, or raise rendezvous.timeout_s."
            ) from None
        if is_master:  # node 0's settings are the job's
            self._store.set("max_restarts", str(max_restarts))
            self._store.set("run_id", run_id)
        self.max_restarts = int(self._get("max_restarts"))
        self.run_id = self._get("run_id")

    def _get(self, key: str) -> str:
        try:
            return bytes(self._store.get(key)).decode()
        except RuntimeError as err:
            raise RendezvousError(
                f"lost the rendezvous store at {self.where} while reading {key!r}: {err}"
            ) from None

    def _has(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except RuntimeError as err:
            raise RendezvousError(
                f"lost contact with the master node's store at {self.where}: {err}"
            ) from None

    def _wait_all(self, keys: list[str], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [k for k in keys if not self._has(k)]
            if not missing:
                return
            if time.monotonic() > deadline:
                nodes = ", ".join(k.rsplit("/", 1)[-1] for k in missing)
                raise RendezvousError(
                    f"node(s) {nodes} of {self.num_nodes} never {what} within {timeout_s:.0f} s "
                    f"(rendezvous at {self.where}). Start fleetrun on every node with "
                    f"--nnodes {self.num_nodes}, its own --node_rank and the same --master_addr/"
                    "--master_port, or raise rendezvous.timeout_s."
                )
            time.sleep(POLL_S)

    def join(self, attempt: int, info: NodeInfo) -> tuple[list[NodeInfo], int]:
        """Meet every node for ``attempt``; return all nodes' info (by rank) and the workers'
        MASTER_PORT."""
        prefix = f"{attempt}"
        self._store.set(
            f"{prefix}/node/{info.node_rank}",
            json.dumps({"ip": info.ip, "host": info.host, "ports": list(info.ports)}),
        )
        keys = [f"{prefix}/node/{r}" for r in range(self.num_nodes)]
        self._wait_all(keys, "arrived", self.timeout_s)
        if self.node_rank == 0:
            self._store.set(f"{prefix}/worker_port", str(find_free_port(self.master_addr)))
        self._wait_all([f"{prefix}/worker_port"], "published the worker port", self.timeout_s)
        nodes = []
        for r in range(self.num_nodes):
            d = json.loads(self._get(f"{prefix}/node/{r}"))
            nodes.append(NodeInfo(r, d["ip"], d["host"], tuple(d["ports"])))
        return nodes, int(self._get(f"{prefix}/worker_port"))

    def report_failure(
        self, attempt: int, text: str, when: float | None = None, lost_peer: bool = False
    ) -> None:
        """Tell every node that attempt ``attempt`` failed (the first report wins the key the
        nodes poll); each node's own report, with the time its failure was seen (``when``,
        epoch seconds) and whether it only reads as a lost peer (``lost_peer``), stays under
        its node rank for :meth:`earlier_failure`."""
        record = json.dumps(
            {"node": self.node_rank, "text": text, "time": when, "lost_peer": lost_peer}
        )
        self._store.set(f"{attempt}/failed/{self.node_rank}", record)
        self._store.compare_set(f"{attempt}/failed", "", record)
        self.saw_failure(attempt)

    def saw_failure(self, attempt: int) -> None:
        """Record that this node knows attempt ``attempt`` failed (:meth:`wait_seen`)."""
        self._store.set(f"{attempt}/seen/{self.node_rank}", "1")

    def wait_seen(self, attempt: int, timeout_s: float) -> None:
        """On node 0, whose fleetrun holds the store: before it ends the job, wait (up to
        ``timeout_s``) until every other node has seen attempt ``attempt``'s failure, so that
        they read its report instead of losing the store mid-read."""
        if self.node_rank != 0:
            return
        keys = [f"{attempt}/seen/{r}" for r in range(1, self.num_nodes)]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(self._has(k) for k in keys) and time.monotonic() < deadline:
                time.sleep(0.05)
        except RendezvousError:
            pass  # nothing left to wait for

    def earlier_failure(
        self, attempt: int, when: float, wait_s: float = 0.0, lost_peer: bool = False
    ) -> str | None:
        """Another node's failure of ``attempt`` that is the root cause rather than this node's
        own first failure, seen at ``when``. A failure of its own that is an error of its own
        (``lost_peer`` false) yields only to another node's error of its own seen before it:
        a peer's "connection closed" can be seen before the error that caused it, since a dying
        process closes its connections before it exits. A failure that only reads as a lost
        peer yields to another node's error of its own reported within ``wait_s``, else to
        any failure another node saw before it."""
        deadline = time.monotonic() + wait_s
        while True:
            reports = []
            for r in range(self.num_nodes):
                key = f"{attempt}/failed/{r}"
                if r == self.node_rank or not self._has(key):
                    continue
                d = json.loads(self._get(key))
                seen = d.get("time")
                reports.append(
                    (seen if seen is not None else when, r, d["text"], d.get("lost_peer"))
                )
            causes = [x for x in reports if not x[3] and (lost_peer or x[0] < when)]
            if not causes and lost_peer and time.monotonic() >= deadline:
                causes = [x for x in reports if x[0] < when]
            if causes:
                _, r, text, _ = min(causes)
                return f"node {r} reported: {text}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def remote_failure(self, attempt: int) -> str | None:
        """The failure another node reported for ``attempt``, if any."""
        key = f"{attempt}/failed"
        if not self._has(key):
            return None
        d = json.loads(self._get(key))
        return f"node {d['node']} reported: {d['text']}"

    def finish(self, attempt: int) -> str | None:
        """After local success: wait until every node succeeded (None) or one failed (its text)."""
        self._store.set(f"{attempt}/done/{self.node_rank}", "1")
        deadline = time.monotonic() + max(self.timeout_s, 3600.0)
        keys = [f"{attempt}/done/{r}" for r in range(self.num_nodes)]
        while True:
            failure = self.remote_failure(attempt)
            if failure:
                return failure
            if all(self._has(k) for k in keys):
                break
            if time.monotonic() > deadline:
                raise RendezvousError("other nodes did not finish within the rendezvous deadline")
            time.sleep(POLL_S)
        self._store.set(f"{attempt}/exit/{self.node_rank}", "1")
        if self.node_rank == 0:  # keep the store up until every node has read the result
            try:
                self._wait_all(
                    [f"{attempt}/exit/{r}" for r in range(self.num_nodes)], "exited", 30.0
                )
            except RendezvousError as err:
                logger.warning("%s", err)
        return None
