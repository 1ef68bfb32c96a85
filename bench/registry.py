"""Every benchmark `python -m bench run` knows: its script, its full and quick arguments, what it
needs, and the claims its figures support (:mod:`bench.spec`); the entries live in
:mod:`bench.catalog_collective` (launcher, collective, elastic), :mod:`bench.catalog_ps`
(parameter server) and :mod:`bench.catalog_ps_train` (PS training, data).

Every ``bench/bench_*.py`` is either registered or listed in :data:`HELPERS` (worker and helper
scripts that are not run on their own); ``tests/test_bench_runner.py`` checks that. Nothing here
imports torch: the docs hook reads this module.
"""

from __future__ import annotations

from bench import catalog_collective, catalog_ps, catalog_ps_train
from bench.spec import AREAS, REQUIREMENTS, Benchmark, Claim, Goal, claim, ge, le

__all__ = [
    "AREAS",
    "BENCHMARKS",
    "BY_NAME",
    "HELPERS",
    "REQUIREMENTS",
    "Benchmark",
    "Claim",
    "Goal",
    "claim",
    "ge",
    "get",
    "le",
]

BENCHMARKS: tuple[Benchmark, ...] = (
    catalog_collective.ENTRIES + catalog_ps.ENTRIES + catalog_ps_train.ENTRIES
)

# Scripts under bench/ that are not benchmarks of their own, and what they are.
HELPERS = {
    "bench/common.py": "statistics, machine info and report() shared by the scripts",
    "bench/paddle_venv.py": "where the scripts find the bench-only Paddle venv",
    "bench/barrier_job.py": "the trivial job bench_launch.py launches",
    "bench/dp_step_worker.py": "the DP job of bench_dp_step.py and bench_metrics_overhead.py",
    "bench/data_load_worker.py": "the loader process of bench_data_load.py",
    "bench/bench_ps_paddle_worker.py": "Paddle's trainer/server script of bench_ps_paddle.py",
    "bench/ps_files_worker.py": "fleetrun's job script of bench_ps_files.py",
    "bench/ps_files_paddle_worker.py": "Paddle's trainer/server script of bench_ps_files.py",
    "bench/check_reader_compat.py": "checks fleet.data reads what Paddle's generator writes "
    "(needs the Paddle venv)",
}

BY_NAME = {b.name: b for b in BENCHMARKS}


def get(name: str) -> Benchmark:
    """The benchmark called ``name``; the error lists the known ones."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(
            f"no benchmark {name!r}; known: {', '.join(sorted(BY_NAME))} (python -m bench list)"
        ) from None
