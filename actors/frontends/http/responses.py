"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is served as a chat request: its input items (messages, function calls
and their outputs) and the stored conversation of `previous_response_id` become chat
messages, its fields a `ChatCompletionRequest`, and `chat_jobs` makes the one
`GenerationParams` (validation, constraints, tools) every API shares. `ResponsesRenderer`
turns the engine's chunks into Responses output items (reasoning, message, function calls),
whole or as the typed stream events.

A stored response (`store`, the default) keeps its conversation (without `instructions`,
which OpenAI does not carry over) in the gateway's `ResponseStore`, bounded in count and
age and visible only to the API key that made it, and keeps its KV in a streaming session:
a follow-up naming it runs as the next turn of that session, so it prefills only what is
new (`usage.input_tokens_details.cached_tokens`). The session belongs to the latest
response of a chain; a second follow-up of the same response (a fork) opens a session of
its own and prefills again. Stored responses hold at most `server.responses_max_sessions`
sessions (the least recently stored gives its up first), so they never take every session
from `/v1/sessions` clients; a response without one, or made when sessions run out,
continues on the prefix cache.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.frontends.base import GenerationError
from actors.frontends.http.asgi import Receive, Scope, Send, path_id, send_response
from actors.frontends.http.errors import NOT_FOUND, ApiError
from actors.frontends.http.generation import ChoiceState, check_model, clip
from actors.frontends.http.output_parts import OutputPolicy, OutputSplitter, Parts
from actors.frontends.http.responses_schemas import (
    UNSUPPORTED,
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from actors.frontends.http.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    FunctionCallIn,
    FunctionIn,
    JsonSchemaFormat,
    ResponseFormat,
    ToolCallIn,
    ToolIn,
    Usage,
)
from actors.frontends.http.sse import named_sse_event
from actors.tool_calls import ToolCall
from transport.channel import ChannelClosed

# The handlers take the `GatewayApp` (its bodies, client, responder, store and settings);
# typed `Any` here, since app.py imports this module.
GatewayApp = Any

MAX_STORED_RESPONSES = 1024
STORED_RESPONSE_TTL_S = 3600.0
MAX_RESPONSE_SESSIONS = 4  # sessions stored responses may hold at once (the rest: none)
_json = msgspec.json.Encoder()


# ---- the store -------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    id: str
    key: str  # the API key that made it; no other key sees it
    body: ResponseObject
    conversation: list[ChatMessageIn]  # input and output, without instructions
    session_id: str | None = None  # the session holding its KV (the chain's latest only)
    stored_at: float = field(default_factory=time.monotonic)


class ResponseStore:
    """Stored responses, least recently stored first: at most `max_count`, none older than
    `ttl_s`, and at most `max_sessions` of them holding a session (the least recently
    stored gives its session up first). Sessions that lose their response (evicted,
    expired, deleted, or over the cap) wait in `retired` until the caller closes them
    (`take_retired`): the store itself never awaits."""

    def __init__(
        self,
        max_count: int = MAX_STORED_RESPONSES,
        ttl_s: float = STORED_RESPONSE_TTL_S,
        max_sessions: int = MAX_RESPONSE_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_count = max_count
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.retired: list[tuple[str, str]] = []  # (key, session id) to close

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: StoredResponse) -> None:
        """Store `item` (a new id: ids are random)."""
        item.stored_at = self.clock()
        self._items[item.id] = item
        self._expire()
        while len(self._items) > self.max_count:
            self._drop(self._items.popitem(last=False)[1])
        holders = [i for i in self._items.values() if i.session_id is not None]
        for old in holders[: max(len(holders) - self.max_sessions, 0)]:
            self.retire(old.key, old.session_id)
            old.session_id = None

    def get(self, response_id: str, key: str) -> StoredResponse | None:
        self._expire()
        item = self._items.get(response_id)
        return item if item is not None and item.key == key else None

    def holds(self, item: StoredResponse) -> bool:
        return self._items.get(item.id) is item

    def take(self, response_id: str, key: str) -> StoredResponse | None:
        """Remove the response (its session, if any, is retired)."""
        item = self.get(response_id, key)
        if item is not None:
            del self._items[response_id]
            self._drop(item)
        return item

    def retire(self, key: str, session_id: str | None) -> None:
        if session_id is not None:
            self.retired.append((key, session_id))

    def take_retired(self) -> list[tuple[str, str]]:
        out, self.retired = self.retired, []
        return out

    def _drop(self, item: StoredResponse) -> None:
        self.retire(item.key, item.session_id)
        item.session_id = None

    def _expire(self) -> None:
        horizon = self.clock() - self.ttl_s
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.stored_at >= horizon:
                break
            self._drop(self._items.popitem(last=False)[1])


