"""One trainer of the fleet.data global-shuffle test (run by fleetrun, world 2).

Loads its ``fleet.util.shard_files`` share of ``--files`` (lines
``1 <uid> <k> ids.. 2 <uid> -<uid>``, ids ``uid * 10 + j``), global-shuffles over the job's gloo
group, and writes OUT/rank<R>.json: the sizes before and after (local and summed over
trainers) and the uids it holds, with whether every example still carries its own ids and
dense values.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.distributed as tdist

import fleet
from collective.group import init_parallel_env
from fleet.data import InMemoryDataset, Slot

p = argparse.ArgumentParser()
p.add_argument("--files", required=True, help="comma-separated slot files")
p.add_argument("--out", required=True)
p.add_argument("--seed", type=int, default=5)
args = p.parse_args()

env = init_parallel_env(backend="gloo")
rank, world = tdist.get_rank(), tdist.get_world_size()
shard = fleet.util.shard_files(args.files.split(","), rank, world)
ds = InMemoryDataset()
ds.init(
    batch_size=100,
    thread_num=2,
    block_bytes=4096,
    use_var=[
        Slot("uid", dense=True),
        Slot("ids"),
        Slot("dense", dtype="float32", dense=True, dim=2),
    ],
)
ds.set_filelist(shard)
ds.load_into_memory()
rec = {
    "rank": rank,
    "world": world,
    "shard": shard,
    "loaded": len(ds),
    "loaded_total": ds.get_memory_data_size(fleet),
}
loaded_uids = sorted(int(u) for b in ds for u in b["uid"].reshape(-1).tolist())
ds.set_shuffle_seed(args.seed)
ds.global_shuffle(fleet, thread_num=12)
uids, consistent = [], True
for b in ds:
    v, o = b["ids"].values.tolist(), b["ids"].offsets.tolist()
    for k, uid in enumerate(b["uid"].reshape(-1).tolist()):
        uids.append(uid)
        consistent &= v[o[k] : o[k + 1]] == [uid * 10 + j for j in range(uid % 4)]
        consistent &= b["dense"][k].tolist() == [float(uid), float(-uid)]
rec.update(
    held=len(ds),
    memory_total=ds.get_memory_data_size(fleet),
    shuffle_total=ds.get_shuffle_data_size(fleet),
    shuffle_local=ds.get_shuffle_data_size(),
    uids=uids,
    consistent=consistent,
    moved=sorted(uids) != loaded_uids,
)
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(rec, f)
print(
    f"rank {rank}: loaded {rec['loaded']}, holds {rec['held']} after the global shuffle", flush=True
)
