"""The parameter-server training benchmarks: the trainer's side (fused lookup, training threads,
step-time breakdown), training from files against Paddle, and data loading (see
:mod:`bench.registry`)."""

from __future__ import annotations

from bench import extract as ex
from bench.extract_ps_files import ps_files
from bench.spec import Benchmark, ge, le
from bench.spec import claim as _c

ENTRIES: tuple[Benchmark, ...] = (
    # ------------------------------------------------------------------- PS training
    Benchmark(
        "ps_fused_lookup",
        "ps",
        "DistributedEmbedding: one fused lookup for all slots vs one call per slot",
        "bench/bench_ps_fused_lookup.py",
        ("--reps", "7", "--batches", "8"),
        ("--reps", "5", "--batches", "5"),
        (
            _c(
                "one_id",
                "26 one-id slots, batch 512, dim 8, forward + backward (trainer side)",
                "one-id slots",
                "lower",
                "one call per slot (26 calls)",
                le(0.5),
            ),
            _c(
                "multi_id",
                "26 multi-id slots (0-5 ids per bag), forward + backward (trainer side)",
                "multi-id",
                "lower",
                "one call per slot (26 calls)",
            ),
        ),
    ),
    Benchmark(
        "trainer_threads",
        "ps",
        "Training threads in one trainer (Paddle's thread_num): 2 threads vs 1, in-process",
        "bench/bench_trainer_threads.py",
        ("--reps", "5", "--lines", "50000"),
        ("--reps", "5", "--lines", "10000"),
        (
            _c(
                "threads",
                "ps_files step on 2 Python threads vs 1 (no servers)",
                "2 threads vs 1",
                "higher",
                "one thread",
            ),
        ),
    ),
    Benchmark(
        "step_phases",
        "ps",
        "Step-time breakdown overhead (train_from_dataset, a few-ms PS step)",
        "bench/bench_step_phases.py",
        ("--rounds", "41", "--steps", "60", "--batch", "128"),
        ("--rounds", "5", "--steps", "30", "--batch", "128", "--cost_reps", "5"),
        (
            _c(
                "step_phases_cost",
                "Phase timing per step, as a share of the step (metrics on)",
                "^timing code per step vs the untimed step \\(cpu\\), metrics on",
                "lower",
                "the step it times",
                le(0.01),
            ),
            _c(
                "step_phases_ab",
                "Step time, train_from_dataset vs the same loop untimed (CPU clock)",
                "^step time \\(cpu\\), train_from_dataset",
                "lower",
                "the same loop without phase timing",
                each=True,
            ),
        ),
    ),
    Benchmark(
        "ps_files",
        "ps",
        "PS training from files vs PaddlePaddle 2.6.2's parameter server",
        "bench/bench_ps_files.py",
        ("--rounds", "5"),
        ("--quick", "--rounds", "5"),
        (
            _c(
                "files_tfd",
                "fleet.train_from_dataset examples/s per epoch",
                r"examples/s, train_from_dataset vs",
                "higher",
                "Paddle 2.6.2 train_from_dataset (thread_num 2)",
                ge(1.3),
                each=True,
                needs_full=True,
                requires="paddle26",
            ),
            _c(
                "files_loop",
                "The guide's loop examples/s per epoch",
                r"examples/s, the guide's loop vs",
                "higher",
                "Paddle 2.6.2 train_from_dataset (thread_num 2)",
                ge(1.3),
                each=True,
                needs_full=True,
                requires="paddle26",
            ),
            _c(
                "files_auc",
                "AUC per epoch",
                r"AUC, .* vs Paddle",
                "higher",
                "Paddle 2.6.2",
                ge(1.0),
                goal_text="equal or better",
                each=True,
                requires="paddle26",
            ),
        ),
        extract=ps_files,
        quick_note="4 files x 10k lines; the Paddle column runs when bench/.venv-paddle26 exists",
        timeout_quick=900.0,
        timeout_full=3600.0,
    ),
    # --------------------------------------------------------------------------------- data
    Benchmark(
        "data_load",
        "data",
        "Datasets from slot files: load_into_memory",
        "bench/bench_data_load.py",
        ("--lines", "1000000", "--num_files", "4", "--threads", "2", "--reps", "5"),
        ("--lines", "20000", "--reps", "5"),
        (
            _c(
                "vs_paddle",
                "fleet.data.InMemoryDataset load lines/s",
                "vs Paddle",
                "higher",
                "PaddlePaddle's InMemoryDataset",
                ge(1.2),
                requires="paddle",
            ),
            _c(
                "vs_python",
                "fleet.data.InMemoryDataset load lines/s",
                "vs plain Python",
                "higher",
                "a plain-Python parse",
                ge(10.0),
            ),
            _c(
                "memory",
                "Memory per example (RSS growth)",
                "^RSS growth",
                "lower",
                "payload 476 B",
                le(1.3),
                goal_text="≤ 1.3x payload",
                needs_full=True,
            ),
        ),
        extract=ex.data_load,
        quick_note="the Paddle column runs when bench/.venv-paddle exists",
    ),
    Benchmark(
        "ctr_files",
        "data",
        "CTR training fed from slot files vs prebuilt tensors",
        "bench/bench_ctr_files.py",
        ("--reps", "5", "--train", "50000", "--test", "10000"),
        None,
        (
            _c(
                "ctr_files",
                "CTR fed by fleet.data",
                "vs tensors$",
                "higher",
                "the same job fed from tensors",
                ge(0.95),
                each=True,
            ),
        ),
        not_quick="fifteen PS jobs",
    ),
)
