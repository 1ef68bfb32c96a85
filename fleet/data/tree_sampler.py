"""Training samples and retrieval over a :class:`~fleet.data.tree_index.TreeIndex` (TDM).

:class:`LayerWiseSampler` turns (user, positive item) pairs into, per layer of the tree, the
item's ancestor as a positive and ``layer_sample_counts`` negatives drawn uniformly (with
replacement) from the other nodes of that layer, as Paddle's ``LayerWiseSampler`` does.
:func:`beam_search` retrieves the top items of a learned (user, node) scorer layer by layer.

::

    sampler = LayerWiseSampler(tree, layer_sample_counts=[1, 2, 4, 8], start_sample_layer=1)
    batch = sampler.sample(item_ids)           # LayerSample: user_idx, node_code, label, level
    logits = model(user_feats[batch.user_idx], tree.node_positions(batch.node_code))
    loss = F.binary_cross_entropy_with_logits(logits, batch.label)

    found = beam_search(tree, lambda codes: model.score(users, codes), len(users),
                        beam_size=64, topk=50)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from collective.errors import ConfigError

if TYPE_CHECKING:  # the index imports this module for its sampler hooks
    from fleet.data.tree_index import TreeIndex


@dataclass(frozen=True)
class LayerSample:
    """Rows for a model, grouped per input (its leaf layer first, then upwards; in each layer
    the positive then its negatives): ``user_idx`` (int64, the input's row), ``node_code``
    (int64), ``label`` (float32, 1 for the positive), ``level`` (int64, the node's layer)."""

    user_idx: torch.Tensor
    node_code: torch.Tensor
    label: torch.Tensor
    level: torch.Tensor

    def __len__(self) -> int:
        return int(self.node_code.numel())


class LayerWiseSampler:
    """Per-layer positives and uniform negatives for layers ``start_sample_layer`` ..
    ``height - 1``.

    ``layer_sample_counts[i]`` is the number of negatives on layer ``start_sample_layer + i``
    (layers past the list's end take 1, as in Paddle); a generator seeded with ``seed`` makes
    the samples reproducible call after call.
    """

    def __init__(
        self,
        tree: TreeIndex,
        layer_sample_counts: Sequence[int],
        start_sample_layer: int = 1,
        seed: int = 0,
    ) -> None:
        self.tree = tree
        h = tree.height()
        if (
            isinstance(start_sample_layer, bool)
            or not isinstance(start_sample_layer, (int, np.integer))
            or not 0 < start_sample_layer < h
        ):
            raise ConfigError(
                f"start_sample_layer {start_sample_layer!r} is out of range: sample from a layer "
                f"in 1 .. {h - 1} (the root, layer 0, has no negatives)",
                key="start_sample_layer",
            )
        n_layers = h - start_sample_layer
        counts = [int(c) for c in layer_sample_counts]
        if len(counts) > n_layers:
            raise ConfigError(
                f"{len(counts)} layer_sample_counts for {n_layers} sampled layers "
                f"({start_sample_layer} .. {h - 1}): give at most one count per layer",
                key="layer_sample_counts",
            )
        counts += [1] * (n_layers - len(counts))
        self.levels = list(range(start_sample_layer, h))
        self.layer_sample_counts = counts
        self.start_sample_layer = int(start_sample_layer)
        for level, count in zip(self.levels, counts):
            size = tree.get_layer_codes(level).size
            if count < 0 or (count > 0 and size < 2):
                raise ConfigError(
                    f"{count} negatives on layer {level} of {size} node(s): counts must be >= 0 "
                    "and a layer of one node has no negatives (start sampling lower)",
                    key="layer_sample_counts",
                )
        self._rng = np.random.default_rng(seed)

    @property
    def rows_per_item(self) -> int:
        """Rows one input turns into: one positive plus the negatives, on every sampled layer."""
        return sum(c + 1 for c in self.layer_sample_counts)

    def _codes(self, item_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[B, rows_per_item]`` codes, labels and levels, leaf layer first."""
        b = item_ids.size
        codes, labels, levels = [], [], []
        for level, count in zip(self.levels[::-1], self.layer_sample_counts[::-1]):
            pos = self.tree.get_ancestor_codes(item_ids, level)
            layer = self.tree.get_layer_codes(level)
            r = self._rng.integers(0, max(layer.size - 1, 1), size=(b, count))
            at = np.searchsorted(layer, pos)[:, None]
            neg = layer[r + (r >= at)]  # uniform over the layer without the positive
            codes.append(np.concatenate([pos[:, None], neg], axis=1))
            lab = np.zeros((b, count + 1), np.float32)
            lab[:, 0] = 1.0
            labels.append(lab)
            levels.append(np.full((b, count + 1), level, np.int64))
        return np.concatenate(codes, 1), np.concatenate(labels, 1), np.concatenate(levels, 1)

    def sample(self, item_ids: Any, user_idx: Any = None) -> LayerSample:
        """Rows for positive items ``item_ids`` (int64, ``[B]``); ``user_idx`` (default
        ``0..B-1``) is repeated onto each input's rows."""
        ids = np.asarray(item_ids)
        if ids.ndim != 1:
            raise ConfigError(f"item_ids must be 1-D, got shape {ids.shape}", key="item_ids")
        codes, labels, levels = self._codes(ids)
        per = codes.shape[1]
        users = np.arange(ids.size) if user_idx is None else np.asarray(user_idx, np.int64)
        if users.shape != ids.shape:
            raise ConfigError(
                f"user_idx has shape {users.shape}, item_ids {ids.shape}: one user per item",
                key="user_idx",
            )
        return LayerSample(
            torch.from_numpy(np.repeat(users.astype(np.int64), per)),
            torch.from_numpy(codes.reshape(-1)),
            torch.from_numpy(labels.reshape(-1)),
            torch.from_numpy(levels.reshape(-1)),
        )

    def sample_rows(
        self, user_input: Any, index_input: Any, with_hierarchy: bool = False
    ) -> np.ndarray:
        """Paddle's layout: int64 rows ``[user features..., node code, label]``.

        ``user_input`` is ``[B, F]`` user feature ids, ``index_input`` the ``B`` positive item
        ids. With ``with_hierarchy`` the user features are item ids too, and above the leaf
        layer each is replaced by its ancestor code on the row's layer.
        """
        users = np.asarray(user_input)
        ids = np.asarray(index_input)
        if users.ndim != 2 or users.shape[0] != ids.size:
            raise ConfigError(
                f"user_input must be [{ids.size}, features] (one row per item), got shape "
                f"{users.shape}",
                key="user_input",
            )
        codes, labels, levels = self._codes(ids)
        feats = np.repeat(users.astype(np.int64)[:, None, :], codes.shape[1], axis=1)
        if with_hierarchy:
            leaf = self.tree.height() - 1
            for level in self.levels:
                if level == leaf:
                    continue
                cols = levels[0] == level
                anc = self.tree.get_ancestor_codes(users.reshape(-1), level).reshape(users.shape)
                feats[:, cols, :] = anc[:, None, :]
        rows = np.concatenate([feats, codes[:, :, None], labels[:, :, None].astype(np.int64)], 2)
        return rows.reshape(-1, rows.shape[2])


@dataclass(frozen=True)
class BeamSearchResult:
    """``item_ids`` / ``leaf_codes`` / ``scores`` are ``[Q, topk]``, best first; where fewer
    leaves were reached ``leaf_codes`` is -1, ``scores`` -inf and ``item_ids`` 0 (item ids may
    be any int64: tell found entries by ``leaf_codes >= 0``). ``scorings`` counts the (query,
    node) scores taken."""

    item_ids: np.ndarray
    leaf_codes: np.ndarray
    scores: torch.Tensor
    scorings: int


def beam_search(
    tree: TreeIndex,
    score_fn: Callable[[torch.Tensor], torch.Tensor],
    num_queries: int,
    beam_size: int,
    topk: int,
) -> BeamSearchResult:
    """Top-``topk`` items per query by beam search, layer by layer.

    ``score_fn(codes)`` scores ``codes`` (int64 ``[Q, C]``, row q for query q) and returns
    ``[Q, C]`` scores. The search starts at the deepest layer of at most ``beam_size`` nodes
    (all kept, none scored), then on each layer below scores the children of the beam and keeps
    the best ``beam_size``; on the leaf layer it keeps the best ``topk``. With a beam as wide as
    the leaf layer this is exhaustive scoring of every leaf.
    """
    for name, v in (("beam_size", beam_size), ("topk", topk), ("num_queries", num_queries)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}", key=name)
    h, k = tree.height(), tree.branch()
    start = 0
    while start + 1 < h and tree.get_layer_codes(start + 1).size <= beam_size:
        start += 1
    beam = torch.from_numpy(tree.get_layer_codes(start)).unsqueeze(0).repeat(num_queries, 1)
    scorings = 0
    if start == h - 1:  # the leaf layer fits the beam: score every leaf
        cand = beam
        scores = torch.as_tensor(score_fn(cand), dtype=torch.float32)
        scorings += int(cand.numel())
    for level in range(start + 1, h):
        offs = torch.arange(1, k + 1, dtype=torch.int64)
        cand = (beam.clamp(min=0).unsqueeze(2) * k + offs).reshape(num_queries, -1)
        valid = torch.from_numpy(tree.contains(cand.numpy())) & (beam >= 0).repeat_interleave(
            k, dim=1
        )
        safe = torch.where(valid, cand, cand[valid][0] if bool(valid.any()) else cand)
        scores = torch.as_tensor(score_fn(safe), dtype=torch.float32)
        scores = scores.masked_fill(~valid, float("-inf"))
        scorings += int(valid.sum())
        cand = torch.where(valid, cand, torch.full_like(cand, -1))
        if level < h - 1:
            keep = min(beam_size, cand.shape[1])
            top = scores.topk(keep, dim=1)
            beam = cand.gather(1, top.indices)
            beam = torch.where(torch.isfinite(top.values), beam, torch.full_like(beam, -1))
    keep = min(topk, cand.shape[1])
    top = scores.topk(keep, dim=1)
    codes = cand.gather(1, top.indices)
    codes = torch.where(torch.isfinite(top.values), codes, torch.full_like(codes, -1))
    out_codes = np.full((num_queries, topk), -1, np.int64)
    out_codes[:, :keep] = codes.numpy()
    out_scores = torch.full((num_queries, topk), float("-inf"))
    out_scores[:, :keep] = top.values
    items = np.zeros_like(out_codes)
    ok = out_codes >= 0
    items[ok] = tree.get_nodes(out_codes[ok])
    return BeamSearchResult(items, out_codes, out_scores, scorings)


__all__ = ["BeamSearchResult", "LayerSample", "LayerWiseSampler", "beam_search"]
