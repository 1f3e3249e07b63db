"""Sampler.verify: draft tokens scored against the target model's logits (speculative decoding).

Greedy verification must emit exactly what sampling row by row emits; sampled verification
(rejection sampling) must emit tokens distributed exactly as the target model's: a chi-square
test over many draws holds it to the exact cell probabilities, and the same test must catch
the two classic mistakes when they are planted in the acceptance and residual rules.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from kernels import sampling
from kernels.sampling import Sampler
from transport.messages.params import GenerationParams, OutputConstraint

# --- helpers ------------------------------------------------------------------------------


def _random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _sampler(
    params: GenerationParams, prompt: tuple[int, ...] = (), history: tuple[int, ...] = ()
) -> Sampler:
    """A sampler holding request 1, which has already emitted ``history``; seeded (0 unless
    ``params`` says), so that two such samplers' generators compare equal."""
    if params.seed is None:
        params = msgspec.structs.replace(params, seed=0)
    sampler = Sampler()
    sampler.add_request(1, params, list(prompt))
    for token in history:
        sampler.state(1).record(token)
    return sampler


def _row_by_row(sampler: Sampler, logits: torch.Tensor, draft: list[int]) -> list:
    """What verification must emit: `sample` on each row until a token differs from the draft.
    Returns (token, logprob, top_logprobs) per emitted token."""
    emitted = []
    for j in range(len(draft) + 1):
        out = sampler.sample([1], logits[j : j + 1].clone())
        logprob = out.logprobs[0] if out.logprobs is not None else None
        top = out.top_logprobs[0] if out.top_logprobs is not None else None
        emitted.append((out.tokens[0], logprob, top))
        if j == len(draft) or out.tokens[0] != draft[j]:
            return emitted
    raise AssertionError("unreachable")


def _penalty_state(sampler: Sampler) -> tuple:
    """Everything verification may change in request 1's state, comparable with ==."""
    state = sampler.state(1)
    output = state.output
    seen = state.seen
    return (
        state.num_sampled,
        None if output is None else dict(zip(output.view_ids().tolist(), output.view_counts())),
        None if seen is None else sorted(seen.view_ids().tolist()),
        state.generator.get_state().tolist(),
    )


# --- greedy: identical to sampling row by row --------------------------------------------

GREEDY_CASES = {
    "plain": (GenerationParams(temperature=0.0), (), ()),
    "penalties": (
        GenerationParams(
            temperature=0.0,
            repetition_penalty=1.8,
            frequency_penalty=1.5,
            presence_penalty=1.0,
            logit_bias={3: 4.0, 11: -2.0, 40: 6.0},
        ),
        (5, 6, 7, 40),
        (3, 3, 9),
    ),
    "logprobs": (
        GenerationParams(temperature=0.0, logprobs=True, top_logprobs=4, frequency_penalty=2.0),
        (),
        (2,),
    ),
}


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy_verification_emits_what_sampling_row_by_row_emits(case: str) -> None:
    params, prompt, history = GREEDY_CASES[case]
    vocab = 64  # small, and four tokens ahead: the chain repeats tokens, so penalties matter
    rng = np.random.default_rng(len(case))
    accepted = []
    for trial in range(40):
        k = int(rng.integers(1, 7))
        logits = _random_logits(k + 1, vocab, seed=trial, scale=1.0)
        logits[:, :4] += 3.0
        # The tokens row-by-row sampling emits when every draft is right.
        chainer = _sampler(params, prompt, history)
        chain = [chainer.sample([1], logits[j : j + 1].clone()).tokens[0] for j in range(k + 1)]
        mismatch = int(rng.integers(0, k + 1))  # k: every draft right
        draft = chain[:k]
        if mismatch < k:
            draft[mismatch] = (chain[mismatch] + 1 + int(rng.integers(vocab - 1))) % vocab

        reference = _sampler(params, prompt, history)
        expected = _row_by_row(reference, logits, draft)
        verifier = _sampler(params, prompt, history)
        out = verifier.verify(1, logits.clone(), draft)

        assert out.tokens == [t for t, _, _ in expected] == chain[: mismatch + 1]
        if params.logprobs:
            assert out.logprobs == [lp for _, lp, _ in expected]
            assert out.top_logprobs == [top for _, _, top in expected]
            assert all(len(top) == params.top_logprobs for top in out.top_logprobs)
        else:
            assert out.logprobs is None and out.top_logprobs is None
        assert _penalty_state(verifier) == _penalty_state(reference)
        accepted.append((mismatch, k))
    assert any(m == k for m, k in accepted) and any(0 < m < k for m, k in accepted)
    assert any(m == 0 for m, _ in accepted)


