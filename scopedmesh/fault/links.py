"""Held links to an epoch's other members: a host cut off from the network is lost within
about a second; a stopped, busy, slow or far process never is.

A refused connect tells a dead process (:mod:`~scopedmesh.fault.probes`), but a
host cut off from the network answers nothing at all: a connect to it, or a
collective with it, just waits. So each slot holds one TCP connection (a
**link**) to the listener of every other member of its epoch's dp group, and
while it waits for them (a collective of the epoch's group, a heal, a
formation) it checks each link every :data:`CHECK_EVERY` seconds and sends one
byte on it. The byte is acknowledged by the peer's **kernel**, whether or not
its process runs: a process that is stopped (SIGSTOP), descheduled or
computing keeps its links alive, however long.

The verdict is :class:`~scopedmesh.fault.protocol.link.Link`'s, from TCP's own
acknowledgement state read at each check (:func:`tcp_acks`, Linux
``TCP_INFO``): a link is **unreachable** when data sent on it is
unacknowledged and no ACK at all has arrived for :data:`UNREACHABLE_AFTER`
seconds (or its connect is unanswered that long); a byte merely in flight at
every check (a delayed ACK plus a round trip of a few ms) is no sign. A cut is
seen within ``UNREACHABLE_AFTER + CHECK_EVERY`` of the last ACK. The kernel
ends such a link by itself too (``TCP_USER_TIMEOUT``, the same limit, also
counted on acknowledgements), but only when a retransmission is due, which
may be seconds later on a loaded machine. Where ``TCP_INFO`` cannot be read
(not Linux), only the socket's errors decide: a cut is seen when the kernel
gives up on the link (its ``TCP_USER_TIMEOUT`` where it has one, else its
retransmission limit, minutes), never sooner, and a live peer is never lost.
A link reset or closed by the peer's kernel (its process ended, or closed its
listener) is **closed**: dead, as a refused probe. A verdict on an
incarnation is final.

Nothing is sent while no one waits: no thread, no store request, no traffic
in a step that does not stall. A wait on the group (:class:`WatchedGroup`)
never waits on gloo with a timeout of its own: a point-to-point operation
whose gloo wait times out is ended and its pair closed, so a late peer would
fail the catch-up. A collective's work wakes the wait through its future; a
point-to-point one's, which gloo completes only inside ``wait``, through the
group's helper thread, which waits on each from the moment it is posted (and
ends when none is left). A loss leaves that thread behind, and one that holds
the abandoned group, until gloo's timeout ends their operations.

>>> import errno
>>> reason_of(errno.ETIMEDOUT), reason_of(errno.EHOSTUNREACH), reason_of(errno.ECONNRESET)
('unreachable', 'unreachable', 'closed')
>>> reason_of(0) is None
True
"""

from __future__ import annotations

import collections
import contextlib
import errno
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from scopedmesh.fault.protocol.link import (
    ALIVE,
    CLOSED,
    UNREACHABLE,
    UNREACHABLE_AFTER,
    Acks,
    Link,
    reason_of,
)
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
    "tcp_acks",
    "unacknowledged",
]

CHECK_EVERY = 0.05  # seconds a wait lasts before (and between) checks of the links

Slot = tuple[int, int, str]  # (replica, coordinate, incarnation token)

_SIOCOUTQNSD = 0x894B  # Linux: bytes in the send queue not sent yet
# Linux's struct tcp_info (include/uapi/linux/tcp.h): 8 one-byte fields (tcpi_state,
# tcpi_ca_state, tcpi_retransmits, tcpi_probes, tcpi_backoff, tcpi_options, the window
# scales, two flags), then u32s from byte 8: tcpi_unacked at byte 24 (the 5th u32),
# tcpi_last_ack_recv at byte 56 (the 13th). tests/unit/test_links.py pins both.
_TCP_INFO = struct.Struct("=8B13I")
_UNACKED, _LAST_ACK_RECV = 8 + 4, 8 + 12  # indices in _TCP_INFO's tuple


