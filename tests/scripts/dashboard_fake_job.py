"""A stand-in for a running fleetrun PS job, for the dashboard's fixture tests (no torch: fast).

Serves real Prometheus text (prometheus_client, one registry and port per process it plays:
the launcher, trainers 0..N-1 and PS server 0) on 127.0.0.1, and writes the launcher's
``metrics_targets.json`` and ``job_state.json`` (atomically) in --log_dir, as the monitoring
contract says. Numbers move every 0.2 s. With --fail_after S (or when the file --fail_when
appears), trainer rank 1 "dies" (SIGKILL): its process record turns failed, the job turns
failed with a root-cause summary, the metric servers stop, and the script exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    start_http_server,
)

p = argparse.ArgumentParser()
p.add_argument("--log_dir", required=True)
p.add_argument("--trainers", type=int, default=2)
p.add_argument(
    "--fail_after", type=float, default=0.0, help="seconds until rank 1 dies (0 = never)"
)
p.add_argument("--fail_when", default="", help="rank 1 dies when this file exists")
p.add_argument("--duration", type=float, default=120.0, help="seconds to run at most")
args = p.parse_args()

log_dir = os.path.abspath(args.log_dir)
os.makedirs(log_dir, exist_ok=True)
host = socket.gethostname()
start = time.time()


def serve(registry: CollectorRegistry) -> tuple[object, str]:
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server, f"127.0.0.1:{server.server_port}"


procs = []  # (role, rank, registry metrics dict, server, address)
for rank in range(args.trainers):
    r = CollectorRegistry()
    m = {
        "steps": Counter("fleet_trainer_steps_total", "steps", registry=r),
        "samples": Counter("fleet_trainer_samples_total", "samples", registry=r),
        "step": Histogram("fleet_trainer_step_seconds", "step time", registry=r),
        "loss": Gauge("fleet_trainer_loss", "loss", registry=r),
        "thr": Gauge("fleet_trainer_throughput_samples_per_second", "thr", registry=r),
        "comm": Histogram("fleet_trainer_comm_seconds", "comm", ["op"], registry=r),
        "phase": Histogram("fleet_trainer_phase_seconds", "phase", ["phase"], registry=r),
    }
    server, addr = serve(r)
    procs.append(("trainer", rank, m, server, addr))
r = CollectorRegistry()
ps = {
    "req": Counter("fleet_ps_requests_total", "req", ["op", "table", "code"], registry=r),
    "lat": Histogram("fleet_ps_request_seconds", "lat", ["op"], registry=r),
    "keys": Counter("fleet_ps_keys_total", "keys", ["op", "table"], registry=r),
    "rows": Gauge("fleet_ps_table_rows", "rows", ["table"], registry=r),
    "bytes": Gauge("fleet_ps_table_bytes", "bytes", ["table"], registry=r),
    "entry": Counter("fleet_ps_entry_keys_total", "entry", ["table", "result"], registry=r),
    "gnodes": Gauge("fleet_ps_graph_nodes", "nodes", ["table"], registry=r),
    "gedges": Gauge("fleet_ps_graph_edges", "edges", ["table"], registry=r),
    "gsec": Summary("fleet_ps_graph_request_seconds", "graph", ["op", "table"], registry=r),
}
server, addr = serve(r)
procs.append(("server", 0, ps, server, addr))
r = CollectorRegistry()
job_state_g = Gauge("fleet_launcher_job_state", "state", ["state"], registry=r)
up_g = Gauge("fleet_launcher_processes_up", "up", ["role"], registry=r)
Counter("fleet_launcher_restarts_total", "restarts", registry=r)
launcher_server, launcher_addr = serve(r)

for role, rank, _, _, _ in procs:
    name = f"workerlog.{rank}" if role == "trainer" else f"serverlog.{rank}"
    with open(os.path.join(log_dir, name), "w") as f:
        f.write(f"{role} {rank} started\n")


def log_path(role: str, rank: int) -> str:
    return os.path.join(log_dir, f"workerlog.{rank}" if role == "trainer" else f"serverlog.{rank}")


def write_json(name: str, data: object) -> None:
    tmp = os.path.join(log_dir, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(log_dir, name))


write_json(
    "metrics_targets.json",
    [
        {"targets": [a], "labels": {"job": "fake", "role": role, "rank": str(rank), "host": host}}
        for role, rank, _, _, a in procs
    ]
    + [
        {
            "targets": [launcher_addr],
            "labels": {"job": "fake", "role": "launcher", "rank": "0", "host": host},
        }
    ],
)


def job_state(state: str, failed: bool, summary: str | None) -> dict:
    records = []
    for role, rank, _, _, a in procs:
        dead = failed and role == "trainer" and rank == 1
        records.append(
            {
                "role": role,
                "rank": rank,
                "host": host,
                "pid": os.getpid() * 10 + rank,
                "state": "failed" if dead else ("up" if not failed else "exited"),
                "exit_code": None if not dead else -9,
                "signal": "SIGKILL" if dead else None,
                "metrics": a,
                "log": log_path(role, rank),
            }
        )
    return {
        "name": "fake",
        "run_id": "fake-run",
        "state": state,
        "attempt": 0,
        "restarts": 0,
        "max_restarts": 0,
        "started_at": start,
        "updated_at": time.time(),
        "launcher_metrics": launcher_addr,
        "processes": records,
        "failure_summary": summary,
    }


job_state_g.labels("running").set(1)
up_g.labels("trainer").set(args.trainers)
up_g.labels("server").set(1)
write_json("job_state.json", job_state("running", False, None))
print(f"fake job up: {log_dir}", flush=True)

end = start + (args.fail_after or args.duration)
step = 0
while time.time() < end and not (args.fail_when and os.path.exists(args.fail_when)):
    step += 1
    for role, rank, m, _, _ in procs:
        if role == "trainer":
            m["steps"].inc()
            m["samples"].inc(64)
            m["step"].observe(0.05)
            m["comm"].labels("all_reduce").observe(0.01)
            m["comm"].labels("ps_pull").observe(0.005)
            m["comm"].labels("ps_push").observe(0.004)
            # a 50 ms step of train_from_dataset (rank 1 waits longer on its pulls)
            for phase, seconds in (
                ("data", 0.002),
                ("pull_wait", 0.010 + 0.010 * rank),
                ("forward", 0.012),
                ("backward", 0.014),
                ("push_optimizer", 0.008),
                ("other", 0.004 - 0.002 * rank),
            ):
                m["phase"].labels(phase).observe(seconds)
            m["loss"].set(2.0 * math.exp(-step / 50) + 0.1 * rank)
            m["thr"].set(1000 + 50 * math.sin(step / 5) + 100 * rank)
        else:
            for table in ("user", "item"):
                m["req"].labels("pull", table, "OK").inc(2)
                m["req"].labels("push", table, "OK").inc(2)
                m["keys"].labels("pull", table).inc(128)
                m["rows"].labels(table).set(100 * step)
                m["bytes"].labels(table).set(100 * step * 36)
                m["entry"].labels(table, "admitted").inc(100)
                m["entry"].labels(table, "filtered").inc(10)
                if step > 10:
                    m["entry"].labels(table, "evicted").inc(5)
            m["gnodes"].labels("social").set(5000)  # a graph table: nodes, edges, samples
            m["gedges"].labels("social").set(40000)
            for _ in range(3):
                m["req"].labels("Graph.SampleNeighbors", "social", "OK").inc()
                m["gsec"].labels("Graph.SampleNeighbors", "social").observe(0.004)
    time.sleep(0.2)

if args.fail_after or (args.fail_when and os.path.exists(args.fail_when)):
    with open(log_path("trainer", 1), "a") as f:
        f.write("about to SIGKILL myself\n")
    summary = (
        "==================== fleetrun: job 'fake' FAILED ====================\n"
        "Root cause (first observed failure):\n"
        f"  host     : {host}\n"
        "  trainer  : rank 1 (local_rank 1, node 0)\n"
        "  exit     : signal SIGKILL (9)\n"
        f"Logs: {log_path('trainer', 1)} (root cause), all in {log_dir}/\n"
    )
    job_state_g.labels("running").set(0)
    job_state_g.labels("failed").set(1)
    write_json("job_state.json", job_state("failed", True, summary))
else:
    write_json("job_state.json", {**job_state("succeeded", False, None)})
for _, _, _, srv, _ in procs:
    srv.shutdown()
launcher_server.shutdown()
print("fake job done", flush=True)
