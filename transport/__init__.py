"""kvactor's transport layer: the message protocol, its codec, addresses and ZeroMQ channels.

* ``transport.messages``: every message type (``Message`` / ``HotMessage`` bases, control plane,
  feature modules).
* ``transport.codec``: strict msgpack encode/decode (``Codec``, ``DecodeFailure``).
* ``transport.address``: inproc / ipc / tcp endpoints (``endpoint_for``, ``IpcDirectory``).
* ``transport.channel``: async ROUTER/DEALER channels (``ServerChannel``, ``ClientChannel``).
* ``actors.bench.transport``: ``python -m actors.bench.transport`` micro-benchmark.

Only the dependency-light names are re-exported here, so importing a message module does not
pull in ZeroMQ.
"""

from __future__ import annotations

from transport.codec import Codec, CodecError, DecodeFailure
from transport.messages.base import HotMessage, Message

__all__ = ["Codec", "CodecError", "DecodeFailure", "HotMessage", "Message"]
