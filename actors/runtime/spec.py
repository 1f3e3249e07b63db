"""``ActorSpec``: how to build and supervise one actor, and building it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from actors.runtime.actor import Actor

CrashPolicy = Literal["shutdown", "restart"]


@dataclass(frozen=True)
class ActorSpec:
    """How to build and supervise one actor. Must be picklable for multi-process engines:
    ``factory`` is ``"package.module:Class"`` or a module-level callable returning an Actor."""

    name: str
    factory: str | Callable[..., Actor]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    group: str = "main"
    on_crash: CrashPolicy = "shutdown"
    max_restarts: int = 3
    restart_backoff_s: float = 0.1  # doubled after each consecutive restart, capped at 5 s
    restart_window_s: float = 60.0  # crashes older than this stop counting toward the max
    # Environment of the child process that hosts this actor, set before anything is
    # imported there (e.g. OpenMP's wait policy); actors in this process ignore it.
    env: Mapping[str, str] = field(default_factory=dict)
    # Actors sent a `PeerCrashed` whenever this one crashes (restarted or not), e.g. the
    # scheduler for the runner: it ends the requests whose step was lost.
    crash_watchers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("_") or "/" in self.name:
            raise ValueError(f"invalid actor name {self.name!r} (non-empty, no '/', no '_' start)")
        if self.on_crash not in ("shutdown", "restart"):
            raise ValueError(f"on_crash must be 'shutdown' or 'restart', got {self.on_crash!r}")
        if self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ValueError("max_restarts and restart_backoff_s must be >= 0")


def resolve_factory(factory: str | Callable[..., Actor]) -> Callable[..., Actor]:
    """The callable named by ``"module:attr.path"``, or ``factory`` itself."""
    if callable(factory):
        return factory
    module_name, sep, attribute_path = factory.partition(":")
    if not sep or not module_name or not attribute_path:
        raise ValueError(f"factory must look like 'package.module:Class', got {factory!r}")
    target: Any = importlib.import_module(module_name)
    for part in attribute_path.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"factory {factory!r} is not callable")
    return target  # type: ignore[no-any-return]


def build_actor(spec: ActorSpec) -> Actor:
    actor = resolve_factory(spec.factory)(**dict(spec.kwargs))
    if not isinstance(actor, Actor):
        raise TypeError(f"factory of {spec.name!r} returned {type(actor).__name__}, not an Actor")
    actor.name = spec.name
    return actor
