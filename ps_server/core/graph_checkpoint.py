"""Saving and loading graph tables: one file per server, loaded by any number of servers.

A save of graph table ``t`` into directory ``D`` writes ``D/t/config.json`` (the table's config;
every server writes the same bytes) and ``D/t/part-<i>-of-<n>.npz`` from server ``i`` of ``n``:
per edge type the CSR (``src``, ``indptr``, ``dst``, ``weight``, ``eid``), per node type the ids
and one array per feature, and the table's next edge id. Each file is written to a temporary
name and renamed, so a part is either whole or absent; ``.npz`` members carry a CRC-32 that
``zipfile`` checks on read.

A load reads every part of the save (all ``n`` must be present) and keeps the nodes and edges
the loading server owns under the current number of servers, so a table saved by N servers loads
into M (the shards move with the nodes). It builds a new table and replaces the old one at once.

A job checkpoint (:mod:`ps_server.checkpoint.save_load`) holds a server's graph tables with its
sparse and dense ones, in the same layout under ``<checkpoint>/graphs/``: the save is split in
two like theirs, :func:`snapshot_part` under the table's lock (references to the arrays, which
are replaced on a change and never edited in place: no copy) and :func:`write_part` on the
writer's thread, which returns each file's size and CRC-32 for the server's manifest.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ps_server.config import GraphTableConfig
from ps_server.core.graph_table import GraphTable
from ps_server.errors import CheckpointCorruptError, CheckpointError

_PART = re.compile(r"^part-(\d{5})-of-(\d{5})\.npz$")


def config_data(config: GraphTableConfig) -> dict:
    """``config`` as plain data whose features are lists, so a JSON writer that sorts keys
    keeps their order (a feature's position is its column in node files)."""
    data = config.to_dict()
    data["features"] = [[t, [list(f) for f in feats]] for t, feats in config.features]
    return data


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class GraphPart:
    """One server's part of a graph table at one instant (:func:`snapshot_part`)."""

    name: str
    config: GraphTableConfig
    server_index: int
    num_servers: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    nodes: int = 0
    edges: int = 0

    @property
    def file_name(self) -> str:
        """``part-<i>-of-<n>.npz``."""
        return f"part-{self.server_index:05d}-of-{self.num_servers:05d}.npz"

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays it refers to."""
        return sum(int(a.nbytes) for a in self.arrays.values())


def merge_pending(table: GraphTable) -> None:
    """Build the CSR of every edge type from the edges added since the last query (under the
    table's lock only), so that a snapshot taken next finds nothing to merge."""
    with table._lock:
        for store in table._edges.values():
            store.merged()


def snapshot_part(table: GraphTable) -> GraphPart:
    """This server's part of ``table`` now (pending additions merged; the arrays are shared with
    the table, which replaces rather than edits them)."""
    arrays: dict[str, np.ndarray] = {}
    edges = nodes = 0
    with table._lock:
        for name in table._edges:
            csr = table._edges[name].merged()
            for f in ("src", "indptr", "dst", "weight", "eid"):
                arrays[f"e/{name}/{f}"] = getattr(csr, f)
            edges += csr.num_edges
        for t, held in table._nodes.items():
            arrays[f"n/{t}/ids"] = held.ids
            for f, a in held.features.items():
                arrays[f"n/{t}/f/{f}"] = a
            nodes += int(held.ids.shape[0])
        arrays["next_eid"] = np.array([table.next_eid], np.int64)
    return GraphPart(
        table.name, table.config, table.server_index, table.num_servers, arrays, nodes, edges
    )


def _crc_of(path: Path, block_bytes: int = 16 << 20) -> tuple[int, int]:
    crc = size = 0
    with open(path, "rb") as f:
        while block := f.read(block_bytes):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


def write_part(part: GraphPart, directory: str | Path) -> dict[str, tuple[int, int]]:
    """Write ``part`` under ``directory/<table name>/`` (config.json and the part's ``.npz``,
    each atomically and fsynced); returns ``{path relative to directory: (bytes, crc32)}``."""
    root = Path(directory) / part.name
    root.mkdir(parents=True, exist_ok=True)
    config = json.dumps(config_data(part.config), sort_keys=True).encode()
    _write_atomic(root / "config.json", lambda f: f.write(config))
    path = root / part.file_name
    _write_atomic(path, lambda f: np.savez(f, **part.arrays))
    return {
        f"{part.name}/config.json": (len(config), zlib.crc32(config)),
        f"{part.name}/{part.file_name}": _crc_of(path),
    }


def save_part(table: GraphTable, directory: str | Path) -> dict[str, int]:
    """Write this server's part of ``table`` under ``directory/<table name>/``; returns the
    counts written."""
    part = snapshot_part(table)
    write_part(part, directory)
    return {"edges": part.edges, "nodes": part.nodes}


def read_config(directory: str | Path, name: str) -> GraphTableConfig:
    """The config saved with graph table ``name`` under ``directory``."""
    path = Path(directory) / name / "config.json"
    try:
        return GraphTableConfig.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise CheckpointError(
            f"no saved graph table {name!r} in {directory} ({path} is missing)"
        ) from None
    except ValueError as err:
        raise CheckpointCorruptError(f"{path} is not a graph table config: {err}") from None


def _parts(root: Path) -> list[Path]:
    found = {}
    totals = set()
    for p in root.iterdir() if root.is_dir() else ():
        m = _PART.match(p.name)
        if m:
            found[int(m.group(1))] = p
            totals.add(int(m.group(2)))
    if len(totals) != 1:
        raise CheckpointError(
            f"{root}: expected the parts of one save (part-<i>-of-<n>.npz), found "
            f"{sorted(p.name for p in found.values()) or 'none'}"
        )
    (n,) = totals
    missing = [i for i in range(n) if i not in found]
    if missing:
        raise CheckpointError(f"{root}: parts {missing} of {n} are missing; the save is incomplete")
    return [found[i] for i in range(n)]


def load_table(
    directory: str | Path, name: str, server_index: int, num_servers: int
) -> tuple[GraphTable, dict[str, int]]:
    """A new table holding this server's share of the save of ``name`` in ``directory``, and
    the counts it kept."""
    config = read_config(directory, name)
    table = GraphTable(config, server_index, num_servers)
    next_eid = 0
    for path in _parts(Path(directory) / name):
        try:
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        except (OSError, ValueError, zipfile.BadZipFile, KeyError) as err:
            raise CheckpointCorruptError(f"{path} cannot be read: {err}") from None
        next_eid = max(next_eid, int(data["next_eid"][0]))
        for e in table._edges:
            src = np.repeat(data[f"e/{e}/src"], np.diff(data[f"e/{e}/indptr"]))
            table.add_edges(e, src, data[f"e/{e}/dst"], data[f"e/{e}/weight"], data[f"e/{e}/eid"])
        for t, spec in table._specs.items():
            ids = data[f"n/{t}/ids"]
            if ids.shape[0]:
                table.add_nodes(t, ids, {f: data[f"n/{t}/f/{f}"] for f, _, _ in spec})
    table.next_eid = next_eid
    stats = table.stats()
    return table, {
        "edges": sum(stats["edges"].values()),
        "nodes": sum(int(table._nodes[t].ids.shape[0]) for t in table._nodes),
    }


__all__ = [
    "GraphPart",
    "config_data",
    "load_table",
    "merge_pending",
    "read_config",
    "save_part",
    "snapshot_part",
    "write_part",
]
