"""The memory plan (kernels/memory_plan.py): weight and KV bytes by hand, the pool sized from
`kv.memory_fraction` / `kv.memory_bytes`, the refusals, and the figures as /metrics gauges.

The shapes are Gemma 3 270M's (the embedded model) and a Llama-3-8B-like config; every
expected figure is worked out in the comments from the shapes alone.
"""

from __future__ import annotations

import pytest

from actors.app.config import ConfigError, EngineConfig
from actors.frontends.http.metrics import GatewayMetrics
from kernels import memory_plan as mp
from kernels.config import ModelConfig, RopeSpec, gemma3_layer_types
from kernels.memory_plan import (
    GIB,
    MemoryPlanError,
    kv_pool_bytes,
    kv_token_bytes,
    linear_bytes,
    plan_memory,
    weight_bytes,
)

GEMMA = ModelConfig(
    arch="gemma3",
    num_layers=18,  # every 6th full (5, 11, 17): 3 full, 15 sliding
    hidden=640,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    intermediate=2048,
    vocab=262144,
    rope=RopeSpec(1e6),
    rope_local=RopeSpec(1e4),
    layer_types=gemma3_layer_types(18),
    sliding_window=512,
    norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
    tie_embeddings=True,
    qk_norm=True,
)
LLAMA_8B = ModelConfig(
    arch="llama",
    num_layers=32,
    hidden=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
    rope=RopeSpec(5e5),
    rope_local=RopeSpec(5e5),
    layer_types=("full_attention",) * 32,
    sliding_window=None,
    norm_eps=1e-5,
    hidden_act="silu",
    tie_embeddings=False,
)

# Gemma: per layer qkv 1536 x 640 + o 640 x 1024 + gate_up 4096 x 640 + down 640 x 2048 =
# 5,570,560 weights, norms 4 x 640 + q/k norms 2 x 256 = 3,072; 18 layers + final norm 640:
# 100,326,016 parameters. The table: 262144 x 640 = 167,772,160.
GEMMA_DECODER_PARAMS = 18 * (5_570_560 + 3_072) + 640
GEMMA_TABLE = 262_144 * 640
# Llama 8B: per layer qkv 6144 x 4096 + o 4096 x 4096 + gate_up 28672 x 4096 + down 4096 x
# 14336 = 218,103,808 weights (6,979,321,856 in 32 layers); norms 32 x 2 x 4096 + 4096 =
# 266,240; the table 128256 x 4096 = 525,336,576, twice (untied): 8,030,261,248 in all.
LLAMA_LINEAR_PARAMS = 32 * 218_103_808
LLAMA_NORMS = 32 * 2 * 4096 + 4096
LLAMA_TABLE = 128_256 * 4096


def plan(config=GEMMA, **overrides):
    base = dict(
        dtype="bfloat16",
        quantization="none",
        available=8 * GIB,
        page_size=16,
        num_pages=2048,
        swa_num_pages=-1,
        context_len=4096,
        chunk_size=512,
    )
    base.update(overrides)
    return plan_memory(config, **base)


# --- weights ---------------------------------------------------------------------------------


def test_llama_8b_weights_in_each_mode():
    assert GEMMA_DECODER_PARAMS == 100_326_016
    assert LLAMA_LINEAR_PARAMS + LLAMA_NORMS + 2 * LLAMA_TABLE == 8_030_261_248
    exact = weight_bytes(LLAMA_8B, 2)  # bf16 on a GPU: no oneDNN copy of the head
    assert exact.embedding == exact.lm_head == 2 * LLAMA_TABLE == 1_050_673_152
    assert exact.total == 2 * 8_030_261_248 == 16_060_522_496  # 14.96 GiB
    # int8: a byte a weight + a bf16 scale per output row (43,008 rows a layer); the untied
    # head is its int8 copy (+ 128,256 scales): its bf16 weight is released once quantized
    int8 = weight_bytes(LLAMA_8B, 2, "int8")
    assert int8.decoder == LLAMA_LINEAR_PARAMS + 32 * 43_008 * 2 + 2 * LLAMA_NORMS
    assert int8.lm_head == LLAMA_TABLE + 2 * 128_256
    assert int8.total == 8_558_873_088  # 7.97 GiB
    # int4: half a byte a weight + a bf16 (scale, zero) per 32 inputs: 0.625 bytes a weight
    int4 = weight_bytes(LLAMA_8B, 2, "int4")
    assert int4.decoder == LLAMA_LINEAR_PARAMS * 5 // 8 + 2 * LLAMA_NORMS == 4_362_608_640
    assert int4.lm_head == LLAMA_TABLE * 5 // 8 == 328_335_360
    assert int4.embedding == 2 * LLAMA_TABLE  # the lookup table stays bf16
    assert int4.total == 5_741_617_152  # 5.35 GiB
    # fp32 activations make the scales 4 bytes: 0.75 bytes a weight
    assert weight_bytes(LLAMA_8B, 4, "int4", activation_bytes=4).decoder == (
        LLAMA_LINEAR_PARAMS * 3 // 4 + 4 * LLAMA_NORMS
    )


