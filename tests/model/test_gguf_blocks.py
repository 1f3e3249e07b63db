"""Decoder linears read from a GGUF's own blocks (kernels/gguf_blocks, kernels.linear's
`Q8_0NarrowLinear`): Q8_0, Q5_0 and Q4_0 records widened to Q8_0 blocks of the same
values, stacked as the model stacks its projections (Llama's q and k rows in the loader's
order), and taken by the narrow calls of the fp16 layouts, the wide ones staying as they
were. The embedded Gemma 3 270M's are its exact weights, and closer than the fp16 copies.
"""

from __future__ import annotations

import copy
import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from kernels.cpu import bf16_matmul_supported
from kernels.gguf_blocks import RECORD_BYTES, linear_blocks, widen
from kernels.linear import NARROW_ROWS, Fp16Linear, Q8_0NarrowLinear, pack_linears
from kernels.q8_0 import Q8_0Weight, compiler, vectorized

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler to build the kernel")
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_0])
def test_widened_records_are_the_values_ggml_dequantizes(qtype):
    values = np.random.default_rng(int(qtype)).standard_normal((7, 96)).astype(np.float32)
    values[0, :32] = 0  # an all-zero block
    records = quantize(values, qtype).reshape(7, 3, RECORD_BYTES[int(qtype)])
    q, scales = widen(records, int(qtype))
    assert q.dtype == np.int8 and q.shape == (7, 3, 32) and scales.shape == (7, 3)
    expected = dequantize(records.reshape(7, -1), qtype).reshape(7, 3, 32)
    assert np.array_equal(q.astype(np.float32) * scales[..., None], expected)
    bound = {Q.Q8_0: 127, Q.Q5_0: 16, Q.Q4_0: 8}[qtype]
    assert np.abs(q.astype(np.int16)).max() <= bound
    with pytest.raises(ValueError, match="records of"):
        widen(records[..., :-1], int(qtype))


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q5_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K_M"])
def test_the_stacked_blocks_are_the_loaded_weights(weight_type, tmp_path):
    """Llama (its q and k rows permuted in the file) and Qwen 2: every projection's blocks
    (qkv, o, gate/up, down; Q4_K_M mixes Q4_K and Q6_K parts in one qkv) equal the weights
    the loader hands the model, bit for bit."""
    from kernels.linear import stack_projections
    from kernels.models import load_config, load_model_weights
    from tests.model.gguf_fixtures import write_tiny_gguf

    for arch in ("llama", "qwen2"):
        path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, weight_type, save_hf=False)
        path = path["gguf_path"]
        config = load_config(str(path))
        weights = stack_projections(load_model_weights(str(path), torch.float32, config))
        blocks = linear_blocks(path, config)
        assert len(blocks) == 4 * config.num_layers
        for name, found in blocks.items():
            assert torch.equal(found.dequantized(), weights[f"{name}.weight"]), (arch, name)
        kinds = {(b.subblocks, b.mins is not None) for b in blocks.values()}
        assert kinds == {
            "Q4_K": {(1, True)},
            "Q6_K": {(2, False)},
            "Q4_K_M": {(1, True), (2, False), (2, True)},  # (2, True): Q4_K q, k + Q6_K v
        }.get(weight_type, {(1, False)})


def test_other_types_give_no_blocks_and_the_places_are_kept(tmp_path):
    from kernels.models import load_config
    from tests.model.gguf_fixtures import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "k.gguf", "qwen2", "Q5_K", save_hf=False)["gguf_path"]
    assert linear_blocks(path, load_config(str(path))) == {}  # Q5_K: not read as blocks
    path = write_tiny_gguf(tmp_path / "m.gguf", "qwen2", "Q8_0", save_hf=False)["gguf_path"]
    config = load_config(str(path))
    assert linear_blocks(path, config)
    # where the tensors lie is found once, then read from the artifact folder (stamped)
    record = next(path.parent.glob("m.gguf*.kvactor")) / "tensor_locations.json"
    saved = json.loads(record.read_text())
    saved["where"] = {}  # a record we can tell apart: no tensors
    record.write_text(json.dumps(saved))
    assert linear_blocks(path, config) == {}
    saved["stamp"] = "stale"
    record.write_text(json.dumps(saved))
    assert len(linear_blocks(path, config)) == 4 * config.num_layers


# ---- the layout -----------------------------------------------------------------------------


