"""The pipeline transport on real processes (2 and 4 stages, CPU, gloo): every receive is posted
ahead of need (pp_schedule.P2P), yet activation shapes may change between calls (sequence
length, train vs eval), a stage may pass several tensors (one an integer tensor that carries no
gradient), the loss reaches every stage, and nothing is left outstanding after a call — with the
losses and weights of the single-process model under both schedules.

Run by pytest; the module is also the worker script (``python test_pipeline_transport.py``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

TOL = 1e-5  # float32
HIDDEN, MBS, ACC = 8, 2, 3
SEQS = (3, 5, 3, 4)  # sequence length per train_batch call: change, change back, change again


def with_mask(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 0's last entry: the activation plus an int64 mask (no gradient travels back)."""
    return h, (torch.arange(h.shape[1]) % 2).expand(h.shape[0], -1).contiguous()


def apply_mask(pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    h, mask = pair
    return h * (1 + mask.unsqueeze(-1).to(h.dtype))


def make_descs() -> list:
    from fleet.meta_parallel import LayerDesc

    lin = LayerDesc(nn.Linear, HIDDEN, HIDDEN)
    # cut uniformly: the (activation, mask) pair crosses the middle boundary at 2 and 4 stages
    return [lin, LayerDesc(nn.Tanh), lin, with_mask, apply_mask, lin, LayerDesc(nn.Tanh), lin]


def batch(seq: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(MBS * ACC, seq, HIDDEN, generator=g),
        torch.randn(MBS * ACC, seq, HIDDEN, generator=g),
    )


def worker(out: str, schedule: str, pp: int) -> None:
    import torch.distributed as tdist

    import fleet
    from fleet.base.topology import HybridCommunicateGroup, build_topology
    from fleet.meta_parallel import PipelineLayer, PipelineParallel

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"pp_degree": pp}
    strategy.pipeline_configs = {
        "micro_batch_size": MBS,
        "accumulate_steps": ACC,
        "schedule_mode": schedule,
    }
    fleet.init(is_collective=True, strategy=strategy)
    hcg = HybridCommunicateGroup(build_topology(strategy.hybrid_configs, tdist.get_world_size()))
    torch.manual_seed(0)
    ref = PipelineLayer(make_descs(), num_stages=1, stage_id=0, loss_fn=nn.MSELoss())
    pipe = PipelineLayer(make_descs(), topology=hcg.topology(), loss_fn=nn.MSELoss())
    pipe.load_state_dict({k: v for k, v in ref.state_dict().items() if k in pipe.state_dict()})
    model = PipelineParallel(pipe, hcg, strategy)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rec: dict = {"loss_err": 0.0, "losses": [], "outstanding": []}
    for step, seq in enumerate(SEQS):
        x, y = batch(seq, step)
        loss = model.train_batch([x, y], opt)
        rec["outstanding"].append(model._p2p.outstanding)
        ref_opt.zero_grad()
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        rec["losses"].append(float(loss))
        rec["loss_err"] = max(rec["loss_err"], abs(float(loss) - float(ref_loss)))
    x, y = batch(7, 99)  # eval at yet another length
    with torch.no_grad():
        rec["eval_err"] = abs(
            float(model.eval_batch([x, y])) - float(nn.functional.mse_loss(ref(x), y))
        )
        outs = model.eval_batch([x, None], compute_loss=False)
        rec["out_err"] = float((outs - ref(x)).abs().max()) if outs is not None else 0.0
    rec["outstanding"].append(model._p2p.outstanding)
    ref_state = ref.state_dict()
    rec["param_err"] = max(
        float((v - ref_state[k]).abs().max()) for k, v in pipe.state_dict().items()
    )
    rank = tdist.get_rank()
    Path(out, f"rank{rank}.json").write_text(json.dumps(rec))
    tdist.barrier()
    tdist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("schedule", "pp"),
    [
        pytest.param("1F1B", 2, marks=pytest.mark.slow),
        ("FThenB", 2),
        pytest.param("1F1B", 4, marks=pytest.mark.slow),
    ],
)
def test_transport_with_changing_shapes_matches_the_single_process_model(
    tmp_path: Path, schedule: str, pp: int
) -> None:
    from conftest import assert_all_ok, run_workers

    results = run_workers(
        Path(__file__),
        pp,
        ["--out", str(tmp_path), "--schedule", schedule, "--pp", str(pp)],
        timeout=100,
        tmp_path=tmp_path,
    )
    assert_all_ok(results)
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(pp)]
    for rec in recs[:-1]:  # the loss reached every stage, passed back along the pipeline
        assert rec["losses"] == recs[-1]["losses"]
    for rec in recs:
        assert rec["loss_err"] <= TOL, rec
        assert rec["eval_err"] <= TOL, rec
        assert rec["out_err"] <= TOL, rec
        assert rec["param_err"] <= TOL, rec
        assert rec["outstanding"] == [0] * (len(SEQS) + 1), rec  # nothing left posted


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--pp", type=int, default=2)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    worker(args.out, args.schedule, args.pp)
