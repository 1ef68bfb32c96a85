"""A k-ary tree over item ids for tree-based deep retrieval (TDM).

Nodes are named by *codes*: the root is code 0 and node ``c`` has the children
``branch * c + 1 .. branch * c + branch``, so layer ``l`` holds the codes
``[(branch**l - 1) / (branch - 1), (branch**(l + 1) - 1) / (branch - 1))``. Every item is one
leaf, all leaves lie on the last layer (level ``height - 1``; the root is level 0), and a node
exists when some leaf lies under it.

A tree is built either from item embeddings by balanced k-means (:meth:`TreeIndex.build`: each
node's items are split into ``branch`` groups of sizes differing by at most one, all nodes of a
layer at once, so the tree is balanced and its height is ``ceil(log_branch(n)) + 1``) or from
given leaf codes (:meth:`TreeIndex.from_codes`, the layout of Paddle's tree files). Lookups are
vectorised over numpy arrays; the method names are those of Paddle's
``paddle.distributed.fleet.dataset.TreeIndex``.

::

    from fleet.data import TreeIndex, LayerWiseSampler

    tree = TreeIndex.build(item_ids, item_emb, branch=4, seed=0)
    tree.save("tree.npz")
    tree = TreeIndex.load("tree.npz")
    tree.get_ancestor_codes(item_ids[:3], level=2)      # int64 codes on layer 2
    sampler = LayerWiseSampler(tree, layer_sample_counts=[2, 4, 8], seed=0)
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np

from collective.errors import ConfigError, FleetError
from fleet.data.errors import DataSourceError

FORMAT = "fleetrun.tree_index"
VERSION = 1
_MAX_CODE = np.iinfo(np.int64).max


class UnknownItemError(FleetError, LookupError):
    """An item id (or node code) asked of a :class:`TreeIndex` is not in the tree."""

    def __init__(self, message: str, values: np.ndarray) -> None:
        super().__init__(message)
        self.values = values

    def __str__(self) -> str:  # LookupError's would quote the message
        return str(self.args[0]) if self.args else ""


def _layer_offsets(branch: int) -> np.ndarray:
    """First code of every layer that fits int64: ``offsets[l] = (branch**l - 1) / (branch - 1)``."""
    offsets = [0]
    size = 1
    while offsets[-1] <= (_MAX_CODE - size) and size <= _MAX_CODE // branch:
        offsets.append(offsets[-1] + size)
        size *= branch
    return np.asarray(offsets, dtype=np.int64)


def _check_branch(branch: Any) -> int:
    if isinstance(branch, bool) or not isinstance(branch, (int, np.integer)) or branch < 2:
        raise ConfigError(
            f"the tree's branch must be an integer >= 2, got {branch!r}: pass branch=2 (binary) "
            "or more children per node",
            key="branch",
        )
    return int(branch)


def _check_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """``ids`` as a 1-D int64 array with no duplicates (integer arrays of other widths convert)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ConfigError(
            f"item ids must be a 1-D array of int64, got dtype {arr.dtype} shape {arr.shape}: "
            "pass np.asarray(ids, dtype=np.int64)",
            key=what,
        )
    if arr.dtype == np.uint64 and arr.size and arr.max() > _MAX_CODE:
        raise ConfigError(
            f"item id {int(arr.max())} does not fit int64: map ids into [-2**63, 2**63)", key=what
        )
    arr = arr.astype(np.int64, copy=False)
    if arr.size == 0:
        raise ConfigError("no item ids given: a tree needs at least one item", key=what)
    uniq, counts = np.unique(arr, return_counts=True)
    if uniq.size != arr.size:
        dup = uniq[counts > 1]
        raise ConfigError(
            f"duplicate item ids {dup[:5].tolist()} ({dup.size} in all): every item is one leaf, "
            "pass each id once",
            key=what,
        )
    return arr


