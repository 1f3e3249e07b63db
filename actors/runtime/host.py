"""``ActorHost``: runs the actors of one process and applies their crash policies."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
from anyio.abc import TaskStatus

from actors.runtime.cell import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    ActorCell,
    CrashReport,
    bind_mailbox,
)
from actors.runtime.logging import get_logger
from actors.runtime.refs import DEFAULT_CALL_TIMEOUT_S
from actors.runtime.spec import ActorSpec, build_actor
from transport.channel import ServerChannel
from transport.messages.control import ActorCrashed

_RESTART_BACKOFF_CAP_S: Final = 5.0

_log = get_logger("supervisor")


@dataclass(frozen=True, slots=True)
class HostTimeouts:
    start_s: float = DEFAULT_START_TIMEOUT_S
    stop_s: float = DEFAULT_STOP_TIMEOUT_S
    call_s: float = DEFAULT_CALL_TIMEOUT_S


CrashNotifier = Callable[[ActorCrashed], Awaitable[None]]


class ActorHost:
    """Runs the actors of one process and applies their crash policies.

    ``run`` returns when every actor has stopped for good (stopped, or crashed without
    restart). ``stop`` may be called from any task and at any time.
    """

    def __init__(
        self,
        specs: Sequence[ActorSpec],
        directory: Mapping[str, str],
        *,
        notify: CrashNotifier,
        timeouts: HostTimeouts = HostTimeouts(),
    ) -> None:
        self.specs = list(specs)
        self.directory = directory
        self.timeouts = timeouts
        self._notify = notify
        self._cells: dict[str, ActorCell] = {}
        self._stopping = False
        self._stop_requested = anyio.Event()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as task_group:
            for spec in self.specs:
                task_group.start_soon(self._supervise, spec)
            task_status.started()

    def stop(self) -> None:
        """Stop every actor (``on_stop`` runs for each) and make ``run`` return."""
        self._stopping = True
        self._stop_requested.set()
        for cell in list(self._cells.values()):
            cell.stop()

    async def _supervise(self, spec: ActorSpec) -> None:
        mailbox: ServerChannel | None = None
        crash_times: deque[float] = deque()
        consecutive = 0
        backlog: list[Any] = []  # received by a crashed instance, not handled
        try:
            while not self._stopping:
                try:
                    if mailbox is None:
                        mailbox = await bind_mailbox(self.directory[spec.name])
                    report, backlog = await self._run_once(spec, mailbox, backlog)
                except Exception as exc:  # binding or building the actor failed
                    report = CrashReport.from_exception(exc)
                if self._stopping:
                    return
                if report is None:
                    # It stopped although nobody here asked it to: that is a crash too (an
                    # actor that just vanishes would leave the system a zombie).
                    report = CrashReport(
                        error="the actor stopped without being asked to", traceback=""
                    )
                now = time.monotonic()
                while crash_times and now - crash_times[0] > spec.restart_window_s:
                    crash_times.popleft()
                crash_times.append(now)
                restart = spec.on_crash == "restart" and len(crash_times) <= spec.max_restarts
                _log.error(
                    "actor crashed",
                    actor=spec.name,
                    error=report.error,
                    traceback=report.traceback,
                    policy=spec.on_crash,
                    restarting=restart,
                    crashes_in_window=len(crash_times),
                )
                notice = ActorCrashed(
                    name=spec.name,
                    error=report.error,
                    traceback=report.traceback,
                    pid=os.getpid(),
                    will_restart=restart,
                )
                with anyio.move_on_after(self.timeouts.stop_s):
                    await self._notify(notice)
                if not restart:
                    return
                backoff = min(spec.restart_backoff_s * (2**consecutive), _RESTART_BACKOFF_CAP_S)
                consecutive += 1
                # Messages sent meanwhile queue in the still-bound mailbox for the next instance.
                with anyio.move_on_after(backoff):
                    await self._stop_requested.wait()
        finally:
            if mailbox is not None:
                mailbox.close()

    async def _run_once(
        self, spec: ActorSpec, mailbox: ServerChannel, backlog: list[Any]
    ) -> tuple[CrashReport | None, list[Any]]:
        cell = ActorCell(
            build_actor(spec),
            mailbox,
            self.directory,
            start_timeout_s=self.timeouts.start_s,
            stop_timeout_s=self.timeouts.stop_s,
            call_timeout_s=self.timeouts.call_s,
            backlog=backlog,
        )
        self._cells[spec.name] = cell
        if self._stopping:
            cell.stop()
        try:
            return await cell.run(), cell.backlog
        finally:
            if self._cells.get(spec.name) is cell:
                del self._cells[spec.name]
