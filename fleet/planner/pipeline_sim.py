"""A pipeline schedule played out on a CPU node its ranks crowd (plain Python, no torch).

With more ranks than cores, a pipeline stage runs faster while its neighbours idle in the
bubble, and slower while every stage computes. Neither ``(m + pp - 1)`` slots of the slowest
stage nor the whole work divided by the cores describes that: the fill's first slots leave
cores idle that no dependency lets another stage use. :func:`simulate` plays the schedule
(1F1B or FThenB, :func:`stage_orders`) out event by event: each stage runs its tasks in its
order, a forward waits for the previous stage's forward of that micro-batch (and a hop), a
backward for the next stage's backward (and a hop; the last stage's for its own forward), and
every task running at a moment progresses at ``rate(n)`` of its alone speed, ``n`` the stages
computing then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Task = tuple[str, int]
"""``("F", i)`` or ``("B", i)``: the forward or backward of micro-batch ``i``."""


def stage_orders(pp: int, m: int, schedule: str = "1F1B") -> list[list[Task]]:
    """Each stage's task order: 1F1B (``pp - s - 1`` warm-up forwards, then one forward and
    one backward in turn, then the remaining backwards) or FThenB (every forward, then every
    backward)."""
    orders: list[list[Task]] = []
    for s in range(pp):
        if schedule == "FThenB":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = min(pp - s - 1, m)
        seq: list[Task] = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                seq.append(("F", f))
                f += 1
            seq.append(("B", b))
            b += 1
        orders.append(seq)
    return orders


def simulate(
    fwd: Sequence[float],
    bwd: Sequence[float],
    m: int,
    hop: float,
    rate: Callable[[int], float],
    schedule: str = "1F1B",
) -> float:
    """Seconds from the first forward to the last backward. ``fwd[s]`` / ``bwd[s]``: stage
    ``s``'s forward / backward of one micro-batch when it runs alone; ``hop``: a message
    between neighbouring stages; ``rate(n)``: the speed of a task, relative to alone, while
    ``n`` stages compute."""
    pp = len(fwd)
    orders = stage_orders(pp, m, schedule)
    pos = [0] * pp
    done: dict[tuple[str, int, int], float] = {}
    running: dict[int, list[float]] = {}  # stage -> [work left]
    t = 0.0

    def ready(s: int) -> float | None:
        """When stage ``s``'s next task may start (None: its inputs are not done yet)."""
        kind, i = orders[s][pos[s]]
        if kind == "F":
            if s == 0:
                return 0.0
            d = done.get(("F", s - 1, i))
            return None if d is None else d + hop
        if s == pp - 1:
            return done.get(("F", s, i))
        d = done.get(("B", s + 1, i))
        return None if d is None else d + hop

    while True:
        for s in range(pp):
            if s not in running and pos[s] < len(orders[s]):
                r = ready(s)
                if r is not None and r <= t + 1e-12:
                    kind, _ = orders[s][pos[s]]
                    running[s] = [fwd[s] if kind == "F" else bwd[s]]
        if not running and all(pos[s] >= len(orders[s]) for s in range(pp)):
            return t
        speed = rate(len(running)) if running else 0.0
        step = min((w[0] / speed for w in running.values()), default=float("inf"))
        for s in range(pp):
            if s not in running and pos[s] < len(orders[s]):
                r = ready(s)
                if r is not None and r > t:
                    step = min(step, r - t)
        if step == float("inf"):  # cannot happen for a valid order; guard the loop anyway
            raise RuntimeError(f"pipeline schedule {schedule} with {pp} stages stalled")
        t += step
        for s in list(running):
            running[s][0] -= step * speed
            if running[s][0] <= 1e-12:
                kind, i = orders[s][pos[s]]
                done[(kind, s, i)] = t
                pos[s] += 1
                del running[s]


__all__ = ["Task", "simulate", "stage_orders"]
