"""CURVE encryption and authentication of internal traffic over tcp://.

An actor system on tcp generates one server and one client keypair at start
(`new_engine_keys`) and activates them in every process of the system (`activate`):
from then on every ROUTER bound on tcp:// is a CURVE server and every DEALER connecting to
tcp:// a CURVE client, and a ZAP handler admits only clients holding the system's client
key. A local process that is not part of the system can neither read internal messages nor
connect to an actor's mailbox. inproc:// and ipc:// are unchanged (the filesystem guards
ipc sockets; inproc never leaves the process).

The keys travel to child processes inside the pickled plan of the spawn, never on the
command line or in the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator


@dataclass(frozen=True)
class EngineKeys:
    """Z85-encoded CURVE keys of one actor system."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def new_engine_keys() -> EngineKeys:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return EngineKeys(server_public, server_secret, client_public, client_secret)


_keys: EngineKeys | None = None
_authenticators: dict[int, tuple[asyncio.AbstractEventLoop, AsyncioAuthenticator]] = {}


def activate(keys: EngineKeys | None) -> None:
    """Secure this process's tcp sockets with `keys` from now on (None: plain again). One
    tcp actor system per process at a time: the keys are the process's."""
    global _keys
    _keys = keys


def active_keys() -> EngineKeys | None:
    return _keys


class _AllowEngineClients:
    """ZAP credentials check: only the active system's client key may connect (read at
    each handshake, so a later system in the same process brings its own key)."""

    def callback(self, domain: str, key: bytes) -> bool:
        keys = _keys
        # pyzmq passes the client's key Z85-encoded.
        return keys is not None and hmac.compare_digest(key, keys.client_public)


def secure_server(socket: zmq.Socket, address: str) -> None:
    """Make a ROUTER about to bind `address` a CURVE server, when keys are active and the
    address is tcp://. Starts this context's ZAP handler on first use."""
    keys = _keys
    if keys is None or not address.startswith("tcp://"):
        return
    _ensure_authenticator(socket.context, keys)
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    socket.setsockopt(zmq.ZAP_DOMAIN, b"kvactor")


def secure_client(socket: zmq.Socket, address: str) -> None:
    """Make a DEALER about to connect to `address` a CURVE client of the system's servers."""
    keys = _keys
    if keys is None or not address.startswith("tcp://"):
        return
    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def _ensure_authenticator(context: zmq.Context, keys: EngineKeys) -> None:
    """One ZAP handler per context, served by the running event loop (a context outlives
    loops, e.g. one `anyio.run` per test: a handler of a finished loop is replaced)."""
    if not isinstance(context, zmq.asyncio.Context):
        raise TypeError("CURVE servers need the asyncio zmq context (the ZAP handler runs there)")
    loop = asyncio.get_running_loop()
    current = _authenticators.get(id(context))
    if current is not None:
        old_loop, old_auth = current
        if old_loop is loop:
            return
        with contextlib.suppress(Exception):
            old_auth.stop()
        # stop() may fail with its loop gone; the ZAP socket must close all the same, or
        # its inproc address stays taken and the new handler cannot bind it.
        zap = getattr(old_auth, "zap_socket", None)
        if zap is not None and not zap.closed:
            zap.close(linger=0)
    auth = AsyncioAuthenticator(context)
    for attempt in range(100):  # the old socket's address is released by libzmq's reaper
        try:
            auth.start()
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt == 99:
                raise
            time.sleep(0.01)
    auth.configure_curve_callback(domain="kvactor", credentials_provider=_AllowEngineClients())
    _authenticators[id(context)] = (loop, auth)


# ---- CURVE for the client endpoint (a keypair the operator keeps) ----------------------------

Z85_KEY_CHARS = 40


def read_curve_secret(path: str) -> bytes:
    """The Z85 CURVE secret key in the file at `path`; ValueError naming the file if bad."""
    try:
        text = open(path, encoding="ascii").read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the CURVE secret key file {path}: {exc}") from None
    key = text.encode()
    if len(key) != Z85_KEY_CHARS:
        raise ValueError(f"{path} does not hold a Z85 CURVE secret key ({Z85_KEY_CHARS} chars)")
    try:
        zmq.curve_public(key)
    except zmq.ZMQError as exc:
        raise ValueError(f"{path} does not hold a valid CURVE secret key: {exc}") from None
    return key


def write_curve_keypair(directory: str) -> tuple[str, str]:
    """A fresh keypair as `<directory>/zmq_server.key` (secret, mode 0600) and
    `zmq_server.pub` (give this one to clients); their paths (public, secret).

    Each file is written to a fresh temporary file in `directory` (created 0600 by
    `mkstemp`, O_EXCL, so nothing existing is opened) and renamed over its path. Invariant:
    the secret never lands in a pre-existing file: whatever was at the path (a file of any
    mode, a symlink to anywhere) is replaced, never written through or followed, and a
    crash leaves either the old file or the new one, never a partial key."""
    import os

    public, secret = zmq.curve_keypair()
    os.makedirs(directory, exist_ok=True)
    secret_path = os.path.join(directory, "zmq_server.key")
    public_path = os.path.join(directory, "zmq_server.pub")
    _replace_file(secret_path, secret.decode() + "\n", 0o600)
    _replace_file(public_path, public.decode() + "\n", 0o644)
    return public_path, secret_path


def _replace_file(path: str, text: str, mode: int) -> None:
    """Atomically put a regular file holding `text` with `mode` at `path` (see above)."""
    import os
    import tempfile

    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory or ".")
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            os.fchmod(f.fileno(), mode)  # mkstemp made it 0600; umask does not apply
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # rename(2) replaces a symlink itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
