"""Tiny heterogeneous-PS process for launcher tests (no torch): one script for every role.

- PSERVER: binds its PADDLE_PORT, waits until every trainer left a done-file.
- HETER_TRAINER: reads the env contract (``collective.env.read_worker_env``), binds its
  PADDLE_PORT and answers each connection with its index, writes what it was given to
  ``OUT/heter<i>.<pid>.json``, and exits once every trainer is done (or never, --heter_stays).
- TRAINER: writes its env to ``OUT/trainer<i>.json``; with --progress_mode, the progress file
  fleet's trainers write (``LOG_DIR/ps_progress.<rank>.json``: the mode the launcher reads);
  then calls its heter worker once per step until ``OUT/finish`` exists (or --steps), waiting
  for a heter worker that is gone to come back on its endpoint.
"""

import argparse
import json
import os
import socket
import sys
import threading
import time

from collective.env import read_worker_env

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=3, help="trainer steps; 0 = until OUT/finish")
p.add_argument("--progress_mode", default="", help="write ps_progress files with this mode")
p.add_argument("--fail_heter", type=int, default=-1, help="this heter worker exits 1 at start")
p.add_argument("--heter_stays", action="store_true", help="heter workers never exit")
args = p.parse_args()
os.makedirs(args.out, exist_ok=True)
env = read_worker_env()
role = str(env.training_role)
num_trainers = int(os.environ["PADDLE_TRAINERS_NUM"])


def all_done() -> bool:
    return len([f for f in os.listdir(args.out) if f.startswith("done")]) == num_trainers


def serve(sock: socket.socket, reply: bytes) -> None:
    while True:
        conn, _ = sock.accept()
        with conn:
            conn.sendall(reply)


def wait_done_then_exit(name: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all_done() and not args.heter_stays:
            print(f"{name} stopping", flush=True)
            sys.exit(0)
        time.sleep(0.05)
    time.sleep(600)


if role == "PSERVER":
    sock = socket.socket()
    sock.bind((env.pod_ip, int(os.environ["PADDLE_PORT"])))
    sock.listen()
    threading.Thread(target=serve, args=(sock, b"server"), daemon=True).start()
    print(f"server {env.server_index} serving on {env.current_endpoint}", flush=True)
    args.heter_stays = False
    wait_done_then_exit(f"server {env.server_index}")
elif role == "HETER_TRAINER":
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((env.pod_ip, int(os.environ["PADDLE_PORT"])))
    sock.listen()
    facts = {
        "pid": os.getpid(),
        "heter_index": env.heter_index,
        "heter_device": env.heter_device,
        "heter_endpoints": list(env.heter_endpoints),
        "current_endpoint": env.current_endpoint,
        "pserver_endpoints": list(env.pserver_endpoints),
        "world_size": env.world_size,
        "restart_count": env.restart_count,
        "env": dict(os.environ),
    }
    with open(os.path.join(args.out, f"heter{env.heter_index}.{os.getpid()}.json"), "w") as f:
        json.dump(facts, f)
    print(f"heter worker {env.heter_index} on {env.heter_device} at {env.current_endpoint}")
    sys.stdout.flush()
    if env.heter_index == args.fail_heter:
        raise RuntimeError(f"heter worker {env.heter_index} found no device")
    threading.Thread(target=serve, args=(sock, str(env.heter_index).encode()), daemon=True).start()
    wait_done_then_exit(f"heter worker {env.heter_index}")
else:
    tid = env.rank
    with open(os.path.join(args.out, f"trainer{tid}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "env": dict(os.environ)}, f)
    mine = env.heter_endpoints[tid % len(env.heter_endpoints)]
    host, port = mine.rsplit(":", 1)
    step = 0
    while True:
        if args.progress_mode and env.log_dir:
            path = os.path.join(env.log_dir, f"ps_progress.{tid}.json")
            progress = {"rank": tid, "attempt": env.restart_count, "step": step}
            with open(path + ".tmp", "w") as f:
                json.dump({**progress, "mode": args.progress_mode}, f)
            os.replace(path + ".tmp", path)
        deadline = time.monotonic() + 60
        while True:  # a heter worker restarted alone comes back on the same endpoint
            try:
                with socket.create_connection((host, int(port)), timeout=2) as c:
                    answer = c.recv(16).decode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"heter worker {mine} unreachable") from None
                time.sleep(0.05)
        step += 1
        finish = os.path.exists(os.path.join(args.out, "finish"))
        if (args.steps and step >= args.steps) or finish:
            break
        time.sleep(0.05)
    print(f"trainer {tid} done after {step} steps (heter worker {answer})", flush=True)
    open(os.path.join(args.out, f"done{tid}"), "w").close()
