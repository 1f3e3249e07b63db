"""The GPU paths' pure parts, on the CPU: FlashInfer's plan arguments expand to exactly the
slots the torch reference attends over (full and sliding layers, one pool or two, page
sizes 1 and 16), device and backend choice, CUDA-graph buckets and padding, and a CPU
engine that never imports a GPU package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.attention.base import AttentionMetadata, AttentionShape
from kernels.attention.flashinfer_backend import flashinfer_layouts
from kernels.device import choose_attention, choose_device
from kernels.forward_batch import ForwardBatch
from kernels.kv_cache import KVCache, ReqToTokenTable

ROOT = Path(__file__).resolve().parents[2]


def scrambled_inputs(page: int, split: bool, window: int | None, first_token: int | None = None):
    """(batch, table, cache, shape): rows over pages in scrambled order, a mixed batch
    (prefill on a prefix, decode, fresh prompt), and for `split` a sliding pool whose map is
    scrambled too. Request i's tokens are `first_token + i` (all 0 when None)."""
    torch.manual_seed(page)
    prefix_lens, extends = [37, 50, 0], [5, 1, 23]
    capacity, rows = 64, len(prefix_lens)
    num_pages = rows * capacity // page
    cache = KVCache(
        num_layers=2,
        num_slots=(num_pages + 1) * page,
        num_kv_heads=1,
        head_dim=8,
        page_size=page,
        sliding_layers=[1] if split else [],
        swa_num_pages=num_pages if split else 0,
    )
    if split:
        full_pages = list(range(1, num_pages + 1))
        cache.map_swa(full_pages, (torch.randperm(num_pages) + 1).tolist())
    table = ReqToTokenTable(rows, capacity)
    pages = torch.randperm(num_pages) + 1
    flat = (pages[:, None] * page + torch.arange(page)).reshape(rows, capacity)
    table.apply_slot_deltas(list(range(rows)), [0] * rows, [capacity] * rows, flat.reshape(-1))
    shape = AttentionShape(4, 1, 8, 8**-0.5, None, window)
    ids = [[0 if first_token is None else first_token + i] * e for i, e in enumerate(extends)]
    batch = ForwardBatch(list(range(rows)), prefix_lens, ids, [True] * rows)
    return batch, table, cache, shape


def scrambled_setup(page: int, split: bool, window: int | None):
    """`scrambled_inputs`' metadata, and its cache."""
    batch, table, cache, shape = scrambled_inputs(page, split, window)
    return AttentionMetadata.build(batch, table, cache, shape), cache


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("split", [False, True])
def test_flashinfer_layouts_expand_to_the_reference_slots(page, split):
    meta, cache = scrambled_setup(page, split, window=8)
    layouts = flashinfer_layouts(meta)
    assert set(layouts) == {"full", "sliding"}
    starts = meta.kv_indptr_host
    for b, slots in enumerate(layouts["full"].slots(page)):
        assert torch.equal(slots, meta.kv_indices[starts[b] : starts[b + 1]])
    for b, slots in enumerate(layouts["sliding"].slots(page)):
        want = cache.sliding_slots(meta.kv_indices[starts[b] : starts[b + 1]])
        assert torch.equal(slots, want)
    assert layouts["full"].window_left == -1 and layouts["sliding"].window_left == 7
    assert layouts["full"].qo_indptr_host.tolist() == [0, 5, 6, 29]
    for layout in layouts.values():
        assert layout.kv_page_indptr_host.dtype == torch.int32
        assert layout.kv_page_indices.dtype == torch.int32
        last = layout.kv_last_page_len_host
        assert bool(((last >= 1) & (last <= page)).all())


def test_a_model_without_a_window_plans_full_layers_only():
    meta, _ = scrambled_setup(16, split=False, window=None)
    assert set(flashinfer_layouts(meta)) == {"full"}


def test_device_and_backend_choice_on_a_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the test is about the CPU-only choice")
    assert choose_device("auto")[0] == "cpu"
    assert choose_device("cpu") == ("cpu", "set in the config")
    with pytest.raises(ValueError, match="no CUDA device"):
        choose_device("cuda")
    assert choose_attention("auto", "cpu")[0] == "torch"
    for name in ("flashinfer", "triton"):
        with pytest.raises(ValueError, match="needs model.device = cuda"):
            choose_attention(name, "cpu")
    assert choose_attention("auto", "cuda")[0] in ("flashinfer", "triton")
    assert choose_attention("auto", "cuda", torch.float32)[0] == "triton"  # no fp32 FlashInfer
    with pytest.raises(ValueError, match="use triton for fp32"):
        choose_attention("flashinfer", "cuda", torch.float32)


