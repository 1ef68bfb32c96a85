"""The ``elastic:`` section of a job spec and the flag spellings that fill it.

torchrun's spellings (``--nnodes MIN:MAX --rdzv_backend c10d --rdzv_endpoint HOST:PORT
--rdzv_id ID --rdzv_conf k=v,... --standalone --monitor_interval S``) and Paddle's
(``--elastic_server etcd://HOST:PORT --job_id ID --np MIN:MAX``) land in the same keys::

    sizes: {nnodes: "1:4", nproc_per_node: 1}     # or elastic: {min_nodes: 1, max_nodes: 4}
    run_id: my-job                                # --rdzv_id / --job_id
    rendezvous: {timeout_s: 60}                   # --rdzv_timeout
    max_restarts: 3
    elastic:
      rdzv_backend: c10d                          # static | c10d | etcd | etcd-v2
      rdzv_endpoint: 10.0.0.1:29400               # etcd://HOST:PORT implies rdzv_backend: etcd
      rdzv_conf: {last_call_timeout: 1}
      monitor_interval_s: 0.1

:func:`normalize_elastic` folds the spellings into one form before the spec is built (``sizes.nnodes
"MIN:MAX"`` → ``elastic.min_nodes``/``max_nodes`` with ``sizes.nnodes = MAX``; ``etcd://`` →
backend etcd; ``standalone`` → c10d on 127.0.0.1); :func:`check_elastic_spec` checks what needs
the whole spec (``--node_rank`` with elastic, a PS job, ...). Standard library only: the CLI
imports this at start.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from collective.env import StrEnum
from collective.errors import ConfigError
from collective.typed_config import require

if TYPE_CHECKING:  # the spec imports this module; no runtime cycle
    from launcher.spec import JobSpec

DEFAULT_C10D_PORT = 29400
"""torchrun's c10d rendezvous port when ``--rdzv_endpoint`` names no port."""
DEFAULT_ETCD_PORT = 2379
"""etcd's client port when the endpoint names no port."""

FAST_RDZV_CONF: dict[str, str] = {
    "last_call_timeout": "1",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "5",
}
"""Our defaults for the c10d / etcd-v2 handlers (torch's are 30 s, 5 s and 3): a silent node is
dropped after ~5 s without a heartbeat instead of ~15 s (a node whose agent process is proven
gone at once, see :mod:`launcher.elastic.liveness`), and a rendezvous that reached MIN nodes
closes 1 s later instead of 30 s. Any ``rdzv_conf`` key given wins. etcd (v1) has no heartbeat
options: there the two keep-alive keys set its members' lease TTL (interval x attempts, 5 s; torch's
is a fixed 10 s), see :func:`launcher.elastic.rdzv.set_etcd_keep_alive`. Fewer missed heartbeats (``keep_alive_max_attempt=2``) recover
faster but drop live nodes on an overloaded machine (seen at load 14 on 2 cores); the agent then
notices and re-joins (launcher.schedulers.local.elastic_agent), at the cost of a re-formed round."""

KNOWN_RDZV_CONF = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "is_host",
    "store_type",
    "timeout",
    "etcd_prefix",
    "protocol",
    "ssl_cert",
    "ssl_cert_key",
    "ca_cert",
    "cacert",
    "cert",
    "key",
    "use_libuv",
)
"""``rdzv_conf`` keys torch's c10d / etcd / etcd-v2 handlers read (torch 2.x); others are typos."""


class RdzvBackend(StrEnum):
    """Rendezvous backend (torchrun's ``--rdzv_backend``)."""

    STATIC = "static"
    """Fixed node count, node ranks given (today's path, no torch in the launcher)."""
    C10D = "c10d"
    """Dynamic rendezvous on a TCPStore hosted by the agent on the endpoint's host."""
    ETCD = "etcd"
    """torch's etcd rendezvous (python-etcd, etcd's v2 API) against a running etcd."""
    ETCD_V2 = "etcd-v2"
    """torch's dynamic rendezvous with its state in etcd (v2 API) via the etcd store."""


