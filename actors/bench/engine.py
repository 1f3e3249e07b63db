"""bin/engine bench engine: kvactor end to end vs HF transformers on the same prompts.

Both run in this process, one after the other, on identical prompts (greedy,
ignore EOS, fixed output length), so the ratio is meaningful on a noisy machine:
  - single stream: one prompt, N new tokens -> tok/s
  - batch B: B distinct ~100-token prompts, N new tokens each -> output tok/s (wall)
Options: --batch 8 --new-tokens 64 --hf/--no-hf --set section.key=value ...
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch

from actors.app.config import load_config
from actors.app.corpus import natural_text
from actors.app.serving import ServingEngine
from transport.messages.engine import GenerationParams


def _prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(natural_text(), add_special_tokens=False)
    step = max(1, (len(ids) - length) // max(batch, 1))
    return [[tokenizer.bos_id] + ids[i * step : i * step + length - 1] for i in range(batch)]


async def _kvactor(cfg, prompts, single, new_tokens):
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    async with ServingEngine(cfg) as eng:
        await eng.generate_batch([single[:8]], GenerationParams(max_tokens=2, temperature=0.0))
        t = time.perf_counter()
        [one] = await eng.generate_batch([single], params)
        single_s = time.perf_counter() - t
        t = time.perf_counter()
        res = await eng.generate_batch(prompts, params)
        batch_s = time.perf_counter() - t
        stats = await eng.scheduler_stats()
    return {
        "single_tok_s": new_tokens / single_s,
        "single_ttft_s": one.ttft_s,
        "batch_tok_s": sum(len(r.token_ids) for r in res) / batch_s,
        "batch_wall_s": batch_s,
        "steps": stats.steps,
    }


def _hf(prompts, single, new_tokens, pad_id):
    from transformers import AutoModelForCausalLM

    from kernels.gguf_loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.inference_mode():
        model.generate(torch.tensor([single[:8]]), max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        model.generate(torch.tensor([single]), **kw)
        single_s = time.perf_counter() - t
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, pad_token_id=pad_id, **kw)
        batch_s = time.perf_counter() - t
    return {
        "single_tok_s": new_tokens / single_s,
        "batch_tok_s": len(prompts) * new_tokens / batch_s,
        "batch_wall_s": batch_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(prog="bin/engine bench engine")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-threads", type=int, default=2, help="torch threads for HF's run")
    ap.add_argument("--config")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    from kernels.tokenizer_loader import load_tokenizer

    cfg = load_config(args.config, args.set)
    tok = load_tokenizer(None)
    prompts = _prompts(tok, args.batch, args.prompt_len)
    single = _prompts(tok, 1, 21)[0]
    ours = anyio.run(_kvactor, cfg, prompts, single, args.new_tokens)
    print(
        f"kvactor  single: {ours['single_tok_s']:.1f} tok/s (ttft {ours['single_ttft_s']:.2f}s)"
        f"  batch {args.batch}: {ours['batch_tok_s']:.1f} tok/s ({ours['batch_wall_s']:.1f}s)"
    )
    if not args.no_hf:
        torch.set_num_threads(args.hf_threads)
        hf = _hf(prompts, single, args.new_tokens, tok.pad_id or 0)
        print(
            f"HF fp32 ({args.hf_threads} threads) single: {hf['single_tok_s']:.1f} tok/s"
            f"  batch {args.batch}: {hf['batch_tok_s']:.1f} tok/s ({hf['batch_wall_s']:.1f}s)"
        )
        print(
            f"ratio kvactor/HF  single {ours['single_tok_s'] / hf['single_tok_s']:.2f}x"
            f"  batch {ours['batch_tok_s'] / hf['batch_tok_s']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
