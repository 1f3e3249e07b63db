"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A Messages request is translated into the chat request it means (`chat_request`) and run as
one: the same jobs (`chat_jobs`: one `GenerationParams`, the same validation, the constraint
engine for `tool_choice` and `output_config.format`, sessions), the same responder, the same
output splitter (reasoning, then tool calls). Only the wire shapes differ:

- `system` (a string or text blocks) is the system message; consecutive turns of one role
  are merged, as Anthropic does; `tool_result` blocks become tool messages (before the
  turn's text), `tool_use` blocks an assistant's tool calls; thinking blocks sent back are
  dropped (chat templates take no reasoning input here). A final assistant turn is
  continued (prefill), as Anthropic does.
- tool_choice: auto -> "auto", any -> "required", tool -> the named function, none ->
  "none"; `disable_parallel_tool_use` -> `parallel_tool_calls: false`.
- The answer is content blocks: `thinking` (with --reasoning-parser), `text`, `tool_use`,
  in the order the model wrote them. Text that is only whitespace is not a block of its
  own before a tool call (nor after the last one). A tool call cut short by max_tokens whose
  arguments are not yet a whole JSON object has `input: {}`.
- stop_reason: a tool call made -> "tool_use", max_tokens -> "max_tokens", a stop sequence
  -> "stop_sequence" (naming it), else "end_turn".
- `max_tokens` is required; past the room the prompt leaves it is cut to that room (as a
  chat request's default is), since Anthropic clients send their own models' large values.
- Streams are Anthropic's named events: message_start (sent with the first output, when
  the prompt's cached share is known), content_block_start / _delta (text_delta,
  thinking_delta, input_json_delta) / _stop per block, message_delta (stop_reason, usage),
  message_stop; a failure after the response started is `event: error`.
- Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}` (the app answers
  every ApiError of these routes in that shape).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import msgspec

from actors.frontends.base import GenerationError
from actors.frontends.http.anthropic_schemas import (
    UNSUPPORTED,
    BlockOut,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessageIn,
    MessageOut,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingOut,
    TokenCount,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    UsageOut,
)
from actors.frontends.http.asgi import Receive, Scope, Send, send_response
from actors.frontends.http.errors import ApiError, anthropic_error, from_generation_error
from actors.frontends.http.generation import ChoiceState, Job, check_model
from actors.frontends.http.output_parts import OutputPolicy, OutputSplitter, Parts
from actors.frontends.http.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    FunctionCallIn,
    FunctionIn,
    JsonSchemaFormat,
    ResponseFormat,
    TextPart,
    ToolCallIn,
    ToolIn,
    Usage,
)
from actors.frontends.http.sse import named_sse_event
from actors.tool_calls import ToolCall
from transport.messages.engine import OutputChunk

_json = msgspec.json.Encoder()

# The blocks each role may send (others are a 400 naming the block).
_ALLOWED = {
    "user": (TextBlock, ToolResultBlock),
    "assistant": (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock),
}


# ---- endpoints -------------------------------------------------------------------------------


async def messages(app: Any, scope: Scope, receive: Receive, send: Send) -> None:
    req: MessagesRequest = app.bodies.decode(await app.bodies.read(scope, receive), MessagesRequest)
    model = check_model(req.model, app.model_names)
    jobs = _jobs(app, chat_request(req))
    # Anthropic clients send their own models' max_tokens: a cap, not a demand (see above).
    jobs = [
        dataclasses.replace(j, params=msgspec.structs.replace(j.params, max_tokens_strict=False))
        for j in jobs
    ]
    renderer = MessagesRenderer(
        model, request_id=scope["kvactor.request_id"], policy=jobs[0].policy
    )
    await app.responder.run(scope, receive, send, jobs, renderer, bool(req.stream), False)


async def count_tokens(app: Any, scope: Scope, receive: Receive, send: Send) -> None:
    """The prompt's length in tokens, rendered exactly as /v1/messages renders it."""
    body = await app.bodies.read(scope, receive)
    req: CountTokensRequest = app.bodies.decode(body, CountTokensRequest)
    check_model(req.model, app.model_names)
    prompt = _jobs(app, chat_request(req))[0].prompt
    try:
        reply = await app.client.tokenize(
            messages=prompt["messages"],
            tools=prompt.get("tools", []),
            add_generation_prompt=prompt["add_generation_prompt"],
            continue_final_message=prompt["continue_final_message"],
            chat_template_kwargs=prompt["chat_template_kwargs"],
        )
    except GenerationError as exc:
        raise from_generation_error(exc) from None
    await send_response(send, 200, _json.encode(TokenCount(input_tokens=len(reply.tokens))))


def _jobs(app: Any, req: ChatCompletionRequest) -> list[Job]:
    return app.chat_jobs(req)


# ---- request -> chat request -----------------------------------------------------------------


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request means; 400 for what this
    server cannot do."""
    for name in UNSUPPORTED:
        if getattr(req, name) is not None:
            raise _bad(f"{name}: not supported by this server", name)
    messages = _system(req.system) + _turns(req.messages)
    prefill = req.messages[-1].role == "assistant"
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = dict(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            session_id=req.session_id,
            cache_salt=req.cache_salt,
            stream=req.stream,
        )
    tool_choice, parallel = _tool_choice(req)
    fmt = req.output_config.format if req.output_config else None
    return ChatCompletionRequest(
        messages=messages,
        tools=_tools(req.tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        response_format=None
        if fmt is None
        else ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=fmt.schema)),
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        chat_template_kwargs=req.chat_template_kwargs,
        **fields,
    )


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _system(system: str | list[TextBlock] | None) -> list[ChatMessageIn]:
    if system is None or system == []:
        return []
    if isinstance(system, str):
        return [ChatMessageIn(role="system", content=system)]
    return [ChatMessageIn(role="system", content=[TextPart("text", b.text) for b in system])]


def _turns(messages: list[MessageIn]) -> list[ChatMessageIn]:
    """Chat messages of the conversation: each turn's blocks checked, consecutive turns of
    one role merged, then each turn translated."""
    turns: list[tuple[str, list]] = []
    for i, m in enumerate(messages):
        blocks = [TextBlock(text=m.content)] if isinstance(m.content, str) else list(m.content)
        for k, block in enumerate(blocks):
            _check_block(block, m.role, f"messages[{i}].content[{k}]")
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    out: list[ChatMessageIn] = []
    for role, blocks in turns:
        out += _user_turn(blocks) if role == "user" else [_assistant_turn(blocks)]
    return out


def _check_block(block: Any, role: str, where: str) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        kind = "image" if isinstance(block, ImageBlock) else "document"
        raise _bad(f"{where}: {kind} blocks are not supported (the model reads text)", "messages")
    if not isinstance(block, _ALLOWED[role]):
        raise _bad(f"{where}: a {role} turn cannot hold a {_tag(block)} block", "messages")
    if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
        for j, part in enumerate(block.content):
            if not isinstance(part, TextBlock):
                raise _bad(
                    f"{where}.content[{j}]: only text is supported in tool results", "messages"
                )


def _tag(block: Any) -> str:
    return type(block).__struct_config__.tag


def _text_content(texts: list[str]) -> str | list[TextPart]:
    return texts[0] if len(texts) == 1 else [TextPart("text", t) for t in texts]


def _user_turn(blocks: list) -> list[ChatMessageIn]:
    """Tool results become tool messages; the text around them user messages, in order."""
    out: list[ChatMessageIn] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
            continue
        if texts:
            out.append(ChatMessageIn(role="user", content=_text_content(texts)))
            texts = []
        content = block.content
        if isinstance(content, list):
            content = _text_content([part.text for part in content]) if content else ""
        out.append(
            ChatMessageIn(role="tool", content=content or "", tool_call_id=block.tool_use_id)
        )
    if texts or not out:
        out.append(ChatMessageIn(role="user", content=_text_content(texts) if texts else ""))
    return out


def _assistant_turn(blocks: list) -> ChatMessageIn:
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    calls = [
        ToolCallIn(id=b.id, function=FunctionCallIn(name=b.name, arguments=json.dumps(b.input)))
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    content: str | list[TextPart] | None = _text_content(texts) if texts else ""
    if calls and not texts:
        content = None  # calls alone, as an OpenAI client sends them
    return ChatMessageIn(role="assistant", content=content, tool_calls=calls or None)


def _tools(tools: list | None) -> list[ToolIn] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom") or tool.input_schema is None:
            raise _bad(
                f"tools[{i}]: only client tools (name, description, input_schema) are "
                f"supported, not {tool.type or 'a tool without input_schema'}",
                "tools",
            )
        function = FunctionIn(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        )
        out.append(ToolIn(type="function", function=function))
    return out


def _tool_choice(req: CountTokensRequest) -> tuple[str | dict | None, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) for Anthropic's tool_choice."""
    choice = req.tool_choice
    if choice is None:
        return None, None
    parallel = (
        None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    )
    if choice.type == "tool":
        if not choice.name:
            raise _bad('tool_choice: type "tool" needs the name of the tool', "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


# ---- output -> Anthropic objects -------------------------------------------------------------


def _input_of(arguments: str) -> dict | None:
    """A call's arguments as its `input`, or None while they are not a whole JSON object."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class _Blocks:
    """One answer's content blocks, built from its parts in order; every change is also
    queued as a stream event (`take_events`), so the streamed blocks are the whole ones."""

    def __init__(self) -> None:
        self.blocks: list[BlockOut] = []
        self.open = False  # the last block is still being written
        self.pending = ""  # whitespace waiting for text to start a text block
        self.calls = 0
        self.events: list[tuple[str, dict]] = []

    def add(self, parts: Parts) -> None:
        if parts.reasoning:
            self._thinking(parts.reasoning)
        if parts.content:
            self._text(parts.content)
        for call in parts.calls:
            self._tool_use(call)

    def finish(self) -> None:
        if self.pending and not self.calls:
            self._start(TextOut(""), TextOut(self.pending))
            self._delta({"type": "text_delta", "text": self.pending})
        self.pending = ""
        self._stop()

    def take_events(self) -> list[tuple[str, dict]]:
        events, self.events = self.events, []
        return events

    def _current(self, kind: type) -> Any:
        last = self.blocks[-1] if self.open else None
        return last if isinstance(last, kind) else None

    def _thinking(self, text: str) -> None:
        block = self._current(ThinkingOut)
        if block is None:
            self._flush_pending()
            block = self._start(ThinkingOut(""), ThinkingOut(""))
        block.thinking += text
        self._delta({"type": "thinking_delta", "thinking": text})

    def _text(self, text: str) -> None:
        block = self._current(TextOut)
        if block is None:
            text, self.pending = self.pending + text, ""
            if not text.strip():
                self.pending = text
                return
            block = self._start(TextOut(""), TextOut(""))
        block.text += text
        self._delta({"type": "text_delta", "text": text})

    def _flush_pending(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, ""
            self._start(TextOut(""), TextOut(pending))
            self._delta({"type": "text_delta", "text": pending})

    def _tool_use(self, call: ToolCall) -> None:
        self.pending = ""  # whitespace before a call is not text
        self.calls += 1
        tool_id = "toolu_" + call.id.removeprefix("call_")
        given = _input_of(call.arguments)
        self._start(ToolUseOut(tool_id, call.name, {}), ToolUseOut(tool_id, call.name, given or {}))
        self._delta({"type": "input_json_delta", "partial_json": call.arguments if given else ""})
        self._stop()

    def _start(self, empty: BlockOut, block: BlockOut) -> Any:
        self._stop()
        self.blocks.append(block)
        self.open = True
        event = {"type": "content_block_start", "index": len(self.blocks) - 1}
        self.events.append(("content_block_start", {**event, "content_block": empty}))
        return block

    def _delta(self, delta: dict) -> None:
        index = len(self.blocks) - 1
        event = {"type": "content_block_delta", "index": index, "delta": delta}
        self.events.append(("content_block_delta", event))

    def _stop(self) -> None:
        if self.open:
            self.open = False
            index = len(self.blocks) - 1
            self.events.append(
                ("content_block_stop", {"type": "content_block_stop", "index": index})
            )


def _usage(state: ChoiceState) -> UsageOut:
    cached = min(state.cached_tokens, state.prompt_tokens)
    return UsageOut(
        input_tokens=state.prompt_tokens - cached,
        output_tokens=state.completion_tokens,
        cache_read_input_tokens=cached,
    )


def _stop_reason(state: ChoiceState, calls: int) -> tuple[str, str | None]:
    if calls and state.finish_reason == "stop":
        return "tool_use", None
    if state.finish_reason == "length":
        return "max_tokens", None
    if isinstance(state.stop_reason, str):
        return "stop_sequence", state.stop_reason
    return "end_turn", None


class MessagesRenderer:
    """Builds /v1/messages objects and events for one request (always one choice)."""

    def __init__(
        self, model: str, *, request_id: str | None = None, policy: OutputPolicy = OutputPolicy()
    ) -> None:
        self.id = f"msg_{request_id or uuid.uuid4().hex}"
        self.model = model
        self.policy = policy
        self._splitter: OutputSplitter | None = None  # streaming
        self._blocks = _Blocks()

    def _message(self, state: ChoiceState, content: list[BlockOut], final: bool) -> MessageOut:
        reason, sequence = _stop_reason(state, self._blocks.calls) if final else (None, None)
        return MessageOut(
            id=self.id,
            model=self.model,
            content=content,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=_usage(state),
        )

    def opening(self, index: int) -> None:
        return None  # message_start goes with the first output: it carries the usage

    def delta(
        self, index: int, chunk: OutputChunk, text_offset: int, state: ChoiceState
    ) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        if self._splitter is None:
            self._splitter = OutputSplitter(self.policy, state.prompt_tail)
            start = self._message(state, [], final=False)
            start.usage.output_tokens = 0
            events.append(("message_start", {"type": "message_start", "message": start}))
        self._blocks.add(self._splitter.feed(chunk.text))
        if chunk.finish_reason is not None:
            self._blocks.add(self._splitter.finish())
            self._blocks.finish()
        events += self._blocks.take_events()
        if chunk.finish_reason is not None:
            reason, sequence = _stop_reason(state, self._blocks.calls)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            events.append(
                (
                    "message_delta",
                    {"type": "message_delta", "delta": delta, "usage": _usage(state)},
                )
            )
        return events

    def final(self, states: list[ChoiceState], usage: Usage) -> MessageOut:
        state = states[0]
        splitter = OutputSplitter(self.policy, state.prompt_tail)
        self._blocks.add(splitter.feed(state.text))
        self._blocks.add(splitter.finish())
        self._blocks.finish()
        return self._message(state, self._blocks.blocks, final=True)

    def sse(self, events: list[tuple[str, Any]]) -> bytes:
        return b"".join(named_sse_event(name, payload) for name, payload in events)

    def stream_end(self, states: list[ChoiceState], usage: Usage, include_usage: bool) -> bytes:
        return named_sse_event("message_stop", {"type": "message_stop"})

    def stream_error(self, error: ApiError) -> bytes:
        return named_sse_event("error", anthropic_error(error))
