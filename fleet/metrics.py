"""Distributed evaluation metrics: Paddle's ``fleet.metrics``, over ``torch.distributed``.

Each function takes *this trainer's* statistics, sums (or maxes / mins) them over every trainer
of the default group (or ``group``) and returns the metric of the union of all trainers' data::

    import fleet
    state = fleet.metrics.AucState()                 # 4096-bucket histograms, as Paddle's auc op
    for x, y in my_shard_of_the_test_set:
        state.update(torch.sigmoid(model(x)), y)
    global_auc = fleet.metrics.auc(state.stat_pos, state.stat_neg)
    accuracy = fleet.metrics.acc(num_correct, num_seen)

Without an initialised process group (or in a world of one) no communication happens and the
same formulas apply to the local statistics, so evaluation code runs unchanged single-process.

Inputs may be Python numbers, numpy arrays or torch tensors (any device). Scalar metrics return
Python floats; ``sum`` / ``max`` / ``min`` of an array return a numpy array (int64 for integer or
bool input, float64 for floating input), of a scalar a float.

Async, half-async and GEO trainers of a fleetrun PS job with automatic checkpoints have no
process group: the
same functions gather through fleetrun's coordinator (:mod:`fleet.base.coordination`) and reduce
on each trainer, so a restarted trainer can replay them.

Every rank must call the same function in the same order (they are collectives). Before the data
is reduced, one small all-reduce makes the ranks agree on the input sizes and on whether any rank
found its input invalid, so a bad input on one rank raises :class:`ConfigError` on *every* rank
instead of leaving the others blocked in a collective. Errors (mismatched shapes, negative counts,
zero totals, non-numeric input) name the argument.

``sum``, ``max`` and ``min`` are Paddle's names and shadow the builtins in this module's
namespace: code here uses numpy's reductions (or ``builtins.sum`` and friends), never the bare
names.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from collective.comm import ReduceOp, all_reduce
from collective.errors import ConfigError
from fleet.base import coordination

logger = logging.getLogger(__name__)

DEFAULT_NUM_BUCKETS = 2**12
"""Histogram size of :class:`AucState` (Paddle's auc op: ``num_thresholds=4095`` + 1)."""

MetricInput = Any
"""A Python number, a numpy array or scalar, or a torch tensor."""

_FLOAT, _INT = 0, 1  # transport dtype codes, compared across ranks before reducing


# ---------------------------------------------------------------------------------------------
# input conversion


def _as_array(value: MetricInput, name: str) -> np.ndarray:
    """``value`` as a numpy array: int64 for bool/integer input, float64 for floating input."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        # numpy has no bfloat16; every float becomes float64 below anyway
        value = (value.double() if value.is_floating_point() else value).numpy()
    if isinstance(value, (str, bytes)):
        raise ConfigError(f"expected a number, array or tensor, got {value!r}", key=name)
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"cannot convert {type(value).__name__} to an array: {exc}", key=name
        ) from exc
    if arr.dtype.kind in "biu":
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        return arr.astype(np.float64)
    raise ConfigError(
        f"expected numbers, got dtype {arr.dtype} ({type(value).__name__}); pass ints or floats",
        key=name,
    )


def _as_scalar(value: MetricInput, name: str) -> float:
    """A number, 0-d or one-element array/tensor (Paddle passes shape-[1] arrays) as a float."""
    arr = _as_array(value, name)
    if arr.size != 1:
        raise ConfigError(
            f"expected one number (or a one-element array), got shape {arr.shape}", key=name
        )
    return float(arr.reshape(-1)[0])


def _check_non_negative(value: float | np.ndarray, name: str) -> None:
    bad = ~(np.asarray(value) >= 0)  # NaN counts as bad too
    if bad.any():
        first = np.asarray(value).reshape(-1)[int(np.flatnonzero(bad.reshape(-1))[0])]
        raise ConfigError(
            f"counts and error sums must be >= 0 (and not NaN), got {first}", key=name
        )


def _as_histogram(value: MetricInput, name: str) -> np.ndarray:
    """A bucket histogram: 1-D ``[n]`` or Paddle's ``[1, n]``, non-negative, as float64 ``[n]``."""
    arr = _as_array(value, name)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError(
            f"expected a histogram of shape [num_buckets] or [1, num_buckets], got shape "
            f"{arr.shape}",
            key=name,
        )
    _check_non_negative(arr, name)
    return arr.astype(np.float64)


# ---------------------------------------------------------------------------------------------
# reduction across trainers


def _world_size(group: tdist.ProcessGroup | None) -> int:
    """Trainers taking part: 1 without a process group, else the size of ``group``."""
    if not (tdist.is_available() and tdist.is_initialized()):
        if group is not None:
            raise ConfigError(
                "a process group was given but torch.distributed is not initialised; call "
                "fleet.init() first, or leave group=None for a single-process metric",
                key="group",
            )
        return 1
    size = tdist.get_world_size(group)
    if size < 1:
        raise ConfigError(
            f"rank {tdist.get_rank()} is not a member of the given group; only its members may "
            "call a metric over it",
            key="group",
        )
    return size


def _device(group: tdist.ProcessGroup | None) -> torch.device:
    """Where the backend wants the tensors: the current GPU for NCCL, else the CPU."""
    if "nccl" in str(tdist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(
    name: str,
    build: Callable[[], np.ndarray],
    op: int,
    group: tdist.ProcessGroup | None,
) -> np.ndarray:
    """``build()`` (this rank's validated values) reduced with ``op`` over ``group``.

    In a world of one this is ``build()``. Otherwise a first all-reduce (MAX of a 5-element
    int64 vector) makes the ranks agree on the element count, the dtype and whether any rank's
    ``build()`` raised; only then is the data reduced, so a mismatch raises everywhere instead
    of hanging or mis-reducing.
    """
    client = coordination.active()
    if client is not None:
        return _reduce_coordinated(client, name, build, op, group)
    if _world_size(group) == 1:
        return build()
    device = _device(group)
    error: ConfigError | None = None
    local = np.zeros(0)
    try:
        local = build()
    except ConfigError as exc:
        error = exc
    code = _INT if local.dtype == np.int64 else _FLOAT
    flags = torch.tensor(
        [local.size, -local.size, code, -code, tdist.get_rank() + 1 if error else 0],
        dtype=torch.int64,
        device=device,
    )
    all_reduce(flags, op=ReduceOp.MAX, group=group)
    max_size, neg_min_size, max_code, neg_min_code, bad_rank = flags.tolist()
    if error is not None:
        raise error
    if bad_rank:
        raise ConfigError(
            f"the input was invalid on rank {bad_rank - 1} (see that rank's error); every rank "
            "stops at this metric",
            key=name,
        )
    if max_size != -neg_min_size:
        raise ConfigError(
            f"trainers passed different sizes ({-neg_min_size} to {max_size} elements, this "
            f"rank {local.size}); every trainer must pass the same shape",
            key=name,
        )
    if max_code != -neg_min_code:
        raise ConfigError(
            "some trainers passed integers and others floats; pass the same dtype everywhere",
            key=name,
        )
    tensor = torch.from_numpy(np.ascontiguousarray(local)).to(device)
    all_reduce(tensor, op=op, group=group)
    return tensor.cpu().numpy().reshape(local.shape)


_NUMPY_OPS = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.MIN: np.min}


def _reduce_coordinated(
    client: coordination.CoordinationClient,
    name: str,
    build: Callable[[], np.ndarray],
    op: int,
    group: tdist.ProcessGroup | None,
) -> np.ndarray:
    """:func:`_reduce` for PS trainers that meet through fleetrun's coordinator (no process
    group: :mod:`fleet.base.coordination`): one round gathers every trainer's values (or its
    error), each trainer checks and reduces them the same way. A restarted trainer replaying
    this round gets the others' recorded values and its own new ones."""
    if group is not None:
        coordination.refuse("fleet.metrics over a process group (group=)")
    error: ConfigError | None = None
    local = np.zeros(0)
    try:
        local = build()
    except ConfigError as exc:
        error = exc
    gathered = client.gather(
        ("error", str(error)) if error else ("ok", local), f"fleet.metrics {_OP_NAMES.get(op, op)}"
    )
    if error is not None:
        raise error
    bad = [r for r, (kind, _) in enumerate(gathered) if kind == "error"]
    if bad:
        raise ConfigError(
            f"the input was invalid on rank {bad[0]} (see that rank's error); every "
            "rank stops at this metric",
            key=name,
        )
    arrays = [a for _, a in gathered]
    if len({a.size for a in arrays}) > 1:
        raise ConfigError(
            f"trainers passed different sizes ({sorted({a.size for a in arrays})} "
            f"elements, this rank {local.size}); every trainer must pass the same "
            "shape",
            key=name,
        )
    if len({a.dtype for a in arrays}) > 1:
        raise ConfigError(
            "some trainers passed integers and others floats; pass the same dtype everywhere",
            key=name,
        )
    reduce = _NUMPY_OPS.get(op)
    if reduce is None:
        raise ConfigError(f"reduction {op!r} is not one of SUM, MAX, MIN", key=name)
    stacked = np.stack([a.reshape(local.shape) for a in arrays])
    return np.asarray(reduce(stacked, axis=0), dtype=local.dtype).reshape(local.shape)


_OP_NAMES = {ReduceOp.SUM: "SUM", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN"}


# ---------------------------------------------------------------------------------------------
# AUC


class AucState:
    """This trainer's positive / negative prediction histograms for :func:`auc` (Paddle's
    ``stat_pos`` / ``stat_neg``).

    A prediction ``p`` in [0, 1] falls in bucket ``int(p * (num_buckets - 1))`` (as Paddle's
    auc op, whose default ``num_thresholds=4095`` gives 4096 buckets); the bucket's count in
    ``stat_pos`` or ``stat_neg`` grows by one, after the label.
    """

    def __init__(self, num_buckets: int = DEFAULT_NUM_BUCKETS) -> None:
        """``num_buckets``: histogram size (>= 2); more buckets, finer AUC (error ~1/num_buckets
        at worst, far less for spread-out predictions)."""
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 2:
            raise ConfigError(f"expected an int >= 2, got {num_buckets!r}", key="num_buckets")
        self.num_buckets = num_buckets
        """Number of histogram buckets."""
        self.stat_pos = np.zeros(num_buckets, dtype=np.int64)
        """Positives per prediction bucket."""
        self.stat_neg = np.zeros(num_buckets, dtype=np.int64)
        """Negatives per prediction bucket."""

    def update(self, preds: MetricInput, labels: MetricInput) -> None:
        """Add a batch: ``preds`` probabilities of the positive class, shape ``[N]``, ``[N, 1]``
        or Paddle's ``[N, 2]`` (the last column is used); ``labels`` 0/1 (or bool), ``[N]`` or
        ``[N, 1]``. Logits are refused: apply a sigmoid first."""
        p = _as_array(preds, "preds").astype(np.float64)
        if p.ndim == 2:
            p = p[:, -1]
        y = _as_array(labels, "labels")
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if p.ndim != 1 or y.ndim != 1 or p.shape[0] != y.shape[0]:
            raise ConfigError(
                f"preds shape {np.shape(preds)} and labels shape {np.shape(labels)} do not "
                "describe the same N examples ([N], [N, 1] or preds [N, 2])",
                key="labels",
            )
        if p.size and not ((p >= 0.0) & (p <= 1.0)).all():
            bad = p[~((p >= 0.0) & (p <= 1.0))][0]
            raise ConfigError(
                f"predictions must be probabilities in [0, 1], got {bad}; apply torch.sigmoid "
                "to logits first",
                key="preds",
            )
        if y.size and not ((y == 0) | (y == 1)).all():
            bad = y[~((y == 0) | (y == 1))][0]
            raise ConfigError(f"labels must be 0 or 1, got {bad}", key="labels")
        n = self.num_buckets
        bucket = (p * (n - 1)).astype(np.int64)
        counts = np.bincount(bucket + n * y.astype(np.int64), minlength=2 * n)
        self.stat_neg += counts[:n]
        self.stat_pos += counts[n:]

    def reset(self) -> None:
        """Zero both histograms (start a new evaluation)."""
        self.stat_pos[:] = 0
        self.stat_neg[:] = 0

    @property
    def num_instances(self) -> int:
        """Examples added on this trainer since the last reset."""
        return int(self.stat_pos.sum() + self.stat_neg.sum())

    def auc(self, group: tdist.ProcessGroup | None = None) -> float:
        """:func:`auc` of these histograms over every trainer of ``group`` (a collective)."""
        return auc(self.stat_pos, self.stat_neg, group=group)

    def local_auc(self) -> float:
        """The AUC of this trainer's histograms alone (no communication; safe to call on one
        rank only, e.g. in a progress line). ConfigError when no instance was added."""
        return _bucketed_auc(self.stat_pos.astype(np.float64), self.stat_neg.astype(np.float64))


def auc(
    stat_pos: MetricInput, stat_neg: MetricInput, group: tdist.ProcessGroup | None = None
) -> float:
    """Bucketed ROC AUC of the union of every trainer's data.

    ``stat_pos[i]`` / ``stat_neg[i]`` count the positives / negatives whose prediction fell in
    bucket ``i`` (higher bucket = higher score), shape ``[n]`` or ``[1, n]``. The histograms are
    all-reduced (SUM); then, walking the buckets from the highest down, with ``P_k`` / ``N_k`` the
    positives / negatives seen up to and including bucket ``k``, the trapezoid rule gives::

        area = sum_k (N_k - N_{k-1}) * (P_{k-1} + P_k) / 2
        AUC  = area / (P * N)                  P, N = total positives, negatives

    (pairs inside one bucket count one half, like tied scores). As Paddle, AUC is 0.5 when the
    data has only one class. Histograms that are all zero on every trainer raise ConfigError.
    """

    def build() -> np.ndarray:
        pos = _as_histogram(stat_pos, "stat_pos")
        neg = _as_histogram(stat_neg, "stat_neg")
        if pos.shape != neg.shape:
            raise ConfigError(
                f"has {neg.size} buckets but stat_pos has {pos.size}; both histograms must have "
                "the same number of buckets",
                key="stat_neg",
            )
        return np.concatenate([pos, neg])

    both = _reduce("stat_pos", build, ReduceOp.SUM, group)
    half = both.size // 2
    return _bucketed_auc(both[:half], both[half:])


def _bucketed_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """The trapezoid AUC of :func:`auc` from global histograms (float64, same length)."""
    total_pos, total_neg = float(pos.sum()), float(neg.sum())
    if total_pos + total_neg == 0:
        raise ConfigError(
            "both histograms are all zero on every trainer: no instances to compute an AUC of; "
            "call AucState.update(preds, labels) before auc()",
            key="stat_pos",
        )
    if total_pos == 0 or total_neg == 0:
        logger.debug("AUC of one-class data (%d pos, %d neg) is 0.5", total_pos, total_neg)
        return 0.5
    pos_desc, neg_desc = pos[::-1], neg[::-1]
    cum_pos = np.cumsum(pos_desc)
    area = float(np.sum(neg_desc * (2.0 * cum_pos - pos_desc)) / 2.0)
    return area / (total_pos * total_neg)


# ---------------------------------------------------------------------------------------------
# ratio metrics


def _ratio(
    num: MetricInput,
    num_name: str,
    den: MetricInput,
    den_name: str,
    group: tdist.ProcessGroup | None,
    at_most_den: bool = False,
) -> float:
    """SUM-reduce (num, den) over the trainers and return num / den."""

    def build() -> np.ndarray:
        a, b = _as_scalar(num, num_name), _as_scalar(den, den_name)
        _check_non_negative(a, num_name)
        _check_non_negative(b, den_name)
        if at_most_den and a > b:
            raise ConfigError(f"{a:g} is more than {den_name}={b:g}", key=num_name)
        return np.array([a, b], dtype=np.float64)

    a, b = _reduce(num_name, build, ReduceOp.SUM, group)
    if b == 0:
        raise ConfigError(
            "is 0 summed over every trainer; the metric of no instances is undefined",
            key=den_name,
        )
    return float(a / b)


def acc(correct: MetricInput, total: MetricInput, group: tdist.ProcessGroup | None = None) -> float:
    """Accuracy over every trainer: ``sum_r correct_r / sum_r total_r``.

    ``correct``: this trainer's correctly classified instances; ``total``: its instances
    (``0 <= correct <= total``; the global total must be > 0).
    """
    return _ratio(correct, "correct", total, "total", group, at_most_den=True)


def mae(
    abserr: MetricInput, total_ins_num: MetricInput, group: tdist.ProcessGroup | None = None
) -> float:
    """Mean absolute error over every trainer: ``sum_r abserr_r / sum_r total_ins_num_r``.

    ``abserr``: this trainer's sum of ``|pred - label|``; ``total_ins_num``: its instances.
    """
    return _ratio(abserr, "abserr", total_ins_num, "total_ins_num", group)


def mse(
    sqrerr: MetricInput, total_ins_num: MetricInput, group: tdist.ProcessGroup | None = None
) -> float:
    """Mean squared error over every trainer: ``sum_r sqrerr_r / sum_r total_ins_num_r``.

    ``sqrerr``: this trainer's sum of ``(pred - label)**2``; ``total_ins_num``: its instances.
    """
    return _ratio(sqrerr, "sqrerr", total_ins_num, "total_ins_num", group)


def rmse(
    sqrerr: MetricInput, total_ins_num: MetricInput, group: tdist.ProcessGroup | None = None
) -> float:
    """Root mean squared error over every trainer:
    ``sqrt(sum_r sqrerr_r / sum_r total_ins_num_r)`` (arguments as :func:`mse`)."""
    return math.sqrt(_ratio(sqrerr, "sqrerr", total_ins_num, "total_ins_num", group))


# ---------------------------------------------------------------------------------------------
# element-wise reductions (Paddle's names; they shadow the builtins in this module)


def _elementwise(input: MetricInput, op: int, group: tdist.ProcessGroup | None) -> Any:
    out = _reduce("input", lambda: _as_array(input, "input"), op, group)
    return float(out) if out.ndim == 0 else out


def sum(input: MetricInput, group: tdist.ProcessGroup | None = None) -> Any:
    """Element-wise ``sum_r input_r`` over every trainer: a float for a scalar input, else a
    numpy array of the input's shape (int64 for integer/bool input, float64 for floats)."""
    return _elementwise(input, ReduceOp.SUM, group)


def max(input: MetricInput, group: tdist.ProcessGroup | None = None) -> Any:
    """Element-wise ``max_r input_r`` over every trainer (return types as :func:`sum`)."""
    return _elementwise(input, ReduceOp.MAX, group)


def min(input: MetricInput, group: tdist.ProcessGroup | None = None) -> Any:
    """Element-wise ``min_r input_r`` over every trainer (return types as :func:`sum`)."""
    return _elementwise(input, ReduceOp.MIN, group)


__all__ = [
    "DEFAULT_NUM_BUCKETS",
    "AucState",
    "acc",
    "auc",
    "mae",
    "max",
    "min",
    "mse",
    "rmse",
    "sum",
]
