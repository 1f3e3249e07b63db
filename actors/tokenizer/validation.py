"""Request validation at the engine's edge: the tokenizer refuses bad input here, once.

Every check raises `BadRequest` with a message that starts with the offending field
(`"temperature: must be in [0, 2] ..."`); the gateway maps it to HTTP 400 with that
`param`, the ZeroMQ endpoint to an `invalid_request` error frame. A prompt too long for
the context or the KV pool raises `ContextTooLong`, whose own ErrorReply code
(`ERR_CONTEXT_LENGTH`) becomes OpenAI's `context_length_exceeded` over HTTP: the class says
so, never the message's text (which may quote the client's). A refused request changes no
engine state. Parameter limits are `transport.messages.params`'s, the only ones.
"""

from __future__ import annotations

import msgspec

from transport.messages.engine import GenerateRequest
from transport.messages.params import GenerationParams, InvalidParams, validate_params

ERR_INVALID_REQUEST = "invalid_request"  # ErrorReply code for bad client input (HTTP 400)
ERR_OVERLOADED = "overloaded"  # ErrorReply code when the queue is full (HTTP 429)
# ErrorReply code for a prompt (or prompt + a client's max_tokens) beyond the model's context
# or the whole KV pool (HTTP 400, code context_length_exceeded; ZeroMQ: invalid_request)
ERR_CONTEXT_LENGTH = "context_length_exceeded"
# ErrorReply code when the engine could not take an accepted-looking request (HTTP 503): the
# same value as the frontends' ERR_ENGINE_STOPPED
ERR_UNAVAILABLE = "engine_stopped"


class BadRequest(ValueError):
    """Invalid client input; the gateway maps it to HTTP 400."""


class ContextTooLong(BadRequest):
    """A prompt the model's context or the whole KV pool cannot hold, or one that leaves
    less room than the max_tokens a client fixed."""


def refusal_code(exc: BadRequest) -> str:
    """The ErrorReply code of a refusal: ERR_CONTEXT_LENGTH or ERR_INVALID_REQUEST."""
    return ERR_CONTEXT_LENGTH if isinstance(exc, ContextTooLong) else ERR_INVALID_REQUEST


class Overloaded(RuntimeError):
    """Too many requests in the engine already; the gateway maps it to HTTP 429."""


class Unavailable(RuntimeError):
    """A hand-off inside the engine failed (the scheduler or the runner did not take the
    request); the client hears it (HTTP 503) and nothing of the request is left behind."""


def check_prompt_size(chars: int, context_len: int, max_token_chars: int) -> None:
    """Refuse, before tokenizing, a text that cannot fit: every token covers at most
    `max_token_chars` characters, so a longer text has more tokens than the context."""
    if chars > context_len * max_token_chars:
        raise ContextTooLong(
            f"prompt is {chars} characters, more than this model's context of {context_len} "
            "tokens can hold"
        )


def check_params(p: GenerationParams, vocab_size: int) -> None:
    try:
        validate_params(p, vocab_size)
    except InvalidParams as exc:
        raise BadRequest(str(exc)) from None


def check_prompt_source(msg: GenerateRequest) -> None:
    given = [x is not None for x in (msg.prompt, msg.prompt_ids, msg.messages)]
    if sum(given) != 1:
        raise BadRequest("give exactly one of prompt, prompt_ids, messages")
    if msg.prompt is not None and not msg.prompt:
        raise BadRequest("prompt is empty")


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"prompt: token ids {bad[:5]} outside the vocabulary")


def check_fits_kv_pool(prompt_len: int, kv_tokens: int) -> None:
    """Refuse a prompt the whole KV pool cannot hold (`kv_tokens`: its positions; 0:
    unknown). Such a request could never run: it would wait, then be cut short with nothing
    generated. (A prompt that fills the pool exactly still gives its first token, sampled
    from the prompt's own last position.)"""
    if kv_tokens and prompt_len > kv_tokens:
        raise ContextTooLong(
            f"prompt is {prompt_len} tokens; this server's KV cache holds {kv_tokens} tokens "
            "in all (kv.num_pages x kv.page_size), so it can never run here"
        )


def fit_to_context(p: GenerationParams, prompt_len: int, context_len: int) -> GenerationParams:
    """Refuse a prompt that leaves no room to generate; cap max_tokens at the room left, or
    refuse it there when the client set it (`max_tokens_strict`)."""
    if prompt_len == 0:
        raise BadRequest("prompt is empty")
    if prompt_len >= context_len:
        raise ContextTooLong(
            f"prompt is {prompt_len} tokens; this model's context is {context_len} tokens"
        )
    room = context_len - prompt_len
    if p.max_tokens > room and p.max_tokens_strict:
        raise ContextTooLong(
            f"max_tokens: the prompt is {prompt_len} tokens and this model's context is "
            f"{context_len} tokens, so at most {room} can be generated; {p.max_tokens} were "
            "asked for"
        )
    if p.max_tokens > room:
        p = msgspec.structs.replace(p, max_tokens=room, min_tokens=min(p.min_tokens, room))
    return p
