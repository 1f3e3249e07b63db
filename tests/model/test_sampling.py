"""Sampler: reproducible seeds, batch independence, truncation, penalties, logprobs, params."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from kernels.sampling import Sampler
from transport.messages.params import GenerationParams as SamplingParams
from transport.messages.params import InvalidParams, validate_params


def _sampler_with(
    params_by_rid: dict[int, SamplingParams], prompts: dict[int, list[int]] | None = None
) -> Sampler:
    sampler = Sampler()
    for rid, params in params_by_rid.items():
        sampler.add_request(rid, params, (prompts or {}).get(rid, []))
    return sampler


def _random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _draw_many(params: SamplingParams, logits_row: torch.Tensor, draws: int) -> np.ndarray:
    """Tokens from ``draws`` independent requests (seeds 0..draws-1) sharing one logits row."""
    sampler = _sampler_with({rid: _with_seed(params, rid) for rid in range(draws)})
    out = sampler.sample(list(range(draws)), logits_row.expand(draws, -1).clone())
    return np.asarray(out.tokens)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(params, seed=seed)


def _reference_kept(logits_row: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The documented truncation semantics, written out plainly over a full sort."""
    weights = np.exp(
        (logits_row.double().numpy() / params.temperature)
        - (logits_row.double().numpy() / params.temperature).max()
    )
    kept = np.ones_like(weights, dtype=bool)
    if params.top_k > 0:
        kept &= weights >= np.sort(weights)[::-1][params.top_k - 1]
    if params.top_p < 1.0:
        ranked = np.sort(weights[kept])[::-1]
        inclusive = np.cumsum(ranked)
        rank = int(np.searchsorted(inclusive, params.top_p * inclusive[-1]))
        kept &= weights >= ranked[rank]
    if params.min_p > 0:
        kept &= weights >= params.min_p * weights.max()
    return kept


def _assert_frequencies_match(tokens: np.ndarray, probabilities: np.ndarray) -> None:
    """Every token's frequency within 5 standard errors (+1 count) of its probability."""
    draws = tokens.size
    counts = np.bincount(tokens, minlength=probabilities.size)
    expected = probabilities * draws
    spread = 5.0 * np.sqrt(draws * probabilities * (1.0 - probabilities)) + 1.0
    bad = np.nonzero(np.abs(counts - expected) > spread)[0]
    assert bad.size == 0, f"tokens {bad[:5]}: counts {counts[bad[:5]]} vs {expected[bad[:5]]}"


# --- parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": "1"},
        {"top_k": -2},
        {"top_k": 1.5},
        {"top_k": True},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"min_p": -0.01},
        {"min_p": 1.5},
        {"seed": -1},
        {"seed": 2**63},
        {"seed": 1.0},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.01},
        {"logprobs": 1},
        {"top_logprobs": -1},
        {"top_logprobs": 21},
        {"top_logprobs": 2, "logprobs": False},
    ],
)
def test_validate_rejects_out_of_range(bad: dict) -> None:
    params = SamplingParams(**bad)
    with pytest.raises(ValueError) as error:
        validate_params(params)
    assert next(iter(bad)) in str(error.value)
    assert isinstance(error.value, InvalidParams) and error.value.field == next(iter(bad))


def test_validate_accepts_edges() -> None:
    # One set of limits for every entry point (HTTP, ZeroMQ, offline): seeds are int64.
    for good in [
        {},
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"min_p": 1.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"frequency_penalty": -2.0},
        {"logprobs": True, "top_logprobs": 20},
    ]:
        validate_params(SamplingParams(**good))


def test_registry_errors() -> None:
    sampler = _sampler_with({1: SamplingParams()})
    with pytest.raises(ValueError, match="already registered"):
        sampler.add_request(1, SamplingParams(), [])
    with pytest.raises(KeyError):
        sampler.sample([2], torch.zeros(1, 8))
    with pytest.raises(ValueError, match="once"):
        sampler.sample([1, 1], torch.zeros(2, 8))
    with pytest.raises(ValueError, match="len\\(rids\\)"):
        sampler.sample([1], torch.zeros(2, 8))
    sampler.remove_request(1)
    assert 1 not in sampler and len(sampler) == 0
    assert sampler.sample([], torch.zeros(0, 8)).tokens == []


