"""A runner step that fails fails its own requests, never the engine (issue 26, item 6).

The real scheduler, allocator and radix actors with a fake runner (no model): a step that
raises in the runner (as an out-of-memory would, or a batch it cannot decode) ends exactly
that step's requests with finish reason "error", their KV goes back through the allocator's
abort path, and every other request (queued then, or submitted later) finishes normally with
the tokens it would have had anyway; the allocator's idle check is clean after. A request
the runner reports as failed (`failed_rids`: its grammar is not loaded) ends alone.
"""

from __future__ import annotations

import anyio

from actors.runtime import ActorSpec
from tests.actors.fake_engine_actors import FakeRunner
from tests.actors.test_scheduler_actors import FakeRunnerOutputs, Harness, run
from transport.messages.alloc import IdleCheck, IdleCheckReply
from transport.messages.control import StatsReply, StatsRequest
from transport.messages.engine import GenerationParams
from transport.messages.runner import ForwardBatchMsg, StepResultMsg


class RaisingRunner(FakeRunner):
    """Raises inside the step whose batch holds a poisoned request (once per request), before
    applying anything of it, as an out-of-memory in the forward would."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.poison: set[int] = set()
        self.raised = 0

    async def handle(self, msg: ForwardBatchMsg, sender):
        hit = self.poison & set(msg.rids)
        if hit:
            self.poison -= hit
            self.raised += 1
            raise RuntimeError("injected: CUDA out of memory")
        return await super().handle(msg, sender)


class RefusingRunner(FakeRunner):
    """Serves every step but cannot register the poisoned requests (as a runner that does not
    hold their grammar): they come back in `failed_rids`, with nothing sampled."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.poison: set[int] = set()

    async def handle(self, msg: ForwardBatchMsg, sender):
        result = await super().handle(msg, sender)
        failed = [r.rid for r in msg.new_reqs if r.rid in self.poison]
        if not failed:
            return result
        keep = [i for i, rid in enumerate(result.rids) if rid not in failed]
        return StepResultMsg(
            step=result.step,
            rids=[result.rids[i] for i in keep],
            tokens=[result.tokens[i] for i in keep],
            failed_rids=failed,
            failure="grammar not loaded",
        )


def _harness(runner_cls, **sched) -> Harness:
    h = Harness(64, 4, rows=8, capacity=128, **sched)
    h.runner = runner_cls((64 + 1) * 4, 8, 128, 4)
    # Restart policy as in the issue: it must not matter (nothing crashes here).
    h.specs[3] = ActorSpec(
        "runner",
        lambda: h.runner,
        on_crash="restart",
        restart_backoff_s=0.0,
        crash_watchers=("scheduler",),
    )
    return h


async def _engine_is_whole(h: Harness) -> None:
    await h.assert_idle_balanced()
    reply = await h.engine.ref("allocator").call(IdleCheck(), expect=IdleCheckReply)
    assert reply.problems == []
    health = await h.engine.health()
    assert all(x.up for x in health.values()), health


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on():
    params = GenerationParams(max_tokens=12, ignore_eos=True)

    async def go():
        h = _harness(RaisingRunner, max_running_requests=2)
        async with h:
            runner: RaisingRunner = h.runner
            await h.submit({1: [10, 11, 12]}, params)
            with anyio.fail_after(10):
                while len(h.sink.outputs.get(1, [])) < 2:
                    await anyio.sleep(0.005)
            # 2 joins 1 in the next step, which raises; 3 and 4 wait for a slot meanwhile.
            runner.poison = {2}
            await h.submit({2: [20, 21, 22, 23, 24]}, params)
            await h.submit({3: [30, 31], 4: [40, 41, 42]}, params)
            await h.wait_done([1, 2, 3, 4])
            assert runner.raised == 1
            assert h.sink.finish[1] == h.sink.finish[2] == "error"
            for rid, prompt in ((3, [30, 31]), (4, [40, 41, 42])):
                assert h.sink.finish[rid] == "length"
                assert h.sink.outputs[rid] == FakeRunnerOutputs.expected(prompt, 12)
            await _engine_is_whole(h)
            # Later requests are served as if nothing happened.
            await h.submit({5: [50, 51, 52]}, params)
            await h.wait_done([5])
            assert h.sink.outputs[5] == FakeRunnerOutputs.expected([50, 51, 52], 12)
            await _engine_is_whole(h)
            stats = await h.engine.ref("scheduler").call(StatsRequest(), expect=StatsReply)
            assert stats.values["runner_failures"] == 1
            assert runner.starts == 1  # the runner never crashed either

    run(go)


def test_a_request_the_runner_cannot_register_ends_alone():
    params = GenerationParams(max_tokens=10, ignore_eos=True)

    async def go():
        h = _harness(RefusingRunner, max_running_requests=4)
        async with h:
            runner: RefusingRunner = h.runner
            await h.submit({1: [10, 11, 12]}, params)
            with anyio.fail_after(10):
                while len(h.sink.outputs.get(1, [])) < 2:
                    await anyio.sleep(0.005)
            runner.poison = {2}
            await h.submit({2: [20, 21, 22], 3: [30, 31, 32]}, params)
            await h.wait_done([1, 2, 3])
            assert h.sink.finish[2] == "error" and h.sink.outputs.get(2, []) == []
            for rid, prompt in ((1, [10, 11, 12]), (3, [30, 31, 32])):
                assert h.sink.finish[rid] == "length"
                assert h.sink.outputs[rid] == FakeRunnerOutputs.expected(prompt, 10)
            await _engine_is_whole(h)
            # Its sampler state is dropped at the runner with the next batch.
            await h.submit({4: [40, 41]}, params)
            await h.wait_done([4])
            assert any(2 in b.finished_rids for b in runner.batches)
            await _engine_is_whole(h)

    run(go)
