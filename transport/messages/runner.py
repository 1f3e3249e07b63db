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


class SamplingSpec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    rid: int
    prompt_ids: list[int]  # for repetition_penalty
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = -1  # -1: unseeded
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0


class ForwardBatchMsg(HotMessage):
    step: int
    rids: list[int]
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    need_logits: list[bool]  # False: a non-final prefill chunk, nothing to sample
    deltas: SlotDeltas
    new_reqs: list[SamplingSpec] = []
    finished_rids: list[int] = []


class StepResultMsg(HotMessage):
    step: int
    rids: list[int]  # requests that sampled a token, in batch order
    tokens: list[int]
    logprobs: list[float] = []  # per sampled token, when any request asked
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    forward_ms: float = 0.0
