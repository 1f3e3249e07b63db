"""The compiled small-step graph (kernels/compiled_step.py) against the eager executor.

Tiny random models (a Gemma 3 with a sliding window of 8 and soft-capping, a Llama with
4 query / 2 KV heads on fbgemm's fp16-packed linears) are compiled once per module. The
executor keeps a split KV pool with a permuted sliding-page map, so the graph's own
sliding-window mapping is exercised. Every case runs the same step eagerly and through the
graph, writing the same slots, and compares logits and the K/V written.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.attention import make_attention_backend
from kernels.compiled_step import (
    CompiledStep,
    cache_root,
    compile_choice,
    compile_verified_here,
    extra_gather_bytes,
    key_lanes,
)
from kernels.forward_batch import ForwardBatch
from kernels.kv_cache import KVCache, ReqToTokenTable
from kernels.model_executor import ModelExecutor
from kernels.models import load_model
from tests.model.model_fixtures import TINY_COMMON, TINY_GEMMA3_WINDOW8, TINY_VOCAB

PAGE = 4
ROWS = 4
CAPACITY = 64  # slots per row: row r owns full pages r * 16 + 1 .. (r + 1) * 16
VOCAB = TINY_VOCAB
COMMON = TINY_COMMON


def _hf_config(name: str):
    from transformers import Gemma3TextConfig, LlamaConfig

    if name == "gemma3":
        return Gemma3TextConfig(**COMMON, **TINY_GEMMA3_WINDOW8)
    return LlamaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16)


def _executor(folder: Path, linear: str) -> ModelExecutor:
    config, model = load_model(folder, torch.float32)
    pages = ROWS * CAPACITY // PAGE
    sliding = config.sliding_layers
    kv = KVCache(
        config.num_layers,
        (pages + 1) * PAGE,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        page_size=PAGE,
        sliding_layers=sliding,
        swa_num_pages=pages if sliding else 0,
    )
    if sliding:  # a permutation: reading the full pool's slots on a sliding layer is wrong
        full = np.arange(1, pages + 1)
        kv.map_swa(full.tolist(), (pages + 1 - full).tolist())
    table = ReqToTokenTable(ROWS, CAPACITY)
    flat = torch.arange(PAGE, PAGE + ROWS * CAPACITY, dtype=torch.int32)
    table.apply_slot_deltas(list(range(ROWS)), [0] * ROWS, [CAPACITY] * ROWS, flat)
    executor = ModelExecutor(
        config, model, kv, make_attention_backend("torch"), table, linear=linear
    )
    executor.compiled = CompiledStep(executor)
    executor.compiled.compile()
    assert executor.compiled.ready, executor.compiled.failed
    return executor


# A hardware gate: where compiled steps are not verified (no AVX2), `compile_choice` keeps
# the runner eager (test_compile_choice_refuses_what_cannot_run checks that on every CPU).
needs_verified_cpu = pytest.mark.skipif(
    not compile_verified_here(), reason="compiled steps are verified on AVX-512 and AVX2 CPUs only"
)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """A kvactor cache of the module's own, and Inductor's folder as torch leaves it once
    anything asked for it (its default written into the environment): a decoy here."""
    kvactor, decoy = tmp_path_factory.mktemp("kvactor"), tmp_path_factory.mktemp("decoy")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVACTOR_CACHE", str(kvactor))
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(decoy))
        yield kvactor, decoy


@pytest.fixture(scope="module", params=[("gemma3", "aten"), ("llama", "fp16")], ids=str)
def executor(request, tmp_path_factory, caches):
    if not compile_verified_here():
        pytest.skip("compiled steps are verified on AVX-512 and AVX2 CPUs only")
    from transformers import AutoModelForCausalLM

    name, linear = request.param
    torch.manual_seed(99)
    hf = AutoModelForCausalLM.from_config(_hf_config(name), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms (Gemma's start at zero)
        for param_name, param in hf.named_parameters():
            if "norm" in param_name:
                param.uniform_(-0.5, 0.5)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return _executor(folder, linear)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(executor, lens: list[int]) -> list[list[int]]:
    prompts = [_prompt(n, seed=i) for i, n in enumerate(lens)]
    rows = list(range(len(lens)))
    executor.compiled.max_tokens = 0  # prefill eagerly
    executor.forward(ForwardBatch(rows, [0] * len(rows), prompts, [True] * len(rows)))
    return prompts


def _both(executor, make_batch, run):
    """(eager, compiled) outputs of the same step, and the K/V each wrote at its slots."""
    compiled = executor.compiled
    outputs, written = [], []
    for limit in (0, 32):
        compiled.max_tokens = limit
        before = compiled.steps
        batch = make_batch()
        outputs.append(run(batch))
        assert compiled.steps == before + (limit > 0)  # the graph ran exactly when allowed
        written.append(_written(executor, batch))
    return outputs, written


def _written(executor, batch: ForwardBatch) -> list[torch.Tensor]:
    """Every layer's K and V at the step's new positions (read back through the table)."""
    kv, table = executor.kv_cache, executor.req_to_token.table
    slots = torch.cat(
        [
            table[row, start : start + len(ids)].long()
            for row, start, ids in zip(batch.rows, batch.prefix_lens, batch.input_ids)
        ]
    )
    out = []
    for layer in range(kv.num_layers):
        k_all, v_all = kv.layer_kv(layer)
        at = kv.sliding_slots(slots) if layer in kv.sliding else slots
        out += [k_all[at].clone(), v_all[at].clone()]
    return out


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < tol * max(1.0, b.abs().max().item())


def test_decode_rows_match_eager(executor):
    lens = [3, 9, 20, 40]  # shorter and longer than the sliding window of 8
    _prefill(executor, lens)
    guarded, direct = executor.compiled.guarded, executor.compiled.direct_steps
    by_graph = list(executor.compiled.direct_by_graph)
    for n in (1, 2, 4):
        rows = list(range(n))

        def batch(rows=rows):
            return ForwardBatch.decode(rows, [lens[r] for r in rows], [7 + r for r in rows])

        (eager, compiled), (kv_eager, kv_compiled) = _both(executor, batch, executor.forward)
        _close(compiled, eager)
        assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
        for a, b in zip(kv_compiled, kv_eager):
            _close(a, b, 1e-5)
    assert executor.compiled.guarded == guarded  # every step skipped Dynamo's guards
    assert executor.compiled.direct_steps == direct + 3  # ... and Dynamo: its code, called
    # one step of one row (its own graph), two of two and four rows (the wider graph)
    assert executor.compiled.direct_by_graph == [by_graph[0] + 1, by_graph[1] + 2]


def test_dynamo_bypass_gives_the_guarded_graphs_result(executor):
    # A known step calls the code Dynamo compiled for its graph without entering Dynamo;
    # the same inputs through Dynamo (guards skipped) must give the same tensor, for the
    # one-row graph and the graph of several rows, with the slots written the same.
    lens = [6, 13, 25]
    _prefill(executor, lens)
    compiled = executor.compiled
    assert compiled.direct_ready
    for rows in ([1], [0, 1, 2]):
        with torch.inference_mode():
            meta = executor._build(
                ForwardBatch.decode(rows, [lens[r] for r in rows], [9] * len(rows))
            )
            inputs = compiled.inputs(meta, meta.extra[0])
        direct = compiled._direct
        try:
            compiled._direct = None
            through_dynamo = compiled.run(inputs)
        finally:
            compiled._direct = direct
        before = compiled.direct_steps
        bypassed = compiled.run(inputs)
        assert compiled.direct_steps == before + 1
        assert torch.equal(bypassed, through_dynamo)


def test_a_failed_capture_keeps_the_compiled_steps_through_dynamo(executor):
    # Dynamo's cache is a private API: whatever it gives that is missing, not code, or the
    # wrong graph's code leaves the bypass off with a reason, never the compile failed.
    compiled = executor.compiled
    one_row, wider = compiled._direct
    body = compiled._own_body()
    direct, why = compiled._checked_direct(body, {False: None, True: wider.__code__})
    assert direct is None and "not found" in why
    direct, why = compiled._checked_direct(body, {False: one_row.__code__, True: 42})
    assert direct is None and why.startswith("TypeError")
    swapped = {False: wider.__code__, True: one_row.__code__}
    direct, why = compiled._checked_direct(body, swapped)
    assert direct is None and why, (direct, why)
    right = compiled._checked_direct(body, {False: one_row.__code__, True: wider.__code__})
    assert right[0] is not None, right


def test_draft_verification_and_prefill_chunks_match_eager(executor):
    lens = [12, 30, 5]
    _prefill(executor, lens)

    def batch():  # a 5-token verification row, a decode row, a 6-token prefill chunk
        return ForwardBatch(
            [0, 1, 2], list(lens), [[11, 12, 13, 14, 15], [16], _prompt(6, 5)], [True] * 3
        )

    def full(b):
        return executor.forward_full(b, [True, False, False])

    ((eager, eager_spans), (compiled, compiled_spans)), (kv_eager, kv_compiled) = _both(
        executor, batch, full
    )
    _close(compiled, eager)
    assert compiled_spans[0].shape == (5, VOCAB)
    _close(compiled_spans[0], eager_spans[0])
    for a, b in zip(kv_compiled, kv_eager):
        _close(a, b, 1e-5)
    (eager, compiled), _ = _both(executor, batch, executor.forward)
    _close(compiled, eager)


def test_compiled_code_is_cached_per_capability_whatever_inductor_chose(executor, caches):
    # Inductor's cache key omits the vector ISA: code generated for AVX-512 and found in a
    # shared folder was built with AVX2 flags under ATEN_CPU_CAPABILITY=avx2 (wrong logits).
    kvactor, decoy = caches
    root = cache_root()
    assert root.parent == kvactor / "inductor"
    assert torch.backends.cpu.get_cpu_capability() in root.name
    assert any((root / "fxgraph").rglob("*")), "no graph in the kvactor cache"
    assert not any(decoy.rglob("*")), "Inductor wrote to the folder it had chosen itself"
    # and it stays so: another executor compiling meanwhile must not see it restored
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root)


def test_wide_steps_stay_eager_and_a_would_be_recompile_runs_eagerly(executor):
    _prefill(executor, [10, 10])
    compiled = executor.compiled
    compiled.max_tokens = 4
    steps = compiled.steps
    executor.forward(ForwardBatch([0, 1], [10, 10], [_prompt(3, 1), _prompt(3, 2)], [True, True]))
    assert compiled.steps == steps  # 6 new tokens > max_tokens 4: eager
    # Inputs the graph was not traced for (int32 slots) would recompile: refused, counted.
    with torch.inference_mode():  # as the executor builds a step
        meta = executor._build(ForwardBatch.decode([0], [10], [5]))
        inputs = compiled.inputs(meta, meta.extra[0])
        bad = type(inputs)(**{**vars(inputs), "full_slots": inputs.full_slots.int()})
    fallbacks, guarded = compiled.fallbacks, compiled.guarded
    assert compiled.known(inputs.as_args()) and not compiled.known(bad.as_args())
    assert compiled.run(bad) is None  # its guards were checked, and failed
    assert (compiled.fallbacks, compiled.guarded) == (fallbacks + 1, guarded + 1)
    assert compiled.run(inputs) is not None  # the graph itself still serves
    # a step over one lane, or over a KV pool other than the graphs were compiled for
    one_lane = type(inputs)(
        **{
            **vars(inputs),
            "full_slots": inputs.full_slots[:, :1].contiguous(),
            "full_mask": inputs.full_mask[..., :1].contiguous(),
        }
    )
    assert not compiled.known(one_lane.as_args())
    pool = executor.kv_cache._k
    try:
        executor.kv_cache._k = [t.clone() for t in pool]
        assert not compiled.known(inputs.as_args())
    finally:
        executor.kv_cache._k = pool
    assert compiled.known(inputs.as_args())


def test_compile_failure_leaves_eager_serving(executor):
    broken = CompiledStep(executor)

    def fails(rows):
        raise RuntimeError("the compiler failed")

    broken._warmup_inputs = fails
    broken.compile()
    assert not broken.ready and broken.failed and not broken.fits(1)


def test_key_lanes_window_and_padding():
    full, full_valid, sliding, sliding_valid = key_lanes(
        np.array([0, 0, 10]), np.array([0, 5, 2]), window=3
    )
    assert full.shape == (3, 6) and sliding.shape == (3, 3)
    assert full[1].tolist() == [0, 1, 2, 3, 4, 5] and full_valid[1].all()
    assert full[0].tolist() == [0] * 6 and full_valid[0].tolist() == [True] + [False] * 5
    assert sliding[1].tolist() == [3, 4, 5]  # positions 3..5 of request 0
    assert sliding[2].tolist() == [10, 11, 12] and sliding_valid[2].all()
    lone = key_lanes(np.array([4]), np.array([0]), window=None)
    assert lone[0].shape == (1, 2) and lone[1].tolist() == [[True, False]]  # >= 2 lanes


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "linear", "on"),
    [
        ("auto", "cpu", torch.float32, "aten", False),  # the exact path stays eager
        ("auto", "cpu", torch.float32, "fp16", True),
        ("auto", "cpu", torch.bfloat16, "aten", True),
        ("on", "cpu", torch.float32, "aten", True),
        ("auto", "cuda", torch.bfloat16, "aten", False),
        ("off", "cpu", torch.bfloat16, "aten", False),
    ],
)
def test_compile_choice(requested, device, dtype, linear, on):
    assert compile_choice(requested, device, dtype, linear, verified=True)[0] is on


def test_compile_choice_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="CPU path"):
        compile_choice("on", "cuda", torch.bfloat16, "aten")
    with pytest.raises(ValueError, match="one of"):
        compile_choice("yes", "cpu", torch.float32, "aten")
    on, why = compile_choice("auto", "cpu", torch.bfloat16, "aten", verified=False)
    assert not on and "verified on AVX512" in why
    with pytest.raises(ValueError, match="verified on AVX512"):
        compile_choice("on", "cpu", torch.bfloat16, "aten", verified=False)


@needs_verified_cpu
def test_bench_model_times_compiled_and_eager_steps(tmp_path, capsys):
    from actors.bench.model import main
    from tests.e2e.engine_fixtures import save_tiny_llama

    save_tiny_llama(tmp_path, vocab_size=300)
    main(
        ["--model", str(tmp_path), "--batches", "1,3", "--context", "12", "--prefill-len", "16"]
        + ["--repeats", "1", "--no-hf", "--linear", "aten", "--compile"]
    )
    out = capsys.readouterr().out
    assert "compiled the small-step graphs in" in out
    for batch in (1, 3):
        assert f"decode batch  {batch} (context 12)" in out
    assert out.count("(compiled; eager") == 2


def test_steps_whose_rows_would_gather_far_more_than_eager_stay_eager(executor, monkeypatch):
    """Every row of the graph gathers its own padded key lanes: a prefill chunk over a long
    cached context gathers that context once per row, where eager gathers it once."""
    import types

    import kernels.compiled_step as compiled_step

    # Gemma 3 270M's shape: 18 layers, 15 sliding (window 512), one KV head of 256, bf16
    gemma = types.SimpleNamespace(
        num_layers=18,
        sliding_layers=tuple(range(15)),
        sliding_window=512,
        num_kv_heads=1,
        head_dim=256,
    )
    one = np.array([1])
    assert extra_gather_bytes(one, np.array([4000]), gemma, 2) == 0  # a decode row
    # 4 drafts verified at context 2,000: 4 more rows, each with the whole context
    drafts = extra_gather_bytes(np.array([5]), np.array([2000]), gemma, 2)
    assert drafts == (3 * 4 * 2000 + 15 * 4 * 512) * 2 * 256 * 2
    # 6 rows extending a 3,300-token context of a model with 128 KiB of KV a token
    heavy = types.SimpleNamespace(
        num_layers=16, sliding_layers=(), sliding_window=None, num_kv_heads=8, head_dim=256
    )
    prefill = extra_gather_bytes(np.array([6, 1]), np.array([3302, 20]), heavy, 2)
    assert prefill == 16 * (7 * 3302 - 3322) * 2 * 8 * 256 * 2
    assert prefill > compiled_step.MAX_EXTRA_GATHER_BYTES
    # the executor's rule: over the bound, the step runs eagerly
    _prefill(executor, [10, 10])
    compiled = executor.compiled
    monkeypatch.setattr(compiled, "max_tokens", 32)  # (another test narrows it)
    steps = compiled.steps
    batch = ForwardBatch([0, 1], [10, 10], [_prompt(3, 1), _prompt(1, 2)], [True, True])
    monkeypatch.setattr(compiled_step, "MAX_EXTRA_GATHER_BYTES", 0)
    executor.forward(batch)
    assert compiled.steps == steps  # eager
    monkeypatch.setattr(compiled_step, "MAX_EXTRA_GATHER_BYTES", 512 << 20)
    batch = ForwardBatch([0, 1], [13, 11], [_prompt(3, 3), _prompt(1, 4)], [True, True])
    executor.forward(batch)
    assert compiled.steps == steps + 1  # within the bound: the graph
