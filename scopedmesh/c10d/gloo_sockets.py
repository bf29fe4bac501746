"""A gloo group's connections, found as it forms, so that an abort can shut them at once.

torch gives no handle on a gloo group's sockets, and gloo closes them only in
the group's destructor: pair by pair, each close waiting for a tick of the
group's event loop, whose ``epoll_wait`` times out every 10 ms. Destroying an
idle group while its peers destroy theirs took about 20 ms
(``python -m benchmarks.gloo_destroy``), one group after another, and a peer
blocked on this rank learns of the close only when its pair's turn comes.

Each gloo group has an event loop of its own: one ``epoll`` instance, made while
the group forms, in which gloo registers the group's listener, the read end of
its wake-up pipe and one connection per peer. On Linux the kernel lists what
an epoll instance holds, with each descriptor's inode, in ``/proc/self/fdinfo``.
So :meth:`Connections.find` looks for the one epoll instance that holds only
descriptors opened while the group formed (each descriptor's file, by
:func:`open_descriptors` before and after: a number reused names another
inode), and exactly what gloo's loop holds for a group of that size (one
pipe, one listener, one connection per peer); it records the connections.
:meth:`Connections.shut` shuts them down (``shutdown(2)``, both ways), which
every peer sees at once as the connection closing, as if the group had been
destroyed. Where the kernel gives no such
list, gloo connects lazily, or no instance (or more than one) fits, nothing is
recorded and a shut does nothing: the group closes as gloo closes it.

Shut only a group with no collective in flight on this rank: gloo does not fail
every operation of a pair that meets a shut connection mid-transfer
(docs/measured.md: a send queued after ``EPIPE``, a receive begun).

>>> before = open_descriptors()
>>> found = Connections.find(before, size=2)   # no group formed since: nothing found
>>> len(found), found.shut()
(0, 0)
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
from collections.abc import Iterator

__all__ = ["Connections", "Descriptors", "open_descriptors"]

_PROC = "/proc/self"
_EPOLL = "anon_inode:[eventpoll]"
# One registered descriptor in an epoll instance's fdinfo, e.g.
# "tfd:       24 events:       19 data: 55c354b81898  pos:0 ino:6fd547 sdev:9".
_TARGET = re.compile(r"tfd:\s*(\d+)\s.*\bino:([0-9a-f]+)")

Target = tuple[int, int]  # a descriptor registered in an epoll instance, and its inode


Descriptors = dict[int, tuple[int, int, int]]  # fd -> the file it names: device, inode, type


def open_descriptors() -> Descriptors | None:
    """This process's open descriptors now, each with the file it names (device, inode and
    type bits); None where ``/proc`` cannot tell.

    A number closed and opened again names another file (another inode), so a
    descriptor opened since is told apart even where it took a closed one's
    number, as gloo's do while another group's destructor closes its own. The
    listing's own descriptor, closed once it is read, is left out.

    >>> 0 in (open_descriptors() or {0: None})
    True
    """
    try:
        listed = os.listdir(f"{_PROC}/fd")
    except OSError:
        return None
    found: Descriptors = {}
    for fd in map(int, listed):
        with contextlib.suppress(OSError):  # closed since it was listed
            status = os.fstat(fd)
            found[fd] = (status.st_dev, status.st_ino, stat.S_IFMT(status.st_mode))
    return found


def _event_loops(now: Descriptors) -> list[int]:
    """The epoll instances among ``now`` (anonymous inodes: their inode names no instance,
    so every one is a candidate, whether its number is new or not)."""
    loops = []
    for fd, (_, _, kind) in now.items():
        if kind == 0:  # an anonymous inode: epoll, eventfd, timerfd, ...
            with contextlib.suppress(OSError):
                if os.readlink(f"{_PROC}/fd/{fd}") == _EPOLL:
                    loops.append(fd)
    return loops


def _targets(loop: int) -> frozenset[Target]:
    """What the epoll instance ``loop`` holds, as (descriptor, inode) pairs."""
    targets: set[Target] = set()
    with open(f"{_PROC}/fdinfo/{loop}") as info:
        for line in info:
            match = _TARGET.match(line)
            if match is not None:
                targets.add((int(match.group(1)), int(match.group(2), 16)))
    return frozenset(targets)


class Connections:
    """The connected sockets of one gloo group, as (descriptor, inode) pairs.

    A descriptor is used only while it still names the same socket (its inode
    is checked on a duplicate), so a number gloo closed and the process reused
    is never touched.

    >>> Connections([]).shut()
    0
    """

    __slots__ = ("_sockets",)

    def __init__(self, sockets: list[Target]) -> None:
        self._sockets = sockets

    @classmethod
    def find(cls, before: Descriptors | None, *, size: int) -> Connections:
        """The connections of the gloo group of ``size`` members formed since
        :func:`open_descriptors` gave ``before``: those of the one epoll instance that holds
        only descriptors opened since, exactly what gloo's loop holds for that size; empty
        unless exactly one instance fits."""
        if before is None:  # no /proc: whose descriptor is whose is not known
            return cls([])
        now = open_descriptors() or {}
        opened = {fd for fd, ident in now.items() if before.get(fd) != ident}
        fits: list[list[Target]] = []
        for loop in _event_loops(now):
            with contextlib.suppress(OSError):  # closed meanwhile: not a live group's
                targets = _targets(loop)
                if not targets or any(fd not in opened for fd, _ in targets):
                    continue  # holds a descriptor open before the group formed (each
                    # target's inode is checked as it is told apart: _kind)
                kinds: dict[str, list[Target]] = {"pipe": [], "listener": [], "connection": []}
                for target in targets:
                    kind = _kind(*target)
                    if kind is not None:
                        kinds[kind].append(target)
                if (len(kinds["pipe"]), len(kinds["listener"])) == (1, 1) and len(
                    kinds["connection"]
                ) == size - 1 == len(targets) - 2:
                    fits.append(kinds["connection"])
        return cls(fits[0] if len(fits) == 1 else [])

    def __len__(self) -> int:
        return len(self._sockets)

    def shut(self) -> int:
        """Shut every connection down, both ways (once); the number shut. Never raises."""
        sockets, self._sockets = self._sockets, []
        shut = 0
        for target in sockets:
            with _still(*target) as found:
                if found is not None and found[1] is not None:
                    with contextlib.suppress(OSError):  # the peer closed it first
                        found[1].shutdown(socket.SHUT_RDWR)
                        shut += 1
        return shut

    def __repr__(self) -> str:
        return f"<gloo connections {[fd for fd, _ in self._sockets]}>"


def _kind(fd: int, inode: int) -> str | None:
    """``"connection"``, ``"listener"`` or ``"pipe"`` for the descriptor ``fd`` if it still
    names ``inode``; None for anything else, or where it cannot be told."""
    with _still(fd, inode) as found:
        if found is None:
            return None
        status, sock = found
        if stat.S_ISFIFO(status.st_mode):
            return "pipe"
        if sock is None:
            return None
        with contextlib.suppress(OSError):
            listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            return "listener" if listening else "connection"
        return None


@contextlib.contextmanager
def _still(fd: int, inode: int) -> Iterator[tuple[os.stat_result, socket.socket | None] | None]:
    """Through a duplicate of ``fd``, while it still names the file ``inode``: its status and,
    for a socket, a socket object on the duplicate; None if ``fd`` is closed or names
    another file now. The duplicate is closed on leaving (gloo's own descriptor never)."""
    try:
        copy = os.dup(fd)
    except OSError:  # closed meanwhile
        yield None
        return
    sock: socket.socket | None = None
    try:
        status: os.stat_result | None = None
        with contextlib.suppress(OSError):
            status = os.fstat(copy)
            if stat.S_ISSOCK(status.st_mode):
                sock = socket.socket(fileno=copy)
        if status is None or status.st_ino != inode:
            yield None
        else:
            yield status, sock
    finally:
        if sock is not None:
            sock.detach()  # the duplicate is closed below, once
        os.close(copy)
