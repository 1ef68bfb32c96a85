"""Fixture worker: every op of the ``collective`` communication API, checked against expected values.

Started by tests/test_collective_ops.py through ``run_workers`` (env contract, gloo). One run checks
all ops so torch is imported once per rank. Prints ``rank R: OK <check>`` per check and
``rank R: ALL OK`` at the end; a wrong value fails with an AssertionError naming the check, rank
and values.

Usage: ``collective_ops.py SCRATCH_DIR``
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

import collective as dist
from collective.comm import REDUCE_OP_NAMES
from collective.errors import ConfigError

RANK = 0
WORLD = 1


def ok(check: str) -> None:
    print(f"rank {RANK}: OK {check}", flush=True)


def expect(check: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want), (
        f"{check} on rank {RANK} of {WORLD}: got {got.tolist()} ({got.dtype}), "
        f"expected {want.tolist()} ({want.dtype})"
    )


def mine() -> torch.Tensor:
    """This rank's input: [r+1, 2(r+1)] as float32."""
    return torch.tensor([RANK + 1.0, 2.0 * (RANK + 1)])


def check_broadcast() -> None:
    src = WORLD - 1  # a non-zero global source
    t = torch.full((3,), float(RANK))
    dist.broadcast(t, src=src)
    expect("broadcast", t, torch.full((3,), float(src)))
    t = torch.full((3,), float(RANK))
    dist.wait(dist.broadcast(t, src=0, sync_op=False))
    expect("broadcast sync_op=False", t, torch.zeros(3))
    ok("broadcast")


