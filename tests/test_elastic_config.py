"""Elastic jobs' config: torchrun and Paddle spellings land in one ElasticConfig; bad input names
the flag (pure, in-process: no rendezvous, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from collective.errors import ConfigError
from launcher.cli import run_command
from launcher.elastic.config import FAST_RDZV_CONF, RdzvBackend
from launcher.spec import build_spec, spec_to_dict

pytestmark = pytest.mark.timeout(60)


def _spec(data: dict):
    return build_spec({"entrypoint": {"script": "t.py"}, **data})


def test_torchrun_spelling_in_yaml_keys() -> None:
    spec = _spec(
        {
            "sizes": {"nnodes": "1:3"},
            "run_id": "job1",
            "elastic": {
                "rdzv_backend": "c10d",
                "rdzv_endpoint": "10.0.0.1",
                "rdzv_conf": "join_timeout=60,last_call_timeout=2",
            },
        }
    )
    e = spec.elastic
    assert e.enabled and e.rdzv_backend is RdzvBackend.C10D
    assert (e.min_nodes, e.max_nodes, spec.sizes.nnodes) == (1, 3, 3)
    assert e.endpoint() == ("10.0.0.1", 29400)
    assert e.handler_conf() == {**FAST_RDZV_CONF, "join_timeout": "60", "last_call_timeout": "2"}
    assert build_spec(spec_to_dict(spec)) == spec  # the job.yaml round trip


def test_paddle_server_spelling_means_etcd() -> None:
    spec = _spec(
        {"sizes": {"nnodes": "2:4"}, "elastic": {"rdzv_endpoint": "etcd://127.0.0.1:2379"}}
    )
    assert spec.elastic.rdzv_backend is RdzvBackend.ETCD and spec.elastic.endpoint() == (
        "127.0.0.1",
        2379,
    )
    assert (spec.elastic.min_nodes, spec.elastic.max_nodes) == (2, 4)


def test_standalone_is_c10d_on_loopback() -> None:
    e = _spec({"elastic": {"standalone": True}}).elastic
    assert e.rdzv_backend is RdzvBackend.C10D and e.endpoint() == ("127.0.0.1", 0)
    assert (e.min_nodes, e.max_nodes) == (1, 1)


def test_fixed_size_elastic_and_static_default() -> None:
    spec = _spec(
        {"sizes": {"nnodes": 2}, "elastic": {"rdzv_backend": "etcd-v2", "rdzv_endpoint": "h:1"}}
    )
    assert (spec.elastic.min_nodes, spec.elastic.max_nodes) == (2, 2)
    static = _spec({"sizes": {"nnodes": 2}})
    assert not static.elastic.enabled and static.elastic.min_nodes is None


@pytest.mark.parametrize(
    "data,key,fragment",
    [
        ({"sizes": {"nnodes": "3:2"}}, "sizes.nnodes", "MIN 3 > MAX 2"),
        ({"sizes": {"nnodes": "0:2"}}, "sizes.nnodes", "MIN must be >= 1"),
        ({"sizes": {"nnodes": "a:b"}}, "sizes.nnodes", "N or MIN:MAX"),
        ({"sizes": {"nnodes": "1:2"}}, "sizes.nnodes", "needs an elastic rendezvous"),
        ({"elastic": {"rdzv_backend": "c10d"}}, "elastic.rdzv_endpoint", "needs an endpoint"),
        (
            {"elastic": {"rdzv_backend": "c10d", "rdzv_endpoint": "h:99999"}},
            "elastic.rdzv_endpoint",
            "not 0..65535",
        ),
        (
            {"elastic": {"rdzv_backend": "zk", "rdzv_endpoint": "h:1"}},
            "elastic.rdzv_backend",
            "'c10d'",
        ),
        (
            {"elastic": {"rdzv_conf": "last_cal_timeout=1"}},
            "elastic.rdzv_conf.last_cal_timeout",
            "did you mean 'last_call_timeout'",
        ),
        ({"elastic": {"rdzv_conf": "nonsense"}}, "elastic.rdzv_conf", "key=value"),
        (
            {"elastic": {"rdzv_backend": "c10d", "rdzv_endpoint": "etcd://h:1"}},
            "elastic.rdzv_backend",
            "is an etcd server",
        ),
        (
            {"elastic": {"standalone": True, "rdzv_endpoint": "h:1"}},
            "elastic.standalone",
            "drop --rdzv_endpoint",
        ),
        (
            {
                "elastic": {"rdzv_backend": "c10d", "rdzv_endpoint": "h:1"},
                "rendezvous": {"node_rank": 0},
            },
            "rendezvous.node_rank",
            "drop --node_rank",
        ),
        (
            {
                "elastic": {"rdzv_backend": "c10d", "rdzv_endpoint": "h:1"},
                "rendezvous": {"ips": "a,b"},
            },
            "rendezvous.ips",
            "static node list",
        ),
        (
            {
                "elastic": {"rdzv_backend": "c10d", "rdzv_endpoint": "h:1"},
                "rendezvous": {"master_port": 5},
            },
            "rendezvous.master_addr",
            "drop --master_addr/--master_port",
        ),
        (
            {"elastic": {"rdzv_backend": "c10d", "rdzv_endpoint": "h:1", "monitor_interval_s": 0}},
            "elastic.monitor_interval_s",
            "must be > 0",
        ),
        (
            {
                "elastic": {"rdzv_backend": "c10d", "rdzv_endpoint": "h:1"},
                "mode": "ps",
                "sizes": {"server_num": 1, "worker_num": 1},
            },
            "mode",
            "collective only",
        ),
    ],
)
def test_bad_elastic_input_names_the_key(data: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        _spec(data)
    assert info.value.key == key and fragment in info.value.message, (
        info.value.key,
        info.value.message,
    )


@pytest.mark.parametrize(
    "args,fragment",
    [
        (
            ["--nnodes", "3:2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:1"],
            "(set by --nnodes)",
        ),
        (["--np", "0:2"], "(set by --np)"),
        (["--nnodes", "0"], "must be >= 1, got 0 (set by --nnodes)"),
        (["--nnodes", "two"], "N or MIN:MAX"),
        (["--nnodes", "1:2"], "needs an elastic rendezvous"),
        (
            [
                "--nnodes",
                "1:2",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                "h:1",
                "--node_rank",
                "1",
            ],
            "(set by --node_rank)",
        ),
        (["--elastic_server", "http://h:1"], "(set by --elastic_server)"),
        (["--standalone", "--rdzv_endpoint", "h:1"], "(set by --standalone)"),
        (["--rdzv_backend", "c10d"], "--rdzv_endpoint HOST:PORT"),
    ],
)
def test_bad_elastic_flags_exit_2_naming_the_flag(
    tmp_path: Path, args: list[str], fragment: str
) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    result = CliRunner().invoke(run_command, [*args, str(script)])
    assert result.exit_code == 2 and fragment in result.output, result.output


def test_paddle_and_torchrun_flags_build_the_same_spec(tmp_path: Path) -> None:
    from launcher.cli import spec_from_params  # the CLI's merge, without launching

    script = str(tmp_path / "t.py")
    specs = []
    for args in (
        ["--np", "1:2", "--elastic_server", "etcd://127.0.0.1:2379", "--job_id", "j"],
        [
            "--nnodes",
            "1:2",
            "--rdzv_backend",
            "etcd",
            "--rdzv_endpoint",
            "127.0.0.1:2379",
            "--rdzv_id",
            "j",
        ],
    ):
        ctx = run_command.make_context("fleetrun", [*args, script])
        specs.append(spec_from_params(ctx, dict(ctx.params)))
    assert specs[0] == specs[1] and specs[0].run_id == "j" and specs[0].elastic.min_nodes == 1


def test_membership_diff_names_who_left_and_joined() -> None:
    from launcher.elastic.membership import Membership, NodeRecord, diff
    from launcher.summary import format_membership

    def node(i: int) -> NodeRecord:
        return NodeRecord(f"h/{i}", "h", "127.0.0.1", 1, (1000 + i,), "fp", "job")

    r0 = Membership(0, 0, (node(1), node(2)))
    r1 = Membership(1, 0, (node(1),))
    r2 = Membership(2, 1, (node(1), node(3)))
    assert diff(None, r0, "start") is None
    lost, grown = diff(r0, r1, "failure"), diff(r1, r2, "join")
    assert lost is not None and grown is not None
    assert lost.text() == "round 1 (failure): left h/2; world 2 -> 1"
    assert grown.text() == "round 2 (join): joined h/3; world 1 -> 2"
    assert r2.endpoints() == ("127.0.0.1:1001", "127.0.0.1:1003") and r2.first_rank(1) == 1
    assert format_membership([lost, grown]).splitlines() == [
        "Membership changes:",
        "  " + lost.text(),
        "  " + grown.text(),
    ]
