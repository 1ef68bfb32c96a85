"""A training script with ``DistributedStrategy(auto=True)``: fleet.init applies the planner's
pick; the script prints the degrees the job runs with (``auto degrees: {"dp": ..}``) and
the planned keys of its strategy.

Usage (under fleetrun): ``planner_auto.py MODEL SAMPLE GLOBAL_BATCH [MEMORY_MB]``.
"""

from __future__ import annotations

import json
import sys

import fleet
from fleet.base.runtime import get_runtime


def main() -> None:
    model, sample, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    memory_mb = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    strategy = fleet.DistributedStrategy()
    strategy.auto = True
    strategy.auto_configs = {
        "model": model,
        "sample": sample,
        "global_batch_size": batch,
        "memory_per_device_MB": memory_mb,
    }
    fleet.init(is_collective=True, strategy=strategy)
    runtime = get_runtime("planner_auto")
    assert runtime.strategy is strategy, "fleet.init must update the script's strategy object"
    hcg = runtime.hcg
    if hcg is None:
        degrees = {"dp": runtime.dp_degree, "mp": 1, "pp": 1, "sharding": 1}
    else:
        degrees = {
            "dp": hcg.get_data_parallel_world_size(),
            "mp": hcg.get_model_parallel_world_size(),
            "pp": hcg.get_pipe_parallel_world_size(),
            "sharding": hcg.get_sharding_parallel_world_size(),
        }
    pc = strategy.pipeline_configs
    planned = {
        "micro_batch_size": pc.micro_batch_size,
        "accumulate_steps": pc.accumulate_steps,
        "recompute": strategy.recompute,
        "stage": strategy.sharding_configs.stage if strategy.sharding else 0,
        "auto": strategy.auto,
    }
    # fleet.init again with the same (now resolved) object keeps the plan's degrees
    fleet.init(is_collective=True, strategy=strategy)
    again = get_runtime("planner_auto").strategy.hybrid_configs
    assert again == strategy.hybrid_configs, (again, strategy.hybrid_configs)
    if fleet.worker_index() == 0:
        print("auto degrees: " + json.dumps(degrees, sort_keys=True), flush=True)
        print("auto planned: " + json.dumps(planned, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
