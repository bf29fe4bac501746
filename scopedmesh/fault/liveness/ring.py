"""The socket ring: each member listens, and links to its successor among those still alive.

The rule: **a rank is alive while its process holds its sockets open.** A
SIGKILLed process's sockets are closed by the kernel at once, so the peer
holding a TCP connection to it reads end-of-file within milliseconds; a rank
that is stopped, descheduled or busy keeps its sockets open and is never
declared lost. A host that vanishes without closing anything is found by the
kernel's keepalive probes within :data:`UNREACHABLE_AFTER` seconds.

A :class:`Ring` owns one member's sockets: its listener, the connections its
predecessors opened to it, its link to its successor, and a wake-up pair for
the thread that reads them. End-of-file without a goodbye (``B``) is a death,
declared in the :class:`~scopedmesh.fault.liveness.deaths.DeathRecord`; then
the ring links to the next member alive, so a second death is seen too.

>>> import errno
>>> reason_of(ConnectionRefusedError(errno.ECONNREFUSED, "refused")), reason_of(TimeoutError())
('closed', 'unreachable')
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from scopedmesh.c10d.store import WatchKeys, read
from scopedmesh.fault.liveness.deaths import CLOSED, UNREACHABLE, DeathRecord, parse_deaths

__all__ = [
    "CONNECT_SLICE",
    "KEEPALIVE_IDLE",
    "KEEPALIVE_PROBES",
    "UNREACHABLE_AFTER",
    "Ring",
    "keep_alive",
    "reason_of",
    "route_address",
]

KEEPALIVE_IDLE = 1  # seconds a ring connection is quiet before the kernel probes the peer's host
KEEPALIVE_PROBES = 2  # unanswered probes, one a second, before the connection fails
UNREACHABLE_AFTER = KEEPALIVE_IDLE + KEEPALIVE_PROBES  # seconds: a host silent this long is lost
CONNECT_SLICE = 0.5  # seconds a ring connection attempt waits before the store is read again


def route_address() -> str:
    """This host's address on the route to ``MASTER_ADDR`` (127.0.0.1 without one); no traffic."""
    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # UDP connect picks a route, sends nothing
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return "127.0.0.1"


