"""Strict msgpack encoding and decoding of actor messages.

``Codec(union)`` owns one reusable msgspec encoder and the decoders for one message union.
``decode`` never raises on hostile bytes: it returns the message or a ``DecodeFailure`` value
naming what was wrong (garbage bytes, unknown tag, wrong field type, missing or unknown field,
oversize). Nothing here ever unpickles.

A union may mix map-shaped ``Message`` types and array-shaped ``HotMessage`` types. msgspec
cannot decode such a union in one decoder, so the codec keeps one decoder per shape and picks
it from the first msgpack byte (map vs array header); every message is one or the other.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, TypeVar

import msgspec

from transport.messages.base import (
    Message,
    is_hot,
    registered_messages,
    registry_version,
)

M = TypeVar("M", bound=Message)

FailureKind = Literal[
    "empty",  # zero-length payload
    "too_large",  # payload over the codec's byte limit
    "garbage",  # not well-formed msgpack (bad opcode, truncated, trailing bytes)
    "not_a_message",  # well-formed msgpack, but not a map or array at the top level
    "unknown_tag",  # the tag names no message of this union (or the tag is missing)
    "wrong_type",  # a field holds a value of the wrong type (including deeper nesting)
    "missing_field",  # a required field is absent
    "unknown_field",  # a field (or trailing array element) the schema does not have
    "invalid_value",  # right type, value out of the schema's constraints
]

# Default ceiling on one encoded message; per-step batches are a few tens of KiB.
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024

# msgpack header bytes: fixmap 0x80-0x8f, map16 0xde, map32 0xdf;
# fixarray 0x90-0x9f, array16 0xdc, array32 0xdd.
_MAP_HEADERS: Final = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_ARRAY_HEADERS: Final = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_NEVER_USED: Final = 0xC1  # the one byte msgpack never emits


@dataclass(frozen=True, slots=True)
class DecodeFailure:
    """Why a payload was rejected. A value, not an exception: callers branch on it."""

    kind: FailureKind
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


class CodecError(ValueError):
    """Raised by ``Codec.decode_or_raise``; carries the ``DecodeFailure``."""

    def __init__(self, failure: DecodeFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def flatten_message_types(spec: Any) -> tuple[type[Message], ...]:
    """The message classes named by ``spec``: a class, a ``Union``/``|`` or an iterable of them.

    Order is preserved and duplicates are dropped. Raises ``TypeError`` for non-messages.
    """
    found: list[type[Message]] = []

    def visit(item: Any) -> None:
        if item is None or item is type(None):
            raise TypeError("None is not a message type")
        if isinstance(item, (types.UnionType,)) or typing.get_origin(item) is typing.Union:
            for member in typing.get_args(item):
                visit(member)
        elif isinstance(item, type):
            if not issubclass(item, Message):
                raise TypeError(f"{item!r} is not a transport Message subclass")
            if item not in found:
                found.append(item)
        elif isinstance(item, (tuple, list, frozenset, set)):
            for member in item:
                visit(member)
        else:
            raise TypeError(f"{item!r} is not a message type or union of message types")

    visit(spec)
    if not found:
        raise TypeError("a codec needs at least one message type")
    return tuple(found)


def _decoder_for(message_types: list[type[Message]]) -> msgspec.msgpack.Decoder | None:
    if not message_types:
        return None
    union = typing.Union[tuple(message_types)]  # noqa: UP007 (built at run time)
    return msgspec.msgpack.Decoder(union)  # type: ignore[arg-type]


class Codec(Generic[M]):
    """Encoder + strict decoders for one message union. Not thread-safe; cheap to build."""

    __slots__ = (
        "message_types",
        "max_message_bytes",
        "_encoder",
        "_map_decoder",
        "_array_decoder",
        "_tag_paths",
    )

    def __init__(
        self, message_types: Any, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        self.message_types: tuple[type[Message], ...] = flatten_message_types(message_types)
        self.max_message_bytes = max_message_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._map_decoder = _decoder_for([t for t in self.message_types if not is_hot(t)])
        self._array_decoder = _decoder_for([t for t in self.message_types if is_hot(t)])
        # Error paths that point at the tag itself ("$.type" for maps, "$[0]" for arrays).
        tag_fields = {t.__struct_config__.tag_field for t in self.message_types}
        self._tag_paths = frozenset({f"$.{f}" for f in tag_fields} | {"$[0]"})

    def encode(self, message: Message) -> bytes:
        """msgpack bytes for ``message``.

        ``Encoder.encode`` is used rather than ``encode_into`` a reused buffer: the buffer
        would have to be copied to bytes anyway before zmq takes it
        (``bin/engine bench transport`` times the codec).
        """
        return self._encoder.encode(message)

    def decode(self, data: bytes | bytearray | memoryview) -> M | DecodeFailure:
        """The decoded message, or a ``DecodeFailure``. Never raises on any input bytes."""
        size = len(data)
        if size == 0:
            return DecodeFailure("empty", "payload has no bytes")
        if size > self.max_message_bytes:
            return DecodeFailure(
                "too_large", f"payload has {size} bytes, limit {self.max_message_bytes}"
            )
        header = data[0]
        if header in _MAP_HEADERS:
            decoder = self._map_decoder
            shape = "map-encoded"
        elif header in _ARRAY_HEADERS:
            decoder = self._array_decoder
            shape = "array-encoded (hot)"
        elif header == _NEVER_USED:
            return DecodeFailure("garbage", "payload starts with the invalid msgpack byte 0xc1")
        else:
            return DecodeFailure(
                "not_a_message", f"payload starts with byte 0x{header:02x}, not a map or array"
            )
        if decoder is None:
            return DecodeFailure("unknown_tag", f"this union accepts no {shape} messages")
        try:
            return decoder.decode(data)  # type: ignore[no-any-return]
        except msgspec.ValidationError as exc:
            return self._classify(str(exc))
        except msgspec.DecodeError as exc:
            return DecodeFailure("garbage", str(exc))
        except (RecursionError, MemoryError, ValueError, TypeError, OverflowError) as exc:
            return DecodeFailure("garbage", f"{type(exc).__name__}: {exc}")

    def decode_or_raise(self, data: bytes | bytearray | memoryview) -> M:
        """The decoded message; raises ``CodecError`` (a ``ValueError``) on any failure."""
        result = self.decode(data)
        if isinstance(result, DecodeFailure):
            raise CodecError(result)
        return result

    def _classify(self, error: str) -> DecodeFailure:
        path_match = _PATH.search(error)
        path = path_match.group(1) if path_match else "$"
        missing = _MISSING_FIELD.match(error)
        if missing:
            field = missing.group(1)
            if f"$.{field}" in self._tag_paths:
                return DecodeFailure("unknown_tag", "message has no tag")
            return DecodeFailure("missing_field", error)
        if path in self._tag_paths:
            return DecodeFailure("unknown_tag", error)
        array_length = _ARRAY_LENGTH.match(error)
        if array_length and path == "$":
            expected, got = int(array_length.group(1)), int(array_length.group(2))
            return DecodeFailure("missing_field" if got < expected else "unknown_field", error)
        if _UNKNOWN_FIELD.match(error):
            return DecodeFailure("unknown_field", error)
        if _CONSTRAINT.match(error):
            return DecodeFailure("invalid_value", error)
        if error.startswith("Expected `"):
            return DecodeFailure("wrong_type", error)
        return DecodeFailure("invalid_value", error)


# Shapes of msgspec.ValidationError messages (msgspec 0.23).
_PATH = re.compile(r" - at `([^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `([^`]*)`")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field")
_ARRAY_LENGTH = re.compile(r"^Expected `array` of (?:at least |at most )?length (\d+), got (\d+)")
_CONSTRAINT = re.compile(r"^Expected `[^`]+` (of length )?[<>=!]")


_any_message_codec: Codec[Message] | None = None
_any_message_version = -1


def any_message_codec() -> Codec[Message]:
    """A codec over every message type registered so far (used to decode call replies).

    Rebuilt when new message classes are registered (e.g. a feature module imported later).
    """
    global _any_message_codec, _any_message_version
    version = registry_version()
    if _any_message_codec is None or version != _any_message_version:
        _any_message_codec = Codec(registered_messages())
        _any_message_version = version
    return _any_message_codec
