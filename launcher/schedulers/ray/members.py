"""What the Ray driver holds of one attempt, and the small actor calls every part of it makes.

:class:`Member` (one process: its actor, where it landed, its spec, its log, its final reply or
failure) and :class:`Group` (the attempt's placement group, actors and members) are filled by
:mod:`~launcher.schedulers.ray.start`, watched and torn down by
:mod:`~launcher.schedulers.ray.watch`, and recorded through :meth:`Member.view` by
:class:`~launcher.telemetry.JobMonitor`. :func:`actor_results` is ``ray.get`` of small actor
calls, bounded in time with errors as LaunchError; :func:`remove_pg` removes a placement group;
:func:`warm_request` says whether an actor forks its process from a warm process.
``ray`` is imported inside the functions only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import IO, Any

from collective.errors import LaunchError
from launcher.attempt import ProcSpec
from launcher.process import ExitInfo
from launcher.schedulers.ray.actor import ActorInfo, PollReply, WarmRequest
from launcher.spec import JobSpec, WarmStart
from launcher.summary import Failure
from launcher.telemetry import MemberView

ACTOR_CALL_TIMEOUT_S = 120.0
"""Bound on actor start-up and its small calls (info, ports, start)."""


@dataclass
class Member:
    """One process of a running attempt, as the driver sees it."""

    actor: Any
    info: ActorInfo
    proc: ProcSpec
    log: IO[bytes]
    pid: int = 0
    reply: PollReply | None = None
    """The final poll reply (set once the process exited)."""
    failure: Failure | None = None
    torn_down: bool = False
    """The attempt's teardown ran (a member with no reply by then is gone, exit unknown)."""

    def view(self) -> MemberView:
        """What :class:`~launcher.telemetry.JobMonitor` records of this member."""
        exit_info = ExitInfo(self.reply.returncode, self.reply.exit_time) if self.reply else None
        gone = self.reply is None and (self.failure is not None or self.torn_down)
        ip = self.info.node_ip
        return MemberView(
            self.proc.role,
            self.proc.rank,
            self.proc.log_path,
            self.proc.metrics_port,
            self.pid or None,
            exit_info,
            ip,
            ip,
            gone,
        )


@dataclass
class Group:
    """Placement group + actors of one attempt."""

    pg: Any
    actors: list[Any] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)


def warm_request(spec: JobSpec, log_dir: str, proc: ProcSpec) -> WarmRequest | None:
    """What an actor is told to fork ``proc`` from a warm process (None: warm starts off, or a
    ``--no_python`` entry point); its log in ``log_dir`` (the driver's absolute one)."""
    if spec.warm_start is not WarmStart.ON or spec.entrypoint.no_python:
        return None
    log_path = os.path.join(log_dir, f"warmlog.{proc.role}{proc.rank}")
    return WarmRequest(log_path, tuple(spec.warm_imports))


def actor_results(ray: Any, refs: list[Any], what: str) -> list[Any]:
    """``ray.get`` of ``refs`` (small actor calls) within :data:`ACTOR_CALL_TIMEOUT_S`; a
    timeout or Ray error raises LaunchError naming ``what`` was being done."""
    from ray.exceptions import GetTimeoutError, RayError

    try:
        return list(ray.get(refs, timeout=ACTOR_CALL_TIMEOUT_S))
    except GetTimeoutError:
        raise LaunchError(f"Ray did not {what} within {ACTOR_CALL_TIMEOUT_S:g} s") from None
    except RayError as err:
        raise LaunchError(f"could not {what} on Ray: {first_line(err)}") from None


def remove_pg(pg: Any) -> None:
    """Remove placement group ``pg``; one already gone (or Ray shut down) is no error."""
    from ray.exceptions import RayError
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except (RayError, ValueError):
        pass


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


__all__ = ["ACTOR_CALL_TIMEOUT_S", "Group", "Member", "actor_results", "first_line", "remove_pg"]
