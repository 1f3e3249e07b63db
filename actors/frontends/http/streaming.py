"""One generation request of the gateway, answered as one JSON body or as an SSE stream.

`GenerationResponder.run` runs one `EngineClient.generate` per choice, each in its own task
feeding a single event stream, plus a task watching `receive()` for `http.disconnect`.
Nothing is sent before every choice is accepted, so a refusal is a plain HTTP error. A
stream that started always ends with an error event or its last chunk, then `[DONE]`; while
a request waits or prefills, a comment line every `keepalive_s` keeps proxies from timing
out. Invariant: when the client leaves, the task group is cancelled, which closes every
choice's generator, which sends `AbortGeneration`; its KV goes back to the pool.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.frontends.base import EngineClient, GenerationError
from actors.frontends.http.asgi import Receive, Scope, Send, send_response
from actors.frontends.http.errors import (
    SERVER_ERROR,
    UNAVAILABLE,
    ApiError,
    from_generation_error,
)
from actors.frontends.http.generation import ChoiceState, Job, Renderer, usage_of
from actors.frontends.http.metrics import GatewayMetrics
from actors.frontends.http.sse import SSE_HEADERS
from actors.runtime.logging import get_logger
from transport.channel import ChannelClosed
from transport.messages.engine import Accepted, OutputChunk

SSE_KEEPALIVE_S = 5.0  # a streamed response with no event this long gets a comment line
KEEPALIVE_EVENT = b": keep-alive\n\n"

_log = get_logger("gateway")
_json = msgspec.json.Encoder()

_ACCEPTED, _CHUNK, _ERROR = 0, 1, 2


@dataclass(slots=True)
class _Event:
    index: int
    kind: int
    chunk: OutputChunk | None = None
    error: ApiError | None = None
    accepted: Accepted | None = None


@dataclass(slots=True)
class _Outcome:
    completed: bool = False  # the last byte of the response is being sent
    succeeded: bool = False  # ... and every choice finished
    disconnected: bool = False  # the client left before `completed`
    error: ApiError | None = None  # refused before the response started
    endpoint: str = ""  # the metrics label of the route


def _post(tx: MemoryObjectSendStream[_Event], event: _Event) -> None:
    # The reader may be gone (the request ended early); its events are no longer needed.
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        tx.send_nowait(event)


class GenerationResponder:
    """Answers generation requests for the app: `await responder.run(...)` per request."""

    def __init__(
        self, client: EngineClient, metrics: GatewayMetrics, keepalive_s: float = SSE_KEEPALIVE_S
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.keepalive_s = keepalive_s

    async def run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        jobs: list[Job],
        renderer: Renderer,
        stream: bool,
        include_usage: bool,
    ) -> None:
        started = time.perf_counter()
        states = [ChoiceState() for _ in jobs]
        for job, state in zip(jobs, states):
            if job.echo:
                state.prompt_text = await self._prompt_text(job)
                state.prompt_was_ids = "prompt_ids" in job.prompt
        prompt_ids: dict[int, list[int]] = {}  # per prompt, when asked for
        for job, state in zip(jobs, states):
            if job.wants_prompt_ids:
                if job.prompt_index not in prompt_ids:
                    prompt_ids[job.prompt_index] = await self._prompt_ids(job)
                state.prompt_token_ids = prompt_ids[job.prompt_index]
        outcome = _Outcome(endpoint=scope.get("kvactor.endpoint", ""))
        tx, rx = anyio.create_memory_object_stream[_Event](math.inf)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, receive, tg.cancel_scope, outcome)
            async with tx:
                for job in jobs:
                    tg.start_soon(self._pump, job, scope.get("kvactor.api_key", ""), tx.clone())
            early: list[_Event] = []
            accepted = 0
            # Nothing is sent before every choice is accepted: a refusal is a plain 400.
            while accepted < len(jobs) and outcome.error is None:
                event = await _next_event(rx)
                if event.kind == _ACCEPTED:
                    accepted += 1
                    if event.accepted is not None:
                        states[event.index].prompt_tail = event.accepted.prompt_tail
                        states[event.index].prompt_tokens = event.accepted.prompt_tokens
                elif event.kind == _ERROR:
                    outcome.error = event.error
                else:
                    early.append(event)
            if outcome.error is None:
                if stream:
                    await self._stream(
                        send, rx, early, jobs, states, renderer, include_usage, started, outcome
                    )
                else:
                    await self._respond(send, rx, early, jobs, states, renderer, started, outcome)
            tg.cancel_scope.cancel()
        if outcome.disconnected:
            self.metrics.count_aborted(outcome.endpoint)
        elif outcome.error is not None:
            raise outcome.error
        elif outcome.succeeded:
            self.metrics.count_success(time.perf_counter() - started, outcome.endpoint)

    async def _prompt_text(self, job: Job) -> str:
        if "prompt" in job.prompt:
            return job.prompt["prompt"]
        try:
            return await self.client.detokenize(list(job.prompt["prompt_ids"]))
        except GenerationError as exc:
            raise from_generation_error(exc) from None

    async def _prompt_ids(self, job: Job) -> list[int]:
        """The token ids the engine will prefill for `job`'s prompt (vLLM's
        return_token_ids): the tokenizer's answer for the same prompt."""
        p = job.prompt
        if "prompt_ids" in p:
            return list(p["prompt_ids"])
        try:
            reply = await self.client.tokenize(
                prompt=p.get("prompt"),
                messages=p.get("messages"),
                add_special_tokens="prompt" in p,
                add_generation_prompt=p.get("add_generation_prompt", True),
                continue_final_message=p.get("continue_final_message", False),
                chat_template_kwargs=p.get("chat_template_kwargs") or {},
                tools=p.get("tools") or [],
            )
        except GenerationError as exc:
            raise from_generation_error(exc) from None
        return list(reply.tokens)

    async def _pump(self, job: Job, api_key: str, tx: MemoryObjectSendStream[_Event]) -> None:
        """Run one choice; every outcome is an event (never an exception in the group)."""
        async with tx:
            try:
                session = {"session_key": api_key} if job.prompt.get("session_id") else {}
                gen = self.client.generate(
                    job.params,
                    **job.prompt,
                    **session,
                    on_accepted=lambda acc: _post(
                        tx, _Event(job.index, _ACCEPTED, accepted=_as_accepted(acc))
                    ),
                )
                async with contextlib.aclosing(gen):
                    async for chunk in gen:
                        _post(tx, _Event(job.index, _CHUNK, chunk=chunk))
            except GenerationError as exc:
                _post(tx, _Event(job.index, _ERROR, error=_named_error(exc, job)))
            except (TimeoutError, ChannelClosed) as exc:
                error = ApiError(
                    503, f"engine unavailable: {type(exc).__name__}: {exc}", type=UNAVAILABLE
                )
                _post(tx, _Event(job.index, _ERROR, error=error))
            except Exception as exc:
                error = ApiError(
                    500, f"internal error: {type(exc).__name__}: {exc}", type=SERVER_ERROR
                )
                _post(tx, _Event(job.index, _ERROR, error=error))

    def _record(
        self, event: _Event, jobs: list[Job], states: list[ChoiceState], started: float
    ) -> int:
        """Fold a chunk into its choice's state and metrics; returns its text offset."""
        chunk = event.chunk
        assert chunk is not None
        state = states[event.index]
        job = jobs[event.index]
        if chunk.token_ids:
            now = time.perf_counter()
            if state.first_token_at is None:
                self.metrics.ttft.observe(now - started)
                state.first_token_at = now
            else:
                self.metrics.itl.observe(now - (state.last_token_at or now))
            state.last_token_at = now
        offset = state.add(chunk)
        if chunk.finish_reason is not None:
            # prefill: from admission (the request's start plus its time in the queue) to
            # the first token; decode: from the first token to the last
            prefill_s = decode_s = -1.0
            if state.first_token_at is not None:
                admitted = started + max(state.queue_time_s, 0.0)
                prefill_s = max(state.first_token_at - admitted, 0.0)
                decode_s = (state.last_token_at or state.first_token_at) - state.first_token_at
            self.metrics.count_finished(
                chunk.finish_reason,
                chunk.prompt_tokens,
                chunk.completion_tokens,
                chunk.cached_tokens,
                state.queue_time_s,
                max_tokens=job.params.max_tokens,
                prefill_s=prefill_s,
                decode_s=decode_s,
            )
            siblings = [s for j, s in zip(jobs, states) if j.prompt_index == job.prompt_index]
            if all(s.finish_reason is not None for s in siblings):
                self.metrics.count_params_n(len(siblings))
        return offset

    async def _respond(
        self,
        send: Send,
        rx: MemoryObjectReceiveStream[_Event],
        early: list[_Event],
        jobs: list[Job],
        states: list[ChoiceState],
        renderer: Renderer,
        started: float,
        outcome: _Outcome,
    ) -> None:
        remaining = len(jobs)
        queue = list(early)
        while remaining:
            event = queue.pop(0) if queue else await _next_event(rx)
            if event.kind == _ERROR:
                outcome.error = event.error
                return
            if event.kind == _CHUNK:
                self._record(event, jobs, states, started)
                remaining -= event.chunk.finish_reason is not None
        body = _json.encode(renderer.final(states, usage_of(jobs, states)))
        outcome.completed = outcome.succeeded = True
        await send_response(send, 200, body)

    async def _stream(
        self,
        send: Send,
        rx: MemoryObjectReceiveStream[_Event],
        early: list[_Event],
        jobs: list[Job],
        states: list[ChoiceState],
        renderer: Renderer,
        include_usage: bool,
        started: float,
        outcome: _Outcome,
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        out: list[bytes] = []
        remaining = len(jobs)
        try:
            out += [
                renderer.sse(o) for job in jobs if (o := renderer.opening(job.index)) is not None
            ]
            remaining, error = await self._stream_events(
                send, rx, early, jobs, states, renderer, started, out
            )
            if error is not None:
                out.append(renderer.stream_error(error))
                self.metrics.count_error(error.status, outcome.endpoint)
            else:
                out.append(renderer.stream_end(states, usage_of(jobs, states), include_usage))
        except Exception as exc:
            # Invariant: a stream that started always ends with the API's error event or its
            # last chunk; a failure here (a rendering bug) must not cut it silently.
            _log.error("stream failed after its response started", exc_info=exc)
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type=SERVER_ERROR)
            out.append(renderer.stream_error(error))
            self.metrics.count_error(error.status, outcome.endpoint)
        outcome.completed = True
        outcome.succeeded = not remaining
        await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})

    async def _stream_events(
        self,
        send: Send,
        rx: MemoryObjectReceiveStream[_Event],
        early: list[_Event],
        jobs: list[Job],
        states: list[ChoiceState],
        renderer: Renderer,
        started: float,
        out: list[bytes],
    ) -> tuple[int, ApiError | None]:
        """Stream chunks until every choice finished or one failed: how many did not finish,
        and the failure. Events not yet sent are left in `out`."""
        remaining = len(jobs)
        queue = list(early)
        while remaining:
            # Write every event already queued in one send (one syscall per batch of chunks).
            if not queue:
                if out:
                    await send(
                        {"type": "http.response.body", "body": b"".join(out), "more_body": True}
                    )
                    out.clear()
                # While a request waits or prefills, a comment keeps proxies from timing out.
                with anyio.move_on_after(self.keepalive_s) as waited:
                    queue.append(await _next_event(rx))
                if waited.cancelled_caught:
                    await send(
                        {"type": "http.response.body", "body": KEEPALIVE_EVENT, "more_body": True}
                    )
                    continue
                while True:
                    try:
                        queue.append(rx.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
            event = queue.pop(0)
            if event.kind == _ERROR:
                assert event.error is not None
                return remaining, event.error
            if event.kind != _CHUNK:
                continue
            assert event.chunk is not None
            offset = self._record(event, jobs, states, started)
            delta = renderer.delta(event.index, event.chunk, offset, states[event.index])
            if delta is not None:
                out.append(renderer.sse(delta))
            remaining -= event.chunk.finish_reason is not None
        return remaining, None


async def _next_event(rx: MemoryObjectReceiveStream[_Event]) -> _Event:
    try:
        return await rx.receive()
    except anyio.EndOfStream:
        # Every choice's task ended without finishing: the engine went away.
        error = ApiError(503, "the engine ended the request without finishing it", type=UNAVAILABLE)
        return _Event(-1, _ERROR, error=error)


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope, outcome: _Outcome) -> None:
    """Cancel the request's task group when the client disconnects mid-request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not outcome.completed:
                outcome.disconnected = True
                scope.cancel()
            return


def _as_accepted(message: object) -> Accepted | None:
    return message if isinstance(message, Accepted) else None


def _named_error(exc: GenerationError, job: Job) -> ApiError:
    """The engine's error, naming the request's own field where the engine named its
    generic one (`constraint` is `response_format`, `structured_outputs`, `tools`, ...)."""
    error = from_generation_error(exc)
    if job.constraint_param and exc.message.startswith("constraint:"):
        text = job.constraint_param + exc.message.removeprefix("constraint")
        return ApiError(error.status, text, param=job.constraint_param)
    return error
