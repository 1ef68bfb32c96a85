"""The trainer's Prometheus metrics: definitions, the ``/metrics`` endpoint, the hooks.

Not :mod:`fleet.metrics` (Paddle's distributed AUC/accuracy over all trainers' data); this module
is about watching the job. ``fleet.init`` calls :func:`start_from_env`: with ``FLEET_METRICS_PORT``
set (fleetrun sets it) the process serves ``/metrics`` and the hooks below record; without it
every hook returns after one flag check (no clock read, no lock).

Where the numbers come from (one-line hook calls in the other fleet modules; all logic is in this
package: the step-phase clock in :mod:`fleet.telemetry.phases`, whose names this module
re-exports, and the state both share in :mod:`fleet.telemetry.state`):

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
  ``compute``: :func:`on_step`; :mod:`fleet.telemetry.phases`). Pull wait and data are accumulated by two clock reads in
  their hooks while timing is on (metrics on, or a ``train_from_dataset`` loop running);
* **loss**: ``fleet.report(loss=...)``; a tensor is kept and read only when scraped (no device
  sync on the training thread);
* **AMP and pipeline**: :func:`set_amp_loss_scale`, :func:`count_amp_skipped_step`,
  :func:`set_pipeline_bubble_ratio` — called by the AMP and pipeline engines.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from collective.clean_exit import register_shutdown
from collective.env import TrainingRole, WorkerEnv
from collective.errors import ConfigError
from collective.metrics_http import serve_metrics, stop_metrics
from fleet.telemetry.phases import (
    FINE_BUCKETS,
    LOOP_PHASES,
    PHASE_BUCKETS,
    PHASE_SECONDS,
    PHASES,
    SEEN_PHASES,
    PhaseHistograms,
    PhaseTimer,
    add_phase,
    end_step,
    phase_clock,
    pull_wait_seconds,
    update_phase_timing,
)
from fleet.telemetry.state import hooks_lock, recorder

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
COMM_BUCKETS = (*FINE_BUCKETS, 10.0)
"""Seconds; :data:`fleet.telemetry.phases.FINE_BUCKETS`, then 10 s."""
COMM_OPS = ("all_reduce", "ps_pull", "ps_push")

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
THROUGHPUT_WINDOW_S = 1.0
_start_lock = threading.Lock()


def enabled() -> bool:
    """Whether this process records metrics (an endpoint is serving)."""
    return recorder.enabled


def _read_loss() -> float:
    loss = recorder.loss
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
        if recorder.server is not None:
            return recorder.port
        try:
            server, _port = serve_metrics(host, port)
        except OSError as err:
            raise ConfigError(
                f"cannot serve /metrics on {host}:{port}: {err.strerror or err}; the port is busy "
                "— let fleetrun pick one (FLEET_METRICS_PORT), or unset FLEET_METRICS_PORT",
                key="FLEET_METRICS_PORT",
            ) from None
        recorder.server, recorder.port, recorder.enabled = server, int(server.server_port), True
        update_phase_timing()
    register_shutdown("fleet.telemetry", stop)  # its thread ends before the groups at exit
    logger.info("trainer metrics on http://%s:%d/metrics", host, recorder.port)
    return recorder.port


def start_from_env(env: WorkerEnv) -> None:
    """Called by ``fleet.init``: start the endpoint when the env contract names a metrics port
    (trainers only: a parameter server's endpoint belongs to its ``PSServer``)."""
    if env.metrics_port and env.training_role is TrainingRole.TRAINER:
        start(env.metrics_port, env.metrics_host)


def stop() -> None:
    """Stop the endpoint and turn the hooks off (tests, benchmarks)."""
    with _start_lock:
        if recorder.server is not None:
            stop_metrics(recorder.server)
        recorder.server, recorder.port, recorder.enabled = None, 0, False
        update_phase_timing()


# -- the hooks -------------------------------------------------------------------------------
def on_forward(inputs: tuple[Any, ...]) -> None:
    """A training forward of the distributed model: count its batch size."""
    if not recorder.enabled or not inputs:
        return
    shape = getattr(inputs[0], "shape", None)
    if shape:
        with hooks_lock:
            recorder.forward_samples += int(shape[0])


def on_step() -> None:
    """A training step ended (see the module docstring)."""
    if not recorder.enabled:
        return
    with hooks_lock:
        _on_step()


def _on_step() -> None:
    now = time.perf_counter()
    st = recorder
    if st.last_step is not None:
        STEP_SECONDS.observe(now - st.last_step)
    end_step(None if st.last_step is None else now - st.last_step)
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
    if not recorder.enabled:
        return
    if loss is not None:
        recorder.loss = loss.detach() if hasattr(loss, "detach") else float(loss)
    if samples is not None:
        with hooks_lock:
            recorder.samples_reported = True
            recorder.window_samples += samples
        SAMPLES.inc(samples)
    if step:
        on_step()


def observe_comm(op: str, seconds: float) -> None:
    """Add one communication interval (``op`` in :data:`COMM_OPS`)."""
    if recorder.enabled:
        _COMM[op].observe(seconds)


def set_amp_loss_scale(scale: float) -> None:
    """The AMP scaler's current loss scale."""
    if recorder.enabled:
        AMP_LOSS_SCALE.set(float(scale))


def count_amp_skipped_step() -> None:
    """AMP skipped an update (inf/NaN gradients)."""
    if recorder.enabled:
        AMP_SKIPPED.inc()


def set_pipeline_bubble_ratio(ratio: float) -> None:
    """Fraction of the last pipeline step this stage sat idle (0..1)."""
    if recorder.enabled:
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
    if recorder.enabled and hasattr(model, "_get_ddp_logging_data"):
        recorder.models.append(weakref.ref(model))


def _read_ddp_comm_times() -> None:
    """Observe each DDP model's newest sampled backward all-reduce time (ns in torch's logger)."""
    hist = _COMM["all_reduce"]
    alive = []
    for ref in recorder.models:
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
            and recorder.seen_iteration.get(id(model)) != iteration
        ):
            recorder.seen_iteration[id(model)] = iteration
            hist.observe(comm_ns / 1e9)
    recorder.models = alive


# -- parameter-server timing -----------------------------------------------------------------
_CLIENT_OPS = {
    "pull_sparse": "ps_pull",
    "pull_dense": "ps_pull",
    "push_sparse": "ps_push",
    "push_dense": "ps_push",
    "push_pull_dense": "ps_push",
    "push_step": "ps_push",
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
            t0 = phase_clock()
            if not t0:
                return inner_pull(*args, **kwargs)
            try:
                return inner_pull(*args, **kwargs)
            finally:
                add_phase("pull_wait", t0)

        comm.pull_sparse = pull_sparse
    if not recorder.enabled:
        return
    comm.client = _TimedClient(comm.client)
    inner_step = comm.step

    @functools.wraps(inner_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner_step(*args, **kwargs)
        add_phase("push_optimizer", t0)
        on_step()
        return out

    comm.step = step


def steps_ended() -> int:
    """Steps ended so far (metrics on; 0 otherwise): a loop ends a step itself only when no
    optimizer or communicator did."""
    return recorder.steps


__all__ = [
    "AMP_LOSS_SCALE",
    "AMP_SKIPPED",
    "COMM_OPS",
    "COMM_SECONDS",
    "LOSS",
    "LOOP_PHASES",
    "PHASES",
    "PHASE_BUCKETS",
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
