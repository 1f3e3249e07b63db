"""The scheduler with the real allocator and radix actors, and a fake model runner.

Fast, model-free checks of scheduling: every forward batch is verified by the
fake runner against a shadow KV store (rows must point at slots holding the
request's own tokens), outputs must not depend on pool size (retraction and
eviction are invisible), chunked prefill respects the chunk size, aborts land
at any stage, LPM orders by cached prefix, and the invariant checker runs
inside the allocator after every message.
"""

from __future__ import annotations

import random

import anyio
import pytest

from actors.runtime import ActorSpec, ActorSystem
from actors.scheduler.actor import SchedulerActor
from tests.actors.fake_engine_actors import FakeRunner, SinkTokenizer
from transport.messages.alloc import KvStats, KvStatsRequest
from transport.messages.control import StatsReply, StatsRequest
from transport.messages.engine import (
    EndRequests,
    GenerationParams,
    NewRequest,
    SchedulerStats,
    SchedulerStatsRequest,
    SubmitRequests,
)

EOS = 5


class Harness:
    def __init__(self, num_pages, page_size, rows=32, capacity=256, alloc=None, **sched):
        self.runner = FakeRunner((num_pages + 1) * page_size, rows, capacity, page_size)
        self.sink = SinkTokenizer()
        kv = dict(num_pages=num_pages, page_size=page_size, max_rows=rows, row_capacity=capacity)
        sched_kw = dict(page_size=page_size, row_capacity=capacity, max_running_requests=rows)
        sched_kw.update(sched)
        self.specs = [
            ActorSpec("radix", "actors.radix_cache:RadixCacheActor", {"page_size": page_size}),
            ActorSpec(
                "allocator",
                "actors.allocator.actor:AllocatorActor",
                {**kv, "debug_checks": True, **(alloc or {})},
            ),
            ActorSpec("scheduler", "actors.scheduler.actor:SchedulerActor", sched_kw),
            ActorSpec("runner", lambda: self.runner),
            ActorSpec("tokenizer", lambda: self.sink),
        ]

    async def __aenter__(self):
        self.engine = ActorSystem(self.specs, transport="inproc")
        await self.engine.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self.engine.__aexit__(*exc)

    async def submit(self, prompts: dict[int, list[int]], params: GenerationParams, eos=(EOS,)):
        self.runner.prompts.update(prompts)
        reqs = [
            NewRequest(rid=r, prompt_ids=p, params=params, eos_ids=list(eos))
            for r, p in prompts.items()
        ]
        await self.engine.ref("scheduler").send(SubmitRequests(reqs=reqs))

    async def end(self, rids, reason="abort"):
        # A call: it returns once the scheduler has taken the end (then a test may go on).
        await self.engine.ref("scheduler").call(EndRequests(rids=rids, reason=reason))

    async def wait_done(self, rids, timeout=60):
        with anyio.fail_after(timeout):
            while not all(r in self.sink.finish for r in rids):
                await anyio.sleep(0.01)

    async def stats(self):
        s = await self.engine.ref("scheduler").call(SchedulerStatsRequest(), expect=SchedulerStats)
        kv = await self.engine.ref("allocator").call(
            KvStatsRequest(check_invariants=True), expect=KvStats
        )
        return s, kv

    async def assert_idle_balanced(self):
        with anyio.fail_after(10):
            while True:
                s, kv = await self.stats()
                if s.waiting == s.running == s.prefilling == 0:
                    break
                await anyio.sleep(0.01)
        assert kv.records == 0 and kv.held_pages == 0 and kv.held_rows == 0, kv
        assert kv.free_pages + kv.tree_pages == kv.total_pages
        assert kv.evictable_pages == kv.tree_pages
        return s, kv


def make_prompts(n, seed, shared=40):
    rng = random.Random(seed)
    base = [rng.randrange(100, 1000) for _ in range(shared)]
    return {
        i + 1: base[: rng.randrange(0, shared)]
        + [rng.randrange(100, 1000) for _ in range(rng.randrange(1, 30))]
        for i in range(n)
    }


