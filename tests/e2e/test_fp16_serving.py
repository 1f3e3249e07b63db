"""`model.linear = "fp16"` (what `auto` picks for an fp32 model on an x86 CPU) through the
whole engine: fp16-stored weights, fp32 activations and accumulation, against HF
transformers' exact fp32 model."""

from __future__ import annotations

import pytest
import torch

from actors.app.serving import ServingEngine
from kernels.linear import fp16_linear_works
from tests.e2e.engine_fixtures import assert_balanced, natural_text, random_prompts, small_config
from tests.e2e.test_engine_e2e import hf_greedy
from transport.messages.engine import GenerationParams

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.model,
    pytest.mark.skipif(not fp16_linear_works(), reason="fbgemm's fp16 linear does not run here"),
]

NEW_TOKENS = 8
NO_EOS = [-1]  # HF greedy to the full length, as ignore_eos


async def test_fp16_weights_serve_within_fp16_rounding_of_hf_fp32(tokenizer, hf_model):
    async with ServingEngine(small_config(model__linear="fp16")) as eng:
        # Prompt logprobs: every position's distribution, one request alone.
        ids = tokenizer.encode(natural_text()[:1500])
        params = GenerationParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        res = await eng.client.complete(params, prompt_ids=ids)
        got = torch.tensor([lp.logprob for lp in res.prompt_logprobs[1:]])
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        error = (got - want).abs()
        # fp16's rounding shows (the layout is in effect) and stays small: measured on the
        # embedded model, max 0.0085 and mean 0.0013 nats over 322 tokens.
        assert 0 < error.max() < 0.05 and error.mean() < 0.005, (error.max(), error.mean())

        # Greedy text: 24 requests decode together, so the LM head's wide calls (oneDNN on
        # the same fp16-rounded values) and narrow ones (fbgemm) both serve them.
        prompts = random_prompts(tokenizer, 24, 5, 120, seed=5)
        greedy = GenerationParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        results = await eng.generate_batch(prompts, greedy)
        expected = [hf_greedy(hf_model, p, NEW_TOKENS, NO_EOS) for p in prompts]
        same = sum(a == b for r, e in zip(results, expected) for a, b in zip(r.token_ids, e))
        # fp32 weights give 100% here; fp16 ones did too on the embedded model. A near-tie
        # may flip once in a while on another CPU's summation order: allow a little.
        assert same >= 0.95 * len(prompts) * NEW_TOKENS, same
        await assert_balanced(eng)
