"""The sparse table's hot loops: compiled (``_kernels.c``, ``_kernels_rows.c``) when built, numpy
otherwise.

``pip install`` compiles ``ps_server/_kernels*.c`` when a C compiler is there (setup.py makes it
optional). The compiled path probes the hash index one key at a time in C and fuses a push —
summing duplicated keys, the optimizer rule, the weight bounds, count / unseen_days / flags —
into one pass over the batch without the GIL; a large batch is split over :func:`set_threads`
threads. Row gathers / scatters, the client's routing and row creation (deduplicating the new
keys, indexing them, the ``Uniform`` and ``Normal`` initializers' values, bit-identical to
numpy's) are compiled too. The numpy path (``hash_index``, ``batch_ops``,
``optimizers``) computes the same results and stays the reference: rules other than the
built-in SGD / Adagrad / Adam (user subclasses of ``OptimizerRule``) always take it.

Why: at 64k-key batches on 1 M rows (dim 8, Adagrad), the numpy push spends its time in ~20
whole-batch passes (probe rounds, gathers and scatters of values and state, the rule's
temporaries); the benchmarks page (docs/benchmarks.md, `ps_kernels`) has the measured speed-up.

``FLEET_PS_KERNELS=numpy`` forces the numpy path (for comparisons and tests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import numpy as np

from ps_server.core.optimizers import SGD, Adagrad, Adam
from ps_server.core.row_flags import CHANGED

try:
    from ps_server.core import _kernels as _c
except ImportError:  # not built (no C compiler at install time)
    _c = None
_FUNCTIONS = (
    "probe",
    "gather",
    "scatter",
    "owned",
    "push",
    "group",
    "insert",
    "distinct",
    "uniform",
    "pack",
)
if _c is not None and not all(hasattr(_c, f) for f in _FUNCTIONS):
    # a build from before the row-creation kernels: the numpy path is right, only slower
    logging.getLogger(__name__).warning(
        "ps_server.core._kernels is an older build (without %s); using the numpy path: "
        "rebuild with `pip install -e .`",
        ", ".join(f for f in _FUNCTIONS if not hasattr(_c, f)),
    )
    _c = None
if _c is not None and getattr(_c, "CHANGED_FLAGS", None) != int(CHANGED):
    # a build from before the serving-export change log: its pushes would not mark rows for
    # the next delta export; the numpy path is right, only slower
    logging.getLogger(__name__).warning(
        "ps_server.core._kernels is an older build (push flags %s, expected %d); using the "
        "numpy path: rebuild with `pip install -e .`",
        getattr(_c, "CHANGED_FLAGS", "?"),
        int(CHANGED),
    )
    _c = None

ENABLED = _c is not None and os.environ.get("FLEET_PS_KERNELS", "c").lower() != "numpy"
"""Whether the compiled kernels are in use in this process."""

_RULE_IDS = {"sgd": 0, "adagrad": 1, "adam": 2}

_threads = 1
_local = threading.local()  # a request thread's own split (:func:`threads_for_call`)


def _split() -> int:
    """Threads this thread's kernel calls split a large batch over."""
    return getattr(_local, "threads", 0) or _threads


@contextlib.contextmanager
def threads_for_call(threads: int) -> Iterator[None]:
    """Within the block, this thread's kernel calls split a large batch over ``threads``
    threads instead of :func:`set_threads`'s (a pass's pull, which its trainer waits for: the
    server may take every core for it). Other threads keep theirs."""
    before = getattr(_local, "threads", 0)
    _local.threads = max(1, int(threads))
    try:
        yield
    finally:
        _local.threads = before


def set_threads(threads: int) -> None:
    """Split one large batch (parts of >= 8192 keys) over up to ``threads`` threads in probe,
    gather and push (the server's ``table_threads``; 1 = the calling thread only)."""
    global _threads
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"table threads must be an integer >= 1, got {threads!r}")
    _threads = threads


def get_threads() -> int:
    """The current :func:`set_threads` value."""
    return _threads


def call_threads() -> int:
    """The threads this thread's calls may split a large batch over (:func:`threads_for_call`
    within its block, else :func:`set_threads`'s); also the SSD tier's reads."""
    return _split()


def probe(slots: np.ndarray, stored_keys: np.ndarray, query: np.ndarray) -> np.ndarray:
    """int64 row of each key in the index ``slots`` (-1 where absent); compiled path only."""
    assert _c is not None
    out = np.empty(query.shape[0], dtype=np.int64)
    _c.probe(slots, stored_keys, np.ascontiguousarray(query, dtype=np.int64), out, _split())
    return out


