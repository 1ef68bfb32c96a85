"""Synthetic Criteo-like click-through-rate data with a known best achievable AUC.

Each example has ``num_slots`` (26) categorical slots holding one 64-bit id each, ``num_dense``
(13) float features and a 0/1 click label:

* **Sparse ids.** Per slot, a Zipf rank ``r`` in ``[0, vocab_size)`` (``P(r) ~ (r + 1)^-s``, so
  a few ids are very frequent and most are rare, as in Criteo) is mapped to a 64-bit id by
  splitmix64 of ``(slot << 40) | r`` read as a signed int64: ids cover the whole int64 range
  (negative ones included) and are distinct across slots, like hashed feature strings.
* **Dense features.** Log-normal "counts" ``exp(mu_j + sigma_j * z)``, then ``log1p`` and a fixed
  per-feature scale, giving float32 values in about [0, 1.2].
* **Labels** come from a *hidden* logistic model: ``logit = bias + sum_slot w[slot, r] +
  v . (dense - centre)`` with ``w`` drawn from the seed for the ``num_weighted_ranks`` most
  frequent ranks of every slot (each slot with its own scale, the tail at weight 0), and ``bias``
  solved so that the mean click probability is ``target_ctr``. The true probability of every
  example is returned too, so the **Bayes AUC** (the AUC of the true probabilities, the best any
  model can reach on that data) is known: :func:`bayes_auc`.

Determinism: example ``i`` of a seed depends only on ``(seed, i)``. Its random words come from
numpy's counter-based Philox generator positioned at ``i * words_per_example`` (exactly
reproducible and seekable, so trainer ``k`` generates only its own contiguous part of one global
dataset: :func:`shard`, then ``generate(config, count, start)``). Vectorised numpy; about a second
per million examples on one core.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

_U32 = 2.0**-32
_CHUNK = 65536  # examples per vectorised step (bounds the temporaries to ~50 MB)
_ID_TABLE_MAX = 1 << 22  # cache the rank -> id table when num_slots * vocab_size fits (32 MB)
_CALIBRATION_START = 1 << 52  # examples used to solve the bias, far from any dataset's indices
_CALIBRATION_COUNT = 65536
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class CTRDataConfig:
    """What the generator draws; two equal configs give identical data."""

    num_slots: int = 26
    """Categorical slots per example (Criteo: 26), each holding one id; at most 64."""
    num_dense: int = 13
    """Dense float features per example (Criteo: 13); at most 64."""
    vocab_size: int = 100_000
    """Zipf support per slot: the number of distinct ids a slot can take."""
    zipf_exponent: float = 1.15
    """Zipf exponent ``s`` of the id ranks (> 0; ~1.1-1.2 resembles Criteo's id skew)."""
    num_weighted_ranks: int = 1000
    """Most-frequent ranks per slot that carry a hidden weight; rarer ids have weight 0."""
    sparse_weight_scale: float = 0.3
    """Typical std of a slot's hidden id weights (each slot's std is this times U(0, 2))."""
    dense_weight_scale: float = 0.5
    """Std of the hidden weights of the (log-normalised) dense features."""
    target_ctr: float = 0.2
    """Mean click probability the hidden bias is solved for (0 < target_ctr < 1)."""
    seed: int = 0
    """Seed of the data, the hidden weights and the dense feature distributions (>= 0)."""

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_dense"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"CTRDataConfig.{name} must be an int in [1, 64], got {value!r}")
        if not isinstance(self.vocab_size, int) or not 1 <= self.vocab_size < 1 << 40:
            raise ValueError(
                f"CTRDataConfig.vocab_size must be an int in [1, 2**40), got {self.vocab_size!r}"
            )
        if not self.zipf_exponent > 0:
            raise ValueError(f"CTRDataConfig.zipf_exponent must be > 0, got {self.zipf_exponent}")
        if not isinstance(self.num_weighted_ranks, int) or self.num_weighted_ranks < 0:
            raise ValueError(
                "CTRDataConfig.num_weighted_ranks must be an int >= 0, got "
                f"{self.num_weighted_ranks!r}"
            )
        for name in ("sparse_weight_scale", "dense_weight_scale"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CTRDataConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.target_ctr < 1:
            raise ValueError(f"CTRDataConfig.target_ctr must be in (0, 1), got {self.target_ctr}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 63:
            raise ValueError(f"CTRDataConfig.seed must be an int in [0, 2**63), got {self.seed!r}")


@dataclass(frozen=True)
class CTRBatch:
    """Examples ``start_index .. start_index + len - 1`` of one generated dataset."""

    sparse_ids: np.ndarray
    """int64 ``[N, num_slots]``: one 64-bit id per slot (any int64 value, negative included)."""
    dense: np.ndarray
    """float32 ``[N, num_dense]``: log1p-normalised dense features."""
    labels: np.ndarray
    """float32 ``[N]``: 1.0 = click."""
    probs: np.ndarray
    """float64 ``[N]``: the hidden model's true click probability of each example."""
    ranks: np.ndarray
    """int64 ``[N, num_slots]``: the Zipf rank behind each id (0 = the slot's most frequent)."""
    start_index: int = 0
    """Global index of the first example."""

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class _Tables:
    """Everything derived from a config once (cached): Zipf sampler, id map, hidden model."""

    cdf: np.ndarray  # float64 [V]: P(rank <= r)
    # int32 [G]: the rank of every u in cell c = [c/G, (c+1)/G), or -1 when the cell straddles
    # a rank boundary (then u needs a real search). Small enough to stay in cache.
    guide: np.ndarray
    guide_bits: int
    id_table: np.ndarray | None  # int64 [S, V] rank -> id, when small enough to cache
    weights: np.ndarray  # float64 [S, K + 1]: hidden weight per (slot, rank < K); column K = 0
    dense_mu: np.ndarray  # float32 [D]: raw dense feature j = exp(mu_j + sigma_j z)
    dense_sigma: np.ndarray  # float32 [D]
    dense_scale: np.ndarray  # float32 [D]: divides log1p(raw)
    dense_centre: np.ndarray  # float32 [D]: log1p-normalised median
    dense_weights: np.ndarray  # float64 [D]
    bias: float


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function (a bijection of uint64), in place on a uint64 copy."""
    with np.errstate(over="ignore"):  # wrap-around multiplication is the point
        z = np.array(z, dtype=np.uint64, copy=True)
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
        z ^= z >> np.uint64(31)
    return z


def slot_rank_to_id(slot: int | np.ndarray, rank: int | np.ndarray) -> np.ndarray:
    """The 64-bit id of ``rank`` in ``slot``: splitmix64 of ``(slot << 40) | rank`` as int64.

    A bijection, so distinct (slot, rank) pairs never share an id.
    """
    key = (np.asarray(slot, dtype=np.uint64) << np.uint64(40)) | np.asarray(rank, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = key + _GOLDEN
    return _mix64(key).view(np.int64)


def _words_per_example(config: CTRDataConfig) -> int:
    """Random 64-bit words one example consumes: two 32-bit uniforms per word, rounded up to
    Philox's block of 4 words so that every example starts on a block."""
    uniforms = config.num_slots + 2 * math.ceil(config.num_dense / 2) + 1
    return 4 * math.ceil(math.ceil(uniforms / 2) / 4)


def _random_words(config: CTRDataConfig, start: int, count: int) -> np.ndarray:
    """uint32 ``[count, 2 * words]`` random words of examples ``start ..`` (Philox, seeked)."""
    words = _words_per_example(config)
    bit_gen = np.random.Philox(key=config.seed)
    bit_gen.advance(start * words // 4)  # Philox advances in blocks of 4 words
    return bit_gen.random_raw(count * words).view(np.uint32).reshape(count, 2 * words)


def _to_uniform(words: np.ndarray) -> np.ndarray:
    """uint32 words as float64 uniforms in (0, 1) (never exactly 0 or 1)."""
    return (words + 0.5) * _U32


@functools.lru_cache(maxsize=8)
def _tables(config: CTRDataConfig) -> _Tables:
    """Build (once per config) the sampler tables and the hidden model, solving the bias."""
    num_slots, num_dense, vocab = config.num_slots, config.num_dense, config.vocab_size
    pmf = np.arange(1, vocab + 1, dtype=np.float64) ** -config.zipf_exponent
    cdf = np.cumsum(pmf)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    guide_bits = int(min(20, max(12, math.ceil(math.log2(2 * vocab)))))
    edges = np.arange((1 << guide_bits) + 1, dtype=np.float64) / (1 << guide_bits)
    first = np.minimum(np.searchsorted(cdf, edges, side="right"), vocab - 1)
    guide = np.where(first[1:] != first[:-1], -1, first[:-1]).astype(np.int32)

    id_table = None
    if num_slots * vocab <= _ID_TABLE_MAX:
        id_table = slot_rank_to_id(np.arange(num_slots)[:, None], np.arange(vocab)[None, :])

    rng = np.random.default_rng([config.seed, 1])
    num_weighted = min(config.num_weighted_ranks, vocab)
    slot_scale = config.sparse_weight_scale * rng.uniform(0.0, 2.0, num_slots)
    weights = np.zeros((num_slots, num_weighted + 1))
    weights[:, :num_weighted] = rng.standard_normal((num_slots, num_weighted)) * slot_scale[:, None]
    dense_mu = rng.uniform(0.0, 3.0, num_dense)
    dense_sigma = rng.uniform(0.5, 1.5, num_dense)
    dense_scale = np.log1p(np.exp(dense_mu + 3.0 * dense_sigma))
    dense_centre = np.log1p(np.exp(dense_mu)) / dense_scale
    dense_weights = rng.standard_normal(num_dense) * config.dense_weight_scale
    f32 = functools.partial(np.asarray, dtype=np.float32)
    tables = _Tables(
        cdf,
        guide,
        guide_bits,
        id_table,
        weights,
        f32(dense_mu),
        f32(dense_sigma),
        f32(dense_scale),
        f32(dense_centre),
        dense_weights,
        bias=0.0,
    )
    # Solve mean(sigmoid(logit + bias)) = target_ctr on a calibration sample (bisection).
    _, _, _, logits = _draw(config, tables, _CALIBRATION_START, _CALIBRATION_COUNT)
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _sigmoid(logits + mid).mean() < config.target_ctr:
            lo = mid
        else:
            hi = mid
    bias = (lo + hi) / 2
    logger.debug("CTR data %s: hidden bias %.4f", config, bias)
    return dataclasses.replace(tables, bias=bias)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


def _zipf_ranks(tables: _Tables, words: np.ndarray) -> np.ndarray:
    """Inverse-CDF Zipf ranks of uint32 random ``words``: a guide-table lookup on the top bits,
    then an exact search for the few words whose guide cell straddles a rank boundary."""
    ranks = tables.guide[words >> np.uint32(32 - tables.guide_bits)].astype(np.int64)
    flat = ranks.reshape(-1)
    todo = np.flatnonzero(flat < 0)
    u = _to_uniform(words.reshape(-1)[todo])
    flat[todo] = np.minimum(np.searchsorted(tables.cdf, u, side="right"), tables.cdf.size - 1)
    return ranks


def _draw(
    config: CTRDataConfig, tables: _Tables, start: int, count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, dense, label uniforms, logits without the bias) of examples ``start ..``."""
    num_slots, num_dense = config.num_slots, config.num_dense
    words = _random_words(config, start, count)
    ranks = _zipf_ranks(tables, words[:, :num_slots])

    pairs = math.ceil(num_dense / 2)
    # Box-Muller in float32 (numpy's float32 transcendentals are SIMD, ~10x float64's);
    # |z| <= 6.8 with 32-bit uniforms, so exp(mu + sigma z) <= e^14 cannot overflow.
    u1 = _to_uniform(words[:, num_slots : num_slots + pairs]).astype(np.float32)
    u2 = _to_uniform(words[:, num_slots + pairs : num_slots + 2 * pairs]).astype(np.float32)
    radius = np.sqrt(np.float32(-2.0) * np.log(u1))
    angle = np.float32(2 * np.pi) * u2
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)], axis=1)[:, :num_dense]
    dense = np.log1p(np.exp(tables.dense_mu + tables.dense_sigma * z)) / tables.dense_scale

    num_weighted = tables.weights.shape[1] - 1
    flat_index = np.minimum(ranks, num_weighted) + np.arange(num_slots) * (num_weighted + 1)
    logits = np.take(tables.weights, flat_index).sum(axis=1)
    logits += (dense - tables.dense_centre) @ tables.dense_weights
    u_label = _to_uniform(words[:, num_slots + 2 * pairs])
    return ranks, dense, u_label, logits


def generate(config: CTRDataConfig, num_examples: int, start_index: int = 0) -> CTRBatch:
    """Examples ``start_index .. start_index + num_examples - 1`` of the dataset of ``config``.

    Deterministic: the same (config, index) always gives the same example, so
    ``generate(c, n, 0)`` equals the concatenation of ``generate(c, k, 0)`` and
    ``generate(c, n - k, k)``.
    """
    if not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(f"num_examples must be an int >= 0, got {num_examples!r}")
    if not isinstance(start_index, int) or not 0 <= start_index < _CALIBRATION_START:
        raise ValueError(f"start_index must be an int in [0, 2**52), got {start_index!r}")
    tables = _tables(config)
    sparse_ids = np.empty((num_examples, config.num_slots), dtype=np.int64)
    ranks_out = np.empty((num_examples, config.num_slots), dtype=np.int64)
    dense_out = np.empty((num_examples, config.num_dense), dtype=np.float32)
    labels = np.empty(num_examples, dtype=np.float32)
    probs = np.empty(num_examples, dtype=np.float64)
    for lo in range(0, num_examples, _CHUNK):
        hi = min(num_examples, lo + _CHUNK)
        ranks, dense, u_label, logits = _draw(config, tables, start_index + lo, hi - lo)
        p = _sigmoid(logits + tables.bias)
        ranks_out[lo:hi] = ranks
        if tables.id_table is not None:
            slot_offset = np.arange(config.num_slots) * config.vocab_size
            np.take(tables.id_table, ranks + slot_offset, out=sparse_ids[lo:hi])
        else:
            sparse_ids[lo:hi] = slot_rank_to_id(np.arange(config.num_slots)[None, :], ranks)
        dense_out[lo:hi] = dense
        probs[lo:hi] = p
        labels[lo:hi] = u_label < p
    return CTRBatch(sparse_ids, dense_out, labels, probs, ranks_out, start_index)


def shard(num_examples: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, count)`` of trainer ``rank``'s contiguous part of ``num_examples`` examples.

    The first ``num_examples % world_size`` trainers get one example more (Paddle's split).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(f"num_examples must be an int >= 0, got {num_examples!r}")
    base, extra = divmod(num_examples, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with tied scores counting one half), numpy only."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1) > 0.5
    num_pos = int(labels.sum())
    num_neg = labels.size - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError(f"AUC needs both classes, got {num_pos} positives, {num_neg} negatives")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    mid_ranks = ends - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    rank_sum = mid_ranks[inverse][labels].sum()
    return float((rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def bayes_auc(config: CTRDataConfig, num_examples: int = 50_000, start_index: int = 0) -> float:
    """AUC of the true click probabilities on examples ``start_index ..`` (the best AUC any
    model can reach on exactly those examples; use a model's held-out range)."""
    batch = generate(config, num_examples, start_index)
    return roc_auc(batch.probs, batch.labels)


__all__ = [
    "CTRBatch",
    "CTRDataConfig",
    "bayes_auc",
    "generate",
    "roc_auc",
    "shard",
    "slot_rank_to_id",
]
