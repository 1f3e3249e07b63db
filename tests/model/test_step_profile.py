"""`actors/bench/step_profile.py`: each op's time lands in its bucket, the LM head's
interior in the LM head's, an embedding lookup in the other ops and not the KV gathers."""

from __future__ import annotations

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
