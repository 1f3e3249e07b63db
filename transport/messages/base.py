"""The base classes every actor message derives from, and the registry of message types.

Every message is a frozen, tagged ``msgspec.Struct``; the tag is the class name, so a class
name must be unique across the whole protocol (the registry enforces this at import time).

Two wire shapes exist:

* ``Message``: encoded as a msgpack map (field names on the wire). Used for control and
  request/response traffic where readability and evolvability matter more than bytes.
* ``HotMessage``: encoded as a msgpack array (``array_like=True``) and not tracked by the
  cyclic GC (``gc=False``). Used for per-step batch traffic (forward batches, step results).

msgspec cannot decode a union mixing the two shapes, so the codec splits every union into its
map-shaped and array-shaped members and dispatches on the first msgpack byte.

Rules for evolving messages:

* New fields are appended LAST, with a default. For ``HotMessage`` the position of a field is
  its identity on the wire (array_like), so never reorder, insert or remove fields; subclass
  fields come after base-class fields.
* All fields are keyword-only (the metaclass sets ``kw_only=True``), so construction always
  names fields: ``Pong(actor="x", pid=1, uptime_s=0.5)``.
* Decoding is strict: unknown fields (map) or extra trailing elements (array) are rejected.
  Peers of one engine run the same code, and external clients must speak the current schema.
* ``HotMessage`` subclasses must not hold reference cycles (``gc=False``).
* A class that only serves as a base for other messages passes ``abstract=True`` in its class
  statement so it is not registered as a wire type.
"""

from __future__ import annotations

from typing import Any

import msgspec

_StructMeta: type = type(msgspec.Struct)

# tag (== class name) -> message class. Only concrete (non-abstract) classes are registered.
_REGISTRY: dict[str, type[Message]] = {}
# Bumped on every registration so cached codecs over "all messages" know to rebuild.
_registry_version = 0


class _MessageMeta(_StructMeta):  # type: ignore[misc, valid-type]
    """Defaults every message class to ``kw_only=True`` and registers concrete classes."""

    def __new__(
        mcls,
        name: str,
        bases: tuple[type, ...],
        namespace: dict[str, Any],
        abstract: bool = False,
        **struct_options: Any,
    ) -> type:
        struct_options.setdefault("kw_only", True)
        cls = super().__new__(mcls, name, bases, namespace, **struct_options)
        if not abstract:
            _register(cls)
        return cls


def _register(cls: type[Message]) -> None:
    global _registry_version
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"message {cls.__qualname__} must have a string tag, got {tag!r}")
    existing = _REGISTRY.get(tag)
    if existing is not None and _qualified_name(existing) != _qualified_name(cls):
        raise TypeError(
            f"message tag {tag!r} of {_qualified_name(cls)} is already used by "
            f"{_qualified_name(existing)}; message class names must be unique"
        )
    # Same qualified name (a module re-import) replaces the old class.
    _REGISTRY[tag] = cls
    _registry_version += 1


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Message(
    msgspec.Struct,
    metaclass=_MessageMeta,
    frozen=True,
    tag=True,
    omit_defaults=True,
    forbid_unknown_fields=True,
    abstract=True,
):
    """Base of every map-encoded actor message (tag = class name, keyword-only fields)."""


class HotMessage(Message, array_like=True, gc=False, abstract=True):
    """Base of per-step batch messages: array-encoded, untracked by the GC.

    Field order is the wire format: append new fields last, with defaults.
    """


def is_hot(message_type: type) -> bool:
    """True when ``message_type`` is encoded as a msgpack array (a ``HotMessage``)."""
    return bool(message_type.__struct_config__.array_like)  # type: ignore[attr-defined]


def registered_messages() -> tuple[type[Message], ...]:
    """Every concrete message class imported so far, in registration order."""
    return tuple(_REGISTRY.values())


def registry_version() -> int:
    """A counter that changes whenever a message class is registered."""
    return _registry_version


def message_for_tag(tag: str) -> type[Message] | None:
    return _REGISTRY.get(tag)
