"""The slot layout of the CTR example's data files, shared by the file writer
(:mod:`.gen_slot_files`), the pipe reader (``reader.py``), the benchmarks and the trainers.

The layout is PaddleRec's Criteo one (``models/rank/dnn``): a label slot ``click``, 26 sparse
slots named ``"1"`` .. ``"26"`` with one id each, and one dense slot ``dense_feature`` of 13
floats, in that order. Two text forms exist:

* **PaddleRec lines** (what a PaddleRec Criteo pre-processing writes)::

      click:0 dense_feature:0.05 ... dense_feature:0.1 1:371155 2:227084 ... 26:26223

* **MultiSlot text** (what Paddle's ``MultiSlotDataGenerator`` prints and Paddle's / our
  ``InMemoryDataset`` parse): for each slot in :data:`SLOT_ORDER`, ``<count> <v1> .. <vcount>``::

      1 0 1 371155 1 227084 ... 1 26223 13 0.05 ... 0.1

Importable without torch and without fleet (the reader runs under Paddle's venv too); only
:func:`make_slots` and :func:`batch_to_inputs` import them, when called.
"""

from __future__ import annotations

from typing import Any

LABEL_SLOT = "click"
"""The 0/1 click label: an int64 slot with one value per example."""
NUM_SPARSE = 26
"""Sparse (categorical) slots per example, Criteo's 26."""
SPARSE_SLOTS = tuple(str(i) for i in range(1, NUM_SPARSE + 1))
"""Names of the sparse slots, PaddleRec's ``"1"`` .. ``"26"``; one int64 id each."""
DENSE_SLOT = "dense_feature"
"""The dense slot: :data:`NUM_DENSE` float32 values per example."""
NUM_DENSE = 13
"""Dense floats per example, Criteo's 13."""
SLOT_ORDER = (LABEL_SLOT, *SPARSE_SLOTS, DENSE_SLOT)
"""Order of the slots in a MultiSlot line (PaddleRec's reader order: label, sparse, dense)."""
DENSE_DECIMALS = 6
"""Decimals the files keep of each dense value; the written text is Python's shortest ``repr``
of the rounded value, so parsing it and printing it again gives the same bytes."""

_INT_SLOTS = frozenset((LABEL_SLOT, *SPARSE_SLOTS))


def parse_paddlerec_line(line: str) -> list[tuple[str, list[int] | list[float]]]:
    """``[(slot, values), ...]`` in :data:`SLOT_ORDER` from one PaddleRec line.

    As PaddleRec's Criteo reader: tokens are ``slot:value`` in any order, a slot may repeat
    (multi-hot), names outside the layout are ignored, a missing int slot becomes ``[0]`` and a
    missing dense slot :data:`NUM_DENSE` zeros (a MultiSlot slot may not be empty).
    """
    ints: dict[str, list[int]] = {name: [] for name in (LABEL_SLOT, *SPARSE_SLOTS)}
    dense: list[float] = []
    for token in line.split():
        name, _, value = token.partition(":")
        if name == DENSE_SLOT:
            dense.append(float(value))
        elif name in _INT_SLOTS:
            ints[name].append(int(value))
    out: list[tuple[str, list[int] | list[float]]] = [
        (name, ints[name] or [0]) for name in (LABEL_SLOT, *SPARSE_SLOTS)
    ]
    out.append((DENSE_SLOT, dense or [0.0] * NUM_DENSE))
    return out


def make_slots() -> list[Any]:
    """The ``use_var`` list of a ``fleet.data`` dataset over these files: ``click`` int64 dense
    dim 1, the 26 sparse int64 slots, ``dense_feature`` float32 dense dim 13."""
    from fleet.data import Slot

    return [
        Slot(LABEL_SLOT, dtype="int64", dense=True, dim=1),
        *(Slot(name, dtype="int64", dense=False) for name in SPARSE_SLOTS),
        Slot(DENSE_SLOT, dtype="float32", dense=True, dim=NUM_DENSE),
    ]


def batch_to_inputs(batch: Any) -> tuple[Any, Any, Any]:
    """``(ids int64 [B, 26], dense float32 [B, 13], labels float32 [B])`` of one ``fleet.data``
    batch, the inputs of :class:`examples.ctr.model.WideDeep` and its loss.

    A sparse slot may be a jagged object (``.values`` / ``.offsets``) or a dense ``[B, 1]``
    tensor; the wide & deep model takes exactly one id per slot, anything else raises.
    """
    import torch

    dense = batch[DENSE_SLOT]
    num_examples = dense.shape[0]
    columns = []
    for name in SPARSE_SLOTS:
        slot = batch[name]
        values = slot if isinstance(slot, torch.Tensor) else slot.values
        if values.numel() != num_examples:
            raise ValueError(
                f"sparse slot {name!r} holds {values.numel()} ids for {num_examples} examples; "
                "the wide & deep model takes exactly one id per slot (write the files with "
                "examples/ctr/gen_slot_files.py, or pool multi-hot slots before the model)"
            )
        columns.append(values.reshape(-1))
    labels = batch[LABEL_SLOT].reshape(-1).to(torch.float32)
    return torch.stack(columns, dim=1), dense, labels


__all__ = [
    "DENSE_DECIMALS",
    "DENSE_SLOT",
    "LABEL_SLOT",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SLOT_ORDER",
    "SPARSE_SLOTS",
    "batch_to_inputs",
    "make_slots",
    "parse_paddlerec_line",
]
