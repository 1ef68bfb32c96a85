"""Binding a process to its share of the host's CPUs (fleetrun ``--ps_bind_cpus``).

Several parameter servers on one host, left to the kernel's scheduler, now and then run on the
same core while another core idles: a server woken for a request is queued behind its
neighbour until the load balancer moves it, and the request takes twice as long. fleetrun's
``--ps_bind_cpus`` (job file ``ps: {bind_cpus: true}``) gives server ``i`` of the ``n`` on a
host FLEET_PS_CPU_SHARE=``i/n``; the process binds itself (every thread it has, and so every
thread it starts later) to the ``i``-th of ``n`` equal blocks of the CPUs it may use. ``python -m collective.bootstrap`` (every Python worker fleetrun starts, the forked
warm ones too) and ``python -m ps_server`` apply it.

The variable is taken out of the environment once applied, so a process the bound one starts
through the bootstrap is not bound to a share of the share. Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence

from collective.env_base import FLEET_PS_CPU_SHARE
from collective.errors import ConfigError


def parse_cpu_share(value: str, name: str = FLEET_PS_CPU_SHARE) -> tuple[int, int]:
    """``(index, count)`` of ``"I/N"`` with ``0 <= I < N``; ConfigError naming ``name``."""
    index, sep, count = str(value).strip().partition("/")
    if not sep or not index.strip().isdigit() or not count.strip().isdigit():
        raise ConfigError(
            f"{value!r} is not of the form I/N (this process's share I of N equal shares of "
            "the host's CPUs, e.g. 0/2)",
            key=name,
        )
    i, n = int(index), int(count)
    if n < 1 or i >= n:
        raise ConfigError(f"{value!r}: need 0 <= I < N and N >= 1", key=name)
    return i, n


def share_of(cpus: Sequence[int], index: int, count: int) -> list[int]:
    """The ``index``-th of ``count`` contiguous blocks of the sorted ``cpus`` (sizes differ by one
    CPU at most); with fewer CPUs than shares, share ``index`` gets CPU ``index mod len(cpus)``."""
    ordered = sorted(cpus)
    if not ordered:
        raise ValueError("no CPUs to share")
    if count > len(ordered):
        return [ordered[index % len(ordered)]]
    return ordered[index * len(ordered) // count : (index + 1) * len(ordered) // count]


def apply_cpu_share(
    environ: MutableMapping[str, str] | None = None, value: str | None = None, name: str = ""
) -> list[int] | None:
    """Bind this process (each of its threads) to its share (``value``, named ``name`` in
    errors, else FLEET_PS_CPU_SHARE in ``environ``, which is then removed) of the CPUs it may
    use now; the CPUs, or None when no share is set."""
    env = os.environ if environ is None else environ
    given = env.pop(FLEET_PS_CPU_SHARE, None)
    if value is None:
        value, name = given, FLEET_PS_CPU_SHARE
    if not value:
        return None
    index, count = parse_cpu_share(value, name or FLEET_PS_CPU_SHARE)
    cpus = share_of(sorted(os.sched_getaffinity(0)), index, count)
    os.sched_setaffinity(0, cpus)  # threads started from now on inherit it
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        threads = []
    for tid in threads:  # those started before (a BLAS pool, ...)
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # it ended meanwhile
            pass
    return cpus


def format_cpus(cpus: Sequence[int]) -> str:
    """``0-3,6`` for [0, 1, 2, 3, 6]."""
    runs: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0] if ordered else 0
    for c in [*ordered[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(runs) if ordered else ""
