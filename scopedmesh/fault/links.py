"""Held links to an epoch's other members: a host cut off from the network is lost within
about a second; a stopped, busy or slow process never is.

A refused connect tells a dead process (:mod:`~scopedmesh.fault.probes`), but a
host cut off from the network answers nothing at all: a connect to it, or a
collective with it, just waits. So each slot holds one TCP connection (a
**link**) to the listener of every other member of its epoch's dp group, and
while it waits for them (a collective of the epoch's group, a heal, a
formation) it sends one byte on each link every :data:`CHECK_EVERY` seconds.
The byte is acknowledged by the peer's **kernel**, whether or not its process
runs: a process that is stopped (SIGSTOP), descheduled or computing keeps its
links alive, however long. A byte still unacknowledged :data:`UNREACHABLE_AFTER`
seconds after it was sent (the kernel's count of unacknowledged bytes,
``SIOCOUTQ``), or a connect unanswered that long, makes the slot **unreachable**;
the kernel ends such a link by itself too (``TCP_USER_TIMEOUT``), but only when
a retransmission is due, and the first one waits a whole retransmission timeout
(with that alone, one cut in eight took 4.5 s to be seen on a loaded machine).
A link reset or closed by the peer's kernel (its process ended, or closed its
listener) is **closed**: dead, as a refused probe. A verdict on an incarnation
is final.

Nothing is sent while no one waits: no thread, no store request, no traffic
in a step that does not stall. A loss leaves one thread behind, which holds the
abandoned group until gloo's timeout ends its collective.

>>> import errno
>>> reason_of(errno.ETIMEDOUT), reason_of(errno.EHOSTUNREACH), reason_of(errno.ECONNRESET)
('unreachable', 'unreachable', 'closed')
>>> reason_of(0) is None
True
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from scopedmesh.fault.state_transfer import CollectiveFailed

__all__ = [
    "CHECK_EVERY",
    "CLOSED",
    "UNREACHABLE",
    "UNREACHABLE_AFTER",
    "Links",
    "Slot",
    "WatchedGroup",
    "reason_of",
    "unacknowledged",
]

CHECK_EVERY = 0.05  # seconds a wait lasts before (and between) checks of the links
UNREACHABLE_AFTER = 0.8  # seconds of unanswered data (or connect) before a host is unreachable
CLOSED = "closed"  # the peer's kernel reset or closed the link: its process is gone
UNREACHABLE = "unreachable"  # the peer's host answered nothing for UNREACHABLE_AFTER

Slot = tuple[int, int, str]  # (replica, coordinate, incarnation token)

_SIOCOUTQNSD = 0x894B  # Linux: bytes in the send queue not sent yet
_SILENT = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


def reason_of(error_number: int) -> str | None:
    """What a link's error says of its peer: :data:`UNREACHABLE` for silence (a timer
    ran out, no route), :data:`CLOSED` for any other error, None for no error."""
    if not error_number:
        return None
    return UNREACHABLE if error_number in _SILENT else CLOSED


def unacknowledged(sock: socket.socket) -> int:
    """How many bytes ``sock`` sent that its peer's kernel has not acknowledged yet: the
    send queue (``SIOCOUTQ``) less what it has not sent (``SIOCOUTQNSD``: a closed
    window holds bytes back while the peer's kernel answers); 0 where the system
    cannot tell."""
    try:
        import fcntl
        import termios
    except ImportError:  # not POSIX: the kernel's TCP_USER_TIMEOUT alone, where it has one
        return 0
    queued = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ on Linux
    if queued is None:
        return 0
    counts: list[int] = []
    for request in (queued, _SIOCOUTQNSD):
        try:
            counts.append(struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0])
        except OSError:
            counts.append(0)
    return max(0, counts[0] - counts[1])


@dataclass
class _Link:
    sock: socket.socket
    since: float  # when its connect began
    connected: bool = False
    unacknowledged_since: float | None = None  # when the oldest byte in flight was sent


@dataclass
class Links:
    """One slot's links to other slots, by :data:`Slot`; ``clock`` and ``unacknowledged``
    (bytes in flight on a socket) are for tests."""

    clock: Callable[[], float] = time.monotonic
    unacknowledged: Callable[[socket.socket], int] = unacknowledged
    _links: dict[Slot, _Link] = field(default_factory=dict)
    lost: dict[Slot, str] = field(default_factory=dict)  # final verdicts: slot -> reason

    def retarget(self, addresses: Mapping[Slot, str | None]) -> None:
        """Hold a link to each slot of ``addresses`` (``host:port``; None: none published,
        so closed) and to no other; links already held are kept."""
        for slot in [s for s in self._links if s not in addresses]:
            self._links.pop(slot).sock.close()
        for slot, address in addresses.items():
            if slot in self._links or slot in self.lost:
                continue
            if address is None:
                self.lost[slot] = CLOSED
                continue
            self._links[slot] = _Link(_connect(address), self.clock())

    def check(self, slot: Slot) -> str | None:
        """The verdict on ``slot`` (None: alive or not linked); sends one byte on its
        link, which its host's kernel acknowledges, whatever its process does."""
        if slot in self.lost:
            return self.lost[slot]
        link = self._links.get(slot)
        if link is None:
            return None
        reason = _state(link, self.clock(), self.unacknowledged)
        if reason is not None:
            self.lost[slot] = reason
            self._links.pop(slot).sock.close()
        return reason

    def check_all(self) -> dict[Slot, str]:
        """Every linked slot's verdict, the lost ones only."""
        for slot in list(self._links):
            self.check(slot)
        return {s: r for s, r in self.lost.items() if r}

    def linked(self, slot: Slot) -> bool:
        return slot in self._links

    def close(self) -> None:
        for link in self._links.values():
            link.sock.close()
        self._links.clear()


def _connect(address: str) -> socket.socket:
    """A non-blocking connect to ``host:port`` that gives up after UNREACHABLE_AFTER of
    unacknowledged data (Linux; elsewhere the pending connect's age decides alone)."""
    host, _, port = address.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        milliseconds = int(UNREACHABLE_AFTER * 1000)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(BlockingIOError, OSError):  # an error shows in SO_ERROR
        sock.connect((host, int(port)))
    return sock


def _state(link: _Link, now: float, unacknowledged: Callable[[socket.socket], int]) -> str | None:
    """A link's verdict now (None: alive, or no answer yet for less than the limit)."""
    sock = link.sock
    if not link.connected:
        _, writable, _ = select.select([], [sock], [], 0)
        if not writable:
            return UNREACHABLE if now - link.since > UNREACHABLE_AFTER else None
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            return reason_of(error) if error != errno.ECONNREFUSED else CLOSED
        link.connected = True
    if not unacknowledged(sock):
        link.unacknowledged_since = None
    elif link.unacknowledged_since is None:
        link.unacknowledged_since = now
    elif now - link.unacknowledged_since > UNREACHABLE_AFTER:
        return UNREACHABLE  # the peer's host acknowledged nothing for that long
    try:
        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
            return CLOSED  # the peer's kernel closed it: its process or listener is gone
    except BlockingIOError:
        pass
    except OSError as error:
        return reason_of(error.errno or errno.ECONNRESET)
    try:
        sock.send(b"\0", socket.MSG_DONTWAIT)
        if link.unacknowledged_since is None:
            link.unacknowledged_since = now
    except BlockingIOError:
        pass  # a full window: the peer's kernel still answers
    except OSError as error:
        return reason_of(error.errno or errno.EPIPE)
    return None


class WatchedGroup:
    """An epoch's dp group whose waits check the links: a wait that lasts longer than
    :data:`CHECK_EVERY` checks them every :data:`CHECK_EVERY`, and raises
    :class:`~scopedmesh.fault.state_transfer.CollectiveFailed` naming the lost member
    as soon as ``check`` names one (the collective is left to gloo's timeout, on a
    helper thread: destroying a group with a collective in flight would wait for it).

    Every other attribute is the group's own.
    """

    def __init__(self, inner: Any, check: Callable[[], str | None]) -> None:
        self._inner: Any = inner
        self._check = check
        self._works: list[Any] = []  # handed out and maybe still in flight

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise CollectiveFailed(f"this epoch's dp group was let go of (calling {name})")
        attribute = getattr(inner, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attribute(*args, **kwargs)
            if callable(getattr(result, "wait", None)) and callable(
                getattr(result, "is_completed", None)
            ):
                self._works = [w for w in self._works if not w.is_completed()] + [result]
                return _WatchedWork(result, self)
            return result

        return call

    def lost(self) -> str | None:
        """What ``check`` says now; on a loss, the group is let go of."""
        lost = self._check()
        if lost is not None:
            self.let_go()
        return lost

    def let_go(self) -> None:
        """Drop the group; a helper thread holds it until its collectives end (they fail
        at gloo's timeout), so that its destructor never waits on the caller's thread."""
        inner, self._inner = self._inner, None
        works, self._works = [w for w in self._works if not w.is_completed()], []
        if inner is None or not works:
            return
        held = [inner, works]
        del inner

        def hold() -> None:
            for work in held[1]:
                with contextlib.suppress(Exception):
                    work.wait()  # releases the GIL; ends at gloo's timeout at the latest
            held.clear()  # the queue is empty now: the destructor does not wait

        name = "scopedmesh-replicas-let-go"
        threading.Thread(target=hold, name=name, daemon=True).start()


class _WatchedWork:
    """A collective's work whose wait checks the group's links while it waits."""

    def __init__(self, work: Any, group: WatchedGroup) -> None:
        self._work, self._group = work, group

    def wait(self, timeout: timedelta | None = None) -> bool:
        work = self._work
        while True:
            try:
                return bool(work.wait(timedelta(seconds=CHECK_EVERY)))
            except Exception:
                if work.is_completed():  # it failed (gloo's own error), not merely still waits
                    raise
            lost = self._group.lost()
            if lost is not None:
                raise CollectiveFailed(lost)

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
