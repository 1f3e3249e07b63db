"""The embedded Gemma 3 270M on our executor vs HF transformers loading the same GGUF (fp32).

Last-position logits must agree within 1e-3 relative L2 on several prompts (one longer than
1,000 tokens, past the 512-token sliding window), with whole and chunked prefill; greedy
32-token continuations must equal HF's greedy `generate`.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.model_fixtures import GreedyRunner, make_executor, rel_l2

pytestmark = pytest.mark.model

LONG_TEXT = (
    "Notes from the observatory log, kept in order.\n"
    + "\n".join(
        f"Entry {i}: on night {i} the sky over station {chr(65 + i % 26)} was "
        f"{['clear', 'hazy', 'cloudy', 'windy', 'still'][i % 5]}, and we recorded "
        f"{(i * 37) % 101} meteors and {(i * 13) % 7} satellites before dawn."
        for i in range(1, 46)
    )
    + "\nSummary of the log: the clearest night was"
)

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived",
    "Translate to German: The weather is nice today. ->",
    "Liste des courses : pommes, poires, 🍌 bananes, et",
    LONG_TEXT,
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert max(len(p) for p in ids) > 1000, "the long prompt must cross 1,000 tokens"
    return ids


@pytest.fixture(scope="module")
def ours(embedded_fp32):
    return embedded_fp32


@pytest.fixture(scope="module")
def hf_last_logits(hf_model, prompt_ids) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [
            hf_model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
            for ids in prompt_ids
        ]


def _runner(ours, num_rows: int, capacity: int) -> GreedyRunner:
    config, model = ours
    executor, slots = make_executor(config, model, num_rows, capacity)
    return GreedyRunner(executor, slots)


def test_config_matches_hf(ours, hf_model):
    config, _ = ours
    hf = hf_model.config
    assert config.num_layers == hf.num_hidden_layers
    assert config.sliding_window == hf.sliding_window
    assert list(config.layer_types) == list(hf.layer_types)
    assert config.rope.theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local.theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.attn_scale == pytest.approx(hf.query_pre_attn_scalar**-0.5)


def test_prefill_logits_match_hf(ours, prompt_ids, hf_last_logits):
    runner = _runner(ours, len(prompt_ids), 2048)
    logits = runner.prefill_logits(prompt_ids)  # all prompts in one ragged batch
    errors = [rel_l2(logits[i], hf_last_logits[i]) for i in range(len(prompt_ids))]
    assert max(errors) < 1e-3, errors
    for i, ref in enumerate(hf_last_logits):
        assert int(logits[i].argmax()) == int(ref.argmax())


def test_chunked_prefill_logits_match_hf(ours, prompt_ids, hf_last_logits):
    long_index = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    runner = _runner(ours, 1, 2048)
    logits = runner.prefill_logits([prompt_ids[long_index]], chunk=200)
    assert rel_l2(logits[0], hf_last_logits[long_index]) < 1e-3


def test_greedy_matches_hf_generate(ours, hf_model, prompt_ids):
    new_tokens = 32
    eos = hf_model.generation_config.eos_token_id
    stop_ids = tuple(eos if isinstance(eos, list) else [eos])
    runner = _runner(ours, len(prompt_ids), 2048)
    got = runner.generate(prompt_ids, new_tokens, stop_ids=stop_ids)
    with torch.inference_mode():
        for ids, ours_out in zip(prompt_ids, got):
            out = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )
            want = out[0, len(ids) :].tolist()
            assert ours_out == want