@pytest.mark.model
def test_a_cpu_engine_imports_no_gpu_package():
    probe = (
        "import sys\n"
        "from actors.app.serving import generate_offline\n"
        "from tests.e2e.engine_fixtures import small_config\n"
        "from transport.messages.engine import GenerationParams\n"
        "cfg = small_config(kv__num_pages=64)\n"
        "out = generate_offline(['Hello'], GenerationParams(max_tokens=2), config=cfg)\n"
        "assert len(out[0].token_ids) == 2\n"
        "bad = [m for m in ('flashinfer', 'kernels.triton_ops', 'kernels.attention."
        "flashinfer_backend', 'kernels.attention.triton_backend') if m in sys.modules]\n"
        "print('GPU-MODULES:' + ','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GPU-MODULES:\n" in out.stdout, out.stdout[-1000:]


def test_decode_buckets_and_padding_point_at_page_zero():
    from kernels.cuda_graphs import DECODE_BUCKETS, bucket_for, pad_layout, padded

    assert DECODE_BUCKETS[:6] == (1, 2, 4, 8, 16, 32) and DECODE_BUCKETS[-1] == 256
    assert [bucket_for(n) for n in (1, 2, 3, 5, 33, 256)] == [1, 2, 4, 8, 64, 256]
    assert bucket_for(257) is None
    meta, _ = scrambled_setup(16, split=True, window=8)
    for kind, layout in flashinfer_layouts(meta).items():
        wide = pad_layout(layout, 8)
        assert wide.qo_indptr_host.tolist() == [0, 5, 6, 29, 30, 31, 32, 33, 34]
        assert wide.kv_page_indptr_host[-1] == layout.kv_page_indptr_host[-1] + 5
        slots = wide.slots(16)
        assert [torch.equal(a, b) for a, b in zip(slots[:3], layout.slots(16))] == [True] * 3
        assert [s.tolist() for s in slots[3:]] == [[0]] * 5  # one key each, in page 0
        assert pad_layout(layout, 3) is layout
        with pytest.raises(ValueError, match="do not fit"):
            pad_layout(layout, 2)
    assert padded(torch.tensor([7, 9]), 4).tolist() == [7, 9, 0, 0]


def test_cuda_graphs_refuse_a_cpu_executor():
    from kernels.cuda_graphs import DecodeGraphs

    class CpuExecutor:
        device = torch.device("cpu")

    with pytest.raises(RuntimeError, match="CUDA device"):
        DecodeGraphs(CpuExecutor())


@pytest.mark.model
def test_gpu_check_dry_run_exercises_every_step(tmp_path):
    """`bin/engine gpu-check --dry-run` at its smallest: parity (one prompt past the
    window), the model split over two ranks (gloo here, NCCL on GPUs) against one,
    throughput against HF, engine against bare, batch-1 bandwidth."""
    out = tmp_path / "gpu.json"
    cmd = [
        sys.executable, "-m", "actors.app.cli", "gpu-check", "--dry-run", "--json", str(out),
        "--batches", "2", "--new-tokens", "2", "--parity-prompts", "2",
        "--parity-tokens", "3", "--bandwidth-steps", "2", "--prompt-tokens", "16",
        "--tp-ranks", "2", "--require", "tensor-parallel",
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    import json

    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["dry_run"] is True
    parity = report["parity"]
    assert parity["passed"] and parity["window_prompts"] == 1
    assert set(parity["runs"]) == {"torch/one_pool", "torch/sliding_pool"}
    for run_ in parity["runs"].values():
        assert [p["prompt_tokens"] for p in run_["per_prompt"]] == [8, 600]
        assert all(p["tokens"] == 3 and p["max_logprob_err"] <= 1e-3 for p in run_["per_prompt"])
    tp = report["tensor_parallel"]
    assert tp["passed"] and tp["ranks"] == 2 and tp["data_group"] == "gloo"
    assert tp["same_tokens"] == [True, True] and tp["max_logprob_diff"] <= 1e-3
    assert report["unmet_requirements"] == []
    assert set(report["throughput"]) == {"2"}
    assert (
        report["throughput"]["2"]["kvactor_tok_s"] > 0 and report["throughput"]["2"]["hf_tok_s"] > 0
    )
    assert report["engine_vs_bare"]["ratio"] > 0
    bw = report["batch1"]
    assert bw["bytes_per_step"] > 500_000_000 and 0 < bw["fraction_of_copy"]