# --- greedy -------------------------------------------------------------------------------


def test_all_greedy_batch_is_argmax_and_leaves_logits_untouched() -> None:
    logits = _random_logits(6, 1000, seed=1)
    before = logits.clone()
    sampler = _sampler_with({rid: SamplingParams(temperature=0.0) for rid in range(6)})
    out = sampler.sample(list(range(6)), logits)
    assert out.tokens == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    assert torch.equal(logits, before)


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = _random_logits(4, 1000, seed=2)
    expected = logits.argmax(dim=-1)
    sampler = _sampler_with(
        {
            0: SamplingParams(temperature=0.0),
            1: SamplingParams(temperature=1.5, top_p=0.5, seed=3),
            2: SamplingParams(temperature=0.0, top_k=5),
            3: SamplingParams(temperature=0.7, min_p=0.1, seed=4),
        }
    )
    out = sampler.sample([0, 1, 2, 3], logits)
    assert out.tokens[0] == expected[0] and out.tokens[2] == expected[2]


# --- seeds and batch independence ---------------------------------------------------------


def _sequence(params: SamplingParams, steps: int, vocab: int = 1000) -> list[int]:
    sampler = _sampler_with({7: params})
    return [
        sampler.sample([7], _random_logits(1, vocab, seed=100 + step, scale=1.0)).tokens[0]
        for step in range(steps)
    ]


def test_same_seed_reproduces_and_different_seeds_differ() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    first, second = _sequence(params, 20), _sequence(params, 20)
    assert first == second
    assert _sequence(_with_seed(params, 1235), 20) != first
    unseeded = SamplingParams(temperature=1.0)
    assert _sequence(unseeded, 20) != _sequence(unseeded, 20)


@pytest.mark.parametrize("vocab", [50001, 262144])
def test_a_request_samples_the_same_alone_or_in_any_batch(vocab: int) -> None:
    watched = SamplingParams(
        temperature=0.9,
        top_p=0.8,
        top_k=4000,
        min_p=0.001,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        seed=99,
    )
    others = {
        11: SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        12: SamplingParams(temperature=2.0, top_p=0.9, seed=5),  # flat: many candidates
        13: SamplingParams(temperature=0.5, top_k=7, seed=6),
        14: SamplingParams(temperature=1.0, presence_penalty=1.0, seed=7),
    }
    prompt = {1: list(range(0, 3000, 7))}
    alone = _sampler_with({1: watched}, prompt)
    crowded = _sampler_with({1: watched, **others}, prompt)
    layouts = [[11, 1, 12], [12, 13, 14, 11, 1], [1], [13, 1, 14]]
    for step in range(12):
        step_logits = _random_logits(1, vocab, seed=step, scale=4.0)
        rids = layouts[step % len(layouts)]
        batch = _random_logits(len(rids), vocab, seed=1000 + step, scale=4.0)
        batch[rids.index(1)] = step_logits[0]
        expected = alone.sample([1], step_logits.clone()).tokens[0]
        assert crowded.sample(rids, batch).tokens[rids.index(1)] == expected, f"step {step}"


# --- truncation ---------------------------------------------------------------------------

CRAFTED = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01]))


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.69), {0, 1}),
        (SamplingParams(top_p=0.71), {0, 1, 2}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),
        (SamplingParams(top_k=3, top_p=0.5), {0, 1}),  # top-p over the top-3 renormalised mass
        (SamplingParams(top_k=3, top_p=0.45), {0}),  # 0.4 / 0.85 > 0.45 already
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_p=0.01), {0}),  # the top token always survives
        (SamplingParams(top_k=5, min_p=0.2), {0, 1, 2, 3}),
    ],
)
def test_truncation_never_emits_an_excluded_token(
    params: SamplingParams, allowed: set[int]
) -> None:
    tokens = _draw_many(params, CRAFTED, draws=3000)
    assert set(tokens.tolist()) == allowed
    probabilities = np.zeros(CRAFTED.numel())
    base = CRAFTED.exp().numpy()
    probabilities[list(allowed)] = base[list(allowed)] / base[list(allowed)].sum()
    _assert_frequencies_match(tokens, probabilities)


