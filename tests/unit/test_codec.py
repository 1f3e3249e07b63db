"""Codec and message-base tests: round trips, strict rejection, never raising on hostile bytes."""

from __future__ import annotations

import gc

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.actors.probe_actors import ProbeEcho, ProbeSum, ProbeTotal
from transport.codec import (
    Codec,
    CodecError,
    DecodeFailure,
    any_message_codec,
    flatten_message_types,
)
from transport.messages import (
    Ack,
    ActorCrashed,
    ControlMessage,
    ErrorReply,
    Message,
    Ping,
    Pong,
    Shutdown,
    StatsReply,
    StatsRequest,
    is_hot,
    message_for_tag,
)

CONTROL_SAMPLES: list[Message] = [
    Ping(),
    Pong(actor="scheduler", pid=4242, uptime_s=12.5),
    Shutdown(),
    Shutdown(reason="engine stop"),
    Ack(),
    ErrorReply(code="handler_error", message="boom", detail="Traceback ..."),
    ActorCrashed(name="radix", error="KeyError: 3", traceback="tb", pid=7, will_restart=True),
    StatsRequest(),
    StatsReply(actor="allocator", values={"free_pages": 10, "hit_rate": 0.25}),
]

control_codec: Codec[Message] = Codec(ControlMessage)
mixed_codec: Codec[Message] = Codec(ControlMessage | ProbeSum)
encode = msgspec.msgpack.encode


@pytest.mark.parametrize("message", CONTROL_SAMPLES, ids=lambda m: type(m).__name__)
def test_every_control_message_round_trips(message: Message) -> None:
    data = control_codec.encode(message)
    decoded = control_codec.decode(data)
    assert decoded == message
    assert type(decoded) is type(message)
    assert control_codec.decode_or_raise(data) == message


def test_hot_and_map_messages_share_one_union() -> None:
    batch = ProbeSum(values=list(range(300)))
    data = mixed_codec.encode(batch)
    assert data[0] in (0xDC, 0xDD) or 0x90 <= data[0] <= 0x9F  # array header on the wire
    assert mixed_codec.decode(data) == batch
    assert mixed_codec.decode(mixed_codec.encode(Ping())) == Ping()
    assert is_hot(ProbeSum) and not is_hot(Ping)


def test_hot_messages_are_not_gc_tracked_and_fields_are_keyword_only() -> None:
    assert not gc.is_tracked(ProbeSum(values=[1, 2]))
    with pytest.raises(TypeError):
        Pong("x", 1, 0.5)  # type: ignore[misc]


def _truncated_pong() -> bytes:
    return encode(Pong(actor="a", pid=1, uptime_s=1.0))[:-3]


REJECTIONS: list[tuple[str, bytes, str]] = [
    ("empty", b"", "empty"),
    ("invalid opcode", b"\xc1\x00\x01", "garbage"),
    ("truncated map", b"\x82", "garbage"),
    ("truncated message", _truncated_pong(), "garbage"),
    ("trailing bytes", encode(Ping()) + b"\x00", "garbage"),
    ("bare integer", encode(5), "not_a_message"),
    ("bare string", encode("Ping"), "not_a_message"),
    ("unknown tag", encode({"type": "NoSuchMessage"}), "unknown_tag"),
    ("missing tag", encode({"actor": "a"}), "unknown_tag"),
    ("tag of wrong type", encode({"type": 7}), "unknown_tag"),
    ("hot message to a map-only union", encode(ProbeSum(values=[1])), "unknown_tag"),
    ("unknown tag, array shape", encode(["NoSuchHot", [1]]), "unknown_tag"),
    (
        "wrong field type",
        encode({"type": "Pong", "actor": 1, "pid": 1, "uptime_s": 1.0}),
        "wrong_type",
    ),
    ("missing field", encode({"type": "Pong", "pid": 1, "uptime_s": 1.0}), "missing_field"),
    ("unknown field", encode({"type": "Ping", "extra": 1}), "unknown_field"),
    (
        "extra nesting in a scalar field",
        encode({"type": "ErrorReply", "code": "x", "message": {"nested": {"deeper": []}}}),
        "wrong_type",
    ),
    (
        "extra nesting in a dict value",
        encode({"type": "StatsReply", "actor": "a", "values": {"k": [[[1]]]}}),
        "wrong_type",
    ),
    (
        "deep nesting bomb in a field",
        b"\x83\xa4type\xaaErrorReply\xa4code\xa1x\xa7message" + b"\x91" * 200_000 + b"\xc0",
        "wrong_type",
    ),
]