def test_narrow_calls_take_the_blocks_and_wide_ones_the_layout():
    linear = torch.nn.Linear(64, 48, bias=True)
    blocks = Q8_0Weight.quantize(linear.weight.detach())
    linear.weight.data = blocks.dequantized()
    module = Q8_0NarrowLinear(Fp16Linear(linear), blocks.packed())
    for n in (1, NARROW_ROWS, NARROW_ROWS + 1, 16):
        x = torch.randn(n, 64)
        want = F.linear(x, blocks.dequantized(), linear.bias.detach())
        got = module(x)
        if n > NARROW_ROWS:  # the fp16 layout's own product
            assert torch.equal(got, module.wide(x))
        else:  # the blocks' (16-bit activations), not the fp16 copy's
            assert torch.equal(got, blocks.packed().product(x) + linear.bias.detach())
        assert (got - want).abs().max() <= 2e-3 * want.abs().max()
        assert torch.equal(copy.deepcopy(module)(x), got)  # a copy computes the same
    with pytest.raises(ValueError, match="blocks of \\[48, 64\\] for a \\[40, 64\\]"):
        Q8_0NarrowLinear(Fp16Linear(torch.nn.Linear(64, 40)), blocks.packed())
    with pytest.raises(ValueError, match="layouts, not onednn"):
        pack_linears(torch.nn.Sequential(linear), "onednn", {"0": blocks.packed()})


def _executor(path, dtype, linear, before=None):
    from kernels.attention import make_attention_backend
    from kernels.kv_cache import KVCache, ReqToTokenTable
    from kernels.model_executor import ModelExecutor
    from kernels.models import load_model

    config, model = load_model(str(path), dtype)
    if before is not None:
        before(model)
    kv = KVCache(config.num_layers, 64, config.num_kv_heads, config.head_dim, dtype)
    table = ReqToTokenTable(2, 32)
    attention = make_attention_backend("torch")
    return config, model, ModelExecutor(config, model, kv, attention, table, linear=linear)