@pytest.mark.parametrize("case", range(6))
def test_truncation_matches_reference_on_random_logits_with_ties(case: int) -> None:
    generator = torch.Generator().manual_seed(case)
    vocab = 40
    # Rounded logits make exact ties, including at the cut-offs.
    logits = torch.round(torch.randn(vocab, generator=generator) * 2.0)
    rng = np.random.default_rng(case)
    params = SamplingParams(
        temperature=float(rng.uniform(0.5, 1.5)),
        top_k=int(rng.choice([-1, 3, 10])),
        top_p=float(rng.choice([1.0, rng.uniform(0.3, 0.95)])),
        min_p=float(rng.choice([0.0, rng.uniform(0.01, 0.2)])),
    )
    kept = _reference_kept(logits, params)
    tokens = _draw_many(params, logits, draws=4000)
    assert set(tokens.tolist()) <= set(np.nonzero(kept)[0].tolist())
    weights = np.exp(logits.double().numpy() / params.temperature) * kept
    _assert_frequencies_match(tokens, weights / weights.sum())


def test_top_p_nucleus_wider_than_the_first_candidate_fetch() -> None:
    # 1800 tied top tokens then 248 slightly lower ones: the 0.8 nucleus needs > 256
    # candidates, ends inside the tie, so exactly the 1800 tied tokens are kept.
    logits = torch.cat([torch.zeros(1800), torch.full((248,), -0.1)])
    tokens = _draw_many(SamplingParams(top_p=0.8), logits, draws=3000)
    assert tokens.max() < 1800
    assert len(set(tokens.tolist())) > 1000


def test_top_k_ties_past_k_are_kept() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0, -1.0])
    tokens = _draw_many(SamplingParams(top_k=2), logits, draws=2000)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_temperature_scales_the_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    for temperature in (0.5, 2.0):
        tokens = _draw_many(SamplingParams(temperature=temperature), logits, draws=4000)
        _assert_frequencies_match(tokens, torch.softmax(logits / temperature, 0).numpy())


# --- penalties ----------------------------------------------------------------------------


def _force(sampler: Sampler, rid: int, token: int, vocab: int) -> None:
    """Emit ``token`` for ``rid`` through a real sampling step (it dominates the logits)."""
    logits = torch.full((1, vocab), -1e4)
    logits[0, token] = 1e4
    assert sampler.sample([rid], logits).tokens == [token]


def test_penalties_change_the_distribution_exactly_as_specified() -> None:
    vocab = 8
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logprobs=True,
    )
    sampler = _sampler_with({1: params}, {1: [0, 1, 1]})
    for token in (2, 2, 3, 0):
        _force(sampler, 1, token, vocab)
    raw = [1.0, -1.0, 0.6, -0.4, 3.0, 0.2, -2.0, 0.0]
    logits = torch.tensor([raw])
    # By hand: repetition over prompt+output {0, 1, 2, 3}; then output counts {2: 2, 3: 1, 0: 1}.
    expected = list(raw)
    expected[0] = 1.0 / 2.0 - 0.5 * 1 - 0.25
    expected[1] = -1.0 * 2.0
    expected[2] = 0.6 / 2.0 - 0.5 * 2 - 0.25
    expected[3] = -0.4 * 2.0 - 0.5 * 1 - 0.25
    out = sampler.sample([1], logits)
    assert logits[0].tolist() == pytest.approx(expected, abs=1e-6)
    hand = torch.log_softmax(torch.tensor(expected, dtype=torch.float64), 0)
    assert out.tokens == [4]
    assert out.logprobs[0] == pytest.approx(float(hand[4]), abs=1e-5)