def run(coro_fn, *args):
    return anyio.run(coro_fn, *args)


@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_do_not_depend_on_pool_size(page_size):
    prompts = make_prompts(40, seed=page_size)
    params = GenerationParams(max_tokens=16, ignore_eos=True)

    async def go(num_pages):
        async with Harness(
            num_pages,
            page_size,
            chunk_size=16,
            max_batch_tokens=64,
            new_token_ratio=0.0,
            min_new_token_ratio=0.0,
        ) as h:
            await h.submit(prompts, params)
            await h.wait_done(prompts)
            s, kv = await h.assert_idle_balanced()
            return dict(h.sink.outputs), s, kv

    roomy, s1, _ = run(go, 4000 // page_size)
    tight, s2, kv2 = run(go, 160 // page_size)
    assert s1.retractions == 0
    assert s2.retractions > 0 and kv2.evicted_pages > 0
    assert tight == roomy
    assert all(len(v) == 16 for v in roomy.values())


def test_chunked_prefill_respects_chunk_and_budget():
    prompts = {1: list(range(100, 300)), 2: list(range(300, 420))}

    async def go():
        async with Harness(400, 4, chunk_size=32, max_batch_tokens=48) as h:
            await h.submit(prompts, GenerationParams(max_tokens=4, ignore_eos=True))
            await h.wait_done(prompts)
            await h.assert_idle_balanced()
            for b in h.runner.batches:
                assert sum(b.extend_lens) <= 48
                assert max(b.extend_lens) <= 32
            return h.sink.outputs

    out = run(go)
    assert [len(v) for v in out.values()] == [4, 4]


def test_eos_min_tokens_and_stop_ids():
    async def go():
        async with Harness(200, 1) as h:
            p = {1: [10, 11, 12]}
            await h.submit(p, GenerationParams(max_tokens=30, ignore_eos=True))
            await h.wait_done(p)
            seq = h.sink.outputs[1]
            # The 4th token becomes a stop id: output ends right there, finish "stop".
            await h.submit(
                {2: [10, 11, 12]}, GenerationParams(max_tokens=30, stop_token_ids=[seq[3]])
            )
            # With min_tokens past it, the stop id is ignored until then.
            await h.submit(
                {3: [10, 11, 12]},
                GenerationParams(max_tokens=30, min_tokens=6, stop_token_ids=[seq[3]]),
            )
            # The model's EOS id stops unless ignore_eos.
            await h.submit({4: [10, 11, 12]}, GenerationParams(max_tokens=30), eos=(seq[1],))
            await h.wait_done([2, 3, 4])
            await h.assert_idle_balanced()
            return seq, h.sink

    seq, sink = run(go)
    assert sink.outputs[2] == seq[:4] and sink.finish[2] == "stop"
    assert sink.outputs[3] == seq[:30] and sink.finish[3] == "length"  # seq[3] not seen again
    assert sink.outputs[4] == seq[:2] and sink.finish[4] == "stop"


def test_abort_waiting_prefilling_and_decoding():
    async def go():
        async with Harness(300, 4, chunk_size=8, max_batch_tokens=12, max_running_requests=2) as h:
            long = {1: list(range(100, 260))}  # 20 chunks of 8
            await h.submit(long, GenerationParams(max_tokens=50, ignore_eos=True))
            dec = {2: [7, 8, 9]}
            await h.submit(dec, GenerationParams(max_tokens=200, ignore_eos=True))
            waiting = {3: [1, 2, 3], 4: [4, 5, 6]}
            await h.submit(waiting, GenerationParams(max_tokens=5, ignore_eos=True))
            await anyio.sleep(0.05)
            s, _ = await h.stats()
            assert s.prefilling + s.running >= 1 and s.waiting >= 1
            await h.end([1, 3])  # mid prefill, and waiting
            with anyio.fail_after(10):
                while len(h.sink.outputs.get(2, [])) < 5:
                    await anyio.sleep(0.01)
            await h.end([2])  # decoding
            await h.wait_done([1, 2, 3, 4])
            s, kv = await h.assert_idle_balanced()
            assert kv.aborted >= 2
            return h.sink

    sink = run(go)
    assert sink.finish[1] == sink.finish[2] == sink.finish[3] == "abort"
    assert sink.finish[4] == "length" and len(sink.outputs[4]) == 5
    assert sink.outputs.get(3, []) == []


def test_lpm_prefers_cached_prefixes():
    shared = list(range(500, 564))

    async def go():
        async with Harness(400, 4, policy="lpm", max_running_requests=1, max_batch_tokens=256) as h:
            await h.submit({1: shared + [1]}, GenerationParams(max_tokens=2, ignore_eos=True))
            await h.wait_done([1])
            # Occupy the only running slot, then queue a cold and a warm request.
            await h.submit({2: [9] * 10}, GenerationParams(max_tokens=30, ignore_eos=True))
            await anyio.sleep(0.02)
            # One message: both wait together (cold first), however soon request 2 ends.
            await h.submit(
                {3: [7, 7, 7, 7, 7, 7], 4: shared + [2]},
                GenerationParams(max_tokens=2, ignore_eos=True),
            )
            await h.wait_done([2, 3, 4])
            await h.assert_idle_balanced()
            first_seen = {
                r: next(i for i, b in enumerate(h.runner.batches) if r in b.rids) for r in (3, 4)
            }
            return first_seen, h.sink

    first_seen, sink = run(go)
    assert first_seen[4] < first_seen[3]
    assert sink.cached[4] == 64


def test_pure_decode_steps_cost_three_messages_at_any_batch_size():
    async def go(n):
        async with Harness(400, 4) as h:
            prompts = {i + 1: [10 + i, 11, 12] for i in range(n)}
            await h.submit(prompts, GenerationParams(max_tokens=20, ignore_eos=True))
            await h.wait_done(prompts)
            s, _ = await h.assert_idle_balanced()
            runner_calls = len(h.runner.batches)
            return s, runner_calls, h.sink.batches

    for n in (1, 16):
        s, runner_calls, token_batches = run(go, n)
        assert s.pure_decode_steps >= 10
        assert s.pure_decode_messages == 3 * s.pure_decode_steps
        assert runner_calls == s.steps  # one forward message per step
        assert token_batches == s.steps  # one token report per step


class _SendOrderScheduler(SchedulerActor):
    """The real scheduler, noting the order in which it hands forwards to the runner and
    token reports to the tokenizer."""

    def __init__(self, log: list[str], **kw) -> None:
        super().__init__(**kw)
        self.order = log

    async def on_start(self) -> None:
        await super().on_start()
        call, send = self.runner.call, self.tokenizer.send

        async def forward(msg, **kw):
            self.order.append("forward")
            return await call(msg, **kw)

        async def report(msg, **kw):
            self.order.append("report")
            return await send(msg, **kw)

        self.runner.call, self.tokenizer.send = forward, report


def test_a_steps_token_report_follows_the_next_forward():
    """Detokenizing and streaming step N's tokens overlaps the runner's step N + 1: the
    report goes out once the next forward is on its way, and the last one when the loop
    has no forward left."""
    order: list[str] = []

    async def go():
        h = Harness(400, 4)
        kw = dict(page_size=4, row_capacity=256, max_running_requests=32)
        h.specs[2] = ActorSpec("scheduler", lambda: _SendOrderScheduler(order, **kw))
        async with h:
            prompts = {1: [10, 11, 12], 2: [13, 14]}
            await h.submit(prompts, GenerationParams(max_tokens=6, ignore_eos=True))
            await h.wait_done(prompts)
            await h.assert_idle_balanced()
            return dict(h.sink.outputs), len(h.runner.batches)

    outputs, forwards = run(go)
    assert all(len(t) == 6 for t in outputs.values())
    assert order.count("forward") == forwards and order.count("report") == forwards
    # F F R F R ... F R R: report j (of step j) after forward j + 1, the last at idle
    for j in range(1, forwards):
        position = [i for i, what in enumerate(order) if what == "report"][j - 1]
        assert order[:position].count("forward") == j + 1, order
    assert order[-2:] == ["report", "report"]


# ---- KV ownership holes (each of these failed before the fix it names) ----------------------


def test_abort_frees_before_the_step_allocates_so_the_waiting_request_runs():
    """40 pages of 4 slots: a 120-token request decodes, a 60-token one waits for room. The
    first is aborted mid-decode: its pages must be back before the step admits, so the second
    runs to its max_tokens (it used to end `length` with 0 tokens, and leave a record)."""

    async def go():
        async with Harness(40, 4, capacity=256, chunk_size=256, max_batch_tokens=512) as h:
            h.runner.hold_at_step = 4
            await h.submit(
                {1: list(range(100, 220))}, GenerationParams(max_tokens=100, ignore_eos=True)
            )
            with anyio.fail_after(10):
                while not h.runner.batches:
                    await anyio.sleep(0.005)
            await h.submit(
                {2: list(range(300, 360))}, GenerationParams(max_tokens=4, ignore_eos=True)
            )
            with anyio.fail_after(10):
                await h.runner.held.wait()
            s, _ = await h.stats()
            assert s.waiting == 1 and s.running == 1  # 2 waits: the pool cannot hold both
            await h.end([1])
            h.runner.release.set()
            await h.wait_done([1, 2])
            _, kv = await h.assert_idle_balanced()
            return h.sink, kv

    sink, kv = run(go)
    assert sink.finish[1] == "abort"
    assert sink.finish[2] == "length" and len(sink.outputs[2]) == 4
    assert kv.records == 0


def test_abort_during_the_forward_that_fills_the_pool_does_not_cut_the_survivor():
    """page_size 1, 60 pages, two 20-token prompts with max_tokens 20: the forward of step 11
    fills the pool; one request is aborted during it. The survivor must decode to 20 tokens
    with no retraction (it used to be cut at 11 tokens, `length`)."""

    async def go():
        async with Harness(60, 1, capacity=64, new_token_ratio=0.0, min_new_token_ratio=0.0) as h:
            h.runner.hold_at_step = 11
            await h.submit(
                {1: list(range(100, 120)), 2: list(range(200, 220))},
                GenerationParams(max_tokens=20, ignore_eos=True),
            )
            with anyio.fail_after(10):
                await h.runner.held.wait()
            _, kv = await h.stats()
            assert kv.free_pages == 0  # this forward's slots fill the pool
            await h.end([1])
            h.runner.release.set()
            await h.wait_done([1, 2])
            s, _ = await h.assert_idle_balanced()
            return h.sink, s

    sink, s = run(go)
    assert sink.finish[1] == "abort"
    assert sink.finish[2] == "length" and len(sink.outputs[2]) == 20
    assert s.retractions == 0


def test_a_refused_admission_leaves_the_prefix_cache_alone():
    """A request too large for the whole pool is refused (and cut); the cached prefix of an
    earlier request must survive it (refusal used to evict the tree first)."""
    shared = list(range(500, 532))  # 32 tokens = 8 pages

    async def go():
        async with Harness(40, 4, capacity=256, chunk_size=256, max_batch_tokens=512) as h:
            await h.submit(
                {1: shared + [1, 2, 3, 4]}, GenerationParams(max_tokens=2, ignore_eos=True)
            )
            await h.wait_done([1])
            _, before = await h.stats()
            await h.submit({2: list(range(1000, 1200))}, GenerationParams(max_tokens=2))
            await h.wait_done([2])
            _, after = await h.stats()
            await h.submit({3: shared + [9, 9]}, GenerationParams(max_tokens=2, ignore_eos=True))
            await h.wait_done([3])
            await h.assert_idle_balanced()
            return h.sink, before, after

    sink, before, after = run(go)
    assert sink.finish[2] == "error" and sink.outputs.get(2, []) == []  # cannot ever fit
    assert after.tree_pages == before.tree_pages and after.evicted_pages == 0
    assert sink.cached[3] == 32


def test_duplicate_request_ids_are_refused_and_change_nothing():
    async def go():
        async with Harness(200, 4) as h:
            params = GenerationParams(max_tokens=30, ignore_eos=True)
            await h.submit({1: [10, 11, 12]}, params)
            with anyio.fail_after(10):
                while len(h.sink.outputs.get(1, [])) < 3:
                    await anyio.sleep(0.005)
            # The same id again (sent directly: the fake runner keeps the first one's prompt).
            again = NewRequest(rid=1, prompt_ids=[40, 41, 42, 43], params=params, eos_ids=[])
            await h.engine.ref("scheduler").send(SubmitRequests(reqs=[again]))
            twice = [NewRequest(rid=7, prompt_ids=[5, 6], params=params, eos_ids=[])] * 2
            await h.engine.ref("scheduler").send(SubmitRequests(reqs=twice))  # twice in one
            await h.wait_done([1])
            await anyio.sleep(0.05)
            s, _ = await h.assert_idle_balanced()
            health = await h.engine.health()
            return h.sink, s, health

    sink, s, health = run(go)
    assert all(hh.up for hh in health.values())
    assert sink.finish[1] == "length" and len(sink.outputs[1]) == 30
    assert sink.outputs[1] == FakeRunnerOutputs.expected([10, 11, 12], 30)
    assert 7 not in sink.finish  # the whole message was refused


class FakeRunnerOutputs:
    @staticmethod
    def expected(prompt: list[int], n: int) -> list[int]:
        from tests.actors.fake_engine_actors import next_token

        toks = list(prompt)
        out = []
        for _ in range(n):
            out.append(next_token(toks))
            toks.append(out[-1])
        return out


def test_runner_crash_ends_requests_with_an_error_and_the_restarted_runner_serves():
    """A runner that crashes mid-step (policy restart): every request, running or queued,
    ends with finish reason "error"; their KV and the whole prefix tree go back; the
    restarted runner then serves new requests, and the pool balances."""
    params = GenerationParams(max_tokens=12, ignore_eos=True)

    async def go():
        h = Harness(64, 4, rows=8, capacity=128, max_running_requests=4)
        h.specs[-2] = ActorSpec(
            "runner",
            lambda: h.runner,
            on_crash="restart",
            restart_backoff_s=0.0,
            crash_watchers=("scheduler",),
        )
        async with h:
            h.runner.crash_at_step = 4
            first = make_prompts(8, seed=11)  # 4 running, 4 queued when it crashes
            await h.submit(first, params)
            await h.wait_done(list(first))
            assert {h.sink.finish[r] for r in first} == {"error"}
            s, kv = await h.assert_idle_balanced()
            assert kv.tree_pages == 0  # the cached prefixes named lost KV: dropped
            assert h.runner.starts == 2
            stats = await h.engine.ref("scheduler").call(StatsRequest(), expect=StatsReply)
            assert stats.values["runner_failures"] == 1
            later = {100 + r: p for r, p in make_prompts(6, seed=12).items()}
            await h.submit(later, params)
            await h.wait_done(list(later))
            assert {h.sink.finish[r] for r in later} == {"length"}
            assert all(len(h.sink.outputs[r]) == 12 for r in later)
            await h.assert_idle_balanced()

    run(go)


def test_runner_crash_with_shutdown_policy_stops_the_system():
    params = GenerationParams(max_tokens=12, ignore_eos=True)

    async def go():
        h = Harness(64, 4, rows=8, capacity=128, max_running_requests=4)
        h.specs[-2] = ActorSpec("runner", lambda: h.runner, crash_watchers=("scheduler",))
        async with h:
            h.runner.crash_at_step = 2
            await h.submit(make_prompts(3, seed=13), params)
            with anyio.fail_after(10):
                crash = await h.engine.wait_stopped()
            assert crash is not None and crash.name == "runner"

    run(go)
