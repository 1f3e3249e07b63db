"""Batched per-request token sampling.

Owns the step from float32 logits [B, V] to one token per request, with each request's own
parameters (``RowParams``) and state (seeded generator, penalty counts). Semantics follow
vLLM/OpenAI:

1. adjustments (in place on ``logits``): ``logit_bias`` (added to its tokens' logits), then
   repetition_penalty over prompt + output tokens (divide a positive logit, multiply a
   negative one), then ``frequency_penalty * count`` and ``presence_penalty`` (once) over
   output tokens, then, for the rows of requests with a grammar (constrained decoding,
   `kernels.grammar`), -inf for every token the grammar does not allow next;
2. greedy requests (temperature 0, or below `GREEDY_TEMPERATURE_BELOW` = 1e-5, where dividing
   by it would overflow) take the argmax of the penalised logits;
3. otherwise: temperature, then top-k, then top-p over the top-k distribution (the smallest
   prefix of the sorted distribution whose mass reaches top_p; the top token is always kept),
   then min-p (drop tokens with prob < min_p * max_prob), then one draw from the request's
   generator.

Choices worth knowing:

- Truncation is by value threshold: every token whose probability equals the cut-off value is
  kept (so top-k may keep more than k tokens when values tie, as vLLM does).
- The draw is an inverse-CDF draw over the kept tokens in vocabulary order, using exactly one
  uniform from the request's generator per sampled step (none for greedy steps). Every step that
  involves a request is computed with row-wise operations whose result does not depend on the
  other rows, so a request's tokens depend only on its seed and its own logits, never on the
  batch it rides in.
- Logprobs are those of the model distribution after bias, penalties and grammar mask,
  before temperature, top-k/top-p/min-p (``log_softmax`` of the penalised logits), as
  vLLM/OpenAI report them.
- ``sample`` applies the penalties to the ``logits`` tensor it is given, in place (the caller
  hands over a fresh tensor; no [B, V] copy is made for them). It runs under inference mode,
  so logits produced under inference mode are accepted.
- Tokens whose probability relative to the top token is below exp(-87) (~1.6e-38, subnormal
  in float32) get weight exactly 0: subnormal arithmetic would slow every pass tens of times.
- Penalty state is sparse: per request, a dict + numpy arrays of distinct token ids and counts;
  each step gathers them into one flat index over [B, V] (no dense [B, V] state).
- Logits on a GPU are sampled there (`kernels.device_sampling`, same semantics, one copy of
  the token ids back) unless a request of the step has penalties, a grammar or logprobs;
  then the step's logits come to the CPU once.

Verification of draft tokens (speculative decoding, ``Sampler.verify``): one request's k
draft tokens are scored against the target model's k + 1 logits rows, row j being the
distribution after draft[:j]. Each position is processed as ``sample`` would process that row
with the request's state as it stands after the tokens emitted before it (bias, penalties
counting them, the grammar mask of the matcher that accepted them, logprobs). The request
emits the accepted drafts and then one more token, 1..k+1 in all, each recorded in order; the
matcher only ever accepts emitted tokens, so nothing needs rolling back.

- Greedy requests accept draft[j] iff it is the argmax ``sample`` takes at row j and emit that
  argmax at the first mismatch (or at row k after k acceptances): output is identical with and
  without speculation.
- Sampled requests use rejection sampling (Leviathan et al. 2023, as vLLM's rejection
  sampler). p_j is the distribution the ordinary draw uses at row j (temperature, then the
  min-p/top-k/top-p value threshold, renormalised over the kept tokens); q_j is the drafter's
  (a point mass at draft[j] unless ``draft_probs`` is given). draft[j] is accepted iff
  u < `acceptance_probability` = min(1, p_j(d) / q_j(d)); on rejection one inverse-CDF draw from
  `residual_distribution` = max(p_j - q_j, 0) (renormalised) is emitted; after k acceptances
  row k is sampled as ``sample`` samples it. Each verified position uses one uniform from the
  request's generator, a rejection one more: the emitted tokens are distributed exactly as
  ``sample`` row by row would emit them, and a seed reproduces them.
"""

from __future__ import annotations

import math
import operator
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.device_sampling import (
    GREEDY_TEMPERATURE_BELOW,  # noqa: F401 (re-exported)
    is_greedy_temperature,
    sample_rows,
    simple_enough,
)

# First candidate count tried when a top-p row has no top-k; grows x16 (then to the whole
# vocabulary) until the nucleus fits.
TOP_P_FIRST_CANDIDATES = 256
SUBNORMAL_LOG_FLOOR = -87.0


