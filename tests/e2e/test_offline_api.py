"""The offline batch API: a list of prompts in, results with ids, text, reasons, timings out."""

from __future__ import annotations

import pytest

from actors.app.serving import generate_offline
from tests.e2e.engine_fixtures import small_config
from transport.messages.engine import GenerationParams


@pytest.mark.model
def test_generate_offline_returns_results_in_prompt_order():
    prompts = ["Count with me: 1, 2, 3, 4, 5,", "The alphabet: A, B, C, D,", [2, 818, 5279]]
    params = [
        GenerationParams(max_tokens=6, temperature=0.0),
        GenerationParams(max_tokens=4, temperature=0.0, stop=[" F"]),
        GenerationParams(max_tokens=3, temperature=0.0),
    ]
    results = generate_offline(prompts, params, config=small_config(kv__num_pages=128))
    assert [r.finish_reason for r in results] == ["length", "stop", "length"]
    assert results[0].text.startswith(" 6, 7") and len(results[0].token_ids) == 6
    assert results[1].text == " E,"
    assert results[2].prompt_tokens == 3 and len(results[2].token_ids) == 3
    for r in results:
        assert 0 < r.ttft_s <= r.total_s