def test_gemma_weights_as_the_cpu_runner_holds_them():
    """Measured on a loaded engine with `measured_weight_bytes` (bf16 871,740,672; fp32
    1,743,481,344; fp32 with fp16 linears 1,878,485,504; bf16 with onednn+fp16 linears
    1,407,825,152; bf16 int8 604,471,552; bf16 int4 503,182,592), before the head and
    linears read the GGUF's Q8_0 blocks: the estimate is exact for such a layout (this
    config carries no GGUF types; with them it counts the blocks, `widened_share`)."""
    bf16 = weight_bytes(GEMMA, 2, lm_head_onednn=True)  # + oneDNN's copy of the tied head
    assert (bf16.embedding, bf16.decoder, bf16.lm_head) == (
        2 * GEMMA_TABLE,
        2 * GEMMA_DECODER_PARAMS,
        2 * GEMMA_TABLE,
    )
    assert bf16.total == 871_740_672  # 0.81 GiB
    assert weight_bytes(GEMMA, 4, lm_head_onednn=True).total == 1_743_481_344
    # fp16 linears: the decoder's linears at 2 bytes (norms stay fp32); the head adds an
    # fp16 copy and oneDNN's fp32 copy of those rounded values
    fp16 = weight_bytes(GEMMA, 4, linear="fp16", lm_head_onednn=True)
    assert fp16.decoder == 2 * 18 * 5_570_560 + 4 * (18 * 3_072 + 640)
    assert fp16.lm_head == GEMMA_TABLE * (2 + 4)
    assert fp16.total == 1_878_485_504
    # onednn+fp16 (a bf16 model): every decoder weight and the head also in fp16
    both = weight_bytes(GEMMA, 2, linear="onednn+fp16", lm_head_onednn=True)
    assert both.decoder == bf16.decoder + 2 * 18 * 5_570_560
    assert both.lm_head == GEMMA_TABLE * (2 + 2)
    assert both.total == 1_407_825_152  # measured on the embedded model, 2026-12-05
    # quantized: the tied head gets a quantized copy, no oneDNN copy
    assert weight_bytes(GEMMA, 2, "int8", lm_head_onednn=True).total == 604_471_552
    assert weight_bytes(GEMMA, 2, "int4", lm_head_onednn=True).total == 503_182_592


def test_linear_bytes_of_each_kind():
    assert linear_bytes(64, 128, 4) == 64 * 128 * 4
    assert linear_bytes(64, 128, 2, "int8") == 64 * 128 + 64 * 2
    # int4: 100 output rows are padded to 112; 128 inputs are 4 groups of (scale, zero)
    assert linear_bytes(100, 128, 2, "int4") == 112 * 64 + 4 * 112 * 2 * 2
    assert linear_bytes(100, 128, 2, "int4", activation_bytes=4) == 112 * 64 + 4 * 112 * 2 * 4
    with pytest.raises(ValueError):
        linear_bytes(1, 32, 2, "int3")


def test_attention_biases_and_qk_norms_count():
    import dataclasses

    base = weight_bytes(LLAMA_8B, 2).decoder
    biased = dataclasses.replace(LLAMA_8B, attention_bias=True)
    assert weight_bytes(biased, 2).decoder - base == 32 * (6144 + 4096) * 2
    qwen2 = dataclasses.replace(LLAMA_8B, arch="qwen2", attention_bias=True)
    assert weight_bytes(qwen2, 2).decoder - base == 32 * 6144 * 2  # q/k/v only
    qwen3 = dataclasses.replace(LLAMA_8B, arch="qwen3", qk_norm=True)
    assert weight_bytes(qwen3, 2).decoder - base == 32 * 2 * 128 * 2


