"""The warm process (a zygote): imports the heavy modules once, then forks workers that run as a
fresh ``python -u -m collective.bootstrap ARGS`` would, without paying the imports again.

fleetrun's agent starts it once per job (``launcher.warm.WarmPool``)::

    python -u -m collective.zygote --socket @NAME --agent PID [--import M ...] [--later M ...]

It imports the ``--import`` modules (numpy, torch, ``torch.distributed``, collective), prints one
line ``{"ready": ...}`` on stdout, then serves spawn requests on the Unix socket until the agent
closes it or dies (``PR_SET_PDEATHSIG``). ``@NAME`` is a socket in Linux's abstract namespace,
which leaves no file behind however the job ends; since such a socket has no file permissions,
the zygote answers only a peer that is the agent itself (``SO_PEERCRED``: its pid and user). Whenever no request has come for
:data:`IDLE_BEFORE_IMPORT_S`, it imports the next ``--later`` module (``torch._dynamo``, fleet,
the PS client, the job file's ``warm_imports:``): a job's first workers are forked as soon as
torch is in, and the restarts find the rest in too. After each import it moves what is alive
to the collector's permanent generation (``gc.freeze``), so the workers' collections leave the
shared pages alone. It never touches CUDA, starts no thread and opens no process group, and it
imports and forks from its one thread only, never both at once, so a fork of it is safe; if an
imported module starts a Python thread, it refuses every later request (the agent then starts
the worker afresh).

A request is a length-prefixed JSON object ``{"argv": [...], "env": {...}, "cwd": "..."}`` with one
file descriptor attached (``SCM_RIGHTS``): the write end of the pipe that becomes the worker's
stdout and stderr. The zygote forks an intermediate that forks the worker and exits at once, so
the worker is adopted by the agent (a child subreaper while it asks): the agent waits for it,
reads its exit status and gets its pidfd exactly as for a worker it started itself. The reply is
``{"pid": N}`` (or ``{"error": "..."}``).

The worker, before it runs the entry point:

* starts its own session (``setsid``: the agent signals its process group);
* waits until the agent has adopted it, then sets ``PR_SET_PDEATHSIG=SIGKILL`` (it dies with the
  agent, as a worker the agent started does); if the agent is already gone it exits;
* takes the pipe as fd 1 and 2 and ``/dev/null`` as fd 0, and closes every other descriptor it
  inherited (as ``Popen(close_fds=True)``);
* resets the signal dispositions the zygote changed to a fresh interpreter's;
* takes the request's environment and working directory;
* reseeds Python's ``random``, numpy's global generator and torch's default CPU generator from
  the OS, as a fresh process seeds them (forked siblings would otherwise share the zygote's
  state). Device generators are not touched: they seed themselves when the device is first
  used, in the worker, as in a fresh process;
* applies ``OMP_NUM_THREADS`` to torch when the request's value differs from the zygote's;
* shows its own environment in ``/proc/PID/environ`` (:func:`set_environ`: written over the
  zygote's environment area, which the agent pads with :data:`ENV_AREA_BYTES` of filler);
* shows ``python -u -m collective.bootstrap ARGS`` as its command line (``ps``, ``top``,
  ``pkill -f``, ``/proc/PID/cmdline``), written over the zygote's in the arguments area as
  setproctitle(3) does (cut to that area's length: the zygote's own command line);
* then runs :func:`collective.bootstrap.main` with the request's arguments: ``-m MODULE`` or a
  script as ``__main__``, the error file, the clean exit;
* and ends as the interpreter would (exit status of ``SystemExit``, an uncaught exception
  through ``sys.excepthook``, death by SIGINT after an uncaught ``KeyboardInterrupt``,
  non-daemon threads joined, atexit handlers run, open files flushed) but without the
  interpreter's finalization, which takes 0.4 to 0.8 s once torch is imported: ``os._exit``,
  as ``multiprocessing``'s forked children end.

What a fork cannot give a worker: its own ``PYTHONHASHSEED`` (siblings share the zygote's hash
seed: ``set`` iteration order of strings agrees between them, as with ``PYTHONHASHSEED`` set),
and a module's import-time reading of a variable that differs per process. The zygote starts
with the job's environment (fleetrun's plus the job's ``env:``), so only the per-process env
contract (``RANK``, ``LOCAL_RANK``, ``PADDLE_*``, ``FLEET_*``, ...) differs, and no fleet module
reads those at import.

Standard library only at import; the preloaded modules are imported by name.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import gc
import importlib
import io
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Any

_PR_SET_PDEATHSIG = 1
MAX_MESSAGE_BYTES = 64 << 20
"""A request or reply larger than this is refused (an environment is a few kilobytes)."""
ADOPTION_TIMEOUT_S = 5.0
"""How long a forked worker waits to be adopted by the agent before it gives up."""
IDLE_BEFORE_IMPORT_S = 0.3
"""Seconds without a spawn request before the warm process imports its next ``--later``
module (the agent asks for a node's workers back to back)."""
ORPHANED_EXIT = 70
"""Exit code of a forked worker whose agent was gone before it could run."""
ENV_AREA_VAR = "FLEETRUN_ENV_AREA"
"""A variable of filler the agent adds to the warm process's environment (and the warm process
drops at once), so that the environment area at the top of its stack, which a forked worker
inherits, has room for the worker's own (:func:`set_environ`)."""
ENV_AREA_BYTES = 65536
"""The filler's length: room for a worker's environment beyond the warm process's."""


class _Become(BaseException):
    """Raised in the forked worker to unwind the zygote's serving stack before it runs."""

    def __init__(self, request: dict[str, Any], out_fd: int) -> None:
        super().__init__()
        self.request = request
        self.out_fd = out_fd


def _set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass


def send_message(sock: socket.socket, data: dict[str, Any], fds: list[int] | None = None) -> None:
    """One length-prefixed JSON message, with ``fds`` attached (``SCM_RIGHTS``)."""
    body = json.dumps(data).encode()
    head = struct.pack("!I", len(body))
    if fds:
        socket.send_fds(sock, [head + body], fds)
    else:
        sock.sendall(head + body)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    chunks, got = [], 0
    while got < n:
        data, new_fds, _flags, _addr = socket.recv_fds(sock, n - got, 4)
        fds.extend(new_fds)
        if not data:
            raise ConnectionError("the peer closed the connection mid-message")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The next message and the file descriptors that came with it."""
    fds: list[int] = []
    (n,) = struct.unpack("!I", _recv_exact(sock, 4, fds))
    if n > MAX_MESSAGE_BYTES:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"message of {n} bytes refused (limit {MAX_MESSAGE_BYTES})")
    data = json.loads(_recv_exact(sock, n, fds))
    if not isinstance(data, dict):
        raise ValueError("a message must be a JSON object")
    return data, fds


def _check(request: dict[str, Any], fds: list[int]) -> str:
    """Why the request cannot be served ("" when it can)."""
    if len(fds) != 1:
        return f"a spawn request carries exactly one descriptor (its stdout), got {len(fds)}"
    argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        return "argv must be a non-empty list of strings"
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        return "env must map strings to strings"
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        return f"cwd {cwd!r} is not a directory"
    return ""


def _spawn(request: dict[str, Any], out_fd: int) -> int:
    """Fork the worker through an intermediate that exits at once; the worker's pid."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate: fork the worker, say its pid, leave it to the agent
        os.close(r)
        try:
            worker = os.fork()
        except OSError:
            os._exit(3)
        if worker == 0:
            os.close(w)
            raise _Become(request, out_fd)
        os.write(w, str(worker).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read()
    os.waitpid(middle, 0)
    if not text:
        raise OSError("the worker could not be forked")
    return int(text)


def _load(name: str) -> str:
    """Import ``name``; "" or why it failed (the rest still load). The cyclic collector is off
    meanwhile: its passes would walk the objects the import keeps, which :func:`_freeze` moves
    out of its reach right after (about a tenth of torch's import time; the cycles it leaves,
    some 7,000 objects after torch, are collected before each later freeze)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - reported, never fatal
        return f"{type(err).__name__}: {err}"
    finally:
        if enabled:
            gc.enable()
    _check_no_cuda()
    return ""


def _freeze(collect: bool) -> None:
    """Move every object alive now to the collector's permanent generation (``gc.freeze``), so
    a worker's collections never write to the pages it shares with this process; ``collect``
    first drops the garbage the last imports left (it would stay frozen otherwise). Also
    :func:`_spare_exit_cleanups`."""
    if collect:
        gc.collect()
    gc.freeze()
    _spare_exit_cleanups()


def _spare_exit_cleanups() -> None:
    """The preloaded torch's own ``weakref.finalize`` clean-ups no longer run at a worker's exit.
    They unregister the operator libraries torch registered at import (``torch.library``), which
    frees nothing another process could see, just before ``os._exit`` frees everything; in a
    forked worker each writes to pages shared with this process, and together they took 40 to
    50 ms of every exit. The script's own finalizers and atexit handlers still run."""
    registry = getattr(weakref.finalize, "_registry", None)
    if not isinstance(registry, dict):
        return
    for fin in list(registry):
        info = registry.get(fin)
        func = getattr(info, "func", None)
        if getattr(func, "__module__", "").startswith("torch."):
            fin.atexit = False


def _threads() -> int:
    """Python threads of this process (a fork copies only the forking one)."""
    return threading.active_count()


def _check_no_cuda() -> None:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is not None and cuda.is_initialized():
        raise SystemExit("collective.zygote: a preloaded module initialised CUDA; not forking")


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The pid and user id of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def serve(
    listener: socket.socket, later: list[str] | None = None, agent: int | None = None
) -> None:
    """Serve spawn requests until an ``{"exit": true}`` one. Runs in the zygote; returns only
    there. ``later``: modules imported while no request waits (after :data:`IDLE_BEFORE_IMPORT_S`
    without one), so the first workers are forked as soon as the early imports are done.
    ``agent``: the only process whose requests are served (others get an error reply)."""
    later = list(later or [])
    while True:
        if later:
            if not select.select([listener], [], [], IDLE_BEFORE_IMPORT_S)[0]:
                name = later.pop(0)
                why = _load(name)
                _freeze(collect=True)
                sys.stderr.write(f"imported {name}\n" if not why else f"{name}: {why}\n")
                sys.stderr.flush()
                continue
        conn, _ = listener.accept()
        with conn:
            if agent is not None and _peer(conn) != (agent, os.getuid()):
                pid, uid = _peer(conn)
                _reply(
                    conn, {"error": f"only the agent (pid {agent}) may ask; pid {pid}, uid {uid}"}
                )
                continue
            try:
                request, fds = recv_message(conn)
            except (OSError, ValueError) as err:
                _reply(conn, {"error": f"bad request: {err}"})
                continue
            if request.get("exit"):
                for fd in fds:
                    os.close(fd)
                _reply(conn, {"bye": True})
                return
            why = _check(request, fds)
            if not why and _threads() > 1:
                why = f"a preloaded module started {_threads() - 1} thread(s); not forking"
            if why:
                for fd in fds:
                    os.close(fd)
                _reply(conn, {"error": why})
                continue
            try:
                pid = _spawn(request, fds[0])  # the forked worker leaves here by _Become
            except OSError as err:
                os.close(fds[0])
                _reply(conn, {"error": f"fork failed: {err}"})
                continue
            os.close(fds[0])
            _reply(conn, {"pid": pid})
            sys.stderr.write(f"forked {pid}: {' '.join(request['argv'])}\n")
            sys.stderr.flush()


def _reply(conn: socket.socket, data: dict[str, Any]) -> None:
    try:
        send_message(conn, data)
    except OSError:
        pass  # the agent went away; it sees no reply and starts the worker afresh


def set_cmdline(argv: list[str]) -> bool:
    """Show ``argv`` as this process's command line by writing over its arguments area (Linux's
    ``arg_start`` .. ``arg_end`` of ``/proc/self/stat``): the words joined by spaces and a NUL,
    NULs after it but a last byte that is not one, so the kernel reads the area as one title up
    to its first NUL (the setproctitle(3) convention; ``psutil`` splits it at the spaces). Text
    longer than the area is cut. False where there is no such area."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, ValueError, IndexError):
        return False
    size = end - start
    if start <= 0 or size < 3:
        return False
    text = " ".join(argv).encode(errors="replace")[: size - 2]
    ctypes.memmove(start, text + b"\0" * (size - len(text) - 1) + b" ", size)
    return True


def _libc_environ() -> list[int]:
    """The addresses of the C library's ``environ`` strings."""
    env = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    out, i = [], 0
    while env[i]:
        out.append(env[i])
        i += 1
    return out


def set_environ(env: dict[str, str]) -> bool:
    """Show ``env`` as this process's ``/proc/PID/environ`` by writing it over the environment
    area the process was started with (``env_start`` .. ``env_end`` of ``/proc/self/stat``):
    ``KEY=VALUE`` entries, each ending in a NUL, then NULs to the area's end (readers such as
    ``psutil`` stop at the first empty entry). Entries that do not fit are left out. Only once
    ``os.environ`` has been replaced, so that the C library's ``environ`` holds copies
    (``setenv``) and nothing reads the area any more; False, untouched, where a string of
    ``environ`` still lies in it, or where there is no such area."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])
        if start <= 0 or end <= start or any(start <= a < end for a in _libc_environ()):
            return False
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    data = bytearray()
    for key, value in env.items():
        entry = os.fsencode(key) + b"=" + os.fsencode(value) + b"\0"
        if len(data) + len(entry) <= end - start:
            data += entry
    ctypes.memmove(start, bytes(data) + b"\0" * (end - start - len(data)), end - start)
    return True


def _become_worker(request: dict[str, Any], out_fd: int, agent: int, zygote_env: dict) -> None:
    """Turn this forked process into the worker (module docstring), then run the entry."""
    os.setsid()
    deadline = time.monotonic() + ADOPTION_TIMEOUT_S
    while os.getppid() != agent and time.monotonic() < deadline:
        time.sleep(0.0005)
    _set_pdeathsig()
    if os.getppid() != agent:
        os._exit(ORPHANED_EXIT)  # never run unsupervised
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.closerange(3, _max_fd())  # as Popen(close_fds=True): only 0, 1 and 2 stay open
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    set_environ(request["env"])
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    set_cmdline([sys.executable, "-u", "-m", "collective.bootstrap", *request["argv"]])
    threads = request["env"].get("OMP_NUM_THREADS")
    if torch is not None and threads and threads != zygote_env.get("OMP_NUM_THREADS"):
        try:
            torch.set_num_threads(int(threads))
        except ValueError:
            pass  # torch ignores a malformed value at import too
    code, interrupted = _run_entry(list(request["argv"]))
    end_process(code, interrupted)


def exit_code(code: object) -> int:
    """The exit status Python gives ``SystemExit(code)`` (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - the status is what matters here
        pass
    return 1


def _run_entry(argv: list[str]) -> tuple[int, bool]:
    """Run the worker's entry as ``python -m collective.bootstrap ARGV`` would; its exit status,
    and whether an uncaught KeyboardInterrupt ended it (Python then dies by SIGINT). An uncaught
    exception goes to ``sys.excepthook`` (the traceback and the error file), as at top level."""
    from collective import bootstrap

    try:
        bootstrap.main(argv)
    except SystemExit as err:
        return exit_code(err.code), False
    except BaseException as err:  # noqa: BLE001 - the top level: reported as Python does
        sys.excepthook(type(err), err, err.__traceback__)
        return 1, isinstance(err, KeyboardInterrupt)
    return 0, False


def _flush_files() -> None:
    """Flush the file objects the worker left open (the interpreter's finalization would, as it
    destroys them): text layers first, then their buffers. Objects frozen in the warm process
    are not looked at (``gc.get_objects`` leaves the permanent generation out): the worker's own
    files are all younger."""
    objs = gc.get_objects()
    for kind in (io.TextIOBase, io.BufferedIOBase):
        for obj in objs:
            if isinstance(obj, kind):
                try:
                    if not obj.closed:
                        obj.flush()
                except Exception:  # noqa: BLE001 - a broken file must not stop the exit
                    pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def end_process(code: int, interrupted: bool = False) -> None:
    """End the forked worker as the interpreter would, without its finalization (the slow part
    once torch is imported: 0.4-0.8 s of tearing down modules): non-daemon threads joined, the
    atexit handlers run (the script's, then the clean exit's), open files flushed, then
    ``os._exit`` (as ``multiprocessing``'s forked children end). Where this Python lacks the
    hooks, the worker returns and the interpreter finalizes as usual."""
    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exitfuncs is None:
        if interrupted:
            raise KeyboardInterrupt
        raise SystemExit(code)
    shutdown()
    run_exitfuncs()
    _flush_files()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 4096


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m collective.zygote")
    p.add_argument(
        "--socket", required=True, help="Unix socket to serve on: a path, or @NAME (abstract)"
    )
    p.add_argument("--agent", type=int, required=True, help="pid of the agent that adopts workers")
    p.add_argument("--import", dest="imports", action="append", default=[], help="module to load")
    p.add_argument(
        "--later", action="append", default=[], help="module to load while no request waits"
    )
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    """The zygote's life: preload, say ready, serve; in a forked worker, run the entry."""
    args = _parse(argv)
    os.environ.pop(ENV_AREA_VAR, None)  # its room stays in the area; no module sees it
    _set_pdeathsig()  # dies with the agent
    if os.getppid() != args.agent:
        raise SystemExit(f"collective.zygote: agent {args.agent} is gone")
    started = time.monotonic()
    loaded, failed = [], {}
    for name in args.imports:
        why = _load(name)
        if why:
            failed[name] = why
        else:
            loaded.append(name)
    _freeze(collect=False)  # the first workers are forked right away: no time to collect
    zygote_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + args.socket[1:] if args.socket.startswith("@") else args.socket)
    listener.listen(64)
    ready = {"ready": True, "loaded": loaded, "failed": failed}
    ready["seconds"] = round(time.monotonic() - started, 3)
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    try:
        serve(listener, args.later, agent=args.agent)
    except _Become as become:
        listener.close()
        _become_worker(become.request, become.out_fd, args.agent, zygote_env)
        return
    listener.close()


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = [
    "ADOPTION_TIMEOUT_S",
    "ENV_AREA_BYTES",
    "ENV_AREA_VAR",
    "IDLE_BEFORE_IMPORT_S",
    "MAX_MESSAGE_BYTES",
    "ORPHANED_EXIT",
    "end_process",
    "exit_code",
    "main",
    "recv_message",
    "send_message",
    "serve",
    "set_cmdline",
    "set_environ",
]
