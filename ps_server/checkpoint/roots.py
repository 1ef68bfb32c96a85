"""Where a server may save and load checkpoints for its callers: its checkpoint roots.

A Save or Load RPC names a directory on the server's file system. Without a limit, anyone who
may call the server could make it write (or read) wherever its user can. So every path that
comes in a request is confined to the server's roots (``--checkpoint_root``,
``FLEET_PS_CHECKPOINT_ROOT`` — several separated by ``os.pathsep``; default: the server's working
directory):

* a relative path resolves under the first root;
* an absolute path must lie under one of the roots;
* after resolving ``..`` and symbolic links (``os.path.realpath``) the path must still lie under
  a root — a symlink inside a root pointing out of it is refused as well.

A path that fails raises :class:`~ps_server.errors.CheckpointPathError` (PERMISSION_DENIED over
gRPC) naming the roots and the flag. Paths the server's own process chooses (``python -m
ps_server --load DIR``, ``PSServer.load_checkpoint``, ``fleet.init_server(dirname)``) are not
requests and are not confined.

fleetrun sets ``FLEET_PS_CHECKPOINT_ROOT`` for its servers to the directory it was started in
and the job's log directory, unless the job's environment sets it.

The check runs when the request arrives; a symlink swapped in while a save runs is not caught
(the roots are for callers holding the job's token, not for a hostile local user).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from collective.errors import ConfigError
from ps_server.errors import CheckpointPathError

CHECKPOINT_ROOT_ENV = "FLEET_PS_CHECKPOINT_ROOT"
"""Checkpoint roots of a server (``os.pathsep``-separated), when ``--checkpoint_root`` is not
given."""


def resolve_roots(
    roots: str | Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """Absolute, symlink-resolved roots: ``roots`` (a path, an ``os.pathsep``-separated list or a
    sequence), else ``FLEET_PS_CHECKPOINT_ROOT``, else the working directory."""
    if roots is None:
        roots = (os.environ if environ is None else environ).get(CHECKPOINT_ROOT_ENV) or os.getcwd()
    parts = roots.split(os.pathsep) if isinstance(roots, str) else [str(r) for r in roots]
    out = tuple(dict.fromkeys(os.path.realpath(p.strip()) for p in parts if p.strip()))
    if not out:
        raise ConfigError(f"must name at least one directory, got {roots!r}", key="checkpoint_root")
    return out


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def confine(path: str, roots: Sequence[str]) -> str:
    """The real path of ``path`` (relative: under ``roots[0]``) if it lies under one of
    ``roots`` (already resolved, see :func:`resolve_roots`); CheckpointPathError otherwise."""
    if not path:
        raise ConfigError("must name a checkpoint directory", key="dir")
    if "\x00" in path:
        raise CheckpointPathError(f"checkpoint path {path!r} contains a NUL byte")
    real = os.path.realpath(os.path.join(roots[0], path))
    if any(_inside(real, root) for root in roots):
        return real
    shown = ", ".join(roots)
    raise CheckpointPathError(
        f"checkpoint path {path!r} resolves to {real}, outside this server's checkpoint "
        f"root(s) {shown}: use a path under them (a relative path resolves under {roots[0]}), "
        "or start the server with --checkpoint_root naming the directory (fleetrun: set "
        f"{CHECKPOINT_ROOT_ENV} in the job's environment)"
    )


__all__ = ["CHECKPOINT_ROOT_ENV", "confine", "resolve_roots"]