# ---- request -> chat -------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, or parts of type input_text/output_text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ApiError(
                400,
                f"{where}[{j}]: content part type {clip(str(kind))!r} is not supported "
                "(input_text and output_text are)",
                param=where,
                code="unsupported_content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError(400, f"{where}[{j}].text: expected a string", param=where)
        texts.append(text)
    return "".join(texts)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{name}: expected a string", param=f"{where}.{name}")
    return value


def input_messages(items: str | list[dict]) -> list[ChatMessageIn]:
    """The chat messages of a Responses `input`: a string is one user message; items are
    messages, function calls (joined to the assistant turn before them) and their outputs
    (tool messages). Reasoning items are dropped: templates leave thinking out of history."""
    if isinstance(items, str):
        return [ChatMessageIn(role="user", content=items)]
    if not items:
        raise ApiError(400, "input: must not be empty", param="input")
    out: list[ChatMessageIn] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(
                    400,
                    f"{where}.role: expected user, system, developer or assistant, "
                    f"got {clip(str(role))!r}",
                    param=f"{where}.role",
                )
            out.append(ChatMessageIn(role=role, content=_text_of(item.get("content"), where)))
        elif kind == "function_call":
            call = ToolCallIn(
                id=_field(item, "call_id", where),
                function=FunctionCallIn(
                    name=_field(item, "name", where), arguments=_field(item, "arguments", where)
                ),
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessageIn(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            out.append(
                ChatMessageIn(
                    role="tool", content=text, tool_call_id=_field(item, "call_id", where)
                )
            )
        elif kind != "reasoning":
            raise ApiError(
                400,
                f"{where}.type: {clip(str(kind))!r} is not supported (message, function_call, "
                "function_call_output and reasoning items are)",
                param=f"{where}.type",
                code="unsupported_input_item",
            )
    return out


def _tools(req: ResponsesRequest) -> list[ToolIn] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.type != "function":
            raise ApiError(
                400,
                f"tools[{i}].type: {clip(tool.type)!r} tools are not supported (function is)",
                param=f"tools[{i}].type",
                code="unsupported_tool",
            )
        if not tool.name:
            raise ApiError(400, f"tools[{i}].name: required", param=f"tools[{i}].name")
        try:
            fn = msgspec.convert(
                {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
                FunctionIn,
            )
        except msgspec.ValidationError as exc:
            raise ApiError(
                400, f"tools[{i}]: {exc}", param=f"tools[{i}].name", code="invalid_type"
            ) from None
        tools.append(ToolIn(type="function", function=fn))
    return tools


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    """Responses' `{"type": "function", "name": x}` in chat's shape."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema is None:
        raise ApiError(400, "text.format.schema: required for json_schema", param="text.format")
    return ResponseFormat(
        type="json_schema",
        json_schema=JsonSchemaFormat(
            name=fmt.name or "response",
            description=fmt.description,
            schema=fmt.schema,
            strict=fmt.strict,
        ),
    )


def chat_request(req: ResponsesRequest, messages: list[ChatMessageIn]) -> ChatCompletionRequest:
    for name in UNSUPPORTED:
        if getattr(req, name) is not None:
            raise ApiError(
                400, f"{name} is not supported by this server", param=name, code="unsupported"
            )
    if req.include:
        raise ApiError(400, "include: no extra output is available", param="include")
    if req.truncation == "auto":
        raise ApiError(400, "truncation: only 'disabled' is supported", param="truncation")
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        tools=_tools(req),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req),
    )


# ---- engine output -> Responses objects ------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
        ),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.total_tokens,
    )


def _call_item(call: ToolCall) -> FunctionCallItem:
    return FunctionCallItem(
        id=_item_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments
    )


def assistant_turn(items: list[OutputItem]) -> ChatMessageIn:
    """The output as the assistant message a follow-up's conversation holds."""
    text = "".join(
        part.text for item in items if isinstance(item, MessageItem) for part in item.content
    )
    calls = [
        ToolCallIn(
            id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments)
        )
        for item in items
        if isinstance(item, FunctionCallItem)
    ]
    return ChatMessageIn(role="assistant", content=text or None, tool_calls=calls or None)


class ResponsesRenderer:
    """Builds one response: the object (whole) or its events (streamed). `on_done` gets the
    finished object and its output items before the response's last byte is sent."""

    def __init__(
        self,
        shell: ResponseObject,
        policy: OutputPolicy,
        on_done: Callable[[ResponseObject], None],
    ) -> None:
        self.shell = shell  # the request's echo: id, model, instructions, tools, ...
        self.policy = policy
        self.on_done = on_done
        self.items: list[OutputItem] = []
        self._seq = 0
        self._splitter: OutputSplitter | None = None
        self._open: MessageItem | ReasoningItem | None = None  # the item text goes into

    # -- stream framing --
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def sse(self, events: list[dict[str, Any]]) -> bytes:
        return b"".join(named_sse_event(e["type"], e) for e in events)

    def _snapshot(self, status: str) -> dict[str, Any]:
        return msgspec.to_builtins(msgspec.structs.replace(self.shell, status=status, output=[]))

    def opening(self, index: int) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._snapshot("in_progress")),
            self._event("response.in_progress", response=self._snapshot("in_progress")),
        ]

    def delta(
        self, index: int, chunk: Any, text_offset: int, state: ChoiceState
    ) -> list[dict[str, Any]] | None:
        if self._splitter is None:
            self._splitter = OutputSplitter(self.policy, state.prompt_tail)
        parts = self._splitter.feed(chunk.text) if chunk.text else Parts()
        events = self._events_of(parts)
        if chunk.finish_reason is not None:
            events += self._events_of(self._splitter.finish())
            events += self._close()
        return events or None

    def _events_of(self, parts: Parts) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if parts.reasoning:
            events += self._text_into(ReasoningItem, parts.reasoning)
        if parts.content:
            events += self._text_into(MessageItem, parts.content)
        for call in parts.calls:
            events += self._close()
            item = _call_item(call)
            at = len(self.items)
            self.items.append(item)
            added = msgspec.structs.replace(item, arguments="", status="in_progress")
            events += [
                self._event("response.output_item.added", output_index=at, item=added),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=at,
                    delta=item.arguments,
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=at,
                    name=item.name,
                    arguments=item.arguments,
                ),
                self._event("response.output_item.done", output_index=at, item=item),
            ]
        return events

    def _text_into(self, kind: type, text: str) -> list[dict[str, Any]]:
        """Events appending `text` to the open item of `kind`, opening one if needed."""
        events: list[dict[str, Any]] = []
        if not isinstance(self._open, kind):
            events += self._close()
            if kind is MessageItem:
                self._open = MessageItem(id=_item_id("msg"), content=[OutputText(text="")])
            else:
                self._open = ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text="")])
            at = len(self.items)
            self.items.append(self._open)
            added = msgspec.structs.replace(self._open, content=[], status="in_progress")
            events.append(self._event("response.output_item.added", output_index=at, item=added))
            if kind is MessageItem:
                events.append(self._part_event("response.content_part.added", OutputText(text="")))
        self._open.content[0].text += text
        suffix = "output_text" if kind is MessageItem else "reasoning_text"
        events.append(
            self._event(
                f"response.{suffix}.delta",
                item_id=self._open.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                **({"logprobs": []} if kind is MessageItem else {}),
            )
        )
        return events

    def _part_event(self, kind: str, part: Any) -> dict[str, Any]:
        assert self._open is not None
        return self._event(
            kind,
            item_id=self._open.id,
            output_index=len(self.items) - 1,
            content_index=0,
            part=part,
        )

    def _close(self) -> list[dict[str, Any]]:
        """The events that end the open text item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        at = self.items.index(item)
        text = item.content[0].text
        if isinstance(item, MessageItem):
            done = [
                self._event(
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=at,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=at,
                    content_index=0,
                    part=item.content[0],
                ),
            ]
        else:
            done = [
                self._event(
                    "response.reasoning_text.done",
                    item_id=item.id,
                    output_index=at,
                    content_index=0,
                    text=text,
                )
            ]
        return [*done, self._event("response.output_item.done", output_index=at, item=item)]

    # -- the finished response --
    def _finished(self, state: ChoiceState, usage: Usage) -> ResponseObject:
        incomplete = state.finish_reason == "length"
        body = msgspec.structs.replace(
            self.shell,
            status="incomplete" if incomplete else "completed",
            output=list(self.items),
            usage=response_usage(usage),
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
        )
        self.on_done(body)
        return body

    def final(self, states: list[ChoiceState], usage: Usage) -> ResponseObject:
        (state,) = states
        splitter = OutputSplitter(self.policy, state.prompt_tail)
        first, last = splitter.feed(state.text), splitter.finish()
        parts = Parts(
            first.reasoning + last.reasoning, first.content + last.content, first.calls + last.calls
        )
        if parts.reasoning:
            self.items.append(
                ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text=parts.reasoning)])
            )
        if parts.content or not parts.calls:
            self.items.append(
                MessageItem(id=_item_id("msg"), content=[OutputText(text=parts.content)])
            )
        self.items += [_call_item(c) for c in parts.calls]
        return self._finished(state, usage)

    def stream_end(self, states: list[ChoiceState], usage: Usage, include_usage: bool) -> bytes:
        body = self._finished(states[0], usage)
        kind = "response.incomplete" if body.status == "incomplete" else "response.completed"
        return self.sse([self._event(kind, response=body)])

    def stream_error(self, error: ApiError) -> bytes:
        code = error.detail.code or error.detail.type
        failed = msgspec.structs.replace(
            self.shell,
            status="failed",
            output=list(self.items),
            error=ResponseError(code=code, message=error.detail.message),
        )
        return self.sse(
            [
                self._event(
                    "error", code=code, message=error.detail.message, param=error.detail.param
                ),
                self._event("response.failed", response=failed),
            ]
        )


# ---- the endpoints ---------------------------------------------------------------------------


async def create(app: GatewayApp, scope: Scope, receive: Receive, send: Send) -> None:
    req: ResponsesRequest = app.bodies.decode(
        await app.bodies.read(scope, receive), ResponsesRequest
    )
    model = check_model(req.model, app.model_names)
    key = scope.get("kvactor.api_key", "")
    store = app.responses
    previous = None
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id, key)
        if previous is None:
            raise ApiError(
                400,
                f"Previous response with id '{clip(req.previous_response_id)}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
    conversation = [*(previous.conversation if previous else []), *input_messages(req.input)]
    system = [ChatMessageIn(role="system", content=req.instructions)] if req.instructions else []
    chat = chat_request(req, [*system, *conversation])  # every check before a session opens
    jobs = app.chat_jobs(chat)
    response_id = f"resp_{uuid.uuid4().hex}"
    shell = ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        model=model,
        status="in_progress",
        output=[],
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=[msgspec.to_builtins(t) for t in req.tools or []],
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text=_text_echo(req),
        previous_response_id=req.previous_response_id,
        store=req.store is not False,
        metadata=dict(req.metadata or {}),
        reasoning=req.reasoning,
    )
    session_id: str | None = None
    stored = False

    def on_done(body: ResponseObject) -> None:
        nonlocal stored
        if req.store is False:
            return
        conversation_out = [*conversation, assistant_turn(body.output)]
        store.put(StoredResponse(response_id, key, body, conversation_out, session_id))
        stored = True

    renderer = ResponsesRenderer(shell, jobs[0].policy, on_done)
    try:
        if req.store is not False:
            session_id = await _session_for(app, previous, key)
        if session_id is not None:
            prompt = {**jobs[0].prompt, "session_id": session_id}
            jobs = [dataclasses.replace(jobs[0], prompt=prompt)]
        await app.responder.run(scope, receive, send, jobs, renderer, bool(req.stream), False)
    finally:
        if session_id is not None and not stored:
            # Not stored (refused or failed): the session goes back to the response it
            # came from while that one is still stored, else it is closed.
            if previous is not None and store.holds(previous) and previous.session_id is None:
                previous.session_id = session_id
            else:
                store.retire(key, session_id)
        await _close_retired(app)


def _text_echo(req: ResponsesRequest) -> dict[str, Any]:
    if req.text is None or req.text.format is None:
        return {"format": {"type": "text"}}
    return {"format": msgspec.to_builtins(req.text.format)}


async def _session_for(app: GatewayApp, previous: StoredResponse | None, key: str) -> str | None:
    """The session this response runs in: the previous response's (taken from it, so a
    concurrent second follow-up of it gets one of its own), or a new one; None when none
    can be had. A previous session that is busy (its aborted turn still ending) or gone is
    retired."""
    unreachable = (GenerationError, TimeoutError, ChannelClosed)
    if previous is not None and previous.session_id is not None:
        session_id, previous.session_id = previous.session_id, None
        try:
            info = await app.client.get_session(session_id, key)
            if not info.closed and not info.busy:
                return session_id
        except unreachable:
            pass
        app.responses.retire(key, session_id)
    try:
        return (await app.client.open_session(0.0, 0, key)).session_id
    except unreachable:
        return None  # at the session limit (or an engine without sessions): no session


async def _close_retired(app: GatewayApp) -> None:
    """Close the sessions the store let go (a close during a turn waits for its end)."""
    for key, session_id in app.responses.take_retired():
        try:
            await app.client.close_session(session_id, key)
        except (GenerationError, TimeoutError, ChannelClosed):
            pass  # already closed, timed out, or the engine is gone


def _response_id(scope: Scope) -> str:
    return path_id(scope, "/v1/responses/")


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{clip(response_id)}' not found.",
        type=NOT_FOUND,
        param="response_id",
        code="not_found",
    )


async def retrieve(app: GatewayApp, scope: Scope, receive: Receive, send: Send) -> None:
    response_id = _response_id(scope)
    item = app.responses.get(response_id, scope.get("kvactor.api_key", ""))
    await _close_retired(app)
    if item is None:
        raise _not_found(response_id)
    await send_response(send, 200, _json.encode(item.body))


async def delete(app: GatewayApp, scope: Scope, receive: Receive, send: Send) -> None:
    response_id = _response_id(scope)
    item = app.responses.take(response_id, scope.get("kvactor.api_key", ""))
    await _close_retired(app)
    if item is None:
        raise _not_found(response_id)
    await send_response(send, 200, _json.encode(DeletedResponse(id=response_id)))
