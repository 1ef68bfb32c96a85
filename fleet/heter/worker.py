"""The heter worker: ``fleet.run_heter_worker(model, optimizer)`` serves ``device_part``.

A heter worker (TRAINING_ROLE=HETER_TRAINER) serves the CPU trainers ``i`` with ``i mod H`` =
its index on POD_IP:PADDLE_PORT (:class:`ps_server.rpc.heter_service.HeterServer`, a pool of
request threads; the device work is serialized by one lock). Per micro-batch it runs
``device_part`` forward, ``loss_fn`` and backward on its device, returns the activations'
gradients, the loss and the output, and updates the dense parameters.

Dense parameters live on the PS dense table :data:`HETER_DENSE_TABLE` (the servers apply the
rule of the optimizer given here, as ``fleet.distributed_optimizer`` does for a trainer's dense
parameters): several heter workers share them, a restarted heter worker pulls them back, and
they are part of every job checkpoint.

* **sync** (``a_sync=False``): a round gathers one micro-batch from each of this worker's
  trainers, their mean gradient is pushed as one SYNC push counted over the H heter workers (the
  servers apply the mean once the H pushes arrived), the heter workers meet in a barrier on the
  servers, and the fresh values are pulled before the replies go out.
* **async**: the micro-batches waiting at the worker are merged into one forward/backward (their
  summed gradient is what separate steps would give); the worker applies it to its own copy with
  the optimizer's rule, replies, and a background sender pushes it (APPLY, queued gradients summed)
  and pulls the servers' values every ``heter_configs.dense_pull_interval`` pushes, as the async
  communicator does for an ordinary trainer's dense parameters.

A CPU heter worker runs ``heter_configs.intra_op_threads`` intra-op threads (0: the CPUs it may
use), whatever ``OMP_NUM_THREADS`` fleetrun set.

It returns when every one of its trainers sent ``Stop`` (``fleet.stop_worker``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from collective.env import TrainingRole, WorkerEnv, usable_cpus
from collective.errors import ConfigError, FleetError
from fleet.heter.model import HeterModel, as_target
from fleet.ps import runtime as ps_runtime

logger = logging.getLogger(__name__)

HETER_DENSE_TABLE = "__heter_dense__"
"""The PS dense table of the heter workers' dense parameters (``device_part``)."""
DENSE_BLOCK = "dense"
"""Its one block: every parameter of ``device_part``, flat float32."""
PHASES = ("decode", "wait", "forward_backward", "reply", "update", "push", "pull")
"""The phases timed per micro-batch (the heter worker's closing log line shows their seconds)."""
SERVER_CHECK_S = 2.0
"""How often a serving heter worker checks that the parameter servers are up."""


def resolve_device(spec: str, index: int) -> torch.device:
    """PADDLE_HETER_TRAINER_DEVICE as a torch device: ``cpu``, ``cuda`` / ``gpu`` (the GPU
    ``index mod count``), ``cuda:N`` / ``gpu:N``. ConfigError naming the device and what this
    host has when it does not exist."""
    raw = (spec or "cpu").strip().lower()
    kind, _, num = raw.partition(":")
    if kind == "gpu":
        kind = "cuda"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    exists = ["cpu"] + [f"cuda:{i}" for i in range(count)]
    if kind == "cpu" and not num:
        return torch.device("cpu")
    if kind != "cuda" or (num and not num.isdigit()):
        raise ConfigError(
            f"heter worker {index}: device {spec!r} is not cpu, cuda, cuda:N, gpu or gpu:N "
            f"(fleetrun --heter_devices); this host has {', '.join(exists)}",
            key="PADDLE_HETER_TRAINER_DEVICE",
        )
    if count == 0 or (num and int(num) >= count):
        raise ConfigError(
            f"heter worker {index}: device {spec!r} does not exist on this host; it has "
            f"{', '.join(exists)} (fleetrun --heter_devices names each worker's device)",
            key="PADDLE_HETER_TRAINER_DEVICE",
        )
    return torch.device(f"cuda:{int(num) if num else index % count}")


