"""Tiny random-weight Llama / Qwen2 / Qwen3 / Gemma 3 vs HF transformers, via hf_loader.

Each model is built from a transformers config in the test (no download), saved with
save_pretrained, loaded back through our HF-folder loader, and compared with the HF model's
own logits: ragged multi-prompt prefill, prompts longer than a sliding window of 8, chunked
prefill, and teacher-forced decode steps. The attention backend is also checked directly
against a dense reference (including logit soft-capping, which no tested model uses).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata, AttentionShape, make_attention_backend
from kernels.forward_batch import ForwardBatch
from kernels.kv_cache import KVCache, ReqToTokenTable
from kernels.models import load_model
from tests.model.model_fixtures import (
    TINY_COMMON,
    TINY_GEMMA3_WINDOW8,
    TINY_VOCAB,
    GreedyRunner,
    make_executor,
    rel_l2,
)

VOCAB = TINY_VOCAB
COMMON = TINY_COMMON


def _configs():
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "llama3_rope": LlamaConfig(
            **COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "qwen2_bias_sliding": Qwen2Config(
            **COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
        "qwen3_qk_norm": Qwen3Config(
            **COMMON,
            num_hidden_layers=2,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=True,
        ),
        "gemma3_window8": Gemma3TextConfig(
            **COMMON,
            **TINY_GEMMA3_WINDOW8,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    }


CASES = list(_configs())


@pytest.fixture(scope="module", params=CASES)
def tiny(request, tmp_path_factory):
    """(name, HF model, our config, our model) for one tiny architecture."""
    from transformers import AutoModelForCausalLM

    hf_config = _configs()[request.param]
    torch.manual_seed(1234)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():  # make Gemma's zero-initialised norms non-trivial too
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    config, model = load_model(folder, torch.float32)
    return request.param, hf, config, model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 13, 31, 47)]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_config_read_from_folder(tiny):
    name, hf, config, _ = tiny
    assert config.num_layers == hf.config.num_hidden_layers
    assert config.vocab == VOCAB
    assert config.tie_embeddings == hf.config.tie_word_embeddings
    hf_types = getattr(hf.config, "layer_types", None) or ["full_attention"] * config.num_layers
    assert list(config.layer_types) == list(hf_types)
    if name.startswith("gemma3"):
        assert config.sliding_window == 8
        assert config.rope.kind == "linear" and config.rope_local.theta == 1e4
        assert config.final_logit_softcap == 30.0


def test_prefill_logits_match_hf(tiny):
    _, hf, config, model = tiny
    prompts = _prompts()
    executor, slots = make_executor(config, model, len(prompts), 128)
    logits = GreedyRunner(executor, slots).prefill_logits(prompts)
    for i, ids in enumerate(prompts):
        assert rel_l2(logits[i], _hf_logits(hf, ids)[-1]) < 1e-3


@pytest.mark.parametrize("chunk,page_size", [(7, 1), (8, 4)])
def test_chunked_prefill_and_decode_match_hf(tiny, chunk, page_size):
    """Chunks crossing the window edge, then teacher-forced decode steps for two requests."""
    _, hf, config, model = tiny
    prompts = _prompts()[2:]
    executor, slots = make_executor(config, model, len(prompts), 128, page_size=page_size)
    runner = GreedyRunner(executor, slots)
    logits = runner.prefill_logits(prompts, chunk=chunk)
    gen = torch.Generator().manual_seed(11)
    continuations = [torch.randint(3, VOCAB, (6,), generator=gen).tolist() for _ in prompts]
    references = [_hf_logits(hf, p + c) for p, c in zip(prompts, continuations)]
    for i, p in enumerate(prompts):
        assert rel_l2(logits[i], references[i][len(p) - 1]) < 1e-3
    rows = list(range(len(prompts)))
    for step in range(len(continuations[0])):
        lens = [len(p) + step for p in prompts]
        tokens = [c[step] for c in continuations]
        batch = ForwardBatch.decode(rows, lens, tokens, slots.extend(rows, [1] * len(rows)))
        step_logits = executor.forward(batch)
        for i in rows:
            assert rel_l2(step_logits[i], references[i][lens[i]]) < 1e-3


def test_greedy_matches_hf_generate(tiny):
    _, hf, config, model = tiny
    prompt = _prompts()[3]
    executor, slots = make_executor(config, model, 1, 128)
    ours = GreedyRunner(executor, slots).generate([prompt], 10)[0]
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=False,
            min_new_tokens=10,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    # min_new_tokens only masks EOS; compare up to our first EOS (none expected usually).
    want = out[0, len(prompt) :].tolist()
    if 2 in ours:
        ours = ours[: ours.index(2)]
        want = want[: len(ours)]
    assert ours == want


# ---------------------------------------------------------------------------------------------
# The reference backend against a dense per-request computation
# ---------------------------------------------------------------------------------------------
def _dense_attention(q, k, v, q_pos, k_pos, scale, softcap, window, group):
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("sliding", [False, True])
def test_torch_backend_matches_dense_attention(softcap, sliding):
    torch.manual_seed(0)
    heads, kv_heads, dim, window, page = 4, 2, 8, 6, 4
    shape = AttentionShape(heads, kv_heads, dim, dim**-0.5, softcap, window)
    # Mixed batch: a prefill chunk on a cached prefix, a decode token, a fresh prompt.
    prefix_lens, extends = [9, 14, 0], [5, 1, 11]
    capacity, rows = 32, len(prefix_lens)
    cache = KVCache(1, page + rows * capacity, kv_heads, dim, page_size=page)
    table = ReqToTokenTable(rows, capacity)
    # Rows use pages in scrambled order, to make sure nothing assumes contiguous slots.
    pages = torch.randperm(rows * capacity // page) + 1
    flat = (pages[:, None] * page + torch.arange(page)).reshape(rows, capacity)
    table.apply_slot_deltas(list(range(rows)), [0] * rows, [capacity] * rows, flat.reshape(-1))
    all_k = [torch.randn(p + e, kv_heads, dim) for p, e in zip(prefix_lens, extends)]
    all_v = [torch.randn(p + e, kv_heads, dim) for p, e in zip(prefix_lens, extends)]
    for r, p in enumerate(prefix_lens):
        if p:
            cache.write(0, table.table[r, :p].long(), all_k[r][:p], all_v[r][:p])
    batch = ForwardBatch(list(range(rows)), prefix_lens, [[0] * e for e in extends], [True] * rows)
    meta = AttentionMetadata.build(batch, table, cache, shape)
    backend = make_attention_backend("torch")
    backend.plan(meta)
    q = torch.randn(sum(extends), heads, dim)
    k_new = torch.cat([k[p:] for k, p in zip(all_k, prefix_lens)])
    v_new = torch.cat([v[p:] for v, p in zip(all_v, prefix_lens)])
    out = backend.forward(0, q, k_new, v_new, cache, is_sliding=sliding)
    begin = 0
    for r, (p, e) in enumerate(zip(prefix_lens, extends)):
        want = _dense_attention(
            q[begin : begin + e],
            all_k[r],
            all_v[r],
            torch.arange(p, p + e),
            torch.arange(p + e),
            shape.scale,
            softcap,
            window if sliding else None,
            2,
        )
        torch.testing.assert_close(out[begin : begin + e], want, rtol=1e-5, atol=1e-5)
        begin += e
    paged = meta.paged_kv
    assert paged.kv_page_indptr.tolist() == [0, 4, 8, 11]
    assert paged.kv_last_page_len.tolist() == [2, 3, 3]
    assert torch.equal(paged.kv_page_indices[:4], flat[0, ::page][:4].int() // page)
