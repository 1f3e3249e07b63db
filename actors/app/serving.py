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
from transport.messages.alloc import KvStats, KvStatsRequest
from transport.messages.engine import GenerationParams, SchedulerStats, SchedulerStatsRequest


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
