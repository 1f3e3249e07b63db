"""Greedy output of a request must not depend on what else shares its forward passes.

Checked on the embedded Gemma 3 270M (fp32): alone vs in a batch of 8 requests of different
lengths; whole-prompt prefill vs 64-token chunks; and a continuous-batching schedule where
one request's chunked prefill rides in the same forwards as another request's decode steps.
"""

from __future__ import annotations

import copy

import pytest

from kernels.forward_batch import ForwardBatch
from kernels.linear import fp16_linear_works, pack_linears
from kernels.lm_head import LmHead, fp16_plan, onednn_available
from kernels.q8_0 import vectorized as q8_0_vectorized
from kernels.tokenizer_loader import load_tokenizer
from tests.model.model_fixtures import GreedyRunner, make_executor

pytestmark = pytest.mark.model

NEW_TOKENS = 16
CAPACITY = 1024

BASE_TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. "
    "Later, towers of stone carried lamps fed with whale oil, then kerosene, and finally "
    "electric bulbs behind great glass lenses that could throw a beam twenty miles out to sea. "
    "Keepers lived in small cottages at the foot of the tower, trimming wicks at midnight, "
    "polishing brass, and writing the weather in a leather logbook every four hours. "
)
# Eight prompts of different lengths (a few tokens to a few hundred).
PROMPT_CHARS = [20, 75, 160, 300, 520, 900, 1400, 2000]


@pytest.fixture(scope="module")
def model(embedded_fp32):
    return embedded_fp32


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = load_tokenizer(None)
    text = BASE_TEXT * 6
    ids = [tok.encode(text[:n]) for n in PROMPT_CHARS]
    assert len({len(p) for p in ids}) == len(ids)
    return ids


@pytest.fixture(scope="module")
def alone_outputs(model, prompts) -> list[list[int]]:
    config, module = model
    outputs = []
    for prompt in prompts:
        executor, slots = make_executor(config, module, 1, CAPACITY)
        outputs.append(GreedyRunner(executor, slots).generate([prompt], NEW_TOKENS)[0])
    return outputs


def test_batch_of_eight_matches_alone(model, prompts, alone_outputs):
    config, module = model
    executor, slots = make_executor(config, module, len(prompts), CAPACITY)
    batched = GreedyRunner(executor, slots).generate(prompts, NEW_TOKENS)
    assert batched == alone_outputs


def test_chunked_prefill_matches_whole(model, prompts, alone_outputs):
    config, module = model
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert len(prompts[longest]) > 3 * 64
    executor, slots = make_executor(config, module, 1, CAPACITY)
    chunked = GreedyRunner(executor, slots).generate([prompts[longest]], NEW_TOKENS, chunk=64)
    assert chunked[0] == alone_outputs[longest]


def test_chunked_prefill_with_paged_kv_matches(model, prompts, alone_outputs):
    """Same chunked prefill with 16-slot pages (slots still page-aligned per row)."""
    config, module = model
    index = 5
    executor, slots = make_executor(config, module, 2, CAPACITY, page_size=16)
    out = GreedyRunner(executor, slots).generate([prompts[index], prompts[0]], NEW_TOKENS, chunk=64)
    assert out == [alone_outputs[index], alone_outputs[0]]


def test_prefill_chunks_mixed_with_decode_steps(model, prompts, alone_outputs):
    """Request A decodes while request B's prompt arrives in 64-token chunks in the same
    forwards (B asks for logits only on its last chunk), then both decode together."""
    config, module = model
    a, b = 2, 6
    executor, slots = make_executor(config, module, 2, CAPACITY)
    prompt_a, prompt_b = prompts[a], prompts[b]

    deltas = slots.extend([0], [len(prompt_a)])
    first = executor.forward(ForwardBatch([0], [0], [prompt_a], [True], deltas))
    out_a = [int(first[0].argmax())]
    out_b: list[int] = []
    done_b = 0
    while len(out_a) < NEW_TOKENS or len(out_b) < NEW_TOKENS:
        rows, prefix, ids, need = [], [], [], []
        if len(out_a) < NEW_TOKENS:
            rows.append(0)
            prefix.append(len(prompt_a) + len(out_a) - 1)
            ids.append([out_a[-1]])
            need.append(True)
        if done_b < len(prompt_b):
            piece = prompt_b[done_b : done_b + 64]
            rows.append(1)
            prefix.append(done_b)
            ids.append(piece)
            need.append(done_b + len(piece) == len(prompt_b))
            done_b += len(piece)
        elif len(out_b) < NEW_TOKENS:
            rows.append(1)
            prefix.append(len(prompt_b) + len(out_b) - 1)
            ids.append([out_b[-1]])
            need.append(True)
        deltas = slots.extend(rows, [len(x) for x in ids])
        logits = executor.forward(ForwardBatch(rows, prefix, ids, need, deltas))
        next_ids = iter(logits.argmax(-1).tolist())
        for row, flag in zip(rows, need):
            if flag:
                (out_a if row == 0 else out_b).append(int(next(next_ids)))
    assert out_a == alone_outputs[a]
    assert out_b == alone_outputs[b]


@pytest.mark.skipif(not fp16_linear_works(), reason="fbgemm's fp16 linear does not run here")
def test_fp16_layout_batch_of_24_matches_alone(model, prompts):
    """fp16-stored weights (`model.linear = "fp16"`): a request's greedy output is the same
    alone (every LM head call narrow: fbgemm's fp16 product) and among 24 (wide calls: oneDNN
    on the same fp16-rounded values)."""
    config, module = model
    fp16 = copy.deepcopy(module)
    assert pack_linears(fp16.layers, "fp16") > 0
    head = LmHead(fp16.lm_head_weight, config.final_logit_softcap, backend=fp16_plan())
    assert head.backend_for(24) != head.backend_for(1) or not onednn_available()
    alone, together = _alone_and_among_24(config, fp16, head, prompts)
    assert together[:8] == alone


def _alone_and_among_24(config, module, head, prompts) -> tuple[list, list]:
    """Greedy outputs of 8 requests each alone, and of the same 8 among 24 at once."""
    batch = [prompts[i % len(prompts)][: 40 + 13 * i] for i in range(24)]
    alone = []
    for prompt in batch[:8]:
        executor, slots = make_executor(config, module, 1, CAPACITY, lm_head=head)
        alone.append(GreedyRunner(executor, slots).generate([prompt], NEW_TOKENS)[0])
    executor, slots = make_executor(config, module, len(batch), CAPACITY, lm_head=head)
    return alone, GreedyRunner(executor, slots).generate(batch, NEW_TOKENS)


@pytest.mark.skipif(
    not (fp16_linear_works() and q8_0_vectorized()), reason="needs fbgemm's fp16 and the kernel"
)
def test_fp16_layout_with_gguf_blocks_batch_of_24_matches_alone(model, prompts):
    """The fp32 model as the runner builds it (`model.linear = "fp16"` on the embedded GGUF):
    narrow calls read the head's and every linear's own blocks (int16 activations), wide
    ones oneDNN's exact head and fbgemm's fp16 linears. A request's greedy output is the
    same alone and among 24."""
    config, module = model
    fp16 = copy.deepcopy(module)
    first, _ = make_executor(config, fp16, 1, CAPACITY, linear="fp16")
    assert first.linear_blocks == 4 * config.num_layers and first.lm_head.backend_for(1) == "q8_0"
    alone, together = _alone_and_among_24(config, fp16, first.lm_head, prompts)
    assert together[:8] == alone
