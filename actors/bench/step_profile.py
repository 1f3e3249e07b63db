"""Where a decode step's time goes: torch's profiler over a few steps of the model executor,
each op's own (self) CPU time put in one bucket.

Buckets, first match up an op's call chain: the LM head (everything under it, its own range
included), decoder linears (`kvactor::packed_linear` and `kvactor::q8_0_linear` too),
attention (SDPA and its parts), KV gather/scatter (index ops that read or write the paged
cache), and the rest (norms, rotary, activations, embedding, copies). What the profiled wall
time holds beyond the ops' own time is Python and dispatch between ops. The profiler adds
its own cost per op, so read shares, not absolute times, and take the step's wall time
from an unprofiled run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile, record_function

LM_HEAD = "lm_head"
LINEARS = "decoder linears"
ATTENTION = "attention"
KV = "KV gather/scatter"
OTHER = "norms, rotary, activations, other ops"
OUTSIDE = "Python and dispatch between ops"
BUCKETS = (LM_HEAD, LINEARS, ATTENTION, KV, OTHER, OUTSIDE)

_LINEAR_OPS = (
    "aten::linear",
    "aten::mm",
    "aten::addmm",
    "aten::matmul",
    "quantized::linear_dynamic_fp16",
    "mkldnn::_linear_pointwise",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
    "kvactor::packed_linear",  # a compiled step's packed linears (kernels.graph_ops)
    "kvactor::q8_0_linear",  # the blocks' operator, eager or in a one-row graph (kernels.q8_0)
)
_KV_OPS = ("aten::index_select", "aten::index_copy_", "aten::index_put_", "aten::index")


def _bucket(event) -> str:
    chain = []
    e = event
    while e is not None:
        chain.append(e.name)
        e = e.cpu_parent
    if LM_HEAD in chain:
        return LM_HEAD
    if any("scaled_dot_product" in n or "attention" in n for n in chain):
        return ATTENTION
    if any(n in _LINEAR_OPS for n in chain):
        return LINEARS
    if "aten::embedding" in chain:  # an index_select inside, but the token table, not KV
        return OTHER
    if any(n in _KV_OPS for n in chain):
        return KV
    return OTHER


def profile_steps(step: Callable[[], object], lm_head_owner, steps: int) -> dict[str, float]:
    """Milliseconds per step in each bucket over `steps` calls of `step`. `lm_head_owner`
    has an `lm_head` attribute, wrapped for the run so its interior is attributed."""
    head = lm_head_owner.lm_head

    def traced_head(*a, **kw):
        with record_function(LM_HEAD):
            return head(*a, **kw)

    step()  # warm-up, outside the profile
    lm_head_owner.lm_head = traced_head
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            wall_us = (time.perf_counter() - t) * 1e6
    finally:
        lm_head_owner.lm_head = head
    totals = dict.fromkeys(BUCKETS, 0.0)
    for event in prof.events():
        # the head's range counts its own time too: work that is no torch op (the Q8_0
        # kernel, called through ctypes) is the range's self time, as an op's is its own
        totals[_bucket(event)] += event.self_cpu_time_total
    totals[OUTSIDE] = max(0.0, wall_us - sum(totals.values()))
    return {k: v / steps / 1e3 for k, v in totals.items()}


def format_profile(label: str, ms: dict[str, float]) -> str:
    total = sum(ms.values())
    parts = [f"{k} {v:.1f} ms ({100 * v / total:.0f}%)" for k, v in ms.items()]
    return f"[{label}] profiled step {total:.1f} ms: " + "; ".join(parts)
