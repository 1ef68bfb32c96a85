"""Serving a parameter-server model: ``fleet.ps.export_serving`` (trainers) and
``fleet.ps.ServingModel`` (anywhere).

:func:`export_serving` writes a self-contained, read-only copy of the model on the servers'
file system: per sparse table the rows whose show count (pushes of the key) reached
``min_show`` with their ids, the dense parameters, the layout of the dense parameters (their
names in the model, when ``model=`` is given), the caller's ``model_config`` (any JSON: tables,
slots, feature names) and a manifest (layout: :mod:`ps_server.checkpoint.serving`).
``mode="delta"`` exports only what changed since the previous export: a daily base plus hourly
deltas update a serving copy (``python -m ps_server --serve BASE DELTA1 ...``, or a Load RPC of
each new delta on a running serving server).

:class:`ServingModel` answers lookups from such a copy — loaded in this process from its
directory, or from ``python -m ps_server --serve`` servers given by endpoints: :meth:`pull`
gives rows (zeros for ids it does not hold, as Paddle's serving does), :meth:`predict` runs a
torch model whose :class:`~fleet.ps.embedding.DistributedEmbedding` lookups it answers, with the
model's dense parameters set from the copy. No ``fleet.init`` is needed to serve.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from collective.env import TrainingRole
from collective.errors import ConfigError, FleetError
from fleet.base import coordination
from fleet.ps.communicator import DENSE_BLOCK, DENSE_TABLE
from fleet.ps.recovery import _agree, _gather, _outcome, finish_pending
from fleet.ps.runtime import _require, get_client, get_communicator, lookups_from

logger = logging.getLogger(__name__)


def _dense_layout(model: torch.nn.Module | None) -> dict[str, Any]:
    params = get_communicator().dense
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    return {
        "table": DENSE_TABLE,
        "block": DENSE_BLOCK,
        "params": [{"name": names.get(id(p)), "shape": list(p.shape)} for p in params],
    }


def export_serving(
    dirname: str,
    *,
    min_show: int = 0,
    mode: str = "all",
    model_config: dict[str, Any] | None = None,
    model: torch.nn.Module | None = None,
) -> Any:
    """Export a read-only serving copy of the job's model into ``dirname`` (on the servers,
    under their checkpoint roots; see the module docstring). Every trainer calls it; trainer 0
    asks the servers once all flushed. ``model``: the trained model, to record the names of
    its dense parameters (then :meth:`ServingModel.predict` can set them by name). Returns the
    export's :class:`~ps_server.checkpoint.series.CheckpointRecord` on every trainer. A trainer 0
    restarted alone that replays this call (:func:`fleet.base.coordination.replaying`) does not
    export again: it gets the record of the export it made before its restart."""
    from ps_server.checkpoint.series import record_from_dict

    st = _require("ps.export_serving()", TrainingRole.TRAINER)
    get_communicator().flush()
    _gather(None)  # every trainer flushed

    def export() -> dict[str, Any]:
        finish_pending(st)
        record = get_client().export_serving(
            dirname,
            min_show=min_show,
            mode=mode,
            model_config=model_config,
            extra={"dense": _dense_layout(model)},
        )
        return record.to_dict()

    again = coordination.replaying()  # a restarted trainer 0 exported this before its restart
    return record_from_dict(
        _agree(st.env.rank, _outcome(export) if st.env.rank == 0 and not again else None)
    )


class _Lookups:
    """What DistributedEmbedding sees as its communicator while a ServingModel answers."""

    prefetches = False

    def __init__(self, serving: ServingModel) -> None:
        self._serving = serving

    def pull_sparse(self, table: str, keys: np.ndarray) -> np.ndarray:
        return self._serving.pull(table, keys)

    def prefetch(self, table: str, keys: np.ndarray) -> None:
        """Serving pulls are local or one call: nothing to start early."""

    def record_sparse(self, table: str, keys: np.ndarray, grads: np.ndarray) -> None:
        raise FleetError(
            f"table {table!r}: a serving copy is read-only; run predictions under "
            "torch.no_grad() (ServingModel.predict does) and train on the training servers"
        )


class ServingModel:
    """A serving copy of a parameter-server model: ``source`` is a serving export's directory
    (loaded in this process, with ``deltas`` applied in order) or the endpoints of ``python -m
    ps_server --serve`` servers (``["host:port", ...]`` or ``"h:p,h:p"``; ``client_options`` go
    to :class:`~ps_server.client.PSClient`)."""

    def __init__(
        self,
        source: str | os.PathLike | Sequence[str],
        *,
        deltas: Sequence[str | os.PathLike] = (),
        **client_options: Any,
    ) -> None:
        self._tables: dict[str, Any] | None = None
        self._client: Any = None
        self._dense_loaded: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
            from ps_server.checkpoint.serving import load_serving

            self._tables, self.records = load_serving([source, *deltas])
        else:
            if deltas:
                raise ConfigError(
                    "deltas are loaded by the serving servers (Load RPC)", key="deltas"
                )
            from ps_server import PSClient
            from ps_server.checkpoint.series import record_from_dict

            self._client = PSClient(source, **client_options)
            served = self._client.stats()[0].get("serving") or []
            if not served:
                self._client.close()
                raise ConfigError(
                    f"{source} does not serve an export: start it with `python -m ps_server "
                    "--serve DIR`, or pass the export's directory",
                    key="source",
                )
            self.records = [record_from_dict(r) for r in served]

    @property
    def model_config(self) -> dict[str, Any]:
        """The ``model_config`` the export was made with."""
        return dict(self.records[0].extra.get("model_config") or {})

    def pull(self, table: str, ids: Any) -> np.ndarray:
        """float32[len(ids), dim]: the rows of ``ids`` (any int64 ids, duplicates allowed);
        zeros for ids the copy does not hold."""
        keys = np.ascontiguousarray(
            ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64
        ).reshape(-1)
        if self._client is not None:
            return self._client.pull_sparse(table, keys)
        assert self._tables is not None
        t = self._tables.get(table)
        if t is None or t.KIND != "sparse":
            raise ConfigError(
                f"no sparse table {table!r} in this export; it holds {sorted(self._tables)}",
                key="table",
            )
        return t.pull(keys)

    def dense_values(self) -> np.ndarray:
        """The dense parameters as exported: one flat float32 vector (empty without any)."""
        layout = self.records[0].extra.get("dense") or {}
        if not layout.get("params"):
            return np.zeros(0, np.float32)
        table, block = layout.get("table", DENSE_TABLE), layout.get("block", DENSE_BLOCK)
        if self._client is not None:
            return self._client.pull_dense(table, block)
        assert self._tables is not None
        if table not in self._tables:
            return np.zeros(0, np.float32)
        return self._tables[table].pull_slice(block, 0, 0)[0]

    def load_dense(
        self, model: torch.nn.Module | None = None, params: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Copy the exported dense values into ``model``'s parameters, by the names the export
        recorded (``export_serving(model=...)``), or into ``params`` in the order the trainer's
        optimizer had them."""
        layout = (self.records[0].extra.get("dense") or {}).get("params")
        values = torch.from_numpy(np.asarray(self.dense_values(), np.float32))
        if params is None:
            if model is None:
                raise ConfigError("pass the model or its dense parameters", key="params")
            if not layout or any(p.get("name") is None for p in layout):
                raise ConfigError(
                    "the export does not name its dense parameters (export_serving(..., "
                    "model=model) records them): pass params= in the optimizer's order",
                    key="params",
                )
            named = dict(model.named_parameters())
            missing = [p["name"] for p in layout if p["name"] not in named]
            if missing:
                raise ConfigError(f"the model has no parameters {missing}", key="model")
            params = [named[p["name"]] for p in layout]
        total = sum(p.numel() for p in params)
        if total != values.numel():
            raise ConfigError(
                f"the export holds {values.numel()} dense values, the parameters {total}",
                key="params",
            )
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(values[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    @contextlib.contextmanager
    def lookups(self) -> Iterator[None]:
        """DistributedEmbedding lookups inside answer from this copy (read-only)."""
        with lookups_from(_Lookups(self)):
            yield

    def predict(self, model: torch.nn.Module, *inputs: Any, **kwargs: Any) -> Any:
        """``model(*inputs, **kwargs)`` in eval mode without gradients, its sparse lookups
        answered by this copy; the first call for a model sets its dense parameters from the
        copy (:meth:`load_dense`, by name). The model's training mode is restored after."""
        if model not in self._dense_loaded:
            if self.dense_values().size:
                self.load_dense(model)
            self._dense_loaded.add(model)
        was_training = model.training
        model.eval()
        try:
            with self.lookups(), torch.no_grad():
                return model(*inputs, **kwargs)
        finally:
            model.train(was_training)

    def close(self) -> None:
        """Close the connection to the serving servers (if any)."""
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> ServingModel:  # noqa: PYI034 - py3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ServingModel", "export_serving"]
