"""OpenAI's and vLLM's ways of asking for constrained output, to one `OutputConstraint`.

A request may use one of: `response_format` (OpenAI: `json_object`, or `json_schema` with
its `schema`), `structured_outputs` (vLLM: `json`, `regex`, `choice`, `grammar`,
`json_object`, `structural_tag`) or vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. Tools (`tools` + `tool_choice`) make their own
constraint (`actors.tool_calls`) and cannot be combined with these. Whether a spec
compiles is decided by the grammar engine in the tokenizer actor (a 400 naming the
problem); the shapes are checked here.
"""

from __future__ import annotations

import json
from typing import Any

from actors.frontends.http.errors import ApiError, too_deep
from actors.frontends.http.schemas import ChatCompletionRequest, SamplingRequest
from actors.tool_calls import (
    Tool,
    ToolSpecError,
    resolve_tool_choice,
    resolve_tool_format,
)
from actors.tool_calls import tool_format as _format
from transport.messages.params import OutputConstraint


def constraint_of(req: SamplingRequest) -> tuple[str, OutputConstraint] | None:
    """(the field it came from, the constraint) of a request, or None."""
    found: list[tuple[str, OutputConstraint]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format(rf)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    if req.guided_json is not None:
        found.append(("guided_json", _json_schema(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        found.append(("guided_regex", OutputConstraint(kind="regex", spec=req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", OutputConstraint(kind="choice", choices=req.guided_choice)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", OutputConstraint(kind="grammar", spec=req.guided_grammar)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(400, f"give one way of constraining the output, not {names}", param=names)
    return found[0] if found else None


def _response_format(rf) -> OutputConstraint:
    if rf.type == "json_object":
        return OutputConstraint(kind="json_object")
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise ApiError(
            400,
            'response_format: type "json_schema" needs json_schema.schema',
            param="response_format",
        )
    return _json_schema(rf.json_schema.schema, "response_format")


def _structured_outputs(so) -> OutputConstraint:
    given = {
        name: value
        for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        if (value := getattr(so, name)) not in (None, False)
    }
    if len(given) != 1:
        raise ApiError(
            400,
            "structured_outputs: give exactly one of json, regex, choice, grammar, "
            f"json_object, structural_tag (got {', '.join(given) or 'none'})",
            param="structured_outputs",
        )
    name, value = next(iter(given.items()))
    if name == "json":
        return _json_schema(value, "structured_outputs")
    if name == "json_object":
        return OutputConstraint(kind="json_object")
    if name == "choice":
        return OutputConstraint(kind="choice", choices=list(value))
    return OutputConstraint(kind=name, spec=value)


def _json_schema(schema: Any, param: str) -> OutputConstraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(
                400, f"{param}: the schema is not valid JSON: {exc}", param=param
            ) from None
        except RecursionError:
            raise too_deep(f"{param}: the schema", param) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}: the schema must be a JSON object", param=param)
    try:
        return OutputConstraint(kind="json_schema", spec=json.dumps(schema))
    except RecursionError:
        raise too_deep(f"{param}: the schema", param) from None


def declared_tools(tools_in) -> list[Tool]:
    """The request's function tools (`ToolIn`s, or None) as the engine's `Tool`s."""
    return [
        Tool(
            name=t.function.name,
            description=t.function.description or "",
            parameters=t.function.parameters or {"type": "object", "properties": {}},
        )
        for t in tools_in or []
    ]


def tool_setup(
    req: ChatCompletionRequest, tool_format: str = "hermes"
) -> tuple[str, list[Tool], OutputConstraint | None]:
    """(tool mode, every tool the template is told about, the calls' constraint in the
    server's tool-call format; "auto" unresolved, with no template to go by, is Hermes)."""
    tools = declared_tools(req.tools)
    try:
        mode, callable_tools = resolve_tool_choice(tools, req.tool_choice)
    except ToolSpecError as exc:
        param = str(exc).split(":")[0]
        raise ApiError(400, str(exc), param=param) from None
    spec = _format(resolve_tool_format(tool_format, None)).constraint(
        mode, callable_tools, parallel=req.parallel_tool_calls is not False
    )
    constraint = None if spec is None else OutputConstraint(kind="structural_tag", spec=spec)
    return mode, (tools if mode != "none" else []), constraint
