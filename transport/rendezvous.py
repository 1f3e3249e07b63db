"""Admission of other machines' ranks into a tensor-parallel group, over ZeroMQ with CURVE.

Node 0 (the one running the control plane) answers at `--dist-init-addr HOST:PORT`, a REP
socket that is a CURVE server. Each other node sends a hello naming its node rank, and gets
the group's settings back: the model and pool shape, and where torch.distributed's
rendezvous store listens (an ephemeral port, told only to admitted nodes). Every node holds
the same CURVE keypair (`bin/engine zmq-keygen DIR`, the secret file copied to each); the
ZAP handler admits only clients holding that key, so a node with another key gets no answer.

A node that cannot be admitted learns why: nothing listening at the address (a wrong
`--dist-init-addr`, or node 0 not up within the wait), or a listener that does not answer
(a wrong key). The collectives themselves are torch.distributed's (gloo over plain TCP, as
in every torch.distributed deployment): keep the nodes on a private network.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator

HANDSHAKE_TIMEOUT_S = 10.0
# This process, named in its hellos: a node asking again (its ranks restarted) is told
# apart from another machine given the same --node-rank.
_INSTANCE = secrets.token_hex(8)
ZAP_DOMAIN = "kvactor-tp"


class RendezvousError(RuntimeError):
    """A node could not be admitted (or admit); the message names the address or the key."""


def split_address(address: str) -> tuple[str, int]:
    """ "HOST:PORT" -> (host, port); RendezvousError naming it when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(f"--dist-init-addr must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


class _SameKey:
    """ZAP check: the client must hold the group's own (public) key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


class Admission:
    """Node 0's side: bound at construction (an unusable address fails here, naming it)."""

    def __init__(self, address: str, secret: bytes) -> None:
        host, port = split_address(address)
        self.address = address
        self.cancelled = False
        self.started = False  # an `admit` took it over (and closes it when done)
        self.context = zmq.Context()
        self.auth = ThreadAuthenticator(self.context)
        self.auth.start()
        public = zmq.curve_public(secret)
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_SameKey(public))
        self.socket = self.context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.CURVE_SERVER, 1)
        self.socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
        self.socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        try:
            self.socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.close()
            raise RendezvousError(
                f"cannot listen at {address} (--dist-init-addr): {exc}; it must be an "
                "address of this machine, node 0's"
            ) from None

    def admit(self, nodes: set[int], answer, deadline: float) -> None:
        """Answer hellos until every node rank in `nodes` has been admitted once (a node
        asking again, after a restart of its ranks, is answered too); `answer(hello)` is
        the dict a node gets (a ValueError from it: the node is refused with its message).
        RendezvousError when `deadline` (time.monotonic) passes or `cancel()` is called."""
        waiting = set(nodes)
        admitted: dict[int, str] = {}  # node rank -> the process that holds it
        refused: dict[int, str] = {}  # node rank -> why its last hello was refused
        while waiting:
            if self.cancelled:
                raise RendezvousError(f"admission at {self.address} cancelled")
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                why = "".join(
                    f"; node {n} was refused: {refused[n]}" for n in sorted(refused) if n in waiting
                )
                raise RendezvousError(
                    f"node(s) {sorted(waiting)} did not join at {self.address} in time{why}"
                )
            if not self.socket.poll(min(left_ms, 200)):
                continue
            try:
                hello = json.loads(self.socket.recv())
                node = int(hello["node_rank"])
            except (ValueError, KeyError, TypeError):
                self.socket.send(json.dumps({"error": "bad hello"}).encode())
                continue
            if node not in nodes:
                self.socket.send(json.dumps({"error": f"no node rank {node} here"}).encode())
                continue
            instance = str(hello.get("instance", ""))
            if admitted.get(node, instance) != instance:
                # Another machine (process) already holds this rank: two nodes were given
                # the same --node-rank, and the rank missing would only show as a timeout.
                error = (
                    f"node rank {node} was admitted already, from another node: give each "
                    f"node its own --node-rank (1..{max(nodes)})"
                )
                self.socket.send(json.dumps({"error": error}).encode())
                continue
            try:
                reply = answer(hello)
            except ValueError as exc:
                refused[node] = str(exc)
                self.socket.send(json.dumps({"error": str(exc)}).encode())
                continue
            self.socket.send(json.dumps(reply).encode())
            admitted[node] = instance
            waiting.discard(node)

    def close_unless_admitting(self) -> None:
        """Close now unless `admit` runs in a thread (it closes on its way out)."""
        if not self.started:
            self.close()

    def cancel(self) -> None:
        """Make a running `admit` give up within its next poll (any thread may call it)."""
        self.cancelled = True

    def close(self) -> None:
        self.socket.close(linger=0)
        self.auth.stop()
        self.context.term()


def request_admission(
    address: str,
    secret: bytes,
    node_rank: int,
    wait_s: float,
    cancelled=lambda: False,
    about: dict | None = None,
) -> dict | None:
    """A node's side: its settings from node 0 at `address`. Waits up to `wait_s` for node
    0 to listen there, then HANDSHAKE_TIMEOUT_S for its answer; RendezvousError naming
    the address (nothing listens) or the key (no answer through CURVE). None once
    `cancelled()` while it waits. `about`: more of the node's settings for node 0 to check."""
    host, port = split_address(address)
    deadline = time.monotonic() + wait_s
    while True:
        if cancelled():
            return None
        try:
            socket.create_connection((host, port), timeout=2.0).close()
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"nothing listens at {address} (--dist-init-addr) after {wait_s:.0f} s: {exc}"
                ) from None
            time.sleep(0.25)
    public = zmq.curve_public(secret)
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CURVE_SERVERKEY, public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.connect(f"tcp://{host}:{port}")
        hello = {"node_rank": node_rank, "instance": _INSTANCE, **(about or {})}
        sock.send(json.dumps(hello).encode())
        if not sock.poll(int(HANDSHAKE_TIMEOUT_S * 1000)):
            raise RendezvousError(
                f"{address} does not answer through CURVE within {HANDSHAKE_TIMEOUT_S:.0f} s: "
                "this node's parallel.curve_secret_file is not node 0's key (or node 0 is "
                "admitting nobody now)"
            )
        reply = json.loads(sock.recv())
    finally:
        sock.close(linger=0)
        context.term()
    if "error" in reply:
        raise RendezvousError(f"{address} refused node {node_rank}: {reply['error']}")
    return reply
