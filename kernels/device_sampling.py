"""Sampling where the logits are (the GPU), for steps whose requests need nothing but the
sampling parameters: one token per row, then one copy of the B token ids to the host.

Semantics are `kernels.sampling`'s (its module docstring): greedy rows (temperature below
`GREEDY_TEMPERATURE_BELOW`, 0 included) take the argmax;
the others divide by their temperature, weigh tokens exp(x - max) (weights below exp(-87)
are 0), keep every token whose weight reaches the largest of the min-p, top-k and top-p
cut-offs (top-p over the top-k-kept tokens, ties kept), and draw by inverse CDF over the
kept tokens in vocabulary order with the request's own uniform. The uniforms come from the
requests' seeded CPU generators, as on the CPU path, so a seeded request draws the same
uniforms wherever it runs. Requests with penalties, logit bias, a grammar or logprobs take
the CPU path (`Sampler.sample` decides per step).

Everything is batched torch over the rows, so it runs on any device; the tests run it on
CPU tensors against the CPU path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

SUBNORMAL_LOG_FLOOR = -87.0
# A temperature below this is greedy (as vLLM's _SAMPLING_EPS): dividing logits by a tiny
# temperature overflows to inf, and exp(inf - inf) is NaN, which would pick an arbitrary
# token (the last id) instead of the argmax. Both sampling paths use `is_greedy_temperature`.
GREEDY_TEMPERATURE_BELOW = 1e-5


def is_greedy_temperature(temperature: float) -> bool:
    """Whether a request with this temperature takes the argmax (0 and anything tiny)."""
    return temperature < GREEDY_TEMPERATURE_BELOW


def simple_enough(params) -> bool:
    """Whether a request's step can be sampled here (`params`: its `RowParams`)."""
    return not params.has_penalties and not params.logprobs


def sample_rows(logits: Tensor, params: list, uniforms: list[float | None]) -> Tensor:
    """int64 token per row of float32 `logits` [B, V] (on its device); `uniforms[i]` is the
    draw of row i (None for greedy rows)."""
    device = logits.device
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not is_greedy_temperature(p.temperature)]
    if not sampled:
        return tokens
    index = torch.tensor(sampled, device=device)
    rows = [params[i] for i in sampled]
    temperature = torch.tensor([p.temperature for p in rows], device=device)
    weights = logits.index_select(0, index) / temperature[:, None]
    weights = weights - weights.amax(dim=-1, keepdim=True)
    weights = F.threshold(weights, SUBNORMAL_LOG_FLOOR, -math.inf).exp()
    threshold = torch.tensor([p.min_p for p in rows], device=device)
    if any(p.uses_top_k or p.uses_top_p for p in rows):
        threshold = torch.maximum(threshold, _truncation_cuts(weights, rows))
    weights = torch.where(weights >= threshold[:, None], weights, torch.zeros_like(weights))
    # float32 cumsum as the CPU path (which accumulates sequentially in float64); on a GPU
    # it is a parallel scan, so a refused token's CDF step may not be exactly flat: the
    # guard below moves such a draw to the next kept token.
    cdf = torch.cumsum(weights, dim=-1)
    u = torch.tensor([uniforms[i] for i in sampled], dtype=torch.float64, device=device)
    targets = (u * cdf[:, -1].double()).to(torch.float32)[:, None]
    chosen = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    vocab = weights.shape[1]
    kept = weights > 0
    # u * total can round up to the total itself: then the last token with weight.
    last_kept = vocab - 1 - kept.flip(-1).int().argmax(dim=-1)
    chosen = torch.where(chosen >= vocab, last_kept, chosen)
    at_or_after = kept & (torch.arange(vocab, device=device)[None, :] >= chosen[:, None])
    next_kept = torch.where(at_or_after.any(dim=-1), at_or_after.int().argmax(dim=-1), last_kept)
    tokens[index] = torch.where(kept.gather(1, chosen[:, None]).squeeze(1), chosen, next_kept)
    return tokens


def _truncation_cuts(weights: Tensor, rows: list) -> Tensor:
    """Per row, the smallest weight kept by its top-k and then its top-p (0 where off)."""
    device = weights.device
    vocab = weights.shape[1]
    ordered = torch.sort(weights, dim=-1, descending=True).values
    k = torch.tensor([min(p.top_k, vocab) if p.uses_top_k else vocab for p in rows], device=device)
    k_cut = ordered.gather(1, (k - 1)[:, None]).squeeze(1)
    k_cut = torch.where(
        torch.tensor([p.uses_top_k for p in rows], device=device), k_cut, torch.zeros_like(k_cut)
    )
    # top-p ranks the top-k-kept multiset by weight: the first rank whose inclusive mass
    # reaches top_p of the kept mass sets the cut (ties with it are kept by value).
    kept = torch.where(ordered >= k_cut[:, None], ordered, torch.zeros_like(ordered))
    inclusive = torch.cumsum(kept.double(), dim=-1)
    top_p = torch.tensor([p.top_p for p in rows], dtype=torch.float64, device=device)
    goal = (top_p * inclusive[:, -1])[:, None]
    rank = torch.searchsorted(inclusive, goal).squeeze(1).clamp(max=vocab - 1)
    p_cut = ordered.gather(1, rank[:, None]).squeeze(1)
    p_cut = torch.where(
        torch.tensor([p.uses_top_p for p in rows], device=device), p_cut, torch.zeros_like(p_cut)
    )
    return torch.maximum(k_cut, p_cut)
