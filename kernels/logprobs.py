"""Log-probabilities of given tokens under a run of logits (prompt logprobs, echo)."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.inference_mode()
def token_logprobs(
    logits: Tensor, targets: list[int], top_k: int
) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """For row i of `logits` [n, V] (n >= len(targets)): log_softmax's value at targets[i],
    the target's rank (1 = the most likely token), and the `top_k` best (ids, logprobs)
    when top_k > 0 (else empty lists)."""
    n = len(targets)
    if n == 0:
        return [], [], [], []
    lsm = torch.log_softmax(logits[:n].float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=lsm.device).unsqueeze(1)
    chosen = lsm.gather(1, index)
    ranks = ((lsm > chosen).sum(dim=-1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    if top_k <= 0:
        return values, ranks, [[] for _ in range(n)], [[] for _ in range(n)]
    best = torch.topk(lsm, min(top_k, lsm.shape[1]), dim=-1)
    return values, ranks, best.indices.tolist(), best.values.tolist()
