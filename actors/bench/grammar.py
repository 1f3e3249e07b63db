"""Benchmark constrained decoding on the served model's vocabulary (Gemma 3: 262,144 tokens).

    bin/engine bench grammar [--batch 1 32] [--reps 20] [--json out.json] [--llguidance]

Reports, for xgrammar (the engine's grammar engine): the tokenizer preparation (once per
process), the compile time of a typical JSON schema, a regex and JSON mode (cold: each
compiled once, no cache), and the cost a constrained decode step adds at each batch size:
filling the matchers' bitmasks, applying them to float32 logits (the engine's numpy unpack
vs xgrammar's own CPU kernel), and `Sampler.sample` with every row constrained minus the
same call unconstrained. `--llguidance` adds llguidance's tokenizer preparation, compile and
fill times for the same schema, when it is installed (it is not a dependency).
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec
import numpy as np
import torch

from actors.bench.timing import time_calls
from kernels.grammar import GrammarEngine, apply_token_bitmask
from kernels.sampling import Sampler
from kernels.tokenizer_loader import load_tokenizer
from transport.messages.params import GenerationParams, OutputConstraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
}
# Where the matchers sit: inside a string value (most tokens allowed) and between fields
# (a handful allowed): the two ends of the masking cost.
STATES = {"in a string": '{"name": "Ada Lovelace, born in', "between fields": '{"name": "Ada", '}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(batches: list[int], reps: int, with_llguidance: bool) -> dict:
    torch.set_num_threads(1)  # the sampler's setting in the runner
    bundle = load_tokenizer(None)
    vocab = bundle.vocab_size
    out: dict = {"vocab": vocab, "engine": "xgrammar"}
    t0 = time.perf_counter()
    engine = GrammarEngine(bundle.tokenizer, vocab, bundle.eos_ids)
    out["tokenizer_prep_ms"] = _ms(time.perf_counter() - t0)
    schema = json.dumps(SCHEMA)
    out["compile_ms"] = {
        "json_schema": _ms(_timed(lambda: engine.compile("json_schema", schema))),
        "regex": _ms(_timed(lambda: engine.compile("regex", r"[A-Z][a-z]{2,8} is \d{1,3}\."))),
        "json_object": _ms(_timed(lambda: engine.compile("json_object"))),
    }
    compiled = engine.compile("json_schema", schema)
    constraint = OutputConstraint(kind="json_schema", spec=schema)
    rows = []
    for (state, text), n in ((s, n) for s in STATES.items() for n in batches):
        prefix = bundle.encode(text, add_special_tokens=False)
        matchers = [engine.matcher(compiled) for _ in range(n)]
        for m in matchers:
            assert all(m.accept(t) for t in prefix), "prefix rejected by the schema"
        bitmask = engine.bitmask(n)
        fill = time_calls(lambda: [m.fill(bitmask, j) for j, m in enumerate(matchers)], reps)
        logits = torch.randn(n, vocab)
        apply_ours = time_calls(lambda: apply_token_bitmask(logits, bitmask, list(range(n))), reps)
        import xgrammar as xgr

        apply_xgr = time_calls(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask), reps)
        # Whole sampler step, greedy: constrained rows (matchers never advance: the same
        # state each step) minus the same rows free.
        free_params = GenerationParams(temperature=0.0)
        tight = msgspec.structs.replace(free_params, constraint=constraint)
        free_s, tight_s = Sampler(), Sampler()
        for rid in range(n):
            free_s.add_request(rid, free_params, [])
            tight_s.add_request(rid, tight, [], _Frozen(engine.matcher(compiled), prefix))
        base = torch.randn(n, vocab)
        rids = list(range(n))
        free_t = time_calls(lambda: free_s.sample(rids, base.clone()), reps)
        tight_t = time_calls(lambda: tight_s.sample(rids, base.clone()), reps)
        rows.append(
            {
                "state": state,
                "allowed_per_row": int(np.bitwise_count(bitmask.numpy().view(np.uint32)).sum())
                // n,
                "batch": n,
                "fill_ms": _ms(fill.median),
                "apply_ms": _ms(apply_ours.median),
                "apply_xgrammar_kernel_ms": _ms(apply_xgr.median),
                "sampler_free_ms": _ms(free_t.median),
                "sampler_constrained_ms": _ms(tight_t.median),
                "mask_cost_per_step_ms": _ms(tight_t.median - free_t.median),
            }
        )
    out["per_step"] = rows
    if with_llguidance:
        prefix = bundle.encode(STATES["in a string"], add_special_tokens=False)
        out["llguidance"] = _llguidance(bundle, vocab, schema, prefix, batches, reps)
    return out


class _Frozen:
    """A matcher held at one state: `accept` is a no-op, so every step masks the same."""

    def __init__(self, matcher, prefix: list[int]) -> None:
        for t in prefix:
            matcher.accept(t)
        self._m = matcher
        self.vocab_size = matcher.vocab_size

    def fill(self, bitmask, row: int) -> None:
        self._m.fill(bitmask, row)

    def accept(self, token: int) -> bool:
        return True


def _llguidance(bundle, vocab: int, schema: str, prefix: list[int], batches, reps) -> dict:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return {"error": "llguidance is not installed"}
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(
        PreTrainedTokenizerFast(tokenizer_object=bundle.tokenizer), n_vocab=vocab
    )
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t0
    fills = {}
    for n in batches:
        matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(n)]
        for m in matchers:
            m.consume_tokens(prefix)
        bitmask = lt.allocate_token_bitmask(n, vocab)
        t = time_calls(
            lambda: [lt.fill_next_token_bitmask(m, bitmask, j) for j, m in enumerate(matchers)],
            reps,
        )
        fills[str(n)] = _ms(t.median)
    return {"tokenizer_prep_ms": _ms(prep), "compile_ms": _ms(compile_s), "fill_ms": fills}


def main() -> int:
    ap = argparse.ArgumentParser(prog="bin/engine bench grammar", description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--llguidance", action="store_true", help="compare with llguidance")
    args = ap.parse_args()
    result = run(args.batch, args.reps, args.llguidance)
    print(f"vocabulary {result['vocab']}, tokenizer preparation {result['tokenizer_prep_ms']} ms")
    print("compile (cold): " + ", ".join(f"{k} {v} ms" for k, v in result["compile_ms"].items()))
    print(
        "\n| state | allowed/row | batch | fill ms | apply ms (engine) "
        "| apply ms (xgrammar kernel only) | sampler free ms | sampler constrained ms "
        "| mask cost per step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["per_step"]:
        print(
            f"| {r['state']} | {r['allowed_per_row']} | {r['batch']} | {r['fill_ms']} "
            f"| {r['apply_ms']} | {r['apply_xgrammar_kernel_ms']} "
            f"| {r['sampler_free_ms']} | {r['sampler_constrained_ms']} "
            f"| {r['mask_cost_per_step_ms']} |"
        )
    if "llguidance" in result:
        print(f"\nllguidance: {json.dumps(result['llguidance'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
