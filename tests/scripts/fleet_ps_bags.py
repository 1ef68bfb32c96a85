"""DistributedEmbedding input forms: [B, L] with pooling equals 1-D ids + offsets (multi-hot
bags of different lengths) equals a jagged slot (values + offsets [B+1]); a list / dict of slots
is one pull; forward and the pushed gradients; prints BAGS_OK."""

from types import SimpleNamespace

import numpy as np
import torch

import fleet
from ps_server import SGD, Uniform

fleet.init(is_collective=False)
emb = fleet.DistributedEmbedding(
    "bags", 3, optimizer=SGD(0.5), initializer=Uniform(-1, 1), pooling="sum"
)
mean = fleet.DistributedEmbedding(
    "bags_mean", 3, optimizer=SGD(0.5), initializer=Uniform(-1, 1), pooling="mean"
)
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
else:
    fleet.init_worker()
    from fleet.ps.runtime import get_client, get_communicator

    ids2d = torch.tensor([[5, -7, 5], [2**62, 3, -(2**63)]], dtype=torch.int64)
    rows = {
        k: get_client().pull_sparse("bags", np.array([k], np.int64))[0]
        for k in ids2d.reshape(-1).tolist()
    }
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

    # Jagged slots (the layout of a fleet.data batch's sparse slot): values + offsets [B+1].
    slot_a = SimpleNamespace(values=flat, offsets=torch.tensor([0, 3, 6, 7]))
    slot_b = SimpleNamespace(
        values=torch.tensor([9, 2**62, 11], dtype=torch.int64), offsets=torch.tensor([0, 0, 2, 3])
    )  # an empty bag first
    emb.eval()
    assert torch.allclose(emb(slot_a), emb(flat, offsets), atol=1e-6)
    comm = get_communicator()
    pulls = []
    real_pull = comm.pull_sparse
    comm.pull_sparse = lambda table, keys: pulls.append(len(keys)) or real_pull(table, keys)
    both = emb([slot_a, slot_b])
    assert pulls == [len(set(flat.tolist()) | {9, 2**62, 11})], pulls  # one pull, ids deduplicated
    comm.pull_sparse = real_pull
    assert [t.shape for t in both] == [(3, 3), (3, 3)]
    assert torch.allclose(both[0], emb(slot_a), atol=1e-6)
    assert torch.allclose(both[1], emb(slot_b), atol=1e-6)
    assert torch.equal(both[1][0], torch.zeros(3))  # an empty bag pools to zeros
    named = emb({"a": slot_a, "b": slot_b})
    assert list(named) == ["a", "b"] and torch.allclose(named["b"], both[1])
    emb.train()
    before = get_client().pull_sparse("bags", np.array([11], np.int64))[0]
    out = emb([slot_a, slot_b])
    (out[0].sum() + out[1].sum()).backward()
    opt.step()
    after11 = get_client().pull_sparse("bags", np.array([11], np.int64))[0]
    assert np.allclose(after11, before - 0.5, atol=1e-6), (after11, before)
    for bad_slot, words in (
        (SimpleNamespace(values=flat, offsets=torch.tensor([0, 3])), "offsets"),
        ("not a slot", "expected a sparse slot"),
    ):
        try:
            emb([slot_a, bad_slot])
        except Exception as err:  # noqa: BLE001 - checking the message
            assert words in str(err), err
        else:
            raise AssertionError(f"{bad_slot} was accepted")
    plain = fleet.DistributedEmbedding("bags_plain", 3)  # pooling None: a slot is a bag, refused
    try:
        plain(slot_a)
    except Exception as err:  # noqa: BLE001 - checking the message
        assert "pooling" in str(err), err
    else:
        raise AssertionError("a slot without pooling was accepted")

    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([1, 2, 3])):
        try:
            emb(bad)
        except Exception as err:  # noqa: BLE001 - checking the message
            assert "ids" in str(err), err
        else:
            raise AssertionError(f"{bad} was accepted")
    print("BAGS_OK", flush=True)
    fleet.stop_worker()
