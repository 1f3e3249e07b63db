"""OpenAI requests to engine jobs, and engine output chunks to OpenAI response objects.

A request becomes one `Job` per choice: `n` choices for each prompt (a batched completions
request has several prompts); choice `prompt_index * n + i` gets seed `seed + i` when a
seed is given. `ChoiceState` accumulates one choice's chunks; the renderers turn chunks
into streamed events and states into the final object. Nothing here touches the engine.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.frontends.http.errors import ApiError
from actors.frontends.http.schemas import (
    MAX_CHOICES,
    MAX_PROMPTS,
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
    PromptTokensDetails,
    SamplingRequest,
    TopLogprob,
    Usage,
)
from transport.messages.engine import ChatMessage, GenerationParams, OutputChunk, TokenLogprob

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Job:
    """One engine request: choice `index` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt: dict[str, Any]  # the prompt keyword of EngineClient.generate
    params: GenerationParams


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

    def add(self, chunk: OutputChunk) -> int:
        """Record `chunk`; returns the text offset at which its text starts."""
        offset = self.text_len
        if chunk.text:
            self.texts.append(chunk.text)
            self.text_len += len(chunk.text)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        return offset

    @property
    def text(self) -> str:
        return "".join(self.texts)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- requests -> jobs ------------------------------------------------------------------------


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(
            404,
            f"The model `{requested}` does not exist; this server serves `{served}`.",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )


def _params(
    req: SamplingRequest,
    *,
    default_max_tokens: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
) -> GenerationParams:
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    return GenerationParams(
        max_tokens=given(max_tokens, default_max_tokens),
        min_tokens=given(req.min_tokens, 0),
        temperature=given(req.temperature, 1.0),
        top_p=given(req.top_p, 1.0),
        top_k=given(req.top_k, -1),
        min_p=given(req.min_p, 0.0),
        seed=req.seed,
        repetition_penalty=given(req.repetition_penalty, 1.0),
        frequency_penalty=given(req.frequency_penalty, 0.0),
        presence_penalty=given(req.presence_penalty, 0.0),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        skip_special_tokens=given(req.skip_special_tokens, True),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
    )


def _expand(prompts: list[dict[str, Any]], n: int, params: GenerationParams) -> list[Job]:
    jobs = []
    for p_index, prompt in enumerate(prompts):
        for i in range(n):
            seeded = params
            if params.seed is not None and i:
                seeded = _with_seed(params, params.seed + i)
            jobs.append(
                Job(index=p_index * n + i, prompt_index=p_index, prompt=prompt, params=seeded)
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


def completion_jobs(req: CompletionRequest) -> list[Job]:
    if req.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported", param="suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise ApiError(400, "best_of is only supported equal to n", param="best_of")
    params = _params(
        req,
        default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,
        max_tokens=req.max_tokens,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
    )
    prompts = _completion_prompts(req.prompt)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"prompts x n must be at most {MAX_CHOICES}", param="n")
    return _expand(prompts, n, params)


def chat_jobs(req: ChatCompletionRequest, context_len: int) -> list[Job]:
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    messages = []
    for m in req.messages:
        content: Any = m.content
        if isinstance(content, list):
            content = [{"type": "text", "text": part.text} for part in content]
        messages.append(ChatMessage(role=m.role, content=content, name=m.name))
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else (req.max_tokens)
    )
    params = _params(
        req,
        default_max_tokens=context_len,  # the tokenizer clamps it to the room left
        max_tokens=max_tokens,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
    )
    return _expand([{"messages": messages}], req.n or 1, params)


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


def completion_logprobs(
    lps: list[TokenLogprob], start_offset: int, with_top: bool
) -> CompletionLogprobs:
    offsets = []
    pos = start_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.text)
    return CompletionLogprobs(
        tokens=[lp.text for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[{text: value for _, text, value in lp.top} for lp in lps]
        if with_top
        else None,
        text_offset=offsets,
    )


def chat_logprobs(lps: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatLogprob(
                token=lp.text,
                logprob=lp.logprob,
                bytes=list(lp.text.encode()),
                top_logprobs=[
                    TopLogprob(token=text, logprob=value, bytes=list(text.encode()))
                    for _, text, value in lp.top
                ],
            )
            for lp in lps
        ]
    )


class CompletionRenderer:
    """Builds /v1/completions objects for one request."""

    def __init__(self, model: str, want_logprobs: bool, top_logprobs: int) -> None:
        self.id = new_id("cmpl")
        self.created = int(time.time())
        self.model = model
        self.want_logprobs = want_logprobs
        self.with_top = top_logprobs > 0

    def opening(self, index: int) -> Completion | None:
        return None

    def delta(self, index: int, chunk: OutputChunk, text_offset: int) -> Completion | None:
        if not chunk.text and chunk.finish_reason is None and not chunk.logprobs:
            return None
        lps = (
            completion_logprobs(list(chunk.logprobs), text_offset, self.with_top)
            if self.want_logprobs
            else None
        )
        choice = CompletionChoice(
            index=index, text=chunk.text, logprobs=lps, finish_reason=chunk.finish_reason
        )
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_event(self, usage: Usage) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def final(self, states: list[ChoiceState], usage: Usage) -> Completion:
        choices = [
            CompletionChoice(
                index=i,
                text=s.text,
                logprobs=completion_logprobs(s.logprobs, 0, self.with_top)
                if self.want_logprobs
                else None,
                finish_reason=s.finish_reason,
            )
            for i, s in enumerate(states)
        ]
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


class ChatRenderer:
    """Builds /v1/chat/completions objects for one request."""

    def __init__(self, model: str, want_logprobs: bool) -> None:
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        self.model = model
        self.want_logprobs = want_logprobs

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def opening(self, index: int) -> ChatCompletionChunk:
        """The first event of each choice: the assistant role, no content yet."""
        return self._chunk(
            ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        )

    def delta(self, index: int, chunk: OutputChunk, text_offset: int) -> ChatCompletionChunk | None:
        if not chunk.text and chunk.finish_reason is None and not chunk.logprobs:
            return None
        lps = chat_logprobs(list(chunk.logprobs)) if self.want_logprobs else None
        delta = ChatDelta(content=chunk.text) if chunk.text else ChatDelta()
        return self._chunk(
            ChatChunkChoice(
                index=index, delta=delta, logprobs=lps, finish_reason=chunk.finish_reason
            )
        )

    def usage_event(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def final(self, states: list[ChoiceState], usage: Usage) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessageOut(content=s.text),
                logprobs=chat_logprobs(s.logprobs) if self.want_logprobs else None,
                finish_reason=s.finish_reason,
            )
            for i, s in enumerate(states)
        ]
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


Renderer = CompletionRenderer | ChatRenderer
