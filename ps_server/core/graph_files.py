"""Graph text files: Paddle's edge and node formats, parsed with vectorised numpy.

Edge files (``load_edge_file``): one edge a line, ``src<TAB>dst[<TAB>weight]``; ids are int64
(any 64-bit signed value), the weight a float (1.0 when absent).

Node files (``load_node_file``): ``type<TAB>id[<TAB>name v v ...]...``: the node type, its id,
then one column per feature, the feature's name followed by its values separated by spaces
(Paddle's layout). The values of a feature configured as ``(dtype, width)`` must be ``width``
numbers of that dtype.

Blank lines are ignored. The fast path parses a whole file with ``np.fromstring`` over masked
byte buffers (no Python per line). When it finds a problem (a line with the wrong number of
columns, a token that is not an int64, an unknown node type or feature, a wrong width), the
file is scanned line by line to name the first bad line (``on_error="raise"``: a
:class:`GraphInputError` naming the file, the line number and the value) or to drop every bad
line and count it (``on_error="skip"``). The line-by-line scan runs only on files that hold a bad
line. Node lines whose features are not all present in the configured order are parsed on that
path too (missing features are zeros).

Files are named by local paths, globs, or fsspec URLs (``s3://``, ``memory://``, ...); names ending
in ``.gz`` are decompressed. Only the storage core's numpy and the standard library are used
(fsspec is imported for URLs only).
"""

from __future__ import annotations

import glob
import gzip
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ps_server.core import graph_kernels
from ps_server.errors import TableInputError

INT64_MIN = np.iinfo(np.int64).min
INT64_MAX = np.iinfo(np.int64).max
ON_ERROR = ("raise", "skip")
_TAB, _NL, _SP = 9, 10, 32


class GraphInputError(TableInputError):
    """A graph request or file is wrong (a malformed line, an unknown type, a bad fanout, a
    metapath that does not chain, features of the wrong width); nothing was changed."""


@dataclass
class ParsedEdges:
    """The edges of one or more files: int64 ``src``, ``dst``, float32 ``weight`` (None when
    no line had one), and how many bad lines ``on_error="skip"`` dropped."""

    src: np.ndarray
    dst: np.ndarray
    weight: np.ndarray | None
    skipped: int = 0


@dataclass
class ParsedNodes:
    """Nodes of one node type: int64 ``ids`` and feature arrays ``{name: [n, width]}``."""

    ids: np.ndarray
    features: dict[str, np.ndarray]


# -- files -----------------------------------------------------------------------------------
def _has_scheme(path: str) -> bool:
    return "://" in path


def expand_paths(table: str, paths: str | Sequence[str]) -> list[str]:
    """Local paths and globs (sorted matches) and fsspec URLs, in order; a pattern or path
    that names nothing is a GraphInputError."""
    items = [paths] if isinstance(paths, str) else list(paths)
    out: list[str] = []
    for p in items:
        if not isinstance(p, str) or not p:
            raise GraphInputError(table, "paths", f"must be file names or globs, got {p!r}")
        if _has_scheme(p):
            if any(c in p for c in "*?["):
                import fsspec  # URLs only

                fs, _, found = fsspec.get_fs_token_paths(p)
                proto = p.split("://", 1)[0]
                out.extend(sorted(f"{proto}://{f}" if "://" not in f else f for f in found))
            else:
                out.append(p)
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p))
            if not found:
                raise GraphInputError(table, "paths", f"the pattern {p!r} matches no file")
            out.extend(found)
        else:
            if not os.path.isfile(p):
                raise GraphInputError(table, "paths", f"no such file {p!r} on this server")
            out.append(p)
    return out


def read_bytes(table: str, path: str) -> bytes:
    """The whole content of ``path`` (a URL through fsspec), gunzipped when it ends in .gz."""
    try:
        if _has_scheme(path):
            import fsspec  # URLs only

            with fsspec.open(path, "rb") as f:
                data = f.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except (OSError, ValueError) as err:
        raise GraphInputError(table, "paths", f"cannot read {path!r}: {err}") from None
    if path.endswith(".gz") or data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data


# -- the byte layout of a text buffer ---------------------------------------------------------
@dataclass
class _Lines:
    buf: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    nfields: np.ndarray
    blank: np.ndarray

    @property
    def num(self) -> int:
        return int(self.starts.shape[0])


