"""Scheduler <-> model runner messages: one forward batch in, one step result out.

A forward batch is flat: request i owns input_ids[sum(extend_lens[:i]) : ...].
Its new KV goes to row `rows[i]` at positions [prefix_lens[i], prefix_lens[i] +
extend_lens[i]); the slots are in the runner's replica after `deltas` apply.
Sampling state is registered once per request (`new_reqs`) and dropped when it
appears in `finished_rids`, so a decode step carries no per-request parameters.

A compiled grammar (it may be MiBs) never rides in a forward batch: the tokenizer hands it to
the runner once per key in a `LoadGrammar` call of its own, and a request names it by key. A
request whose key the runner does not hold (evicted, or a restarted runner) comes back in
`StepResultMsg.failed_rids` and ends with an error; the rest of the step is unaffected.
"""

from __future__ import annotations

import msgspec

from transport.messages.alloc import SlotDeltas
from transport.messages.base import HotMessage, Message
from transport.messages.params import GenerationParams


class RunnerRequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Registers a request with the runner; its sampler state is derived from `params`."""

    rid: int
    params: GenerationParams
    prompt_ids: list[int] = []  # only when repetition_penalty != 1 (it counts prompt tokens)
    grammar_key: str = ""  # params.constraint's compiled grammar, loaded by `LoadGrammar`


class ForwardBatchMsg(HotMessage):
    step: int
    rids: list[int]
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    need_logits: list[bool]  # False: a non-final prefill chunk, nothing to sample
    deltas: SlotDeltas
    new_reqs: list[RunnerRequest] = []
    finished_rids: list[int] = []
    # Per request, when any asks (else empty): logprobs of every new token's successor with
    # this many alternatives (-1: none), and the token after this chunk (-1: none).
    prompt_logprobs: list[int] = []
    next_ids: list[int] = []
    # Speculative decoding, when any request drafts (else empty): per request, how many of
    # its input ids are draft tokens to verify (its extend is the step's token, then them).
    draft_lens: list[int] = []


class StepResultMsg(HotMessage):
    step: int
    rids: list[int]  # requests that sampled a token, in batch order
    tokens: list[int]  # flat: `counts[i]` tokens of rids[i] (one each when `counts` is empty)
    counts: list[int] = []  # speculative steps: accepted drafts + 1 per request
    logprobs: list[float] = []  # per sampled token, when any request asked
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    forward_ms: float = 0.0
    # Prompt logprobs, per request that asked: `prompt_counts[i]` positions, flat.
    prompt_rids: list[int] = []
    prompt_counts: list[int] = []
    prompt_token_logprobs: list[float] = []
    prompt_top_ids: list[list[int]] = []
    prompt_top_logprobs: list[list[float]] = []
    prompt_ranks: list[int] = []
    # Requests of this batch the runner could not serve (e.g. their grammar is not loaded):
    # nothing sampled for them; the scheduler ends them with an error. `failure` says why.
    failed_rids: list[int] = []
    failure: str = ""


class LoadGrammar(Message):
    """Tokenizer -> runner (a call): keep this compiled grammar under `key` (bytes from
    `GrammarEngine.compile_serialized`). Empty `data`: only ask whether it is held (and mark
    it used). Answered by `GrammarLoaded`."""

    key: str
    data: bytes = b""


class GrammarLoaded(Message):
    key: str
    present: bool  # the runner holds the grammar now
