"""Launch-to-exit of a trivial 2-worker job on Ray: ``fleetrun --scheduler ray`` vs Ray Train's
``TorchTrainer``, same function, same already-running cluster, same run.

The job (:func:`allreduce_once`): 2 workers join a gloo process group, do one ``all_reduce`` of
one float, and exit. Ray Train sets the process group up itself before calling the function; the
fleetrun worker (this file with ``--worker``) does ``init_process_group`` from the env contract,
calls the same function, and destroys the group — both sides include group set-up.

* **ours**: ``python -m launcher -c JOB`` (a job file: scheduler ray, ``ray.address`` = the
  cluster, 2 trainers of 1 CPU / 256Mi, ``tee: none``), timed from ``Popen`` to exit: CLI start,
  joining the cluster, placement group, 2 actors, 2 worker processes (python + torch import),
  teardown.
* **peer**: ``python bench/bench_ray_launch.py --torchtrainer ADDRESS`` — a fresh driver process
  that joins the cluster and runs ``TorchTrainer(fn, scaling_config=ScalingConfig(num_workers=2,
  resources_per_worker={"CPU": 1}), run_config=RunConfig(storage_path=tmp)).fit()``, timed the
  same way (its workers are Ray worker processes that import torch too).

The cluster: ``ray start --head --block`` on 127.0.0.1 with 4 logical CPUs, no dashboard, usage
stats off, in a private temp dir; started once before the measurements (not timed) and stopped
at the end. One warm-up run of each, then ``--reps`` (>= 5) alternating runs (order flips every
repetition). Reported: median [min .. max] seconds and ours/peer (goal <= 1.2).

Run: ``.venv/bin/python bench/bench_ray_launch.py [--reps 5] [--json bench/results/ray_launch.json]``
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, Stats, bench_env, report

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def allreduce_once() -> float:
    """The job's function: one all_reduce of (rank + 1) over the current process group."""
    import torch
    import torch.distributed as torch_dist

    t = torch.tensor([float(torch_dist.get_rank() + 1)])
    torch_dist.all_reduce(t)
    return float(t.item())


def worker_main() -> None:
    """fleetrun's worker: group from the env contract, the function, group destroyed."""
    import torch.distributed as torch_dist

    torch_dist.init_process_group("gloo")
    total = allreduce_once()
    expected = torch_dist.get_world_size() * (torch_dist.get_world_size() + 1) / 2
    if total != expected:
        raise SystemExit(f"all_reduce gave {total}, expected {expected}")
    torch_dist.destroy_process_group()


def torchtrainer_main(address: str) -> None:
    """The peer: a driver that runs :func:`allreduce_once` on 2 Ray Train workers."""
    os.environ.update(RAY_ENV)
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    with tempfile.TemporaryDirectory(prefix="frt-train-") as storage:
        trainer = TorchTrainer(
            allreduce_once,
            scaling_config=ScalingConfig(
                num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(storage_path=storage, name="bench"),
        )
        trainer.fit()
    ray.shutdown()


def start_cluster(temp: str) -> tuple[subprocess.Popen, str]:
    """``ray start --head --block`` on loopback; returns (process, address) once it accepts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "4",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--temp-dir",
            temp,
        ],
        env={**bench_env(), **RAY_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while True:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return head, f"127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("ray head did not come up in 120 s") from None
            time.sleep(0.5)


def stop_cluster(head: subprocess.Popen) -> None:
    head.send_signal(signal.SIGTERM)
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def timed(cmd: list[str], env: dict[str, str], cwd: str) -> float:
    """Seconds from start to exit of ``cmd``; raises with its output if it fails."""
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torchtrainer", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main()
        return
    if args.torchtrainer:
        torchtrainer_main(args.torchtrainer)
        return
    if args.reps < 5:
        p.error("--reps must be >= 5")
    import yaml

    env = {**bench_env(), **RAY_ENV, "RAY_AUTH_MODE": "token"}  # ray start --head uses token auth
    env.pop("RAY_ADDRESS", None)
    with tempfile.TemporaryDirectory(prefix="frt-") as temp:
        head, address = start_cluster(temp)
        try:
            job = os.path.join(temp, "job.yaml")
            with open(job, "w", encoding="utf-8") as f:
                yaml.safe_dump(
                    {
                        "name": "bench-ray-launch",
                        "scheduler": "ray",
                        "entrypoint": {"script": os.path.abspath(__file__), "args": ["--worker"]},
                        "sizes": {"nproc_per_node": 2},
                        "backend": "gloo",
                        "tee": "none",
                        "resources": {"trainer": {"cpu": 1, "memory": "256Mi"}},
                        "log_dir": os.path.join(temp, "log"),
                        "ray": {"address": address},
                    },
                    f,
                )
            cmds = {
                "ours": [sys.executable, "-m", "launcher", "-c", job],
                "peer": [sys.executable, os.path.abspath(__file__), "--torchtrainer", address],
            }
            times: dict[str, list[float]] = {"ours": [], "peer": []}
            for name, cmd in cmds.items():  # warm-up (worker pool, imports in the page cache)
                print(f"warm-up {name}: {timed(cmd, env, REPO):.2f} s", flush=True)
            for rep in range(args.reps):
                order = ["ours", "peer"] if rep % 2 == 0 else ["peer", "ours"]
                for name in order:
                    dt = timed(cmds[name], env, REPO)
                    times[name].append(dt)
                    print(f"rep {rep} {name}: {dt:.2f} s", flush=True)
        finally:
            stop_cluster(head)
    from importlib.metadata import version

    report(
        "Ray launch-to-exit, trivial 2-worker all_reduce job (fleetrun --scheduler ray vs TorchTrainer)",
        [
            (
                "launch-to-exit, same running local cluster (4 logical CPUs)",
                Stats.of(times["ours"]),
                Stats.of(times["peer"]),
                "ours/peer, lower is better",
            )
        ],
        goal="<= 1.2",
        extra={"ray": version("ray"), "times": times},
        json_path=args.json or None,
    )


if __name__ == "__main__":
    main()
