"""Paddle's model files for online training, on the parameter server: :func:`load_model` (a
full save or a delta loaded by every server) and :func:`save_cache_model` (a read-only serving
copy); and the trainer-0 agreements the streaming modules share (:func:`_from_rank0`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from collective.errors import ConfigError, FleetError
from fleet.ps import recovery, serving
from fleet.ps import runtime as ps_runtime


def _is_rank0() -> bool:
    return ps_runtime._require("train_days()").env.rank == 0


def _from_rank0(fn: Callable[[], Any]) -> Any:
    """Trainer 0's result of ``fn`` on every trainer (its FleetError raised on every trainer)."""
    st = ps_runtime._require("train_days()")
    return recovery._agree(st.env.rank, recovery._outcome(fn) if st.env.rank == 0 else None)


def _refresh_dense() -> None:
    """After the servers loaded a model: drop cached rows, take the dense values from them."""
    comm = ps_runtime.get_communicator()
    comm.forget_server_values()
    if comm.dense:
        comm._set_dense(comm.pull_dense())
        if hasattr(comm, "set_dense_base"):
            comm.set_dense_base()


def load_model(dirname: str, mode: int = 0) -> dict[str, int]:
    """Paddle's ``fleet.load_model(path, mode)``: every trainer calls it; trainer 0 has every
    server load ``dirname`` (``mode`` 0: a full save replaces the tables; 1: a delta updates
    them, and must follow the model loaded or saved last). Returns rows read per table."""
    if mode not in (0, 1):
        raise ConfigError(f"got {mode!r}; allowed: 0 (a full save), 1 (a delta)", key="mode")
    ps_runtime.get_communicator().flush()
    recovery._gather(None)  # every trainer flushed: nothing reaches the servers after the load

    def load() -> dict[str, int]:
        from ps_server.checkpoint import read_checkpoint

        info = read_checkpoint(dirname)
        want = "all" if mode == 0 else "delta"
        if info.mode != want:
            raise FleetError(
                f"{dirname} holds a {info.mode!r} save; load it with mode="
                f"{0 if info.mode == 'all' else 1}"
            )
        return ps_runtime.get_client().load(dirname)

    rows = _from_rank0(load)
    _refresh_dense()
    return rows


def save_cache_model(
    dirname: str, mode: int = 0, *, min_show: int = 1, model: torch.nn.Module | None = None
) -> Any:
    """Paddle's ``fleet.save_cache_model(dirname, mode=...)``: the rows shown at least
    ``min_show`` times as a read-only serving copy (:func:`fleet.ps.export_serving`; mode 0 all,
    1 only what changed since the previous one). Returns the export's record."""
    if mode not in (0, 1):
        raise ConfigError(f"got {mode!r}; allowed: 0 (all), 1 (delta)", key="mode")
    return serving.export_serving(
        dirname, min_show=min_show, mode="all" if mode == 0 else "delta", model=model
    )


__all__ = ["load_model", "save_cache_model"]