def check_all_reduce() -> None:
    ranks = [r + 1.0 for r in range(WORLD)]
    base = torch.tensor([1.0, 2.0])
    want = {
        dist.ReduceOp.SUM: base * sum(ranks),
        dist.ReduceOp.MAX: base * max(ranks),
        dist.ReduceOp.MIN: base * min(ranks),
        dist.ReduceOp.PROD: torch.tensor([math.prod(ranks), math.prod(2 * r for r in ranks)]),
        dist.ReduceOp.AVG: base * (sum(ranks) / WORLD),
    }
    for op, expected in want.items():
        name = REDUCE_OP_NAMES[op]
        t = mine()
        dist.all_reduce(t, op=op)
        expect(f"all_reduce {name}", t, expected)
        t = mine()
        task = dist.all_reduce(t, op=op, sync_op=False)
        task.wait()
        expect(f"all_reduce {name} sync_op=False", t, expected)
        ok(f"all_reduce {name}")
    # AVG of integers truncates (as NCCL does); torch's own op constants are accepted too.
    t = torch.tensor([RANK + 1, 10 * (RANK + 1)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    total = sum(range(1, WORLD + 1))
    expect("all_reduce AVG int64", t, torch.tensor([total // WORLD, 10 * total // WORLD]))
    t = mine()
    dist.all_reduce(t, op=tdist.ReduceOp.SUM)
    expect("all_reduce torch ReduceOp.SUM", t, base * sum(ranks))
    ok("all_reduce int AVG and torch op")


def check_reduce() -> None:
    dst = WORLD - 1
    total = float(sum(range(1, WORLD + 1)))
    t = mine()
    dist.reduce(t, dst=dst, op=dist.ReduceOp.SUM)
    if RANK == dst:
        expect("reduce SUM", t, torch.tensor([total, 2 * total]))
    t = mine()
    dist.reduce(t, dst=dst, op=dist.ReduceOp.AVG)
    if RANK == dst:
        expect("reduce AVG", t, torch.tensor([total / WORLD, 2 * total / WORLD]))
    t = mine()
    dist.wait(dist.reduce(t, dst=0, op=dist.ReduceOp.MAX, sync_op=False))
    if RANK == 0:
        expect("reduce MAX sync_op=False", t, torch.tensor([WORLD * 1.0, WORLD * 2.0]))
    ok("reduce")


def check_all_gather() -> None:
    want = [torch.tensor([r + 1.0, 2.0 * (r + 1)]) for r in range(WORLD)]
    out: list[torch.Tensor] = []
    dist.all_gather(out, mine())
    assert len(out) == WORLD, f"all_gather into [] gave {len(out)} tensors, expected {WORLD}"
    for r, (got, w) in enumerate(zip(out, want)):
        expect(f"all_gather (empty list) slot {r}", got, w)
    out = [torch.empty(2) for _ in range(WORLD)]
    dist.wait(dist.all_gather(out, mine(), sync_op=False))
    for r, (got, w) in enumerate(zip(out, want)):
        expect(f"all_gather sync_op=False slot {r}", got, w)
    try:
        dist.all_gather([torch.empty(2)] * (WORLD + 1), mine())
    except ConfigError as exc:
        assert "tensor_list" in str(exc) and str(WORLD + 1) in str(exc), str(exc)
    else:
        raise AssertionError("all_gather with a wrong-length tensor_list did not raise")
    ok("all_gather")


def check_all_gather_object() -> None:
    want = [{"rank": r, "name": "x" * r} for r in range(WORLD)]
    out: list[object] = []
    dist.all_gather_object(out, {"rank": RANK, "name": "x" * RANK})
    assert out == want, f"all_gather_object into [] on rank {RANK}: got {out}, expected {want}"
    out = [None] * WORLD
    dist.all_gather_object(out, ("t", RANK))
    assert out == [("t", r) for r in range(WORLD)], f"all_gather_object on rank {RANK}: {out}"
    ok("all_gather_object")


def check_scatter() -> None:
    src = 1
    parts = [torch.full((2,), 10.0 * r) for r in range(WORLD)]
    t = torch.empty(2)
    # Paddle lets every rank pass tensor_list; off the source it is ignored.
    dist.scatter(t, parts if RANK in (src, 0) else None, src=src)
    expect("scatter", t, torch.full((2,), 10.0 * RANK))
    t = torch.empty(2)
    dist.wait(dist.scatter(t, parts, src=0, sync_op=False))
    expect("scatter sync_op=False", t, torch.full((2,), 10.0 * RANK))
    if RANK == src:
        try:
            dist.scatter(t, parts[:-1], src=src)
        except ConfigError as exc:
            assert "tensor_list" in str(exc) and f"{WORLD - 1} tensors" in str(exc), str(exc)
        else:
            raise AssertionError("scatter with a short tensor_list did not raise on the source")
    ok("scatter")


def check_barrier(scratch: Path) -> None:
    (scratch / f"before_barrier.{RANK}").write_text("x")
    dist.barrier()
    missing = [r for r in range(WORLD) if not (scratch / f"before_barrier.{r}").exists()]
    assert not missing, f"barrier on rank {RANK} returned before ranks {missing} arrived"
    dist.barrier()  # nobody leaves (and the test cleans up) while others still check
    ok("barrier")


def check_send_recv() -> None:
    last = WORLD - 1
    if RANK == 0:
        dist.send(torch.tensor([7.0, 8.0]), dst=last)
        back = torch.empty(2)
        dist.recv(back, src=last)
        expect("send/recv reply", back, torch.tensor([8.0, 9.0]))
    elif RANK == last:
        got = torch.empty(2)
        dist.recv(got, src=0)
        expect("send/recv", got, torch.tensor([7.0, 8.0]))
        dist.wait(dist.send(got + 1, dst=0, sync_op=False))
    ok("send/recv")


def check_isend_irecv() -> None:
    nxt, prev = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    out = torch.full((4,), float(RANK))
    got = torch.empty(4)
    send_task = dist.isend(out, dst=nxt)
    recv_task = dist.irecv(got, src=prev)
    recv_task.wait()
    dist.wait(send_task)
    expect("isend/irecv ring", got, torch.full((4,), float(prev)))
    ok("isend/irecv")


def check_new_group() -> None:
    pair = dist.new_group([0, 1])  # every rank calls new_group, as with torch
    if RANK in (0, 1):
        t = mine()
        dist.all_reduce(t, group=pair)
        expect("all_reduce in new_group([0, 1])", t, torch.tensor([3.0, 6.0]))
        t = mine()
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pair)
        expect("all_reduce AVG in new_group([0, 1])", t, torch.tensor([1.5, 3.0]))
        assert dist.get_world_size(pair) == 2, "new_group([0, 1]) size is not 2"
    if WORLD >= 3:
        # src/dst are global ranks also inside a sub-group that does not start at rank 0.
        tail_ranks = list(range(1, WORLD))
        tail = dist.new_group(tail_ranks)
        if RANK in tail_ranks:
            t = torch.full((2,), float(RANK))
            dist.broadcast(t, src=WORLD - 1, group=tail)
            expect(
                "broadcast in new_group(1..n-1) from global src", t, torch.full((2,), WORLD - 1.0)
            )
            t = torch.full((2,), float(RANK))
            dist.reduce(t, dst=WORLD - 1, group=tail)
            if RANK == WORLD - 1:
                expect("reduce in new_group(1..n-1)", t, torch.full((2,), float(sum(tail_ranks))))
    ok("new_group")


def main() -> None:
    global RANK, WORLD
    scratch = Path(sys.argv[1])
    env = dist.init_parallel_env(timeout_s=60)
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    assert (RANK, WORLD) == (env.rank, env.world_size), f"{(RANK, WORLD)} != env {env}"
    assert dist.get_backend() == "gloo", dist.get_backend()
    check_broadcast()
    check_all_reduce()
    check_reduce()
    check_all_gather()
    check_all_gather_object()
    check_scatter()
    check_barrier(scratch)
    check_send_recv()
    check_isend_irecv()
    check_new_group()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {RANK}: ALL OK", flush=True)


if __name__ == "__main__":
    main()
