"""Two function tools the tool-call tests share (pure data; no torch)."""

from __future__ import annotations

from actors.tool_calls import Tool

WEATHER = Tool(
    name="get_weather",
    description="Weather in a city",
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
TIME = Tool(
    name="get_time",
    parameters={
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)
