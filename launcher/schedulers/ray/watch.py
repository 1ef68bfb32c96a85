"""Watch one attempt of a Ray job to its end, and tear it down.

:func:`watch_attempt` long-polls every actor for output (to ``log_dir/workerlog.N`` /
``serverlog.N`` and the console), records exits and failures (a process's non-zero exit or
signal, with its error file; a dead actor or node), re-creates one failed PS process's actor alone
in async/GEO mode (:mod:`~launcher.schedulers.ray.ps_recovery`), ends an elastic round when its
growth probe is placed, and gives the servers ``ps.server_grace_s`` once the trainers are done.
:func:`teardown_attempt` stops every process, flushes the last output, kills the actors and
removes the placement group (unless the job keeps it across attempts).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from launcher.attempt import TRAINER
from launcher.schedulers.ray import elastic, ps_recovery
from launcher.schedulers.ray.actor import ActorInfo, PollReply
from launcher.schedulers.ray.members import (
    Group,
    Member,
    actor_results,
    first_line,
    remove_pg,
    warm_request,
)
from launcher.summary import Failure, read_error_file

if TYPE_CHECKING:
    from launcher.schedulers.ray.job import RayJob

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""Long-poll period of each actor (output arrives as soon as it is written, not per period)."""


def watch_attempt(job: RayJob, group: Group, attempt: int) -> list[Failure]:
    """Stream output until the attempt ends; the failures (empty = success)."""
    pending = {m.actor.poll.remote(POLL_S): m for m in group.members}
    server_deadline: float | None = None
    while pending:
        ready, _ = job.ray.wait(list(pending), num_returns=1, timeout=POLL_S * 5)
        for ref in ready:
            m = pending.pop(ref)
            if _handle_poll(job, m, ref, attempt):
                pending[m.actor.poll.remote(POLL_S)] = m
        if ready:
            job.monitor.refresh()
        failures = [m.failure for m in group.members if m.failure is not None]
        if failures:
            member = _restart_alone(job, group, failures, attempt)
            if member is None:
                return failures
            pending[member.actor.poll.remote(POLL_S)] = member
            continue
        if not any(m.reply for m in group.members) and elastic.probe_placed(
            job.ray, job.probe
        ):  # an elastic job can grow (none has finished yet)
            logger.info("resources for one more node are free: re-forming the job bigger")
            job.grow = True
            return []
        trainers_done = all(m.reply is not None for m in group.members if m.proc.role == TRAINER)
        if trainers_done:
            # as the local scheduler: servers get server_grace_s to stop on their own
            server_deadline = server_deadline or time.monotonic() + job.spec.ps.server_grace_s
            if time.monotonic() >= server_deadline:
                return []
    return []


def _restart_alone(
    job: RayJob, group: Group, failures: list[Failure], attempt: int
) -> Member | None:
    """A PS job in async/GEO mode whose one failure is a server or a trainer: re-create its
    actor alone in its bundle — a server on its port, restoring its shards; a trainer from
    its data position, meeting the others through the coordinator —
    (:mod:`~launcher.schedulers.ray.ps_recovery`); the others go on. The new member (replacing
    the dead one), or None: the attempt ends."""
    if job.recovery is None or job.elastic or len(failures) != 1:
        return None
    i = next(i for i, m in enumerate(group.members) if m.failure is failures[0])
    old = group.members[i]
    ctx = ps_recovery.RespawnContext(
        job.ray,
        job.actor_cls,
        group.pg,
        job.run_id,
        job.argv,
        job.spec.entrypoint.no_python,
        job.cwd,
        job.monitor.metrics_enabled,
        functools.partial(actor_results, job.ray),
        functools.partial(warm_request, job.spec, job.log_dir),
    )
    respawn = (
        ps_recovery.respawn_trainer if old.proc.role == TRAINER else ps_recovery.respawn_server
    )
    got = respawn(
        ctx,
        job.recovery,
        failures,
        old.actor,
        old.proc,
        i,
        job.slots[i].bundle,
        old.log,
        attempt,
        job.restarts < job.spec.max_restarts,
    )
    if not isinstance(got, ps_recovery.Respawned):
        if got == ps_recovery.PORT_TAKEN:  # the restart-all recovery finds it a new port
            job.server_ports.pop(old.proc.rank, None)
        return None
    member = Member(got.actor, got.info, got.proc, old.log, got.pid)
    group.members[i] = member
    if got.actor is not old.actor:  # a new actor (the old one kept: warm starts)
        group.actors.append(got.actor)
    job.restarts += 1
    job.monitor.recovered(old.proc.role, got.recovery.text())
    job.monitor.restarted_in_place(job.restarts)
    job.monitor.attempt_started(attempt, group.members)
    logger.warning("%s", got.recovery.text())
    return member