def _balanced_split(
    emb: np.ndarray, groups: np.ndarray, sizes: np.ndarray, branch: int, iters: int, rng
) -> np.ndarray:
    """Split every group into ``branch`` parts of near-equal sizes by balanced k-means.

    ``groups`` is ``[G, S]`` item rows padded with -1, ``sizes`` the valid count per group.
    Returns ``[G, S]`` child numbers (0..branch-1; -1 on padding). All groups run at once.
    """
    g, s = groups.shape
    valid = groups >= 0
    x = emb[np.where(valid, groups, 0)]  # [G, S, d]
    caps = sizes[:, None] // branch + (np.arange(branch)[None, :] < (sizes[:, None] % branch))
    # Initial centres: `branch` distinct random items of each group.
    keys = np.where(valid, rng.random((g, s)), np.inf)
    pick = np.argsort(keys, axis=1)[:, np.minimum(np.arange(branch), s - 1)]
    pick = np.where(np.take_along_axis(valid, pick, axis=1), pick, 0)
    centres = np.take_along_axis(x, pick[:, :, None], axis=1)  # [G, k, d]
    assign = np.full((g, s), -1, dtype=np.int64)
    for _ in range(iters):
        diff = x[:, :, None, :] - centres[:, None, :, :]
        dist = np.einsum("gskd,gskd->gsk", diff, diff)  # [G, S, k] squared distances
        new = np.full((g, s), -1, dtype=np.int64)
        free = valid.copy()
        for j in range(branch - 1):
            # Items that prefer child j most over the children still to fill go first.
            pref = dist[:, :, j] - dist[:, :, j + 1 :].min(axis=2)
            order = np.argsort(np.where(free, pref, np.inf), axis=1, kind="stable")
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, np.arange(s)[None, :].repeat(g, 0), axis=1)
            take = free & (rank < caps[:, j : j + 1])
            new[take] = j
            free &= ~take
        new[free] = branch - 1
        if np.array_equal(new, assign):
            break
        assign = new
        onehot = (assign[:, :, None] == np.arange(branch)[None, None, :]).astype(x.dtype)
        counts = onehot.sum(1)  # [G, k]
        sums = np.einsum("gsk,gsd->gkd", onehot, x)
        centres = np.where(
            counts[:, :, None] > 0, sums / np.maximum(counts, 1)[:, :, None], centres
        )
    return assign