def keep_alive(sock: socket.socket) -> socket.socket:
    """Have the kernel probe ``sock``'s peer host: a silent host fails it in about 3 s.

    The peer's kernel answers the probes, so a stopped or busy process stays
    alive; only a host that vanished from the network (a partition, a power
    cut) stops answering.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return sock


def reason_of(error: OSError) -> str:
    """Why a connection failed: UNREACHABLE for silence (keepalive, connect), else CLOSED."""
    silent = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)
    return UNREACHABLE if isinstance(error, TimeoutError) or error.errno in silent else CLOSED


class Ring:
    """One member's sockets in the ring of ``ranks`` (sorted global ranks).

    ``store`` is the client the watch's thread uses (never the caller's);
    ``record`` is where deaths are declared and learned; ``report`` is told
    of a failure the thread survives (what happened, the error).
    """

    def __init__(
        self,
        rank: int,
        ranks: tuple[int, ...],
        keys: WatchKeys,
        *,
        host: str | None,
        timeout: timedelta,
        record: DeathRecord,
        report: Callable[[str, BaseException], None],
    ) -> None:
        self.rank, self.ranks, self.keys, self.timeout = rank, ranks, keys, timeout
        self.record, self.report = record, report
        self.store: Any = None  # the thread's client, set by the watch
        self.relink_due: float | None = None  # since when a relink waits for the store
        self.relink_failed = False  # whether this relink's first store error was reported
        self.listener = socket.create_server((host or route_address(), 0), backlog=len(ranks))
        self.wake_r, self.wake_w = socket.socketpair()
        self.peers: dict[socket.socket, list[Any]] = {}  # socket -> [rank or None, buffer]
        self.succ: tuple[int, socket.socket] | None = None
        self.left: set[int] = set()

    def join(self, store: Any) -> None:
        """Publish this rank's address, then link to its successor once it has published."""
        address = "{}:{}".format(*self.listener.getsockname()[:2])
        store.set(self.keys.addr(self.rank), address)
        successor = self.next_after(self.rank)
        if successor is None:
            return
        try:
            store.wait([self.keys.addr(successor)], self.timeout)
        except Exception as error:
            raise TimeoutError(
                f"liveness watch: rank {successor} (this rank's successor) published no "
                f"address within {self.timeout.total_seconds():g} s; start a LivenessWatch "
                f"on every rank of {list(self.ranks)}, in the same order"
            ) from error
        host, port = store.get(self.keys.addr(successor)).decode().rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=self.timeout.total_seconds())
        keep_alive(conn).sendall(f"H{self.rank}\n".encode())
        self.succ = (successor, conn)

    def next_after(self, rank: int) -> int | None:
        """The member after ``rank`` in ring order that is not known dead or gone, or None."""
        order = self.ranks
        start = order.index(rank)
        for step in range(1, len(order)):
            candidate = order[(start + step) % len(order)]
            if candidate == self.rank:
                return None
            if candidate not in self.record.lost and candidate not in self.left:
                return candidate
        return None

    def relink(self) -> None:
        """Watch the next alive member after this one (thread only).

        A store error on the way is survived: the link is tried again every
        interval; the first error of a relink is reported (it goes on), and again
        once it has failed for the watch's ``timeout``.
        """
        if self.succ is not None:
            self.succ[1].close()
        self.succ = None
        first = self.relink_due if self.relink_due is not None else time.monotonic()
        try:
            self._link_next()
            self.relink_due, self.relink_failed = None, False
        except OSError:
            raise
        except Exception as error:  # the store: try again next interval
            if not self.relink_failed:
                self.report("failed while relinking the ring (it goes on)", error)
            self.relink_due, self.relink_failed = first, True
            if time.monotonic() - first >= self.timeout.total_seconds():
                self.report("could not relink the ring, the store failing", error)

    def _link_next(self) -> None:
        candidate = self.next_after(self.rank)
        while candidate is not None:
            address = read(self.store, self.keys.addr(candidate))
            if address is None:
                self.left.add(candidate)  # closed its watch cleanly
            else:
                conn = None
                try:
                    conn = self._connect(candidate, address)
                    if conn is not None:
                        conn.sendall(f"H{self.rank}\n".encode())
                        self.succ, conn = (candidate, conn), None
                        return
                except OSError as error:  # refused (nobody listens there), or no answer
                    if self.store.check([self.keys.addr(candidate)]):
                        self.record.declare(self.store, candidate, reason_of(error))
                    else:
                        self.left.add(candidate)
                finally:
                    if conn is not None:
                        conn.close()
            candidate = self.next_after(self.rank)

    def _connect(self, rank: int, address: str) -> socket.socket | None:
        """A ring connection to ``rank`` at ``address`` (``host:port``); None once it is lost.

        A silent host is retried in slices of :data:`CONNECT_SLICE` seconds,
        learning the store's deaths in between, so that the thread is never
        blind to them for long; the last error is raised after
        :data:`UNREACHABLE_AFTER` seconds of silence.
        """
        host, port = address.rsplit(":", 1)
        give_up = time.monotonic() + UNREACHABLE_AFTER
        while True:
            try:
                conn = socket.create_connection((host, int(port)), timeout=CONNECT_SLICE)
                return keep_alive(conn)
            except TimeoutError:
                if time.monotonic() >= give_up:
                    raise
            self.record.learn(parse_deaths(read(self.store, self.keys.lost) or ""))
            if rank in self.record.lost:
                return None

    def select(self, selector: selectors.BaseSelector, wait: float | None) -> list[Any]:
        """The sockets readable within ``wait`` seconds (None: no limit), the selector kept
        to the live set."""
        watched: set[Any] = {self.listener, self.wake_r, *self.peers}
        if self.succ is not None:
            watched.add(self.succ[1])
        for key in list(selector.get_map().values()):
            if key.fileobj not in watched:
                selector.unregister(key.fileobj)  # closed ones too: found by object
        registered = {key.fileobj for key in selector.get_map().values()}
        for sock in watched.difference(registered):
            selector.register(sock, selectors.EVENT_READ)
        return [key.fileobj for key, _ in selector.select(wait)]

    def on_readable(self, sock: socket.socket) -> None:
        """Read ``sock``: accept a predecessor, note who it is, or declare its end a death."""
        if sock is self.listener:
            conn, _ = sock.accept()
            self.peers[keep_alive(conn)] = [None, b""]
            return
        reason = CLOSED
        try:
            data = sock.recv(256)
        except OSError as error:
            data, reason = b"", reason_of(error)
        link = self.succ
        succ = link is not None and sock is link[1]
        if link is not None and succ:
            rank: int | None = link[0]
            said_bye = b"B" in data
        else:
            entry = self.peers[sock]
            entry[1] += data
            *lines, entry[1] = entry[1].split(b"\n")
            for line in lines:
                if line.startswith(b"H"):
                    entry[0] = int(line[1:])
            rank, said_bye = entry[0], b"B" in entry[1] or any(line == b"B" for line in lines)
        if data and not said_bye:
            return
        sock.close()
        if succ:  # relinked below, or (the store failing) at the next interval
            self.succ = None
            self.relink_due = self.relink_due or time.monotonic()
        else:
            del self.peers[sock]
        if rank is not None:
            if said_bye or not self.store.check([self.keys.addr(rank)]):
                self.left.add(rank)
            else:
                self.record.declare(self.store, rank, reason)
        if succ:
            self.relink()

    def wake(self) -> None:
        """Wake the thread that reads the ring, so that it stops."""
        with contextlib.suppress(OSError):
            self.wake_w.send(b"x")

    def nudge(self) -> None:
        """Wake the thread that reads the ring, so that it looks at its work (it goes on)."""
        with contextlib.suppress(OSError):
            self.wake_w.send(b"n")

    def woken_to_stop(self) -> bool:
        """Read the wake-up pair: whether :meth:`wake` (not only :meth:`nudge`) was called."""
        try:
            return b"x" in self.wake_r.recv(4096)
        except OSError:
            return True

    def shut(self, *, goodbye: bool) -> None:
        """Close every socket; with ``goodbye``, tell the peers this rank left (not died)."""
        socks = [*self.peers, *([self.succ[1]] if self.succ is not None else [])]
        for sock in socks:
            with contextlib.suppress(OSError):
                if goodbye:
                    sock.sendall(b"B\n")
                sock.close()
        self.peers.clear()
        self.succ = None
        for sock in (self.listener, self.wake_r, self.wake_w):
            sock.close()
