"""Shared helpers of the benchmarks: statistics of repeated timings, ratios, machine info, and
the runner of a fleetrun job of the CTR example (:func:`run_ctr_job`).

Every benchmark measures fleetrun and its peer (or limit) in the same run and prints
``median [min .. max]`` of >= 5 repetitions for both, and the ratio.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Stats:
    """median / min / max of one measured quantity."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
        return (
            f"{self.median * scale:.{digits}f} {unit} "
            f"[{self.min * scale:.{digits}f} .. {self.max * scale:.{digits}f}] (n={self.n})"
        )


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return {
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "platform": platform.platform(),
    }


def bench_env() -> dict[str, str]:
    """Environment for benchmark subprocesses: no inherited contract, 1 thread per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET", "PADDLE_", "PET_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def fleetrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_checked(cmd: list[str], timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess:
    """Run ``cmd``; raise with its output if it fails."""
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=kw.pop("env", bench_env()),
        check=False,
        **kw,
    )
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def run_ctr_job(
    tmp: str,
    train: int,
    test: int,
    *,
    mode: str = "async",
    workers: int = 1,
    script: str = "examples/ctr/train_ps.py",
    fleet_args: Sequence[str] = (),
    script_args: Sequence[str] = (),
) -> dict[str, Any]:
    """One ``fleetrun --server_num 1 --worker_num <workers>`` job of a CTR example script
    (``examples/ctr``) on ``train`` + ``test`` generated examples in ``mode``, its logs under
    ``<tmp>/log``; ``fleet_args`` go to fleetrun, ``script_args`` to the script. Returns the JSON
    the script writes (``examples_per_s``, ``test_auc``, ``bayes_auc``, ...); raises with the
    job's output if it fails."""
    path = os.path.join(tmp, "ctr.json")
    run_checked(
        fleetrun_cmd(
            "--server_num",
            "1",
            "--worker_num",
            str(workers),
            *fleet_args,
            "--log_dir",
            os.path.join(tmp, "log"),
            "--tee",
            "none",
            script,
            "--train",
            str(train),
            "--test",
            str(test),
            "--mode",
            mode,
            "--json",
            path,
            *script_args,
        ),
        cwd=REPO,
        env=bench_env(),
    )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def report(
    title: str,
    rows: list[tuple[str, Stats, Stats, str]],
    goal: str,
    extra: dict[str, Any] | None = None,
    json_path: str | None = None,
    unit: str = "s",
) -> None:
    """Print ``ours vs peer`` rows with the ratio of medians, and optionally dump JSON."""
    info = machine_info()
    print(
        f"== {title} ==  ({info['date']}, {info['cpus']} CPUs, torch {info['torch']}, "
        f"python {info['python']})"
    )
    out_rows = []
    for label, ours, peer, ratio_kind in rows:
        ratio = ours.median / peer.median if peer.median else float("nan")
        print(
            f"{label}\n  fleetrun : {ours.fmt(unit)}\n  peer     : {peer.fmt(unit)}\n"
            f"  ratio ({ratio_kind}) = {ratio:.3f}   goal: {goal}"
        )
        out_rows.append(
            {
                "label": label,
                "ours": asdict(ours),
                "peer": asdict(peer),
                "ratio": ratio,
                "ratio_kind": ratio_kind,
            }
        )
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "title": title,
                    "machine": info,
                    "unit": unit,
                    "goal": goal,
                    "rows": out_rows,
                    **(extra or {}),
                },
                f,
                indent=2,
            )