@pytest.mark.parametrize(
    "dtype, linear",
    [
        (torch.float32, "fp16"),
        pytest.param(
            torch.bfloat16,
            "onednn+fp16",
            marks=pytest.mark.skipif(
                not bf16_matmul_supported(), reason="onednn+fp16 needs oneDNN's bf16 product"
            ),
        ),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_the_executor_reads_a_q8_0_models_blocks(arch, dtype, linear, tmp_path):
    """Both fp16 layouts: every linear's narrow calls read the file's blocks (a bf16 model
    then makes no fp16 copy of it); one whose blocks differ from the loaded weight is left
    out, named, and keeps the layout."""
    from kernels.linear import NarrowFp16Linear, OneDnnLinear
    from tests.model.gguf_fixtures import write_tiny_gguf

    if not vectorized():
        pytest.skip("the kernel has no AVX2 build here: the layout keeps its fp16 copies")
    path = write_tiny_gguf(tmp_path / "m.gguf", arch, "Q8_0", save_hf=False)["gguf_path"]
    config, model, executor = _executor(path, dtype, linear)
    assert executor.linear == linear and executor.linear_blocks == 4 * config.num_layers
    assert executor.linear_blocks_error is None
    layer = model.layers[0]
    # the wide calls' layout alone: a bf16 model holds no fp16 copy of these linears
    wide = {"fp16": Fp16Linear, "onednn+fp16": OneDnnLinear}[linear]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert type(layer.get_submodule(name)) is Q8_0NarrowLinear
        assert type(layer.get_submodule(name).wide) is wide
    qkv = layer.self_attn.qkv_proj
    x = torch.randn(1, config.hidden).to(dtype)
    weight = linear_blocks(path, config)["layers.0.self_attn.qkv_proj"].dequantized()
    bias = None if qkv.bias is None else qkv.bias.float()
    assert (bias is not None) == (arch == "qwen2")
    want = F.linear(x.float(), weight, bias)
    assert (qkv(x).float() - want).abs().max() <= 1e-2 * want.abs().max()

    # a loaded weight unlike its blocks: that linear keeps the layout, and is named
    def poison(model):
        with torch.no_grad():
            model.layers[1].mlp.gate_up_proj.weight[0, 0] += 1

    _, model, executor = _executor(path, dtype, linear, before=poison)
    assert executor.linear_blocks == 4 * config.num_layers - 1
    assert "layers.1.mlp.gate_up_proj" in executor.linear_blocks_error
    kept = model.layers[1].mlp.gate_up_proj
    assert type(kept) is {"fp16": Fp16Linear}.get(linear, NarrowFp16Linear)


@pytest.mark.model
def test_the_embedded_models_linears_are_its_blocks_and_closer_than_fp16_copies():
    """Gemma 3 270M (q/k/v/gate/up in Q5_0 and Q8_0, o in Q4_K, down in Q4_K and Q6_K):
    every linear reads its blocks, and its narrow products on the fp32 model's fp16 layout
    are closer to the exact weights' with them than with the fp16 copies alone."""
    from kernels.gguf_loader import default_model_path

    path = default_model_path()
    config, model, executor = _executor(path, torch.float32, "fp16")
    if not vectorized():
        pytest.skip("the kernel has no AVX2 build here")
    assert executor.linear_blocks == 4 * config.num_layers
    generator = torch.Generator().manual_seed(0)
    blocks = linear_blocks(path, config)
    for name, weight in blocks.items():
        if not name.startswith(("layers.0.", "layers.1.")):  # Q6_K and Q4_K downs
            continue
        weight = weight.dequantized()
        module = model.get_submodule(name)
        x = torch.randn(NARROW_ROWS, module.in_features, generator=generator)
        exact = F.linear(x.double(), weight.double())
        via_blocks = module(x).double()
        via_fp16 = module.wide(x).double()
        err_blocks = (via_blocks - exact).abs().max().item()
        err_fp16 = (via_fp16 - exact).abs().max().item()
        assert err_blocks < err_fp16, name


def test_a_compiled_one_row_step_holds_the_blocks_operator(tmp_path, monkeypatch):
    """The one-row graph (batch-1 decode) calls `kvactor.q8_0_linear` itself: no linear's
    Python runs in its step, where the two-row graph still goes through `packed_linear` and
    each module's `product`. Both give the eager step's logits."""
    from kernels import q8_0
    from kernels.attention import make_attention_backend
    from kernels.compiled_step import CompiledStep, compile_verified_here
    from kernels.forward_batch import ForwardBatch
    from kernels.kv_cache import KVCache, ReqToTokenTable
    from kernels.model_executor import ModelExecutor
    from kernels.models import load_model
    from tests.model.gguf_fixtures import write_tiny_gguf

    if not vectorized() or not compile_verified_here():
        pytest.skip("no vectorized kernel or no verified compiled steps here")
    if not q8_0.load_operator():
        pytest.skip(f"no operator here: {q8_0.operator_status()}")
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q8_0", save_hf=False)["gguf_path"]
    config, model = load_model(str(path), torch.float32)
    kv = KVCache(config.num_layers, 65, config.num_kv_heads, config.head_dim, torch.float32)
    table = ReqToTokenTable(2, 32)
    table.apply_slot_deltas([0, 1], [0, 0], [32, 32], torch.arange(1, 65, dtype=torch.int32))
    attention = make_attention_backend("torch")
    executor = ModelExecutor(config, model, kv, attention, table, linear="fp16")
    assert executor.linear_blocks == 4 * config.num_layers
    assert executor.linear_operator == "built"
    executor.compiled = CompiledStep(executor)
    executor.compiled.compile()
    assert executor.compiled.ready, executor.compiled.failed
    lens = [5, 9]
    executor.compiled.max_tokens = 0  # prefill eagerly
    prompts = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate(lens)]
    executor.forward(ForwardBatch([0, 1], [0, 0], prompts, [True, True]))

    calls = []
    product = Q8_0NarrowLinear.product
    monkeypatch.setattr(
        Q8_0NarrowLinear, "product", lambda self, rows: calls.append(1) or product(self, rows)
    )
    linears = 4 * config.num_layers
    for rows, compiled_calls in (([0], 0), ([0, 1], linears)):
        logits = []
        for limit in (0, 32):  # eager, then the graph
            executor.compiled.max_tokens = limit
            calls.clear()
            steps = executor.compiled.steps
            batch = ForwardBatch.decode(rows, [lens[r] for r in rows], [7 + r for r in rows])
            logits.append(executor.forward(batch))
            assert executor.compiled.steps == steps + (limit > 0)
            assert len(calls) == (compiled_calls if limit else linears)
        eager, compiled = logits
        assert (compiled - eager).abs().max() <= 1e-4 * max(1.0, eager.abs().max().item())
        assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
