"""One client's request never stalls, strands or starves the others at the tokenizer
(issue 26, items 7, 8 and 9), with the real tokenizer actor and stand-ins for the rest:

- a submit the scheduler does not take is an error to the client, and frees everything the
  request held (its in-flight slot, its session turn): nothing is accepted and then lost;
- a grammar compiles beside the mailbox: other requests are answered meanwhile; a compile
  is bounded in time and in bytes (a 400 naming the limit);
- grammars travel by key: the runner gets one once (acknowledged), requests name it;
- the real runner keeps grammars by key and refuses a request whose key it does not hold;
- /tokenize is bounded like a prompt and returns the token strings in the same call.
"""

from __future__ import annotations

import time

import anyio
import pytest

from actors.runtime import Actor, ActorSpec, ActorSystem, RemoteError
from actors.tokenizer.validation import ERR_CONTEXT_LENGTH, ERR_INVALID_REQUEST, ERR_UNAVAILABLE
from tests.actors.probe_actors import ProbeActor
from transport.messages.control import StatsReply, StatsRequest
from transport.messages.engine import (
    Accepted,
    EndRequests,
    GenerateRequest,
    GenerationParams,
    SubmitRequests,
    TokenizeReply,
    TokenizeRequest,
)
from transport.messages.params import OutputConstraint
from transport.messages.runner import GrammarLoaded, LoadGrammar, RunnerRequest
from transport.messages.sessions import BeginTurn, BeginTurnReply, EndTurn

pytestmark = [pytest.mark.model]

# Compiles for seconds (about 7 s here) into about 70 MiB: ten bounded repetitions of
# overlapping character classes.
SLOW_REGEX = (
    "[b-j]{1,50}[g-t]{1,50}[a-q]{1,50}[d-z]{1,50}[c-k]{1,50}"
    "[h-w]{1,50}[b-r]{1,50}[e-y]{1,50}[a-m]{1,50}[f-u]{1,50}"
)
BIG_REGEX = "[a-z]{1000}"  # compiles in about a second into about 9 MiB
CHOICE = OutputConstraint(kind="choice", choices=["yes", "no"])


class TakingScheduler(Actor):
    inbox = SubmitRequests | EndRequests

    def __init__(self) -> None:
        self.submitted = []
        self.ended: list[int] = []

    async def handle(self, msg, sender):
        if isinstance(msg, SubmitRequests):
            self.submitted.extend(msg.reqs)
        else:
            self.ended.extend(msg.rids)
        return None


class KeyRunner(Actor):
    """Holds grammars by key, as the runner does (records what it was sent)."""

    inbox = LoadGrammar

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.loads: list[str] = []

    async def handle(self, msg: LoadGrammar, sender):
        if msg.data:
            self.held[msg.key] = len(msg.data)
            self.loads.append(msg.key)
        return GrammarLoaded(key=msg.key, present=msg.key in self.held)


class FakeSessions(Actor):
    inbox = BeginTurn | EndTurn

    def __init__(self) -> None:
        self.busy: set[str] = set()

    async def handle(self, msg, sender):
        if isinstance(msg, BeginTurn):
            if msg.session_id in self.busy:
                return BeginTurnReply(ok=False, code="session_busy", message="busy")
            self.busy.add(msg.session_id)
            return BeginTurnReply(ok=True, max_new_tokens=msg.max_new_tokens)
        self.busy.discard(msg.session_id)
        return None


def _system(scheduler, runner=None, sessions=None, **tok) -> ActorSystem:
    specs = [
        ActorSpec(
            "tokenizer",
            "actors.tokenizer.actor:TokenizerActor",
            dict(context_len=512, **tok),
        ),
        ActorSpec("scheduler", scheduler),
    ]
    if runner is not None:
        specs.append(ActorSpec("runner", lambda: runner))
    if sessions is not None:
        specs.append(ActorSpec("sessions", lambda: sessions))
    return ActorSystem(specs, transport="inproc", start_timeout_s=120)


def _request(rid: str, constraint: OutputConstraint | None = None, **kw) -> GenerateRequest:
    params = GenerationParams(max_tokens=8, constraint=constraint)
    return GenerateRequest(client_rid=rid, reply_to="nobody", params=params, prompt="Hi", **kw)


async def _live_streams(system: ActorSystem) -> int:
    stats = await system.ref("tokenizer").call(StatsRequest(), expect=StatsReply)
    return int(stats.values["live_streams"])


def test_a_submit_the_scheduler_does_not_take_is_an_error_and_frees_its_slot():
    """The scheduler cannot decode the submit (as an oversized one): the client hears it,
    and neither its in-flight slot nor its session turn stays taken."""
    sessions = FakeSessions()

    async def go():
        # A probe cannot decode SubmitRequests: it drops what was sent, refuses what is called.
        async with _system(ProbeActor, sessions=sessions, max_in_flight=2) as system:
            tok = system.ref("tokenizer")
            for i in range(4):  # more than max_in_flight: no slot may leak
                with pytest.raises(RemoteError) as err:
                    await tok.call(_request(f"c{i}", session_id="s1"), expect=Accepted)
                assert err.value.reply.code == ERR_UNAVAILABLE, err.value.reply
                assert "scheduler did not take" in err.value.reply.message
            assert await _live_streams(system) == 0
            with anyio.fail_after(5):
                while sessions.busy:  # the turn is over, the session free again
                    await anyio.sleep(0.01)

    anyio.run(go)


