"""The wire schema of OpenAI's Responses API (`/v1/responses`) as the gateway serves it.

Requests decode strictly where kvactor acts on a field and leniently elsewhere, as the
chat schema does: unknown top-level fields are ignored (and logged), known fields kvactor
does not implement (`UNSUPPORTED`) are a 400 naming them. Input items are checked one by
one (`responses.input_messages`), so an error names the item (`input[2].call_id`).
Response objects and stream events mirror OpenAI's field for field, so the official client
parses them into its typed models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from actors.frontends.http.schemas import MAX_MESSAGES, MAX_TOOLS, Int

MAX_INPUT_ITEMS = MAX_MESSAGES


class FunctionToolIn(msgspec.Struct, kw_only=True):
    """A Responses function tool: flat, unlike chat's `{"type", "function": {...}}`."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FormatIn(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: dict | bool | None = None
    strict: bool | None = None


class TextIn(msgspec.Struct, kw_only=True):
    format: FormatIn | None = None
    verbosity: str | None = None  # accepted and ignored


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[dict], msgspec.Meta(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionToolIn], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextIn | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and ignored
    seed: Int | None = None  # kvactor/vLLM extension
    top_k: Int | None = None  # vLLM extension
    reasoning: dict | None = None  # effort/summary: accepted; the reasoning parser decides
    truncation: Literal["disabled", "auto"] | None = None
    # Known and not implemented: a 400 naming the field when set.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    top_logprobs: Int | None = None
    max_tool_calls: Int | None = None


# Fields of ResponsesRequest that are refused with 400 when set (to anything but a default).
UNSUPPORTED = ("background", "conversation", "prompt", "top_logprobs", "max_tool_calls")


# ---- objects ---------------------------------------------------------------------------------


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list = msgspec.field(default_factory=list)
    logprobs: list = msgspec.field(default_factory=list)


class MessageItem(msgspec.Struct):
    id: str
    content: list[OutputText]
    type: str = "message"
    role: str = "assistant"
    status: str = "completed"


class FunctionCallItem(msgspec.Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    type: str = "function_call"
    status: str = "completed"


class ReasoningText(msgspec.Struct):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct):
    id: str
    content: list[ReasoningText]
    summary: list = msgspec.field(default_factory=list)
    type: str = "reasoning"
    status: str = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct):
    id: str
    created_at: int
    model: str
    status: str  # in_progress | completed | incomplete | failed
    output: list[OutputItem]
    object: str = "response"
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] = msgspec.field(default_factory=list)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    text: dict = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    truncation: str = "disabled"
    reasoning: dict | None = None


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True
