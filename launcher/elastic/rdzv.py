"""torch's rendezvous handler for this agent, and what we add around it.

We do not write a rendezvous engine: :func:`make_handler` builds
``torch.distributed.elastic.rendezvous.RendezvousParameters`` from the job spec and asks
``registry.get_rendezvous_handler`` for the c10d, etcd or etcd-v2 handler. Around it:

* :func:`probe_endpoint` — an endpoint nobody listens on is named (with ``--rdzv_endpoint`` and
  ``--rdzv_timeout``) instead of torch's generic connection error after 60 s;
* :func:`claim_run_id` — the job's fingerprint (script, args, nproc_per_node) is stored under
  the run id before joining, so a second job that reuses ``--rdzv_id`` by mistake is refused
  before it disturbs the first;
* :func:`hosts_port` — whether this agent hosts the c10d store (torch decides: the first agent
  on the endpoint's host to bind it), so that losing the store can name its host.

* :func:`drop_dead_nodes` — nodes whose agent process is proven gone
  (:mod:`launcher.elastic.liveness`) leave torch's rendezvous state at once instead of after the
  heartbeat window, and :func:`last_call` skips the last-call wait when nobody else is left
  to wait for.

Private attributes of torch's handlers we use (the first two since torch 2.0, all in 2.13):
``_store`` of the dynamic handler and ``_rdzv_impl.client`` of the etcd one, to reach the
job-wide store; ``_state_holder`` (its ``state``, ``mark_dirty()``, ``sync()``),
``_heartbeat_lock``, ``_this_node``, ``_settings`` (its keep-alive values) and
``_settings.timeout._last_call`` of the dynamic handler
(c10d, etcd-v2), and the state's ``last_heartbeats`` / ``participants`` / ``wait_list`` /
``redundancy_list``, to drop proven-dead nodes through torch's own sanitizer and shorten one
round's last call. When torch changes them, :func:`drop_dead_nodes` and :func:`last_call` log
a warning and do nothing: nodes are dropped after the heartbeat window, as before.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

from collective.errors import ConfigError, RendezvousError
from launcher.elastic.config import RdzvBackend

logger = logging.getLogger(__name__)

PROBE_POLL_S = 0.2


def is_local_host(host: str) -> bool:
    """Whether ``host`` is an address of this machine (it could host the c10d store)."""
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def route_ip(host: str) -> str:
    """The local address this machine uses to reach ``host`` (this node's workers' address)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def probe_endpoint(host: str, port: int, timeout_s: float, what: str) -> None:
    """Wait until ``host:port`` accepts TCP connections, or RendezvousError naming it."""
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
                return
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"cannot reach the rendezvous endpoint {host}:{port} ({what}, --rdzv_endpoint) "
                f"within {timeout_s:g} s (--rdzv_timeout): {last}. Start it first "
                f"({'scripts/etcd.sh' if 'etcd' in what else 'the agent on that host hosts it'}), "
                "check the address, or raise --rdzv_timeout"
            )
        time.sleep(PROBE_POLL_S)


