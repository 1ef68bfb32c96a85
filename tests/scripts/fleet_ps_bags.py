"""DistributedEmbedding input forms: [B, L] with pooling equals 1-D ids + offsets (multi-hot
bags of different lengths), forward and the pushed gradients; prints BAGS_OK."""

import numpy as np
import torch

import fleet
from ps_server import SGD, Uniform

fleet.init(is_collective=False)
emb = fleet.DistributedEmbedding("bags", 3, optimizer=SGD(0.5), initializer=Uniform(-1, 1), pooling="sum")
mean = fleet.DistributedEmbedding("bags_mean", 3, optimizer=SGD(0.5), initializer=Uniform(-1, 1), pooling="mean")
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
else:
    fleet.init_worker()
    from fleet.ps.runtime import get_client

    ids2d = torch.tensor([[5, -7, 5], [2**62, 3, -(2**63)]], dtype=torch.int64)
    rows = {k: get_client().pull_sparse("bags", np.array([k], np.int64))[0] for k in ids2d.reshape(-1).tolist()}
    out2d = emb(ids2d)
    expect = torch.tensor(np.array([sum(rows[k] for k in r) for r in ids2d.tolist()]))
    assert torch.allclose(out2d, expect, atol=1e-6), (out2d, expect)
    flat = torch.tensor([5, -7, 5, 2**62, 3, -(2**63), 9], dtype=torch.int64)
    offsets = torch.tensor([0, 3, 6], dtype=torch.int64)  # bags of 3, 3 and 1 ids
    out_bag = emb(flat, offsets)
    assert torch.allclose(out_bag[:2], out2d, atol=1e-6), (out_bag, out2d)
    m = mean(flat, offsets)
    assert m.shape == (3, 3)
    opt = fleet.distributed_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    (out2d.sum() + m.sum()).backward()
    opt.step()
    after = get_client().pull_sparse("bags", np.array([5, -7], np.int64))
    # d(sum of all outputs)/d(row 5) = 2 (it appears twice), row -7: 1; SGD lr 0.5
    assert np.allclose(after[0], rows[5] - 0.5 * 2, atol=1e-6), (after[0], rows[5])
    assert np.allclose(after[1], rows[-7] - 0.5 * 1, atol=1e-6)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([1, 2, 3])):
        try:
            emb(bad)
        except Exception as err:  # noqa: BLE001 - checking the message
            assert "ids" in str(err), err
        else:
            raise AssertionError(f"{bad} was accepted")
    print("BAGS_OK", flush=True)
    fleet.stop_worker()
