"""The actor system: start actors from specs, apply crash policies, stop everything cleanly.

Placement:

* ``transport="inproc"``: every actor runs in this process, in the system's task group.
* ``transport="ipc"`` or ``"tcp"``: one child process per ``group`` (multiprocessing "spawn");
  groups named in ``local_groups`` run in this process instead. The parent supervises.

Each process runs an ``ActorHost`` that owns its actors' cells and applies each actor's crash
policy locally: ``restart`` (fresh instance, exponential backoff, at most ``max_restarts``
crashes within ``restart_window_s``) or ``shutdown``. Every crash is logged with name, error
and traceback and reported to the system as ``ActorCrashed``, and each actor named in the
spec's ``crash_watchers`` is sent a ``PeerCrashed``. A child process that dies is a crash of
every actor in its group: the process is started again when all of them have the restart
policy (same budget). A crash that is not restarted shuts the whole system down: every
actor's ``on_stop`` runs, sockets close, child processes exit (terminated, then killed, after
timeouts) and the ipc directory is removed.

Nothing waits without a deadline: start-up, pings, shutdown calls and process joins all have
timeouts, so ``ActorSystem.stop`` returns in bounded time even with a wedged child.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.process
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final

import anyio
from anyio.abc import TaskGroup

from actors.runtime.cell import DEFAULT_STOP_TIMEOUT_S
from actors.runtime.child import (
    HOST_ENDPOINT_PREFIX,
    SUPERVISOR_ENDPOINT,
    ChildPlan,
    child_main,
)
from actors.runtime.errors import RemoteError
from actors.runtime.host import ActorHost, HostTimeouts
from actors.runtime.logging import get_logger
from actors.runtime.refs import DEFAULT_CALL_TIMEOUT_S, ActorRef, RefBook
from actors.runtime.spec import ActorSpec
from transport.address import (
    IpcDirectory,
    Transport,
    endpoint_for,
    new_system_id,
    pick_free_tcp_port,
)
from transport.channel import ChannelClosed, ServerChannel
from transport.codec import Codec
from transport.messages.control import Ack, ActorCrashed, PeerCrashed, Shutdown
from transport.security import EngineKeys, activate, active_keys, new_engine_keys

_PROCESS_POLL_S: Final = 0.05
_TERMINATE_GRACE_S: Final = 3.0
_KILL_GRACE_S: Final = 2.0

_log = get_logger("supervisor")


@dataclass(frozen=True, slots=True)
class ActorHealth:
    name: str
    up: bool
    pid: int = 0
    uptime_s: float = 0.0
    busy_s: float = 0.0  # how long its current message has run (0: idle)
    error: str = ""


class SystemStartError(RuntimeError):
    """The system could not bring every actor up; it has been stopped cleanly."""


class ActorSystem:
    """A running set of actors. Use ``async with ActorSystem(specs) as system: ...``.

    ``start`` returns once every actor answered a Ping. ``stop`` is idempotent and bounded
    in time. After a fatal crash the system stops itself; ``crash`` holds the notice and
    ``wait_stopped`` returns it.
    """

    def __init__(
        self,
        specs: Sequence[ActorSpec],
        *,
        transport: Transport = "inproc",
        local_groups: Collection[str] = (),
        system_id: str | None = None,
        start_timeout_s: float = 30.0,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        names = [spec.name for spec in specs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate actor names: {duplicates}")
        if not specs:
            raise ValueError("an actor system needs at least one actor")
        self.specs = list(specs)
        self.transport: Transport = transport
        self.system_id = system_id or new_system_id()
        self.start_timeout_s = start_timeout_s
        self.timeouts = HostTimeouts(
            start_s=start_timeout_s, stop_s=stop_timeout_s, call_s=call_timeout_s
        )
        groups = {spec.group for spec in specs}
        if transport == "inproc":
            self._local_groups = groups
        else:
            self._local_groups = set(local_groups) & groups
        self._child_groups = sorted(groups - self._local_groups)
        self.directory: dict[str, str] = {}
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self.crash: ActorCrashed | None = None
        self._ipc_dir = IpcDirectory(self.system_id) if transport == "ipc" else None
        self._host: ActorHost | None = None
        self._host_done = anyio.Event()
        self._supervisor_server: ServerChannel | None = None
        self._refs: RefBook | None = None
        self._task_group: TaskGroup | None = None
        self._owned_task_group: TaskGroup | None = None
        self._started = False
        self._stopping = False
        self._stopped = anyio.Event()
        self._expected_exits: set[str] = set()
        self._group_crashes: dict[str, list[float]] = {}  # child group -> its crash times
        self._keys: EngineKeys | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> ActorSystem:
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._owned_task_group = task_group
        try:
            await self.start(task_group)
        except BaseException:
            await self._close_owned_task_group()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The body's own exception propagates unchanged (not wrapped in an ExceptionGroup).
        await self._close_owned_task_group()

    async def _close_owned_task_group(self) -> None:
        await self.stop()
        task_group, self._owned_task_group = self._owned_task_group, None
        if task_group is not None:
            # Only the system's own service loops are left; they hold no state worth saving.
            task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)

    async def start(self, task_group: TaskGroup) -> None:
        """Start every actor with background tasks in ``task_group``; return once all of
        them answered a Ping. Raises ``SystemStartError`` (after stopping) on failure."""
        if self._started:
            raise RuntimeError("actor system already started")
        self._started = True
        self._task_group = task_group
        if self._ipc_dir is not None:
            self._ipc_dir.create()
        if self.transport == "tcp":
            # Internal traffic on tcp is CURVE-encrypted; only this system's processes hold
            # the keys (transport/security.py).
            self._keys = new_engine_keys()
            activate(self._keys)
        self.directory = self._plan_directory()
        self._refs = RefBook(self.directory, sender="system", call_timeout_s=self.timeouts.call_s)
        _log.info(
            "actor system starting",
            system=self.system_id,
            transport=self.transport,
            actors=[spec.name for spec in self.specs],
            child_groups=self._child_groups,
        )
        if self._child_groups:
            self._supervisor_server = ServerChannel(self.directory[SUPERVISOR_ENDPOINT])
            task_group.start_soon(self._serve_supervisor, self._supervisor_server)
            for group in self._child_groups:
                self._spawn_child(group)
            task_group.start_soon(self._watch_children)
        local_specs = [spec for spec in self.specs if spec.group in self._local_groups]
        if local_specs:
            self._host = ActorHost(
                local_specs, self.directory, notify=self._on_crash_notice, timeouts=self.timeouts
            )
            task_group.start_soon(self._run_local_host, self._host)
        else:
            self._host_done.set()
        try:
            await self._wait_ready()
        except SystemStartError:
            await self.stop()
            raise
        _log.info("actor system ready", system=self.system_id)

    async def stop(self) -> None:
        """Stop every actor and process; idempotent; concurrent callers wait for the first."""
        if self._stopping:
            with anyio.move_on_after(self._stop_budget_s()):
                await self._stopped.wait()
            return
        self._stopping = True
        with anyio.CancelScope(shield=True):
            try:
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(self._stop_local_host)
                    for group in list(self.processes):
                        task_group.start_soon(self._stop_child, group)
            finally:
                if self._refs is not None:
                    self._refs.close()
                if self._supervisor_server is not None:
                    self._supervisor_server.close()
                if self._ipc_dir is not None:
                    self._ipc_dir.remove()
                if self._keys is not None and active_keys() is self._keys:
                    activate(None)
                self._stopped.set()
                _log.info(
                    "actor system stopped", system=self.system_id, crashed=self.crash is not None
                )

    async def wait_stopped(self) -> ActorCrashed | None:
        """Wait until the system has stopped; the fatal crash notice, if one caused it."""
        await self._stopped.wait()
        return self.crash

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    # --- use ---------------------------------------------------------------------------------

    def ref(self, name: str) -> ActorRef:
        """A ref to actor ``name`` for callers outside the system (tests, the gateway)."""
        if self._refs is None:
            raise RuntimeError("actor system is not started")
        return self._refs.ref(name)

    @property
    def actor_names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    async def health(
        self, timeout_s: float = 1.0, stuck_after_s: float = math.inf
    ) -> dict[str, ActorHealth]:
        """Ping every actor concurrently. Busy is not down (pings are answered while an actor
        works); an actor is down when it does not answer in time, or when the message it is
        handling has run longer than `stuck_after_s`."""
        results: dict[str, ActorHealth] = {}

        async def probe(name: str) -> None:
            try:
                pong = await self.ref(name).ping(timeout=timeout_s)
            except (TimeoutError, RemoteError, ChannelClosed, RuntimeError) as exc:
                results[name] = ActorHealth(name=name, up=False, error=str(exc))
                return
            stuck = pong.busy_s > stuck_after_s
            results[name] = ActorHealth(
                name=name,
                up=not stuck,
                pid=pong.pid,
                uptime_s=pong.uptime_s,
                busy_s=pong.busy_s,
                error=f"stuck: one message has run for {pong.busy_s:.1f} s" if stuck else "",
            )

        async with anyio.create_task_group() as task_group:
            for name in self.actor_names:
                task_group.start_soon(probe, name)
        return {name: results[name] for name in self.actor_names}

    # --- internals ---------------------------------------------------------------------------

    def _plan_directory(self) -> dict[str, str]:
        names = [spec.name for spec in self.specs]
        if self._child_groups:
            names.append(SUPERVISOR_ENDPOINT)
            names += [HOST_ENDPOINT_PREFIX + group for group in self._child_groups]
        directory: dict[str, str] = {}
        used_ports: set[int] = set()
        for name in names:
            if self.transport == "tcp":
                port = pick_free_tcp_port(exclude=used_ports)
                used_ports.add(port)
                directory[name] = endpoint_for(name, "tcp", self.system_id, port=port)
            else:
                directory[name] = endpoint_for(name, self.transport, self.system_id)
        return directory

    def _stop_budget_s(self) -> float:
        return self.timeouts.stop_s + _TERMINATE_GRACE_S + _KILL_GRACE_S + 2.0

    async def _run_local_host(self, host: ActorHost) -> None:
        try:
            await host.run()
        finally:
            self._host_done.set()

    async def _stop_local_host(self) -> None:
        if self._host is None:
            return
        self._host.stop()
        with anyio.move_on_after(self.timeouts.stop_s + 1.0):
            await self._host_done.wait()

    def _spawn_child(self, group: str) -> None:
        plan = ChildPlan(
            group=group,
            specs=tuple(spec for spec in self.specs if spec.group == group),
            directory=self.directory,
            timeouts=self.timeouts,
            system_id=self.system_id,
            transport=self.transport,
            keys=self._keys,
        )
        context = multiprocessing.get_context("spawn")
        process = context.Process(
            target=child_main, args=(plan,), name=f"kvactor-{group}", daemon=True
        )
        process.start()
        self.processes[group] = process
        _log.info("child started", group=group, pid=process.pid)

    async def _stop_child(self, group: str) -> None:
        process = self.processes[group]
        self._expected_exits.add(group)

        async def request_shutdown() -> None:
            assert self._refs is not None
            host = self._refs.ref(HOST_ENDPOINT_PREFIX + group)
            with contextlib.suppress(TimeoutError, RemoteError, ChannelClosed):
                await host.call(Shutdown(reason="system stop"), timeout=self.timeouts.stop_s)

        # The child may already be exiting on its own (its last actor crashed), in which case
        # nobody answers the Shutdown call: whichever finishes first ends the wait.
        async with anyio.create_task_group() as requests:
            if process.is_alive() and self._refs is not None:
                requests.start_soon(request_shutdown)
            exited = await self._join(process, self.timeouts.stop_s + 1.0)
            requests.cancel_scope.cancel()
        if exited:
            return
        _log.warning("child did not exit; terminating", group=group, pid=process.pid)
        process.terminate()
        if await self._join(process, _TERMINATE_GRACE_S):
            return
        _log.error("child ignored SIGTERM; killing", group=group, pid=process.pid)
        process.kill()
        await self._join(process, _KILL_GRACE_S)

    @staticmethod
    async def _join(process: multiprocessing.process.BaseProcess, timeout_s: float) -> bool:
        with anyio.move_on_after(timeout_s):
            while process.is_alive():
                await anyio.sleep(_PROCESS_POLL_S)
        if process.is_alive():
            return False
        process.join(timeout=0)
        return True

    async def _watch_children(self) -> None:
        """An unexpected child exit is a crash of every actor in its group: the group is
        started again when all of them have the "restart" policy (within their budget),
        else the system stops."""
        while not self._stopping:
            for group, process in list(self.processes.items()):
                if group not in self._expected_exits and not process.is_alive():
                    restart = self._may_restart_group(group)
                    notice = ActorCrashed(
                        name=f"group:{group}",
                        error=f"process {process.pid} exited with code {process.exitcode}",
                        pid=process.pid or 0,
                        will_restart=restart,
                    )
                    _log.error(
                        "child process died",
                        group=group,
                        exitcode=process.exitcode,
                        restarting=restart,
                    )
                    process.join(timeout=0)
                    if restart:
                        self._spawn_child(group)
                    else:
                        self._expected_exits.add(group)
                    await self._on_crash_notice(notice)
            await anyio.sleep(_PROCESS_POLL_S * 4)

    def _may_restart_group(self, group: str) -> bool:
        specs = [spec for spec in self.specs if spec.group == group]
        if not specs or any(spec.on_crash != "restart" for spec in specs):
            return False
        now = time.monotonic()
        window = min(spec.restart_window_s for spec in specs)
        crashes = [t for t in self._group_crashes.get(group, []) if now - t <= window]
        crashes.append(now)
        self._group_crashes[group] = crashes
        return len(crashes) <= min(spec.max_restarts for spec in specs)

    def _crashed_actors(self, notice: ActorCrashed) -> list[ActorSpec]:
        if notice.name.startswith("group:"):
            group = notice.name.removeprefix("group:")
            return [spec for spec in self.specs if spec.group == group]
        return [spec for spec in self.specs if spec.name == notice.name]

    async def _tell_watchers(self, notice: ActorCrashed) -> None:
        for spec in self._crashed_actors(notice):
            for watcher in spec.crash_watchers:
                message = PeerCrashed(
                    actor=spec.name, error=notice.error, will_restart=notice.will_restart
                )
                with contextlib.suppress(ChannelClosed, KeyError, RuntimeError, TimeoutError):
                    await self.ref(watcher).send(message, timeout=1.0)

    async def _serve_supervisor(self, server: ServerChannel) -> None:
        codec: Codec[ActorCrashed | Ack] = Codec(ActorCrashed | Ack)
        ack = codec.encode(Ack())
        with contextlib.suppress(ChannelClosed):
            while True:
                incoming = await server.recv()
                notice = codec.decode(incoming.payload)
                if incoming.envelope.is_call:
                    server.reply(incoming.peer, incoming.envelope.request_id, ack)
                if not isinstance(notice, ActorCrashed):
                    _log.warning("bad supervisor notice", failure=str(notice))
                    continue
                await self._on_crash_notice(notice)

    async def _on_crash_notice(self, notice: ActorCrashed) -> None:
        if not self._stopping:
            await self._tell_watchers(notice)
        if notice.will_restart:
            _log.warning("actor restarting", actor=notice.name, error=notice.error)
            return
        if self._stopping:
            return
        if self.crash is None:
            self.crash = notice
        _log.error(
            "fatal actor crash; actor system shutting down", actor=notice.name, error=notice.error
        )
        if self._task_group is not None:
            self._task_group.start_soon(self.stop)

    async def _wait_ready(self) -> None:
        deadline = anyio.current_time() + self.start_timeout_s
        pending = set(self.actor_names)
        while pending:
            if self.crash is not None or self._stopping:
                reason = self.crash.error if self.crash else "actor system stopped during start"
                who = self.crash.name if self.crash else "actor system"
                raise SystemStartError(f"{who} failed during start: {reason}")
            if anyio.current_time() > deadline:
                raise SystemStartError(
                    f"actors not ready after {self.start_timeout_s} s: {sorted(pending)}"
                )
            ready: set[str] = set()

            async def probe(name: str) -> None:
                with contextlib.suppress(TimeoutError, RemoteError, ChannelClosed):
                    await self.ref(name).ping(timeout=0.25)
                    ready.add(name)

            async with anyio.create_task_group() as probes:
                for name in pending:
                    probes.start_soon(probe, name)
            pending -= ready
