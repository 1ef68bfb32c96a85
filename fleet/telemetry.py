"""The trainer's Prometheus metrics: definitions, the ``/metrics`` endpoint, the hooks.

Not :mod:`fleet.metrics` (Paddle's distributed AUC/accuracy over all trainers' data); this module
is about watching the job. ``fleet.init`` calls :func:`start_from_env`: with ``FLEET_METRICS_PORT``
set (fleetrun sets it) the process serves ``/metrics`` and the hooks below record; without it
every hook returns after one flag check (no clock read, no lock).

Where the numbers come from (one-line hook calls in the other fleet modules; all logic is here):

* **a step ends** at each ``step()`` of the optimizer ``fleet.distributed_optimizer`` returned
  (:func:`on_step`; a gradient-merge micro-step counts too), or at each communicator step in
  parameter-server mode, or at ``fleet.report(step=True)`` for scripts with neither.
  ``fleet_trainer_step_seconds`` is the time between two step ends: data loading, forward,
  backward, communication and the update;
* **samples**: the batch size (first dimension of the first tensor argument) of each training-mode
  forward of ``fleet.distributed_model``'s model (:func:`on_forward`), unless the script reports
  ``fleet.report(samples=N)`` — then only what it reports;
* **all_reduce time**: DDP's own runtime statistics (:func:`watch_ddp`): its reducer times the
  backward all-reduce (first bucket launched → last bucket done) on iterations 1-10 and every
  100th; :func:`on_step` reads them on steps 1-12 and every 50th and observes each new sample.
  Sampled, but free on the hot path — a timing comm hook (:func:`timed_comm_hook`, for code that
  registers its own hook anyway) replaces DDP's C++ all-reduce with a Python one and cost
  +1.2 % (plain) to +2.7 % (timed) of a 71 ms step in a same-process A/B;
* **PS pull/push time**: the communicator's client calls (:func:`instrument_communicator`);
* **step phases** (``fleet_trainer_phase_seconds{phase}``, :data:`PHASES`): where a step's time
  went. ``fleet.train_from_dataset`` times every phase of its loop itself (:class:`PhaseTimer`);
  a hand-written loop gets what fleet sees without its help (data from the :mod:`fleet.data`
  iterators, pull wait, push/optimizer from the PS communicator's step, the rest as
  ``compute``: :func:`on_step`). Pull wait and data are accumulated by two clock reads in
  their hooks while timing is on (metrics on, or a ``train_from_dataset`` loop running);
* **loss**: ``fleet.report(loss=...)``; a tensor is kept and read only when scraped (no device
  sync on the training thread);
* **AMP and pipeline**: :func:`set_amp_loss_scale`, :func:`count_amp_skipped_step`,
  :func:`set_pipeline_bubble_ratio` — called by the AMP and pipeline engines.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily

from collective.clean_exit import register_shutdown
from collective.env import TrainingRole, WorkerEnv
from collective.errors import ConfigError

logger = logging.getLogger(__name__)

STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Seconds; from sub-millisecond steps of tiny models to minute-long steps."""
COMM_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
COMM_OPS = ("all_reduce", "ps_pull", "ps_push")
PHASES = ("data", "pull_wait", "forward", "backward", "push_optimizer", "other", "compute")
"""``phase`` label values of ``fleet_trainer_phase_seconds``. ``data``: waiting for the next batch;
``pull_wait``: a forward waiting for PS rows (the communicator's ``pull_sparse`` on the training
thread, a prefetch's wait included); ``forward`` (loss included, pull wait excluded);
``backward``; ``push_optimizer``: ``optimizer.step()`` (the PS push included) and
``zero_grad``; ``other``: the rest of the step (loss bookkeeping, AUC, progress lines).
``compute`` replaces forward + backward + other where fleet cannot tell them apart (a
hand-written loop). The phases of one step add up to its step time."""

