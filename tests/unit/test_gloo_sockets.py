"""A gloo group's connections: which sockets are taken, and their shutdown(2).

The world figures (a 4-member group finds its 3 connections; an interrupt ends
a collective in flight on every member at once) are in ``tests/world/test_watch.py``.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from scopedmesh.c10d import gloo_sockets
from scopedmesh.c10d.gloo_sockets import Connections, Found, pick

LISTENER = Found(3, 30, 4000, None)


@given(
    size=st.integers(2, 9),
    foreign=st.lists(st.integers(1025, 3999), max_size=3),
    seed=st.randoms(use_true_random=False),
)
def test_a_foreign_socket_is_never_taken(size: int, foreign: list[int], seed: object) -> None:
    """The group's connections: ``size - 1``, half accepted on its listener (port 4000),
    half connected out; other threads' sockets (``foreign``) opened meanwhile."""
    accepted = [Found(10 + i, 100 + i, 4000, 5000 + i) for i in range(size // 2)]
    out = [Found(20 + i, 200 + i, 6000 + i, 7000 + i) for i in range(size - 1 - size // 2)]
    strangers = [Found(40 + i, 400 + i, port, 29500) for i, port in enumerate(foreign)]
    found = [LISTENER, *accepted, *out, *strangers]
    seed.shuffle(found)  # type: ignore[attr-defined]
    taken = {found[i] for i in pick(found, size)}
    assert not taken & set(strangers)
    if strangers:  # the count is off: only the certain ones
        assert taken == set(accepted)
    else:
        assert taken == {*accepted, *out}


def test_without_one_listener_only_an_exact_count_is_taken() -> None:
    pair = [Found(5, 50, 4000, 5000), Found(6, 60, 6000, 7000)]
    assert pick(pair, 3) == (0, 1)
    assert pick(pair, 2) == ()  # one too many, and no listener to tell which is the group's
    assert pick([LISTENER, LISTENER, *pair], 4) == ()


def test_shut_ends_the_connection_for_both_ends_and_counts_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        connections = Connections(((a.fileno(), os.fstat(a.fileno()).st_ino),))
        assert connections.shut() == 1
        assert b.recv(1) == b""  # the peer reads end-of-file at once
        assert a.fileno() >= 0  # the descriptor is still the owner's to close


def test_shut_leaves_a_reused_descriptor_alone() -> None:
    """gloo closed the socket and the number now names another: never shut that one."""
    a, b = socket.socketpair()
    with a, b:
        stale = Connections(((a.fileno(), os.fstat(a.fileno()).st_ino + 1),))
        assert stale.shut() == 0
        b.sendall(b"x")
        assert a.recv(1) == b"x"  # still open both ways
    assert Connections(((10**6, 1),)).shut() == 0  # not open at all


def test_a_one_member_group_has_no_connection_to_shut() -> None:
    before = gloo_sockets.sockets_now()
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    found = gloo_sockets.connections_since(before, 1)
    assert before is not None and len(found) == 0
    del group
    assert len(gloo_sockets.connections_since(None, 2)) == 0  # no listing: nothing found