def parse_rdzv_conf(value: Any, path: str) -> dict[str, str]:
    """``k=v,k=v`` (torchrun's ``--rdzv_conf``) or a mapping → ``{k: v}``; unknown keys refused."""
    if value is None:
        return {}
    if isinstance(value, str):
        out: dict[str, str] = {}
        for item in (v.strip() for v in value.split(",")):
            if not item:
                continue
            k, sep, v = item.partition("=")
            if not sep or not k.strip():
                raise ConfigError(
                    f"{item!r} is not of the form key=value (e.g. "
                    "last_call_timeout=1,join_timeout=60)",
                    key=path,
                )
            out[k.strip()] = v.strip()
    elif isinstance(value, Mapping):
        out = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}
    else:
        raise ConfigError(f"expected key=value,... or a mapping, got {value!r}", key=path)
    for k in out:
        if k not in KNOWN_RDZV_CONF:
            close = difflib.get_close_matches(k, KNOWN_RDZV_CONF, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown rendezvous option {k!r}{hint}; torch's handlers read: "
                f"{', '.join(KNOWN_RDZV_CONF)}",
                key=f"{path}.{k}",
            )
    return out


def parse_node_range(value: Any, path: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's ``--nnodes``, Paddle's ``--np``) → ``(MIN, MAX)``."""
    text = str(value).strip()
    lo, sep, hi = text.partition(":")
    try:
        low, high = (int(lo), int(hi)) if sep else (int(text), int(text))
    except ValueError:
        raise ConfigError(
            f"expected N or MIN:MAX (e.g. 2 or 1:4), got {value!r}", key=path
        ) from None
    if low < 1:
        raise ConfigError(f"MIN must be >= 1, got {text!r} (e.g. 1:{max(high, 1)})", key=path)
    if low > high:
        raise ConfigError(
            f"MIN {low} > MAX {high} in {text!r}; write MIN:MAX with MIN <= MAX "
            f"(e.g. {high}:{low})",
            key=path,
        )
    return low, high


def split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` → ``(host, port)`` (IPv6 in brackets allowed)."""
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.lstrip(":")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
    if not host:
        raise ConfigError(f"{endpoint!r} has no host; give HOST:PORT", key="elastic.rdzv_endpoint")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(
            f"{endpoint!r}: port {port_text!r} is not 0..65535", key="elastic.rdzv_endpoint"
        )
    return host, int(port_text)


