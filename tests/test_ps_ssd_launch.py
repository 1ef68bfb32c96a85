"""fleetrun's ``--ps_ssd_dir`` / ``ps: {ssd_dir: ...}``: each server gets ``<dir>/server-<i>``
as its SSD root (FLEET_PS_SSD_ROOT, read by ``fleet.init_server``); bad values are refused
naming the flag; the CTR example trains with SSD tables end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import REPO, gen_slot_files, run_fleetrun

from collective.errors import ConfigError
from launcher.ps_env import FLEET_PS_SSD_ROOT, check_ps_ssd_dir, ps_ssd_root_env
from launcher.schedulers.k8s.render import check_renderable, render_job
from launcher.schedulers.local.plan import Placement, PSPlan
from launcher.spec import build_spec


def _spec(tmp_path: Path, **extra: object) -> dict:
    data: dict = {
        "entrypoint": {"script": "train.py"},
        "mode": "ps",
        "sizes": {"server_num": 2, "worker_num": 1},
        "log_dir": str(tmp_path / "log"),
    }
    data.update(extra)
    return data


def test_job_file_key_gives_each_server_its_own_directory(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    spec = build_spec(_spec(tmp_path, ps={"ssd_dir": str(ssd)}))
    assert spec.ps.ssd_dir == str(ssd)
    assert ps_ssd_root_env(spec, 1) == {FLEET_PS_SSD_ROOT: str(ssd / "server-1")}
    place = Placement(1, 0, "127.0.0.1", None, "127.0.0.1", "run")
    (tmp_path / "log").mkdir()
    procs = PSPlan(spec, place, None).specs(0)
    assert ssd.is_dir()  # created by the launcher, writable
    roots = {(p.role, p.rank): p.env.get(FLEET_PS_SSD_ROOT) for p in procs}
    assert roots[("server", 0)] == str(ssd / "server-0")
    assert roots[("server", 1)] == str(ssd / "server-1")
    assert roots[("trainer", 0)] is None
    no_ssd = build_spec(_spec(tmp_path))
    assert ps_ssd_root_env(no_ssd, 0) == {}


def test_ray_servers_get_their_directories() -> None:
    pytest.importorskip("ray")
    from launcher.schedulers.ray.plan import AttemptPaths, Placed, make_proc_specs, make_slots

    spec = build_spec(
        {
            "entrypoint": {"script": "t.py"},
            "mode": "ps",
            "scheduler": "ray",
            "sizes": {"server_num": 2, "worker_num": 1},
            "ps": {"ssd_dir": "/nvme/ps"},
        }
    )
    placed = [Placed(s, "10.0.0.1", "a", (), 7000 + i) for i, s in enumerate(make_slots(spec))]
    procs, _ = make_proc_specs(spec, placed, 0, AttemptPaths("rid", 0, 0, "/logs", None))
    roots = {(p.role, p.rank): p.env.get(FLEET_PS_SSD_ROOT) for p in procs}
    assert roots == {
        ("server", 0): "/nvme/ps/server-0",
        ("server", 1): "/nvme/ps/server-1",
        ("trainer", 0): None,
    }


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"ps": {"ssd_dir": "relative/ssd"}}, "must be an absolute directory path"),
        ({"mode": "collective", "sizes": {}, "ps": {"ssd_dir": "/tmp/x"}}, "is for PS jobs"),
    ],
)
def test_bad_ssd_dir_in_the_job_file(tmp_path: Path, data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_spec(_spec(tmp_path, **data))
    assert err.value.key == "ps.ssd_dir"
    assert fragment in str(err.value) and "--ps_ssd_dir" in str(err.value)


def test_ssd_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    spec = build_spec(_spec(tmp_path, ps={"ssd_dir": str(blocker / "ssd")}))
    with pytest.raises(ConfigError, match="--ps_ssd_dir / ps.ssd_dir .* cannot be created"):
        check_ps_ssd_dir(spec)


def _server_pod(objs: list[dict]) -> dict:
    (sts,) = [
        o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-server")
    ]
    return sts["spec"]["template"]["spec"]


@pytest.mark.parametrize("version", ["1.28.0", "1.31.0"])
def test_kubernetes_server_pods_get_an_ssd_volume(tmp_path: Path, version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    spec = build_spec(_spec(tmp_path, name="ctr", scheduler="k8s", ps={"ssd_dir": "/mnt/ssd/"}))
    objs = render_job(spec, ps_token="t")
    for obj in objs:
        if obj["kind"] != "PodGroup":
            kubernetes_validate.validate(obj, version, strict=True)
    pod = _server_pod(objs)
    (container,) = pod["containers"]
    names = [e["name"] for e in container["env"]]
    root = container["env"][names.index(FLEET_PS_SSD_ROOT)]
    assert root["value"] == "/mnt/ssd/$(FLEET_POD_NAME)"  # one directory per server pod
    assert names.index("FLEET_POD_NAME") < names.index(FLEET_PS_SSD_ROOT)  # expanded
    assert {"name": "ps-ssd", "emptyDir": {}} in pod["volumes"]
    assert {"name": "ps-ssd", "mountPath": "/mnt/ssd"} in container["volumeMounts"]
    for obj in objs:  # the trainers get neither
        if obj["kind"] == "Job":
            tpod = obj["spec"]["template"]["spec"]
            assert all(v["name"] != "ps-ssd" for v in tpod["volumes"])
            assert all(e["name"] != FLEET_PS_SSD_ROOT for e in tpod["containers"][0]["env"])


def test_kubernetes_ssd_dir_on_a_volume_of_the_job_adds_none(tmp_path: Path) -> None:
    k8s = {
        "volumes": [{"name": "nvme", "hostPath": {"path": "/nvme", "type": "Directory"}}],
        "volume_mounts": [{"name": "nvme", "mountPath": "/mnt/nvme"}],
    }
    spec = build_spec(
        _spec(tmp_path, name="ctr", scheduler="k8s", k8s=k8s, ps={"ssd_dir": "/mnt/nvme/ps"})
    )
    check_renderable(spec)
    pod = _server_pod(render_job(spec, ps_token="t"))
    assert [v["name"] for v in pod["volumes"]] == ["fleetrun-config", "nvme"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[FLEET_PS_SSD_ROOT] == "/mnt/nvme/ps/$(FLEET_POD_NAME)"


def test_server_start_creates_its_directory_or_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ps_server.server import ssd_root_from_env

    monkeypatch.setenv(FLEET_PS_SSD_ROOT, str(tmp_path / "ssd" / "server-0"))
    assert ssd_root_from_env() == str(tmp_path / "ssd" / "server-0")
    assert (tmp_path / "ssd" / "server-0").is_dir()
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv(FLEET_PS_SSD_ROOT, str(tmp_path / "f" / "server-0"))
    with pytest.raises(ConfigError, match="--ps_ssd_dir") as err:
        ssd_root_from_env()
    assert err.value.key == FLEET_PS_SSD_ROOT
    monkeypatch.delenv(FLEET_PS_SSD_ROOT)
    assert ssd_root_from_env() is None


@pytest.mark.timeout(60)
def test_flag_with_a_relative_path_exits_2_naming_it(tmp_path: Path) -> None:
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        str(tmp_path / "log"),
        "--ps_ssd_dir",
        "ssd",
        "examples/ctr/train_ps.py",
        cwd=REPO,
    )
    assert r.returncode == 2, r.stderr
    assert "ps.ssd_dir" in r.stderr and "--ps_ssd_dir" in r.stderr
    assert "absolute" in r.stderr


@pytest.mark.timeout(120)
def test_ctr_example_trains_with_ssd_tables(tmp_path: Path) -> None:
    ssd, out = tmp_path / "ssd", tmp_path / "ctr.json"
    r = run_fleetrun(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--log_dir",
        str(tmp_path / "log"),
        "--ps_ssd_dir",
        str(ssd),
        "examples/ctr/train_ps.py",
        "--storage",
        "ssd",
        "--cache_rows",
        "500",
        "--train",
        "4000",
        "--test",
        "1000",
        "--json",
        str(out),
        cwd=REPO,
        timeout=100,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["storage"] == "ssd" and result["examples"] > 3000
    for table in ("ctr_dim1", "ctr_dim16"):  # both tables overflowed their 500-row caches
        tier = ssd / "server-0" / table / "shards-00000"
        assert (tier / "FLEET_SSD_TIER").exists()
        size = sum(f.stat().st_size for f in (tier / "db").iterdir() if f.is_file())
        assert size > 10_000, (table, size)
    assert os.listdir(ssd) == ["server-0"]


@pytest.mark.timeout(150)
def test_ctr_example_pass_cache_over_ssd_tables(tmp_path: Path) -> None:
    """``train_ps.py --pass_cache`` on SSD tables: the pass's rows come out of both tiers in one
    pull per table, its deltas and optimizer state go back in one push per table; the same
    job on memory tables ends with the same test AUC."""
    gen_slot_files(tmp_path / "slots", 2, 1500)
    results = {}
    for storage in ("ssd", "memory"):
        ssd, out = tmp_path / "ssd", tmp_path / f"{storage}.json"
        tables = ["--storage", "ssd", "--cache_rows", "500"] if storage == "ssd" else []
        r = run_fleetrun(
            "--server_num",
            "1",
            "--worker_num",
            "1",
            "--log_dir",
            str(tmp_path / f"log-{storage}"),
            *(["--ps_ssd_dir", str(ssd)] if storage == "ssd" else []),
            "examples/ctr/train_ps.py",
            *tables,
            "--data_dir",
            str(tmp_path / "slots"),
            "--pass_cache",
            "--mode",
            "sync",
            "--test",
            "1000",
            "--json",
            str(out),
            cwd=REPO,
            timeout=100,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        results[storage] = json.loads(out.read_text())
        log = (tmp_path / f"log-{storage}" / "workerlog.0").read_text()
        assert "pass: 4 sparse RPCs" in log, log[-2000:]  # 2 tables x (one pull + one push)
    result = results["ssd"]
    assert result["pass_cache"] and result["storage"] == "ssd" and result["examples"] >= 2560
    assert abs(result["test_auc"] - results["memory"]["test_auc"]) < 0.002, results
    for table in ("ctr_dim1", "ctr_dim16"):  # the pass's rows overflowed the caches to disk
        tier = ssd / "server-0" / table / "shards-00000" / "db"
        assert sum(f.stat().st_size for f in tier.iterdir() if f.is_file()) > 10_000, table


def test_ctr_example_pass_cache_needs_a_loaded_dataset() -> None:
    from examples.ctr.train_ps import parse_args

    for argv in (["--pass_cache"], ["--pass_cache", "--data_dir", "d", "--dataset", "queue"]):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2
