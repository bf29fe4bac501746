"""Finding a gloo group's connections through its event loop, and shutting them (Linux).

An epoll instance made between two looks (``selectors.EpollSelector``) holding
what gloo's loop holds for a group of 2 (a pipe, a listener, one connection)
stands in for a group's loop: :meth:`Connections.find` must find that
connection, and nothing where no instance, or more than one, fits. A shut must
reach the peer, and never a socket that took a closed descriptor's number.
The real groups are in ``tests/world/test_abort.py``.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from scopedmesh.c10d.gloo_sockets import Connections, Descriptors, open_descriptors

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="epoll and /proc/self/fdinfo are Linux's"
)


@dataclass
class Loop:
    """An epoll instance holding what gloo's loop holds for a group of 2."""

    selector: selectors.EpollSelector = field(default_factory=selectors.EpollSelector)
    listener: socket.socket = field(default_factory=lambda: socket.create_server(("127.0.0.1", 0)))
    pair: tuple[socket.socket, socket.socket] = field(default_factory=socket.socketpair)
    pipe: tuple[int, int] = field(default_factory=os.pipe)

    def __post_init__(self) -> None:
        for item in (self.listener, self.pair[0], self.pipe[0]):
            self.selector.register(item, selectors.EVENT_READ)
        self.pair[1].settimeout(5.0)  # a read that should see the close never hangs

    def close(self) -> None:
        self.selector.close()
        for sock in (self.listener, *self.pair):
            sock.close()
        for fd in self.pipe:
            os.close(fd)


@pytest.fixture
def before() -> Iterator[Descriptors | None]:
    yield open_descriptors()


def test_find_records_the_connection_of_the_one_loop_that_fits(
    before: Descriptors | None,
) -> None:
    loop = Loop()
    try:
        found = Connections.find(before, size=2)
        assert len(found) == 1, found  # the connection: not the listener, not the pipe
        assert found.shut() == 1
        assert loop.pair[1].recv(1) == b""  # the peer sees the connection close at once
        assert found.shut() == 0  # once only
        assert loop.pair[0].fileno() >= 0  # gloo's descriptor stays open: only shut down
    finally:
        loop.close()


def test_a_loop_that_does_not_hold_what_gloos_holds_is_never_taken(
    before: Descriptors | None,
) -> None:
    loop = Loop()
    extra, extra_peer = socket.socketpair()
    try:
        assert len(Connections.find(before, size=3)) == 0  # one connection, not two
        loop.selector.register(extra, selectors.EVENT_READ)
        assert len(Connections.find(before, size=2)) == 0  # a socket more than gloo's
        assert len(Connections.find(before, size=3)) == 2  # now it fits a group of 3
    finally:
        loop.close()
        extra.close()
        extra_peer.close()


def test_two_loops_that_fit_record_nothing(
    before: Descriptors | None,
) -> None:
    first, second = Loop(), Loop()
    try:
        found = Connections.find(before, size=2)
        assert len(found) == 0  # whose is which is not known: nothing is shut
        first.pair[1].setblocking(False)
        with pytest.raises(BlockingIOError):  # still open
            first.pair[1].recv(1)
    finally:
        first.close()
        second.close()


def test_a_loop_holding_what_an_earlier_loop_held_is_never_taken() -> None:
    earlier = Loop()  # before the look: a watch's selector, another group
    try:
        before = open_descriptors()
        later = selectors.EpollSelector()  # made since, over the earlier loop's sockets
        for item in (earlier.listener, earlier.pair[0], earlier.pipe[0]):
            later.register(item, selectors.EVENT_READ)
        assert len(Connections.find(before, size=2)) == 0
        later.close()
    finally:
        earlier.close()


def test_a_descriptor_number_taken_by_another_socket_is_never_shut(
    before: Descriptors | None,
) -> None:
    loop = Loop()
    found = Connections.find(before, size=2)
    assert len(found) == 1
    ours = loop.pair[0]
    number = ours.fileno()
    loop.selector.unregister(ours)
    ours.close()  # gloo closed it; the number is free
    stranger, peer = socket.socketpair()
    peer.settimeout(5.0)
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
        loop.close()


def test_the_listings_own_descriptor_is_not_counted_open() -> None:
    before = open_descriptors()
    assert before is not None
    opened = os.open(os.devnull, os.O_RDONLY)  # takes the lowest free number
    try:
        assert opened not in before  # else a loop opened now could hold it: never found
    finally:
        os.close(opened)


def test_a_loop_made_at_the_numbers_of_descriptors_closed_meanwhile_is_found() -> None:
    """While a group forms, another group's destructor (a heal's, left to a thread) closes
    its descriptors, and the new group's take their numbers: they are new all the same."""
    old = Loop()
    before = open_descriptors()
    old.close()
    new = Loop()  # the lowest free numbers: the old loop's
    try:
        numbers = {new.selector.fileno(), new.listener.fileno(), new.pair[0].fileno(), new.pipe[0]}
        assert before is not None and numbers & set(before)  # else this proves nothing
        found = Connections.find(before, size=2)
        assert len(found) == 1, found
    finally:
        new.close()
