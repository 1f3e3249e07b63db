"""max_tokens against the room a prompt leaves: capped when it is a default, refused when a
client set it (OpenAI's and vLLM's HTTP behaviour), and a full context is always refused."""

from __future__ import annotations

import pytest

from actors.tokenizer.validation import (
    BadRequest,
    ContextTooLong,
    check_fits_kv_pool,
    check_prompt_size,
    fit_to_context,
    refusal_code,
)
from transport.messages.params import GenerationParams


def test_a_default_is_capped_at_the_room_left():
    p = fit_to_context(GenerationParams(max_tokens=100, min_tokens=50), 90, 100)
    assert (p.max_tokens, p.min_tokens) == (10, 10)


def test_an_explicit_max_tokens_past_the_room_is_refused():
    strict = GenerationParams(max_tokens=11, max_tokens_strict=True)
    with pytest.raises(BadRequest, match=r"^max_tokens: .*context is 100 tokens.*at most 10"):
        fit_to_context(strict, 90, 100)
    fitting = GenerationParams(max_tokens=10, max_tokens_strict=True)
    assert fit_to_context(fitting, 90, 100) == fitting


def test_a_prompt_that_fills_the_context_is_refused_either_way():
    for strict in (False, True):
        with pytest.raises(BadRequest, match="context is 100 tokens"):
            fit_to_context(GenerationParams(max_tokens_strict=strict), 100, 100)


def test_a_prompt_the_whole_kv_pool_cannot_hold_is_refused():
    check_fits_kv_pool(160, 160)  # it fills the pool: its first token is still sampled
    with pytest.raises(BadRequest, match=r"prompt is 161 tokens; .*KV cache holds 160 tokens"):
        check_fits_kv_pool(161, 160)
    check_fits_kv_pool(10**6, 0)  # a pool not known here checks nothing


def _http_error(exc: BadRequest):
    """What an HTTP client gets for a refusal, carried as the tokenizer carries it."""
    from actors.frontends.base import GenerationError
    from actors.frontends.http.errors import from_generation_error

    return from_generation_error(GenerationError(refusal_code(exc), str(exc)))


def test_too_long_reaches_http_clients_as_context_length_exceeded():
    """Over the pool, over the context (in tokens, or in characters before tokenizing), or
    a fixed max_tokens past the room: each a 400 with OpenAI's code."""
    refusals = [
        lambda: check_fits_kv_pool(161, 160),
        lambda: fit_to_context(GenerationParams(), 100, 100),
        lambda: fit_to_context(GenerationParams(max_tokens=11, max_tokens_strict=True), 90, 100),
        lambda: check_prompt_size(10_001, 100, 100),
    ]
    for refuse in refusals:
        with pytest.raises(ContextTooLong) as refused:
            refuse()
        error = _http_error(refused.value)
        assert (error.status, error.detail.code) == (400, "context_length_exceeded")


def test_a_clients_own_text_never_picks_the_code():
    """The code comes from the refusal's class: a message quoting a client's text that
    reads like a context refusal is still a plain 400."""
    quoted = BadRequest("request id 'this model's context is 5 tokens' is already running")
    error = _http_error(quoted)
    assert (error.status, error.detail.code) == (400, None)
    assert _http_error(BadRequest("prompt is empty")).detail.code is None
