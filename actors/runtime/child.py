"""The entry point of a child process of a multi-process actor system."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from typing import Final

import anyio

from actors.runtime.host import ActorHost, HostTimeouts
from actors.runtime.logging import configure_logging, get_logger
from actors.runtime.spec import ActorSpec
from transport.address import IpcDirectory, Transport
from transport.channel import ChannelClosed, ClientChannel, ServerChannel
from transport.codec import Codec, DecodeFailure
from transport.messages.control import Ack, ActorCrashed, Ping, Pong, Shutdown
from transport.security import EngineKeys, activate

SUPERVISOR_ENDPOINT: Final = "_supervisor"  # the parent's inbox for ActorCrashed notices
HOST_ENDPOINT_PREFIX: Final = "_host."  # a child host's control inbox: "_host.<group>"


@dataclass(frozen=True)
class ChildPlan:
    """Everything a child process needs (pickled through multiprocessing spawn)."""

    group: str
    specs: tuple[ActorSpec, ...]
    directory: dict[str, str]
    timeouts: HostTimeouts
    system_id: str
    transport: Transport
    keys: EngineKeys | None = None  # CURVE keys of a tcp system


def child_main(plan: ChildPlan) -> None:
    """Entry point of a child process: run the group's actors until told to stop."""
    for spec in plan.specs:  # before the actors' modules (and torch) are imported
        os.environ.update(spec.env)
    activate(plan.keys)
    configure_logging()
    # SIGINT belongs to the parent (it stops the system); the child stops on its request.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    anyio.run(_child_run, plan)


async def _child_run(plan: ChildPlan) -> None:
    log = get_logger("host", group=plan.group)
    supervisor = ClientChannel(plan.directory[SUPERVISOR_ENDPOINT], sender=f"_host.{plan.group}")
    crash_codec: Codec[ActorCrashed] = Codec(ActorCrashed)

    async def notify(notice: ActorCrashed) -> None:
        # A call, not a send: the parent's Ack proves delivery before this process may exit.
        with contextlib.suppress(TimeoutError, ChannelClosed):
            await supervisor.call(crash_codec.encode(notice), timeout=plan.timeouts.stop_s)

    host = ActorHost(plan.specs, plan.directory, notify=notify, timeouts=plan.timeouts)
    control = ServerChannel(plan.directory[HOST_ENDPOINT_PREFIX + plan.group])
    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(_serve_host_control, control, host)
            task_group.start_soon(_stop_when_parent_dies, host, plan)
            task_group.start_soon(_stop_on_sigterm, host)
            await host.run()
            task_group.cancel_scope.cancel()
    finally:
        control.close()
        supervisor.close()
        log.info("host exited")


async def _serve_host_control(control: ServerChannel, host: ActorHost) -> None:
    codec: Codec[Ping | Shutdown] = Codec(Ping | Shutdown)
    started = time.monotonic()
    while True:
        incoming = await control.recv()
        message = codec.decode(incoming.payload)
        if isinstance(message, DecodeFailure):
            continue
        if incoming.envelope.is_call:
            reply = (
                Pong(actor="_host", pid=os.getpid(), uptime_s=time.monotonic() - started)
                if isinstance(message, Ping)
                else Ack()
            )
            control.reply(incoming.peer, incoming.envelope.request_id, codec.encode(reply))
        if isinstance(message, Shutdown):
            host.stop()


async def _stop_when_parent_dies(host: ActorHost, plan: ChildPlan) -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    while parent.is_alive():
        await anyio.sleep(0.5)
    get_logger("host", group=plan.group).warning("parent process is gone; stopping")
    host.stop()
    # The parent can no longer clean up; the system is over, so its socket files can go.
    if plan.transport == "ipc":
        IpcDirectory(plan.system_id).remove()


async def _stop_on_sigterm(host: ActorHost) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            host.stop()
            return
