"""OpenAI requests to engine jobs, and engine output chunks to OpenAI response objects.

A request becomes one `Job` per choice: `n` choices for each prompt (a batched completions
request has several prompts); choice `prompt_index * n + i` gets seed `seed + i` when a
seed is given. Fields a request leaves unset take the model's generation defaults
(`generation_config.json`), then the engine's. `ChoiceState` accumulates one choice's
chunks; the renderers turn chunks into streamed events and states into the final object
(with `echo`, the prompt and its logprobs come first). Nothing here touches the engine.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from actors.frontends.http.constraints import constraint_of, tool_setup
from actors.frontends.http.errors import ApiError, ErrorBody
from actors.frontends.http.output_parts import OutputPolicy, OutputSplitter, Parts, split_whole
from actors.frontends.http.schemas import (
    MAX_CHOICES,
    MAX_PROMPTS,
    UNSUPPORTED,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCallOut,
    FunctionDelta,
    PromptTokensDetails,
    SamplingRequest,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from actors.frontends.http.sse import DONE_EVENT, sse_event
from actors.tool_calls import ToolCall
from actors.tool_calls import tool_format as tool_format_of
from transport.messages.engine import ChatMessage, GenerationParams, OutputChunk, TokenLogprob
from transport.messages.params import OutputConstraint

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Job:
    """One engine request: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt: dict[str, Any]  # the prompt keywords of EngineClient.generate
    params: GenerationParams
    echo: bool = False  # completions: the prompt precedes the completion in the response
    policy: OutputPolicy = OutputPolicy()  # how its output splits into reasoning, content, calls
    constraint_param: str | None = None  # the field the output constraint came from
    wants_prompt_ids: bool = False  # vLLM's return_token_ids: the prompt's ids are shown


@dataclass(frozen=True)
class Extras:
    """vLLM's additions to a response, as a request asks for them."""

    token_ids: bool = False  # return_token_ids: prompt and output token ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name "token_id:<id>"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    prompt_logprobs: bool = False  # the prompt's logprobs (vLLM's `prompt_logprobs`)

    @classmethod
    def of(cls, req: SamplingRequest, continuous_usage: bool = False) -> Extras:
        return cls(
            token_ids=bool(req.return_token_ids),
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
            continuous_usage=continuous_usage,
            prompt_logprobs=getattr(req, "prompt_logprobs", None) is not None,
        )


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    texts: list[str] = field(default_factory=list)
    text_len: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_text: str = ""  # for echo
    prompt_was_ids: bool = False  # the prompt came as token ids (echo shows their text)
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] = field(default_factory=list)  # the output's, so far
    prompt_tail: str = ""  # the text the output continues (Accepted.prompt_tail)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_reason: str | int | None = None
    queue_time_s: float = -1.0
    echoed: bool = False  # the prompt went out (streaming echo)

    def add(self, chunk: OutputChunk) -> int:
        """Record `chunk`; returns the text offset at which its text starts."""
        offset = self.text_len
        if chunk.text:
            self.texts.append(chunk.text)
            self.text_len += len(chunk.text)
        self.logprobs.extend(chunk.logprobs)
        self.token_ids.extend(chunk.token_ids)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens
        if chunk.queue_time_s >= 0:
            self.queue_time_s = chunk.queue_time_s
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_matched
        return offset

    @property
    def text(self) -> str:
        return "".join(self.texts)


def new_id(prefix: str, request_id: str | None = None) -> str:
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def clip(value: str, limit: int = 200) -> str:
    """A user value short enough to echo in an error message."""
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


# ---- requests -> jobs ------------------------------------------------------------------------


def check_model(requested: str | None, served: list[str]) -> str:
    """The name to answer with: the one requested, if served; the first served one if none
    was named."""
    if requested is None:
        return served[0]
    if requested in served:
        return requested
    names = ", ".join(f"`{n}`" for n in served)
    raise ApiError(
        404,
        f"The model `{clip(requested)}` does not exist; this server serves {names}.",
        type="not_found_error",
        param="model",
        code="model_not_found",
    )


