"""`actors/bench/step_profile.py`: each op's time lands in its bucket, the LM head's
interior in the LM head's, an embedding lookup in the other ops and not the KV gathers."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from actors.bench.step_profile import (
    ATTENTION,
    BUCKETS,
    KV,
    LINEARS,
    LM_HEAD,
    format_profile,
    profile_steps,
)


class _Model:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.layer = nn.Linear(64, 64)
        self.lm_head = nn.Linear(64, 4096)  # a linear too: must count as the head, not a layer
        self.x = torch.randn(4, 64)

    def step(self) -> torch.Tensor:
        h = self.layer(self.x)
        q = h.view(4, 1, 1, 64)
        h = torch.nn.functional.scaled_dot_product_attention(q, q, q).view(4, 64)
        return self.lm_head(h)


def test_buckets_attribute_the_head_the_layers_and_attention():
    m = _Model()
    head = m.lm_head
    with torch.inference_mode():
        ms = profile_steps(m.step, m, steps=3)
    assert m.lm_head is head  # restored after the run
    assert set(ms) == set(BUCKETS)
    assert ms[LM_HEAD] > 0 and ms[LINEARS] > 0 and ms[ATTENTION] > 0
    assert all(v >= 0 for v in ms.values())
    line = format_profile("batch 4", ms)
    assert line.startswith("[batch 4] profiled step") and "lm_head" in line


def test_an_embedding_lookup_is_not_a_kv_gather():
    class _Embed:
        def __init__(self) -> None:
            self.table = nn.Embedding(50_000, 256)
            self.ids = torch.randint(0, 50_000, (4096,))
            self.lm_head = nn.Identity()

        def step(self):
            return self.lm_head(self.table(self.ids))

    m = _Embed()
    with torch.inference_mode():
        ms = profile_steps(m.step, m, steps=3)
    assert ms[KV] == 0


def test_work_outside_torch_ops_lands_in_the_head_and_the_packed_linears():
    """The Q8_0 kernel runs through ctypes, no torch op: inside the head its time is the
    head's range's own; inside a compiled step's `kvactor::packed_linear`, the op's own."""
    from kernels import graph_ops

    opaque_s = 0.004  # a sleep: no torch op, and never shorter, however busy the machine

    def opaque_product(rows: torch.Tensor) -> torch.Tensor:  # opaque to the profiler
        time.sleep(opaque_s)
        return torch.zeros(rows.shape[0], 2048)

    class _Packed:
        out_features = 2048

        def product(self, rows: torch.Tensor) -> torch.Tensor:
            return opaque_product(rows)

    class _Opaque:
        def __init__(self) -> None:
            self.packed = _Packed()
            self.handle = graph_ops.register(self.packed)
            self.x = torch.randn(64, 2048)

        def lm_head(self, h: torch.Tensor) -> torch.Tensor:
            return opaque_product(h)

        def step(self):
            h = graph_ops.packed_linear(self.x, self.handle, 2048)
            return self.lm_head(h)

    m = _Opaque()
    with torch.inference_mode():
        ms = profile_steps(m.step, m, steps=3)
    # attributed elsewhere, either bucket would hold only `zeros`' microseconds
    assert ms[LM_HEAD] >= opaque_s * 1e3, ms
    assert ms[LINEARS] >= opaque_s * 1e3, ms


def test_the_blocks_operator_counts_as_a_linear():
    """`kvactor::q8_0_linear` (the decoder linears of a compiled one-row step) is a linear."""
    from kernels import q8_0

    if q8_0.kernel() is None or not q8_0.load_operator():
        pytest.skip(f"no operator here: {q8_0.operator_status()}")
    packed = q8_0.Q8_0Weight.quantize(torch.randn(4096, 1024) * 0.05).packed()
    x = torch.randn(1, 1024)

    class _Blocks:
        def lm_head(self, h: torch.Tensor) -> torch.Tensor:
            return h

        def step(self):
            return self.lm_head(packed.linear(x))

    m = _Blocks()
    with torch.inference_mode():
        ms = profile_steps(m.step, m, steps=5)
    assert ms[LINEARS] > 0.5 * sum(ms.values())