def gather(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = src[rows[i]]`` where ``rows[i] >= 0`` (others untouched); rows are the first
    axis (any dtype). Compiled path only."""
    assert _c is not None
    if src.shape[1:] != out.shape[1:] or out.shape[0] != rows.shape[0] or src.dtype != out.dtype:
        raise ValueError(
            f"gather: out must be [len(rows), ...] = [{rows.shape[0]}, {src.shape[1:]}] of "
            f"{src.dtype} like src, got {out.shape} of {out.dtype}"
        )
    _c.gather(src, np.ascontiguousarray(rows, dtype=np.int64), out, _split())


def pack(
    records: np.ndarray, template: np.ndarray, rows: np.ndarray, fields: dict[str, np.ndarray]
) -> None:
    """``records[i]`` = the one-record ``template`` with each field of ``fields`` (name: column,
    rows first) set to ``column[rows[i]]`` (every row in range): C-contiguous structured records
    packed in one pass, no temporaries. Compiled path only."""
    assert _c is not None
    if not records.flags.c_contiguous or template.dtype != records.dtype or template.size != 1:
        raise ValueError("pack: records must be contiguous and the template one such record")
    parts = []
    for name, col in fields.items():
        base, offset = records.dtype.fields[name][:2]
        if col.dtype != base.base or col.shape[1:] != base.shape:
            raise ValueError(
                f"pack: field {name!r} takes {base.base}[., {base.shape}], got {col.dtype}"
                f"{col.shape}"
            )
        if base.itemsize:  # an empty field (no optimizer state) has nothing to copy
            parts.append((np.ascontiguousarray(col), base.itemsize, offset))
    _c.pack(
        records.view(np.uint8),
        np.ascontiguousarray(template).view(np.uint8),
        np.ascontiguousarray(rows, dtype=np.int64),
        tuple(parts),
        _split(),
    )


def scatter(src: np.ndarray, positions: np.ndarray, dst: np.ndarray) -> None:
    """``dst[positions] = src`` (rows, the first axis; positions distinct and in range)."""
    assert _c is not None
    if (
        src.shape[1:] != dst.shape[1:]
        or src.shape[0] != positions.shape[0]
        or src.dtype != dst.dtype
    ):
        raise ValueError(
            f"scatter: src must be [len(positions), ...] = [{positions.shape[0]}, "
            f"{dst.shape[1:]}] of {dst.dtype} like dst, got {src.shape} of {src.dtype}"
        )
    _c.scatter(src, np.ascontiguousarray(positions, dtype=np.int64), dst)


def first_unowned(keys: np.ndarray, salt: int, owned: np.ndarray) -> int:
    """Position of the first key whose shard ``owned`` (uint8 per shard) marks 0, or -1."""
    assert _c is not None
    return int(_c.owned(np.ascontiguousarray(keys, dtype=np.int64), salt, owned))


def insert(slots: np.ndarray, stored_keys: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> None:
    """Index distinct absent ``keys`` (written at ``stored_keys[rows]``): each takes the first
    empty slot from its home slot on (the numpy twin is ``HashIndex._place``)."""
    assert _c is not None
    _c.insert(
        slots,
        stored_keys,
        np.ascontiguousarray(keys, dtype=np.int64),
        np.ascontiguousarray(rows, dtype=np.int64),
    )


def distinct(keys: np.ndarray, uniq: np.ndarray, inverse: np.ndarray, counts: np.ndarray) -> int:
    """The distinct ``keys`` in order of first occurrence into ``uniq[:nu]``, each key's index in
    them into ``inverse``, their occurrences into ``counts[:nu]`` (int64 arrays); returns nu."""
    assert _c is not None
    return int(_c.distinct(np.ascontiguousarray(keys, dtype=np.int64), uniq, inverse, counts))


def reindex(slots: np.ndarray, stored_keys: np.ndarray, old_slots: np.ndarray) -> None:
    """Index the live rows (>= 0) of the int32 slot array ``old_slots`` into ``slots``."""
    assert _c is not None
    _c.insert(slots, stored_keys, None, np.ascontiguousarray(old_slots, dtype=np.int32))


def uniform_rows(
    keys: np.ndarray,
    stream: int,
    low: float,
    high: float,
    dst: np.ndarray,
    rows: np.ndarray | None = None,
) -> None:
    """The ``Uniform(low, high)`` initial rows of ``keys`` into ``dst[rows]`` (``dst`` itself
    without rows), float32 ``[., dim]``; ``stream``: ``hashing.stream_of(table, seed, "init")``.
    Bit-identical to ``Uniform.generate`` (numpy)."""
    assert _c is not None
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if rows is not None:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
    _c.uniform(
        keys, stream, float(low), float(high) - float(low), dst.shape[1], dst, rows, _split()
    )


_normal_agrees: bool | None = None


def normal_compiled() -> bool:
    """Whether :func:`normal_rows` may compute the ``Normal`` initializer's rows: a build with
    the kernel whose libm ``log`` / ``cos`` give numpy's values bit for bit (checked once on a
    sample of keys; numpy's own SIMD float64 functions, on AVX-512 machines, may differ in the
    last bit: then the numpy path stays in use)."""
    global _normal_agrees
    if not ENABLED:
        return False
    if _normal_agrees is None:
        _normal_agrees = hasattr(_c, "normal") and _normal_matches_numpy()
    return _normal_agrees


def _normal_matches_numpy() -> bool:
    from ps_server.core.hashing import KeyRNG, stream_of

    keys = np.arange(-2048, 2048, dtype=np.int64) * np.int64(0x9E3779B97F4A7C1)
    want = (0.25 + 1.5 * KeyRNG("check", 7, keys, "init").normal(16, attempt=3)).astype(np.float32)
    got = np.empty((keys.shape[0], 16), dtype=np.float32)
    _c.normal(keys, stream_of("check", 7, "init"), 3, 0.25, 1.5, 16, got)
    return bool(np.array_equal(want.view(np.uint32), got.view(np.uint32)))


def normal_rows(
    keys: np.ndarray,
    stream: int,
    mean: float,
    std: float,
    dst: np.ndarray,
    rows: np.ndarray | None = None,
    attempt: int = 0,
) -> None:
    """The ``Normal(mean, std)`` initial rows of ``keys`` into ``dst[rows]`` (``dst`` itself
    without rows), float32 ``[., dim]``; ``stream``: ``hashing.stream_of(table, seed, "init")``.
    Bit-identical to ``Normal.generate`` (numpy) where :func:`normal_compiled` says so."""
    assert _c is not None
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if rows is not None:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
    _c.normal(keys, stream, attempt, float(mean), float(std), dst.shape[1], dst, rows, _split())


def push_hyper(rule: object) -> tuple[int, np.ndarray] | None:
    """(rule id, float64 hyper-parameters) of a built-in rule, or None (use numpy)."""
    if not ENABLED or type(rule) not in (SGD, Adagrad, Adam):
        return None
    h = np.zeros(8, dtype=np.float64)
    h[0] = rule.lr  # type: ignore[attr-defined]
    if isinstance(rule, Adagrad):
        h[1] = rule.eps
    elif isinstance(rule, Adam):
        h[1], h[2] = rule.betas
        h[3] = rule.eps
    bounds = rule.weight_bounds  # type: ignore[attr-defined]
    if bounds is not None:
        h[4], h[5], h[6] = bounds[0], bounds[1], 1.0
    return _RULE_IDS[rule.TYPE], h  # type: ignore[attr-defined]


def push(
    rule_id: int,
    hyper: np.ndarray,
    cols: dict[str, np.ndarray],
    flags: np.ndarray,
    rows: np.ndarray,
    grads: np.ndarray,
) -> int:
    """Fused push of ``grads`` into ``rows`` (duplicates allowed, all >= 0); distinct rows."""
    assert _c is not None
    return int(
        _c.push(
            rule_id,
            hyper,
            cols["values"],
            cols["state"],
            cols["count"],
            cols["unseen_days"],
            flags,
            np.ascontiguousarray(rows, dtype=np.int64),
            np.ascontiguousarray(grads, dtype=np.float32),
        )
    )


def group(
    keys: np.ndarray, salt: int, num_shards: int, num_servers: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(positions, keys) of ``keys`` per server, in one pass (the compiled twin of
    ``routing.split_by_server``)."""
    assert _c is not None
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    out = np.empty(keys.shape[0], dtype=np.int64)
    grouped = np.empty_like(keys)
    counts = _c.group(keys, salt, num_shards, num_servers, out, grouped)
    bounds = np.cumsum(counts)[:-1]
    return np.split(out, bounds), np.split(grouped, bounds)


__all__ = [
    "ENABLED",
    "distinct",
    "first_unowned",
    "gather",
    "get_threads",
    "group",
    "insert",
    "normal_compiled",
    "normal_rows",
    "probe",
    "push",
    "push_hyper",
    "reindex",
    "scatter",
    "set_threads",
    "threads_for_call",
    "uniform_rows",
]