@pytest.mark.parametrize(("case", "data", "kind"), REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_strict_rejection_returns_a_failure_value(case: str, data: bytes, kind: str) -> None:
    result = control_codec.decode(data)
    assert isinstance(result, DecodeFailure), f"{case} decoded to {result!r}"
    assert result.kind == kind, f"{case}: {result}"
    assert result.detail
    with pytest.raises(CodecError) as raised:
        control_codec.decode_or_raise(data)
    assert raised.value.failure == result


def test_array_shape_errors_are_classified() -> None:
    assert mixed_codec.decode(encode(["ProbeSum"])) == DecodeFailure(
        "missing_field", "Expected `array` of at least length 2, got 1"
    )
    too_long = mixed_codec.decode(encode(["ProbeSum", [1], 2]))
    assert isinstance(too_long, DecodeFailure) and too_long.kind == "unknown_field"
    wrong = mixed_codec.decode(encode(["ProbeSum", ["a"]]))
    assert isinstance(wrong, DecodeFailure) and wrong.kind == "wrong_type"


def test_a_union_only_accepts_its_own_members() -> None:
    ping_only: Codec[Ping] = Codec(Ping)
    result = ping_only.decode(encode(Pong(actor="a", pid=1, uptime_s=0.0)))
    assert isinstance(result, DecodeFailure) and result.kind == "unknown_tag"


def test_size_limit() -> None:
    small: Codec[Message] = Codec(ControlMessage, max_message_bytes=64)
    result = small.decode(encode(ErrorReply(code="x", message="y" * 100)))
    assert isinstance(result, DecodeFailure) and result.kind == "too_large"


def test_registry_rejects_a_second_class_with_the_same_tag() -> None:
    with pytest.raises(TypeError, match="already used"):

        class Ping(Message):  # noqa: F811 - the clash is the point
            pass

    registered = message_for_tag("Ping")
    assert registered is not None and registered.__module__ == "transport.messages.control"


def test_flatten_rejects_non_messages() -> None:
    assert flatten_message_types(Ping | Pong | Ping) == (Ping, Pong)
    for bad in (int, None, "Ping", msgspec.Struct):
        with pytest.raises(TypeError):
            flatten_message_types(bad)


def test_any_message_codec_covers_messages_registered_later() -> None:
    codec = any_message_codec()
    assert codec.decode(codec.encode(ProbeTotal(total=3))) == ProbeTotal(total=3)

    class CodecLateRegistered(Message):
        value: int

    late = any_message_codec()
    assert late.decode(late.encode(CodecLateRegistered(value=9))) == CodecLateRegistered(value=9)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_raise(data: bytes) -> None:
    result = mixed_codec.decode(data)
    assert isinstance(result, (DecodeFailure, Message))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)
tags = st.sampled_from(["Ping", "Pong", "ErrorReply", "StatsReply", "ProbeSum", "Nope"])


@settings(max_examples=300, deadline=None)
@given(tags, st.dictionaries(st.text(max_size=10), msgpack_values, max_size=6))
def test_random_well_formed_maps_never_raise(tag: str, fields: dict[str, object]) -> None:
    result = mixed_codec.decode(encode({"type": tag, **fields}))
    assert isinstance(result, (DecodeFailure, Message))


@settings(max_examples=300, deadline=None)
@given(tags, st.lists(msgpack_values, max_size=6))
def test_random_well_formed_arrays_never_raise(tag: str, items: list[object]) -> None:
    result = mixed_codec.decode(encode([tag, *items]))
    assert isinstance(result, (DecodeFailure, Message))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_valid_messages_never_raise(data: st.DataObject) -> None:
    original = bytearray(
        encode(
            data.draw(
                st.sampled_from(
                    [*CONTROL_SAMPLES, ProbeSum(values=[1, 2, 3]), ProbeEcho(text="hello")]
                )
            )
        )
    )
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        position = data.draw(st.integers(min_value=0, max_value=len(original) - 1))
        original[position] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(original)))
    result = mixed_codec.decode(bytes(original[:cut]))
    assert isinstance(result, (DecodeFailure, Message))