# --- KV ----------------------------------------------------------------------------------------


def test_kv_bytes_follow_the_pools_the_cache_allocates():
    # Gemma bf16: K and V of 1 head x 256 = 1,024 bytes a layer and token
    assert kv_token_bytes(GEMMA, 2, split=True) == (3 * 1024, 15 * 1024)
    assert kv_token_bytes(GEMMA, 2, split=False) == (18 * 1024, 0)
    # the default pool: 2048 + 1 pages of 16 tokens in each pool
    assert kv_pool_bytes(GEMMA, 2, 16, 2048, 2048) == 2049 * 16 * 18 * 1024 == 604_274_688
    assert kv_pool_bytes(GEMMA, 4, 16, 2048, 2048) == 1_208_549_376  # fp32: ~1.13 GiB
    assert kv_pool_bytes(GEMMA, 2, 16, 2048, 512) == 16 * (2049 * 3 + 513 * 15) * 1024
    assert kv_pool_bytes(GEMMA, 2, 16, 2048, 0) == 2049 * 16 * 18 * 1024  # one pool
    # Llama 8B bf16: 32 layers x 2 x 8 heads x 128 x 2 bytes = 128 KiB a token, 2 MiB a page
    assert kv_token_bytes(LLAMA_8B, 2, split=True) == (128 << 10, 0)
    assert kv_pool_bytes(LLAMA_8B, 2, 16, 2048, 2048) == 2049 * (2 << 20)


# --- the plan ----------------------------------------------------------------------------------


def test_the_default_plan_keeps_the_configured_pages():
    p = plan()
    assert (p.num_pages, p.swa_num_pages) == (2048, 2048)
    assert p.weights == 871_740_672 and p.kv_pool == 604_274_688
    assert p.headroom == 8 * GIB - 871_740_672 - 604_274_688
    assert p.why == "kv.num_pages = 2048 as configured" and not p.warnings
    assert p.kv_tokens == 32_768
    fields = p.log_fields()
    assert fields["weights"] == "0.81 GiB" and fields["kv_pool"] == "0.56 GiB"
    # an explicit sliding pool stays as given; none for 0 or a model without sliding layers
    assert plan(swa_num_pages=512).swa_num_pages == 512
    assert plan(swa_num_pages=0).swa_num_pages == 0
    assert plan(LLAMA_8B, quantization="int4", available=24 * GIB).swa_num_pages == 0


def test_a_fraction_sizes_the_pool_from_what_the_weights_leave():
    # 0.5 of 8 GiB = 4,294,967,296, less 871,740,672 of weights: 3,423,226,624 for the pool;
    # a page of both pools is 16 x 18 x 1,024 = 294,912 bytes, and each pool has a padding
    # page: (n + 1) x 294,912 <= 3,423,226,624 gives n = 11,606
    p = plan(memory_fraction=0.5)
    assert (p.num_pages, p.swa_num_pages) == (11_606, 11_606)
    assert p.kv_pool == 11_607 * 294_912 <= 4 * GIB - p.weights
    assert p.why.startswith("kv.memory_fraction = 0.5 of 8.00 GiB available on the CPU")


