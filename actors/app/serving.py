"""The serving engine: config -> actor specs -> a running `ServingEngine`.

`ServingEngine` runs the core actors plus an in-process frontend in one `ActorSystem`
(placement by config, `actors.app.specs`) and exposes its `EngineClient`, KV and scheduler
stats. `generate_offline` is the batch API: prompts in, results out.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from actors.app.config import EngineConfig
from actors.app.specs import engine_specs
from actors.frontends.base import EngineClient, FrontendActor, GenerationResult
from actors.runtime import ActorSpec, ActorSystem
from actors.runtime.logging import get_logger
from transport.channel import ChannelClosed
from transport.messages.alloc import KvStats, KvStatsRequest
from transport.messages.control import StatsReply, StatsRequest
from transport.messages.engine import (
    EndStreams,
    GenerationParams,
    SchedulerStats,
    SchedulerStatsRequest,
    StopAccepting,
)
from transport.messages.sessions import PersistSessions, SessionsPersisted

_log = get_logger("serve")


_SERVING_FRONTENDS = ("gateway", "zmq_endpoint")


class ServingEngine:
    """`async with ServingEngine(cfg) as eng:` -> every actor running; `eng.client` serves."""

    def __init__(
        self, cfg: EngineConfig | None = None, extra_specs: Sequence[ActorSpec] = ()
    ) -> None:
        self.cfg = cfg or EngineConfig.load()
        self.frontend = FrontendActor()
        specs = engine_specs(self.cfg, self.frontend) + list(extra_specs)
        self.system = ActorSystem(
            specs,
            transport=self.cfg.engine.transport,
            local_groups={"main"},
            start_timeout_s=600.0,
            call_timeout_s=600.0,
        )
        self.client: EngineClient | None = None

    async def __aenter__(self) -> ServingEngine:
        await self.system.__aenter__()
        self.client = self.frontend.client
        return self

    async def __aexit__(self, *exc) -> None:
        await self.system.__aexit__(*exc)

    async def kv_stats(self, check_invariants: bool = False) -> KvStats:
        return await self.system.ref("allocator").call(
            KvStatsRequest(check_invariants=check_invariants), expect=KvStats
        )

    async def scheduler_stats(self) -> SchedulerStats:
        return await self.system.ref("scheduler").call(
            SchedulerStatsRequest(), expect=SchedulerStats
        )

    async def actor_stats(self, name: str) -> dict:
        """An actor's counters (its mailbox's and the actor's own `stats()`)."""
        reply = await self.system.ref(name).call(StatsRequest(), expect=StatsReply)
        return dict(reply.values)

    @property
    def frontend_names(self) -> list[str]:
        """The actors clients reach the engine through (each a `FrontendActor`)."""
        return [s.name for s in self.system.specs if s.name in ("frontend", *_SERVING_FRONTENDS)]

    async def drain(self, grace_s: float) -> int:
        """Stop taking requests, let the open ones finish for up to `grace_s`, then end the
        rest with an error their clients see; how many were ended that way."""
        names = self.frontend_names
        for name in names:
            await self.system.ref(name).send(StopAccepting())
        open_streams = await self._open_streams(names)
        _log.info("draining", open_streams=open_streams, grace_s=grace_s)
        with anyio.move_on_after(grace_s):
            while open_streams:
                await anyio.sleep(0.1)
                open_streams = await self._open_streams(names)
        if open_streams:
            for name in names:
                await self.system.ref(name).send(
                    EndStreams(reason="the server shut down before this request finished")
                )
            await anyio.sleep(0.5)  # the frontends write those errors out
        _log.info("drained", ended_with_error=open_streams)
        await self._persist_sessions()
        return open_streams

    async def _persist_sessions(self) -> None:
        """With a disk tier (kv.store_dir), the idle sessions' KV goes to files the next
        start on the same folder takes back."""
        if "sessions" not in {s.name for s in self.system.specs}:
            return
        try:
            reply = await self.system.ref("sessions").call(
                PersistSessions(), expect=SessionsPersisted, timeout=300.0
            )
        except Exception as exc:  # a drain goes on: those sessions prefill after the restart
            _log.error("sessions not persisted", error=f"{type(exc).__name__}: {exc}")
            return
        if reply.persisted:
            _log.info("sessions persisted", sessions=reply.persisted)

    async def _open_streams(self, names: list[str]) -> int:
        total = 0
        for name in names:
            try:
                reply = await self.system.ref(name).call(
                    StatsRequest(), expect=StatsReply, timeout=2.0
                )
            except (TimeoutError, ChannelClosed):
                continue
            total += int(reply.values.get("open_streams", 0))
        return total

    async def generate_batch(
        self,
        prompts: list[str] | list[list[int]],
        params: GenerationParams | list[GenerationParams],
    ) -> list[GenerationResult]:
        """Submit every prompt at once; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results: list[GenerationResult | None] = [None] * len(prompts)

        async def one(i: int) -> None:
            p = prompts[i]
            kw = {"prompt": p} if isinstance(p, str) else {"prompt_ids": list(p)}
            results[i] = await self.client.complete(plist[i], **kw)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return results


def generate_offline(
    prompts: list[str] | list[list[int]],
    params: GenerationParams | list[GenerationParams] | None = None,
    config: EngineConfig | None = None,
) -> list[GenerationResult]:
    """Blocking batch generation: start an engine, run every prompt, stop the engine."""

    async def main() -> list[GenerationResult]:
        async with ServingEngine(config) as eng:
            return await eng.generate_batch(prompts, params or GenerationParams())

    return anyio.run(main)
