"""A gloo group's connections, found as it forms, so that an abort can shut them at once.

torch gives no handle on a gloo group's sockets, and gloo closes them only in
the group's destructor: pair by pair, each close waiting for a tick of the
group's event loop, whose ``epoll_wait`` times out every 10 ms. Destroying an
idle group while its peers destroy theirs took about 20 ms
(``python -m benchmarks.gloo_destroy``), one group after another, and a peer
blocked on this rank learns of the close only when its pair's turn comes.

Each gloo group has an event loop of its own: one ``epoll`` instance, made while
the group forms, in which gloo registers the group's sockets (its listener and
one connection per peer). On Linux the kernel lists an epoll instance's
registered descriptors, with their inodes, in ``/proc/self/fdinfo``. So
:meth:`Connections.find` takes the one epoll instance that appeared while the
group formed and records its connected sockets; :meth:`Connections.shut` shuts
them down (``shutdown(2)``, both ways), which every peer sees at once as the
connection closing, as if the group had been destroyed. Everything else (the
listener, gloo's wake-up pipe) is left alone. Where the kernel gives no such
list, or two groups formed at the same moment in this process, nothing is
recorded and a shut does nothing: the group closes as gloo closes it.

Shut only a group with no collective in flight on this rank: gloo does not fail
every operation of a pair that meets a shut connection mid-transfer
(docs/measured.md: a send queued after ``EPIPE``, a receive begun).

>>> Connections([]).shut()
0
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
from collections.abc import Iterator

__all__ = ["Connections", "event_loops"]

_PROC = "/proc/self"
# One registered descriptor in an epoll instance's fdinfo, e.g.
# "tfd:       24 events:       19 data: 55c354b81898  pos:0 ino:6fd547 sdev:9".
_TARGET = re.compile(r"tfd:\s*(\d+)\s.*\bino:([0-9a-f]+)")


def event_loops() -> frozenset[tuple[int, int]]:
    """This process's epoll instances now, as (descriptor, inode); empty off Linux."""
    loops: set[tuple[int, int]] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(f"{_PROC}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                if os.readlink(f"{_PROC}/fd/{name}") == "anon_inode:[eventpoll]":
                    loops.add((int(name), os.stat(f"{_PROC}/fd/{name}").st_ino))
    return frozenset(loops)


class Connections:
    """The connected sockets of one gloo group, as (descriptor, inode) pairs.

    A descriptor is used only while it still names the same socket (its inode
    is checked on a duplicate), so a number gloo closed and the process reused
    is never touched.
    """

    __slots__ = ("_sockets",)

    def __init__(self, sockets: list[tuple[int, int]]) -> None:
        self._sockets = sockets

    @classmethod
    def find(cls, before: frozenset[tuple[int, int]]) -> Connections:
        """The connections of the gloo group formed since :func:`event_loops` gave ``before``.

        Empty unless exactly one epoll instance appeared meanwhile.
        """
        appeared = event_loops() - before
        if len(appeared) != 1:
            return cls([])
        ((loop, _),) = appeared
        sockets: list[tuple[int, int]] = []
        with contextlib.suppress(OSError), open(f"{_PROC}/fdinfo/{loop}") as info:
            for line in info:
                match = _TARGET.match(line)
                if match is None:
                    continue
                target = (int(match.group(1)), int(match.group(2), 16))
                if _is_connection(*target):
                    sockets.append(target)
        return cls(sockets)

    def __len__(self) -> int:
        return len(self._sockets)

    def shut(self) -> int:
        """Shut every connection down, both ways (once); the number shut. Never raises."""
        sockets, self._sockets = self._sockets, []
        shut = 0
        for fd, inode in sockets:
            with _same_socket(fd, inode) as sock:
                if sock is not None:
                    with contextlib.suppress(OSError):  # the peer closed it first
                        sock.shutdown(socket.SHUT_RDWR)
                        shut += 1
        return shut

    def forget(self) -> None:
        """Drop the record (the group closed the gloo way): nothing is shut later."""
        self._sockets = []

    def __repr__(self) -> str:
        return f"<gloo connections {[fd for fd, _ in self._sockets]}>"


def _is_connection(fd: int, inode: int) -> bool:
    """Whether ``fd`` is the socket ``inode`` and a connection (not a listener)."""
    with _same_socket(fd, inode) as sock:
        return sock is not None and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)


@contextlib.contextmanager
def _same_socket(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A socket on a duplicate of ``fd`` if it is still the socket ``inode``, else None;
    the duplicate is closed on leaving (gloo's own descriptor is never closed here)."""
    try:
        copy = os.dup(fd)
    except OSError:  # closed meanwhile
        yield None
        return
    try:
        status = os.fstat(copy)
        if status.st_ino != inode or not stat.S_ISSOCK(status.st_mode):
            yield None
            return
        sock = socket.socket(fileno=copy)
        try:
            yield sock
        finally:
            sock.detach()
    finally:
        os.close(copy)
