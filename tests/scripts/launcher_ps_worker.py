"""Tiny PS-mode process for launcher tests (no torch). A server binds its PADDLE_PORT and waits
until every trainer left a done-file; a trainer checks every server listens, then finishes."""

import argparse
import json
import os
import socket
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--fail_server", type=int, default=-1)
p.add_argument("--fail_trainer", type=int, default=-1)
p.add_argument("--server_stays", action="store_true", help="servers never exit on their own")
args = p.parse_args()
os.makedirs(args.out, exist_ok=True)
role = os.environ["TRAINING_ROLE"]
servers = os.environ["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")
num_trainers = int(os.environ["PADDLE_TRAINERS_NUM"])

if role == "PSERVER":
    me = f"{os.environ['POD_IP']}:{os.environ['PADDLE_PORT']}"
    index = servers.index(me)
    sock = socket.socket()
    sock.bind((os.environ["POD_IP"], int(os.environ["PADDLE_PORT"])))
    sock.listen()
    with open(os.path.join(args.out, f"server{index}.json"), "w") as f:
        cpus = sorted(os.sched_getaffinity(0))
        json.dump({"pid": os.getpid(), "env": dict(os.environ), "cpus": cpus}, f)
    print(f"server {index} serving on {me}", flush=True)
    if index == args.fail_server:
        time.sleep(0.3)
        raise RuntimeError(f"server {index} lost its table")
    deadline = time.monotonic() + 60
    while not args.server_stays and time.monotonic() < deadline:
        if len([f for f in os.listdir(args.out) if f.startswith("done")]) == num_trainers:
            print(f"server {index} stopping", flush=True)
            sys.exit(0)
        time.sleep(0.05)
    time.sleep(600)
else:
    tid = int(os.environ["PADDLE_TRAINER_ID"])
    with open(os.path.join(args.out, f"trainer{tid}.json"), "w") as f:
        cpus = sorted(os.sched_getaffinity(0))
        json.dump({"pid": os.getpid(), "env": dict(os.environ), "cpus": cpus}, f)
    for ep in servers:  # servers start first, but give them a moment
        host, port = ep.rsplit(":", 1)
        for _ in range(100):
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"server {ep} never listened")
    if tid == args.fail_trainer:
        raise ValueError(f"trainer {tid} got a bad batch")
    print(f"trainer {tid} done", flush=True)
    open(os.path.join(args.out, f"done{tid}"), "w").close()
