"""Every benchmark `python -m bench run` knows: its script, its full and quick arguments, what it
needs, and the claims its figures support.

A benchmark is one script ``bench/bench_<x>.py`` run as a subprocess with ``--json PATH``; the
JSON it writes is turned into figures by its extractor (:mod:`bench.extract`) and each claim
picks the figure(s) it is about by a regular expression on the figure's label. Every
``bench/bench_*.py`` is either registered here or listed in :data:`HELPERS` (worker and helper
scripts that are not run on their own); ``tests/test_bench_runner.py`` checks that.

Nothing here imports torch: the docs hook reads this module.
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


def _c(id: str, label: str, figure: str, better: str, peer: str, *goals: Goal, **kw) -> Claim:
    return Claim(id, label, figure, better, peer, tuple(goals), **kw)


def le(value: float, on: str = "ratio") -> Goal:
    """``on`` ≤ value."""
    return Goal(on, "<=", value)


def ge(value: float, on: str = "ratio") -> Goal:
    """``on`` ≥ value."""
    return Goal(on, ">=", value)


PS_RPC_TCP = r"server\(s\), .* per step$"
PS_RPC_SHM = r"\[ours through shared memory\]$"

BENCHMARKS: tuple[Benchmark, ...] = (
    # ---------------------------------------------------------------------------- launcher
    Benchmark(
        "launch",
        "launcher",
        "fleetrun vs torchrun: launch and failure detection",
        "bench/bench_launch.py",
        ("--reps", "7"),
        ("--reps", "5"),
        (
            _c(
                "launch",
                "Launch-to-exit, trivial 2-rank gloo barrier job",
                "^launch-to-exit",
                "lower",
                "torchrun (static rendezvous)",
                le(1.10),
            ),
            _c(
                "death",
                "Rank death → launcher exit (other rank blocked in a barrier)",
                "^rank death",
                "lower",
                "torchrun",
                le(2.0, "ours"),
                le(1.0),
                goal_text="≤ 2 s and ≤ torchrun",
            ),
        ),
        timeout_quick=240,
    ),
    Benchmark(
        "import",
        "launcher",
        "Start-up cost of the package layout",
        "bench/bench_import.py",
        ("--before", "6106d00", "--reps", "15"),
        ("--before", "6106d00", "--reps", "5"),
        (
            _c(
                "import",
                "Start-up: import time of this tree vs the flat layout (6106d00)",
                ".",
                "lower",
                "the tree at 6106d00",
                le(1.05),
                each=True,
                goal_text="≤ 1.05 (no slower than before, within noise)",
            ),
        ),
    ),
    Benchmark(
        "ray_launch",
        "launcher",
        "Ray scheduler: launch-to-exit vs Ray Train's TorchTrainer",
        "bench/bench_ray_launch.py",
        ("--reps", "5"),
        None,
        (
            _c(
                "ray_launch",
                "Launch-to-exit of a 2-worker all_reduce job on a running Ray cluster",
                "^launch-to-exit",
                "lower",
                "Ray Train TorchTrainer",
                le(1.2),
            ),
        ),
        requires=("ray",),
        not_quick="a Ray cluster start and ~12 launches of tens of seconds each",
    ),
    # -------------------------------------------------------------------------- collective
    Benchmark(
        "allreduce",
        "collective",
        "collective.all_reduce vs torch.distributed.all_reduce",
        "bench/bench_allreduce.py",
        ("--reps", "15"),
        ("--reps", "5", "--sizes-mib", "4"),
        (
            _c(
                "allreduce",
                "all_reduce bus bandwidth, 2 ranks (gloo)",
                "^bus bandwidth",
                "higher",
                "torch.distributed.all_reduce",
                ge(0.97),
                each=True,
            ),
        ),
    ),
    Benchmark(
        "dp_step",
        "collective",
        "Data-parallel step time: fleet vs DDP",
        "bench/bench_dp_step.py",
        ("--reps", "7", "--steps", "30"),
        ("--reps", "5", "--steps", "10"),
        (
            _c(
                "dp_step",
                "DP step time, 4.2 M-param MLP, 2 ranks: fleet.distributed_model under fleetrun",
                "^median step time",
                "lower",
                "DDP under torchrun",
                le(1.02),
            ),
        ),
    ),
    Benchmark(
        "tp",
        "collective",
        "Tensor parallel vs DTensor; recompute",
        "bench/bench_tp.py",
        ("--reps", "7", "--steps", "10"),
        ("--reps", "5", "--steps", "3", "--dim", "256", "--batch", "64"),
        (
            _c(
                "tp",
                "TP MLP fwd+bwd step: ColumnParallelLinear → RowParallelLinear",
                "^median step time",
                "lower",
                "DTensor ColwiseParallel/RowwiseParallel",
                le(1.053),
                goal_text="ratio ≤ 1.053 (speed ≥ 0.95)",
            ),
            _c(
                "recompute_bytes",
                "Recompute: saved-tensor bytes of 4 TP blocks",
                "^recompute: saved",
                "lower",
                "the same blocks without recompute",
            ),
            _c(
                "recompute_time",
                "Recompute: step time (one extra forward, ~1.33x expected)",
                "^recompute: step time",
                "lower",
                "the same blocks without recompute",
            ),
        ),
        extract=ex.rows_plus(ex.tp_recompute),
    ),
    Benchmark(
        "pipeline",
        "collective",
        "Pipeline parallel 1F1B vs torch.distributed.pipelining",
        "bench/bench_pipeline.py",
        ("--reps", "7", "--steps", "8"),
        ("--reps", "5", "--steps", "3", "--hidden", "256"),
        (
            _c(
                "pipeline",
                "1F1B step time, 2 stages, 8 micro-batches: PipelineParallel.train_batch",
                "^median step time",
                "lower",
                "PipelineStage + Schedule1F1B",
                le(1.053),
                goal_text="ratio ≤ 1.053 (speed ≥ 0.95)",
            ),
            _c(
                "pp_memory",
                "1F1B peak saved activations, 16 vs 4 micro-batches",
                "^1F1B peak",
                "lower",
                "(growth with m)",
                le(1.1, "ours"),
                goal_text="≤ 1.1x",
            ),
            _c(
                "pp_bubble",
                "Bubble (idle share of a step, incl. communication)",
                "^bubble",
                "lower",
                "(p−1)/(m+p−1)",
                each=True,
            ),
        ),
        extract=ex.rows_plus(ex.pipeline_extras),
    ),
    Benchmark(
        "sharding",
        "collective",
        "Sharding stage 1/2 vs ZeroRedundancyOptimizer / FSDP2",
        "bench/bench_sharding.py",
        ("--reps", "5"),
        ("--reps", "5", "--steps", "5", "--warmup", "1", "--layers", "4", "--width", "256"),
        (
            _c(
                "stage1",
                "Stage 1 step time (ShardedOptimizer)",
                "^stage 1",
                "lower",
                "DDP + ZeroRedundancyOptimizer",
                le(1.05),
            ),
            _c(
                "stage2",
                "Stage 2 step time (gradients reduced to the owner)",
                "^stage 2",
                "lower",
                "FSDP2 fully_shard(reshard_after_forward=False)",
                le(1.05),
            ),
            _c(
                "state_bytes",
                "Optimizer-state bytes per rank, stage 1",
                "fleet-s1$",
                "lower",
                "unsharded DDP + Adam",
                le(0.55),
                goal_text="≤ 1/N + 5 % = 0.55",
            ),
        ),
        extract=ex.rows_plus(ex.sharding_state),
    ),
    Benchmark(
        "hybrid_combos",
        "collective",
        "Hybrid combinations (world 4)",
        "bench/bench_hybrid_combos.py",
        ("--reps", "7"),
        ("--reps", "5", "--steps", "3", "--width", "64", "--batch", "16"),
        (
            _c(
                "s3_tp",
                "Sharding stage 3 x TP (sharding 2 x mp 2)",
                "^1\\.",
                "lower",
                "torch FSDP2 + DTensor TP",
                le(1.05),
                goal_text="≤ 1.05 (speed ≥ 0.95)",
            ),
            _c("o2_s2", "AMP O2 bf16 x stage 2 (fleet both)", "^2\\.", "lower", "float32 stage 2"),
            _c(
                "s3_pp",
                "Stage 3 x pipeline (fleet both; no torch-native peer)",
                "^3\\.",
                "lower",
                "stage 1 x pipeline",
            ),
        ),
        timeout_quick=240,
    ),
    Benchmark(
        "dp_comm",
        "collective",
        "Communication-efficient data parallel",
        "bench/bench_dp_comm.py",
        ("--no_metrics",),
        None,
        (
            _c(
                "fp16_time",
                "fp16_allreduce step time",
                "^1\\. fp16",
                "lower",
                "DDP + fp16_compress_hook",
                le(1.02),
            ),
            _c(
                "fp16_bytes",
                "fp16_allreduce bytes per step vs float32",
                "^fp16_allreduce bytes",
                "lower",
                "(float32)",
                le(0.5, "ours"),
                goal_text="0.50",
            ),
            _c(
                "fp16_loss",
                "fp16_allreduce: the DP example's final loss",
                "^fp16_allreduce: final",
                "lower",
                "float32 all-reduce",
                le(1.01),
                goal_text="within 1 % (ratio ≤ 1.01)",
            ),
            _c(
                "localsgd_time",
                "localsgd k=4 step time",
                "^2\\. localsgd",
                "lower",
                "DDP + PostLocalSGDOptimizer",
            ),
            _c(
                "localsgd_share",
                "localsgd k=4: share of steps with an all-reduce",
                "^localsgd k=4: share",
                "lower",
                "(1/k)",
                le(0.25, "ours"),
                goal_text="0.25",
            ),
            _c(
                "adaptive",
                "adaptive_localsgd: steps to within 2 % of the dense final loss",
                "^adaptive_localsgd",
                "lower",
                "dense run's length",
                le(1.1),
            ),
            _c(
                "dgc_bytes",
                "dgc sparsity 0.999: bytes per step vs dense",
                "^dgc bytes",
                "lower",
                "(dense)",
                le(0.02, "ours"),
                goal_text="≤ 0.02",
            ),
            _c(
                "dgc_loss",
                "dgc: the DP example's final loss",
                "^dgc: final",
                "lower",
                "dense all-reduce",
                le(1.02),
                goal_text="within 2 % (ratio ≤ 1.02)",
            ),
            _c("plain", "Plain DP step time, paired jobs", "^4\\. plain", "lower", "DDP", le(1.02)),
        ),
        extract=ex.rows_plus(ex.dp_comm_extras),
        not_quick="~60 fleetrun/torchrun jobs and three 300-step example runs",
        timeout_full=3600,
    ),
    Benchmark(
        "metrics_dp",
        "collective",
        "Prometheus metrics overhead on a DP step",
        "bench/bench_metrics_overhead.py",
        ("--skip_ps", "--reps", "7"),
        None,
        (
            _c(
                "metrics_dp",
                "DP step time with fleetrun --metrics",
                "^median step time",
                "lower",
                "the same job with --no-metrics",
                le(1.01),
            ),
        ),
        json_suffix=".dp.json",
        not_quick="a 1 % goal needs full-length jobs; 14 two-rank jobs",
    ),
    # ------------------------------------------------------------------------------ elastic
    Benchmark(
        "elastic",
        "elastic",
        "Elastic jobs: node loss and join (c10d)",
        "bench/bench_elastic.py",
        ("--reps", "5", "--variants", "fleetrun-c10d,torchrun-c10d"),
        None,
        (
            _c(
                "loss",
                "Node loss: SIGKILL → training again at world 1",
                "^loss, fleetrun-c10d",
                "lower",
                "torchrun c10d, same rendezvous options",
                le(10.0, "ours"),
                le(1.0),
                goal_text="≤ 10 s and ≤ torchrun",
            ),
            _c(
                "join",
                "Join: 3rd agent start → world 2 training",
                "^join, fleetrun-c10d",
                "lower",
                "torchrun c10d, same rendezvous options",
                le(10.0, "ours"),
                goal_text="≤ 10 s",
            ),
        ),
        extract=ex.elastic,
        not_quick="each repetition starts, kills and joins whole agents: ~5 minutes",
    ),
    Benchmark(
        "elastic_etcd",
        "elastic",
        "Elastic jobs: node loss and join (etcd)",
        "bench/bench_elastic.py",
        ("--reps", "5", "--variants", "fleetrun-etcd,torchrun-c10d"),
        None,
        (
            _c(
                "loss_etcd",
                "Node loss over etcd",
                "^loss, fleetrun-etcd",
                "lower",
                "torchrun c10d",
                le(10.0, "ours"),
                goal_text="≤ 10 s",
            ),
            _c(
                "join_etcd",
                "Join over etcd",
                "^join, fleetrun-etcd",
                "lower",
                "torchrun c10d",
                le(10.0, "ours"),
                goal_text="≤ 10 s",
            ),
        ),
        extract=ex.elastic,
        requires=("etcd",),
        not_quick="as `elastic`, plus a private etcd",
    ),
    Benchmark(
        "elastic_checkpoint",
        "elastic",
        "Elastic resume checkpoints vs a hand-written torch.save",
        "bench/bench_elastic_checkpoint.py",
        ("--reps", "5"),
        ("--reps", "5", "--layers", "2", "--width", "256"),
        (
            _c(
                "ckpt",
                "fleet.elastic.Checkpointer",
                ".",
                "lower",
                "rank-0 torch.save + fsync + rename / torch.load",
                each=True,
            ),
        ),
    ),
    # ------------------------------------------------------------------ parameter server
    Benchmark(
        "ps_memory",
        "ps",
        "Sparse table memory and index throughput",
        "bench/bench_ps_memory.py",
        ("--reps", "7"),
        ("--rows", "200000", "--reps", "5"),
        (
            _c(
                "bytes_per_row",
                "Bytes per row, dim 8, Adagrad",
                "^bytes per row",
                "lower",
                "payload (key + values + accumulators + counters)",
                le(1.5),
                goal_text="≤ 1.5x payload",
            ),
            _c(
                "index",
                "Sparse pull/push rows/s, 64k-key batches: hash index",
                "hash index vs dict",
                "higher",
                "dict index",
                each=True,
            ),
        ),
        extract=ex.ps_memory,
    ),
    Benchmark(
        "ps_kernels",
        "ps",
        "Sparse table kernels: compiled vs numpy",
        "bench/bench_ps_kernels.py",
        ("--reps", "7"),
        ("--reps", "5", "--steps", "3", "--dims", "8"),
        (
            _c(
                "kernels",
                "Table pull+push keys/s in-process, compiled kernels",
                "repeats\\)$",
                "higher",
                "the numpy path",
                each=True,
            ),
            _c(
                "threads",
                "Table pull+push keys/s, table threads",
                "threads vs 1$",
                "higher",
                "1 thread",
                each=True,
            ),
        ),
    ),
    Benchmark(
        "ps_rpc",
        "ps",
        "PS pull+push over gRPC vs a transport-only echo",
        "bench/bench_ps_rpc.py",
        (),
        ("--reps", "5", "--steps", "4", "--dims", "8", "--servers", "1"),
        (
            _c(
                "rpc_tcp",
                "Pull+push keys/s, TCP path",
                PS_RPC_TCP,
                "higher",
                "gRPC echo of the same bytes",
                ge(0.5),
                each=True,
            ),
            _c(
                "rpc_shm",
                "Pull+push keys/s, shared-memory path (the default on one host)",
                PS_RPC_SHM,
                "higher",
                "gRPC echo of the same bytes",
                ge(0.5),
                each=True,
            ),
        ),
    ),
    Benchmark(
        "ps_peers",
        "ps",
        "PS pull+push vs a Ray-actor PS and a torch.distributed.rpc PS",
        "bench/bench_ps_peers.py",
        ("--dists", "uniform,zipf"),
        (
            "--dims",
            "8",
            "--dists",
            "uniform",
            "--ours_servers",
            "1",
            "--reps",
            "5",
            "--rep_seconds",
            "1",
        ),
        (
            _c(
                "vs_ray",
                "Pull+push keys/s, int64 ids",
                " vs ray ",
                "higher",
                "Ray actor PS",
                ge(3.0),
                each=True,
            ),
            _c(
                "vs_rpc",
                "Pull+push keys/s, int64 ids",
                " vs rpc ",
                "higher",
                "torch.distributed.rpc PS",
                ge(3.0),
                each=True,
            ),
        ),
        requires=("ray",),
        timeout_full=3600,
    ),
    Benchmark(
        "ctr",
        "ps",
        "CTR training: PS job vs single-process torch",
        "bench/bench_ctr.py",
        ("--reps", "5"),
        ("--reps", "5", "--train", "20000", "--test", "5000"),
        (
            _c(
                "ctr",
                "CTR examples/s, 1 server + 1 trainer (async, prefetch)",
                "^train examples",
                "higher",
                "single-process torch (sparse nn.Embedding + sparse Adagrad)",
                ge(0.6),
                needs_full=True,
            ),
            _c(
                "ctr_auc",
                "CTR test AUC",
                "^test AUC",
                "higher",
                "single-process torch",
                le(0.01, "absdiff"),
                goal_text="within 0.01",
            ),
        ),
        extract=ex.rows_plus(ex.ctr_auc),
        timeout_quick=240,
    ),
    Benchmark(
        "ps_checkpoint",
        "ps",
        "PS checkpoint stall",
        "bench/bench_ps_checkpoint.py",
        ("--reps", "7"),
        ("--rows", "200000", "--reps", "5", "--quiet_s", "0.5"),
        (
            _c(
                "stall",
                "Largest pull latency during the snapshot (the stall), 10^6 rows dim 8",
                "^largest pull latency during",
                "lower",
                "a quiet window",
                le(0.5, "ours"),
                goal_text="≤ 0.5 s at 10^6 rows",
                needs_full=True,
            ),
            _c(
                "lock",
                "Table-lock time",
                "^server's table-lock",
                "lower",
                "memcpy of the same bytes (limit)",
            ),
            _c(
                "whole",
                "Stall vs the whole save",
                "^stall vs the whole save",
                "lower",
                "a save holding the locks throughout",
            ),
            _c(
                "writing",
                "Largest pull latency while the files are written",
                "while the files",
                "lower",
                "a quiet window",
            ),
        ),
    ),
    Benchmark(
        "ps_security",
        "ps",
        "PS security: refused and garbage calls; the token check on the hot path",
        "bench/bench_ps_security.py",
        (),
        ("--calls", "1000", "--reps", "5", "--small_calls", "200", "--big_steps", "1"),
        (
            _c(
                "refused",
                "Calls refused per second",
                r"calls, .* -> ",
                "higher",
                "served ListTables calls",
                ge(0.5),
                each=True,
            ),
            _c(
                "hot",
                "Hot path with the token checked",
                "^hot path",
                "higher",
                "the same server without a token",
                ge(0.95),
                each=True,
            ),
            _c(
                "intact",
                "Tables unchanged, server serving after every attack",
                "^tables unchanged",
                "higher",
                "—",
                ge(1, "ours"),
                goal_text="yes",
            ),
        ),
        extract=ex.rows_plus(ex.security_extras),
    ),
    Benchmark(
        "metrics_ps",
        "ps",
        "Prometheus metrics overhead on PS throughput",
        "bench/bench_metrics_overhead.py",
        ("--skip_dp",),
        ("--skip_dp", "--ps_rounds", "9", "--ps_block", "10"),
        (
            _c(
                "metrics_ps",
                "PS pull+push keys/s with --metrics_port, scraped every second",
                "^pull\\+push keys/s per",
                "higher",
                "the same server without metrics",
                ge(0.98),
                needs_full=True,
            ),
        ),
        json_suffix=".ps.json",
    ),
    Benchmark(
        "ps_chaos",
        "ps",
        "PS chaos: servers and trainers SIGKILLed during training",
        "bench/bench_ps_chaos.py",
        ("--lines", "260000", "--period", "30", "--interval", "5", "--test", "20000"),
        None,
        (
            _c(
                "server_recovery",
                "A server killed every 30 s: recovery per kill",
                "^servers killed: recovery",
                "lower",
                "—",
                le(5.0, "ours"),
                goal_text="≤ 5 s",
            ),
            _c(
                "server_auc",
                "Servers killed: test AUC",
                "^servers killed: test AUC",
                "higher",
                "the undisturbed run",
                le(0.005, "absdiff"),
                goal_text="within 0.005",
            ),
            _c(
                "trainer_gap",
                "A trainer killed: the other trainer's longest gap per kill",
                "other trainer",
                "lower",
                "—",
                le(1.5, "ours"),
                goal_text="never stops (≤ 1.5 s: the progress files' ~1 s resolution)",
            ),
            _c(
                "trainer_recovery",
                "A trainer killed: the restarted trainer steps again",
                "^trainers killed: recovery",
                "lower",
                "—",
                le(5.0, "ours"),
                goal_text="≤ 5 s",
            ),
            _c(
                "trainer_auc",
                "Trainers killed: test AUC",
                "^trainers killed: test AUC",
                "higher",
                "the undisturbed run",
                le(0.005, "absdiff"),
                goal_text="within 0.005",
            ),
            _c(
                "orphans",
                "Orphan processes after the runs",
                "^orphan",
                "lower",
                "—",
                le(0, "ours"),
                goal_text="0",
            ),
        ),
        extract=ex.ps_chaos,
        not_quick="three CTR jobs of over 3 minutes each",
        timeout_full=3600,
    ),
    Benchmark(
        "ps_inplace",
        "ps",
        "PS server restarted alone in place: Ray vs local",
        "bench/bench_ps_inplace.py",
        (),
        None,
        (
            _c(
                "inplace",
                "Server recovery per kill on Ray",
                "^server restarted",
                "lower",
                "the local scheduler",
                le(5.0, "ours"),
                goal_text="≤ 5 s",
            ),
        ),
        extract=ex.ps_inplace,
        requires=("ray",),
        not_quick="two CTR jobs of several minutes, one on Ray",
    ),
    Benchmark(
        "streaming_checkpoint",
        "ps",
        "fleet.train_days with and without automatic checkpoints",
        "bench/bench_streaming_checkpoint.py",
        ("--reps", "5", "--days", "2", "--passes", "3", "--lines", "10000"),
        None,
        (
            _c(
                "stream",
                "Online day/pass stream with checkpoints",
                "with vs without",
                "higher",
                "the same stream without checkpoints",
                each=True,
            ),
        ),
        extract=ex.streaming_checkpoint,
        not_quick="ten fleetrun jobs of 10-60 s",
    ),
    Benchmark(
        "ps_paddle",
        "ps",
        "Online day/pass stream vs PaddlePaddle 2.6.2's parameter server",
        "bench/bench_ps_paddle.py",
        ("--reps", "3", "--checkpoints", "on"),
        None,
        (
            _c(
                "paddle_train",
                "Training examples/s, checkpoints on",
                "^training examples",
                "higher",
                "Paddle 2.6.2 train_from_dataset",
                ge(1.3),
            ),
            _c(
                "paddle_pass",
                "Whole pass examples/s (validation + training + saves)",
                "^whole-pass",
                "higher",
                "Paddle 2.6.2",
                ge(1.3),
            ),
            _c(
                "paddle_auc",
                "Progressive AUC of the stream's last pass",
                "^progressive AUC",
                "higher",
                "Paddle 2.6.2",
                ge(1.0),
                goal_text="equal or better",
            ),
        ),
        extract=ex.ps_paddle,
        requires=("paddle26",),
        not_quick="needs the Paddle 2.6.2 venv; six jobs of ~30-50 s",
    ),
    # --------------------------------------------------------------------------------- data
    Benchmark(
        "data_load",
        "data",
        "Datasets from slot files: load_into_memory",
        "bench/bench_data_load.py",
        ("--lines", "1000000", "--num_files", "4", "--threads", "2", "--reps", "5"),
        ("--lines", "50000", "--reps", "5"),
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
                "CTR examples/s fed by fleet.data",
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

# Scripts under bench/ that are not benchmarks of their own, and what they are.
HELPERS = {
    "bench/common.py": "statistics, machine info and report() shared by the scripts",
    "bench/paddle_venv.py": "where the scripts find the bench-only Paddle venv",
    "bench/barrier_job.py": "the trivial job bench_launch.py launches",
    "bench/dp_step_worker.py": "the DP job of bench_dp_step.py and bench_metrics_overhead.py",
    "bench/data_load_worker.py": "the loader process of bench_data_load.py",
    "bench/bench_ps_paddle_worker.py": "Paddle's trainer/server script of bench_ps_paddle.py",
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
