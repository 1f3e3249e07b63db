"""ZeroMQ endpoint addresses for actors: ``inproc://``, ``ipc://`` and ``tcp://127.0.0.1:port``.

* inproc: ``inproc://kvactor-<engine>/<name>``; only reachable inside one process (and one
  zmq Context, see ``transport.channel.shared_context``).
* ipc: a Unix socket file in a per-engine temp directory (``kvactor-<engine>``), created by
  ``IpcDirectory`` and removed with it. Paths stay under the Unix socket path limit: long actor
  names are shortened with a hash.
* tcp: loopback with a free port picked from the OS.

The per-engine ipc directory is a pure function of the engine id, so every process of one
engine computes the same endpoints.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Final, Literal, get_args

Transport = Literal["inproc", "ipc", "tcp"]
TRANSPORTS: Final[tuple[str, ...]] = get_args(Transport)

# sun_path is 108 bytes on Linux and 104 on macOS, both including the trailing NUL.
_UNIX_SOCKET_PATH_LIMIT: Final = 103
_SOCKET_SUFFIX: Final = ".sock"
_SAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
_ENGINE_ID = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_LOOPBACK: Final = "127.0.0.1"


def new_system_id() -> str:
    """A short random id naming one engine instance (its inproc names and ipc directory)."""
    return secrets.token_hex(4)


def _check_system_id(system_id: str) -> str:
    if not _ENGINE_ID.match(system_id):
        raise ValueError(f"engine id must match {_ENGINE_ID.pattern}, got {system_id!r}")
    return system_id


def ipc_dir_for(system_id: str) -> Path:
    """The per-engine directory holding ipc socket files (not created here)."""
    _check_system_id(system_id)
    base = tempfile.gettempdir()
    leaf = f"kvactor-{system_id}"
    # Leave room for "/" + a 32-char socket file name; fall back to /tmp for long TMPDIRs.
    if len(base) + 1 + len(leaf) + 1 + 32 > _UNIX_SOCKET_PATH_LIMIT:
        base = "/tmp"
    return Path(base) / leaf


class IpcDirectory:
    """Owns one engine's ipc directory: ``create()`` makes it (private, 0o700), ``remove()``
    deletes it and every socket file in it. ``remove`` is idempotent."""

    def __init__(self, system_id: str) -> None:
        self.path = ipc_dir_for(system_id)

    def create(self) -> Path:
        self.path.mkdir(mode=0o700, parents=False, exist_ok=True)
        return self.path

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> IpcDirectory:
        self.create()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def _socket_file_name(name: str, budget: int) -> str:
    safe = _SAFE_CHARS.sub("_", name) or "_"
    file_name = safe + _SOCKET_SUFFIX
    if len(file_name) <= budget:
        return file_name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    keep = max(0, budget - len(digest) - 1 - len(_SOCKET_SUFFIX))
    return f"{safe[:keep]}-{digest}{_SOCKET_SUFFIX}"


def pick_free_tcp_port(
    host: str = _LOOPBACK, exclude: set[int] | frozenset[int] = frozenset()
) -> int:
    """A TCP port the OS reports free on ``host`` right now (not in ``exclude``).

    The port is released before returning, so another process could take it before the
    caller binds; on loopback with ephemeral ports this race is rare and surfaces as a bind
    error at start-up, never as a hang.
    """
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port not in exclude:
            return port
    raise OSError("could not find a free TCP port")


def endpoint_for(
    name: str,
    transport: Transport,
    system_id: str,
    *,
    port: int | None = None,
    host: str = _LOOPBACK,
) -> str:
    """The endpoint where actor ``name`` of engine ``system_id`` binds over ``transport``.

    For tcp a free port is picked unless ``port`` is given, so call it once per actor and
    share the result (the supervisor does).
    """
    _check_system_id(system_id)
    if not name:
        raise ValueError("endpoint name must not be empty")
    if transport == "inproc":
        return f"inproc://kvactor-{system_id}/{name}"
    if transport == "ipc":
        directory = ipc_dir_for(system_id)
        budget = _UNIX_SOCKET_PATH_LIMIT - len(str(directory)) - 1
        return f"ipc://{directory / _socket_file_name(name, budget)}"
    if transport == "tcp":
        return f"tcp://{host}:{port if port is not None else pick_free_tcp_port(host)}"
    raise ValueError(f"unknown transport {transport!r}; expected one of {TRANSPORTS}")


def transport_of(endpoint: str) -> Transport:
    """The transport named by an endpoint's scheme."""
    scheme, sep, _ = endpoint.partition("://")
    if not sep or scheme not in TRANSPORTS:
        raise ValueError(f"not a kvactor endpoint: {endpoint!r}")
    return scheme  # type: ignore[return-value]


def ipc_path_of(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://`` endpoint, else None."""
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None
