"""The wire protocol: every message type actors exchange (msgspec structs, tagged unions).

``base`` holds the ``Message``/``HotMessage`` bases and the registry; ``control`` holds the
runtime's control plane. Feature modules (alloc, runner, ...) live next to them and are imported
explicitly by their users.
"""

from __future__ import annotations

from transport.messages.base import (
    HotMessage,
    Message,
    is_hot,
    message_for_tag,
    registered_messages,
    registry_version,
)
from transport.messages.control import (
    Ack,
    ActorCrashed,
    ControlMessage,
    ErrorReply,
    Ping,
    Pong,
    RuntimeControl,
    Shutdown,
    StatsReply,
    StatsRequest,
)

__all__ = [
    "Ack",
    "ActorCrashed",
    "ControlMessage",
    "ErrorReply",
    "HotMessage",
    "Message",
    "Ping",
    "Pong",
    "RuntimeControl",
    "Shutdown",
    "StatsReply",
    "StatsRequest",
    "is_hot",
    "message_for_tag",
    "registered_messages",
    "registry_version",
]