def hosts_port(port: int) -> bool:
    """Whether this process holds a listening TCP socket on ``port`` (Linux /proc)."""
    inodes = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path, encoding="ascii") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(cols[9])
        except OSError:
            continue
    if not inodes:
        return False
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def make_handler(
    backend: RdzvBackend,
    endpoint: str,
    run_id: str,
    min_nodes: int,
    max_nodes: int,
    local_addr: str,
    conf: dict[str, str],
) -> Any:
    """torch's handler for ``backend`` (imports torch)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if backend is RdzvBackend.ETCD:
        conf = dict(conf)
        set_etcd_keep_alive(
            conf.pop("keep_alive_interval", None), conf.pop("keep_alive_max_attempt", None)
        )
    params = RendezvousParameters(
        backend=str(backend),
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=local_addr,
        **conf,
    )
    try:
        return get_rendezvous_handler(params)
    except ImportError as err:
        raise ConfigError(
            f"rdzv_backend {backend} needs the python-etcd client (torch's etcd handlers use "
            f"etcd's v2 API): pip install python-etcd ({err})",
            key="elastic.rdzv_backend",
        ) from None
    except Exception as err:  # torch raises RendezvousConnectionError / ValueError / RuntimeError
        raise RendezvousError(
            f"could not open the {backend} rendezvous at {endpoint} (--rdzv_endpoint): "
            f"{type(err).__name__}: {err}{_cause(err)}"
        ) from None


def set_etcd_keep_alive(interval: str | None, attempts: str | None) -> None:
    """Give torch's etcd (v1) handler the c10d handler's liveness rule: a node is dropped after
    ``keep_alive_interval * keep_alive_max_attempt`` seconds without renewing its lease.

    The v1 handler has no such option: each member's keep-alive key lives ``CONST_WORKER_KEEPALIVE_TTL``
    (10 s, a module constant read at each round) and is renewed every half of it, so survivors
    waited 5-10 s for a dead node's key to expire (measured: node loss 12.2 s). The TTL is set on
    the key by its owner, so agents with the default TTL (plain torchrun) still work beside ours."""
    if interval is None and attempts is None:
        return
    from torch.distributed.elastic.rendezvous import etcd_rendezvous

    ttl = float(interval or 5) * int(attempts or 3)
    etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL = max(
        2, round(ttl)
    )  # etcd v2 TTLs are whole seconds


def leave_round(handler: Any, backend: RdzvBackend, group_rank: int | None) -> None:
    """Before this agent re-enters the etcd (v1) rendezvous, delete its own keep-alive key of the
    round it leaves, so the round is seen as dead at once.

    Otherwise torch's handler only stops renewing the key, and every agent re-forming (a node
    joined, or a worker failed) waits for it to expire (the TTL above). The c10d and etcd-v2
    handlers close the round themselves. Best effort: a key already gone is fine."""
    if backend is not RdzvBackend.ETCD or group_rank is None:
        return
    impl = getattr(handler, "_rdzv_impl", None)
    if impl is None:
        return
    try:
        _, state = impl.get_rdzv_state()
        if state.get("status") != "final":
            return
        key = impl.get_path(f"/rdzv/v_{state['version']}/rank_{group_rank}")
        if key not in state.get("keep_alives", ()):
            return
        stop = getattr(impl, "_lease_this_rank_stop", None)
        if stop is not None:
            stop.set()
        impl.client.delete(key)
        logger.info("left etcd rendezvous round %s (deleted %s)", state["version"], key)
    except Exception as err:  # noqa: BLE001 - etcd errors, a state already replaced: torch copes
        logger.debug("leaving the etcd round: %s", err)


EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
DROP_ATTEMPTS = 5
"""Compare-and-set attempts to write the dropped nodes (another agent may write in between)."""
_warned: set[str] = set()


def _warn_once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(
            "torch's rendezvous handler has no %s (torch changed?): dead nodes are dropped "
            "after the heartbeat window only",
            what,
        )


def node_key(node: Any) -> str:
    """``addr_pid_localid`` of one of torch's rendezvous node descriptors (its repr)."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


def this_node_key(handler: Any) -> str:
    """:func:`node_key` of this agent in the dynamic handler; empty for the etcd (v1) one."""
    node = getattr(handler, "_this_node", None)
    return node_key(node) if node is not None else ""