def tcp_acks(sock: socket.socket) -> Acks | None:
    """``sock``'s acknowledgement state from Linux's ``TCP_INFO``: segments in flight
    (``tcpi_unacked``) and seconds since the last ACK (``tcpi_last_ack_recv``); None
    where the system has no ``TCP_INFO`` in that layout (not Linux) or cannot say."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or not sys.platform.startswith("linux"):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO.size)
    except OSError:
        return None
    if len(raw) < _TCP_INFO.size:
        return None
    fields = _TCP_INFO.unpack(raw[: _TCP_INFO.size])
    return Acks(unacked=fields[_UNACKED], silent_for=fields[_LAST_ACK_RECV] / 1000)


def unacknowledged(sock: socket.socket) -> int:
    """How many bytes ``sock`` sent that its peer's kernel has not acknowledged yet: the
    send queue (``SIOCOUTQ``) less what it has not sent (``SIOCOUTQNSD``: a closed
    window holds bytes back while the peer's kernel answers); 0 where the system
    cannot tell. (Bytes in flight are no verdict by themselves: :func:`tcp_acks`.)"""
    try:
        import fcntl
        import termios
    except ImportError:  # not POSIX
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
class _Held:
    sock: socket.socket
    link: Link  # the verdict's state machine


@dataclass
class Links:
    """One slot's links to other slots, by :data:`Slot`; ``clock`` and ``acks`` (a
    socket's acknowledgement state, :func:`tcp_acks`) are for tests."""

    clock: Callable[[], float] = time.monotonic
    acks: Callable[[socket.socket], Acks | None] = tcp_acks
    _links: dict[Slot, _Held] = field(default_factory=dict)
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
            self._links[slot] = _Held(_connect(address), Link(self.clock()))

    def check(self, slot: Slot) -> str | None:
        """The verdict on ``slot`` (None: alive or not linked); sends one byte on its
        link, which its host's kernel acknowledges, whatever its process does."""
        if slot in self.lost:
            return self.lost[slot]
        held = self._links.get(slot)
        if held is None:
            return None
        verdict = _check(held, self.clock(), self.acks)
        if verdict == ALIVE:
            return None
        self.lost[slot] = verdict
        self._links.pop(slot).sock.close()
        return verdict

    def check_all(self) -> dict[Slot, str]:
        """Every linked slot's verdict, the lost ones only."""
        for slot in list(self._links):
            self.check(slot)
        return {s: r for s, r in self.lost.items() if r}

    def linked(self, slot: Slot) -> bool:
        return slot in self._links

    def close(self) -> None:
        for held in self._links.values():
            held.sock.close()
        self._links.clear()


def _connect(address: str) -> socket.socket:
    """A non-blocking connect to ``host:port`` that the kernel ends once data stays
    unacknowledged for UNREACHABLE_AFTER (``TCP_USER_TIMEOUT``, Linux)."""
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


def _check(held: _Held, now: float, acks: Callable[[socket.socket], Acks | None]) -> str:
    """One check of a link at ``now``: its events handed to its machine, then one byte
    sent (the next check's evidence); the verdict."""
    sock, link = held.sock, held.link
    if not link.is_connected:
        _, writable, _ = select.select([], [sock], [], 0)
        if not writable:
            return link.pending(now)
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            return link.failed(error)
        link.connected(now)
    if link.acks(now, acks(sock)) != ALIVE:
        return link.verdict
    try:
        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
            return link.ended()  # the peer's kernel closed it: its process or listener is gone
    except BlockingIOError:
        pass
    except OSError as error:
        return link.failed(error.errno or errno.ECONNRESET)
    try:
        sock.send(b"\0", socket.MSG_DONTWAIT)
    except BlockingIOError:
        return link.verdict  # a full window: the peer's kernel still answers
    except OSError as error:
        return link.failed(error.errno or errno.EPIPE)
    return link.sent(now)


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
        # Handed out and maybe still in flight; they hold no reference to this group (a
        # dropped group must go at once: its peers' operations fail when it does).
        self._works: list[_Operation] = []
        self._waiter = _Waiter()  # waits on its point-to-point operations as they are posted

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
                operation = _Operation(result, self._waiter, name in _POINT_TO_POINT)
                self._works = [w for w in self._works if not w.is_completed()] + [operation]
                return _WatchedWork(operation, self, _what(name, args))
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
                work.settle()  # releases the GIL; ends at gloo's timeout at the latest
            held.clear()  # the queue is empty now: the destructor does not wait

        name = "scopedmesh-replicas-let-go"
        threading.Thread(target=hold, name=name, daemon=True).start()


def _what(name: str, args: tuple[Any, ...]) -> str:
    """An operation of the group, for an error: ``recv from member 1``, ``allreduce``.

    >>> _what("recv", ([], 1, 0)), _what("send", ([], 2, 0)), _what("allreduce", ([],))
    ('recv from member 1', 'send to member 2', 'allreduce')
    """
    if name in ("send", "recv") and len(args) > 1 and isinstance(args[1], int):
        return f"{name} {'to' if name == 'send' else 'from'} member {args[1]}"
    return name


class _WatchedWork:
    """An operation's work whose wait checks the group's links while it waits."""

    def __init__(self, operation: _Operation, group: WatchedGroup, what: str) -> None:
        self._operation, self._group, self._what = operation, group, what

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait until the operation completes (its own answer: gloo's error if it
        failed), checking the links every :data:`CHECK_EVERY` seconds; never a gloo
        wait with a timeout (a late peer must not close the pair).

        ``timeout`` (None or 0: none, as torch's default) bounds the wait: past it,
        :class:`~scopedmesh.fault.state_transfer.CollectiveFailed` names the
        operation, and the group is let go of (its operation still in flight).
        """
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
        operation = self._operation
        start = time.monotonic()
        limit = None if timeout is None or timeout <= timedelta(0) else timeout.total_seconds()
        while not operation.ended(CHECK_EVERY if limit is None else min(CHECK_EVERY, limit)):
            operation.hurry()  # still queued behind another: a thread of its own
            lost = self._group.lost()
            if lost is not None:
                raise CollectiveFailed(lost)
            if limit is not None and time.monotonic() - start >= limit:
                self._group.let_go()
                raise CollectiveFailed(
                    f"waited {limit:g} s for {self._what} on this epoch's dp group "
                    f"(the peers' links are alive: a peer is late or never posted its side)"
                )
        return operation.answer()

    def is_completed(self) -> bool:
        """Whether the operation ended (a point-to-point one: once a wait saw it end)."""
        return self._operation.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._operation.work, name)


class _Operation:
    """One operation's work, and an event set once it ended, without a timed wait.

    A collective's gloo work has a future, whose callback sets the event. A
    point-to-point operation's has none and completes only inside its ``wait``
    (a second ``wait`` waits for another message), and a ``wait`` with a
    timeout that runs out closes gloo's pair to the peer: so the group's
    :class:`_Waiter` waits on it, once and without a timeout of its own (gloo's
    ends it), from the moment it is posted, and keeps its answer.
    """

    def __init__(self, work: Any, waiter: _Waiter, point_to_point: bool) -> None:
        self.work, self._waiter = work, waiter
        self._ended = threading.Event()
        self._answer: list[Any] = []  # a helper thread's: True/False, or the error raised
        future = None if point_to_point else _future_of(work)
        if future is not None:
            ended = self._ended  # the callback holds the event alone: no cycle through it
            future.add_done_callback(lambda _: ended.set())
        else:
            waiter.post(self)

    def ended(self, seconds: float) -> bool:
        """Whether the operation ended, waiting up to ``seconds`` for it (woken at once)."""
        return self._ended.wait(seconds)

    def hurry(self) -> None:
        """Wait on this operation on a thread of its own if the group's waiter has not
        begun to (it waits in posting order, and an earlier operation may wait on one
        this caller has yet to make possible)."""
        if self._waiter.claim(self):
            _start(self.wait_once)

    def wait_once(self) -> None:
        """A helper thread's one wait on the work (gloo's timeout ends it at the latest)."""
        try:
            self._answer.append(bool(self.work.wait()))
        except Exception as error:  # raised again on the caller's thread by answer()
            self._answer.append(error)
        finally:
            self._ended.set()

    def answer(self) -> bool:
        """The ended operation's answer, or its error raised here."""
        if not self._answer:
            return bool(self.work.wait())  # a collective that completed: at once
        answer = self._answer[0]
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    def is_completed(self) -> bool:
        return self._ended.is_set() or bool(self.work.is_completed())

    def settle(self) -> None:
        """Wait until the operation ends, however it ends (gloo's timeout at the latest)."""
        self._ended.wait()


class _Waiter:
    """A group's helper thread, while it has point-to-point operations in flight: it
    waits on each, in the order they were posted, from the moment they are posted
    (a catch-up's many sends and receives end back to back; each caller's wait
    finds its own ended), and ends when none is left."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[_Operation] = collections.deque()
        self._running = False

    def post(self, operation: _Operation) -> None:
        with self._lock:
            self._queue.append(operation)
            if self._running:
                return
            self._running = True
        _start(self._run)

    def claim(self, operation: _Operation) -> bool:
        """Take ``operation`` off the queue if this thread has not begun to wait on it."""
        with self._lock:
            if operation not in self._queue:
                return False
            self._queue.remove(operation)
            return True

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                operation = self._queue.popleft()
            operation.wait_once()


_POINT_TO_POINT = frozenset({"send", "recv", "recv_anysource"})  # gloo: no future


def _start(target: Callable[[], None]) -> None:
    threading.Thread(target=target, name="scopedmesh-links-wait", daemon=True).start()


def _future_of(work: Any) -> Any:
    """``work``'s future, or None where it has none (gloo's point-to-point works)."""
    get_future = getattr(work, "get_future", None)
    if get_future is None:
        return None
    try:
        return get_future()
    except RuntimeError:  # this work type implements no future
        return None