def test_greedy_verification_counts_accepted_drafts_in_the_penalties() -> None:
    """Token 0 leads every row by 1.0; a frequency penalty of 0.6 per use makes it lose row 2
    once it was emitted twice: verification must count the accepted drafts to see that."""
    logits = torch.zeros(3, 8)
    logits[:, 0] = 2.0
    logits[:, 1] = 1.0
    penalised = _sampler(GenerationParams(temperature=0.0, frequency_penalty=0.6))
    assert penalised.verify(1, logits.clone(), [0, 0]).tokens == [0, 0, 1]
    plain = _sampler(GenerationParams(temperature=0.0))
    assert plain.verify(1, logits.clone(), [0, 0]).tokens == [0, 0, 0]


def test_an_empty_draft_is_one_ordinary_sample() -> None:
    logits = _random_logits(1, 300, seed=4)
    for params in (
        GenerationParams(temperature=0.0, logprobs=True, top_logprobs=2),
        GenerationParams(temperature=0.9, top_p=0.9, seed=8, logprobs=True),
    ):
        want = _sampler(params).sample([1], logits.clone())
        got = _sampler(params).verify(1, logits.clone(), [])
        assert (got.tokens, got.logprobs, got.top_logprobs) == (
            want.tokens,
            want.logprobs,
            want.top_logprobs,
        )


# --- sampled: penalties and logprobs per position ------------------------------------------


def test_sampled_positions_see_the_accepted_drafts_penalties_and_report_logprobs() -> None:
    """Token 5 dominates every row (p ~ 1 even after penalties): all drafts are accepted, and
    row j is penalised for the j copies of 5 emitted before it, exactly as `sample` would."""
    vocab, k = 12, 3
    raw = _random_logits(k + 1, vocab, seed=2, scale=0.5)
    raw[:, 5] = 40.0
    params = GenerationParams(
        temperature=1.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        seed=3,
        logprobs=True,
        top_logprobs=2,
    )
    sampler = _sampler(params)
    logits = raw.clone()
    out = sampler.verify(1, logits, [5] * k)
    assert out.tokens == [5] * (k + 1)
    expected = raw.clone()
    for j in range(1, k + 1):
        expected[j, 5] -= 0.5 * j + 0.25
    assert torch.allclose(logits, expected)  # every row penalised in place, as `sample` does
    reference = torch.log_softmax(expected.double(), dim=-1)
    for j, token in enumerate(out.tokens):
        assert out.logprobs[j] == pytest.approx(float(reference[j, token]), abs=1e-5)
        best = torch.topk(reference[j], 2)
        assert [t for t, _ in out.top_logprobs[j]] == best.indices.tolist()
    state = sampler.state(1)
    assert state.num_sampled == k + 1
    assert dict(zip(state.output.view_ids().tolist(), state.output.view_counts())) == {5: k + 1}


# --- grammar ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammar():
    """(engine, vocabulary) over the grammar tests' character vocabulary."""
    from tokenizers import Tokenizer, models

    from kernels.grammar import GrammarEngine  # xgrammar is a pinned dependency
    from tests.model.model_fixtures import char_vocab

    vocab = char_vocab([], eos=1)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return GrammarEngine(tokenizer, len(vocab), [1]), vocab


def _constrained(engine, temperature: float, seed: int = 0):
    """A sampler with request 1 under the regex [0-9]{3}, and a second matcher for reference."""
    constraint = OutputConstraint(kind="regex", spec="[0-9]{3}")
    compiled = engine.compile(constraint.kind, constraint.spec)
    params = GenerationParams(temperature=temperature, seed=seed, constraint=constraint)
    sampler = Sampler()
    sampler.add_request(1, params, [], engine.matcher(compiled))
    return sampler, engine.matcher(compiled)


