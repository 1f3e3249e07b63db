"""The OpenAI wire schema the gateway speaks: request and response msgspec Structs.

Requests are decoded with `msgspec.json.decode(body, type=...)`: wrong types and
out-of-schema values are refused before anything reaches the engine. Unknown fields are
ignored (the app logs their names once per request), as vLLM does, so clients sending other
servers' extensions keep working; fields that are known but not supported (`UNSUPPORTED`)
get a clear 400. Range checks of sampling values belong to the one validator
(`transport.messages.params.validate_params`, run by the tokenizer actor); the constraints
here are the HTTP-specific ones (n, logprobs, roles, content part types). `null` for an
optional parameter means "the default", as in OpenAI's API.

Responses mirror OpenAI's objects field for field (ids, `object`, `created`, `model`,
`choices`, `usage`), so the official client parses them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_N = 16  # choices per request
MAX_PROMPTS = 16  # prompts in one batched /v1/completions request
MAX_CHOICES = 64  # engine requests one HTTP request may start (prompts x n)
MAX_COMPLETION_LOGPROBS = 20  # completions' `logprobs` (top-n); the tokenizer caps the same
MAX_MESSAGES = 1024
MAX_TOOLS = 128

# Every integer of a request fits a signed 64-bit integer (JSON allows any size; the engine's
# msgpack messages do not).
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


# ---- requests --------------------------------------------------------------------------------


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of these."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class FunctionIn(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolIn(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionIn


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"


class ToolCallIn(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    # vLLM: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = False


class SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: Int | None = None
    skip_special_tokens: bool | None = None  # None: true (or the format's need)
    include_stop_str_in_output: bool | None = False
    user: str | None = None  # accepted and ignored
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # Constrained output (actors.frontends.http.constraints): OpenAI's response_format,
    # vLLM's structured_outputs and its older guided_* fields; at most one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Tool calling (chat only; actors.tool_calls)
    tools: Annotated[list[ToolIn], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # The deprecated function-calling fields: refused with 400 (use tools)
    functions: list | None = None
    function_call: str | dict | None = None
    # kvactor: a turn of this streaming session (POST /v1/sessions); the request carries the
    # whole conversation and the session's KV serves the part it already holds
    session_id: str | None = None
    # vLLM's prefix-cache isolation: only requests with the same salt share cached KV pages
    # (non-empty when given; GenerationParams.cache_salt)
    cache_salt: str | None = None
    # kvactor: false keeps this request out of speculative decoding (same output)
    speculative: bool | None = None
    # vLLM: the prompt's and the output's token ids in the response
    return_token_ids: bool | None = None
    # vLLM: logprobs name tokens as "token_id:<id>" (for tokens with no clean text)
    return_tokens_as_token_ids: bool | None = None


class CompletionRequest(SamplingRequest, kw_only=True):
    # A string, a list of strings (one prompt each), a token id list, or a list of them.
    prompt: str | list[str | Int | list[Int]]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool | None = False  # the prompt before the completion (with its logprobs)
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: str | None = None  # only null is supported
    best_of: Int | None = None  # only null or n is supported


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class ChatMessageIn(msgspec.Struct):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessageIn], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Int | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    # vLLM: the prompt's logprobs (top-level `prompt_logprobs` of the response)
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None


class SessionCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/sessions."""

    ttl_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # idle timeout; 0: the server's default
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # conversation capacity; 0: the context
    priority: int = 0  # a higher one keeps its KV in the pool and the tiers longer
    retain_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # kept in the tiers this long per turn


class SessionObject(msgspec.Struct):
    id: str
    ttl_s: float
    max_tokens: int
    turns: int
    tokens: int
    held_tokens: int
    idle_s: float
    busy: bool
    object: str = "session"
    closed: bool = False
    pool_tokens: int = 0  # of held_tokens, those in the pool (the rest wait in a tier)
    priority: int = 0
    retain_s: float = 0.0


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # vLLM's prompt_logprobs: one entry per prompt token (None for the first), each
    # token id -> {"logprob", "rank", "decoded_token"}
    prompt_logprobs: list[dict[str, dict] | None] | None = None
    # vLLM's return_token_ids: the prompt's ids (first chunk) and the output's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(msgspec.Struct):
    """A /v1/completions response, and (object "text_completion" too) each streamed chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprob] | None
    refusal: None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None
    # With --reasoning-parser: the model's thinking, under both of vLLM's names (the older
    # `reasoning_content` and the newer `reasoning`); null without a parser.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM's, as completions'
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None  # "assistant", in the first chunk of each choice only
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser, as ChatMessageOut
    reasoning: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids (first chunk)


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "kvactor"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


# Known fields this server refuses (with a 400 naming them) when they are set.
UNSUPPORTED = ("functions", "function_call")


# ---- tokenizer endpoints (vLLM's shapes) ------------------------------------------------------


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    # with messages: the tools the chat template is told about, as a chat request's
    tools: Annotated[list[ToolIn], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[Int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
