"""Anthropic's Messages API wire schema (POST /v1/messages, /v1/messages/count_tokens):
request and response msgspec Structs.

Requests decode as the OpenAI ones do (`schemas.py`): wrong types, unknown content block
types and roles other than user / assistant are refused with a 400 before anything reaches
the engine; unknown top-level fields are ignored (and logged once), so clients sending
newer fields keep working. Fields that are known but would change the answer in a way this
server cannot honour (`UNSUPPORTED`, image and document blocks, server tools) get a 400
naming them. Content blocks are tagged by their `type`, as Anthropic sends them.

Responses mirror Anthropic's objects (`type: "message"`, content blocks, `stop_reason`,
`usage`), so the official `anthropic` SDK parses them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from actors.frontends.http.schemas import MAX_MESSAGES, MAX_TOOLS, Int

# ---- requests --------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str  # cache_control and citations are accepted and ignored


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    source: dict | None = None  # refused: the server serves text-only models


class DocumentBlock(msgspec.Struct, tag_field="type", tag="document", kw_only=True):
    source: dict | None = None  # refused


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    is_error: bool | None = None  # accepted; the template is given the content alone


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking"):
    data: str = ""


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class MessageIn(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(msgspec.Struct, kw_only=True):
    """A client tool. `type` is absent or "custom"; Anthropic's server tools (web search,
    code execution, ...) name a versioned type and are refused."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    """Accepted and ignored: there is no thinking budget; with the server's
    --reasoning-parser a model's thinking comes back in `thinking` blocks."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = None


class JsonOutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict


class OutputConfig(msgspec.Struct, kw_only=True):
    format: JsonOutputFormat | None = None  # the constraint engine's JSON schema
    effort: str | None = None  # accepted and ignored


ChatTemplateKwargs = dict[str, str | int | float | bool | None]


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """POST /v1/messages/count_tokens; the prompt fields of a Messages request."""

    model: str
    messages: Annotated[list[MessageIn], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[ToolDef], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Known and refused when set (UNSUPPORTED)
    mcp_servers: list | None = None
    container: str | dict | None = None
    context_management: dict | None = None
    # Extensions (vLLM's and kvactor's, as on /v1/chat/completions)
    chat_template_kwargs: ChatTemplateKwargs | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """POST /v1/messages."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    metadata: dict | None = None  # accepted and ignored (user_id)
    service_tier: str | None = None  # accepted and ignored
    # Extensions: sampling fields of /v1/chat/completions, a streaming session's turn,
    # the prefix-cache salt
    seed: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    session_id: str | None = None
    cache_salt: str | None = None


# Known request fields this server refuses (with a 400 naming them) when they are set.
UNSUPPORTED = ("mcp_servers", "container", "context_management")


# ---- responses -------------------------------------------------------------------------------


class TextOut(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingOut(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # no signature: thinking blocks sent back are dropped anyway


class ToolUseOut(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict


BlockOut = TextOut | ThinkingOut | ToolUseOut


class UsageOut(msgspec.Struct):
    """As Anthropic counts: `input_tokens` are the prompt tokens not read from the prefix
    cache; the prompt is `input_tokens + cache_read_input_tokens` tokens long."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageOut(msgspec.Struct):
    id: str
    model: str
    content: list[BlockOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: UsageOut
    type: str = "message"
    role: str = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int
