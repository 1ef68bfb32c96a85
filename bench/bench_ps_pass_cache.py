"""CTR training with the pass cache vs the async RPC path and single-process torch.

One pass over slot files (``examples/ctr/gen_slot_files.py``, the CTR example's synthetic data)
loaded into an InMemoryDataset, the CTR example's wide & deep model (rows Adagrad, dense Adam),
1 server + 1 trainer under fleetrun:

* ``pass``: ``a_sync_configs.use_ps_gpu`` (async dense), ``fleet.begin_pass(ds)`` before the
  pass and ``fleet.end_pass()`` after it, both inside the timed span: one pull and one push per
  table per pass;
* ``passgeo``: the same pass cache with the dense part trained on the trainer and its delta
  exchanged every ``DENSE_K`` steps (GEO's ``k_steps``; Paddle's GPU PS keeps the dense part on
  its trainers too) instead of a push and pull of it every step;
* ``async``: the async RPC path (a pull per table per step, prefetched, pushes in the background);
* the peer: ``python -m examples.ctr.baseline`` (one process, hashed sparse ``nn.Embedding``).

Runs alternate; median of >= 5 with min/max. Reports examples/s (each pass cache vs baseline,
pass vs async), the test AUC of each, and the sparse RPCs of a pass. Each repetition also runs
``pass``, ``passgeo`` and ``async`` with 1 server + 2 trainers (each trainer reads one of the
two files) for their test AUC, measured by trainer 0 once both trainers are done (the servers'
rows and dense parameters, so both trainers' updates).

``--gpu``: the trainer's model on CUDA (the same job, 1 server + 1 trainer), ``pass`` (the pass's
rows in GPU memory, lookups and their updates on the device) against ``async`` (rows pulled per
step and copied to the GPU): the pass cache's GPU goal, >= 3x. It writes ``{"skipped": ...}``
without a CUDA device.

Usage: ``python bench/bench_ps_pass_cache.py [--reps 5] [--train 100000] [--test 20000]
[--gpu]`` (``--worker`` and ``--device`` are the fleetrun script's).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO, Stats, bench_env, fleetrun_cmd, report, run_checked

FILES = 2
DENSE_K = 50
"""``passgeo``: steps between the dense part's exchanges."""


