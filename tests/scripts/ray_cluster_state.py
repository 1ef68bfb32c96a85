"""Print, as JSON, what of fleetrun is still alive on a Ray cluster: live actors named
``fleetrun-*`` and placement groups named ``fleetrun-*`` that are not REMOVED.

``python ray_cluster_state.py ADDRESS`` (Ray env set as fleetrun sets it when joining)."""

import json
import sys

from launcher.schedulers.ray.cluster import prepare_ray_env

prepare_ray_env(joining=True)

import ray  # noqa: E402  (after prepare_ray_env, which sets Ray's env before it loads)

ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
try:
    actors = [
        a.get("Name") or a.get("name")
        for a in ray._private.state.actors().values()
        if (a.get("State") or a.get("state")) not in ("DEAD", 4)
        and str(a.get("Name") or a.get("name") or "").startswith("fleetrun-")
    ]
    pgs = [
        pg["name"]
        for pg in ray.util.placement_group_table().values()
        if str(pg.get("name", "")).startswith("fleetrun-") and pg.get("state") != "REMOVED"
    ]
    print(json.dumps({"actors": actors, "placement_groups": pgs}))
finally:
    ray.shutdown()
