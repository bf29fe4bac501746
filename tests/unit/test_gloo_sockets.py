"""Finding a gloo group's connections through its event loop, and shutting them (Linux).

An epoll instance made between two looks (``selectors.EpollSelector``, as gloo's
loop makes one) stands in for a group's loop: what is registered in it is what
:meth:`Connections.find` must find, listeners and pipes left out; a shut must
reach the peer, and never a socket that took a closed descriptor's number.
The real groups are in ``tests/world/test_abort.py``.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
from collections.abc import Iterator

import pytest

from scopedmesh.c10d.gloo_sockets import Connections, event_loops

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="epoll and /proc/self/fdinfo are Linux's"
)


@pytest.fixture
def loop() -> Iterator[tuple[selectors.EpollSelector, frozenset[tuple[int, int]]]]:
    before = event_loops()
    selector = selectors.EpollSelector()
    yield selector, before
    selector.close()


def test_find_records_the_connections_of_the_one_new_loop_and_nothing_else(
    loop: tuple[selectors.EpollSelector, frozenset[tuple[int, int]]],
) -> None:
    selector, before = loop
    listener = socket.create_server(("127.0.0.1", 0))
    ours, theirs = socket.socketpair()
    reading, writing = os.pipe()
    unregistered, _ = socket.socketpair()
    for item in (listener, ours, reading):
        selector.register(item, selectors.EVENT_READ)
    try:
        found = Connections.find(before)
        assert len(found) == 1, found  # the connection: not the listener, the pipe, the rest
        assert found.shut() == 1
        assert theirs.recv(1) == b""  # the peer sees the connection close at once
        assert found.shut() == 0  # once only
        with pytest.raises(OSError):  # the descriptor is still open, only shut down
            ours.send(b"x")
        assert ours.fileno() >= 0
    finally:
        for item in (listener, ours, theirs, unregistered, _):
            item.close()
        os.close(reading)
        os.close(writing)


def test_two_new_loops_record_nothing(
    loop: tuple[selectors.EpollSelector, frozenset[tuple[int, int]]],
) -> None:
    selector, before = loop
    other = selectors.EpollSelector()
    ours, theirs = socket.socketpair()
    selector.register(ours, selectors.EVENT_READ)
    try:
        found = Connections.find(before)
        assert len(found) == 0  # whose is which is not known: nothing is shut
        assert found.shut() == 0
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):  # still open
            theirs.recv(1)
    finally:
        other.close()
        ours.close()
        theirs.close()


def test_a_descriptor_number_taken_by_another_socket_is_never_shut(
    loop: tuple[selectors.EpollSelector, frozenset[tuple[int, int]]],
) -> None:
    selector, before = loop
    ours, theirs = socket.socketpair()
    selector.register(ours, selectors.EVENT_READ)
    found = Connections.find(before)
    assert len(found) == 1
    number = ours.fileno()
    selector.unregister(ours)
    ours.close()  # gloo closed it; the number is free
    stranger, peer = socket.socketpair()
    try:
        if stranger.fileno() != number:  # make the stranger take the number
            os.dup2(stranger.fileno(), number)
            stranger.close()
            stranger = socket.socket(fileno=number)
        assert found.shut() == 0
        stranger.sendall(b"ok")
        assert peer.recv(2) == b"ok"  # untouched
    finally:
        stranger.close()
        peer.close()
        theirs.close()
