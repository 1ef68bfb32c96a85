"""A clean exit for every process fleet starts: our subsystems first, then torch's process groups.

Why this exists (torch 2.13, Python 3.11, gloo): a worker that finished its work could die at
exit with SIGABRT and ``terminate called without an active exception``. The cores all show the
same thing. A gloo worker thread (``pt_gloo_runloop``) completes a collective — the caller's
``wait()`` returns at that moment — and only afterwards drops its own reference to the work
object. When that last reference goes, the work's tensors release their Python objects, which
needs the GIL. If the main thread has reached ``Py_FinalizeEx`` by then, ``take_gil`` ends the
gloo thread with ``pthread_exit``; the forced unwind meets the work's ``noexcept`` destructor,
and the C++ runtime calls ``std::terminate``. ``destroy_process_group()`` does not help: for
gloo it only forgets the group, and DDP still holds it. The race needs the gloo thread to be off
the CPU for the few instructions between "complete" and "released" — rare on an idle machine,
common on a loaded one.

So :func:`shutdown`, while the interpreter is fully alive:

1. runs the callbacks our own subsystems registered (:func:`register_shutdown`: the metrics
   endpoint, PS communicators, monitors), newest first;
2. destroys the process groups, sub-groups first (newest first), then the default group;
3. waits (bounded) until every gloo worker thread sits idle — asleep, and not woken once during
   an interval in which the GIL was free, so none is about to release work (Linux ``/proc``;
   elsewhere this step is skipped);
4. then collects garbage, so groups only reference cycles kept alive are destroyed now, their
   destructors joining the idle threads. (A group a DDP model used outlives the model — torch
   keeps a reference — and its threads stay, idle, until the process ends: harmless.)

:func:`install_atexit` registers it to run at exit; :func:`collective.group.init_parallel_env`
and fleetrun's worker bootstrap (for plain torchrun scripts) call it, so scripts need no change.
Calling :func:`shutdown` again, or after the script destroyed its groups itself, is a no-op.

Standard library only at import: torch is touched only when the process already imported it
(with no ``torch.distributed`` in ``sys.modules`` there is no group to destroy).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from collective.errors import ShutdownError

logger = logging.getLogger(__name__)

GLOO_THREAD_NAME = "pt_gloo_runloop"
"""What torch names a ProcessGroupGloo worker thread (``/proc/self/task/*/comm``)."""
IDLE_TIMEOUT_S = 10.0
"""How long :func:`wait_gloo_idle` waits at most, in seconds. A thread preempted on a loaded
machine runs again within milliseconds; the bound only keeps exit from hanging on a thread that
keeps running. (A thread blocked in a collective no peer joins sleeps: it counts as idle.)"""
IDLE_POLL_S = 0.005
"""Seconds between two looks at the gloo threads (the GIL is free meanwhile)."""

_callbacks: dict[str, Callable[[], None]] = {}
"""name -> callback, in registration order (dicts keep it)."""
_lock = threading.Lock()
"""Guards ``_callbacks`` and ``_atexit_installed`` (never held while a callback runs)."""
_shutdown_lock = threading.Lock()
"""Serialises whole shutdowns (an explicit call racing the atexit one)."""
_atexit_installed = False
_failing = False
"""Set when the process is ending on an error (:func:`mark_failing`): then the exit path does
nothing, so that the process that failed first is also the first to lose its connections."""


def register_shutdown(name: str, fn: Callable[[], None]) -> None:
    """Run ``fn()`` at :func:`shutdown` (at exit, or when called), before the process groups go.

    Callbacks run newest first, each at most once. ``name`` identifies the subsystem
    (``"fleet.telemetry"``); registering a name again replaces its callback and moves it to the
    newest position. ``fn`` must be safe to call when its subsystem already stopped.
    """
    with _lock:
        _callbacks.pop(name, None)
        _callbacks[name] = fn


def unregister_shutdown(name: str) -> None:
    """Forget the callback of ``name`` (its subsystem stopped on its own); no-op if unknown."""
    with _lock:
        _callbacks.pop(name, None)


def registered_shutdowns() -> list[str]:
    """Names of the pending callbacks, in the order :func:`shutdown` will run them."""
    with _lock:
        return list(reversed(_callbacks))


def install_atexit() -> None:
    """Run :func:`shutdown` at interpreter exit (once, however often this is called).

    atexit runs handlers newest first, so handlers the script registers later run before this
    one (and may still use the process groups).
    """
    global _atexit_installed
    with _lock:
        if not _atexit_installed:
            atexit.register(_shutdown_at_exit)
            _install_failure_hook()
            _atexit_installed = True


def mark_failing() -> None:
    """This process is ending on an error: skip the exit path (callbacks, group teardown).

    Why: destroying the groups of a failing rank closes its connections while it still runs,
    so its peers fail ("Connection reset by peer") and may exit *before* it; a launcher that
    orders failures by exit time would then name a peer as the root cause. Without the
    teardown the failing rank dies first, as before. An uncaught exception marks the process
    by itself (a ``sys.excepthook`` wrapper); :func:`collective.spawn` marks a child whose
    function raised."""
    global _failing
    _failing = True


def _install_failure_hook() -> None:
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        mark_failing()
        previous(exc_type, exc, tb)  # type: ignore[arg-type]

    sys.excepthook = hook


def shutdown(idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Stop our subsystems, destroy every process group and let gloo's threads go idle.

    Idempotent: each callback runs once, and groups already destroyed (by an earlier call or by
    the script's own ``destroy_process_group()``) are skipped. Raises :class:`ShutdownError`
    naming the callbacks that raised, after all steps ran.
    """
    with _shutdown_lock:
        failed = _run_callbacks()
        tdist = sys.modules.get("torch.distributed")
        if tdist is not None:  # without it there is no group and no gloo thread
            _destroy_process_groups(tdist)
            if wait_gloo_idle(idle_timeout_s):
                # Groups kept alive only by reference cycles go now; their destructors join
                # the idle threads. Not with a busy thread: a destructor run under the GIL
                # (DDP's reducer) would wait for a thread that waits for the GIL.
                gc.collect()
            else:
                logger.warning(
                    "gloo worker threads kept running for %.0f s at shutdown; the process may "
                    "abort at exit",
                    idle_timeout_s,
                )
    if failed:
        raise ShutdownError(
            "shutdown callbacks raised (the rest of the shutdown ran): "
            + "; ".join(f"{name}: {type(err).__name__}: {err}" for name, err in failed)
        ) from failed[0][1]


def _shutdown_at_exit() -> None:
    if _failing:
        logger.debug("exiting on an error: process groups left to the process's end")
        return
    try:
        shutdown()
    except ShutdownError as err:  # exit goes on: the exit code stays the script's
        logger.warning("%s", err)


def _run_callbacks() -> list[tuple[str, Exception]]:
    failed: list[tuple[str, Exception]] = []
    while True:
        with _lock:
            if not _callbacks:
                return failed
            name = next(reversed(_callbacks))
            fn = _callbacks.pop(name)
        try:
            fn()
        except Exception as err:  # one subsystem must not stop the others' exit
            logger.debug("shutdown callback %s raised", name, exc_info=True)
            failed.append((name, err))


def _destroy_process_groups(tdist: ModuleType) -> None:
    """Sub-groups newest first, then the default group (no-op when none is initialised)."""
    if not tdist.is_available() or not tdist.is_initialized():
        return
    c10d = tdist.distributed_c10d
    world = c10d.GroupMember.WORLD
    # torch keeps no public list of groups; _world.pg_map holds this rank's, oldest first.
    subgroups = [pg for pg in c10d._world.pg_map if pg is not world]
    for pg in reversed(subgroups):
        tdist.destroy_process_group(pg)
    tdist.destroy_process_group()


@dataclass(frozen=True)
class _ThreadSample:
    state: str
    """``R`` running/runnable, ``S`` sleeping, ... (``/proc/<tid>/status``)."""
    switches: int
    """Voluntary + involuntary context switches so far: unchanged = did not run since."""


def _sample_gloo_threads() -> dict[str, _ThreadSample] | None:
    """tid -> sample for every gloo worker thread of this process; None without ``/proc``."""
    task_dir = "/proc/self/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    samples = {}
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/comm", encoding="ascii", errors="replace") as f:
                if f.read().strip() != GLOO_THREAD_NAME:
                    continue
            with open(f"{task_dir}/{tid}/status", encoding="ascii", errors="replace") as f:
                fields = {k: v for k, _, v in (line.partition(":") for line in f)}
        except OSError:
            continue  # the thread ended meanwhile
        switches = int(fields.get("voluntary_ctxt_switches", 0)) + int(
            fields.get("nonvoluntary_ctxt_switches", 0)
        )
        samples[tid] = _ThreadSample(fields.get("State", "?").strip()[:1], switches)
    return samples


def wait_gloo_idle(timeout_s: float = IDLE_TIMEOUT_S) -> bool:
    """Block until every gloo worker thread of this process is idle; False on timeout.

    Idle means asleep in two looks :data:`IDLE_POLL_S` apart without a single context switch in
    between. The GIL is free between the looks (``time.sleep``), so a thread waiting for it to
    release a finished work would have run; a thread preempted before releasing is runnable
    (``R``). True at once when there is no gloo thread or no ``/proc``.
    """
    deadline = time.monotonic() + timeout_s
    before = _sample_gloo_threads()
    while before:
        time.sleep(IDLE_POLL_S)
        after = _sample_gloo_threads()
        if not after or (after == before and all(s.state == "S" for s in after.values())):
            return True
        if time.monotonic() > deadline:
            return False
        before = after
    return True


__all__ = [
    "install_atexit",
    "mark_failing",
    "register_shutdown",
    "registered_shutdowns",
    "shutdown",
    "unregister_shutdown",
    "wait_gloo_idle",
]
