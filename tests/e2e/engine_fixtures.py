"""Shared pieces of the end-to-end engine tests: configs, prompts, the balance check."""

from __future__ import annotations

import random

from actors.app.corpus import natural_text
from actors.app.serving import EngineConfig, ServingEngine


def small_config(**overrides) -> EngineConfig:
    base = dict(
        kv__num_pages=512,
        kv__page_size=16,
        kv__context_len=2048,
        kv__max_rows=40,
        scheduler__max_running_requests=32,
        scheduler__max_batch_tokens=1024,
        scheduler__chunk_size=256,
        engine__debug_checks=True,
        model__dtype="float32",  # HF parity is checked in fp32, on the exact weights
        model__linear="aten",  # (auto stores an fp32 model's weights in fp16)
        model__threads=1,
        model__compile="off",  # compiled steps have tests of their own (test_compiled_step)
    )
    base.update(overrides)
    return EngineConfig.load(**base)


async def assert_balanced(eng: ServingEngine) -> None:
    """Idle engine: no request holds KV; free + tree == total; invariants hold."""
    stats = await eng.kv_stats(check_invariants=True)
    assert stats.records == 0, f"{stats.records} request records left: {stats}"
    assert stats.held_rows == 0 and stats.held_pages == 0, stats
    assert stats.free_pages + stats.tree_pages == stats.total_pages, stats
    assert stats.evictable_pages == stats.tree_pages, f"tree locks leaked: {stats}"


async def settle(eng: ServingEngine, tries: int = 100) -> None:
    """Let in-flight requests and aborts land (up to `tries` x 50 ms), then the pools must
    balance (`assert_balanced`)."""
    import anyio

    for _ in range(tries):
        s = await eng.scheduler_stats()
        if s.waiting == s.running == s.prefilling == 0:
            break
        await anyio.sleep(0.05)
    await assert_balanced(eng)


def random_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append([tokenizer.bos_id] + ids[start : start + length - 1])
    return out


def save_tiny_llama(folder, vocab_size: int, max_position_embeddings: int = 512) -> None:
    """A seeded random 2-layer Llama (hidden 64, GQA 4/2) saved as a Hugging Face folder:
    the model of the e2e tests that serve a tokenizer and template of their own (ids 0-2
    are pad, bos, eos)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


TINY_LLAMA_VOCAB = 300


def hf_tokenizer(tok):
    """A `tokenizers.Tokenizer` as a transformers fast tokenizer with the tiny models'
    special tokens (<s>, </s>, <unk>, <pad>: ids 1, 2, 3, 0 in their vocabularies)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def tiny_llama_folder(root):
    """A random-weight Llama with a word-level tokenizer, a chat template and a
    generation_config.json, saved as a Hugging Face folder."""
    import json

    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    folder = root / "tiny-llama"
    save_tiny_llama(folder, TINY_LLAMA_VOCAB)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab |= {f"w{i}": i for i in range(4, TINY_LLAMA_VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = hf_tokenizer(tok)
    hf_tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w9{% endif %}"
    )
    hf_tok.save_pretrained(folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "max_new_tokens": 5, "bos_token_id": 1, "eos_token_id": 2})
    )
    return folder
