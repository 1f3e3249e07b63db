"""max_tokens against the room a prompt leaves: capped when it is a default, refused when a
client set it (OpenAI's and vLLM's HTTP behaviour), and a full context is always refused."""

from __future__ import annotations

import pytest

from actors.tokenizer.validation import BadRequest, fit_to_context
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
