"""fleetrun's benchmarks: ``python -m bench run [--quick] [--only NAME ...]`` runs them and
writes ``bench/results/*.json``; the docs build turns the latest results into the benchmarks
page (``scripts/docs_hooks/benchmarks.py``).

The scripts themselves (``bench/bench_*.py``) still run on their own
(``python bench/bench_launch.py --reps 7``); they import their helpers as siblings
(``from common import ...``), so this package imports none of them.
"""