def _per_line(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How many bytes of each line ``mask`` marks (one cumulative sum, no search)."""
    csum = np.zeros(mask.shape[0] + 1, np.int64)
    np.cumsum(mask, out=csum[1:])
    return csum[ends] - csum[starts]


def _lines(data: bytes) -> _Lines:
    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(buf == _NL)
    if buf.shape[0] and buf[-1] != _NL:
        ends = np.append(ends, buf.shape[0])
    starts = np.empty_like(ends)
    if ends.shape[0]:
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
    nfields = _per_line(buf == _TAB, starts, ends) + 1
    space = (buf == _SP) | (buf == _TAB) | (buf == _NL) | (buf == 13)
    blank = _per_line(space, starts, ends) == ends - starts
    return _Lines(buf, starts, ends, nfields, blank)


def _field_of_byte(lines: _Lines) -> np.ndarray:
    """For every byte, the index of the tab-separated column it is in (a tab counts to the
    column it opens)."""
    buf = lines.buf
    tab_cum = np.cumsum(buf == _TAB, dtype=np.int32)
    before = np.where(lines.starts > 0, tab_cum[np.maximum(lines.starts - 1, 0)], 0)
    lens = np.minimum(lines.ends + 1, buf.shape[0]) - lines.starts
    return tab_cum - np.repeat(before.astype(np.int32), lens)


def _parse_ints(buf: np.ndarray | bytes, expected: int) -> np.ndarray | None:
    """int64 numbers of ``buf`` (whitespace-separated); None unless exactly ``expected`` parse
    and none is at the int64 limits (where overflow clamps)."""
    if expected == 0:
        return np.empty(0, np.int64)
    try:
        raw = buf if isinstance(buf, bytes) else buf.tobytes()
        vals = np.fromstring(raw, dtype=np.int64, sep=" ")
    except ValueError:
        return None
    if vals.shape[0] != expected or vals.min() == INT64_MIN or vals.max() == INT64_MAX:
        return None
    return vals


def _parse_floats(buf: np.ndarray, expected: int) -> np.ndarray | None:
    if expected == 0:
        return np.empty(0, np.float64)
    try:
        vals = np.fromstring(buf.tobytes(), dtype=np.float64, sep=" ")
    except ValueError:
        return None
    return vals if vals.shape[0] == expected else None


def _int64(token: str) -> int:
    value = int(token, 10)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{token!r} is outside the int64 range")
    return value


# -- edges -----------------------------------------------------------------------------------
_NOT_CONTROL = bytes(range(11, 256))


def _two_columns(data: bytes) -> ParsedEdges | None:
    """The common case, checked on tab and newline positions only: every line ``src<TAB>dst``
    with exactly one tab (None when some line is not, e.g. weights or blank lines). The bytes
    below 11 (tabs, newlines and other control bytes), kept by one ``bytes.translate``, must be
    tab, newline, tab, newline, ... (the last newline may be missing)."""
    seps = data.translate(None, _NOT_CONTROL)
    n = (len(seps) + 1) // 2
    if not seps or (seps != b"\t\n" * n and seps != b"\t\n" * (n - 1) + b"\t"):
        return None
    vals = _parse_ints(data, 2 * n)
    if vals is None:
        return None
    return ParsedEdges(vals[0::2], vals[1::2], None)


def _fast_edges(data: bytes) -> ParsedEdges | None:
    if graph_kernels.ENABLED:
        got = graph_kernels.parse_edges(data)
        if got is not None:
            return ParsedEdges(*got)
    two = _two_columns(data)
    if two is not None:
        return two
    lines = _lines(data)
    keep = ~lines.blank
    nf = lines.nfields[keep]
    if np.any((nf < 2) | (nf > 3)):
        return None
    n = int(nf.shape[0])
    if not np.any(nf == 3):
        vals = _parse_ints(data, 2 * n)
        if vals is None:
            return None
        return ParsedEdges(vals[0::2].copy(), vals[1::2].copy(), None)
    field = _field_of_byte(lines)
    ids_buf = np.where(field >= 2, np.uint8(_SP), lines.buf)
    vals = _parse_ints(ids_buf, 2 * n)
    w_buf = np.where(field == 2, lines.buf, np.uint8(_SP))
    w3 = _parse_floats(w_buf, int(np.count_nonzero(nf == 3)))
    if vals is None or w3 is None:
        return None
    weight = np.ones(n, np.float32)
    weight[nf == 3] = w3.astype(np.float32)
    return ParsedEdges(vals[0::2].copy(), vals[1::2].copy(), weight)


def _check_edge_line(line: str) -> str | None:
    """Why ``line`` is not an edge line (None when it is one)."""
    parts = line.split("\t")
    if len(parts) not in (2, 3):
        return f"has {len(parts)} tab-separated column(s); an edge line is src<TAB>dst[<TAB>weight]"
    for what, tok in zip(("src", "dst"), parts[:2]):
        try:
            _int64(tok.strip())
        except ValueError:
            return f"{what} {tok!r} is not an int64 id"
    if len(parts) == 3:
        try:
            float(parts[2])
        except ValueError:
            return f"weight {parts[2]!r} is not a number"
    return None


def _bad_lines(table: str, data: bytes, name: str, check, on_error: str) -> tuple[bytes, int]:
    """The slow scan: raise for the first bad line, or return the good lines and the count of
    bad ones (``skip``)."""
    good, bad = [], 0
    for number, raw in enumerate(data.split(b"\n"), 1):
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if not text.strip():
            continue
        why = check(text)
        if why is None:
            good.append(raw)
            continue
        if on_error == "raise":
            raise GraphInputError(
                table,
                "file",
                f"{name}, line {number}: {why}: {text[:200]!r} (fix the line, or load with "
                "on_error='skip' to drop and count bad lines)",
            )
        bad += 1
    return b"\n".join(good) + b"\n", bad


def check_on_error(table: str, on_error: str) -> None:
    """GraphInputError unless ``on_error`` is ``raise`` or ``skip``."""
    if on_error not in ON_ERROR:
        raise GraphInputError(table, "on_error", f"must be 'raise' or 'skip', got {on_error!r}")


def parse_edges(table: str, data: bytes, name: str, on_error: str = "raise") -> ParsedEdges:
    """The edges of one file's bytes (see the module docstring)."""
    check_on_error(table, on_error)
    parsed = _fast_edges(data)
    if parsed is not None:
        return parsed
    good, bad = _bad_lines(table, data, name, _check_edge_line, on_error)
    parsed = _fast_edges(good)
    if parsed is None:  # pragma: no cover - the scan accepted only lines the fast path parses
        raise GraphInputError(table, "file", f"{name}: lines could not be parsed")
    parsed.skipped = bad
    return parsed


# -- nodes -----------------------------------------------------------------------------------
FeatureSpec = tuple[tuple[str, str, int], ...]


def _node_line_checker(types: dict[str, FeatureSpec]):
    def check(line: str) -> str | None:
        parts = line.split("\t")
        if len(parts) < 2:
            return "a node line is type<TAB>id[<TAB>name values...]..."
        if parts[0] not in types:
            return f"unknown node type {parts[0]!r} (node types: {sorted(types)})"
        try:
            _int64(parts[1].strip())
        except ValueError:
            return f"id {parts[1]!r} is not an int64 id"
        spec = {f[0]: f for f in types[parts[0]]}
        for col in parts[2:]:
            toks = col.split()
            if not toks:
                continue
            if toks[0] not in spec:
                return f"unknown feature {toks[0]!r} of node type {parts[0]!r} (features: {sorted(spec)})"
            _, dtype, width = spec[toks[0]]
            if len(toks) - 1 != width:
                return f"feature {toks[0]!r} has {len(toks) - 1} value(s), its width is {width}"
            try:
                for t in toks[1:]:
                    _int64(t) if dtype == "int64" else float(t)
            except ValueError:
                return f"feature {toks[0]!r} value {t!r} is not {dtype}"
        return None

    return check


def _slow_nodes(data: bytes, types: dict[str, FeatureSpec]) -> dict[str, ParsedNodes]:
    """Line-by-line parse of lines already checked (any feature order, missing = zeros)."""
    rows: dict[str, list] = {t: [] for t in types}
    for raw in data.split(b"\n"):
        text = raw.decode("utf-8").rstrip("\r")
        if not text.strip():
            continue
        parts = text.split("\t")
        feats = {}
        for col in parts[2:]:
            toks = col.split()
            if toks:
                feats[toks[0]] = toks[1:]
        rows[parts[0]].append((_int64(parts[1].strip()), feats))
    out = {}
    for t, spec in types.items():
        got = rows[t]
        ids = np.array([r[0] for r in got], dtype=np.int64)
        arrays = {}
        for fname, dtype, width in spec:
            a = np.zeros((len(got), width), dtype=np.float64 if dtype == "float32" else np.int64)
            for i, (_, feats) in enumerate(got):
                if fname in feats:
                    a[i] = [_int64(v) for v in feats[fname]] if dtype == "int64" else feats[fname]
            arrays[fname] = a.astype(np.float32) if dtype == "float32" else a
        out[t] = ParsedNodes(ids, arrays)
    return out


def _match_prefix(buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, word: bytes) -> np.ndarray:
    """Lines whose field at ``starts`` (of length ``lens``) is exactly ``word``."""
    ok = lens == len(word)
    for k, ch in enumerate(word):
        pos = np.minimum(starts + k, buf.shape[0] - 1)
        ok &= buf[pos] == ch
    return ok


def _fast_nodes(data: bytes, types: dict[str, FeatureSpec]) -> dict[str, ParsedNodes] | None:
    lines = _lines(data)
    buf = lines.buf
    keep = np.flatnonzero(~lines.blank)
    if np.any(lines.nfields[keep] < 2):
        return None
    tabs = np.flatnonzero(buf == _TAB)
    # the k-th tab of each line: its first tab is at index (tabs before the line)
    tabs_before = np.searchsorted(tabs, lines.starts)
    field = _field_of_byte(lines)
    line_len = np.minimum(lines.ends + 1, buf.shape[0]) - lines.starts
    line_of_byte = np.repeat(np.arange(lines.num), line_len)
    out: dict[str, ParsedNodes] = {}
    matched = np.zeros(lines.num, bool)
    for t, spec in types.items():
        first_tab = tabs[np.minimum(tabs_before[keep], max(tabs.shape[0] - 1, 0))]
        is_t = np.zeros(lines.num, bool)
        is_t[keep] = _match_prefix(
            buf, lines.starts[keep], first_tab - lines.starts[keep], t.encode()
        )
        matched |= is_t
        rows = np.flatnonzero(is_t)
        if rows.shape[0] and np.any(lines.nfields[rows] != 2 + len(spec)):
            return None
        mine = is_t[line_of_byte]
        for k, (fname, _, _) in enumerate(spec):  # the name opens column 2 + k
            fstart = tabs[tabs_before[rows] + 1 + k] + 1 if rows.shape[0] else rows
            flen = np.where(
                k + 1 < len(spec),
                tabs[np.minimum(tabs_before[rows] + 2 + k, tabs.shape[0] - 1)] - fstart,
                lines.ends[rows] - fstart,
            )
            word = fname.encode()
            ok = _match_prefix(buf, fstart, np.full_like(fstart, len(word)), word)
            after = buf[np.minimum(fstart + len(word), buf.shape[0] - 1)]
            if not np.all(ok & ((after == _SP) | (flen == len(word)))):
                return None
        blanked = buf.copy()
        for k, (fname, _, _) in enumerate(spec):
            if rows.shape[0]:
                fstart = tabs[tabs_before[rows] + 1 + k] + 1
                for j in range(len(fname)):
                    blanked[fstart + j] = _SP
        n = int(rows.shape[0])
        ids = _parse_ints(np.where(mine & (field == 1), blanked, np.uint8(_SP)), n)
        if ids is None:
            return None
        arrays = {}
        for k, (fname, dtype, width) in enumerate(spec):
            col = np.where(mine & (field == 2 + k), blanked, np.uint8(_SP))
            vals = (
                _parse_ints(col, n * width) if dtype == "int64" else _parse_floats(col, n * width)
            )
            if vals is None:
                return None
            vals = vals.reshape(n, width)
            arrays[fname] = vals.astype(np.float32) if dtype == "float32" else vals
        out[t] = ParsedNodes(ids, arrays)
    if not np.all(matched[keep]):
        return None
    return out


def parse_nodes(
    table: str, data: bytes, name: str, types: dict[str, FeatureSpec], on_error: str = "raise"
) -> tuple[dict[str, ParsedNodes], int]:
    """Nodes per node type of one file's bytes, and the count of skipped bad lines."""
    check_on_error(table, on_error)
    parsed = _fast_nodes(data, types)
    if parsed is not None:
        return parsed, 0
    good, bad = _bad_lines(table, data, name, _node_line_checker(types), on_error)
    return _slow_nodes(good, types), bad


__all__ = [
    "GraphInputError",
    "ParsedEdges",
    "ParsedNodes",
    "check_on_error",
    "expand_paths",
    "parse_edges",
    "parse_nodes",
    "read_bytes",
]