@dataclass(frozen=True, slots=True)
class RowParams:
    """The sampler's per-request form of a request's parameters, derived once when it is
    registered from the engine's `GenerationParams` (or any object with these attributes).
    The sampler trusts them: validation happens once, where requests enter the engine."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logprobs: bool
    top_logprobs: int
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, p: Any) -> RowParams:
        return cls(
            temperature=float(p.temperature),
            top_k=int(p.top_k),
            top_p=float(p.top_p),
            min_p=float(p.min_p),
            seed=p.seed,
            repetition_penalty=float(p.repetition_penalty),
            frequency_penalty=float(p.frequency_penalty),
            presence_penalty=float(p.presence_penalty),
            logprobs=bool(p.logprobs),
            top_logprobs=int(p.top_logprobs) if p.logprobs else 0,
            logit_bias=tuple(
                sorted(
                    (int(t), float(b)) for t, b in (getattr(p, "logit_bias", None) or {}).items()
                )
            ),
        )

    @property
    def is_greedy(self) -> bool:
        return is_greedy_temperature(self.temperature)

    @property
    def has_penalties(self) -> bool:
        """Whether anything edits this row's logits before sampling (bias or penalties)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0


class _GrowableIds:
    """Distinct token ids (insertion order) with an int64 count each, viewable as numpy."""

    def __init__(self, initial: np.ndarray | None = None) -> None:
        ids = np.unique(initial) if initial is not None and initial.size else np.empty(0, np.int64)
        capacity = max(16, 2 * ids.size)
        self.ids = np.zeros(capacity, np.int64)
        self.counts = np.zeros(capacity, np.int64)
        self.size = ids.size
        self.ids[: self.size] = ids
        self.counts[: self.size] = 1
        self.slot = {int(t): i for i, t in enumerate(ids)}

    def add(self, token: int) -> None:
        slot = self.slot.get(token)
        if slot is None:
            if self.size == self.ids.size:
                self.ids = np.resize(self.ids, 2 * self.size)
                self.counts = np.resize(self.counts, 2 * self.size)
            slot = self.size
            self.slot[token] = slot
            self.ids[slot] = token
            self.counts[slot] = 0
            self.size += 1
        self.counts[slot] += 1

    def view_ids(self) -> np.ndarray:
        return self.ids[: self.size]

    def view_counts(self) -> np.ndarray:
        return self.counts[: self.size]


class SamplerState:
    """What the sampler keeps for one request between steps.

    Invariant: ``output`` counts every token this sampler emitted for the request (only kept
    when the request has penalties); ``seen`` holds the distinct ids of prompt + output (only
    kept when repetition_penalty != 1).
    """

    def __init__(self, params: RowParams, prompt_ids: list[int], matcher: Any = None) -> None:
        self.params = params
        self.matcher = matcher  # a kernels.grammar.TokenMatcher, for a constrained request
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.num_sampled = 0
        self.output: _GrowableIds | None = None
        self.seen: _GrowableIds | None = None
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self.output = _GrowableIds()
        self.bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in params.logit_bias], dtype=np.float32)
        if params.repetition_penalty != 1.0:
            prompt = np.asarray(prompt_ids, dtype=np.int64)
            if prompt.size and prompt.min() < 0:
                raise ValueError("prompt token ids must be non-negative")
            self.seen = _GrowableIds(prompt)

    def record(self, token: int) -> None:
        self.num_sampled += 1
        if self.matcher is not None:
            self.matcher.accept(token)
        if self.output is not None:
            self.output.add(token)
        if self.seen is not None and token not in self.seen.slot:
            self.seen.add(token)

    def next_uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))