def worker(args: argparse.Namespace) -> None:
    """The fleetrun script: train one pass, evaluate, write JSON (trainer 0)."""
    sys.path.insert(0, str(REPO))
    import torch

    import fleet
    from examples.ctr.data import CTRDataConfig, generate
    from examples.ctr.model import WideDeep
    from examples.ctr.slots import batch_to_inputs, make_slots
    from fleet.ps.runtime import get_client
    from ps_server import Adagrad, Constant, Normal

    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    if args.worker == "pass":
        strategy.a_sync_configs = {"use_ps_gpu": True}
    if args.dense_k:  # GEO: dense trained locally, its delta exchanged every dense_k steps
        strategy.a_sync_configs = {"k_steps": args.dense_k}
    fleet.init(is_collective=False, strategy=strategy)
    torch.manual_seed(0)

    def embedding(num_slots: int, dim: int) -> torch.nn.Module:
        init = Constant(0.0) if dim == 1 else Normal(0.0, 0.05)
        return fleet.DistributedEmbedding(
            f"ctr_dim{dim}", dim, optimizer=Adagrad(0.05), initializer=init
        )

    data = CTRDataConfig(seed=0)
    model = WideDeep(data.num_slots, data.num_dense, 16, (256, 128), embedding_factory=embedding)
    device = torch.device(args.device)
    model.to(device)  # the DistributedEmbeddings' rows come back on it too
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return
    fleet.init_worker()
    opt = fleet.distributed_optimizer(torch.optim.Adam(list(model.dense_parameters()), lr=1e-3))
    ds = fleet.InMemoryDataset()
    ds.init(batch_size=512, thread_num=1, use_var=make_slots(), pipe_command="cat")
    ds.set_filelist(fleet.util.get_file_shard(sorted(glob.glob(os.path.join(args.data, "part-*")))))
    ds.load_into_memory()
    client = get_client()
    calls = {"pull": 0, "push": 0}
    pull, push = client.pull_sparse, client.push_sparse
    pull_state = client.pull_sparse_with_state  # a pass's pull of Adagrad rows

    def counted(kind, call):
        def wrapped(*a, **kw):
            calls[kind] += 1
            return call(*a, **kw)

        return wrapped

    client.pull_sparse, client.push_sparse = counted("pull", pull), counted("push", push)
    client.pull_sparse_with_state = counted("pull", pull_state)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    fleet.barrier_worker()
    t0 = time.perf_counter()
    examples = 0
    phases = {}
    if args.worker == "pass":
        fleet.begin_pass(ds, label="click")
    phases["begin"] = time.perf_counter() - t0
    for batch in ds:
        ids, dense, labels = batch_to_inputs(batch)
        dense, labels = dense.to(device), labels.to(device)  # ids: deduplicated on the host
        loss = loss_fn(model(ids, dense), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        examples += labels.shape[0]
    phases["loop"] = time.perf_counter() - t0 - phases["begin"]
    if args.worker == "pass":
        fleet.end_pass()
    opt.comm.flush()
    seconds = time.perf_counter() - t0
    fleet.barrier_worker()  # every trainer's updates are on the servers
    opt.comm._set_dense(opt.comm.pull_dense())  # the servers' dense parameters
    phases["end"] = seconds - phases["loop"] - phases["begin"]
    rpcs = calls["pull"] + calls["push"]  # the pass's (evaluation pulls not counted)
    test = generate(data, args.test, args.train)
    state = fleet.metrics.AucState()
    model.eval()
    with torch.no_grad():
        for lo in range(0, args.test, 8192):
            p = torch.sigmoid(
                model(
                    torch.from_numpy(test.sparse_ids[lo : lo + 8192]),
                    torch.from_numpy(test.dense[lo : lo + 8192]).to(device),
                )
            )
            state.update(p.cpu(), test.labels[lo : lo + 8192])
    # every trainer scores the same test examples with the same model: the global AUC of
    # fleet.metrics (summed histograms) is the AUC of one trainer's
    auc = fleet.metrics.auc(state.stat_pos, state.stat_neg)
    if fleet.worker_index() != 0:
        fleet.stop_worker()
        return
    with open(args.out, "w") as f:
        json.dump(
            {
                "examples_per_s": examples / seconds,
                "auc": auc,
                "sparse_rpcs": rpcs,
                "phases": phases,
            },
            f,
        )
    fleet.stop_worker()


def run_ps(
    kind: str,
    data: str,
    train: int,
    test: int,
    tmp: str,
    trainers: int = 1,
    device: str = "cpu",
    dense_k: int = 0,
) -> dict:
    out = os.path.join(tmp, f"{kind}{trainers}.json")
    run_checked(
        fleetrun_cmd(
            "--server_num",
            "1",
            "--worker_num",
            str(trainers),
            "--log_dir",
            os.path.join(tmp, f"log_{kind}"),
            "--tee",
            "none",
            "bench/bench_ps_pass_cache.py",
            "--worker",
            kind,
            "--data",
            data,
            "--out",
            out,
            "--train",
            str(train),
            "--test",
            str(test),
            "--device",
            device,
            "--dense_k",
            str(dense_k),
        ),
        cwd=REPO,
        env=bench_env(),
    )
    with open(out) as f:
        return json.load(f)


def write_files(tmp: str, train: int) -> str:
    """The first ``train`` generated examples as ``FILES`` slot files under ``tmp``; the dir."""
    data = os.path.join(tmp, "data")
    run_checked(
        [sys.executable, "examples/ctr/gen_slot_files.py", "--out_dir", data]
        + ["--num_files", str(FILES), "--lines_per_file", str(train // FILES)],
        cwd=REPO,
    )
    return data


def run_baseline(train: int, test: int) -> dict:
    out = run_checked(
        [sys.executable, "-m", "examples.ctr.baseline", "--train", str(train), "--test", str(test)]
        + ["--threads", "1", "--json"],
        cwd=REPO,
    ).stdout
    d = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
    return {"examples_per_s": d["train_examples_per_s"], "auc": d["test_auc"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--train", type=int, default=100_000)
    ap.add_argument("--test", type=int, default=20_000)
    ap.add_argument("--gpu", action="store_true", help="the trainer's model on CUDA")
    ap.add_argument("--worker", choices=["pass", "async"])
    ap.add_argument("--device", default="cpu", help="the fleetrun script's model device")
    ap.add_argument("--dense_k", type=int, default=0, help="the fleetrun script's GEO k_steps")
    ap.add_argument("--data")
    ap.add_argument("--out")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.gpu:
        gpu_main(args)
        return
    order = ("pass", "passgeo", "async", "baseline", "pass2", "passgeo2", "async2")
    res: dict[str, list[dict]] = {kind: [] for kind in order}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_files(tmp, args.train)
        for rep in range(args.reps):
            for kind in order if rep % 2 == 0 else order[::-1]:
                if kind == "baseline":
                    r = run_baseline(args.train, args.test)
                else:
                    trainers = 2 if kind.endswith("2") else 1
                    geo = kind.startswith("passgeo")
                    worker_kind = "pass" if geo else kind.rstrip("2")
                    r = run_ps(
                        worker_kind,
                        data,
                        args.train,
                        args.test,
                        tmp,
                        trainers,
                        dense_k=DENSE_K if geo else 0,
                    )
                res[kind].append(r)
    speed = {k: Stats.of([r["examples_per_s"] for r in v]) for k, v in res.items()}
    auc = {k: Stats.of([r["auc"] for r in v]) for k, v in res.items()}
    rpcs = Stats.of([r["sparse_rpcs"] for r in res["pass"]])
    report(
        f"CTR training over {args.train} examples in {FILES} slot files, 1 server + 1 trainer: "
        "pass cache vs single-process torch and vs the async RPC path",
        [
            (
                "pass cache examples/s vs baseline",
                speed["pass"],
                speed["baseline"],
                "pass/baseline",
            ),
            ("pass cache examples/s vs async", speed["pass"], speed["async"], "pass/async"),
            (
                "pass cache (dense GEO) examples/s vs baseline",
                speed["passgeo"],
                speed["baseline"],
                "passgeo/baseline",
            ),
        ],
        goal="pass/baseline >= 1.0; AUC within 0.003 of async",
        unit="ex/s",
        json_path=args.json,
        extra={
            "auc_pass": auc["pass"].__dict__,
            "auc_async": auc["async"].__dict__,
            "auc_baseline": auc["baseline"].__dict__,
            "auc_pass_2_trainers": auc["pass2"].__dict__,
            "auc_async_2_trainers": auc["async2"].__dict__,
            "auc_passgeo": auc["passgeo"].__dict__,
            "auc_passgeo_2_trainers": auc["passgeo2"].__dict__,
            "dense_k": DENSE_K,
            "sparse_rpcs_per_pass": rpcs.__dict__,
        },
    )
    print(
        f"test AUC: pass cache {auc['pass'].fmt('', digits=4)} | async "
        f"{auc['async'].fmt('', digits=4)} | baseline {auc['baseline'].fmt('', digits=4)}"
    )
    print(
        f"test AUC, 2 trainers: pass cache {auc['pass2'].fmt('', digits=4)} | async "
        f"{auc['async2'].fmt('', digits=4)}"
    )
    print(
        f"pass cache with dense GEO (k_steps {DENSE_K}): test AUC "
        f"{auc['passgeo'].fmt('', digits=4)}, 2 trainers {auc['passgeo2'].fmt('', digits=4)}"
    )
    print(f"sparse RPCs per pass (2 tables): {rpcs.median:.0f} (async path: per step)")


def gpu_main(args: argparse.Namespace) -> None:
    """``--gpu``: the pass cache on the GPU against the same GPU trainer pulling per step."""
    import torch

    if not torch.cuda.is_available():
        reason = "no CUDA device: the GPU pass cache needs one"
        print(f"[bench_ps_pass_cache] skipped: {reason}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": reason}, f)
        return
    res: dict[str, list[dict]] = {"pass": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_files(tmp, args.train)
        for rep in range(args.reps):
            for kind in ("pass", "async") if rep % 2 == 0 else ("async", "pass"):
                res[kind].append(run_ps(kind, data, args.train, args.test, tmp, device="cuda"))
    speed = {k: Stats.of([r["examples_per_s"] for r in v]) for k, v in res.items()}
    auc = {k: Stats.of([r["auc"] for r in v]) for k, v in res.items()}
    report(
        f"CTR training over {args.train} examples, 1 server + 1 trainer, the model on "
        f"{torch.cuda.get_device_name()}: pass cache vs pulling per step",
        [
            (
                "GPU trainer examples/s, pass cache vs per step",
                speed["pass"],
                speed["async"],
                "pass/per-step",
            ),
            (
                "GPU trainer test AUC, pass cache vs per step",
                auc["pass"],
                auc["async"],
                "pass/per-step",
            ),
        ],
        goal="pass/per-step >= 3.0",
        unit="",
        json_path=args.json,
        extra={"row_units": ["ex/s", "AUC"]},
    )


if __name__ == "__main__":
    main()
