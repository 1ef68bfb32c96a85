"""Packed-bytes encoding of keys, rows and dense values on the wire (both ends use this module).

Keys travel as int64 little-endian (8 bytes per key), rows / gradients / dense values as float32
little-endian, row-major (``n * dim * 4`` bytes). Decoding is a zero-copy ``np.frombuffer`` view
(read-only); a byte count that does not fit the expected shape is a
:class:`~ps_server.errors.TableInputError` naming the table, the field and the sizes, which the
server maps to ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ps_server.errors import TableInputError

KEY_DTYPE = np.dtype("<i8")
"""Keys on the wire: int64 little-endian."""
VALUE_DTYPE = np.dtype("<f4")
"""Rows, gradients and dense values on the wire: float32 little-endian."""
KEY_BYTES = KEY_DTYPE.itemsize
VALUE_BYTES = VALUE_DTYPE.itemsize


def encode_keys(keys: np.ndarray) -> bytes:
    """int64[n] → ``n * 8`` bytes (little-endian)."""
    return np.ascontiguousarray(keys, dtype=KEY_DTYPE).tobytes()


def encode_values(values: np.ndarray) -> bytes:
    """float32 array of any shape → its row-major bytes (little-endian)."""
    return np.ascontiguousarray(values, dtype=VALUE_DTYPE).tobytes()


def decode_keys(table: str, data: bytes, field: str = "keys") -> np.ndarray:
    """``n * 8`` bytes → int64[n] (a read-only view); TableInputError if not a multiple of 8."""
    if len(data) % KEY_BYTES:
        raise TableInputError(
            table,
            field,
            f"{len(data)} bytes is not a multiple of {KEY_BYTES} (int64 little-endian keys); "
            "the request is truncated or not packed int64",
        )
    return np.frombuffer(data, dtype=KEY_DTYPE).astype(np.int64, copy=False)


def decode_rows(
    table: str, data: bytes, num_rows: int, dim: int, field: str = "grads", width: str = "dim"
) -> np.ndarray:
    """``num_rows * dim * 4`` bytes → float32[num_rows, dim] (a read-only view); ``width``
    names ``dim`` in the error (``state_dim`` for optimizer state)."""
    want = num_rows * dim * VALUE_BYTES
    if len(data) != want:
        raise TableInputError(
            table,
            field,
            f"{len(data)} bytes, expected len(keys) * {width} * 4 = {num_rows} * {dim} * "
            f"{VALUE_BYTES} = {want} (float32 little-endian, row-major); "
            + (
                f"they hold {num_rows} rows of {width} {len(data) // (num_rows * VALUE_BYTES)} "
                f"but the table's {width} is {dim}"
                if num_rows and len(data) % (num_rows * VALUE_BYTES) == 0
                else "length mismatch or truncated bytes"
            ),
        )
    return (
        np.frombuffer(data, dtype=VALUE_DTYPE).astype(np.float32, copy=False).reshape(num_rows, dim)
    )


def decode_shows(table: str, data: bytes, num_keys: int) -> np.ndarray:
    """``num_keys * 4`` bytes -> uint32[num_keys] show counts (a read-only view)."""
    if len(data) != num_keys * 4:
        raise TableInputError(
            table,
            "shows",
            f"{len(data)} bytes, expected len(keys) * 4 = {num_keys} * 4 = {num_keys * 4} "
            "(one uint32 little-endian show count per key)",
        )
    return np.frombuffer(data, dtype="<u4").astype(np.uint32, copy=False)


def decode_values(table: str, data: bytes, field: str, numel: int | None = None) -> np.ndarray:
    """``numel * 4`` bytes → float32[numel] (a read-only view); ``numel=None`` takes any whole
    number of floats."""
    if len(data) % VALUE_BYTES or (numel is not None and len(data) != numel * VALUE_BYTES):
        expect = (
            f"{numel} * {VALUE_BYTES} = {numel * VALUE_BYTES}"
            if numel is not None
            else (f"a multiple of {VALUE_BYTES}")
        )
        raise TableInputError(
            table,
            field,
            f"{len(data)} bytes, expected {expect} (float32 little-endian); length mismatch or "
            "truncated bytes",
        )
    return np.frombuffer(data, dtype=VALUE_DTYPE).astype(np.float32, copy=False)


def as_keys(table: str, keys: Any) -> np.ndarray:
    """Client side: any 1-D integer array-like (list, numpy, CPU torch tensor) → int64[n]."""
    arr = np.asarray(keys)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TableInputError(
            table,
            "keys",
            f"must be a 1-D array of integers, got dtype {arr.dtype} and shape {arr.shape}",
        )
    return arr.astype(np.int64, copy=False)


def as_rows(table: str, grads: Any, num_rows: int, dim: int, field: str = "grads") -> np.ndarray:
    """Client side: a float array-like of shape ``(num_rows, dim)`` → contiguous float32."""
    arr = np.asarray(grads)
    if arr.dtype.kind != "f" and arr.size:
        raise TableInputError(table, field, f"must hold floats, got dtype {arr.dtype}")
    arr = arr.astype(np.float32, copy=False)
    if arr.shape != (num_rows, dim) and not (num_rows == 0 and arr.size == 0):
        raise TableInputError(
            table,
            field,
            f"shape must be (len(keys), dim) = ({num_rows}, {dim}), got {arr.shape}",
        )
    return np.ascontiguousarray(arr.reshape(num_rows, dim))


def as_shows(table: str, shows: Any, num_keys: int) -> np.ndarray:
    """Client side: one integer show count per key (0 .. 2**32 - 1) → uint32 little-endian."""
    arr = np.asarray(shows)
    if arr.shape != (num_keys,) or (arr.size and arr.dtype.kind not in "iu"):
        raise TableInputError(
            table,
            "shows",
            f"must be {num_keys} integer show counts (one per key), got dtype {arr.dtype} and "
            f"shape {arr.shape}",
        )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise TableInputError(
            table,
            "shows",
            f"show counts must be in [0, 2**32 - 1], got {int(arr.min())} .. {int(arr.max())}",
        )
    return np.ascontiguousarray(arr, dtype="<u4")


def as_flat_values(table: str, values: Any, field: str) -> np.ndarray:
    """Client side: a float array-like of any shape → contiguous float32[numel]."""
    arr = np.asarray(values)
    if arr.dtype.kind != "f" and arr.size:
        raise TableInputError(table, field, f"must hold floats, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)


__all__ = [
    "KEY_BYTES",
    "KEY_DTYPE",
    "VALUE_BYTES",
    "VALUE_DTYPE",
    "as_flat_values",
    "as_keys",
    "as_rows",
    "as_shows",
    "decode_keys",
    "decode_rows",
    "decode_shows",
    "decode_values",
    "encode_keys",
    "encode_values",
]