def check_supported(req: SamplingRequest) -> None:
    """A 400 naming the first known field this server does not implement, when it is set."""
    for name in UNSUPPORTED:
        if getattr(req, name, None) is not None:
            raise ApiError(
                400,
                f"{name} is not supported by this server",
                param=name,
                code="unsupported_parameter",
            )


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, bias in (raw or {}).items():
        try:
            out[int(key)] = float(bias)
        except ValueError:
            raise ApiError(
                400, f"logit_bias: keys must be token ids, got {clip(key)!r}", param="logit_bias"
            ) from None
    return out


def _params(
    req: SamplingRequest,
    *,
    defaults: dict[str, Any],
    default_max_tokens: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: int | None = None,
    constraint: OutputConstraint | None = None,
) -> GenerationParams:
    check_supported(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if req.cache_salt is not None and not req.cache_salt:
        # As vLLM: an explicit salt must be non-empty ("" is the shared, unsalted cache).
        raise ApiError(400, "cache_salt: must be a non-empty string if given", param="cache_salt")

    def given(value: Any, name: str, engine_default: Any) -> Any:
        return defaults.get(name, engine_default) if value is None else value

    return GenerationParams(
        max_tokens=given(max_tokens, "max_tokens", default_max_tokens),
        min_tokens=given(req.min_tokens, "min_tokens", 0),
        temperature=given(req.temperature, "temperature", 1.0),
        top_p=given(req.top_p, "top_p", 1.0),
        top_k=given(req.top_k, "top_k", -1),
        min_p=given(req.min_p, "min_p", 0.0),
        seed=req.seed,
        repetition_penalty=given(req.repetition_penalty, "repetition_penalty", 1.0),
        frequency_penalty=given(req.frequency_penalty, "frequency_penalty", 0.0),
        presence_penalty=given(req.presence_penalty, "presence_penalty", 0.0),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        skip_special_tokens=given(req.skip_special_tokens, "skip_special_tokens", True),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        logit_bias=_logit_bias(req.logit_bias),
        prompt_logprobs=prompt_logprobs,
        constraint=constraint,
        cache_salt=req.cache_salt or "",
        max_tokens_strict=max_tokens is not None,  # a default is capped at the room left
        speculate=req.speculative is not False,
    )


def _expand(
    prompts: list[dict[str, Any]],
    n: int,
    params: GenerationParams,
    echo: bool = False,
    policy: OutputPolicy = OutputPolicy(),
    constraint_param: str | None = None,
    wants_prompt_ids: bool = False,
) -> list[Job]:
    jobs = []
    for p_index, prompt in enumerate(prompts):
        for i in range(n):
            seeded = params
            if params.seed is not None and i:
                seeded = _with_seed(params, params.seed + i)
            jobs.append(
                Job(
                    index=p_index * n + i,
                    prompt_index=p_index,
                    prompt=prompt,
                    params=seeded,
                    echo=echo,
                    policy=policy,
                    constraint_param=constraint_param,
                    wants_prompt_ids=wants_prompt_ids,
                )
            )
    return jobs


def _with_seed(params: GenerationParams, seed: int) -> GenerationParams:
    return msgspec.structs.replace(params, seed=seed)


def _completion_prompts(prompt: str | list[Any]) -> list[dict[str, Any]]:
    """The prompts of a completions request: text or token ids, one or a batch."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        out = [{"prompt": p} for p in prompt]
    elif all(isinstance(p, list) for p in prompt):
        out = [{"prompt_ids": list(p)} for p in prompt]
    else:
        raise ApiError(
            400,
            "prompt must be a string, a list of strings, a list of token ids, "
            "or a list of token id lists",
            param="prompt",
        )
    if len(out) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    return out


def completion_jobs(req: CompletionRequest, defaults: dict[str, Any]) -> list[Job]:
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported", param="suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise ApiError(400, "best_of is only supported equal to n", param="best_of")
    # echo with logprobs needs the prompt's logprobs; vLLM's prompt_logprobs asks directly.
    prompt_lps = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_lps = max(req.logprobs, prompt_lps or 0)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            raise ApiError(400, f"{name}: only for /v1/chat/completions", param=name)
    found = constraint_of(req)
    params = _params(
        req,
        defaults=defaults,
        default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,
        max_tokens=req.max_tokens,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        prompt_logprobs=prompt_lps,
        constraint=found[1] if found else None,
    )
    prompts = _completion_prompts(req.prompt)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"prompts x n must be at most {MAX_CHOICES}", param="n")
    if req.session_id:
        _check_session_turn(req, len(prompts) * n)
        prompts = [{**prompts[0], "session_id": req.session_id}]
    return _expand(
        prompts,
        n,
        params,
        echo=bool(req.echo),
        constraint_param=found[0] if found else None,
        wants_prompt_ids=bool(req.return_token_ids),
    )


def _check_session_turn(req: SamplingRequest, choices: int) -> None:
    if choices != 1:
        raise ApiError(400, "a session turn is one prompt with n = 1", param="session_id")


def chat_jobs(
    req: ChatCompletionRequest,
    context_len: int,
    defaults: dict[str, Any],
    *,
    tool_format: str = "hermes",
    reasoning: str = "",
) -> list[Job]:
    """The jobs of a chat request; `tool_format` and `reasoning` are the server's parsers."""
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(
            400, "prompt_logprobs: not available when streaming", param="prompt_logprobs"
        )
    messages = [chat_message(m) for m in req.messages]
    tool_mode, tools, constraint = tool_setup(req, tool_format)
    found = constraint_of(req)
    if found is not None:
        if constraint is not None:
            raise ApiError(
                400,
                f"{found[0]}: cannot be combined with tools (use tool_choice none)",
                param=found[0],
            )
        constraint = found[1]
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else (req.max_tokens)
    )
    params = _params(
        req,
        defaults=defaults,
        default_max_tokens=context_len,  # the tokenizer clamps it to the room left
        max_tokens=max_tokens,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        prompt_logprobs=req.prompt_logprobs,
        constraint=constraint,
    )
    if reasoning and constraint is not None:
        # The constraint applies once reasoning ends; the tokenizer wraps it knowing the
        # rendered prompt (whether it opened the reasoning).
        params = msgspec.structs.replace(params, reasoning_parser=reasoning)
    if tool_mode != "none" and req.skip_special_tokens is None:
        if tool_format_of(tool_format).special_markers:
            # The format's markers are special tokens (Mistral's [TOOL_CALLS]): the parser
            # must see them, so they are decoded unless the request says otherwise.
            params = msgspec.structs.replace(params, skip_special_tokens=False)
    prompt = {
        "messages": messages,
        "add_generation_prompt": req.add_generation_prompt is not False,
        "continue_final_message": bool(req.continue_final_message),
        "chat_template_kwargs": dict(req.chat_template_kwargs or {}),
    }
    if tools:
        prompt["tools"] = [t.openai() for t in tools]
    if req.session_id:
        _check_session_turn(req, req.n or 1)
        prompt["session_id"] = req.session_id
    return _expand(
        [prompt],
        req.n or 1,
        params,
        policy=OutputPolicy(
            tool_format=tool_format if tool_mode != "none" else None,
            calls_only=tool_mode in ("required", "named"),
            tools=tuple(tools),
            reasoning=reasoning,
        ),
        constraint_param=found[0] if found else ("tools" if constraint else None),
        wants_prompt_ids=bool(req.return_token_ids),
    )


