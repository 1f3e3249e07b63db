"""A step's host arrays reach the device in one packed transfer (`HostStaging`, packed on
the CPU here so the packing is what is tested): the metadata built through it equals the
unstaged build field by field (mixed batch, page sizes 1 and 16, one KV pool or two, and
`paged_kv`), the sliding map and the executor's forwards (`forward`, `forward_full`) come
out the same, with one transfer per step."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from kernels.attention import AttentionMetadata
from kernels.forward_batch import ForwardBatch
from kernels.host_staging import HostStaging
from kernels.kv_cache import KVCache, ReqToTokenTable
from tests.model.test_gpu_paths_on_cpu import scrambled_inputs


def mixed_setup(page: int, split: bool):
    """Rows over scrambled pages; prefill on a prefix, decode, fresh prompt; window 8."""
    return scrambled_inputs(page, split, window=8, first_token=7)


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("split", [False, True])
def test_staged_metadata_equals_the_unstaged_build_in_one_transfer(page, split):
    batch, table, cache, shape = mixed_setup(page, split)
    plain = AttentionMetadata.build(batch, table, cache, shape)
    staging = HostStaging("cpu", pack=True)
    ids = batch.flat_input_ids()
    staged = AttentionMetadata.build(batch, table, cache, shape, staging=staging, extra=[ids])
    assert staging.transfers == 1
    for f in fields(AttentionMetadata):
        if f.compare and f.name != "sliding_slots":
            assert_same(getattr(staged, f.name), getattr(plain, f.name))
    assert (staged.sliding_slots is None) == (not split)
    (ids_t,) = staged.extra
    assert ids_t.dtype == torch.int64 and ids_t.tolist() == ids.tolist()
    for f in fields(staged.paged_kv):
        assert_same(getattr(staged.paged_kv, f.name), getattr(plain.paged_kv, f.name))
    assert staging.transfers == 1  # paged_kv rode in build's transfer
    # Metadata without the pre-staged page arrays stages them itself, in one transfer.
    bare = replace(staged, paged_staged=None)
    for f in fields(bare.paged_kv):
        assert_same(getattr(bare.paged_kv, f.name), getattr(plain.paged_kv, f.name))
    assert staging.transfers == 2


def test_a_new_token_in_the_padding_page_is_refused_on_the_cpu():
    batch, _, cache, shape = mixed_setup(16, split=False)
    empty = ReqToTokenTable(3, 64)  # every entry is slot 0, in the padding page
    with pytest.raises(ValueError, match="no slot"):
        AttentionMetadata.build(batch, empty, cache, shape, staging=HostStaging("cpu", pack=True))


def test_sliding_map_through_a_packed_staging_matches():
    maps = []
    for pack in (False, True):
        cache = KVCache(2, 8 * 4, 1, 8, page_size=4, sliding_layers=[1], swa_num_pages=5)
        cache.staging = HostStaging("cpu", pack=pack)
        cache.map_swa([1, 3, 6], [2, 5, 1])
        cache.map_swa([3], [0])
        maps.append(cache.swa_map.clone())
        assert cache.staging.transfers == (2 if pack else 0)
    assert torch.equal(maps[0], maps[1]) and maps[1].tolist() == [0, 2, 0, 0, 0, 0, 1, 0, 0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kernels.models import load_model

    hf_config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    return load_model(folder, torch.float32)


def prompts_batch(slots, prompts, need):
    deltas = slots.extend(list(range(len(prompts))), [len(p) for p in prompts])
    return ForwardBatch(list(range(len(prompts))), [0] * len(prompts), prompts, need, deltas)


def test_executor_steps_are_one_transfer_and_unchanged(tiny_llama):
    from tests.model.model_fixtures import make_executor

    config, model = tiny_llama
    prompts = [[3, 9, 27, 81, 5], [11, 12], [40, 41, 42]]
    results = []
    for pack in (False, True):
        executor, slots = make_executor(config, model, num_rows=3, row_capacity=16, page_size=4)
        executor.staging = HostStaging("cpu", pack=pack)
        step = [executor.forward(prompts_batch(slots, prompts, [True, False, True]))]
        deltas = slots.extend([0, 1, 2], [1, 1, 1])
        decode = ForwardBatch.decode([0, 1, 2], [5, 2, 3], [1, 2, 3], deltas)
        step.append(executor.forward(decode))
        assert executor.staging.transfers == (2 if pack else 0)
        results.append(step)
    for plain, packed in zip(*results):
        assert torch.equal(plain, packed)


def test_forward_full_rows_are_each_prefix_last_logits(tiny_llama):
    from tests.model.model_fixtures import make_executor

    config, model = tiny_llama
    prompts = [[3, 9, 27, 4], [11, 12, 13], [40, 41]]
    executor, slots = make_executor(config, model, num_rows=3, row_capacity=16, page_size=4)
    executor.staging = HostStaging("cpu", pack=True)
    need, full = [True, False, True], [False, True, True]
    picked, per_request = executor.forward_full(prompts_batch(slots, prompts, need), full)
    assert executor.staging.transfers == 1
    assert picked.shape[0] == 2 and [len(r) for r in per_request] == [3, 2]
    torch.testing.assert_close(per_request[1][-1], picked[1])
    for k, i in enumerate(i for i, f in enumerate(full) if f):
        for j in range(len(prompts[i])):
            ref, ref_slots = make_executor(config, model, num_rows=1, row_capacity=16, page_size=4)
            want = ref.forward(prompts_batch(ref_slots, [prompts[i][: j + 1]], [True]))[0]
            torch.testing.assert_close(per_request[k][j], want, rtol=1e-4, atol=1e-4)
    ref, ref_slots = make_executor(config, model, num_rows=1, row_capacity=16, page_size=4)
    want = ref.forward(prompts_batch(ref_slots, [prompts[0]], [True]))[0]
    torch.testing.assert_close(picked[0], want, rtol=1e-4, atol=1e-4)