def test_penalised_sampling_follows_the_penalised_distribution() -> None:
    vocab = 6
    params = SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5)
    logits = torch.tensor([0.5, 0.5, 0.0, 0.0, -0.5, -0.5])
    draws = 3000
    sampler = _sampler_with({rid: _with_seed(params, rid) for rid in range(draws)})
    for rid in range(draws):
        _force(sampler, rid, 0, vocab)
        _force(sampler, rid, 0, vocab)
        _force(sampler, rid, 2, vocab)
    tokens = np.asarray(sampler.sample(list(range(draws)), logits.expand(draws, -1).clone()).tokens)
    penalised = logits.clone()
    penalised[0] -= 1.5 + 0.5 * 2
    penalised[2] -= 1.5 + 0.5 * 1
    _assert_frequencies_match(tokens, torch.softmax(penalised.double(), 0).numpy())


def test_greedy_argmax_is_taken_after_penalties() -> None:
    sampler = _sampler_with({1: SamplingParams(temperature=0.0, repetition_penalty=3.0)}, {1: [0]})
    assert sampler.sample([1], torch.tensor([[3.0, 2.0, -1.0]])).tokens == [1]


def test_penalties_apply_to_logits_made_under_inference_mode() -> None:
    with torch.inference_mode():
        logits = torch.tensor([[2.0, 1.0, 0.5]])
    sampler = _sampler_with({1: SamplingParams(temperature=0.0, repetition_penalty=4.0)}, {1: [0]})
    assert sampler.sample([1], logits).tokens == [1]
    assert logits[0, 0].item() == pytest.approx(0.5)


def test_prompt_ids_outside_the_vocabulary_are_rejected() -> None:
    sampler = _sampler_with({1: SamplingParams(repetition_penalty=1.5)}, {1: [3, 99]})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.sample([1], torch.zeros(1, 10))


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_and_top_logprobs_match_log_softmax() -> None:
    vocab = 5000
    logits = _random_logits(4, vocab, seed=9)
    reference = torch.log_softmax(logits.double(), dim=-1)
    sampler = _sampler_with(
        {
            0: SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
            1: SamplingParams(temperature=0.7, top_k=20, seed=1, logprobs=True),
            2: SamplingParams(temperature=1.0, seed=2),
            3: SamplingParams(temperature=2.0, top_p=0.5, seed=3, logprobs=True, top_logprobs=3),
        }
    )
    out = sampler.sample([0, 1, 2, 3], logits.clone())
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.logprobs[2] is None and out.top_logprobs[2] == [] and out.top_logprobs[1] == []
    for row in (0, 1, 3):
        assert out.logprobs[row] == pytest.approx(float(reference[row, out.tokens[row]]), abs=1e-4)
    for row, n in ((0, 5), (3, 3)):
        best = torch.topk(reference[row], n)
        assert [t for t, _ in out.top_logprobs[row]] == best.indices.tolist()
        assert [lp for _, lp in out.top_logprobs[row]] == pytest.approx(
            best.values.tolist(), abs=1e-4
        )
    assert out.top_logprobs[0][0][0] == out.tokens[0]
    assert all(math.isfinite(lp) and lp <= 0 for lp in (out.logprobs[0], out.logprobs[3]))


# --- the two draw paths -------------------------------------------------------------------


def test_candidate_draw_equals_full_vocabulary_draw() -> None:
    from kernels.sampling import _Candidates, _draw_full

    generator = torch.Generator().manual_seed(5)
    vocab = 3000
    logits = torch.round(torch.randn(vocab, generator=generator) * 8.0) / 4.0  # many ties
    weights = torch.exp(logits - logits.max())
    best = torch.topk(weights, 400)
    candidates = _Candidates(best.values.numpy(), best.indices.numpy())
    threshold = float(best.values[150])
    assert candidates.values[-1] < threshold
    uniforms = torch.rand(500, generator=generator, dtype=torch.float64)
    full = _draw_full(
        weights.expand(500, -1).clone(),
        torch.full((500,), threshold),
        uniforms,
        torch.empty(500, vocab),
        torch.empty(500, vocab, dtype=torch.bool),
    )
    picked = [candidates.draw(threshold, float(u)) for u in uniforms]
    assert picked == full.tolist()
    assert len(set(picked)) > 20