def chat_message(m: Any) -> ChatMessage:
    """The engine's form of one OpenAI chat message (tool-call history included)."""
    content: Any = m.content
    if isinstance(content, list):
        content = [{"type": "text", "text": part.text} for part in content]
    calls = None
    if m.tool_calls:
        calls = [
            {
                "id": c.id or "",
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in m.tool_calls
        ]
    return ChatMessage(
        role=m.role, content=content, name=m.name, tool_calls=calls, tool_call_id=m.tool_call_id
    )


# ---- outputs -> OpenAI objects ---------------------------------------------------------------


def usage_of(jobs: list[Job], states: list[ChoiceState]) -> Usage:
    """Prompt tokens count once per prompt (as OpenAI bills n > 1); cached tokens are the
    least any of the prompt's choices got from the prefix cache."""
    prompt_tokens = 0
    cached = 0
    seen: set[int] = set()
    for job in jobs:
        if job.prompt_index in seen:
            continue
        seen.add(job.prompt_index)
        siblings = [states[j.index] for j in jobs if j.prompt_index == job.prompt_index]
        prompt_tokens += siblings[0].prompt_tokens
        cached += min(s.cached_tokens for s in siblings)
    completion = sum(s.completion_tokens for s in states)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _name(token_id: int, text: str, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else text


def completion_logprobs(
    lps: list[TokenLogprob], start_offset: int, as_ids: bool = False
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs shape; the first prompt token (echo) has null entries. Each
    `top_logprobs` entry holds the `logprobs` best tokens and, as OpenAI's does, the chosen
    (or echoed) token itself, so `logprobs=0` gives that token alone. Offsets count text,
    whatever the tokens are named."""
    offsets = []
    pos = start_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.text)
    return CompletionLogprobs(
        tokens=[_name(lp.token_id, lp.text, as_ids) for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[_top_with_chosen(lp, as_ids) for lp in lps],
        text_offset=offsets,
    )


def _top_with_chosen(lp: TokenLogprob, as_ids: bool = False) -> dict[str, float] | None:
    if lp.logprob is None:
        return None
    top = {_name(tid, text, as_ids): value for tid, text, value in lp.top}
    top.setdefault(_name(lp.token_id, lp.text, as_ids), lp.logprob)
    return top


def vllm_prompt_logprobs(lps: list[TokenLogprob]) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else the token and
    its top alternatives, each {"logprob", "rank", "decoded_token"}."""
    out: list[dict[str, dict] | None] = []
    for lp in lps:
        if lp.logprob is None:
            out.append(None)
            continue
        entry = {
            str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.text}
        }
        for rank, (tid, text, value) in enumerate(lp.top, start=1):
            entry.setdefault(str(tid), {"logprob": value, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out


def chat_logprobs(lps: list[TokenLogprob], as_ids: bool = False) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatLogprob(
                token=_name(lp.token_id, lp.text, as_ids),
                logprob=lp.logprob,
                bytes=list(lp.text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=_name(tid, text, as_ids), logprob=value, bytes=list(text.encode())
                    )
                    for tid, text, value in lp.top
                ],
            )
            for lp in lps
        ]
    )


def usage_so_far(state: ChoiceState) -> Usage:
    """One choice's usage as of its latest chunk (continuous_usage_stats)."""
    return Usage(
        prompt_tokens=state.prompt_tokens,
        completion_tokens=state.completion_tokens,
        total_tokens=state.prompt_tokens + state.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=state.cached_tokens),
    )


