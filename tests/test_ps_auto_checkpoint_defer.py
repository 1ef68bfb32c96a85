"""An automatic checkpoint epoch that opens while the previous checkpoint is still being written
is deferred: the leader takes no snapshot and nobody waits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from collective.env import PSCheckpointEnv
from fleet.ps.auto_checkpoint import AutoCheckpointer
from ps_server.rpc.checkpoint_client import PendingCheckpoint
from ps_server.rpc.proto import ps_pb2

pytestmark = pytest.mark.timeout(30)


def _pending(step: int) -> PendingCheckpoint:
    """A checkpoint whose snapshot was taken and whose commit has not run yet (phase 2 runs
    only when ``result()`` is called: ``background=False``)."""
    reply = ps_pb2.CheckpointBeginResponse(snapshot_s=0.01, snapshot_bytes=1)
    return PendingCheckpoint(None, "/ckpt", f"ckpt-{step}", step, None, [reply], 5.0, False)


def test_an_epoch_during_the_previous_write_is_deferred() -> None:
    auto = AutoCheckpointer(PSCheckpointEnv(dir="/ckpt", interval_s=0.5), rank=0, log_dir=None)
    pending = _pending(40)
    auto._pending_step = 40
    st = SimpleNamespace(pending_checkpoint=pending)
    info = auto._snapshot(st, 80, {0: {"step": 80}}, last_step=40)
    assert info == {"deferred": 40}  # no snapshot taken, no step: the coordinator keeps 40
    assert st.pending_checkpoint is pending and not pending.done()  # still the servers' to finish
