"""Table configs: frozen dataclasses with validation, plain-dict round trip and a diff helper.

``SparseTableConfig`` / ``DenseTableConfig`` travel as JSON in the gRPC ``CreateTable`` request
(:func:`config_to_dict` / :func:`config_from_dict`, tagged with ``"kind"``) and in the checkpoint
manifest. Creating a table is idempotent: the same config again is fine, a different one is a
:class:`~ps_server.errors.TableConfigMismatchError` listing the differing fields and both configs
(:func:`check_same_config`). A bad value is a :class:`~collective.errors.ConfigError` naming the
field.

:class:`GraphTableConfig` describes a graph table (node and edge types, node features); it travels
in the graph service's requests (:mod:`ps_server.rpc.graph_service`) and with a saved graph, not
through ``CreateTable``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from collective.env import StrEnum
from collective.errors import ConfigError
from collective.typed_config import from_dict, require
from ps_server.core.entry import EntryPolicy
from ps_server.core.initializers import Initializer
from ps_server.core.optimizers import OptimizerRule
from ps_server.errors import TableConfigMismatchError

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
MAX_SHARDS = 65536
"""Upper bound of ``num_shards`` (shard indices are 5 digits in file names)."""


class NonFinitePolicy(StrEnum):
    """What a push with NaN/inf gradients does."""

    REJECT = "reject"
    """Raise NonFiniteGradientError naming the table and the count; apply nothing."""
    SKIP = "skip"
    """Drop the rows (occurrences) with non-finite values, apply the rest, count the dropped."""


class SparseStorage(StrEnum):
    """Where a sparse table keeps its rows."""

    MEMORY = "memory"
    """Every row in memory (the default)."""
    SSD = "ssd"
    """Up to ``cache_rows`` rows in memory, the others in RocksDB on the server's local disk
    (``--ssd_root``; ``pip install "fleetrun[ssd]"``)."""


def _parse_optional_entry(value: Any, path: str) -> EntryPolicy | None:
    return None if value is None else EntryPolicy.parse(value, path)


def _parse_rules(config: Any, entry: bool) -> None:
    """Let the rule fields be given in their dict form too (``{"type": "adagrad", ...}``)."""
    if isinstance(config.optimizer, Mapping):
        object.__setattr__(
            config, "optimizer", OptimizerRule.from_dict(config.optimizer, "optimizer")
        )
    if hasattr(config, "initializer") and isinstance(config.initializer, Mapping):
        object.__setattr__(
            config, "initializer", Initializer.from_dict(config.initializer, "initializer")
        )
    if entry and isinstance(config.entry, Mapping):
        object.__setattr__(config, "entry", EntryPolicy.from_dict(config.entry, "entry"))


def _check_required(cls: type, data: Any, path: str) -> None:
    """ConfigError naming the missing required fields (``typed_config.from_dict`` would let the
    dataclass raise a bare TypeError)."""
    if not isinstance(data, Mapping):
        return  # from_dict reports a non-mapping itself
    missing = [
        f.name
        for f in fields(cls)
        if f.init and f.default is MISSING and f.default_factory is MISSING and f.name not in data
    ]
    if missing:
        raise ConfigError(
            f"missing required field(s) {missing} of a {cls.__name__}",
            key=path or None,
        )


def _check_name(name: str) -> None:
    require(
        isinstance(name, str) and bool(_NAME_RE.match(name)),
        "name",
        f"must be 1-128 characters of letters, digits, '_', '.', '-' (not starting with '.' "
        f"or '-'); it names the checkpoint folder. Got {name!r}",
    )


def _check_shards(num_shards: int) -> None:
    require(
        isinstance(num_shards, int) and 1 <= num_shards <= MAX_SHARDS,
        "num_shards",
        f"must be an integer in [1, {MAX_SHARDS}], got {num_shards!r}",
    )


@dataclass(frozen=True)
class SparseTableConfig:
    """A sparse (embedding) table: int64 keys → float32 rows of ``dim``."""

    name: str
    """Table name (letters, digits, ``_ . -``); unique per server, names the checkpoint folder."""
    dim: int
    """Floats per row (1..65536)."""
    optimizer: OptimizerRule = field(metadata={"parse": OptimizerRule.parse})
    """Server-side optimizer rule (``SGD``, ``Adagrad``, ``Adam`` or a registered one)."""
    initializer: Initializer = field(metadata={"parse": Initializer.parse})
    """Initial values of a new row, deterministic per (table, key, seed)."""
    entry: EntryPolicy | None = field(default=None, metadata={"parse": _parse_optional_entry})
    """Admission policy; ``None`` admits every key on first pull or push."""
    num_shards: int = 64
    """Fixed number of shards (routing and checkpoint files are per shard); never changes."""
    seed: int = 0
    """Seed of the initial values and of probabilistic admission."""
    nonfinite: NonFinitePolicy = NonFinitePolicy.REJECT
    """``reject``: a push with NaN/inf raises, nothing applied; ``skip``: those rows are dropped."""
    max_capacity: int | None = None
    """Most rows per server; when full, the longest-unseen rows are evicted. ``None``: no limit."""
    show_decay_rate: float = 1.0
    """Each ``end_day`` multiplies every row's show count by this and rounds down (Paddle's
    ``show_click_decay_rate``; 1.0: no decay). In (0, 1]."""
    storage: SparseStorage = SparseStorage.MEMORY
    """``memory``: every row in memory; ``ssd``: hot rows in memory, cold rows on the server's
    local disk (see ``cache_rows``)."""
    cache_rows: int | None = None
    """``storage="ssd"``: most rows per server kept in memory (>= 1; this or ``cache_bytes``);
    the others are moved to disk (lowest show count first). Must be None for
    ``storage="memory"``."""
    cache_bytes: int | None = None
    """``storage="ssd"``: the memory tier's size in bytes instead of ``cache_rows`` (turned into
    rows by the bytes of one row in memory: key, flags, values, optimizer state, show count,
    unseen days, access tick; the key index comes on top). Must be None for
    ``storage="memory"``."""

    def __post_init__(self) -> None:
        _check_name(self.name)
        _parse_rules(self, entry=True)
        self._check_storage()
        require(
            isinstance(self.show_decay_rate, (int, float)) and 0.0 < self.show_decay_rate <= 1.0,
            "show_decay_rate",
            f"must be a number in (0, 1], got {self.show_decay_rate!r}",
        )
        require(
            isinstance(self.dim, int) and 1 <= self.dim <= 65536,
            "dim",
            f"must be an integer in [1, 65536], got {self.dim!r}",
        )
        require(
            isinstance(self.optimizer, OptimizerRule),
            "optimizer",
            f"must be an OptimizerRule (e.g. Adagrad(lr=0.05)), got {self.optimizer!r}",
        )
        require(
            isinstance(self.initializer, Initializer),
            "initializer",
            f"must be an Initializer (e.g. Uniform(-0.01, 0.01)), got {self.initializer!r}",
        )
        require(
            self.entry is None or isinstance(self.entry, EntryPolicy),
            "entry",
            f"must be None or an EntryPolicy (e.g. CountFilterEntry(3)), got {self.entry!r}",
        )
        _check_shards(self.num_shards)
        require(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        try:
            object.__setattr__(self, "nonfinite", NonFinitePolicy(self.nonfinite))
        except ValueError:
            raise ConfigError(
                f"must be 'reject' or 'skip', got {self.nonfinite!r}", key="nonfinite"
            ) from None
        require(
            self.max_capacity is None
            or (isinstance(self.max_capacity, int) and self.max_capacity >= 1),
            "max_capacity",
            f"must be None or an integer >= 1, got {self.max_capacity!r}",
        )

    def _check_storage(self) -> None:
        try:
            object.__setattr__(self, "storage", SparseStorage(self.storage))
        except ValueError:
            raise ConfigError(
                f"table {self.name!r}: must be 'memory' or 'ssd', got {self.storage!r}",
                key="storage",
            ) from None
        rows, nbytes = self.cache_rows, self.cache_bytes
        if self.storage is SparseStorage.SSD:
            require(
                rows is None or nbytes is None,
                "cache_bytes",
                f"table {self.name!r}: give cache_rows or cache_bytes, not both (got "
                f"cache_rows={rows!r}, cache_bytes={nbytes!r})",
            )
            key, value = ("cache_bytes", nbytes) if nbytes is not None else ("cache_rows", rows)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                key,
                f"table {self.name!r}: storage='ssd' needs cache_rows (rows kept in memory per "
                f"server) or cache_bytes (bytes of them), an integer >= 1, got {key}={value!r}",
            )
        else:
            for key, value in (("cache_rows", rows), ("cache_bytes", nbytes)):
                require(
                    value is None,
                    key,
                    f"table {self.name!r}: {key} applies to storage='ssd' only; remove it or "
                    f"set storage='ssd' (got {key}={value!r} with storage='memory')",
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (rules as ``{"type": ..., ...}``)."""
        return {
            "name": self.name,
            "dim": self.dim,
            "optimizer": self.optimizer.to_dict(),
            "initializer": self.initializer.to_dict(),
            "entry": None if self.entry is None else self.entry.to_dict(),
            "num_shards": self.num_shards,
            "seed": self.seed,
            "nonfinite": self.nonfinite.value,
            "max_capacity": self.max_capacity,
            # only when set: configs and manifests without decay read as before
            **({"show_decay_rate": self.show_decay_rate} if self.show_decay_rate != 1.0 else {}),
            **(
                {"storage": self.storage.value, "cache_rows": self.cache_rows}
                if self.storage is SparseStorage.SSD
                else {}
            ),
            **({"cache_bytes": self.cache_bytes} if self.cache_bytes is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "") -> SparseTableConfig:
        """Build from plain data; ConfigError names the key path of a bad value."""
        _check_required(cls, data, path)
        return from_dict(cls, data, path)


@dataclass(frozen=True)
class DenseTableConfig:
    """A dense table: named flat float32 blocks (e.g. one per model parameter)."""

    name: str
    """Table name (letters, digits, ``_ . -``); unique per server, names the checkpoint folder."""
    optimizer: OptimizerRule = field(metadata={"parse": OptimizerRule.parse})
    """Server-side optimizer rule; state per element, Adam's step per block."""
    num_shards: int = 16
    """Fixed number of shards blocks are hashed to (by name); never changes."""
    nonfinite: NonFinitePolicy = NonFinitePolicy.REJECT
    """``reject``: a push with NaN/inf raises; ``skip``: that push is dropped and counted."""

    def __post_init__(self) -> None:
        _check_name(self.name)
        _parse_rules(self, entry=False)
        require(
            isinstance(self.optimizer, OptimizerRule),
            "optimizer",
            f"must be an OptimizerRule (e.g. Adam(lr=1e-3)), got {self.optimizer!r}",
        )
        _check_shards(self.num_shards)
        try:
            object.__setattr__(self, "nonfinite", NonFinitePolicy(self.nonfinite))
        except ValueError:
            raise ConfigError(
                f"must be 'reject' or 'skip', got {self.nonfinite!r}", key="nonfinite"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return {
            "name": self.name,
            "optimizer": self.optimizer.to_dict(),
            "num_shards": self.num_shards,
            "nonfinite": self.nonfinite.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "") -> DenseTableConfig:
        """Build from plain data; ConfigError names the key path of a bad value."""
        _check_required(cls, data, path)
        return from_dict(cls, data, path)


GRAPH_FEATURE_DTYPES = ("float32", "int64")
"""The dtypes a graph node feature may have."""


def _graph_edge_type(value: Any, i: int, node_types: tuple[str, ...]) -> tuple[str, str, str]:
    """``(name, src_type, dst_type)`` from a name or a 3-sequence; a bare name takes the only
    node type when there is one, else ``""`` (types unknown: metapaths are not checked)."""
    key = f"edge_types[{i}]"
    if isinstance(value, str):
        only = node_types[0] if len(node_types) == 1 else ""
        value = (value, only, only)
    require(
        isinstance(value, (list, tuple))
        and len(value) == 3
        and all(isinstance(v, str) for v in value),
        key,
        f"must be a name or (name, src_type, dst_type) of strings, got {value!r}",
    )
    name, src, dst = value
    require(
        bool(_NAME_RE.match(name)),
        key,
        f"edge type name must be letters, digits, '_ . -', got {name!r}",
    )
    for end, t in (("src_type", src), ("dst_type", dst)):
        require(
            t == "" or t in node_types,
            key,
            f"{end} {t!r} of edge type {name!r} is not one of node_types {list(node_types)}; "
            "add it to node_types or fix the edge type",
        )
    return (name, src, dst)


def _graph_features(value: Any, node_types: tuple[str, ...]) -> tuple:
    """``((node_type, ((name, dtype, width), ...)), ...)`` sorted, from a mapping
    ``{node_type: {name: (dtype, width)}}``."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        value = {t: dict((f[0], (f[1], f[2])) for f in feats) for t, feats in value}
    require(
        isinstance(value, Mapping),
        "features",
        f"must map node type -> {{name: (dtype, width)}}, got {value!r}",
    )
    out = []
    for node_type in sorted(value):
        feats = value[node_type]
        key = f"features.{node_type}"
        require(
            node_type in node_types,
            key,
            f"node type {node_type!r} is not one of node_types {list(node_types)}",
        )
        require(isinstance(feats, Mapping), key, f"must map name -> (dtype, width), got {feats!r}")
        items = []
        for name in feats:  # file order of the features is this order
            spec = feats[name]
            fkey = f"{key}.{name}"
            require(
                isinstance(name, str) and bool(_NAME_RE.match(name)),
                fkey,
                f"feature name must be letters, digits, '_ . -', got {name!r}",
            )
            require(
                isinstance(spec, (list, tuple)) and len(spec) == 2,
                fkey,
                f"must be (dtype, width), e.g. ('float32', 16), got {spec!r}",
            )
            dtype, width = spec
            require(
                dtype in GRAPH_FEATURE_DTYPES,
                fkey,
                f"dtype must be one of {list(GRAPH_FEATURE_DTYPES)}, got {dtype!r}",
            )
            require(
                isinstance(width, int) and not isinstance(width, bool) and 1 <= width <= 65536,
                fkey,
                f"width must be an integer in [1, 65536], got {width!r}",
            )
            items.append((name, dtype, width))
        out.append((node_type, tuple(items)))
    return tuple(out)


@dataclass(frozen=True)
class GraphTableConfig:
    """A graph table: int64 node ids of ``node_types``, edges of ``edge_types`` (each
    ``(name, src_type, dst_type)``, or a bare name when there is one node type), node features
    per node type (``{node_type: {name: (dtype, width)}}``, dtype ``float32`` or ``int64``).
    Nodes are sharded over the servers by id as sparse keys are (``num_shards``)."""

    name: str
    """Table name (letters, digits, ``_ . -``); unique among the server's graph tables."""
    node_types: tuple[str, ...] = ("node",)
    """Node type names (at least one)."""
    edge_types: tuple = ()
    """Edge types: ``(name, src_type, dst_type)`` after validation (a bare name is kept with the
    only node type, or ``""`` types when there are several: metapaths then go unchecked)."""
    features: Any = None
    """Node features per node type; normalised to sorted ``((type, ((name, dtype, width), ...)),
    ...)``; a feature's position is its column in node files."""
    num_shards: int = 64
    """Fixed number of shards nodes are hashed to (a shard's server is ``shard % servers``)."""

    def __post_init__(self) -> None:
        _check_name(self.name)
        node_types = self.node_types
        if isinstance(node_types, str):
            node_types = (node_types,)
        require(
            isinstance(node_types, (list, tuple))
            and len(node_types) >= 1
            and all(isinstance(t, str) and _NAME_RE.match(t) for t in node_types)
            and len(set(node_types)) == len(node_types),
            "node_types",
            f"must be a non-empty list of distinct names (letters, digits, '_ . -'), got "
            f"{self.node_types!r}",
        )
        node_types = tuple(node_types)
        object.__setattr__(self, "node_types", node_types)
        edges = self.edge_types
        require(
            isinstance(edges, (list, tuple)) and len(edges) >= 1,
            "edge_types",
            f"must list at least one edge type (a name or (name, src_type, dst_type)), got "
            f"{edges!r}",
        )
        edges = tuple(_graph_edge_type(e, i, node_types) for i, e in enumerate(edges))
        names = [e[0] for e in edges]
        require(
            len(set(names)) == len(names),
            "edge_types",
            f"edge type names must be distinct, got {names}",
        )
        object.__setattr__(self, "edge_types", edges)
        object.__setattr__(self, "features", _graph_features(self.features, node_types))
        _check_shards(self.num_shards)

    def edge_type(self, name: str) -> tuple[str, str, str]:
        """``(name, src_type, dst_type)`` of edge type ``name`` (ConfigError naming the known)."""
        for e in self.edge_types:
            if e[0] == name:
                return e
        raise ConfigError(
            f"unknown edge type {name!r} of graph table {self.name!r}; edge types: "
            f"{[e[0] for e in self.edge_types]}",
            key="edge_type",
        )

    def node_features(self, node_type: str) -> tuple[tuple[str, str, int], ...]:
        """``((name, dtype, width), ...)`` of ``node_type`` (ConfigError for an unknown type)."""
        if node_type not in self.node_types:
            raise ConfigError(
                f"unknown node type {node_type!r} of graph table {self.name!r}; node types: "
                f"{list(self.node_types)}",
                key="node_type",
            )
        return dict(self.features).get(node_type, ())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return {
            "name": self.name,
            "node_types": list(self.node_types),
            "edge_types": [list(e) for e in self.edge_types],
            "features": {t: {n: [d, w] for n, d, w in f} for t, f in self.features},
            "num_shards": self.num_shards,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "") -> GraphTableConfig:
        """Build from plain data (the :meth:`to_dict` form, ``"kind"`` ignored)."""
        _check_required(cls, data, path)
        allowed = {f.name for f in fields(cls)}
        extra = [k for k in data if k not in allowed and k != "kind"]
        if extra:
            raise ConfigError(
                f"unknown key(s) {extra} of a GraphTableConfig; allowed: {sorted(allowed)}",
                key=path or None,
            )
        return cls(**{k: v for k, v in data.items() if k in allowed})


TableConfig = SparseTableConfig | DenseTableConfig
_KINDS: dict[str, type] = {"sparse": SparseTableConfig, "dense": DenseTableConfig}


def config_kind(config: TableConfig) -> str:
    """``"sparse"``, ``"dense"`` or ``"graph"``."""
    if isinstance(config, GraphTableConfig):
        return "graph"
    return "sparse" if isinstance(config, SparseTableConfig) else "dense"


def config_to_dict(config: TableConfig) -> dict[str, Any]:
    """``{"kind": "sparse"|"dense", **config.to_dict()}`` (the CreateTable / manifest form)."""
    return {"kind": config_kind(config), **config.to_dict()}


def config_from_dict(data: Mapping[str, Any], path: str = "") -> TableConfig:
    """Inverse of :func:`config_to_dict`: dispatch on ``"kind"``."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"expected a mapping with 'kind' sparse|dense, got {data!r}", key=path or None
        )
    kind = data.get("kind")
    cls = _KINDS.get(str(kind).lower())
    if cls is None:
        raise ConfigError(
            f"must be 'sparse' or 'dense', got {kind!r}", key=f"{path}.kind" if path else "kind"
        )
    return cls.from_dict({k: v for k, v in data.items() if k != "kind"}, path)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def config_diff(existing: Mapping[str, Any], requested: Mapping[str, Any]) -> list[str]:
    """Lines ``"optimizer.lr: 0.1 (existing) != 0.05 (requested)"`` for each differing leaf."""
    a, b = _flatten(existing), _flatten(requested)
    lines = []
    for key in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(key, "<absent>"), b.get(key, "<absent>")
        if va != vb:
            lines.append(f"{key}: {va!r} (existing) != {vb!r} (requested)")
    return lines


def check_same_config(existing: TableConfig, requested: TableConfig) -> None:
    """Raise TableConfigMismatchError (listing the differences and both configs) unless equal."""
    if existing == requested:
        return
    a, b = config_to_dict(existing), config_to_dict(requested)
    raise TableConfigMismatchError(existing.name, config_diff(a, b) or ["(types differ)"], a, b)


__all__ = [
    "GRAPH_FEATURE_DTYPES",
    "DenseTableConfig",
    "GraphTableConfig",
    "NonFinitePolicy",
    "SparseStorage",
    "SparseTableConfig",
    "TableConfig",
    "check_same_config",
    "config_diff",
    "config_from_dict",
    "config_kind",
    "config_to_dict",
]
