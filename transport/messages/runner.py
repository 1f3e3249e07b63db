"""Scheduler <-> model runner messages: one forward batch in, one step result out.

A forward batch is flat: request i owns input_ids[sum(extend_lens[:i]) : ...].
Its new KV goes to row `rows[i]` at positions [prefix_lens[i], prefix_lens[i] +
extend_lens[i]); the slots are in the runner's replica after `deltas` apply.
Sampling state is registered once per request (`new_reqs`) and dropped when it
appears in `finished_rids`, so a decode step carries no per-request parameters.
"""

from __future__ import annotations

import msgspec

from transport.messages.alloc import SlotDeltas
from transport.messages.base import HotMessage
from transport.messages.params import GenerationParams


class RunnerRequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Registers a request with the runner; its sampler state is derived from `params`."""

    rid: int
    params: GenerationParams
    prompt_ids: list[int] = []  # only when repetition_penalty != 1 (it counts prompt tokens)
    grammar: bytes = b""  # params.constraint's compiled grammar (serialized), when it has one


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


class StepResultMsg(HotMessage):
    step: int
    rids: list[int]  # requests that sampled a token, in batch order
    tokens: list[int]
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