def _allowed(engine, matcher) -> list[int]:
    bitmask = engine.bitmask(1)
    matcher.fill(bitmask, 0)
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[: matcher.vocab_size]).tolist()


def test_a_draft_the_grammar_forbids_is_rejected_and_never_reaches_the_matcher(grammar) -> None:
    engine, vocab = grammar
    digits = [vocab[c] for c in "0123456789"]
    letter = vocab["x"]
    logits = _random_logits(4, len(vocab), seed=0, scale=1.0)
    logits[:, letter] = 50.0  # the unconstrained argmax everywhere
    best_digit = [digits[int(logits[j, digits].argmax())] for j in range(4)]

    sampler, reference = _constrained(engine, temperature=0.0)
    out = sampler.verify(1, logits.clone(), [best_digit[0], letter, best_digit[2]])
    assert out.tokens == [best_digit[0], best_digit[1]]  # accepted, then the correction
    for token in out.tokens:
        assert reference.accept(token)
    matcher = sampler.state(1).matcher
    assert matcher.rejected == 0
    assert _allowed(engine, matcher) == _allowed(engine, reference) == sorted(digits)

    # Sampled: the forbidden draft has target probability 0, whatever the seed.
    for seed in range(30):
        sampler, _ = _constrained(engine, temperature=1.0, seed=seed)
        out = sampler.verify(1, logits[:2].clone(), [letter])
        assert len(out.tokens) == 1 and out.tokens[0] in digits
        assert sampler.state(1).matcher.rejected == 0


# --- sampled: the emitted tokens follow the target distribution ---------------------------

