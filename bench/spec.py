"""The parts of a benchmark's registration: what it runs, its claims and their goals.

A benchmark is one script ``bench/bench_<x>.py`` run as a subprocess with ``--json PATH``; the
JSON it writes is turned into figures by its extractor (:mod:`bench.extract`) and each claim
picks the figure(s) it is about by a regular expression on the figure's label. Nothing here
imports torch: the docs hook reads these modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench import extract as ex

AREAS = {
    "launcher": "Launcher",
    "collective": "Collective training",
    "elastic": "Elastic jobs",
    "ps": "Parameter server",
    "data": "Data",
}

# What a benchmark may need beyond the project's virtualenv, and how to get it.
REQUIREMENTS = {
    "paddle": "the bench-only PaddlePaddle venv bench/.venv-paddle (bench/setup_paddle_venv.sh)",
    "paddle26": "the bench-only PaddlePaddle 2.6.2 venv bench/.venv-paddle26 "
    "(bench/setup_paddle26_venv.sh)",
    "ray": "ray (pip install 'fleetrun[ray]')",
    "etcd": "an etcd binary on PATH (scripts/etcd.sh installs Debian's etcd-server)",
    "cuda": "a CUDA GPU (torch.cuda.is_available())",
}


@dataclass(frozen=True)
class Goal:
    """One condition: ``on`` (``ratio``: ours/peer of the medians, ``ours``: our median,
    ``absdiff``: |ours - peer|) compared with ``value`` by ``op`` (``<=`` or ``>=``)."""

    on: str
    op: str
    value: float

    def holds(self, ours: float | None, peer: float | None, ratio: float | None) -> bool | None:
        """Whether the condition holds; None when a value it needs is missing."""
        x = {"ratio": ratio, "ours": ours}.get(self.on)
        if self.on == "absdiff":
            x = None if ours is None or peer is None else abs(ours - peer)
        if x is None:
            return None
        return x <= self.value if self.op == "<=" else x >= self.value


@dataclass(frozen=True)
class Claim:
    """A statement a benchmark's figures support.

    ``figure`` is a regular expression searched in the figure labels; with ``each`` every
    matching figure is a row of its own (labelled by the figure), else the first match is used.
    ``goals`` all have to hold for the claim to be met; none means the row is informational.
    ``needs_full``: the goal is about the full sizes, so a quick run's figure is shown but not
    judged. ``requires`` names an optional peer (see :data:`REQUIREMENTS`) whose absence leaves
    the row unmeasured without failing the benchmark.
    """

    id: str
    label: str
    figure: str
    better: str  # "lower" or "higher"
    peer: str
    goals: tuple[Goal, ...] = ()
    goal_text: str = ""
    each: bool = False
    needs_full: bool = False
    requires: str = ""

    def goal_description(self) -> str:
        """The goal in words: ``goal_text`` or the conditions written out."""
        if self.goal_text:
            return self.goal_text
        if not self.goals:
            return "informational"
        names = {"ratio": "ratio", "ours": "ours", "absdiff": "|ours − peer|"}
        return " and ".join(
            f"{names[g.on]} {'≤' if g.op == '<=' else '≥'} {g.value:g}" for g in self.goals
        )


@dataclass(frozen=True)
class Benchmark:
    """One script and how the runner runs and reads it."""

    name: str
    area: str
    title: str
    script: str
    full_args: tuple[str, ...]
    quick_args: tuple[str, ...] | None
    claims: tuple[Claim, ...]
    extract: ex.Extractor = ex.report_rows
    requires: tuple[str, ...] = ()
    not_quick: str = ""  # why the benchmark is left out of --quick
    quick_note: str = ""  # what --quick changes, when it is more than smaller sizes
    json_suffix: str = ""  # the script writes PATH + json_suffix
    timeout_quick: float = 180.0
    timeout_full: float = 1800.0

    def args(self, quick: bool) -> tuple[str, ...]:
        """The script's arguments in a mode (quick needs ``quick_args``)."""
        if quick:
            if self.quick_args is None:
                raise ValueError(f"{self.name} has no quick mode: {self.not_quick}")
            return self.quick_args
        return self.full_args


def claim(id: str, label: str, figure: str, better: str, peer: str, *goals: Goal, **kw) -> Claim:
    """A :class:`Claim` with its goals as positional arguments."""
    return Claim(id, label, figure, better, peer, tuple(goals), **kw)


def le(value: float, on: str = "ratio") -> Goal:
    """``on`` ≤ value."""
    return Goal(on, "<=", value)


def ge(value: float, on: str = "ratio") -> Goal:
    """``on`` ≥ value."""
    return Goal(on, ">=", value)