class HeterWorker:
    """The handler of the Heter service (``hello``, ``step``, ``predict``, ``stop``)."""

    def __init__(self, model: HeterModel, optimizer: Any, env: WorkerEnv, strategy: Any) -> None:
        from fleet.ps.optimizer import rule_from_torch
        from ps_server import PSClient

        self.env = env
        self.index = env.heter_index
        self.num_heter = len(env.heter_endpoints)
        self.device = resolve_device(env.heter_device, self.index)
        self.net = model.device_part.to(self.device)
        self.loss_fn = model.loss_fn
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.sync = not strategy.a_sync
        cfg = strategy.heter_configs
        self.recovery_s = cfg.recovery_timeout_s
        self.pull_interval = cfg.dense_pull_interval
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.intra_op_threads or usable_cpus())
        self.trainers = [t for t in range(env.world_size) if t % self.num_heter == self.index]
        self.stopped: set[int] = set()
        self.stepped: set[int] = set()
        self.done = threading.Event()
        self.fatal: BaseException | None = None
        self.cut: tuple[int, list[Any]] | None = None  # (first trainer, its activation layout)
        self.device_lock = threading.Lock()
        self.cv = threading.Condition()
        self.round: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []  # async: micro-batches waiting for the device
        self.latest: np.ndarray | None = None
        self.latest_lock = threading.Lock()
        self.busy_s = 0.0
        """Seconds of device work (forward, loss, backward, the update's local part)."""
        self.micro_batches = 0
        self.first_t: float | None = None  # when the first micro-batch's work began
        self.last_t = 0.0  # when the last one's ended
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        """Seconds per phase of the micro-batches (summed over request threads; ``push`` and
        ``pull`` run off the critical path in async mode)."""
        self.merges = 0  # forward/backward passes (async: one per merged group)
        self.pushes = 0
        self._sendq: queue.Queue[np.ndarray | None] = queue.Queue()
        self._sender: threading.Thread | None = None
        self.client = PSClient(list(env.pserver_endpoints))
        self.client.wait_ready(timeout_s=120)
        self.client.create_dense_table(HETER_DENSE_TABLE, optimizer=rule_from_torch(optimizer))
        self._init_dense()

    # -- dense parameters on the servers ------------------------------------------------------
    def _flat(self, grads: bool) -> np.ndarray:
        parts = []
        for p in self.params:
            t = p.grad if grads else p.detach()
            t = torch.zeros_like(p) if t is None else t
            parts.append(t.detach().reshape(-1).to(torch.float32).cpu())
        return torch.cat(parts).numpy() if parts else np.zeros(0, np.float32)

    def _set(self, flat: np.ndarray) -> None:
        values = torch.from_numpy(np.asarray(flat, np.float32).copy())
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(values[offset : offset + n].view_as(p).to(p.device, p.dtype))
                offset += n

    def _init_dense(self) -> None:
        """Worker 0 gives the table its first values unless it exists (a restart, a loaded
        checkpoint: the servers' values win); every worker then pulls them."""
        from ps_server.rpc.status import PSNotFoundError

        deadline = time.monotonic() + self.recovery_s
        while True:
            try:
                self._set(self.client.pull_dense(HETER_DENSE_TABLE, DENSE_BLOCK))
                return
            except PSNotFoundError:
                if self.index == 0:
                    self.client.init_dense(HETER_DENSE_TABLE, DENSE_BLOCK, self._flat(False))
                elif time.monotonic() > deadline:
                    raise FleetError(
                        f"heter worker {self.index}: heter worker 0 did not create the dense "
                        f"table {HETER_DENSE_TABLE} within {self.recovery_s:g}s"
                    ) from None
                else:
                    time.sleep(0.1)

    # -- requests -------------------------------------------------------------------------------
    def _tensors(self, trainer: int, arrays: dict[str, np.ndarray]) -> list[torch.Tensor]:
        names = sorted((k for k in arrays if k.startswith("act")), key=lambda k: int(k[3:]))
        layout = [[list(arrays[k].shape[1:]), arrays[k].dtype.str] for k in names]
        with self.cv:
            if self.cut is None:
                self.cut = (trainer, layout)
            first, want = self.cut
        if layout != want:

            def show(lay: list[Any]) -> str:
                return ", ".join(f"[B, {', '.join(map(str, s))}] {d}" for s, d in lay)

            err = ConfigError(
                f"heter worker {self.index}: the cut differs between trainers: trainer {trainer} "
                f"sends activations {show(layout)} but trainer {first} sent {show(want)}; every "
                "CPU trainer must run the same cpu_part (same widths and dtypes)",
                key="cpu_part",
            )
            self.abort(err)
            raise err
        out = []
        for k in names:
            t = torch.from_numpy(np.array(arrays[k])).to(self.device)
            out.append(t.requires_grad_(t.is_floating_point()))
        return out

    def _add(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.phases[phase] += now - t0
        return now

    def hello(self, h: dict[str, Any], a: dict[str, np.ndarray]) -> Any:
        trainer = int(h["trainer"])
        if trainer not in self.trainers:
            raise ConfigError(
                f"trainer {trainer} called heter worker {self.index}, which serves trainers "
                f"{self.trainers} (trainer i talks to heter worker i mod {self.num_heter})",
                key="trainer",
            )
        mode = "sync" if self.sync else "async"
        return {"index": self.index, "device": str(self.device), "mode": mode}, {}

    def predict(self, h: dict[str, Any], a: dict[str, np.ndarray]) -> Any:
        acts = self._tensors(int(h["trainer"]), a)
        with self.device_lock, torch.no_grad():
            self._refresh()
            out = self.net(*acts)
        return {}, {"out": out.detach().float().cpu().numpy()}

    def step(self, h: dict[str, Any], a: dict[str, np.ndarray]) -> Any:
        trainer = int(h["trainer"])
        if self.fatal is not None:
            raise self.fatal
        self.stepped.add(trainer)
        t0 = time.perf_counter()
        item = {"trainer": trainer, "acts": self._tensors(trainer, a), "label": a["label"]}
        t0 = self._add("decode", t0)
        if not self.sync:
            return self._step_async(item, t0)
        with self.cv:
            self.round.append(item)
            batch = self._full_round_locked()
            if batch is None:
                self.cv.wait_for(lambda: "reply" in item or "error" in item)
        if batch is not None:
            self._run_round(batch)
        if "error" in item:
            raise item["error"]
        return item["reply"]

    def _step_async(self, item: dict[str, Any], t0: float) -> Any:
        """Queue ``item``; whichever request thread gets the device next computes every queued
        micro-batch as one, applies the summed gradient locally and hands it to the sender."""
        with self.cv:
            self.pending.append(item)
        with self.device_lock:
            t0 = self._add("wait", t0)
            if "reply" not in item and "error" not in item:
                with self.cv:
                    batch, self.pending = self.pending, []
                try:
                    self._refresh()
                    replies, grad = self._compute(batch, mean=False)
                    t1 = time.perf_counter()
                    self.optimizer.step()  # the local copy, by the servers' rule
                    self.busy_s += time.perf_counter() - t1
                    self.last_t = self._add("update", t1)
                    self._send(grad)
                    for it, reply in zip(batch, replies):
                        it["reply"] = reply
                except Exception as err:  # noqa: BLE001 - every merged trainer gets the error
                    for it in batch:
                        it["error"] = err
        if "error" in item:
            raise item["error"]
        return item["reply"]

    def _send(self, grad: np.ndarray) -> None:
        if self._sender is None:
            self._sender = threading.Thread(
                target=self._send_loop, name="heter-sender", daemon=True
            )
            self._sender.start()
        self._sendq.put(grad)

    def _send_loop(self) -> None:
        """Async: push the queued gradients (summed), pull every ``pull_interval`` pushes."""
        while True:
            grad = self._sendq.get()
            if grad is None:
                return
            while True:
                try:
                    more = self._sendq.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._sendq.put(None)
                    break
                grad = grad + more
            try:
                t0 = time.perf_counter()
                if (self.pushes + 1) % self.pull_interval == 0:
                    # the push and the pull of the fresh values in one call
                    fresh = self.client.push_pull_dense(
                        HETER_DENSE_TABLE, DENSE_BLOCK, grad, mode="apply"
                    )
                    self.pushes += 1
                    self._add("push", t0)
                    with self.latest_lock:
                        self.latest = fresh
                else:
                    self.client.push_dense(HETER_DENSE_TABLE, DENSE_BLOCK, grad, mode="apply")
                    self.pushes += 1
                    self._add("push", t0)
            except Exception as err:  # noqa: BLE001 - the next micro-batch raises it
                logger.exception("heter worker %d: dense push failed", self.index)
                self.fatal = self.fatal or err
                return

    def flush(self) -> None:
        """Async: wait until the sender pushed every queued gradient."""
        if self._sender is not None:
            self._sendq.put(None)
            self._sender.join(timeout=self.recovery_s)

    def stop(self, h: dict[str, Any], a: dict[str, np.ndarray]) -> Any:
        trainer = int(h["trainer"])
        with self.cv:
            self.stopped.add(trainer)
            batch = self._full_round_locked()
            if all(t in self.stopped for t in self.trainers):
                self.done.set()
        if batch is not None:
            self._run_round(batch)
        logger.info("heter worker %d: trainer %d stopped", self.index, trainer)
        return {}, {}

    # -- the device work ------------------------------------------------------------------------
    def _refresh(self) -> None:
        with self.latest_lock:
            fresh, self.latest = self.latest, None
        if fresh is not None:
            self._set(fresh)

    def _compute(
        self, items: list[dict[str, Any]], mean: bool = True
    ) -> tuple[list[Any], np.ndarray]:
        """One forward + loss + backward of the micro-batches concatenated along the batch (the
        caller holds the device lock); the replies and the dense gradient: the sum of the
        micro-batches' loss gradients (``mean``: divided by their number). Each micro-batch's
        loss is ``loss_fn`` over its own rows, so its activation gradients equal a separate
        step's when ``device_part`` treats rows independently (no batch statistics)."""
        t0 = time.perf_counter()
        self.first_t = t0 if self.first_t is None else self.first_t
        self.net.train()
        for p in self.params:
            p.grad = None
        sizes = [int(item["acts"][0].shape[0]) if item["acts"] else 0 for item in items]
        if len(items) == 1:
            acts = items[0]["acts"]
        else:
            acts = [torch.cat(ts) for ts in zip(*(item["acts"] for item in items))]
        out = self.net(*acts)
        losses = []
        offset = 0
        for item, n in zip(items, sizes):
            part = out[offset : offset + n] if len(items) > 1 else out
            label = torch.from_numpy(np.array(item["label"])).to(self.device)
            losses.append(self.loss_fn(part, as_target(self.loss_fn, part, label)))
            offset += n
        (losses[0] if len(losses) == 1 else torch.stack(losses).sum()).backward()
        t1 = self._add("forward_backward", t0)
        out_np = out.detach().float().cpu().numpy()
        replies = []
        offset = 0
        for item, n, loss in zip(items, sizes, losses):
            grads = {
                f"grad{i}": (t.grad if t.grad is not None else torch.zeros_like(t))
                .detach()
                .cpu()
                .numpy()
                for i, t in enumerate(item["acts"])
            }
            grads["out"] = out_np[offset : offset + n]
            replies.append(({"loss": float(loss.detach())}, grads))
            offset += n
        grad = self._flat(True)
        if mean and len(items) > 1:
            grad = grad / len(items)
        self.last_t = self._add("reply", t1)
        self.busy_s += self.last_t - t0
        self.micro_batches += len(items)
        self.merges += 1
        return replies, grad

    def _full_round_locked(self) -> list[dict[str, Any]] | None:
        """Sync: the round's micro-batches once every running trainer of this worker sent one."""
        running = [t for t in self.trainers if t not in self.stopped]
        if self.round and len(self.round) >= len(running):
            batch, self.round = self.round, []
            return batch
        return None

    def _run_round(self, batch: list[dict[str, Any]]) -> None:
        try:
            with self.device_lock:
                replies, grad = self._compute(batch)
                t0 = time.perf_counter()
                self.client.push_dense(
                    HETER_DENSE_TABLE, DENSE_BLOCK, grad, mode="sync", sync_count=self.num_heter
                )
                if self.num_heter > 1:
                    self.client.barrier("fleet.heter round", self.num_heter)
                t0 = self._add("push", t0)
                self._set(self.client.pull_dense(HETER_DENSE_TABLE, DENSE_BLOCK))
                self._add("pull", t0)
            for item, reply in zip(batch, replies):
                item["reply"] = reply
        except Exception as err:  # noqa: BLE001 - every waiting trainer gets the error
            for item in batch:
                item["error"] = err
        with self.cv:
            self.cv.notify_all()

    # -- serving --------------------------------------------------------------------------------
    def abort(self, err: BaseException) -> None:
        """A fatal error: the trainers waiting in a sync round get it now, and :meth:`serve`
        raises it."""
        with self.cv:
            self.fatal = self.fatal or err
            for item in self.round:
                item["error"] = err
            self.round = []
            self.cv.notify_all()

    def serve(self) -> None:
        """Serve until every trainer of this worker stopped; FleetError when the servers are
        gone for longer than the recovery window first (or a bad cut was seen)."""
        from ps_server.rpc.status import PSRpcError

        if not self.trainers:
            logger.warning(
                "heter worker %d has no CPU trainer to serve (%d trainers, %d heter workers)",
                self.index,
                self.env.world_size,
                self.num_heter,
            )
            return
        last_ok = time.monotonic()
        while not self.done.wait(SERVER_CHECK_S):
            if self.fatal is not None:
                raise self.fatal
            try:
                self.client.wait_ready(timeout_s=SERVER_CHECK_S)
                last_ok = time.monotonic()
            except PSRpcError:
                if time.monotonic() - last_ok < self.recovery_s:
                    continue
                why = (
                    "no CPU trainer ever sent a micro-batch: the trainers' model is not a "
                    "fleet.heter.HeterModel trained with train_step"
                    if not self.stepped
                    else f"trainers {sorted(set(self.trainers) - self.stopped)} never stopped"
                )
                raise FleetError(
                    f"heter worker {self.index}: the parameter servers are gone "
                    f"({','.join(self.env.pserver_endpoints)}) and {why}"
                ) from None


def run_heter_worker(model: Any = None, optimizer: Any = None) -> None:
    """Serve ``model``'s ``device_part`` for this heter worker's CPU trainers until they all
    stopped (Paddle's name). ``model``: the script's :class:`~fleet.heter.HeterModel`;
    ``optimizer``: a torch optimizer over ``model.device_part``'s parameters whose rule the
    servers apply (SGD, Adagrad or Adam, as ``fleet.distributed_optimizer``)."""
    from ps_server.rpc.heter_service import HeterServer

    st = ps_runtime._require("run_heter_worker()", TrainingRole.HETER_TRAINER)
    ps_runtime.heter_started()
    if not isinstance(model, HeterModel):
        raise ConfigError(
            "fleet.run_heter_worker needs the script's fleet.heter.HeterModel(cpu_part, "
            f"device_part, loss_fn), got {type(model).__name__}: a heter worker runs the "
            "device_part of the cut",
            key="model",
        )
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        raise ConfigError(
            "fleet.run_heter_worker needs a torch optimizer over model.device_part's "
            f"parameters (SGD, Adagrad or Adam), got {type(optimizer).__name__}",
            key="optimizer",
        )
    env = st.env
    worker = HeterWorker(model, optimizer, env, st.strategy)
    host, _, port = env.current_endpoint.rpartition(":")
    server = HeterServer(worker, host, int(port))
    server.start()
    logger.info(
        "heter worker %d on %s, %s, serving on %s",
        worker.index,
        worker.device,
        "sync" if worker.sync else "async",
        env.current_endpoint,
    )
    t0 = time.perf_counter()
    try:
        worker.serve()
        worker.flush()
    finally:
        server.stop()
        worker.client.close()
        first = worker.first_t if worker.first_t is not None else t0
        span = max(worker.last_t - first, 1e-9)
        logger.info(
            "heter worker %d: %d micro-batches, busy %.2fs of the %.2fs between the first and "
            "the last (%.0f%%; %.2fs served in all)",
            worker.index,
            worker.micro_batches,
            worker.busy_s,
            span,
            100.0 * worker.busy_s / span,
            time.perf_counter() - t0,
        )
        logger.info(
            "heter worker %d phases (s): %s; %d forward/backward passes, %d dense pushes, %d "
            "intra-op threads",
            worker.index,
            ", ".join(f"{k} {v:.2f}" for k, v in worker.phases.items()),
            worker.merges,
            worker.pushes,
            torch.get_num_threads(),
        )


__all__ = ["DENSE_BLOCK", "HETER_DENSE_TABLE", "HeterWorker", "resolve_device", "run_heter_worker"]
