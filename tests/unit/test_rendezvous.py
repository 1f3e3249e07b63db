"""Admission of other machines' tensor-parallel ranks (transport/rendezvous.py): the node
holding the group's CURVE key gets its settings; another key gets a message naming the key;
an address nobody listens at, a message naming the address; node 0 cannot listen at an
address that is not its own."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from transport.rendezvous import (
    Admission,
    RendezvousError,
    request_admission,
    split_address,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def admission():
    secret = zmq.curve_keypair()[1]
    address = f"127.0.0.1:{_free_port()}"
    node0 = Admission(address, secret)
    yield node0, address, secret
    node0.close()


def _serve(node0: Admission, nodes: set[int], seconds: float = 20.0) -> list:
    errors: list = []

    def run():
        try:
            deadline = time.monotonic() + seconds
            node0.admit(nodes, lambda h: {"store_port": 1234, "node": h["node_rank"]}, deadline)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    errors.append(thread)
    return errors


def test_a_node_with_the_key_gets_its_settings(admission):
    node0, address, secret = admission
    outcome = _serve(node0, {1, 2})
    assert request_admission(address, secret, 2, wait_s=5) == {"store_port": 1234, "node": 2}
    assert request_admission(address, secret, 1, wait_s=5)["node"] == 1
    outcome[-1].join(5)
    assert outcome == [outcome[-1]]  # no error: both admitted


def test_another_key_is_named(admission, monkeypatch):
    import transport.rendezvous as rendezvous

    node0, address, _ = admission
    _serve(node0, {1}, seconds=5)
    monkeypatch.setattr(rendezvous, "HANDSHAKE_TIMEOUT_S", 1.0)
    with pytest.raises(RendezvousError, match="curve_secret_file is not node 0's key"):
        request_admission(address, zmq.curve_keypair()[1], 1, wait_s=5)


def test_an_address_nobody_listens_at_is_named():
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(RendezvousError, match=f"nothing listens at {address}"):
        request_admission(address, zmq.curve_keypair()[1], 1, wait_s=0.5)


def test_node_0_listens_only_at_its_own_address():
    with pytest.raises(RendezvousError, match="cannot listen at 192.0.2.1:"):
        Admission(f"192.0.2.1:{_free_port()}", zmq.curve_keypair()[1])
    with pytest.raises(RendezvousError, match="HOST:PORT"):
        split_address("no-port")


def test_an_unknown_node_rank_is_refused(admission):
    node0, address, secret = admission
    _serve(node0, {1}, seconds=5)
    with pytest.raises(RendezvousError, match="no node rank 3"):
        request_admission(address, secret, 3, wait_s=5)


def test_two_nodes_given_the_same_node_rank_are_told_so(admission, monkeypatch):
    import transport.rendezvous as rendezvous

    node0, address, secret = admission
    outcome = _serve(node0, {1, 2})
    assert request_admission(address, secret, 1, wait_s=5)["node"] == 1
    # the same node asking again (its ranks restarted) is answered again
    assert request_admission(address, secret, 1, wait_s=5)["node"] == 1
    monkeypatch.setattr(rendezvous, "_INSTANCE", "another-machine")
    with pytest.raises(RendezvousError, match="node rank 1 was admitted already"):
        request_admission(address, secret, 1, wait_s=5)
    assert request_admission(address, secret, 2, wait_s=5)["node"] == 2  # the right one joins
    outcome[-1].join(5)
    assert outcome == [outcome[-1]]


def test_node_0_names_the_refusal_when_the_refused_node_never_joins(admission):
    """A node refused by `answer` (another group shape, too few GPUs) is told why, and node
    0's own timeout names that refusal rather than only a node that did not join."""
    from kernels.tensor_parallel import check_node

    node0, address, secret = admission
    errors: list = []

    def run():
        try:
            node0.admit({1}, lambda h: check_node(h, 4, 2, "cuda") or {}, time.monotonic() + 3)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    with pytest.raises(RendezvousError, match="node 1: 2 tensor-parallel ranks .* sees 1"):
        request_admission(address, secret, 1, wait_s=5, about={"world": 4, "nnodes": 2, "gpus": 1})
    thread.join(10)
    (error,) = errors
    assert "did not join" in str(error)
    assert "node 1 was refused: node 1: 2 tensor-parallel ranks on this machine" in str(error)


def test_a_nodes_hello_is_checked_against_the_group():
    from kernels.tensor_parallel import check_node

    check_node({"node_rank": 1, "world": 4, "nnodes": 2, "gpus": 2}, 4, 2, "cuda")
    check_node({"node_rank": 1, "world": 4, "nnodes": 2, "gpus": 0}, 4, 2, "cpu")
    check_node({"node_rank": 1, "world": 4, "nnodes": 2}, 4, 2, "cuda")  # it checks itself
    with pytest.raises(ValueError, match=r"node 1 has tensor_parallel_size, nnodes = \(2, 2\)"):
        check_node({"node_rank": 1, "world": 2, "nnodes": 2}, 4, 2, "cpu")
    with pytest.raises(ValueError, match="node 1: 2 tensor-parallel ranks .* sees 1"):
        check_node({"node_rank": 1, "world": 4, "nnodes": 2, "gpus": 1}, 4, 2, "cuda")