VOCAB = 6
TARGET_LOGITS = torch.log(
    torch.tensor(
        [
            [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
            [0.10, 0.20, 0.30, 0.20, 0.12, 0.08],
            [0.05, 0.15, 0.40, 0.20, 0.10, 0.10],
        ]
    )
)
# A drafter that overrates token 1 first and token 2 second (so drafts get rejected).
DRAFT_PROBS = torch.tensor(
    [
        [0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
        [0.20, 0.05, 0.45, 0.10, 0.10, 0.10],
    ]
)
POINT_DRAFT = [1, 2]
CHI2_Z_AT_1E3 = 3.090232  # the standard normal's 0.999 quantile


def _chi2_critical(df: int) -> float:
    """Chi-square 0.999 quantile by Wilson-Hilferty (at most 2.5% above the exact one, df >= 2)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + CHI2_Z_AT_1E3 * math.sqrt(a)) ** 3


def _target(params: GenerationParams) -> np.ndarray:
    """The documented target distribution per row, in float64: temperature, top-k (ties kept),
    top-p over the top-k set, min-p, renormalised."""
    rows = []
    for row in TARGET_LOGITS.double().numpy():
        weights = np.exp(row / params.temperature - (row / params.temperature).max())
        kept = np.ones(VOCAB, dtype=bool)
        if params.top_k > 0:
            kept &= weights >= np.sort(weights)[::-1][params.top_k - 1]
        if params.top_p < 1.0:
            ranked = np.sort(weights[kept])[::-1]
            inclusive = np.cumsum(ranked)
            kept &= weights >= ranked[int(np.searchsorted(inclusive, params.top_p * inclusive[-1]))]
        kept &= weights >= params.min_p
        rows.append(weights * kept / (weights * kept).sum())
    return np.array(rows)


def _cell_probabilities(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Probability of each (first, second) outcome, [V, V + 1]: column V is "first rejected,
    nothing more", column t is "first accepted, then t". Accepting t at position 0 has
    probability min(p0, q0)(t), a rejection emitting t max(p0 - q0, 0)(t); whatever happened
    at position 1, the second token is distributed by p1."""
    cells = np.zeros((VOCAB, VOCAB + 1))
    cells[:, :VOCAB] = np.minimum(p[0], q[0])[:, None] * p[1][None, :]
    cells[:, VOCAB] = np.maximum(p[0] - q[0], 0.0)
    return cells


def _chi2(counts: np.ndarray, probabilities: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; inf if an impossible cell was observed."""
    counts, probabilities = counts.ravel(), probabilities.ravel()
    possible = probabilities > 1e-12
    if counts[~possible].any():
        return math.inf, int(possible.sum()) - 1
    expected = probabilities[possible] * counts.sum()
    return float(((counts[possible] - expected) ** 2 / expected).sum()), int(possible.sum()) - 1


def _draw(params: GenerationParams, draws: int, with_draft_probs: bool, seed: int) -> np.ndarray:
    """Counts [V, V + 1] of (first, second) outcomes (`_cell_probabilities`' layout) over
    ``draws`` verifications, each with fresh drafts from the drafter's distribution."""
    rng = np.random.default_rng(seed)
    if with_draft_probs:
        drafts = np.stack(
            [rng.choice(VOCAB, size=draws, p=DRAFT_PROBS[j].double().numpy()) for j in range(2)],
            axis=1,
        )
    else:
        drafts = np.tile(POINT_DRAFT, (draws, 1))
    draft_probs = DRAFT_PROBS if with_draft_probs else None
    sampler = _sampler(msgspec.structs.replace(params, seed=seed))
    counts = np.zeros((VOCAB, VOCAB + 1), dtype=np.int64)
    for draft in drafts.tolist():
        tokens = sampler.verify(1, TARGET_LOGITS.clone(), draft, draft_probs).tokens
        accepted = tokens[0] == draft[0] and len(tokens) > 1
        counts[tokens[0], tokens[1] if accepted else VOCAB] += 1
    return counts


def _statistics(params: GenerationParams, draws: int, with_draft_probs: bool, seed: int):
    """(statistic, critical value) for the first token's marginal and for the joint cells."""
    p = _target(params)
    if with_draft_probs:
        q = DRAFT_PROBS.double().numpy()
    else:
        q = np.eye(VOCAB)[POINT_DRAFT]
    counts = _draw(params, draws, with_draft_probs, seed)
    first, first_df = _chi2(counts.sum(axis=1), p[0])
    joint, joint_df = _chi2(counts, _cell_probabilities(p, q))
    return (first, _chi2_critical(first_df)), (joint, _chi2_critical(joint_df))


SAMPLED_CASES = {
    "point mass": (GenerationParams(temperature=1.0), False),
    "draft probs": (GenerationParams(temperature=1.0), True),
    # top-k keeps the tie at 0.10 (5 tokens), min-p then drops it: the candidates path.
    "top-k, min-p": (GenerationParams(temperature=0.8, top_k=4, min_p=0.3), True),
    # top-p alone over six tokens: the full-vocabulary path, with a masked threshold.
    "top-p": (GenerationParams(temperature=1.3, top_p=0.7), False),
}


@pytest.mark.parametrize("case", sorted(SAMPLED_CASES))
def test_sampled_verification_emits_the_target_distribution(case: str) -> None:
    params, with_draft_probs = SAMPLED_CASES[case]
    (first, first_critical), (joint, joint_critical) = _statistics(
        params, draws=15000, with_draft_probs=with_draft_probs, seed=11
    )
    assert first < first_critical, (first, first_critical)
    assert joint < joint_critical, (joint, joint_critical)


def test_the_chi_square_test_catches_acceptance_that_ignores_the_drafter(monkeypatch) -> None:
    monkeypatch.setattr(sampling, "acceptance_probability", lambda p_d, q_d: p_d)
    (first, first_critical), (joint, joint_critical) = _statistics(
        GenerationParams(temperature=1.0), draws=8000, with_draft_probs=True, seed=12
    )
    assert first > first_critical and joint > joint_critical, (first, joint)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_the_chi_square_test_catches_resampling_from_the_target(
    monkeypatch, with_draft_probs: bool
) -> None:
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    (first, first_critical), (joint, joint_critical) = _statistics(
        GenerationParams(temperature=1.0), draws=8000, with_draft_probs=with_draft_probs, seed=13
    )
    assert first > first_critical and joint > joint_critical, (first, joint)


def test_acceptance_and_residual_rules() -> None:
    assert sampling.acceptance_probability(0.2, 0.5) == pytest.approx(0.4)
    assert sampling.acceptance_probability(0.5, 0.2) == 1.0
    assert sampling.acceptance_probability(0.3, 1.0) == pytest.approx(0.3)  # a point mass
    assert sampling.acceptance_probability(0.0, 0.0) == 0.0  # the target forbids it
    assert sampling.acceptance_probability(0.1, 0.0) == 1.0
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert sampling.residual_distribution(p, q).tolist() == pytest.approx([0.3, 0.0, 0.0])


# --- reproducibility and bad input --------------------------------------------------------


def test_the_same_seed_drafts_and_logits_reproduce_the_same_tokens() -> None:
    vocab, k = 2000, 4
    params = GenerationParams(temperature=1.0, top_p=0.95, frequency_penalty=0.3, seed=21)
    rng = np.random.default_rng(0)
    steps = []
    for step in range(12):
        logits = _random_logits(k + 1, vocab, seed=step, scale=2.0)
        draft_probs = torch.softmax(_random_logits(k, vocab, seed=100 + step, scale=2.0), -1)
        q = draft_probs.double().numpy()
        draft = [int(rng.choice(vocab, p=q[j] / q[j].sum())) for j in range(k)]
        steps.append((logits, draft, draft_probs if step % 2 else None))

    def run(seed: int) -> list[list[int]]:
        sampler = _sampler(msgspec.structs.replace(params, seed=seed))
        return [sampler.verify(1, lg.clone(), d, dp).tokens for lg, d, dp in steps]

    first = run(21)
    assert run(21) == first
    assert run(22) != first
    assert sum(len(tokens) for tokens in first) > len(steps)  # some drafts were accepted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_input_raises_and_changes_no_state(temperature: float) -> None:
    vocab = 50
    params = GenerationParams(
        temperature=temperature, frequency_penalty=0.5, repetition_penalty=1.3, seed=1
    )
    sampler = _sampler(params, prompt=[1, 2], history=[4, 4, 7])
    before = _penalty_state(sampler)
    logits = _random_logits(3, vocab, seed=0)
    bad_calls = [
        (logits, [1], None, "len\\(draft\\) \\+ 1"),
        (logits, [1, 2, 3], None, "len\\(draft\\) \\+ 1"),
        (logits[0], [], None, "len\\(draft\\) \\+ 1"),
        (logits, [1, vocab], None, "outside the vocabulary"),
        (logits, [-1, 2], None, "outside the vocabulary"),
        (logits, [1.0, 2], None, "integers"),
        (logits, [1, 2], torch.full((2, vocab + 1), 1 / vocab), "draft_probs"),
        (logits, [1, 2], torch.full((1, vocab), 1 / vocab), "draft_probs"),
    ]
    for bad_logits, draft, draft_probs, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            sampler.verify(1, bad_logits.clone(), draft, draft_probs)
        assert _penalty_state(sampler) == before
    with pytest.raises(KeyError):
        sampler.verify(2, logits.clone(), [1, 2])
    assert len(sampler.verify(1, logits.clone(), [1, 2]).tokens) >= 1
    assert _penalty_state(sampler) != before


def test_logits_in_another_dtype_verify_as_float32() -> None:
    logits = _random_logits(4, 500, seed=6).to(torch.bfloat16)
    for params in (GenerationParams(temperature=0.0), GenerationParams(temperature=0.7, seed=2)):
        draft = [int(t) for t in logits[:3].float().argmax(dim=-1)]
        want = _sampler(params).verify(1, logits.float(), draft).tokens
        assert _sampler(params).verify(1, logits.clone(), draft).tokens == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_logits_on_a_gpu_verify_as_on_the_cpu() -> None:
    vocab, k = 4096, 4
    logits = _random_logits(k + 1, vocab, seed=8)
    draft_probs = torch.softmax(_random_logits(k, vocab, seed=9), dim=-1)
    chain = [int(t) for t in logits[:k].argmax(dim=-1)]
    for params in (
        GenerationParams(temperature=0.0),  # argmax on the device
        GenerationParams(temperature=0.0, frequency_penalty=0.5),
        GenerationParams(temperature=0.9, top_p=0.9, seed=4),
    ):
        for draft in (chain, chain[:2] + [7, 8]):
            for probs in (None, draft_probs):
                cpu, gpu = _sampler(params), _sampler(params)
                want = cpu.verify(1, logits.clone(), draft, probs).tokens
                on_device = None if probs is None else probs.cuda()
                assert gpu.verify(1, logits.cuda(), draft, on_device).tokens == want
                assert _penalty_state(gpu) == _penalty_state(cpu)