def test_tied_top_k_rows_draw_the_same_through_either_path(monkeypatch) -> None:
    from kernels import sampling

    candidate_draws = {"count": 0}
    original = sampling._Candidates.draw

    def counting(self, threshold: float, uniform: float) -> int:
        candidate_draws["count"] += 1
        return original(self, threshold, uniform)

    monkeypatch.setattr(sampling._Candidates, "draw", counting)
    watched = SamplingParams(temperature=1.0, top_k=50, seed=3)
    alone = _sampler_with({1: watched})
    crowded = _sampler_with({1: watched, 2: SamplingParams(top_k=5000, seed=4)})
    steps, vocab = 15, 20000
    alone_tokens, crowded_tokens = [], []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        # Quarter-step logits: the 50th weight is tied well past rank 51.
        logits = torch.round(torch.randn(2, vocab, generator=generator) * 4.0) / 4.0
        before = candidate_draws["count"]
        alone_tokens.append(alone.sample([1], logits[:1].clone()).tokens[0])
        assert candidate_draws["count"] == before  # 51 candidates cannot hold the tie
        crowded_tokens.append(crowded.sample([2, 1], logits.flip(0).clone()).tokens[1])
    assert candidate_draws["count"] >= steps  # with 5001 candidates the tie fits
    assert crowded_tokens == alone_tokens


def test_sampler_thread_setting_is_scoped_to_the_call() -> None:
    before = torch.get_num_threads()
    sampler = Sampler(num_threads=1)
    sampler.add_request(1, SamplingParams(seed=1, top_p=0.9), [])
    threaded = Sampler()
    threaded.add_request(1, SamplingParams(seed=1, top_p=0.9), [])
    logits = _random_logits(1, 5000, seed=3)
    assert sampler.sample([1], logits.clone()).tokens == threaded.sample([1], logits).tokens
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="num_threads"):
        Sampler(num_threads=0)


def test_logit_bias_forbids_and_forces_tokens() -> None:
    logits = _random_logits(3, 1000, seed=11)
    top = int(logits[0].argmax())
    sampler = _sampler_with(
        {
            1: SamplingParams(temperature=0.0, logit_bias={top: -100.0}),
            2: SamplingParams(temperature=0.0, logit_bias={7: 100.0}),
            3: SamplingParams(temperature=0.8, seed=1, logit_bias={9: 100.0}),
        }
    )
    out = sampler.sample([1, 2, 3], logits.clone())
    assert out.tokens[0] != top
    assert out.tokens[1] == 7 and out.tokens[2] == 9


def test_sampling_on_the_logits_device_draws_what_the_cpu_path_draws():
    """kernels.device_sampling (run here on CPU tensors) picks the CPU sampler's token for
    the same logits and the same per-request uniforms, for every truncation mix."""
    from kernels.device_sampling import sample_rows
    from kernels.sampling import RowParams, Sampler
    from transport.messages.params import GenerationParams

    mixes = [
        GenerationParams(temperature=0.0),
        GenerationParams(temperature=0.7, seed=1),
        GenerationParams(temperature=1.0, top_k=5, seed=2),
        GenerationParams(temperature=1.3, top_p=0.9, seed=3),
        GenerationParams(temperature=0.9, top_k=50, top_p=0.8, seed=4),
        GenerationParams(temperature=1.0, min_p=0.05, seed=5),
        GenerationParams(temperature=1.5, top_k=1, seed=6),
        GenerationParams(temperature=0.5, top_p=0.3, min_p=0.1, seed=7),
    ]
    cpu = Sampler()
    for rid, p in enumerate(mixes):
        cpu.add_request(rid, p, [])
    generators = [
        torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in mixes
    ]
    rows = [RowParams.of(p) for p in mixes]
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(len(mixes), 4096, generator=rng) * 4
        want = cpu.sample(list(range(len(mixes))), logits.clone()).tokens
        uniforms = [
            None
            if g is None or r.is_greedy
            else float(torch.rand((), generator=g, dtype=torch.float64))
            for g, r in zip(generators, rows)
        ]
        got = sample_rows(logits.clone(), rows, uniforms).tolist()
        assert got == want
