"""Triton kernels of the GPU model runner, by op, each behind a thin launcher (torch in,
torch out):

  * `kv`: `store_kv` (new K/V rows into the cache at their slots: the `KVCache.write`
    copy), `apply_slot_deltas` (runs of slots into the req-to-token table, on the device:
    `ReqToTokenTable.apply_slot_deltas`) and `paged_kv_indices` (a batch's page lists from
    the req-to-token table, on the device: `AttentionMetadata.paged_kv`, optionally mapped
    to the sliding pool);
  * `decode`: `decode_attention`, one query token per request over all its keys (split-KV,
    then a merge of the splits' partial softmaxes);
  * `extend`: `extend_attention`, ragged query chunks over their cached prefix plus
    themselves, causal;
  * `common`: what they share (`LazyJit`, block sizes, the dot precision).

Both attention kernels read a request's keys through a location list: with `page_size == 1`
the list holds the slot of each key (`AttentionMetadata.kv_indices`), otherwise page ids
(`PagedKvLayout.kv_page_indices`), key j of a request then living at slot
`pages[j // page_size] * page_size + j % page_size`. Query head h reads KV head
h // group_size (HF's repeat_kv order); one program handles all the query heads of a KV head,
so each K/V block is loaded once per group. Scores are `scale * q.k` in float32, soft-capped
(`softcap * tanh(s / softcap)`) when asked, limited to keys at positions
`> q_pos - window` on windowed layers, and normalised with an online softmax in float32.

Modes: the kernels are handed to `triton.jit` when first launched, not when their module is
imported, and again if `TRITON_INTERPRET` (`triton.knobs.runtime.interpret`) has changed
since (`common.LazyJit`): `triton.jit` reads that setting when it decorates, so decorating at
import would tie the kernels to whatever the environment said when something first imported
them. Under the interpreter they run on CPU tensors (that is how they are tested); compiled,
on CUDA tensors. For the same reason no kernel calls a `@triton.jit` helper of its own. Those
of triton.language itself (tl.zeros, tl.max, tl.sum) are decorated when triton.language is
first imported, so interpreting also needs TRITON_INTERPRET set before that import (or
those helpers swapped for interpreted copies, as tests/model/test_triton_kernels.py does).

Shapes assumed: K/V caches are [num_slots, num_kv_heads, head_dim] with a unit stride on
the last dimension (`KVCache.layer_kv`), q/k/v/out [tokens, heads, head_dim] (made
contiguous on the last dimension when they are not); head_dim is any size (padded to a power
of two of at least 16 inside the kernels, masked); num_q_heads a multiple of num_kv_heads.
The dot products take the cache's dtype (q is cast to it); with float32 caches they run in
IEEE float32 (no TF32), so fp32 results match a float32 reference to ~1e-6.
"""
