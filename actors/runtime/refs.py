"""``ActorRef``: a handle to one actor by name (call and send); ``RefBook`` caches them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar, overload

import msgspec

from actors.runtime.errors import RemoteError, UnexpectedReply
from transport.channel import ChannelClosed, ClientChannel
from transport.codec import Codec, DecodeFailure, any_message_codec
from transport.messages.base import Message
from transport.messages.control import ERR_BAD_REPLY, ErrorReply, Ping, Pong

R = TypeVar("R", bound=Message)

DEFAULT_CALL_TIMEOUT_S: Final = 30.0
DEFAULT_SEND_TIMEOUT_S: Final = 10.0

_encoder = msgspec.msgpack.Encoder()


class ActorRef:
    """A handle to one actor by name: ``call`` (request/reply) and ``send`` (fire-and-forget).

    Owns one DEALER connection; safe to use from many tasks at once. ``close`` it when done
    (the runtime closes the refs it hands out).
    """

    def __init__(
        self,
        name: str,
        address: str,
        *,
        sender: str = "",
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.send_timeout_s = send_timeout_s
        self._channel = ClientChannel(address, sender=sender)

    @overload
    async def call(self, message: Message, *, timeout: float | None = None) -> Message: ...

    @overload
    async def call(
        self, message: Message, *, expect: type[R], timeout: float | None = None
    ) -> R: ...

    async def call(
        self,
        message: Message,
        *,
        expect: type[Message] | None = None,
        timeout: float | None = None,
    ) -> Message:
        """Send ``message`` and return the reply.

        Raises ``RemoteError`` when the actor answers with ``ErrorReply``, ``TimeoutError``
        when no reply comes within ``timeout`` (default ``call_timeout_s``), ``ChannelClosed``
        when this ref is closed, and ``UnexpectedReply`` when ``expect`` is given and the
        reply is of another type. Without ``expect`` the reply is decoded against every
        message class imported in this process, so the reply's module must be imported.
        """
        limit = self.call_timeout_s if timeout is None else timeout
        try:
            payload = await self._channel.call(_encoder.encode(message), timeout=limit)
        except TimeoutError:
            raise TimeoutError(
                f"actor {self.name!r} did not answer {type(message).__name__} within {limit} s"
            ) from None
        codec = any_message_codec() if expect is None else _reply_codec(expect)
        reply = codec.decode(payload)
        if isinstance(reply, DecodeFailure):
            if expect is not None and reply.kind == "unknown_tag":
                raise UnexpectedReply(
                    f"actor {self.name!r} answered {type(message).__name__} with something "
                    f"other than {expect.__name__}: {reply}"
                )
            raise RemoteError(
                self.name, ErrorReply(code=ERR_BAD_REPLY, message=f"undecodable reply: {reply}")
            )
        if isinstance(reply, ErrorReply):
            raise RemoteError(self.name, reply)
        return reply

    async def send(self, message: Message, *, timeout: float | None = None) -> None:
        """Fire-and-forget. Waits only while the connection's queue is full."""
        limit = self.send_timeout_s if timeout is None else timeout
        await self._channel.send(_encoder.encode(message), timeout=limit)

    async def ping(self, *, timeout: float = 1.0) -> Pong:
        return await self.call(Ping(), expect=Pong, timeout=timeout)

    def close(self) -> None:
        self._channel.close()

    @property
    def closed(self) -> bool:
        return self._channel.closed

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r}, {self.address!r})"


_reply_codecs: dict[type[Message], Codec[Message]] = {}


def _reply_codec(expect: type[Message]) -> Codec[Message]:
    """Decoder for a call whose caller named the reply type: that type or ErrorReply."""
    codec = _reply_codecs.get(expect)
    if codec is None:
        codec = Codec((expect, ErrorReply))
        _reply_codecs[expect] = codec
    return codec


class RefBook:
    """Creates and caches ``ActorRef``s by actor name for one sender; closes them together."""

    def __init__(
        self,
        directory: Mapping[str, str],
        *,
        sender: str,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        self._directory = directory
        self._sender = sender
        self._call_timeout_s = call_timeout_s
        self._refs: dict[str, ActorRef] = {}
        self._closed = False

    def ref(self, name: str) -> ActorRef:
        existing = self._refs.get(name)
        if existing is not None:
            return existing
        if self._closed:
            raise ChannelClosed(f"refs of {self._sender!r} are closed")
        address = self._directory.get(name)
        if address is None:
            known = ", ".join(sorted(n for n in self._directory if not n.startswith("_")))
            raise KeyError(f"no actor named {name!r} (known: {known})")
        ref = ActorRef(name, address, sender=self._sender, call_timeout_s=self._call_timeout_s)
        self._refs[name] = ref
        return ref

    def close(self) -> None:
        self._closed = True
        for ref in self._refs.values():
            ref.close()
        self._refs.clear()
