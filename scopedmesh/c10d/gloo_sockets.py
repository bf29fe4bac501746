"""A gloo group's connections, found as its construction opens them, and shut at once.

gloo gives no handle on its sockets and no way to close them but its
destructor, which waits for a collective in flight, and a collective blocked on
a dead peer ends only when its own connection fails. So a closable group
(:mod:`scopedmesh.c10d.closable`) notes the sockets its construction opened:
the descriptors that ``/proc/self/fd`` lists after ``ProcessGroupGloo(...)``
and did not before. Of those, gloo's listener (no peer) is never touched
(gloo ends the process when its ``accept`` fails); the connections to the
``size - 1`` peers are :meth:`Connections.shut` with ``shutdown(2)`` when the
group is aborted: a collective in flight on them fails at once, here and on
every peer (they read end-of-file), instead of as each collective times out.

Another thread may open a socket while the group forms (the liveness watch's
ring relinking, a store client). A connection accepted on the group's own
listener is the group's for sure; the others are taken only when the count is
exactly the group's ``size - 1`` connections, so a foreign socket is never
shut: with one too many, only the certain ones are kept, and the group's other
connections close as before, when its collectives fail. Where ``/proc/self/fd``
does not exist (not Linux), nothing is found and nothing is shut.

>>> Connections(()).shut()
0
>>> pick([Found(5, 11, 4000, None), Found(6, 12, 4000, 5000), Found(7, 13, 6000, 4100)], 3)
(1, 2)
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Connections", "Found", "connections_since", "pick", "sockets_now"]

_FDS = "/proc/self/fd"


def sockets_now() -> dict[int, int] | None:
    """This process's open sockets, descriptor -> inode; None where it cannot tell."""
    try:
        names = os.listdir(_FDS)
    except OSError:
        return None
    found: dict[int, int] = {}
    for name in names:
        try:
            target = os.readlink(f"{_FDS}/{name}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        if target.startswith("socket:["):
            found[int(name)] = int(target[8:-1])
    return found


@dataclass(frozen=True)
class Found:
    """A TCP socket a construction opened: descriptor, inode, local port, peer's port
    (None: a listener)."""

    fd: int
    inode: int
    port: int
    peer: int | None


def pick(found: Iterable[Found], size: int) -> tuple[int, ...]:
    """The indices into ``found`` of the group's ``size - 1`` connections (see the module).

    ``found`` lists the TCP sockets opened while a group of ``size`` members
    formed, in any order. A connection accepted on the one listener among them is
    certain; the others count only if the connections number exactly ``size - 1``.
    Returns positions in ``found``'s order.

    >>> pick([Found(5, 11, 4000, None), Found(6, 12, 4000, 5000), Found(8, 14, 6001, 9)], 2)
    (1,)
    """
    found = list(found)
    listeners = [f.port for f in found if f.peer is None]
    connected = [i for i, f in enumerate(found) if f.peer is not None]
    if len(connected) == size - 1:
        return tuple(connected)
    if len(listeners) != 1:
        return ()
    return tuple(i for i in connected if found[i].port == listeners[0])


def _describe(fd: int, inode: int) -> Found | None:
    """``fd`` as a :class:`Found` if it is still the TCP socket ``inode``, else None."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None
    with sock:  # closes the copy only
        if os.fstat(copy).st_ino != inode or sock.type != socket.SOCK_STREAM:
            return None
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        port = int(sock.getsockname()[1])
        try:
            peer: int | None = int(sock.getpeername()[1])
        except OSError:  # not connected: a listener
            peer = None
        return Found(fd, inode, port, peer)


def connections_since(before: Mapping[int, int] | None, size: int) -> Connections:
    """The connections of a group of ``size`` whose construction began at ``before``
    (:func:`sockets_now`); none where that could not be read."""
    now = sockets_now() if before is not None else None
    if before is None or now is None:
        return Connections(())
    new = [(fd, inode) for fd, inode in sorted(now.items()) if before.get(fd) != inode]
    found = [f for f in (_describe(fd, inode) for fd, inode in new) if f is not None]
    return Connections(tuple((found[i].fd, found[i].inode) for i in pick(found, size)))


@dataclass(frozen=True)
class Connections:
    """A group's connections as ``(descriptor, inode)``; :meth:`shut` ends them at once."""

    held: tuple[tuple[int, int], ...]

    def shut(self) -> int:
        """``shutdown(2)`` each connection still open under its descriptor; how many were.

        A descriptor gloo closed (and the system may have reused) is told by its
        inode and left alone. Never waits; safe from any thread, any number of times
        (a second shutdown of a socket does nothing).
        """
        count = 0
        for fd, inode in self.held:
            try:
                copy = os.dup(fd)
            except OSError:  # gloo closed it
                continue
            try:
                if os.fstat(copy).st_ino != inode:  # the number was reused: not ours
                    continue
                sock = socket.socket(fileno=copy)
                copy = -1  # the socket owns the copy now
                with sock, contextlib.suppress(OSError):  # OSError: reset already
                    sock.shutdown(socket.SHUT_RDWR)
                    count += 1
            finally:
                if copy >= 0:
                    os.close(copy)
        return count

    def __len__(self) -> int:
        return len(self.held)
