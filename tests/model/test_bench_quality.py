"""`bench quality`'s perplexity: which tokens each scoring scores, on a scripted executor
whose logits make every scored token's probability known."""

from __future__ import annotations

import math

import torch

from actors.bench.quality import perplexity

VOCAB, BOS = 50, 2


class ScriptedExecutor:
    """Logits under which a token at an input position p is predicted with probability
    `sure` when p is odd, uniformly when even; records the windows it was given."""

    def __init__(self, sure: float = 0.5) -> None:
        self.windows: list[list[int]] = []
        self.sure = sure

    def forward_full(self, batch, full):
        (inputs,) = batch.input_ids
        self.windows.append(list(inputs))
        logits = torch.zeros(len(inputs), VOCAB)
        for p in range(1, len(inputs), 2):
            # Every token of row p gets probability (1 - sure) / (V - 1), except token 7.
            logits[p, 7] = math.log(self.sure * (VOCAB - 1) / (1 - self.sure))
        return None, [logits]


def test_every_position_is_scored_by_default():
    ids = [BOS] + [7] * 20  # the targets are all token 7
    executor = ScriptedExecutor()
    got = perplexity(executor, ids, window=10)
    # Windows [0..10], [10..20]: 10 + 10 targets, rows 0..9 each, half of them odd.
    assert [len(w) for w in executor.windows] == [10, 10]
    assert executor.windows[0][0] == BOS and executor.windows[1][0] == 7
    want = math.exp(-(10 * math.log(1 / VOCAB) + 10 * math.log(0.5)) / 20)
    assert math.isclose(got, want, rel_tol=1e-5)


def test_llama_cpp_windows_open_with_bos_and_score_their_second_half():
    ids = [BOS] + [7] * 24  # 25 tokens: two whole windows of 12, the rest dropped
    executor = ScriptedExecutor()
    got = perplexity(executor, ids, window=12, llama_cpp=True, bos=BOS)
    # Each window: 12 tokens, the first replaced by BOS; rows 0..10 predict tokens 1..11.
    assert [len(w) for w in executor.windows] == [11, 11]
    assert all(w[0] == BOS and w[1:] == [7] * 10 for w in executor.windows)
    # Scored rows 6..10 of each window (llama-perplexity's n_ctx/2 .. n_ctx-2): 7 and 9 odd.
    scored = [math.log(1 / VOCAB), math.log(0.5)] * 2 + [math.log(1 / VOCAB)]
    want = math.exp(-sum(scored) / len(scored))
    assert math.isclose(got, want, rel_tol=1e-5)