@dataclass(frozen=True)
class ElasticConfig:
    """An elastic collective job: node range and the torch rendezvous that forms each round."""

    rdzv_backend: RdzvBackend = RdzvBackend.STATIC
    """``static`` (fixed nodes, the default), ``c10d``, ``etcd`` or ``etcd-v2``."""
    rdzv_endpoint: str | None = None
    """``HOST[:PORT]`` of the rendezvous: the c10d store (hosted by the agent on HOST; default
    port 29400) or etcd (default port 2379). ``etcd://HOST:PORT`` (Paddle's ``--elastic_server``)
    means rdzv_backend etcd."""
    rdzv_conf: dict[str, str] = field(default_factory=dict, metadata={"parse": parse_rdzv_conf})
    """Extra options for torch's handler (``--rdzv_conf k=v,...``); :data:`FAST_RDZV_CONF` fills
    the ones not given."""
    min_nodes: int | None = None
    """Fewest nodes a round may start with (``--nnodes MIN:MAX``); none = ``sizes.nnodes``."""
    max_nodes: int | None = None
    """Most nodes a round admits; none = ``sizes.nnodes`` (``sizes.nnodes`` is set to it)."""
    standalone: bool = False
    """One node, c10d on 127.0.0.1 with a free port and a fresh run id (torchrun's --standalone)."""
    monitor_interval_s: float = 0.1
    """Seconds between the agent's checks for waiting nodes (torchrun's --monitor_interval)."""

    def __post_init__(self) -> None:
        require(
            self.monitor_interval_s > 0,
            "monitor_interval_s",
            f"must be > 0 seconds, got {self.monitor_interval_s}",
        )
        for name in ("min_nodes", "max_nodes"):
            n = getattr(self, name)
            require(n is None or n >= 1, name, f"must be >= 1, got {n}")
        if self.min_nodes is not None and self.max_nodes is not None:
            require(
                self.min_nodes <= self.max_nodes,
                "min_nodes",
                f"min_nodes {self.min_nodes} > max_nodes {self.max_nodes}; MIN must be <= MAX",
            )
        if self.enabled and not self.standalone:
            require(
                bool(self.rdzv_endpoint),
                "rdzv_endpoint",
                f"rdzv_backend {self.rdzv_backend} needs an endpoint: --rdzv_endpoint HOST:PORT "
                "(or --standalone for one machine, or Paddle's --elastic_server etcd://HOST:PORT)",
            )
        if self.rdzv_endpoint:
            split_endpoint(self.rdzv_endpoint, 0)

    @property
    def enabled(self) -> bool:
        """Whether the job is elastic (any backend but ``static``)."""
        return self.rdzv_backend is not RdzvBackend.STATIC

    def endpoint(self) -> tuple[str, int]:
        """``(host, port)`` of the rendezvous, with the backend's default port."""
        assert self.rdzv_endpoint, "not an elastic job"
        default = DEFAULT_C10D_PORT if self.rdzv_backend is RdzvBackend.C10D else DEFAULT_ETCD_PORT
        return split_endpoint(self.rdzv_endpoint, default)

    def handler_conf(self) -> dict[str, str]:
        """``rdzv_conf`` with our fast defaults for the keys not given (see FAST_RDZV_CONF)."""
        return {**FAST_RDZV_CONF, **self.rdzv_conf}


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    sec = data.get(name)
    if sec is None:
        return {}
    if not isinstance(sec, Mapping):
        raise ConfigError(f"expected a mapping, got {sec!r}", key=name)
    return dict(sec)


def normalize_elastic(data: Mapping[str, Any]) -> dict[str, Any]:
    """Fold the spellings of an elastic job into the canonical keys (before the spec is built).

    * ``sizes.nnodes: "MIN:MAX"`` → ``elastic.min_nodes/max_nodes`` and ``sizes.nnodes: MAX``;
    * ``elastic.rdzv_endpoint: etcd://HOST:PORT`` → backend etcd, endpoint ``HOST:PORT``;
    * ``elastic.standalone`` → backend c10d on ``127.0.0.1:0`` (a free port at launch);
    * an elastic job without ``min_nodes``/``max_nodes`` gets ``sizes.nnodes`` for both.
    """
    out = dict(data)
    sizes, elastic = _section(out, "sizes"), _section(out, "elastic")
    nnodes = sizes.get("nnodes")
    if isinstance(nnodes, str) and ":" in nnodes:
        low, high = parse_node_range(nnodes, "sizes.nnodes")
        for key, n in (("min_nodes", low), ("max_nodes", high)):
            if elastic.get(key) not in (None, n):
                raise ConfigError(
                    f"sizes.nnodes {nnodes!r} disagrees with elastic.{key} "
                    f"{elastic[key]!r}; give the node range once",
                    key="sizes.nnodes",
                )
            elastic[key] = n
        sizes["nnodes"] = high
    elif isinstance(nnodes, str) and not nnodes.strip().lstrip("-").isdigit():
        raise ConfigError(
            f"expected N or MIN:MAX (e.g. 2 or 1:4), got {nnodes!r}", key="sizes.nnodes"
        )
    endpoint = elastic.get("rdzv_endpoint")
    if isinstance(endpoint, str) and "://" in endpoint:
        scheme, _, rest = endpoint.partition("://")
        if scheme.lower() != "etcd":
            raise ConfigError(
                f"{endpoint!r}: only etcd://HOST:PORT has a scheme (Paddle's "
                "--elastic_server); for c10d give HOST:PORT",
                key="elastic.rdzv_endpoint",
            )
        backend = str(elastic.get("rdzv_backend") or "etcd").lower()
        if backend not in ("etcd", "etcd-v2"):
            raise ConfigError(
                f"{endpoint!r} is an etcd server but rdzv_backend is {backend!r}; "
                "use --rdzv_backend etcd (or etcd-v2), or drop the etcd:// scheme",
                key="elastic.rdzv_backend",
            )
        elastic["rdzv_backend"], elastic["rdzv_endpoint"] = backend, rest.rstrip("/")
    if str(elastic.get("standalone", "")).lower() in ("true", "1", "yes"):
        if elastic.get("rdzv_endpoint"):
            raise ConfigError(
                "--standalone hosts its own rendezvous on 127.0.0.1; drop "
                "--rdzv_endpoint (or drop --standalone)",
                key="elastic.standalone",
            )
        if str(elastic.get("rdzv_backend") or "c10d").lower() != "c10d":
            raise ConfigError(
                "--standalone uses the c10d backend; drop --rdzv_backend", key="elastic.standalone"
            )
        elastic["rdzv_backend"], elastic["rdzv_endpoint"] = "c10d", "127.0.0.1:0"
    backend = str(elastic.get("rdzv_backend") or "static").lower()
    if backend != "static":
        _, n = parse_node_range(sizes.get("nnodes", 1), "sizes.nnodes")
        elastic.setdefault("max_nodes", n)
        elastic.setdefault("min_nodes", elastic["max_nodes"])
        sizes["nnodes"] = elastic["max_nodes"]
    if sizes:
        out["sizes"] = sizes
    if elastic:
        out["elastic"] = elastic
    return out