# -- metric definitions (the naming test scans this module) -----------------------------------
STEPS = Counter("fleet_trainer_steps", "Training steps ended (optimizer steps)")
SAMPLES = Counter("fleet_trainer_samples", "Training samples consumed")
STEP_SECONDS = Histogram(
    "fleet_trainer_step_seconds", "Time between two step ends", buckets=STEP_BUCKETS
)
LOSS = Gauge("fleet_trainer_loss", "Last loss given to fleet.report")
THROUGHPUT = Gauge(
    "fleet_trainer_throughput_samples_per_second",
    "Samples per second over the last window of >= 1 s",
)
COMM_SECONDS = Histogram(
    "fleet_trainer_comm_seconds",
    "Time in communication, by operation",
    ["op"],
    buckets=COMM_BUCKETS,
)
PIPELINE_BUBBLE = Gauge(
    "fleet_trainer_pipeline_bubble_ratio", "Idle fraction of a pipeline stage's step (0..1)"
)
AMP_LOSS_SCALE = Gauge("fleet_trainer_amp_loss_scale", "Current AMP loss scale")
AMP_SKIPPED = Counter(
    "fleet_trainer_amp_skipped_steps", "Steps AMP skipped because of inf/NaN gradients"
)

_COMM = {op: COMM_SECONDS.labels(op=op) for op in COMM_OPS}
PHASE_BUCKETS = COMM_BUCKETS[:-1] + (5.0, 10.0, 60.0)


class PhaseHistograms:
    """``fleet_trainer_phase_seconds{phase}``: a histogram per phase, kept as plain bucket
    counts that the training threads write under the hooks' lock (:data:`_hooks`, which the
    callers hold: cheaper than a ``prometheus_client`` observation, six of which happen per
    step) and turned into one histogram family when scraped. A scrape may see a step's phases
    half observed."""

    name = "fleet_trainer_phase_seconds"
    doc = "Time of each step spent in a phase (the phases of a step add up to its step time)"

    def __init__(self) -> None:
        self.counts = {p: [0] * (len(PHASE_BUCKETS) + 1) for p in PHASES}
        self.sums = dict.fromkeys(PHASES, 0.0)

    def observe(self, phase: str, seconds: float) -> None:
        """One step's time in ``phase``."""
        self.counts[phase][bisect.bisect_left(PHASE_BUCKETS, seconds)] += 1
        self.sums[phase] += seconds

    def count(self, phase: str) -> int:
        """Observations of ``phase`` so far."""
        return sum(self.counts[phase])

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.doc, labels=["phase"])]

    def collect(self) -> list[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=["phase"])
        for phase in PHASES:
            counts = list(self.counts[phase])
            if not any(counts):
                continue
            buckets, acc = [], 0
            for bound, n in zip((*map(str, PHASE_BUCKETS), "+Inf"), counts):
                acc += n
                buckets.append((bound, acc))
            fam.add_metric([phase], buckets, self.sums[phase])
        return [fam]


PHASE_SECONDS = PhaseHistograms()
REGISTRY.register(PHASE_SECONDS)
THROUGHPUT_WINDOW_S = 1.0


class _State:
    """Per-process recorder state (touched by the training thread only, except ``loss``)."""

    def __init__(self) -> None:
        self.enabled = False
        self.server: Any = None
        self.port = 0
        self.last_step: float | None = None
        self.forward_samples = 0
        self.samples_reported = False
        """True once the script called report(samples=...): the forward count is ignored."""
        self.window_start: float | None = None
        self.window_samples = 0
        self.window_steps = 0
        self.throughput_set = False
        self.loss: Any = None
        self.models: list[Any] = []
        """weakrefs of the DDP models whose runtime stats give the all-reduce time."""
        self.seen_iteration: dict[int, int] = {}
        self.steps = 0


_state = _State()
_start_lock = threading.Lock()
_hooks = threading.RLock()
"""Held by every hook that updates the step counters and phase totals: with
``train_from_dataset(thread_num=N)`` several training threads call them at once, and
``x += 1`` on shared state loses updates between threads."""


def enabled() -> bool:
    """Whether this process records metrics (an endpoint is serving)."""
    return _state.enabled


def _read_loss() -> float:
    loss = _state.loss
    if loss is None:
        return float("nan")
    try:
        return float(loss.item()) if hasattr(loss, "item") else float(loss)
    except (RuntimeError, ValueError, TypeError):
        return float("nan")


LOSS.set_function(_read_loss)