def drop_dead_nodes(handler: Any, keys: Collection[str]) -> list[str]:
    """Remove the nodes named by ``keys`` (:func:`node_key`) from the dynamic handler's shared
    state now; return the keys removed.

    Only for nodes proven dead (their agent's liveness port refused a connection): each one's
    last heartbeat is set to the epoch and the state written back (compare-and-set, retried),
    so torch's sanitizer — ours at this sync, every other agent's at its next — removes it from
    the participants, wait list and redundancy list as if its heartbeats had lapsed."""
    holder = getattr(handler, "_state_holder", None)
    lock = getattr(handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        if getattr(handler, "_rdzv_impl", None) is None:  # not the etcd (v1) handler either
            _warn_once("_state_holder / _heartbeat_lock")
        return []
    wanted = set(keys)
    try:
        with lock:  # the keep-alive thread uses the same holder
            for _ in range(DROP_ATTEMPTS):
                holder.sync()
                beats = holder.state.last_heartbeats
                hits = [n for n in beats if node_key(n) in wanted]
                if not hits:
                    return []
                for n in hits:
                    beats[n] = EPOCH
                holder.mark_dirty()
                if holder.sync():
                    return [node_key(n) for n in hits]
    except AttributeError as err:
        _warn_once(f"rendezvous state as expected ({err})")
    except Exception as err:  # noqa: BLE001 - the store is gone: next_rendezvous names it
        logger.debug("dropping dead nodes from the rendezvous state: %s", err)
    return []


def alone_in_rendezvous(handler: Any) -> bool:
    """Whether the dynamic handler's state (last synced) names no node but this one: no other
    participant, nobody on the wait or redundancy list."""
    holder = getattr(handler, "_state_holder", None)
    me = getattr(handler, "_this_node", None)
    if holder is None or me is None:
        return False
    try:
        state = holder.state
        others = set(state.participants) | set(state.wait_list) | set(state.redundancy_list)
    except AttributeError as err:
        _warn_once(f"rendezvous state as expected ({err})")
        return False
    return not (others - {me})


def heartbeat_window_s(handler: Any) -> float | None:
    """``keep_alive_interval * keep_alive_max_attempt`` of the dynamic handler, in seconds:
    how long a node that stopped answering stays in the rendezvous; None for etcd (v1)."""
    settings = getattr(handler, "_settings", None)
    try:
        window = settings.keep_alive_interval * settings.keep_alive_max_attempt  # type: ignore[union-attr]
        return float(window.total_seconds())
    except (AttributeError, TypeError):
        return None


@contextmanager
def last_call(handler: Any, seconds: float) -> Iterator[None]:
    """For the ``with`` body, the dynamic handler closes a round ``seconds`` after it reached
    MIN nodes (its ``last_call_timeout`` takes whole seconds, and must be positive)."""
    timeout = getattr(getattr(handler, "_settings", None), "timeout", None)
    old = getattr(timeout, "_last_call", None)
    if not isinstance(old, timedelta):
        if getattr(handler, "_rdzv_impl", None) is None:
            _warn_once("_settings.timeout._last_call")
        yield
        return
    timeout._last_call = timedelta(seconds=max(seconds, 0.001))  # type: ignore[union-attr]
    try:
        yield
    finally:
        timeout._last_call = old  # type: ignore[union-attr]


def _cause(err: BaseException) -> str:
    return f" ({err.__cause__})" if err.__cause__ else ""


def job_store(handler: Any, backend: RdzvBackend, run_id: str) -> Any:
    """A store that lives as long as the rendezvous (not one round's): the c10d / etcd-v2
    handler's own store, or an EtcdStore on the etcd handler's client."""
    store = getattr(handler, "_store", None)
    if store is not None:
        return store
    if backend is RdzvBackend.ETCD:
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        return EtcdStore(handler._rdzv_impl.client, f"/fleetrun/run_{run_id}")
    raise RendezvousError(f"torch's {backend} handler has no store we can reach (torch changed?)")


def claim_run_id(store: Any, run_id: str, fingerprint: str, job: str) -> None:
    """Store this job's fingerprint under ``run_id`` (first agent wins); ConfigError naming
    ``--rdzv_id`` when another job holds it."""
    key, job_key = f"fleetrun/{run_id}/fingerprint", f"fleetrun/{run_id}/job"
    try:
        if type(store).__name__ != "EtcdStore":  # EtcdStore has no compare_set
            held = bytes(store.compare_set(key, "", fingerprint)).decode()
            if held == fingerprint:
                store.set(job_key, job)
        elif store.check([key]):
            held = bytes(store.get(key)).decode()
        else:
            store.set(key, fingerprint)
            store.set(job_key, job)
            held = fingerprint
        other = bytes(store.get(job_key)).decode() if held != fingerprint else ""
    except (RuntimeError, ValueError, TimeoutError) as err:
        raise RendezvousError(
            f"could not read the rendezvous store for run id {run_id!r}: {err}"
        ) from None
    if held != fingerprint:
        raise ConfigError(
            f"rendezvous id {run_id!r} is taken by another job ({other}); this agent runs {job}. "
            "Two jobs must not share one --rdzv_id: pick another --rdzv_id (--job_id), or run "
            "the same script, arguments and --nproc_per_node as that job (an id kept in etcd "
            "stays taken after its job ended)",
            key="run_id",
        )


__all__ = [
    "alone_in_rendezvous",
    "claim_run_id",
    "drop_dead_nodes",
    "heartbeat_window_s",
    "hosts_port",
    "is_local_host",
    "job_store",
    "last_call",
    "leave_round",
    "make_handler",
    "node_key",
    "probe_endpoint",
    "route_ip",
    "set_etcd_keep_alive",
    "this_node_key",
]
