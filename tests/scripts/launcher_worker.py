"""Tiny worker for launcher tests (no torch: fast). Writes OUT/rank<R>.attempt<A>.json with its
env and pid, then behaves as the flags say."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--fail_ranks", default="", help="comma list of ranks that raise ValueError")
p.add_argument("--exit_code_ranks", default="", help="comma list of ranks that exit 3")
p.add_argument("--sigkill_ranks", default="", help="comma list of ranks that SIGKILL themselves")
p.add_argument("--fail_attempts", type=int, default=99, help="fail only while restart count < N")
p.add_argument("--delay", type=float, default=0.3, help="seconds before failing")
p.add_argument("--hang", action="store_true", help="non-failing ranks sleep 600 s")
p.add_argument("--grandchild", action="store_true", help="start a sleeping grandchild")
p.add_argument("--ignore_sigterm", action="store_true")
args = p.parse_args()

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
info = {"pid": os.getpid(), "argv": sys.argv[1:], "env": dict(os.environ)}
if args.grandchild:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    info["grandchild"] = child.pid
if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.makedirs(args.out, exist_ok=True)
# tmp + rename: the tests poll for rank*.json and read it at once (a plain write let them read an
# empty file once under load)
record = os.path.join(args.out, f"rank{rank}.attempt{attempt}.json")
with open(record + ".tmp", "w") as f:
    json.dump(info, f)
os.replace(record + ".tmp", record)
print(f"worker rank {rank} attempt {attempt} up", flush=True)


def ranks(text):
    return {int(r) for r in text.split(",") if r}


failing = attempt < args.fail_attempts
if failing and rank in ranks(args.fail_ranks):
    time.sleep(args.delay)
    raise ValueError(f"injected failure on rank {rank}")
if failing and rank in ranks(args.exit_code_ranks):
    time.sleep(args.delay)
    print("exiting with code 3", flush=True)
    sys.exit(3)
if failing and rank in ranks(args.sigkill_ranks):
    time.sleep(args.delay)
    print("about to SIGKILL myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if args.hang:
    time.sleep(600)
print(f"worker rank {rank} done", flush=True)