def test_grammars_compile_beside_the_mailbox_bounded_in_time_and_size():
    scheduler, runner = TakingScheduler(), KeyRunner()

    async def go():
        async with _system(
            lambda: scheduler, runner, grammar_compile_timeout_s=0.5, grammar_max_bytes=4 << 20
        ) as system:
            tok = system.ref("tokenizer")
            # Warm the grammar engine (its first build is not a compile's time).
            await tok.call(_request("warm", CHOICE), expect=Accepted, timeout=120)

            slow_refusal: list[RemoteError] = []

            async def slow() -> None:
                with pytest.raises(RemoteError) as err:
                    await tok.call(_request("slow", OutputConstraint("regex", SLOW_REGEX)))
                slow_refusal.append(err.value)

            async with anyio.create_task_group() as tg:
                tg.start_soon(slow)
                await anyio.sleep(0.2)  # the compile runs now
                t0 = time.monotonic()
                await tok.call(_request("free"), expect=Accepted)
                await tok.call(TokenizeRequest(prompt="hello"), expect=TokenizeReply)
                assert time.monotonic() - t0 < 0.5  # not stuck behind the compile
            reply = slow_refusal[0].reply
            assert reply.code == ERR_INVALID_REQUEST
            assert "did not compile within 0.5 s" in reply.message
            assert "grammar_compile_timeout_s" in reply.message
            assert await _live_streams(system) == 2  # warm and free: nothing else was taken

        # The size limit, with time enough for any machine to finish the compile.
        async with _system(
            lambda: scheduler, runner, grammar_compile_timeout_s=120.0, grammar_max_bytes=4 << 20
        ) as system:
            tok = system.ref("tokenizer")
            with pytest.raises(RemoteError) as err:
                await tok.call(_request("big", OutputConstraint("regex", BIG_REGEX)), timeout=180)
            assert err.value.reply.code == ERR_INVALID_REQUEST
            assert "grammar_max_bytes" in err.value.reply.message
            assert err.value.reply.message.startswith("constraint: the compiled grammar is")
            assert await _live_streams(system) == 0

    anyio.run(go)


def test_grammars_travel_by_key_once():
    scheduler, runner = TakingScheduler(), KeyRunner()
    regex = OutputConstraint("regex", "(a|b|c)[a-z0-9]{20}")

    async def go():
        async with _system(lambda: scheduler, runner) as system:
            tok = system.ref("tokenizer")
            async with anyio.create_task_group() as tg:
                for i in range(4):  # at once: one compile, one load
                    tg.start_soon(lambda i=i: tok.call(_request(f"r{i}", regex), timeout=120))
            await tok.call(_request("again", regex), expect=Accepted)
            keys = {r.grammar_key for r in scheduler.submitted}
            assert len(scheduler.submitted) == 5 and len(keys) == 1 and "" not in keys
            assert runner.loads == list(keys)  # sent once, by its own message
            assert max(len(r.prompt_ids) for r in scheduler.submitted) < 10

    anyio.run(go)


def test_the_runner_keeps_grammars_by_key_and_refuses_a_missing_one():
    from actors.model_runner import ModelRunnerActor, RegisterFailed
    from kernels.grammar import GrammarEngine, constraint_key
    from kernels.tokenizer_loader import load_tokenizer

    class NoModel(ModelRunnerActor):
        async def on_start(self) -> None:  # grammars only: no weights
            pass

    runner = NoModel(num_pages=4, page_size=16, max_rows=2, row_capacity=64, device="cpu")
    bundle = load_tokenizer(None)
    engine = GrammarEngine.shared(
        str(bundle.extra.get("source", None)), bundle.tokenizer, bundle.vocab_size, bundle.eos_ids
    )
    regex = OutputConstraint("regex", "[xy]{3}")
    key = constraint_key("regex", regex.spec)
    data = engine.compile_serialized("regex", regex.spec)
    params = GenerationParams(max_tokens=4, constraint=regex)

    async def go():
        async with ActorSystem([ActorSpec("runner", lambda: runner)], transport="inproc") as sys:
            ref = sys.ref("runner")
            query = LoadGrammar(key=key)
            assert not (await ref.call(query, expect=GrammarLoaded)).present
            load = LoadGrammar(key=key, data=data)
            assert (await ref.call(load, expect=GrammarLoaded, timeout=120)).present
            assert (await ref.call(query, expect=GrammarLoaded)).present

    anyio.run(go)
    assert runner._matcher(RunnerRequest(rid=1, params=params, grammar_key=key)) is not None
    with pytest.raises(RegisterFailed, match="not loaded"):
        runner._matcher(RunnerRequest(rid=2, params=params, grammar_key="f" * 32))


def test_tokenize_is_bounded_like_a_prompt_and_returns_token_strings_in_one_call():
    async def go():
        async with _system(ProbeActor) as system:
            tok = system.ref("tokenizer")
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as err:
                await tok.call(TokenizeRequest(prompt="hello " * 400_000), expect=TokenizeReply)
            assert time.monotonic() - t0 < 1.0  # refused by its size, not tokenized
            assert err.value.reply.code == ERR_CONTEXT_LENGTH
            assert err.value.reply.message.startswith("prompt is")
            with pytest.raises(RemoteError) as err:  # small enough to read, too many tokens
                await tok.call(TokenizeRequest(prompt="x " * 1000), expect=TokenizeReply)
            assert err.value.reply.code == ERR_CONTEXT_LENGTH
            assert "context is 512 tokens" in err.value.reply.message
            reply = await tok.call(
                TokenizeRequest(prompt="Hello, world", return_token_strs=True),
                expect=TokenizeReply,
            )
            assert len(reply.token_strs) == len(reply.tokens) > 2
            # the vocabulary's own pieces (vLLM's convert_ids_to_tokens), not decoded text
            assert reply.token_strs[0] == "<bos>"
            assert "▁world" in reply.token_strs
            assert "".join(reply.token_strs[1:]).replace("▁", " ") == "Hello, world"

    anyio.run(go)
