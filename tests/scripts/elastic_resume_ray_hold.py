"""Fixture for tests/test_elastic_ray.py: another user of the Ray cluster, holding CPUs.

``python elastic_resume_ray_hold.py ADDRESS CPUS`` joins the cluster, places a placement group
of one ``{"CPU": CPUS}`` bundle, prints ``HOLDING``, and on a ``release`` line on stdin removes
it and prints ``RELEASED``; end of input disconnects.
"""

from __future__ import annotations

import sys

from launcher.schedulers.ray.cluster import prepare_ray_env

prepare_ray_env(joining=True)

import ray  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402


def main() -> None:
    ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
    try:
        pg = placement_group([{"CPU": float(sys.argv[2])}], name="elastic-test-hold")
        ray.get(pg.ready(), timeout=120)
        print("HOLDING", flush=True)
        for line in sys.stdin:
            if line.strip() == "release":
                remove_placement_group(pg)
                print("RELEASED", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