def start(port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` on ``host:port`` (0 = a free port) and turn the hooks on; returns the
    port. Idempotent: a second call returns the running endpoint's port."""
    with _start_lock:
        if _state.server is not None:
            return _state.port
        try:
            server, _thread = start_http_server(port, addr=host)
        except OSError as err:
            raise ConfigError(
                f"cannot serve /metrics on {host}:{port}: {err.strerror or err}; the port is busy "
                "— let fleetrun pick one (FLEET_METRICS_PORT), or unset FLEET_METRICS_PORT",
                key="FLEET_METRICS_PORT",
            ) from None
        _state.server, _state.port, _state.enabled = server, int(server.server_port), True
        _update_phase_timing()
    register_shutdown("fleet.telemetry", stop)  # its thread ends before the groups at exit
    logger.info("trainer metrics on http://%s:%d/metrics", host, _state.port)
    return _state.port


def start_from_env(env: WorkerEnv) -> None:
    """Called by ``fleet.init``: start the endpoint when the env contract names a metrics port
    (trainers only: a parameter server's endpoint belongs to its ``PSServer``)."""
    if env.metrics_port and env.training_role is TrainingRole.TRAINER:
        start(env.metrics_port, env.metrics_host)


def stop() -> None:
    """Stop the endpoint and turn the hooks off (tests, benchmarks)."""
    with _start_lock:
        if _state.server is not None:
            _state.server.shutdown()
            _state.server.server_close()
        _state.server, _state.port, _state.enabled = None, 0, False
        _update_phase_timing()


# -- the hooks -------------------------------------------------------------------------------
def on_forward(inputs: tuple[Any, ...]) -> None:
    """A training forward of the distributed model: count its batch size."""
    if not _state.enabled or not inputs:
        return
    shape = getattr(inputs[0], "shape", None)
    if shape:
        with _hooks:
            _state.forward_samples += int(shape[0])


def on_step() -> None:
    """A training step ended (see the module docstring)."""
    if not _state.enabled:
        return
    with _hooks:
        _on_step()


def _on_step() -> None:
    now = time.perf_counter()
    st = _state
    if st.last_step is not None:
        STEP_SECONDS.observe(now - st.last_step)
        if not _phases.loops:  # a train_from_dataset loop observes its own phases
            _observe_seen_phases(now - st.last_step)
    _phases.mark = dict(_phases.total)
    st.last_step = now
    STEPS.inc()
    st.steps += 1
    if st.models and (st.steps <= 12 or st.steps % 50 == 0):
        _read_ddp_comm_times()
    if not st.samples_reported and st.forward_samples:
        SAMPLES.inc(st.forward_samples)
        st.window_samples += st.forward_samples
    st.forward_samples = 0
    if st.window_start is None:
        st.window_start, st.window_samples, st.window_steps = now, 0, 0
        return
    st.window_steps += 1
    elapsed = now - st.window_start
    # every >= 1 s; the first value already after 3 steps (short jobs show a rate too)
    if elapsed >= THROUGHPUT_WINDOW_S or (not st.throughput_set and st.window_steps >= 3):
        THROUGHPUT.set(st.window_samples / elapsed)
        st.window_start, st.window_samples, st.window_steps = now, 0, 0
        st.throughput_set = True


def report(loss: Any = None, samples: int | None = None, step: bool = False) -> None:
    """What only the training script knows: ``loss`` (a float or a tensor, read lazily),
    ``samples`` consumed (counted at once; replaces the automatic batch-size count from then
    on), and
    ``step=True`` to end a step where no fleet optimizer does (see the module docstring)."""
    if samples is not None and (
        isinstance(samples, bool) or not isinstance(samples, int) or samples < 0
    ):
        raise ConfigError(f"must be an integer >= 0, got {samples!r}", key="samples")
    if not _state.enabled:
        return
    if loss is not None:
        _state.loss = loss.detach() if hasattr(loss, "detach") else float(loss)
    if samples is not None:
        with _hooks:
            _state.samples_reported = True
            _state.window_samples += samples
        SAMPLES.inc(samples)
    if step:
        on_step()


def observe_comm(op: str, seconds: float) -> None:
    """Add one communication interval (``op`` in :data:`COMM_OPS`)."""
    if _state.enabled:
        _COMM[op].observe(seconds)


def set_amp_loss_scale(scale: float) -> None:
    """The AMP scaler's current loss scale."""
    if _state.enabled:
        AMP_LOSS_SCALE.set(float(scale))


def count_amp_skipped_step() -> None:
    """AMP skipped an update (inf/NaN gradients)."""
    if _state.enabled:
        AMP_SKIPPED.inc()


def set_pipeline_bubble_ratio(ratio: float) -> None:
    """Fraction of the last pipeline step this stage sat idle (0..1)."""
    if _state.enabled:
        PIPELINE_BUBBLE.set(float(ratio))


# -- all-reduce timing (DDP comm hook) ---------------------------------------------------------
def timed_comm_hook(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap a DDP comm hook so each bucket's time to completion goes to
    ``fleet_trainer_comm_seconds{op="all_reduce"}``."""
    hist = _COMM["all_reduce"]

    @functools.wraps(hook)
    def timed(state: Any, bucket: Any) -> Any:
        start_t = time.perf_counter()
        fut = hook(state, bucket)

        def done(f: Any) -> Any:
            hist.observe(time.perf_counter() - start_t)
            return f.value()

        return fut.then(done)

    return timed


def watch_ddp(model: Any) -> None:
    """Report the all-reduce time of a DDP model from its sampled runtime stats (metrics on)."""
    if _state.enabled and hasattr(model, "_get_ddp_logging_data"):
        _state.models.append(weakref.ref(model))


def _read_ddp_comm_times() -> None:
    """Observe each DDP model's newest sampled backward all-reduce time (ns in torch's logger)."""
    hist = _COMM["all_reduce"]
    alive = []
    for ref in _state.models:
        model = ref()
        if model is None:
            continue
        alive.append(ref)
        try:
            data = model._get_ddp_logging_data()
        except (AttributeError, RuntimeError):
            continue
        iteration, comm_ns = data.get("iteration"), data.get("backward_comm_time")
        if (
            isinstance(iteration, int)
            and isinstance(comm_ns, int)
            and comm_ns > 0
            and _state.seen_iteration.get(id(model)) != iteration
        ):
            _state.seen_iteration[id(model)] = iteration
            hist.observe(comm_ns / 1e9)
    _state.models = alive


# -- parameter-server timing -----------------------------------------------------------------
_CLIENT_OPS = {
    "pull_sparse": "ps_pull",
    "pull_dense": "ps_pull",
    "push_sparse": "ps_push",
    "push_dense": "ps_push",
}


class _TimedClient:
    """Proxy of a PS client: pull_* calls time as ``ps_pull``, push_* as ``ps_push``."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        op = _CLIENT_OPS.get(name)
        if op is None:
            return attr
        hist = _COMM[op]

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                hist.observe(time.perf_counter() - t0)

        return timed


def instrument_communicator(comm: Any) -> None:
    """Add ``comm.pull_sparse``'s time on the training thread to the ``pull_wait`` phase while
    phase timing is on (one flag check otherwise); with metrics on, also time
    ``comm.client``'s pulls/pushes, add ``comm.step()`` to the ``push_optimizer`` phase and end
    a step after it (PS mode)."""
    inner_pull = getattr(comm, "pull_sparse", None)
    if inner_pull is not None:

        @functools.wraps(inner_pull)
        def pull_sparse(*args: Any, **kwargs: Any) -> Any:
            if not _phases.on:
                return inner_pull(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner_pull(*args, **kwargs)
            finally:
                took = time.perf_counter() - t0
                with _hooks:
                    _phases.total["pull_wait"] += took

        comm.pull_sparse = pull_sparse
    if not _state.enabled:
        return
    comm.client = _TimedClient(comm.client)
    inner_step = comm.step

    @functools.wraps(inner_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner_step(*args, **kwargs)
        took = time.perf_counter() - t0
        with _hooks:
            _phases.total["push_optimizer"] += took
        on_step()
        return out

    comm.step = step


# -- step phases -----------------------------------------------------------------------------
LOOP_PHASES = ("data", "pull_wait", "forward", "backward", "push_optimizer", "other")
"""The phases a :class:`PhaseTimer` loop times (``compute`` is split into forward, backward and
other there)."""
SEEN_PHASES = ("data", "pull_wait", "push_optimizer")
"""The phases fleet's hooks accumulate by themselves (a hand-written loop's breakdown)."""


class _Phases:
    """Seconds the phase hooks accumulated (totals that only grow; readers keep snapshots)."""

    def __init__(self) -> None:
        self.on = False
        """Hooks accumulate: metrics on, or a :class:`PhaseTimer` loop running."""
        self.loops = 0
        """:class:`PhaseTimer` loops running (they observe their own phases)."""
        self.total = dict.fromkeys(SEEN_PHASES, 0.0)
        self.mark = dict(self.total)
        """``total`` at the last step end (:func:`on_step`)."""


_phases = _Phases()


def _update_phase_timing() -> None:
    _phases.on = _state.enabled or _phases.loops > 0


def phase_clock() -> float:
    """``time.perf_counter()`` while phase timing is on, else 0.0 (then :func:`add_phase` does
    nothing): the two calls around a part of the step a hook times."""
    return time.perf_counter() if _phases.on else 0.0


def add_phase(phase: str, since: float) -> None:
    """Add the time since ``since`` (a :func:`phase_clock` value) to ``phase`` (one of
    :data:`SEEN_PHASES`)."""
    if since:
        took = time.perf_counter() - since
        with _hooks:
            _phases.total[phase] += took


def pull_wait_seconds() -> float:
    """Seconds this process's training thread waited in PS pulls so far (while timing was on)."""
    return _phases.total["pull_wait"]


def _observe_seen_phases(step_s: float) -> None:
    """A hand-written loop's step ended: observe what the hooks saw, the rest as ``compute``."""
    total, mark = _phases.total, _phases.mark
    seen = 0.0
    for phase in SEEN_PHASES:
        d = max(0.0, total[phase] - mark[phase])
        seen += d
        PHASE_SECONDS.observe(phase, d)
    PHASE_SECONDS.observe("compute", max(0.0, step_s - seen))


class PhaseTimer:
    """The phase clock of a loop that times every phase itself (``fleet.train_from_dataset``).

    Used as a context manager around the loop: inside, the pull-wait hook runs even with
    metrics off, and :func:`on_step` leaves the phase histograms to this timer. Each
    :meth:`add` is one step (seconds per :data:`LOOP_PHASES` phase): observed in
    ``fleet_trainer_phase_seconds`` when metrics are on, and summed in :attr:`total` and
    :attr:`period` (the caller resets ``period`` when it prints).
    """

    def __init__(self) -> None:
        self.total = [0.0] * len(LOOP_PHASES)
        self.period = [0.0] * len(LOOP_PHASES)

    def __enter__(self) -> PhaseTimer:
        with _hooks:
            _phases.loops += 1
            _update_phase_timing()
        return self

    def __exit__(self, *exc: Any) -> None:
        with _hooks:
            _phases.loops -= 1
            _update_phase_timing()

    def add(self, *seconds: float) -> None:
        """One step's phases, in :data:`LOOP_PHASES` order."""
        with _hooks:
            total, period = self.total, self.period
            for i, s in enumerate(seconds):
                total[i] += s
                period[i] += s
            if _state.enabled:
                for phase, s in zip(LOOP_PHASES, seconds):
                    PHASE_SECONDS.observe(phase, s)

    def reset_period(self) -> None:
        with _hooks:
            self.period = [0.0] * len(LOOP_PHASES)


def steps_ended() -> int:
    """Steps ended so far (metrics on; 0 otherwise): a loop ends a step itself only when no
    optimizer or communicator did."""
    return _state.steps


__all__ = [
    "AMP_LOSS_SCALE",
    "AMP_SKIPPED",
    "COMM_OPS",
    "COMM_SECONDS",
    "LOSS",
    "LOOP_PHASES",
    "PHASES",
    "PHASE_SECONDS",
    "PIPELINE_BUBBLE",
    "PhaseHistograms",
    "SEEN_PHASES",
    "PhaseTimer",
    "add_phase",
    "SAMPLES",
    "STEPS",
    "STEP_SECONDS",
    "THROUGHPUT",
    "count_amp_skipped_step",
    "enabled",
    "instrument_communicator",
    "observe_comm",
    "on_forward",
    "on_step",
    "phase_clock",
    "pull_wait_seconds",
    "report",
    "set_amp_loss_scale",
    "set_pipeline_bubble_ratio",
    "start",
    "start_from_env",
    "steps_ended",
    "stop",
    "timed_comm_hook",
    "watch_ddp",
]
