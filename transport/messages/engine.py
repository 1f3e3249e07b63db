"""Front-of-engine messages: clients <-> tokenizer <-> scheduler.

Client-facing request ids are strings chosen by the client (the gateway, the
ZeroMQ SDK, the offline API); inside the engine every request has an int `rid`
assigned by the tokenizer actor. Outputs flow scheduler -> tokenizer (token
ids, one `TokenBatch` per step) -> the request's `reply_to` actor (text, one
`OutputBatch` per destination per step).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from transport.messages.base import HotMessage, Message
from transport.messages.params import GenerationParams

__all__ = ["GenerationParams"]  # re-exported: the parameter type of every request


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    role: str
    content: str | list[dict[str, str]] | None = None
    name: str | None = None
    # OpenAI's tool-call history: an assistant's calls, and the call a tool message answers
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class GenerateRequest(Message):
    """Call to the tokenizer actor; answered by `Accepted` or an ErrorReply (bad input)."""

    client_rid: str
    reply_to: str  # actor that receives this request's OutputBatch entries
    params: GenerationParams
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open
    chat_template_kwargs: dict[str, str | int | float | bool | None] = {}
    session_id: str = ""  # a turn of this streaming session (the prompt is the whole conversation)
    # OpenAI function tools the chat template is told about (see actors.tool_calls)
    tools: list[dict[str, Any]] = []


class TokenizeRequest(Message):
    """Call to the tokenizer (the /tokenize endpoint): a prompt or chat messages to ids."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt
    add_generation_prompt: bool = True  # for messages
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, str | int | float | bool | None] = {}
    tools: list[dict[str, Any]] = []  # with messages: as GenerateRequest's
    return_token_strs: bool = False  # the reply carries each token's piece too (same call)


class TokenizeReply(Message):
    tokens: list[int]
    token_strs: list[str] = []  # with return_token_strs: one per token
    max_model_len: int = 0


class DetokenizeRequest(Message):
    tokens: list[int]


class DetokenizeReply(Message):
    prompt: str


class TokenizerInfoRequest(Message):
    """Call to the tokenizer (vLLM's /tokenizer_info): what a client needs to tokenize and
    render chats as the server does."""


class TokenizerInfo(Message):
    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    add_bos_token: bool
    chat_template: str | None
    added_tokens_decoder: dict[str, dict[str, Any]]  # id -> {"content", "special"}


class Accepted(Message):
    client_rid: str
    rid: int
    prompt_tokens: int
    prompt_tail: str = ""  # the text of the prompt's last few tokens, special tokens kept


class AbortGeneration(Message):
    """Client -> tokenizer: abort by client id (unknown ids are ignored)."""

    client_rids: list[str]


class NewRequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    rid: int
    prompt_ids: list[int]
    params: GenerationParams
    eos_ids: list[int]  # stop ids from the model, honoured unless ignore_eos
    session_id: str = ""  # a streaming session's turn
    # params.constraint's compiled grammar, by key: the tokenizer compiled it and the runner
    # holds it (`LoadGrammar`) before this request is submitted
    grammar_key: str = ""


class SubmitRequests(HotMessage):
    """Tokenizer -> scheduler, a call: answered (Ack) once the requests are queued, so a
    submit that is lost (undecodable, too large, a scheduler that is gone) is an error the
    tokenizer passes on to the client, never silence."""

    reqs: list[NewRequest]


class FinishReason(enum.StrEnum):
    """Why a request ended (OpenAI's `finish_reason` values, plus "abort")."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, the context, or a pool too small for it
    ABORT = "abort"  # the client left or asked to stop
    ERROR = "error"  # the engine failed it (its runner crashed, or the server shut down)


class StopAccepting(Message):
    """To a frontend: refuse new requests from now on (the server is draining)."""


class EndStreams(Message):
    """To a frontend: end every open stream now with an error saying `reason`."""

    reason: str


class EndRequests(HotMessage):
    """Tokenizer -> scheduler: stop these requests (abort, or a stop string matched)."""

    rids: list[int]
    reason: FinishReason  # ABORT or STOP


class TokenBatch(HotMessage):
    """Scheduler -> tokenizer, once per step: new tokens and finishes, flat."""

    rids: list[int]
    counts: list[int]  # new tokens per rid (0 when only a finish is reported)
    tokens: list[int]
    finish: list[str]  # "" while running, else a FinishReason value
    cached: list[int]  # prompt tokens served from the prefix cache (first report only; else -1)
    logprobs: list[float] = []  # per token in `tokens`, when any request asked
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    queued_s: list[float] = []  # per rid: seconds it waited before admission (first report)
    # Prompt logprobs (as StepResultMsg): logprob of prompt token j given the tokens before it,
    # for j from `prompt_starts[i]` on, `prompt_counts[i]` of them.
    prompt_rids: list[int] = []
    prompt_starts: list[int] = []
    prompt_counts: list[int] = []
    prompt_token_logprobs: list[float] = []
    prompt_top_ids: list[list[int]] = []
    prompt_top_logprobs: list[list[float]] = []
    prompt_ranks: list[int] = []
    # Why a request finished "error" where its runner did not fail: the client's message.
    error_rids: list[int] = []
    error_texts: list[str] = []


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    token_id: int
    text: str
    logprob: float | None  # None only for the first prompt token (it has no context)
    top: list[tuple[int, str, float]] = []
    rank: int = 0  # prompt tokens: 1 = the most likely token there (0: not computed)


class OutputChunk(msgspec.Struct, array_like=True, frozen=True, gc=False):
    client_rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []
    stop_matched: str | int | None = None
    prompt_logprobs: list[TokenLogprob] = []  # every prompt token (with prompt_logprobs)
    queue_time_s: float = -1.0  # seconds waiting for admission (first chunk only)


class OutputBatch(HotMessage):
    chunks: list[OutputChunk]


class SchedulerStatsRequest(Message):
    pass


class SchedulerStats(Message):
    waiting: int
    running: int
    prefilling: int
    steps: int
    decode_steps: int
    retractions: int
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    new_token_ratio: float
    pure_decode_steps: int = 0  # decode steps with no admission, finish or end
    pure_decode_messages: int = 0  # messages the scheduler sent during those steps
    runner_busy_s: float = 0.0  # the runner's time inside its steps (forward + sampling)
    # Tokens per step (prefill + decode scheduled in one forward), as a histogram: of the
    # `step_tokens_count` steps, `step_tokens_buckets[i]` had at most `step_tokens_bounds[i]`
    # tokens (cumulative, as Prometheus' `le`); `step_tokens_sum` tokens in all.
    step_tokens_bounds: list[int] = []
    step_tokens_buckets: list[int] = []
    step_tokens_sum: int = 0
    step_tokens_count: int = 0
    # Speculative decoding (vLLM's spec_decode counters): steps of a request that verified
    # drafts, draft tokens proposed, draft tokens accepted, accepted by draft position.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
