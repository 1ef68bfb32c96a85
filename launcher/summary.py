"""The root-cause-first failure summary fleetrun prints when a job fails.

Layout (fixed template, as torchrun's ChildFailedError, with Ray Train's grouping)::

    ==================== fleetrun: job 'demo' FAILED ====================
    Root cause (first observed failure):
      time     : 2026-11-22 20:31:02  (attempt 0)
      host     : node-a
      role     : trainer   rank: 1 (local_rank 1, node 0)
      exit     : exit code 1   pid: 4242
      error    : ValueError: bad batch
      traceback (last 12 lines, from log/errors/attempt0/error.1.json):
        ...
    Other failures:
      [ranks 2, 3] exit code 1: ValueError: bad batch  (same as root cause)
    Stopped by fleetrun after the root cause: ranks 0
    Logs: log/workerlog.1 (root cause), all in log/
    =====================================================================

Pure functions over :class:`Failure` records: unit-tested without processes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

TRACEBACK_LINES = 12
LOG_TAIL_LINES = 12
MAX_MESSAGE_CHARS = 1000


@dataclass(frozen=True)
class Failure:
    """One process that failed on its own (not one fleetrun stopped)."""

    role: str
    """``trainer``, ``server`` or ``heter`` (a heter worker)."""
    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    exit_desc: str
    """``exit code 1`` / ``signal SIGKILL (9)``."""
    time: float
    attempt: int
    log_path: str
    error_file: str | None = None
    """Set when the process wrote one (its traceback)."""
    message: str = ""
    """The exception line (``ValueError: ...``) from the error file, if any."""
    traceback: str = ""
    """The Python traceback from the error file, if any."""


PEER_LOSS_WORDS = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "remote worker",
    "remote process",
    "connection refused",
    "connection was likely closed",
)
"""Words of the errors a collective raises when a peer process died (gloo, NCCL, the store:
``Failed to recv, got 0 bytes. Connection was likely closed``)."""


def lost_a_peer(failure: Failure) -> bool:
    """Whether ``failure``'s error reads as a collective that lost a peer process."""
    text = failure.message.lower()
    return any(word in text for word in PEER_LOSS_WORDS)


def root_first(failures: Sequence[Failure]) -> list[Failure]:
    """``failures`` root cause first: the earliest one with an error of its own, then the rest
    by time. A process that only lost a peer (:func:`lost_a_peer`) can exit before the peer
    whose error closed its connections, so it is the root cause only when no other is."""
    return sorted(failures, key=lambda f: (lost_a_peer(f), f.time))


def read_error_file(path: str | None) -> tuple[str, str] | None:
    """(message, traceback) from a torch-elastic-format error file, or None when absent/bad."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        msg = data["message"]
        if isinstance(msg, str):  # torch's format for non-Python errors
            return msg, ""
        return str(msg.get("message", "")), str(msg.get("extraInfo", {}).get("py_callstack", ""))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


def tail_lines(path: str, n: int) -> list[str]:
    """Last ``n`` non-empty lines of a text file (reads at most the last 64 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - 65536, 0))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    lines = [ln for ln in data.splitlines() if ln.strip()]
    return lines[-n:]


def role_label(role: str, rank: int) -> str:
    """How a process is named in messages: ``rank 3``, ``server 1``, ``heter worker 0``."""
    if role == "trainer":
        return f"rank {rank}"
    return f"{'heter worker' if role == 'heter' else role} {rank}"


def _ranks_text(role: str, ranks: Sequence[int]) -> str:
    noun = {"trainer": "rank", "heter": "heter worker"}.get(role, role)
    label = noun + ("s" if len(ranks) > 1 else "")
    return f"{label} {', '.join(str(r) for r in sorted(ranks))}"


def _cut(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 20] + " ...[cut, see log]"


def format_membership(changes: Sequence[object]) -> str:
    """``Membership changes:`` and one line per change of an elastic job (objects with a
    ``text()``: launcher.elastic.membership.MembershipChange); empty without changes."""
    if not changes:
        return ""
    return "\n".join(["Membership changes:", *(f"  {c.text()}" for c in changes)])  # type: ignore[attr-defined]


def format_summary(
    job_name: str,
    failures: Sequence[Failure],
    stopped: Sequence[tuple[str, int]],
    log_dir: str,
    restarts_used: int,
    max_restarts: int,
    note: str = "",
) -> str:
    """The summary text; ``failures`` in any order (root cause first here: :func:`root_first`),
    ``stopped`` = the
    (role, rank) pairs fleetrun terminated because of the failure."""
    bar = "=" * 72
    head = f" fleetrun: job '{job_name}' FAILED "
    lines = [head.center(72, "=")]
    if note:
        lines.append(note)
    if not failures:
        lines += ["No process reported a failure.", f"Logs: {log_dir}/", bar]
        return "\n".join(lines)
    ordered = root_first(failures)
    root = ordered[0]
    lines.append("Root cause (first observed failure):")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(root.time))
    lines.append(
        f"  time     : {stamp}  (attempt {root.attempt}, restarts used {restarts_used}/{max_restarts})"
    )
    lines.append(f"  host     : {root.host}")
    if root.role == "trainer":
        where = f"rank {root.rank} (local_rank {root.local_rank}, node {root.node_rank})"
    else:
        where = f"index {root.rank} (node {root.node_rank})"
    lines.append(f"  {root.role:<8} : {where}")
    lines.append(f"  exit     : {root.exit_desc}   pid: {root.pid}")
    if root.message:
        lines.append(f"  error    : {_cut(root.message)}")
    if root.traceback:
        tb = [ln for ln in root.traceback.rstrip().splitlines()][-TRACEBACK_LINES:]
        lines.append(f"  traceback (last {len(tb)} lines, from {root.error_file}):")
        lines += [f"    {ln}" for ln in tb]
    else:
        tail = tail_lines(root.log_path, LOG_TAIL_LINES)
        if tail:
            lines.append(f"  last {len(tail)} lines of {root.log_path}:")
            lines += [f"    {_cut(ln, 300)}" for ln in tail]
    others = ordered[1:]
    if others:
        lines.append("Other failures:")
        groups: dict[tuple[str, str, str], list[int]] = {}
        for f in others:
            groups.setdefault((f.role, f.exit_desc, f.message), []).append(f.rank)
        for (role, desc, msg), ranks in groups.items():
            same = " (same as root cause)" if (desc, msg) == (root.exit_desc, root.message) else ""
            text = f": {_cut(msg, 300)}" if msg else ""
            lines.append(f"  [{_ranks_text(role, ranks)}] {desc}{text}{same}")
    if stopped:
        by_role: dict[str, list[int]] = {}
        for role, rank in stopped:
            by_role.setdefault(role, []).append(rank)
        what = "; ".join(_ranks_text(role, ranks) for role, ranks in by_role.items())
        lines.append(f"Stopped by fleetrun after the root cause: {what}")
    lines.append(f"Logs: {root.log_path} (root cause); all logs in {log_dir}/")
    lines.append(bar)
    return "\n".join(lines)