def check_elastic_spec(spec: JobSpec) -> None:
    """Checks of an elastic job that need the whole spec (ConfigError naming the key)."""
    e = spec.elastic
    if not e.enabled:
        require(
            e.min_nodes is None or e.min_nodes == e.max_nodes,
            "sizes.nnodes",
            f"a node range {e.min_nodes}:{e.max_nodes} needs an elastic rendezvous: add "
            "--rdzv_backend c10d --rdzv_endpoint HOST:PORT (or --standalone, or Paddle's "
            "--elastic_server etcd://HOST:PORT)",
        )
        return
    require(
        e.max_nodes == spec.sizes.nnodes,
        "sizes.nnodes",
        f"is {spec.sizes.nnodes} but elastic.max_nodes is {e.max_nodes}; give the node range once",
    )
    r = spec.rendezvous
    require(
        r.node_rank is None,
        "rendezvous.node_rank",
        f"an elastic job (rdzv_backend {e.rdzv_backend}) gets node ranks from the rendezvous; "
        "drop --node_rank",
    )
    require(
        not r.ips,
        "rendezvous.ips",
        "--ips is a static node list; an elastic job finds its nodes through --rdzv_endpoint",
    )
    require(
        r.master_addr is None and r.master_port is None,
        "rendezvous.master_addr",
        "an elastic job's workers get MASTER_ADDR/PORT from the rendezvous; drop "
        "--master_addr/--master_port and give --rdzv_endpoint HOST:PORT",
    )
    require(
        str(spec.mode) == "collective",
        "mode",
        "elastic jobs are collective only; a parameter-server job has a fixed layout",
    )


def job_fingerprint(spec: JobSpec) -> str:
    """What every agent of one elastic job shares (script, module, args, nproc_per_node): stored
    in the rendezvous so that an agent of another job that reuses ``rdzv_id`` is named."""
    e = spec.entrypoint
    text = json.dumps([e.script, e.module, list(e.args), spec.sizes.nproc_per_node])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_job(spec: JobSpec) -> str:
    """A short human form of the fingerprinted fields."""
    e = spec.entrypoint
    what = f"-m {e.module}" if e.module else str(e.script)
    return " ".join([what, *e.args]) + f" (nproc_per_node {spec.sizes.nproc_per_node})"