class OpenAIStreaming(ABC):
    """How OpenAI's streams are framed: `data:` events, a usage chunk when asked for, and
    `[DONE]` after the last chunk or after an `{"error": ...}` event."""

    sse = staticmethod(sse_event)

    def stream_end(self, states: list[ChoiceState], usage: Usage, include_usage: bool) -> bytes:
        return (sse_event(self.usage_event(usage)) if include_usage else b"") + DONE_EVENT

    def stream_error(self, error: ApiError) -> bytes:
        return sse_event(ErrorBody(error=error.detail)) + DONE_EVENT

    @abstractmethod
    def usage_event(self, usage: Usage) -> Any:
        """The chunk that carries `usage` alone (no choices), in the endpoint's object."""


class CompletionRenderer(OpenAIStreaming):
    """Builds /v1/completions objects for one request."""

    def __init__(
        self,
        model: str,
        want_logprobs: bool,
        *,
        request_id: str | None = None,
        echo: bool = False,
        extras: Extras = Extras(),
    ) -> None:
        self.id = new_id("cmpl", request_id)
        self.created = int(time.time())
        self.model = model
        self.want_logprobs = want_logprobs
        self.echo = echo
        self.extras = extras

    def opening(self, index: int) -> Completion | None:
        return None

    def _choice(
        self,
        index: int,
        state: ChoiceState,
        text: str,
        lps: list[TokenLogprob],
        offset: int,
        finish: str | None,
        first: bool,
        token_ids: list[int],
    ) -> CompletionChoice:
        if self.echo and first:
            if self.want_logprobs and state.prompt_logprobs and state.prompt_was_ids:
                # A prompt of token ids is echoed as its tokens' text, special tokens (<bos>,
                # <pad>) included, so every `text_offset` points at its token in `text`.
                state.prompt_text = "".join(lp.text for lp in state.prompt_logprobs)
            text = state.prompt_text + text
            lps = [*state.prompt_logprobs, *lps]
            offset = 0
        elif self.echo:
            offset += len(state.prompt_text)
        extras = self.extras
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=completion_logprobs(lps, offset, extras.tokens_as_ids)
            if self.want_logprobs
            else None,
            finish_reason=finish,
            stop_reason=state.stop_reason if finish else None,
            prompt_logprobs=vllm_prompt_logprobs(state.prompt_logprobs)
            if extras.prompt_logprobs and first
            else None,
            prompt_token_ids=state.prompt_token_ids if extras.token_ids and first else None,
            token_ids=token_ids if extras.token_ids else None,
        )

    def delta(
        self, index: int, chunk: OutputChunk, text_offset: int, state: ChoiceState
    ) -> Completion | None:
        first = not state.echoed
        if (
            not chunk.text
            and chunk.finish_reason is None
            and not chunk.logprobs
            and not (first and (self.echo or self.extras.prompt_logprobs))
        ):
            return None
        state.echoed = True
        choice = self._choice(
            index,
            state,
            chunk.text,
            list(chunk.logprobs),
            text_offset,
            chunk.finish_reason,
            first,
            list(chunk.token_ids),
        )
        usage = usage_so_far(state) if self.extras.continuous_usage else None
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        )

    def usage_event(self, usage: Usage) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def final(self, states: list[ChoiceState], usage: Usage) -> Completion:
        choices = [
            self._choice(i, s, s.text, s.logprobs, 0, s.finish_reason, True, s.token_ids)
            for i, s in enumerate(states)
        ]
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


