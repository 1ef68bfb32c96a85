"""Proven-dead nodes: liveness probes on real sockets, and dropping a node from torch's real c10d
rendezvous state (two handlers on one TCPStore in this process, bound to 127.0.0.1 port 0)."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import pytest

from launcher.elastic.config import RdzvBackend
from launcher.elastic.liveness import Liveness, LivenessListener, LivenessTracker, probe
from launcher.elastic.rdzv import (
    alone_in_rendezvous,
    drop_dead_nodes,
    heartbeat_window_s,
    last_call,
    make_handler,
    this_node_key,
)


def _closed_port() -> int:
    """A port that just had a listener and has none now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        return int(s.getsockname()[1])


@pytest.mark.timeout(30)
def test_probe_tells_alive_from_gone() -> None:
    listener = LivenessListener("127.0.0.1")
    try:
        for _ in range(3):  # accepted and closed each time, the listener stays
            assert probe("127.0.0.1", listener.port) is Liveness.ALIVE
    finally:
        listener.close()
    assert probe("127.0.0.1", listener.port) is Liveness.DEAD
    assert probe("127.0.0.1", 0) is Liveness.UNKNOWN


@pytest.mark.timeout(30)
def test_a_refusal_proves_death_only_for_a_port_seen_alive() -> None:
    """A port that never accepted (a firewall's reset looks the same) proves nothing."""
    listener = LivenessListener("127.0.0.1")
    tracker = LivenessTracker()
    never = ("never/1", "127.0.0.1", _closed_port())
    alive = ("alive/2", "127.0.0.1", listener.port)
    tracker.check_in_background([alive, never])
    for _ in range(100):
        if tracker.seen():
            break
        threading.Event().wait(0.05)
    assert tracker.seen() == {"alive/2"}
    assert tracker.proven_dead([alive, never]) == []
    listener.close()
    assert tracker.proven_dead([alive, never]) == ["alive/2"]


def _handlers(conf: dict[str, str]) -> tuple[Any, Any]:
    port = _closed_port()
    first = make_handler(RdzvBackend.C10D, f"127.0.0.1:{port}", "liveness", 1, 2, "127.0.0.1", conf)
    second = make_handler(
        RdzvBackend.C10D, f"127.0.0.1:{port}", "liveness", 1, 2, "127.0.0.1", conf
    )
    return first, second


@pytest.mark.timeout(120)
def test_dropped_node_leaves_the_round_before_its_heartbeat_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A and B form a round of 2 (heartbeat window: an hour). A drops B by its key: B is out of
    A's synced state at once, A is alone, and A's next round forms at world 1."""
    conf = {
        "last_call_timeout": "5",
        "keep_alive_interval": "720",
        "keep_alive_max_attempt": "5",
        "join_timeout": "60",
    }
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the agent sets it
    a, b = _handlers(conf)
    try:
        got: dict[str, Any] = {}
        tb = threading.Thread(target=lambda: got.setdefault("b", b.next_rendezvous()))
        tb.start()
        got["a"] = a.next_rendezvous()
        tb.join(60)
        assert got["a"].world_size == got["b"].world_size == 2
        assert not alone_in_rendezvous(a)
        assert heartbeat_window_s(a) == 3600.0
        assert drop_dead_nodes(a, ["nobody_1_0"]) == []
        assert drop_dead_nodes(a, [this_node_key(b)]) == [this_node_key(b)]
        assert alone_in_rendezvous(a)
        timeout = a._settings.timeout
        with last_call(a, 0.001):
            assert timeout.last_call == timedelta(milliseconds=1)
            info = a.next_rendezvous()
        assert timeout.last_call == timedelta(seconds=5)
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        for h in (b, a):
            h.shutdown()


@pytest.mark.timeout(30)
def test_handlers_without_state_are_left_alone() -> None:
    """A handler without torch's dynamic state (etcd v1, or a changed torch): nothing dropped,
    the last call unchanged, no error."""

    class Plain:
        pass

    h = Plain()
    assert drop_dead_nodes(h, ["x_1_0"]) == []
    assert not alone_in_rendezvous(h)
    with last_call(h, 0.001):
        pass
    assert this_node_key(h) == ""
    assert heartbeat_window_s(h) is None