def test_a_byte_budget_sizes_the_pool_itself():
    p = plan(memory_bytes=GIB)  # (n + 1) x 294,912 <= 1 GiB
    assert p.num_pages == GIB // 294_912 - 1 == 3_639
    assert p.kv_pool <= GIB < p.kv_pool + 294_912
    # an explicit sliding pool keeps its share: 512 of 2048 pages, a quarter; a full page is
    # 49,152 bytes, a sliding one 245,760: n = (1 GiB - 294,912) // 110,592 = 9,706
    q = plan(memory_bytes=GIB, swa_num_pages=512)
    assert (q.num_pages, q.swa_num_pages) == (9_706, 9_706 // 4)
    assert q.kv_pool == 9_707 * 49_152 + (9_706 // 4 + 1) * 245_760 <= GIB


def test_the_8b_model_in_int4_on_a_24_gib_machine():
    # 0.9 x 24 GiB = 23,192,823,398, less 5,741,617,152 of int4 weights: 17,451,206,246
    # for 2 MiB pages (one of them padding): 8,320 pages, 133,120 tokens
    p = plan(LLAMA_8B, quantization="int4", available=24 * GIB, memory_fraction=0.9)
    assert p.weights == 5_741_617_152
    assert p.num_pages == 8_320 and p.kv_tokens == 133_120
    assert p.kv_pool == 8_321 * (2 << 20) == 17_450_401_792
    assert p.headroom == 24 * GIB - 5_741_617_152 - 17_450_401_792  # ~2.40 GiB
    assert not p.warnings
    fixed = plan(LLAMA_8B, quantization="int4", available=24 * GIB)
    assert fixed.num_pages == 2048 and fixed.kv_pool == 2049 * (2 << 20)  # ~4.0 GiB


def test_weights_that_cannot_fit_are_refused_naming_a_quantization_that_does():
    with pytest.raises(MemoryPlanError) as info:
        plan(LLAMA_8B, available=12 * GIB)
    text = str(info.value)
    # bf16 on the CPU: the weights and oneDNN's copy of the head, 17,111,195,648 bytes
    assert "the weights alone (~15.94 GiB, bfloat16) exceed the 12.00 GiB available" in text
    assert "--quantization int8" in text and "~7.97 GiB" in text
    with pytest.raises(MemoryPlanError, match="--quantization int4"):
        plan(LLAMA_8B, quantization="int8", available=7 * GIB)
    with pytest.raises(MemoryPlanError, match="a smaller model"):
        plan(LLAMA_8B, quantization="int4", available=5 * GIB)


def test_a_budget_below_one_request_is_refused_with_what_to_change():
    # 0.9 of 7 GiB less 5.35 GiB of weights: 486 pages, one 8192-token request needs 512
    with pytest.raises(MemoryPlanError) as info:
        plan(
            LLAMA_8B,
            quantization="int4",
            available=7 * GIB,
            memory_fraction=0.9,
            context_len=8192,
        )
    text = str(info.value)
    assert "486 pages of 16 tokens" in text and "kv.context_len = 8192" in text
    assert "512 pages" in text and "raise kv.memory_fraction" in text
    assert "--max-model-len" in text and "--quantization int4" not in text  # already int4
    with pytest.raises(MemoryPlanError, match="raise kv.memory_bytes.*--quantization int4"):
        plan(memory_bytes=1 << 20)
    # the weights beyond the fraction leave no pool at all
    with pytest.raises(MemoryPlanError, match="0 pages"):
        plan(memory_fraction=0.05)


def test_a_budgeted_sliding_pool_must_hold_a_window_and_a_chunk():
    # a sliding pool of 1 in 2048 full pages: 1 GiB gives ~21,800 full pages, 10 sliding,
    # fewer than the window (512) and a chunk (512) need: 64 pages
    with pytest.raises(MemoryPlanError, match="sliding layers' pool gets 10 pages.*64 pages"):
        plan(memory_bytes=GIB, swa_num_pages=1)
    assert plan(swa_num_pages=1).swa_num_pages == 1  # a fixed pool is the user's to size


def test_a_fixed_pool_that_cannot_be_committed_is_refused():
    # the pool is allocated (and written) in full at start: it must fit beside the weights
    with pytest.raises(MemoryPlanError) as info:
        plan(num_pages=8192, available=2 * GIB)
    text = str(info.value)
    assert "KV pool of 8192 pages (2.25 GiB" in text and "kv.memory_fraction" in text


def test_little_headroom_is_a_warning():
    p = plan(memory_fraction=0.99)
    assert p.headroom < 0.05 * p.available
    assert p.warnings and "activations" in p.warnings[0]


def test_measured_weights_replace_the_estimate():
    assert plan(weights=GIB).weights == GIB


# --- memory available --------------------------------------------------------------------------


def test_available_memory_reads_meminfo_and_the_cgroup(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  32000000 kB\nMemAvailable:  1000 kB\n")
    assert mp._mem_available(meminfo) == 1000 * 1024
    assert mp._mem_available(tmp_path / "absent") is None
    (tmp_path / "memory.max").write_text("max\n")
    assert mp._cgroup_room(tmp_path) is None
    (tmp_path / "memory.max").write_text("4096\n")
    (tmp_path / "memory.current").write_text("1024\n")
    assert mp._cgroup_room(tmp_path) == 3072
    monkeypatch.setattr(mp, "_mem_available", lambda: 10_000)
    monkeypatch.setattr(mp, "_cgroup_room", lambda: 3072)
    assert mp.available_memory("cpu") == (3072, "the memory cgroup's limit less its usage")
    monkeypatch.setattr(mp, "_cgroup_room", lambda: None)
    assert mp.available_memory("cpu") == (10_000, "MemAvailable in /proc/meminfo")


def test_this_machine_has_some_memory_available():
    available, where = mp.available_memory("cpu")
    assert available > 0 and where


# --- config and metrics ------------------------------------------------------------------------


def test_config_keys_and_their_checks():
    cfg = EngineConfig.load()
    assert (cfg.kv.memory_fraction, cfg.kv.memory_bytes) == (0.0, 0)
    assert EngineConfig.load(kv__memory_fraction=0.9).kv.memory_fraction == 0.9
    assert EngineConfig.load(kv__memory_bytes=1 << 30).kv.memory_bytes == 1 << 30
    with pytest.raises(ConfigError, match="kv.memory_fraction must be in"):
        EngineConfig.load(kv__memory_fraction=1.5)
    with pytest.raises(ConfigError, match="kv.memory_bytes must be >= 0"):
        EngineConfig.load(kv__memory_bytes=-1)
    with pytest.raises(ConfigError, match="set one of them"):
        EngineConfig.load(kv__memory_fraction=0.5, kv__memory_bytes=1 << 30)


def test_the_plan_figures_are_gauges_not_cache_config_labels():
    config = {
        "block_size": "16",
        "num_gpu_blocks": "512",
        "enable_prefix_caching": "True",
        "cache_dtype": "auto",
        "memory_weights_bytes": "871740672",
        "memory_kv_pool_bytes": "604274688",
        "memory_available_bytes": "8589934592",
    }
    text = GatewayMetrics("m", 4096, config).render(None, None).decode()
    assert "# TYPE kvactor:memory_weights_bytes gauge" in text
    assert 'kvactor:memory_weights_bytes{model_name="m"} 8.71740672e+08' in text
    assert 'kvactor:memory_kv_pool_bytes{model_name="m"} 6.04274688e+08' in text
    assert 'kvactor:memory_available_bytes{model_name="m"} 8.589934592e+09' in text
    [info] = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info")]
    assert "memory" not in info and 'num_gpu_blocks="512"' in info
    assert "memory_weights" not in GatewayMetrics("m", 4096).render(None, None).decode()


def test_fp16_linears_count_the_q8_0_blocks_a_gguf_gives_them():
    """An fp32 model's fp16 layout also holds int8 blocks of the linears its GGUF stores in
    Q8_0 / Q5_0 / Q4_0 / Q4_K / Q6_K (kernels.gguf_blocks): the estimate adds at most 1.375
    bytes a weight over those types' share of the linears (the embedded model's: all)."""
    import dataclasses

    types = {"Q5_0": 63_406_080, "Q8_0": 1_474_560, "Q4_K": 23_592_960, "Q5_K": 11_796_480}
    gguf = dataclasses.replace(GEMMA, extra={**GEMMA.extra, "linear_types": types})
    share = (63_406_080 + 1_474_560 + 23_592_960) / sum(types.values())  # not Q5_K
    plain = weight_bytes(GEMMA, 4, linear="fp16").decoder
    with_blocks = weight_bytes(gguf, 4, linear="fp16").decoder
    assert with_blocks - plain == pytest.approx(1.375 * share * 18 * 5_570_560, rel=1e-6)
    # a bf16 model's blocks replace fp16 copies (2 bytes): the estimate stays an upper bound
    assert weight_bytes(gguf, 2, linear="onednn+fp16") == weight_bytes(
        GEMMA, 2, linear="onednn+fp16"
    )