@dataclass
class SampleOutput:
    tokens: list[int]
    # Per row: log-prob of the chosen token, None for rows that did not ask; None if no row did.
    logprobs: list[float | None] | None = None
    # Per row: (token, log-prob) best first, [] for rows that did not ask; None if no row did.
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Sampler:
    """Samples one token per request for a batch of logits rows, one call per step.

    ``num_threads``: torch intra-op threads while sampling (None = leave the process setting).
    The work is a handful of memory-bound passes; on a busy 2-core box one thread avoids
    OpenMP barrier stalls (measure with `bin/engine bench lm_head --sampler`).
    """

    def __init__(self, num_threads: int | None = None) -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
        self.num_threads = num_threads
        self._states: dict[int, SamplerState] = {}
        # Reused [rows, V] float32 buffers: fresh 32 MiB tensors page-fault on every step.
        self._probs_buf = torch.empty(0)
        self._cdf_buf = torch.empty(0)
        self._mask_buf = torch.empty(0, dtype=torch.bool)
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: int) -> bool:
        return rid in self._states

    def add_request(
        self, rid: int, params: Any, prompt_ids: list[int], matcher: Any = None
    ) -> None:
        """Register `rid` with its (already validated) parameters and, for a constrained
        request, its grammar matcher (`kernels.grammar.TokenMatcher`)."""
        if rid in self._states:
            raise ValueError(f"request {rid} is already registered with the sampler")
        self._states[rid] = SamplerState(RowParams.of(params), prompt_ids, matcher)

    def remove_request(self, rid: int) -> None:
        self._states.pop(rid, None)

    def state(self, rid: int) -> SamplerState:
        return self._states[rid]

    def sample(self, rids: list[int], logits: Tensor) -> SampleOutput:
        """One token per row of ``logits`` [B, V] for the requests ``rids`` (row order).

        Penalties are applied to ``logits`` in place (to its float32 CPU copy when it is not
        already a contiguous float32 CPU tensor). Each chosen token is recorded into its
        request's state.
        """
        with self._threads():
            return self._sample(rids, logits)

    def verify(
        self, rid: int, logits: Tensor, draft: Sequence[int], draft_probs: Tensor | None = None
    ) -> SampleOutput:
        """Score a request's k draft tokens with the target model's logits [k + 1, V] (row j:
        the distribution of the token after draft[:j]) and return the tokens it emits this
        step: the accepted drafts, then one more (the correction at the first rejection, or the
        bonus token after all k were accepted): 1..k+1 tokens, each recorded into the
        request's state (penalty counts, grammar matcher accept, num_sampled) in order.

        ``draft_probs`` [k, V]: the drafter's distribution per position (rows summing to 1);
        None for a drafter that proposes point masses (n-gram lookup). Greedy requests ignore
        it. ``SampleOutput`` rows are the emitted tokens (logprobs and top_logprobs per emitted
        token, as ``sample`` reports them). Rows up to the last emitted one get their
        penalties in place, as ``sample`` edits its logits. Logits on a GPU: a greedy request
        without penalties, grammar or logprobs takes every row's argmax there (one copy of k + 1
        ids back); otherwise the rows come to the CPU once. Bad input (row count, draft ids
        outside the vocabulary, ``draft_probs`` shape) raises ValueError before any state
        changes; an empty draft is ``sample([rid], logits)``.
        """
        with self._threads():
            return self._verify(rid, logits, draft, draft_probs)

    @contextmanager
    def _threads(self) -> Iterator[None]:
        if self.num_threads is None:
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    @torch.inference_mode()  # also lets penalties edit logits made under inference mode
    def _sample(self, rids: list[int], logits: Tensor) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rids):
            raise ValueError(
                f"logits must be [len(rids)={len(rids)}, V], got {tuple(logits.shape)}"
            )
        if len(set(rids)) != len(rids):
            raise ValueError("a request may appear only once per sampling batch")
        missing = [rid for rid in rids if rid not in self._states]
        if missing:
            raise KeyError(f"requests not registered with the sampler: {missing}")
        if logits.device.type != "cpu":
            states = [self._states[rid] for rid in rids]
            if all(s.matcher is None and simple_enough(s.params) for s in states):
                # On the logits' device; one copy of the B token ids comes back.
                uniforms = [None if s.params.is_greedy else s.next_uniform() for s in states]
                tokens = sample_rows(logits.float(), [s.params for s in states], uniforms)
                output = SampleOutput(tokens=tokens.tolist())
                for state, token in zip(states, output.tokens):
                    state.record(token)
                return output
            logits = logits.float().cpu()  # penalties, grammars, logprobs: on the CPU
        if logits.dtype != torch.float32 or not logits.is_contiguous():
            logits = logits.float().contiguous()
        states = [self._states[rid] for rid in rids]
        if not rids:
            return SampleOutput(tokens=[])
        params = [s.params for s in states]

        self._adjust(states, logits)

        tokens = torch.empty(len(rids), dtype=torch.int64)
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy_rows:
            # numpy's argmax (first maximal index, like torch's) is faster than torch's here.
            tokens[greedy_rows] = torch.from_numpy(
                _take_rows(logits, greedy_rows).numpy().argmax(axis=-1)
            )
        if sampled_rows:
            tokens[sampled_rows] = self._sample_rows(logits, sampled_rows, states)

        output = SampleOutput(tokens=tokens.tolist())
        if any(p.logprobs for p in params):
            scratch = self._workspace(sum(p.logprobs for p in params), logits.shape[1])[0]
            output.logprobs, output.top_logprobs = _logprobs(logits, tokens, params, scratch)
        for state, token in zip(states, output.tokens):
            state.record(token)
        return output

    # --- verification of draft tokens ---------------------------------------------------

    @torch.inference_mode()
    def _verify(
        self, rid: int, logits: Tensor, draft: Sequence[int], draft_probs: Tensor | None
    ) -> SampleOutput:
        state = self._states.get(rid)
        if state is None:
            raise KeyError(f"requests not registered with the sampler: [{rid}]")
        draft = _checked_draft(logits, draft, draft_probs)
        if not draft:
            return self._sample([rid], logits)
        params = state.params
        if logits.device.type != "cpu":
            if params.is_greedy and state.matcher is None and simple_enough(params):
                # Every row's argmax on the logits' device, one copy of k + 1 ids back: the
                # tokens `sample` takes there row by row, as nothing edits these rows.
                chain = logits.float().argmax(dim=-1).tolist()
                tokens = chain[: _accepted(draft, chain) + 1]
                for token in tokens:
                    state.record(token)
                return SampleOutput(tokens=tokens)
            logits = logits.float().cpu()
        if logits.dtype != torch.float32 or not logits.is_contiguous():
            logits = logits.float().contiguous()
        if params.is_greedy:
            outputs = []
            for j in range(len(draft) + 1):
                outputs.append(self._sample([rid], logits[j : j + 1]))
                if j == len(draft) or outputs[-1].tokens[0] != draft[j]:
                    break
            return _joined(outputs, params.logprobs)
        return self._verify_sampled(rid, state, logits, draft, draft_probs)

    def _verify_sampled(
        self,
        rid: int,
        state: SamplerState,
        logits: Tensor,
        draft: list[int],
        draft_probs: Tensor | None,
    ) -> SampleOutput:
        """Rejection sampling over the draft (module docstring); the bonus row by `_sample`."""
        params, vocab = state.params, logits.shape[1]
        q_at_draft = (
            [1.0] * len(draft)
            if draft_probs is None
            else draft_probs[torch.arange(len(draft)), torch.tensor(draft)].double().tolist()
        )
        outputs = []
        for j, proposed in enumerate(draft):
            row = logits[j : j + 1]
            self._adjust([state], row)
            weights, threshold, candidates = self._truncation(row, [0], [params])
            _, cdf, mask = self._workspace(1, vocab)
            cut = float(threshold[0])
            fetched = candidates.get(0)
            masked = False
            if fetched is not None and fetched.values[-1] < cut:  # every kept weight fetched
                total = float(fetched.values[fetched.values >= cut].sum(dtype=np.float64))
            else:
                _drop_below(weights, cut, mask)
                masked = True
                total = float(weights.sum())
            weight = float(weights[0, proposed])
            p_proposed = weight / total if weight >= cut else 0.0
            accept = state.next_uniform() < acceptance_probability(p_proposed, q_at_draft[j])
            if accept:
                token = proposed
            else:
                if not masked:
                    _drop_below(weights, cut, mask)
                p = weights[0].div_(total)
                if draft_probs is None:
                    q = torch.zeros(vocab)
                    q[proposed] = 1.0
                else:
                    q = draft_probs[j].float().cpu()
                token = _draw_residual(p, q, state.next_uniform(), cdf[0], mask[0])
            outputs.append(SampleOutput(tokens=[token]))
            if params.logprobs:
                scratch = self._workspace(1, vocab)[0]
                chosen = torch.tensor([token])
                outputs[-1].logprobs, outputs[-1].top_logprobs = _logprobs(
                    row, chosen, [params], scratch
                )
            state.record(token)
            if not accept:
                return _joined(outputs, params.logprobs)
        outputs.append(self._sample([rid], logits[len(draft) :]))
        return _joined(outputs, params.logprobs)

    # --- penalties ------------------------------------------------------------------------

    def _adjust(self, states: list[SamplerState], logits: Tensor) -> None:
        """Bias, penalties, then grammar masks, in place on ``logits`` (row i: states[i])."""
        if any(s.params.has_penalties for s in states):
            self._apply_penalties(states, logits)
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        if constrained:
            self._apply_grammars(states, constrained, logits)

    def _apply_penalties(self, states: list[SamplerState], logits: Tensor) -> None:
        vocab = logits.shape[1]
        flat = logits.view(-1)
        rep_index: list[np.ndarray] = []
        rep_factor: list[np.ndarray] = []
        add_index: list[np.ndarray] = []
        add_delta: list[np.ndarray] = []
        bias_index: list[np.ndarray] = []
        bias_delta: list[np.ndarray] = []
        for row, state in enumerate(states):
            p = state.params
            if state.bias_ids.size:
                _check_ids(state.bias_ids, vocab)
                bias_index.append(state.bias_ids + row * vocab)
                bias_delta.append(state.bias_values)
            if state.seen is not None and state.seen.size:
                ids = state.seen.view_ids()
                _check_ids(ids, vocab)
                rep_index.append(ids + row * vocab)
                rep_factor.append(np.full(ids.size, p.repetition_penalty, np.float32))
            if state.output is not None and state.output.size:
                ids, counts = state.output.view_ids(), state.output.view_counts()
                _check_ids(ids, vocab)
                add_index.append(ids + row * vocab)
                add_delta.append(
                    (-(p.frequency_penalty * counts + p.presence_penalty)).astype(np.float32)
                )
        if bias_index:
            index = torch.from_numpy(np.concatenate(bias_index))
            flat.index_add_(0, index, torch.from_numpy(np.concatenate(bias_delta)))
        if rep_index:
            index = torch.from_numpy(np.concatenate(rep_index))
            factor = torch.from_numpy(np.concatenate(rep_factor))
            values = flat[index]
            flat[index] = torch.where(values > 0, values / factor, values * factor)
        if add_index:
            index = torch.from_numpy(np.concatenate(add_index))
            flat.index_add_(0, index, torch.from_numpy(np.concatenate(add_delta)))

    # --- grammars ---------------------------------------------------------------------------

    def _apply_grammars(self, states: list[SamplerState], rows: list[int], logits: Tensor) -> None:
        """Mask the rows of constrained requests to what their grammars allow next."""
        from kernels.grammar import apply_token_bitmask

        vocab_size = states[rows[0]].matcher.vocab_size  # one grammar engine per runner
        words = (vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(
                max(len(rows), self._bitmask.shape[0]), words, dtype=torch.int32
            )
        bitmask = self._bitmask[: len(rows)]
        for j, i in enumerate(rows):
            states[i].matcher.fill(bitmask, j)
        apply_token_bitmask(logits, bitmask, rows, vocab_size)

    # --- stochastic rows ------------------------------------------------------------------

    def _workspace(self, rows: int, vocab: int) -> tuple[Tensor, Tensor, Tensor]:
        if self._probs_buf.shape[0] < rows or self._probs_buf.shape[1:] != (vocab,):
            capacity = max(rows, self._probs_buf.shape[0] if self._probs_buf.dim() == 2 else 0)
            self._probs_buf = torch.empty(capacity, vocab)
            self._cdf_buf = torch.empty(capacity, vocab)
            self._mask_buf = torch.empty(capacity, vocab, dtype=torch.bool)
        return self._probs_buf[:rows], self._cdf_buf[:rows], self._mask_buf[:rows]

    def _sample_rows(self, logits: Tensor, rows: list[int], states: list[SamplerState]) -> Tensor:
        weights, threshold, candidates = self._truncation(
            logits, rows, [states[i].params for i in rows]
        )
        _, cdf, mask = self._workspace(len(rows), logits.shape[1])
        uniforms = [states[i].next_uniform() for i in rows]
        chosen = torch.empty(len(rows), dtype=torch.int64)
        # Rows whose kept set lies inside the fetched candidates skip the full-vocabulary passes;
        # both paths compute the same float32 CDF over kept tokens in vocabulary order.
        full_rows = []
        for j in range(len(rows)):
            fetched = candidates.get(j)
            if fetched is not None and fetched.values[-1] < threshold[j]:
                chosen[j] = fetched.draw(float(threshold[j]), uniforms[j])
            else:
                full_rows.append(j)
        if full_rows:
            chosen[full_rows] = _draw_full(
                _take_rows(weights, full_rows),
                torch.from_numpy(threshold[full_rows]),
                torch.tensor([uniforms[j] for j in full_rows], dtype=torch.float64),
                cdf[: len(full_rows)],
                mask[: len(full_rows)],
            )
        return chosen

    def _truncation(
        self, logits: Tensor, rows: list[int], params: list[RowParams]
    ) -> tuple[Tensor, np.ndarray, dict[int, _Candidates]]:
        """The distribution each listed row of ``logits`` is drawn from, as (weights, threshold,
        candidates): weights [len(rows), V] (a workspace buffer) are exp(x / T - rowmax), 0 below
        exp(-87); the kept tokens are those with weight >= threshold[j] (float32 per row);
        candidates[j], where top-k or top-p fetched them, are row j's largest weights."""
        vocab = logits.shape[1]
        weights, cdf, _ = self._workspace(len(rows), vocab)
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        if len(rows) == logits.shape[0]:
            torch.div(logits, temperature, out=weights)
        else:
            torch.index_select(logits, 0, torch.tensor(rows), out=weights)
            weights.div_(temperature)
        # weights = exp(x - rowmax): the top token weighs exactly 1, so p / p_max == weight.
        # Weights below exp(-87) (~1.6e-38, subnormal in float32) are flushed to exactly 0:
        # subnormals make every later pass tens of times slower on x86.
        weights.sub_(weights.amax(dim=-1, keepdim=True))
        F.threshold_(weights, SUBNORMAL_LOG_FLOOR, -math.inf)
        weights.exp_()

        # Per row, the smallest weight that survives min-p, top-k and top-p, and (where top-k
        # or top-p fetched them) the largest weights with their token ids.
        threshold = np.array([p.min_p for p in params], dtype=np.float32)
        candidates: dict[int, _Candidates] = {}
        by_top_k = [j for j, p in enumerate(params) if p.uses_top_k]
        if by_top_k:
            cuts, fetched = _top_k_cuts(
                _take_rows(weights, by_top_k), [params[j] for j in by_top_k]
            )
            threshold[by_top_k] = np.maximum(threshold[by_top_k], cuts)
            candidates.update(zip(by_top_k, fetched))
        by_top_p_only = [j for j, p in enumerate(params) if p.uses_top_p and not p.uses_top_k]
        if by_top_p_only:
            cuts, fetched = _top_p_cuts(
                _take_rows(weights, by_top_p_only), [params[j] for j in by_top_p_only], scratch=cdf
            )
            threshold[by_top_p_only] = np.maximum(threshold[by_top_p_only], cuts)
            candidates.update((j, c) for j, c in zip(by_top_p_only, fetched) if c is not None)
        return weights, threshold, candidates


def acceptance_probability(p_d: float, q_d: float) -> float:
    """The probability of accepting a draft token d: min(1, p(d) / q(d)) for target
    probability p(d) and drafter probability q(d); 0 whenever the target gives d nothing."""
    if p_d <= 0.0:
        return 0.0
    if p_d >= q_d:
        return 1.0
    return p_d / q_d


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """What a rejected position draws from: max(p - q, 0) over the vocabulary, unnormalised
    (the draw normalises). With acceptance by `acceptance_probability`, accepting or drawing
    from it emits a token distributed exactly by p."""
    return torch.sub(p, q).clamp_(min=0.0)


def _draw_residual(p: Tensor, q: Tensor, uniform: float, cdf: Tensor, mask: Tensor) -> int:
    """Inverse-CDF draw from `residual_distribution(p, q)` ([V] each; ``cdf``, ``mask``:
    [V] scratch). A residual with no mass (p == q up to rounding, where rejection has
    probability ~0) falls back to p itself."""
    residual = residual_distribution(p, q)
    if not float(residual.sum()) > 0.0:
        residual = p
    chosen = _draw_full(
        residual.unsqueeze(0),
        torch.zeros(1),
        torch.tensor([uniform], dtype=torch.float64),
        cdf.unsqueeze(0),
        mask.unsqueeze(0),
    )
    return int(chosen[0])


def _drop_below(weights: Tensor, cut: float, mask: Tensor) -> None:
    """Zero, in place, the weights of one row [1, V] below ``cut`` (``mask``: [1, V] scratch)."""
    if cut > 0.0:
        torch.lt(weights, cut, out=mask)
        weights.masked_fill_(mask, 0.0)


def _checked_draft(logits: Tensor, draft: Sequence[int], draft_probs: Tensor | None) -> list[int]:
    """``draft`` as a list of ints, after checking it against ``logits`` and ``draft_probs``."""
    try:
        ids = [operator.index(t) for t in draft]
    except TypeError:
        raise ValueError("draft token ids must be integers") from None
    if logits.dim() != 2 or logits.shape[0] != len(ids) + 1:
        raise ValueError(
            f"logits must be [len(draft) + 1 = {len(ids) + 1}, V], got {tuple(logits.shape)}"
        )
    vocab = logits.shape[1]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft token ids {bad[:5]} are outside the vocabulary of {vocab}")
    if draft_probs is not None and tuple(draft_probs.shape) != (len(ids), vocab):
        raise ValueError(
            f"draft_probs must be [len(draft) = {len(ids)}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )
    return ids


def _accepted(draft: list[int], chain: list[int]) -> int:
    """How many leading drafts equal the target's tokens."""
    for j, token in enumerate(draft):
        if token != chain[j]:
            return j
    return len(draft)


def _joined(outputs: list[SampleOutput], with_logprobs: bool) -> SampleOutput:
    """One request's single-token outputs as one output, a row per token."""
    joined = SampleOutput(tokens=[t for out in outputs for t in out.tokens])
    if with_logprobs:
        joined.logprobs = [lp for out in outputs for lp in out.logprobs]
        joined.top_logprobs = [top for out in outputs for top in out.top_logprobs]
    return joined


def _draw_full(
    weights: Tensor, threshold: Tensor, uniforms: Tensor, cdf: Tensor, mask: Tensor
) -> Tensor:
    """Inverse-CDF draw per row over every weight >= its threshold (``weights`` is edited)."""
    if bool((threshold > 0).any()):
        torch.lt(weights, threshold.unsqueeze(1), out=mask)
        weights.masked_fill_(mask, 0.0)
    torch.cumsum(weights, dim=-1, out=cdf)  # per row, sequential, accumulated in float64
    targets = (uniforms * cdf[:, -1].double()).to(torch.float32).unsqueeze(1)
    chosen = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # u * total can round up to total itself; then take the last token with weight.
    for j in (chosen >= weights.shape[1]).nonzero().flatten().tolist():
        chosen[j] = int(weights[j].nonzero().max())
    return chosen


@dataclass(frozen=True)
class _Candidates:
    """One row's largest weights (descending) and their token ids."""

    values: np.ndarray
    ids: np.ndarray

    def draw(self, threshold: float, uniform: float) -> int:
        """The token ``_draw_full`` would pick, given every kept weight is a candidate."""
        kept = self.values >= threshold
        ids = self.ids[kept]
        order = np.argsort(ids)
        ids = ids[order]
        # Same accumulation as torch.cumsum on float32 (float64 accumulator, float32 result).
        cdf = np.cumsum(self.values[kept][order], dtype=np.float64).astype(np.float32)
        target = np.float32(uniform * np.float64(cdf[-1]))
        position = int(np.searchsorted(cdf, target, side="right"))
        if position >= ids.size:
            position = int(np.nonzero(self.values[kept][order] > 0)[0].max())
        return int(ids[position])


# Truncation works by value on weights whose row maximum is exactly 1: top-k keeps every
# weight >= the k-th largest (ties included); top-p ranks the top-k-kept multiset by weight and
# keeps every weight >= the weight at the first rank whose inclusive mass reaches top_p of the
# kept mass. Only sorted candidate values are used (never their order among ties), every
# reduction is per row and sequential, and the candidate count only bounds the search, so a
# row's cut-off does not depend on which other rows share the batch.


def _top_k_cuts(matrix: Tensor, params: list[RowParams]) -> tuple[np.ndarray, list[_Candidates]]:
    """Per row of ``matrix``: the top-k cut-off (raised to the top-p one where top_p < 1)."""
    vocab = matrix.shape[1]
    k = np.array([min(p.top_k, vocab) for p in params])
    # One candidate past the largest k: a row whose last candidate is below its cut-off has
    # every kept weight among its candidates.
    count = min(vocab, int(k.max()) + 1)
    best = torch.topk(matrix, count, dim=-1, sorted=True)
    values, ids = best.values.numpy(), best.indices.numpy()
    fetched = [_Candidates(values[slot], ids[slot]) for slot in range(len(params))]
    slots = np.arange(len(params))
    k_cut = values[slots, k - 1]
    cuts = k_cut.copy()
    wants_top_p = [slot for slot, p in enumerate(params) if p.uses_top_p]
    if not wants_top_p:
        return cuts, fetched
    # Weights tied with the k-th may run past the fetched candidates: count them in full.
    # (numpy: torch's bool reductions are much slower than this single-threaded count.)
    kept = np.count_nonzero(matrix.numpy() >= k_cut[:, None], axis=-1)
    fetched_above = np.count_nonzero(values > k_cut[:, None], axis=-1)
    inclusive = np.cumsum(values, axis=-1, dtype=np.float64)
    mass_above = np.where(
        fetched_above > 0, inclusive[slots, np.maximum(fetched_above, 1) - 1], 0.0
    )
    total = mass_above + (kept - fetched_above) * k_cut.astype(np.float64)
    for slot in wants_top_p:
        # Ranks past ``kept`` are outside the top-k set; ranks past ``count`` all weigh k_cut.
        searchable = min(count, int(kept[slot]))
        rank = int(np.searchsorted(inclusive[slot, :searchable], params[slot].top_p * total[slot]))
        if rank < searchable:
            cuts[slot] = max(cuts[slot], values[slot, rank])
    return cuts, fetched


def _top_p_cuts(
    matrix: Tensor, params: list[RowParams], scratch: Tensor
) -> tuple[np.ndarray, list[_Candidates | None]]:
    """Per row of ``matrix`` (no top-k): the top-p cut-off, fetching more candidates as needed."""
    rows, vocab = matrix.shape
    # Row totals from a per-row sequential cumsum (its last column): batch-invariant rounding.
    torch.cumsum(matrix, dim=-1, out=scratch[:rows])
    targets = scratch[:rows, -1].double().numpy() * np.array(
        [p.top_p for p in params], dtype=np.float64
    )
    cuts = np.zeros(rows, dtype=np.float32)
    fetched: list[_Candidates | None] = [None] * rows
    pending = list(range(rows))
    count = min(vocab, TOP_P_FIRST_CANDIDATES)
    while pending:
        subset = _take_rows(matrix, pending)
        if count >= vocab:  # numpy's SIMD sort of bare values beats torch.sort
            values, ids = -np.sort(-subset.numpy(), axis=-1), None
        else:
            best = torch.topk(subset, count, dim=-1, sorted=True)
            values, ids = best.values.numpy(), best.indices.numpy()
        inclusive = np.cumsum(values, axis=-1, dtype=np.float64)
        still_pending = []
        for slot, row in enumerate(pending):
            rank = int(np.searchsorted(inclusive[slot], targets[row]))
            if rank >= count and count < vocab:
                still_pending.append(row)  # the nucleus reaches past the candidates
                continue
            cuts[row] = values[slot, min(rank, count - 1)]
            if ids is not None:
                fetched[row] = _Candidates(values[slot], ids[slot])
        pending = still_pending
        count = vocab if count * 16 >= vocab // 4 else count * 16
    return cuts, fetched


def _logprobs(
    logits: Tensor, tokens: Tensor, params: list[RowParams], scratch: Tensor
) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """Log-probs under log_softmax(logits) for the rows that asked (``scratch``: [rows, V])."""
    rows = [i for i, p in enumerate(params) if p.logprobs]
    chosen_logprobs: list[float | None] = [None] * len(params)
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    selected = _take_rows(logits, rows)
    # logsumexp by hand into reused memory, subnormals flushed: faster than torch's.
    row_max = selected.amax(dim=-1, keepdim=True)
    torch.sub(selected, row_max, out=scratch)
    F.threshold_(scratch, SUBNORMAL_LOG_FLOOR, -math.inf)
    mass = scratch.exp_().sum(dim=-1).double()
    log_normalizer = (row_max.squeeze(1).double() + mass.log()).float()
    chosen = selected.gather(1, tokens[rows].unsqueeze(1)).squeeze(1) - log_normalizer
    for slot, i in enumerate(rows):
        chosen_logprobs[i] = float(chosen[slot])
    widest = min(max(params[i].top_logprobs for i in rows), logits.shape[1])
    if widest > 0:
        best = torch.topk(selected, widest, dim=-1, sorted=True)
        best_logprobs = (best.values - log_normalizer.unsqueeze(1)).tolist()
        best_ids = best.indices.tolist()
        for slot, i in enumerate(rows):
            n = params[i].top_logprobs
            top[i] = list(zip(best_ids[slot][:n], best_logprobs[slot][:n]))
    return chosen_logprobs, top


def _take_rows(matrix: Tensor, rows: list[int]) -> Tensor:
    """The listed rows of ``matrix``: the tensor itself when that is every row, else a copy."""
    if rows == list(range(matrix.shape[0])):
        return matrix
    return matrix.index_select(0, torch.tensor(rows, dtype=torch.int64))


def _check_ids(ids: np.ndarray, vocab: int) -> None:
    if ids.size and int(ids.max()) >= vocab:
        raise ValueError(f"token id {int(ids.max())} is outside the vocabulary of {vocab}")
