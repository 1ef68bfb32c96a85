"""Slots: the columns of a MultiSlot example (Paddle's ``use_var``), typed and validated.

Paddle declares the slots of a dataset with static-graph variables
(``paddle.static.data(name, shape, dtype, lod_level)``): ``lod_level=1`` is a variable-length
(sparse) slot, ``lod_level=0`` a dense one of fixed ``shape[1:]``. Here a :class:`Slot` says the
same in four fields, and the label is a slot like any other::

    use_var = [Slot("click", dtype="int64", dense=True),          # lod_level=0, shape [-1, 1]
               *(Slot(str(i)) for i in range(1, 27)),              # lod_level=1, int64 ids
               Slot("dense_feature", dtype="float32", dense=True, dim=13)]

The order of ``use_var`` is the order of the slots in every line of the files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from collective.env import StrEnum
from collective.errors import ConfigError


class SlotDtype(StrEnum):
    """Value types a slot may hold (Paddle's dataset supports exactly these two)."""

    INT64 = "int64"
    """Ids or integer features; Paddle's ``uint64`` feasigns are read as the same 64 bits."""
    FLOAT32 = "float32"
    """Real-valued features."""

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype of the values."""
        return np.dtype(np.int64 if self is SlotDtype.INT64 else np.float32)


@dataclass(frozen=True)
class Slot:
    """One slot of a MultiSlot example.

    A sparse slot (``dense=False``, Paddle's ``lod_level=1``) holds a variable number of values
    per example (ids, usually); a batch gives it as a :class:`~fleet.data.batch.SparseBatch`. A
    dense slot (Paddle's ``lod_level=0``) holds exactly ``dim`` values per example; a batch gives
    it as a ``[B, dim]`` tensor.
    """

    name: str
    """The key of the slot in a batch; unique in ``use_var``. Not written in the files (a line
    names no slots: position says which is which)."""
    dtype: str | SlotDtype = "int64"
    """``"int64"`` or ``"float32"``."""
    dense: bool = False
    """True: exactly ``dim`` values per example; False: any number (0 included)."""
    dim: int = 1
    """Values per example of a dense slot (>= 1); a sparse slot keeps 1."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise ConfigError(
                f"got {self.name!r}; a slot name is a non-empty string without surrounding "
                "spaces, e.g. Slot('click')",
                key="Slot.name",
            )
        try:
            dtype = SlotDtype(self.dtype)
        except ValueError:
            raise ConfigError(
                f"got {self.dtype!r} for slot {self.name!r}; use 'int64' (ids, labels) or "
                "'float32' (real values), as Paddle's dataset",
                key="Slot.dtype",
            ) from None
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.dense, bool):
            raise ConfigError(
                f"got {self.dense!r} for slot {self.name!r}; use True or False", key="Slot.dense"
            )
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ConfigError(
                f"got {self.dim!r} for slot {self.name!r}; dim is an int >= 1 (values per "
                "example of a dense slot)",
                key="Slot.dim",
            )
        if not self.dense and self.dim != 1:
            raise ConfigError(
                f"got dim={self.dim} for sparse slot {self.name!r}; a sparse slot holds any "
                "number of values: drop dim, or set dense=True for exactly dim values",
                key="Slot.dim",
            )

    @property
    def kind_code(self) -> int:
        """The parser's slot kind: bit 0 float32, bit 1 dense."""
        return (1 if self.dtype is SlotDtype.FLOAT32 else 0) | (2 if self.dense else 0)


def check_use_var(use_var: Sequence[Slot]) -> tuple[Slot, ...]:
    """``use_var`` as a tuple of slots, or :class:`ConfigError` naming what is wrong."""
    if isinstance(use_var, (str, bytes, Slot)) or not isinstance(use_var, Sequence):
        raise ConfigError(
            f"got {type(use_var).__name__}; use_var is a list of fleet.data.Slot in the order "
            "of the slots in each line",
            key="use_var",
        )
    slots = tuple(use_var)
    for i, slot in enumerate(slots):
        if not isinstance(slot, Slot):
            raise ConfigError(
                f"item {i} is a {type(slot).__name__} ({slot!r}); use fleet.data.Slot(name, "
                "dtype, dense, dim) where Paddle takes a paddle.static.data variable",
                key="use_var",
            )
    seen: set[str] = set()
    for slot in slots:
        if slot.name in seen:
            raise ConfigError(
                f"slot name {slot.name!r} appears twice; names must be unique", key="use_var"
            )
        seen.add(slot.name)
    return slots


__all__ = ["Slot", "SlotDtype", "check_use_var"]