class ChatRenderer(OpenAIStreaming):
    """Builds /v1/chat/completions objects for one request."""

    def __init__(
        self,
        model: str,
        want_logprobs: bool,
        *,
        request_id: str | None = None,
        policy: OutputPolicy = OutputPolicy(),
        extras: Extras = Extras(),
    ) -> None:
        self.id = new_id("chatcmpl", request_id)
        self.created = int(time.time())
        self.model = model
        self.want_logprobs = want_logprobs
        self.policy = policy
        self.extras = extras
        self._splitters: dict[int, OutputSplitter] = {}  # streaming, per choice

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def opening(self, index: int) -> ChatCompletionChunk:
        """The first event of each choice: the assistant role, no content yet."""
        return self._chunk(
            ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        )

    def delta(
        self, index: int, chunk: OutputChunk, text_offset: int, state: ChoiceState
    ) -> ChatCompletionChunk | None:
        if not chunk.text and chunk.finish_reason is None and not chunk.logprobs:
            return None
        lps = (
            chat_logprobs(list(chunk.logprobs), self.extras.tokens_as_ids)
            if self.want_logprobs
            else None
        )
        finish = chunk.finish_reason
        splitter = self._splitters.get(index)
        first = splitter is None
        if splitter is None:
            splitter = self._splitters[index] = OutputSplitter(self.policy, state.prompt_tail)
        parts = splitter.feed(chunk.text)
        if finish is not None:
            last = splitter.finish()
            parts = Parts(
                parts.reasoning + last.reasoning,
                parts.content + last.content,
                parts.calls + last.calls,
            )
            if splitter.calls and finish == "stop":
                finish = "tool_calls"
        extras = self.extras
        if not parts and finish is None and lps is None and not extras.token_ids:
            return None
        before = len(splitter.calls) - len(parts.calls)
        deltas = [
            ToolCallDelta(
                index=before + k,
                id=call.id,
                type="function",
                function=FunctionDelta(name=call.name, arguments=call.arguments),
            )
            for k, call in enumerate(parts.calls)
        ]
        delta = ChatDelta(
            content=parts.content or None,
            tool_calls=deltas or None,
            reasoning_content=parts.reasoning or None,
            reasoning=parts.reasoning or None,
        )
        out = self._chunk(
            ChatChunkChoice(
                index=index,
                delta=delta,
                logprobs=lps,
                finish_reason=finish,
                stop_reason=state.stop_reason if finish else None,
                token_ids=list(chunk.token_ids) if extras.token_ids else None,
            )
        )
        if extras.continuous_usage:
            out.usage = usage_so_far(state)
        if extras.token_ids and first:
            out.prompt_token_ids = state.prompt_token_ids
        return out

    def usage_event(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def final(self, states: list[ChoiceState], usage: Usage) -> ChatCompletion:
        choices = []
        for i, s in enumerate(states):
            message, finish = self._message_and_finish(s)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=chat_logprobs(s.logprobs, self.extras.tokens_as_ids)
                    if self.want_logprobs
                    else None,
                    finish_reason=finish,
                    stop_reason=s.stop_reason,
                    token_ids=s.token_ids if self.extras.token_ids else None,
                )
            )
        first = states[0]
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            prompt_logprobs=vllm_prompt_logprobs(first.prompt_logprobs)
            if self.extras.prompt_logprobs
            else None,
            prompt_token_ids=first.prompt_token_ids if self.extras.token_ids else None,
        )

    def _message_and_finish(self, state: ChoiceState) -> tuple[ChatMessageOut, str | None]:
        """The choice's message (reasoning and tool calls parsed out, when asked) and finish
        reason: "tool_calls" for one that stopped after making calls."""
        parts = split_whole(self.policy, state.text, state.prompt_tail)
        content: str | None = parts.content
        if (parts.calls or self.policy.calls_only) and not parts.content.strip():
            content = None  # only calls were made (or, calls alone asked, none)
        reasoning = parts.reasoning if self.policy.reasoning else None
        message = ChatMessageOut(
            content=content,
            tool_calls=[_call_out(c) for c in parts.calls] or None,
            reasoning_content=reasoning,
            reasoning=reasoning,
        )
        finish = state.finish_reason
        if parts.calls and finish == "stop":
            finish = "tool_calls"
        return message, finish


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(
        id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments)
    )


class Renderer(Protocol):
    """What the responder needs of an API's renderer (chat, completions, Responses,
    Messages): its objects for one choice's start, each chunk and the whole answer, and how
    its streams frame events, end and fail."""

    def opening(self, index: int) -> Any | None: ...

    def delta(
        self, index: int, chunk: OutputChunk, text_offset: int, state: ChoiceState
    ) -> Any | None: ...

    def final(self, states: list[ChoiceState], usage: Usage) -> Any: ...

    def sse(self, obj: Any) -> bytes: ...

    def stream_end(self, states: list[ChoiceState], usage: Usage, include_usage: bool) -> bytes: ...

    def stream_error(self, error: ApiError) -> bytes: ...