class TreeIndex:
    """A balanced k-ary tree over int64 item ids, with node embeddings when built from item
    embeddings. Build with :meth:`build` or :meth:`from_codes`, or :meth:`load` a saved one."""

    def __init__(
        self,
        branch: int,
        ids: np.ndarray,
        leaf_codes: np.ndarray,
        node_emb: np.ndarray | None = None,
        name: str = "tree",
    ) -> None:
        self._branch = _check_branch(branch)
        self.name = name
        ids = _check_ids(ids)
        codes = np.asarray(leaf_codes)
        if codes.shape != ids.shape or not np.issubdtype(codes.dtype, np.integer):
            raise ConfigError(
                f"leaf codes must be an integer array of the ids' shape {ids.shape}, got dtype "
                f"{codes.dtype} shape {codes.shape}: pass one code per id",
                key="codes",
            )
        codes = codes.astype(np.int64, copy=False)
        if codes.min() < 0:
            raise ConfigError(
                f"leaf code {int(codes.min())} is negative: codes start at 0 (the root)",
                key="codes",
            )
        self._offsets = _layer_offsets(self._branch)
        levels = np.searchsorted(self._offsets, codes, side="right") - 1
        if levels.min() != levels.max():
            bad = int(np.argmin(levels)) if levels.min() < levels.max() else 0
            raise ConfigError(
                f"leaf codes lie on layers {int(levels.min())}..{int(levels.max())} (code "
                f"{int(codes[bad])} of id {int(ids[bad])} is on layer {int(levels[bad])}): every "
                "leaf must be on the last layer; extend shorter paths by their first child",
                key="codes",
            )
        if np.unique(codes).size != codes.size:
            raise ConfigError(
                "two items share a leaf code: every item needs a leaf of its own", key="codes"
            )
        self._height = int(levels[0]) + 1
        order = np.argsort(ids, kind="stable")
        self._ids = ids[order]  # sorted, for searchsorted lookups
        self._id_codes = codes[order]
        layers = [np.unique(codes)]
        for _ in range(self._height - 1):
            layers.append(np.unique((layers[-1] - 1) // self._branch))
        self._layers = layers[::-1]  # [level] -> sorted codes
        self._node_codes = np.concatenate(self._layers)  # sorted: layers are consecutive ranges
        leaf_order = np.argsort(codes, kind="stable")
        self._leaf_ids = ids[leaf_order]  # item id of each leaf, by leaf code
        if node_emb is not None:
            node_emb = np.ascontiguousarray(node_emb, dtype=np.float32)
            if node_emb.ndim != 2 or node_emb.shape[0] != self._node_codes.size:
                raise ConfigError(
                    f"node embeddings must be [{self._node_codes.size}, dim] (one row per node), "
                    f"got shape {node_emb.shape}",
                    key="node_emb",
                )
        self._node_emb = node_emb
        self._layerwise_sampler: Any = None  # init_layerwise_sampler's LayerWiseSampler

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        ids: Any,
        embeddings: Any,
        branch: int = 2,
        seed: int = 0,
        kmeans_iters: int = 10,
        name: str = "tree",
    ) -> TreeIndex:
        """A balanced tree from item embeddings (``[len(ids), dim]``) by recursive balanced
        k-means: deterministic for a seed. Internal nodes get the mean embedding of their
        leaves (``node_emb``)."""
        branch = _check_branch(branch)
        ids = _check_ids(ids)
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.ndim != 2 or emb.shape[0] != ids.size:
            raise ConfigError(
                f"embeddings must be [{ids.size}, dim] (one row per id), got shape {emb.shape}: "
                "pass the item embedding matrix in the order of ids",
                key="embeddings",
            )
        if not np.isfinite(emb).all():
            raise ConfigError("embeddings hold NaN or inf values", key="embeddings")
        n = ids.size
        height = 1
        while branch ** (height - 1) < n:
            height += 1
        rng = np.random.default_rng(seed)
        # Groups of the current layer: items (rows of emb) padded with -1, their node codes.
        groups = np.arange(n, dtype=np.int64)[None, :]
        sizes = np.array([n], dtype=np.int64)
        codes = np.zeros(1, dtype=np.int64)
        for _ in range(height - 1):
            child = _balanced_split(emb, groups, sizes, branch, kmeans_iters, rng)
            csizes = sizes[:, None] // branch + (
                np.arange(branch)[None, :] < (sizes[:, None] % branch)
            )
            width = int(csizes.max())
            # Each child's items in their current order, left-aligned, padded.
            key = np.where(child >= 0, child, branch)
            order = np.argsort(key, axis=1, kind="stable")
            sorted_items = np.take_along_axis(groups, order, axis=1)
            starts = np.concatenate(
                [np.zeros((len(sizes), 1), np.int64), np.cumsum(csizes, 1)[:, :-1]], 1
            )
            cols = starts[:, :, None] + np.arange(width)[None, None, :]  # [G, k, W]
            ok = np.arange(width)[None, None, :] < csizes[:, :, None]
            gathered = np.take_along_axis(
                sorted_items[:, None, :].repeat(branch, 1),
                np.minimum(cols, sorted_items.shape[1] - 1),
                axis=2,
            )
            new_groups = np.where(ok, gathered, -1).reshape(-1, width)
            new_sizes = csizes.reshape(-1)
            new_codes = (branch * codes[:, None] + 1 + np.arange(branch)[None, :]).reshape(-1)
            keep = new_sizes > 0
            groups, sizes, codes = new_groups[keep], new_sizes[keep], new_codes[keep]
        leaf_codes = np.empty(n, dtype=np.int64)
        leaf_codes[groups[:, 0]] = codes
        tree = cls(branch, ids, leaf_codes, None, name)
        tree._node_emb = tree._mean_embeddings(emb, leaf_codes)
        return tree

    @classmethod
    def from_codes(
        cls, ids: Any, codes: Any, branch: int = 2, node_emb: Any = None, name: str = "tree"
    ) -> TreeIndex:
        """A tree from given leaf codes (``codes[i]`` is the leaf of ``ids[i]``; all on one
        layer). ``node_emb`` optionally gives one row per node, in code order."""
        return cls(branch, ids, np.asarray(codes), node_emb, name)

    def _mean_embeddings(self, emb: np.ndarray, leaf_codes: np.ndarray) -> np.ndarray:
        """Per node (code order) the mean embedding of the items under it."""
        out = np.zeros((self._node_codes.size, emb.shape[1]), dtype=np.float64)
        count = np.zeros(self._node_codes.size, dtype=np.int64)
        codes = leaf_codes
        size = self._node_codes.size
        for _ in range(self._height):
            pos = np.searchsorted(self._node_codes, codes)
            for j in range(emb.shape[1]):
                out[:, j] += np.bincount(pos, weights=emb[:, j], minlength=size)
            count += np.bincount(pos, minlength=size)
            codes = (codes - 1) // self._branch
        return (out / count[:, None]).astype(np.float32)

    # ------------------------------------------------------------------ save / load
    def save(self, path: str | os.PathLike) -> None:
        """Write the tree to one ``.npz`` file (format name and version included)."""
        emb = self._node_emb if self._node_emb is not None else np.zeros((0, 0), np.float32)
        with open(path, "wb") as f:
            np.savez(
                f,
                format=np.array(FORMAT),
                version=np.array(VERSION, dtype=np.int64),
                branch=np.array(self._branch, dtype=np.int64),
                name=np.array(self.name),
                ids=self._ids,
                codes=self._id_codes,
                node_emb=emb,
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> TreeIndex:
        """Read a tree written by :meth:`save`; a missing, foreign or corrupt file raises
        :class:`~fleet.data.errors.DataSourceError` naming the path."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise DataSourceError(f"tree index file {path} does not exist", path)
        try:
            z = np.load(path, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise ValueError("a single array, not an .npz archive")
            with z:
                data = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
            raise DataSourceError(
                f"{path} is not a tree index file (not a readable .npz: {e}); write one with "
                "TreeIndex.save",
                path,
            ) from e
        if data.get("format") is None or str(data["format"]) != FORMAT:
            raise DataSourceError(
                f"{path} is an .npz file but not a tree index (format "
                f"{data.get('format')!r}, expected {FORMAT!r}); write one with TreeIndex.save",
                path,
            )
        version = int(data.get("version", -1))
        if version != VERSION:
            raise DataSourceError(
                f"{path} holds tree index format version {version}; this fleetrun reads version "
                f"{VERSION}: save the tree again with this version",
                path,
            )
        missing = {"branch", "ids", "codes", "node_emb", "name"} - set(data)
        if missing:
            raise DataSourceError(
                f"{path} is a corrupt tree index: missing {sorted(missing)}", path
            )
        emb = data["node_emb"]
        try:
            return cls(
                int(data["branch"]),
                data["ids"],
                data["codes"],
                emb if emb.size or emb.shape[0] else None,
                str(data["name"]),
            )
        except ConfigError as e:
            raise DataSourceError(f"{path} is a corrupt tree index: {e}", path) from e

    # ------------------------------------------------------------------ properties
    def height(self) -> int:
        """Number of layers, the root's included (leaves are on level ``height() - 1``)."""
        return self._height

    def branch(self) -> int:
        """Children per node."""
        return self._branch

    def total_node_nums(self) -> int:
        """Number of nodes that exist (every ancestor of a leaf, the leaves included)."""
        return int(self._node_codes.size)

    def emb_size(self) -> int:
        """Width of the node embeddings (0 when the tree has none)."""
        return 0 if self._node_emb is None else int(self._node_emb.shape[1])

    @property
    def node_emb(self) -> np.ndarray | None:
        """``[total_node_nums(), emb_size()]`` float32 node embeddings in code order, or None."""
        return self._node_emb

    @property
    def node_codes(self) -> np.ndarray:
        """Every node's code, sorted (layer by layer)."""
        return self._node_codes

    def __len__(self) -> int:
        return int(self._ids.size)

    def __repr__(self) -> str:
        return (
            f"TreeIndex(name={self.name!r}, items={len(self)}, branch={self._branch}, "
            f"height={self._height}, nodes={self.total_node_nums()})"
        )

    # ------------------------------------------------------------------ lookups
    def _check_level(self, level: Any) -> int:
        if (
            isinstance(level, bool)
            or not isinstance(level, (int, np.integer))
            or not 0 <= level < self._height
        ):
            raise ConfigError(
                f"level {level!r} is out of range: this tree has levels 0 (root) .. "
                f"{self._height - 1} (leaves)",
                key="level",
            )
        return int(level)

    def _leaf_codes_of(self, ids: Any) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ConfigError(
                f"item ids must be int64, got dtype {arr.dtype}: pass np.asarray(ids, "
                "dtype=np.int64)",
                key="ids",
            )
        arr = arr.astype(np.int64, copy=False)
        pos = np.searchsorted(self._ids, arr)
        pos = np.minimum(pos, self._ids.size - 1)
        found = self._ids[pos] == arr
        if not found.all():
            unknown = np.unique(arr[~found])
            raise UnknownItemError(
                f"item ids {unknown[:5].tolist()} ({unknown.size} in all) are not in tree "
                f"{self.name!r}: look up only ids the tree was built with",
                unknown,
            )
        return self._id_codes[pos]

    def level_of(self, codes: Any) -> np.ndarray:
        """The layer of each code."""
        return np.searchsorted(self._offsets, np.asarray(codes, np.int64), side="right") - 1

    def get_ancestor_codes(self, ids: Any, level: int) -> np.ndarray:
        """The code on layer ``level`` above each item (int64, the shape of ``ids``)."""
        level = self._check_level(level)
        codes = self._leaf_codes_of(ids)
        for _ in range(self._height - 1 - level):
            codes = (codes - 1) // self._branch
        return codes

    def get_pi_relation(self, ids: Any, level: int) -> dict[int, int]:
        """``{item id: its ancestor code on layer level}``."""
        ids = np.asarray(ids, dtype=np.int64)
        return dict(zip(ids.tolist(), self.get_ancestor_codes(ids, level).tolist()))

    def get_travel_codes(self, id: int, start_level: int = 0) -> np.ndarray:
        """The path from the item's leaf up to layer ``start_level`` (leaf first, root last
        with the default)."""
        start_level = self._check_level(start_level)
        code = int(self._leaf_codes_of(np.array([id]))[0])
        n = self._height - start_level
        out = np.empty(n, dtype=np.int64)
        for i in range(n):
            out[i] = code
            code = (code - 1) // self._branch
        return out

    def get_travel_path(self, child: int, ancestor: int) -> list[int]:
        """Codes from ``child`` up to (not including) ``ancestor``."""
        res = []
        child = int(child)
        while child > ancestor:
            res.append(child)
            child = (child - 1) // self._branch
        return res

    def get_layer_codes(self, level: int) -> np.ndarray:
        """The codes of the nodes on layer ``level``, sorted."""
        return self._layers[self._check_level(level)]

    def contains(self, codes: Any) -> np.ndarray:
        """Whether each code is a node of the tree (bool, the shape of ``codes``)."""
        codes = np.asarray(codes, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self._node_codes, codes), self._node_codes.size - 1)
        return self._node_codes[pos] == codes

    def node_positions(self, codes: Any) -> np.ndarray:
        """Each code's row in :attr:`node_codes` / :attr:`node_emb` (a dense index for an
        embedding table of ``total_node_nums()`` rows); unknown codes raise."""
        codes = np.asarray(codes, dtype=np.int64)
        ok = self.contains(codes)
        if not ok.all():
            bad = np.unique(codes[~ok])
            raise UnknownItemError(
                f"codes {bad[:5].tolist()} are not nodes of tree {self.name!r}", bad
            )
        return np.searchsorted(self._node_codes, codes)

    def get_children_codes(self, ancestor: int, level: int | None = None) -> np.ndarray:
        """The existing children of ``ancestor`` (``level=None``), or its descendants on layer
        ``level`` (Paddle's signature), sorted."""
        ancestor = int(ancestor)
        if not bool(self.contains(np.array([ancestor]))[0]):
            raise UnknownItemError(
                f"code {ancestor} is not a node of tree {self.name!r}", np.array([ancestor])
            )
        here = int(self.level_of(ancestor))
        level = here + 1 if level is None else self._check_level(level)
        if level <= here:
            raise ConfigError(
                f"level {level} is not below code {ancestor}'s layer {here}: ask for a level in "
                f"{here + 1} .. {self._height - 1}",
                key="level",
            )
        if level >= self._height:
            return np.zeros(0, dtype=np.int64)
        span = self._branch ** (level - here)
        lo = ancestor * span + (span - 1) // (self._branch - 1)
        layer = self._layers[level]
        return layer[np.searchsorted(layer, lo) : np.searchsorted(layer, lo + span)]

    def get_nodes(self, codes: Any) -> np.ndarray:
        """The item id of each leaf code; codes that are not leaves raise (item ids may be any
        int64, so there is no sentinel)."""
        codes = np.asarray(codes, dtype=np.int64)
        leaves = self._layers[-1]
        pos = np.minimum(np.searchsorted(leaves, codes), leaves.size - 1)
        ok = leaves[pos] == codes
        if not ok.all():
            bad = np.unique(codes[~ok])
            raise UnknownItemError(
                f"codes {bad[:5].tolist()} are not leaves of tree {self.name!r} (leaves are on "
                f"layer {self._height - 1}): pass leaf codes",
                bad,
            )
        return self._leaf_ids[pos]

    def get_all_leafs(self) -> np.ndarray:
        """Every item id, in leaf-code order."""
        return self._leaf_ids

    def get_all_items(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, leaf codes)``, ids sorted."""
        return self._ids, self._id_codes

    # ------------------------------------------------------------------ Paddle's sampler hooks
    def init_layerwise_sampler(
        self, layer_sample_counts: list[int], start_sample_layer: int = 1, seed: int = 0
    ) -> None:
        """Attach a :class:`~fleet.data.tree_sampler.LayerWiseSampler` (Paddle's spelling)."""
        from fleet.data.tree_sampler import LayerWiseSampler

        self._layerwise_sampler = LayerWiseSampler(
            self, layer_sample_counts, start_sample_layer, seed
        )

    def layerwise_sample(
        self, user_input: Any, index_input: Any, with_hierarchy: bool = False
    ) -> np.ndarray:
        """Paddle's rows ``[user features..., node code, label]``: see
        :meth:`~fleet.data.tree_sampler.LayerWiseSampler.sample_rows`."""
        sampler = self._layerwise_sampler
        if sampler is None:
            raise ConfigError(
                "no layer-wise sampler: call init_layerwise_sampler(layer_sample_counts) first",
                key="layerwise_sampler",
            )
        return sampler.sample_rows(user_input, index_input, with_hierarchy)


__all__ = ["FORMAT", "VERSION", "TreeIndex", "UnknownItemError"]
