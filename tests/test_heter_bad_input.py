"""Heterogeneous PS jobs given bad input fail with errors that name the thing and the fix:
run_heter_worker without a HeterModel, trainers whose model is not a HeterModel, a cut whose
activations differ between trainers, a device that does not exist, a heter worker unreachable at
start or lost for good, a script without a heter-worker branch; and the Heter transport's own
checks (token, message bound).

The default run keeps one job of real processes (a cut that differs between trainers: the heter
worker's error reaches both trainers) and the in-process checks (the transport's token, message
bound and unavailable endpoint; device names; heter_configs); the other jobs are marked slow."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from collective.errors import ConfigError
from fleet.heter import resolve_device
from fleet.strategy import DistributedStrategy
from ps_server.heter_client import HeterClient, HeterUnavailableError
from ps_server.rpc.heter_service import HeterServer
from ps_server.rpc.status import PSUnauthenticatedError

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from heter_job import HeterJob


def _fails(job: HeterJob, name: str, *texts: str, timeout_s: float = 300.0) -> str:
    code = job.wait([name], timeout_s=timeout_s)[name]
    log = job.log(name)
    assert code != 0, log
    for text in texts:
        assert text in log, f"{text!r} not in:\n{log[-4000:]}"
    return log


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_heter_worker_scripts_without_a_heter_worker_branch(tmp_path: Path) -> None:
    """run_heter_worker without a model; the is_worker() path only; no branch at all; a
    device that does not exist. Each heter worker process fails alone (no servers needed)."""
    cases = {
        "no_model": ["needs the script's fleet.heter.HeterModel", "got NoneType"],
        "worker_only": ["this process is a heter worker", "fleet.run_heter_worker(model"],
        "fallthrough": ["without calling fleet.run_heter_worker", "is_heter_worker()"],
    }
    jobs = []
    try:
        for bad in cases:
            jobs.append(HeterJob(tmp_path / bad, ["--bad", bad]).start(roles=("heter",)))
        jobs.append(HeterJob(tmp_path / "dev", [], devices=("cuda:3",)).start(roles=("heter",)))
        for job, texts in zip(jobs, cases.values()):
            _fails(job, "heter.0", *texts)
        _fails(jobs[-1], "heter.0", "device 'cuda:3' does not exist on this host", "it has cpu")
    finally:
        for job in jobs:
            job.kill()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_trainers_without_a_heter_model(tmp_path: Path) -> None:
    job = HeterJob(tmp_path, ["--steps", "5", "--bad", "plain_model", "--recovery_s", "3"])
    try:
        # the heter worker first: the trainer fails within a second or two and its stop_worker
        # stops the server, which a heter worker still importing torch would never reach
        job.start(roles=("server", "heter"))
        job.wait_for_line("heter.0", "serving on")
        job.start(roles=("trainer",))
        _fails(job, "trainer.0", "built no fleet.heter.HeterModel", job.layout.heter_endpoints[0])
        _fails(job, "heter.0", "no CPU trainer ever sent a micro-batch", "not a fleet.heter")
    finally:
        job.kill()


@pytest.mark.timeout(420)
def test_cut_differs_between_trainers(tmp_path: Path) -> None:
    job = HeterJob(
        tmp_path,
        ["--steps", "20", "--mode", "async", "--bad", "shape", "--recovery_s", "3"],
        trainers=2,
    )
    try:
        job.start()
        heter = _fails(job, "heter.0", "the cut differs between trainers")
        assert "[B, 18] <f4" in heter and "[B, 16] <f4" in heter, heter
        assert "trainer 1 sends" in heter or "trainer 0 sends" in heter
        logs = job.log("trainer.0") + job.log("trainer.1")
        assert "the cut differs between trainers" in logs, job.logs()
    finally:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_heter_worker_unreachable_at_start(tmp_path: Path) -> None:
    job = HeterJob(tmp_path, ["--steps", "5", "--start_s", "3"])
    try:
        job.start(roles=("server", "trainer"))
        ep = job.layout.heter_endpoints[0]
        _fails(job, "trainer.0", f"heter worker {ep} is unreachable", "not serving after 3s")
    finally:
        job.kill()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_lost_heter_worker_fails_naming_it(tmp_path: Path) -> None:
    job = HeterJob(tmp_path, ["--steps", "200", "--mode", "async", "--k", "1", "--recovery_s", "3"])
    try:
        job.start()
        job.wait_for_line("trainer.0", "trainer 0 step 10")
        job.procs["heter.0"].kill()
        t0 = time.monotonic()
        ep = job.layout.heter_endpoints[0]
        _fails(job, "trainer.0", f"heter worker {ep} is unavailable", "got no answer for 3s")
        assert time.monotonic() - t0 < 120
    finally:
        job.kill()


def test_resolve_device() -> None:
    assert str(resolve_device("cpu", 0)) == "cpu"
    with pytest.raises(ConfigError, match=r"'tpu:0' is not cpu, cuda, cuda:N"):
        resolve_device("tpu:0", 0)
    if not __import__("torch").cuda.is_available():
        with pytest.raises(
            ConfigError, match=r"device 'gpu' does not exist on this host; it has cpu"
        ):
            resolve_device("gpu", 1)


def test_heter_configs_are_typed() -> None:
    s = DistributedStrategy()
    s.heter_configs = {"max_in_flight": 4}
    assert s.heter_configs.max_in_flight == 4
    with pytest.raises(ConfigError, match=r"heter_configs\.max_in_flight: must be >= 0"):
        s.heter_configs = {"max_in_flight": -1}
    with pytest.raises(ConfigError, match=r"unknown key"):
        s.heter_configs = {"in_flight": 1}


class _Echo:
    def hello(self, h, a):
        return {"index": 0}, {}

    def step(self, h, a):
        return {"loss": 0.5}, {"grad0": -a["act0"]}

    predict = stop = hello


@pytest.mark.timeout(30)
def test_transport_token_and_message_bound() -> None:
    server = HeterServer(_Echo(), "127.0.0.1", 0, token="job-token-123")
    port = server.start()
    try:
        ep = f"127.0.0.1:{port}"
        with HeterClient(ep, token="job-token-123", max_message_mb=1) as client:
            client.wait_ready(5)
            h, a = client.call("Step", {"trainer": 0}, {"act0": np.ones((4, 3), np.float32)})
            assert h["loss"] == 0.5 and a["grad0"].tolist() == [[-1.0] * 3] * 4
            with pytest.raises(ConfigError, match=r"exceeds the 1 MiB message limit"):
                client.call("Step", {"trainer": 0}, {"act0": np.ones((1 << 19,), np.float32)})
        with HeterClient(ep, token="another-token-456") as client:
            with pytest.raises(PSUnauthenticatedError):
                client.call("Hello", {"trainer": 0})
        with HeterClient("127.0.0.1:1", recovery_s=0.5) as client:
            with pytest.raises(HeterUnavailableError, match=r"127\.0\.0\.1:1 is unavailable"):
                client.call("Step", {"trainer": 0, "seq": 3})
    finally:
        server.stop()