def _handle_poll(job: RayJob, m: Member, ref: Any, attempt: int) -> bool:
    """Write a poll reply's output; record an exit. True while the process still runs."""
    from ray.exceptions import RayError

    try:
        reply: PollReply = job.ray.get(ref)
    except RayError as err:  # actor or node died
        m.failure = Failure(
            role=m.proc.role,
            rank=m.proc.rank,
            local_rank=m.proc.local_rank,
            node_rank=m.proc.node_rank,
            host=_host(m.info),
            pid=m.info.pid,
            exit_desc=f"Ray actor died ({type(err).__name__})",
            time=time.time(),
            attempt=attempt,
            log_path=m.proc.log_path,
            message=first_line(err),
        )
        return False
    if reply.output:
        m.log.write(reply.output)
        if m.proc.show:
            for line in reply.output.splitlines(keepends=True):
                job.console.write(m.proc.prefix, line)
    if reply.returncode is None:
        return True
    m.reply = reply
    if reply.returncode != 0:
        m.failure = _failure(m, reply, attempt)
    return False


def _failure(m: Member, reply: PollReply, attempt: int) -> Failure:
    parsed = None
    if reply.error_text is not None:
        os.makedirs(os.path.dirname(m.proc.error_file), exist_ok=True)
        if not _same_file_written(m.proc.error_file, reply.error_text):
            with open(m.proc.error_file, "w", encoding="utf-8") as f:
                f.write(reply.error_text)
        parsed = read_error_file(m.proc.error_file)
    return Failure(
        role=m.proc.role,
        rank=m.proc.rank,
        local_rank=m.proc.local_rank,
        node_rank=m.proc.node_rank,
        host=_host(m.info),
        pid=reply.pid,
        exit_desc=reply.exit_desc,
        time=reply.exit_time,
        attempt=attempt,
        log_path=m.proc.log_path,
        error_file=m.proc.error_file if parsed else None,
        message=parsed[0] if parsed else "",
        traceback=parsed[1] if parsed else "",
    )


def teardown_attempt(job: RayJob, group: Group) -> None:
    """Stop every process, flush the last output, kill the actors, remove the placement group."""
    ray = job.ray
    from ray.exceptions import RayError

    grace = job.spec.grace_period_s
    alive = [m for m in group.members if m.reply is None and m.failure is None]
    try:
        if group.members:
            # every member, failed ones too: stop() also kills what is left of the child's
            # process group (a dead actor's call just errors)
            stops = [m.actor.stop.remote(grace) for m in group.members]
            ray.wait(stops, num_returns=len(stops), timeout=grace + 10.0)
        if alive:  # the output they wrote while stopping
            finals = {m.actor.poll.remote(0.0): m for m in alive}
            done, _ = ray.wait(list(finals), num_returns=len(finals), timeout=5.0)
            for ref in done:
                try:
                    reply = ray.get(ref)
                except RayError:
                    continue
                finals[ref].log.write(reply.output)
                if reply.returncode is not None:
                    finals[ref].reply = reply
    finally:
        for m in group.members:
            m.log.close()
            m.torn_down = True
        for actor in group.actors:
            try:
                ray.kill(actor, no_restart=True)
            except (RayError, ValueError):
                pass
        if group.pg is not None and group.pg is not job.kept_pg:
            remove_pg(group.pg)


def _host(info: ActorInfo) -> str:
    return info.hostname if info.hostname == info.node_ip else f"{info.hostname} ({info.node_ip})"


def _same_file_written(path: str, text: str) -> bool:
    """True when ``path`` already holds ``text`` (driver and actor on one machine)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == text
    except OSError:
        return False


__all__ = ["POLL_S", "teardown_attempt", "watch_attempt"]
