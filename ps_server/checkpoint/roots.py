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

**Data roots.** A graph table's LoadEdges / LoadNodes request names files the server reads (edge
and node files, globs, fsspec URLs). They are confined too, to the server's *data roots*
(``--data_root``, ``FLEET_PS_DATA_ROOT``, several separated by ``os.pathsep``; default: the
working directory, the checkpoint roots and the system's temporary directory, where generated
graphs are commonly staged): :func:`confine_data_paths` resolves each local path or pattern,
and each file a pattern matches, after ``..`` and symbolic links, and refuses one outside the
roots with :class:`~ps_server.errors.DataPathError` (PERMISSION_DENIED) naming the path, the
roots and the variable. A relative path resolves under the server's working directory, as it
is read. URLs of a remote file system (``s3://``, ``hdfs://``, ``memory://`` ...) pass: the
store's own credentials govern them; ``file://`` and ``local://`` URLs, and chained URLs whose
last part is local (``zip://a::file:///x.zip``), are local paths and confined.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence

from collective.errors import ConfigError
from ps_server.errors import CheckpointPathError, DataPathError

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


DATA_ROOT_ENV = "FLEET_PS_DATA_ROOT"
"""Data roots of a server (``os.pathsep``-separated): where graph files a request names may lie."""
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)
_LOCAL_PROTOCOLS = frozenset({"file", "local"})


def resolve_data_roots(
    roots: str | Sequence[str] | None = None,
    checkpoint_roots: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """Absolute, symlink-resolved data roots: ``roots``, else ``FLEET_PS_DATA_ROOT``, else the
    working directory, ``checkpoint_roots`` and the system's temporary directory."""
    if roots is None:
        roots = (os.environ if environ is None else environ).get(DATA_ROOT_ENV) or None
    if roots is None:
        parts = [os.getcwd(), *checkpoint_roots, tempfile.gettempdir()]
    else:
        parts = roots.split(os.pathsep) if isinstance(roots, str) else [str(r) for r in roots]
    out = tuple(dict.fromkeys(os.path.realpath(p.strip()) for p in parts if p.strip()))
    if not out:
        raise ConfigError(f"must name at least one directory, got {roots!r}", key="data_root")
    return out


def local_part(path: str) -> str | None:
    """The local file-system path ``path`` reads (itself, a ``file://`` / ``local://`` URL's
    path, a chained URL's last part when local); None for a remote URL."""
    last = path.rsplit("::", 1)[-1]
    m = _URL.match(last)
    if m is None:
        return last
    return m.group(2) if m.group(1).lower() in _LOCAL_PROTOCOLS else None


def _check_data(path: str, shown: str, roots: Sequence[str]) -> None:
    if "\x00" in path:
        raise DataPathError(f"graph data path {shown!r} contains a NUL byte")
    real = os.path.realpath(path)
    if not any(_inside(real, root) for root in roots):
        raise DataPathError(
            f"graph data path {shown!r} resolves to {real}, outside this server's data root(s) "
            f"{', '.join(roots)}: put the files under them, or start the servers with "
            f"{DATA_ROOT_ENV} (os.pathsep-separated directories; python -m ps_server: "
            "--data_root) naming their directory"
        )


def confine_data_paths(table: str, paths: str | Sequence[str], roots: Sequence[str]) -> list[str]:
    """``paths`` (files, globs, URLs) as given, once every local one — and every local file a
    pattern matches — lies under ``roots`` (already resolved); DataPathError otherwise."""
    from ps_server.core.graph_files import expand_paths

    items = [paths] if isinstance(paths, str) else list(paths)
    local = []
    for p in items:
        part = local_part(p) if isinstance(p, str) else None
        if part is not None:
            _check_data(part, p, roots)  # before the pattern is expanded: nothing is read
            local.append(p)
    for p, found in zip(local, (expand_paths(table, p) for p in local)):
        for f in found:
            _check_data(local_part(f) or f, f"{f} (matched by {p})" if f != p else p, roots)
    return items


__all__ = [
    "CHECKPOINT_ROOT_ENV",
    "DATA_ROOT_ENV",
    "confine",
    "confine_data_paths",
    "local_part",
    "resolve_data_roots",
    "resolve_roots",
]
