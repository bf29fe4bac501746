"""A held link's verdict: alive, unreachable or closed, from what the kernel says of it.

A link is one TCP connection to a peer's listener. Its peer's **kernel**
acknowledges every byte sent on it, whether or not the peer's process runs
(stopped, descheduled, computing), so a link tells a host cut off from the
network apart from a slow process: the peer is :data:`UNREACHABLE` only when
TCP's own acknowledgement state says so, that is, data sent on the link is
unacknowledged (``tcpi_unacked`` > 0) **and** no acknowledgement at all has
arrived for :data:`UNREACHABLE_AFTER` seconds (``tcpi_last_ack_recv``), while
that data was in flight. A byte in flight at every check is no sign of a cut:
a peer's delayed ACK (40 ms on Linux) plus a round trip of a few ms keeps one
in flight at every 50 ms check, and its ACKs still come. A connect unanswered
for :data:`UNREACHABLE_AFTER` is unreachable too; a reset or an end of file is
:data:`CLOSED` (the peer's process or listener is gone). A verdict is final.

:class:`Link` is that rule as a state machine with no socket, clock or thread:
the caller (``scopedmesh.fault.links``) hands it events (the connect's
outcome, each check's :class:`Acks` read from ``TCP_INFO``, each byte sent, a
socket error) with the time, and reads the verdict.

>>> link = Link(opened=0.0)
>>> link.connected(0.01), link.sent(0.01)  # a check sends a byte
('alive', 'alive')
>>> link.acks(0.06, Acks(unacked=1, silent_for=0.05))  # its ACK is late: no sign
'alive'
>>> link.sent(0.06), link.acks(0.90, Acks(unacked=1, silent_for=0.05))  # ACKs still come
('alive', 'alive')
>>> link.acks(1.70, Acks(unacked=1, silent_for=0.85))  # none for 0.85 s, data in flight
'unreachable'
>>> link.acks(1.75, Acks(unacked=0, silent_for=0.0))  # final
'unreachable'
"""

from __future__ import annotations

import errno
import math
from dataclasses import dataclass

from scopedmesh.errors import shown

__all__ = [
    "ALIVE",
    "CLOSED",
    "UNREACHABLE",
    "UNREACHABLE_AFTER",
    "Acks",
    "Link",
    "reason_of",
]

ALIVE = "alive"  # no verdict: the peer's kernel answers (or the connect is young)
CLOSED = "closed"  # the peer's kernel reset or closed the link: its process is gone
UNREACHABLE = "unreachable"  # the peer's host acknowledged nothing for UNREACHABLE_AFTER
UNREACHABLE_AFTER = 0.8  # seconds without an ACK while data is in flight (or of a connect)

_SILENT = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


def reason_of(error_number: int) -> str | None:
    """What a link's error says of its peer: :data:`UNREACHABLE` for silence (a timer
    ran out, no route), :data:`CLOSED` for any other error, None for no error.

    >>> reason_of(errno.ETIMEDOUT), reason_of(errno.ECONNRESET), reason_of(0)
    ('unreachable', 'closed', None)
    """
    if not error_number:
        return None
    return UNREACHABLE if error_number in _SILENT else CLOSED


@dataclass(frozen=True)
class Acks:
    """A link's acknowledgement state, as its kernel reports it (Linux ``TCP_INFO``):
    ``unacked`` segments sent and not acknowledged yet (``tcpi_unacked``), and
    ``silent_for`` seconds since the last acknowledgement arrived
    (``tcpi_last_ack_recv``, in ms there).

    >>> Acks(unacked=2, silent_for=0.04)
    Acks(unacked=2, silent_for=0.04)
    >>> Acks(unacked=-1, silent_for=0.0)
    Traceback (most recent call last):
    ...
    ValueError: unacked must be an int >= 0 (segments in flight), got -1
    """

    unacked: int
    silent_for: float

    def __post_init__(self) -> None:
        if isinstance(self.unacked, bool) or not isinstance(self.unacked, int):
            raise TypeError(
                f"unacked must be an int (segments in flight), got {shown(self.unacked)}"
            )
        if self.unacked < 0:
            raise ValueError(
                f"unacked must be an int >= 0 (segments in flight), got {self.unacked}"
            )
        _seconds(self.silent_for, "silent_for")


def _seconds(value: object, name: str) -> float:
    """``value`` as finite seconds >= 0, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {shown(value)}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite seconds >= 0, got {shown(value)}")
    return float(value)


class Link:
    """One link's verdict, from events: the connect began at ``opened`` (seconds, on
    the caller's clock); ``limit`` is :data:`UNREACHABLE_AFTER` unless a test says.

    Each method takes one event and returns the verdict after it: :data:`ALIVE`,
    :data:`UNREACHABLE` or :data:`CLOSED` (final once it is not alive).

    >>> link = Link(opened=5.0)
    >>> link.pending(5.5), link.pending(5.81)  # a connect no one answers
    ('alive', 'unreachable')
    >>> Link(opened=0.0).failed(errno.ECONNREFUSED)
    'closed'
    """

    def __init__(self, opened: float, *, limit: float = UNREACHABLE_AFTER) -> None:
        self._opened = _seconds(opened, "opened")
        self._limit = _seconds(limit, "limit")
        if self._limit == 0:
            raise ValueError("limit must be positive seconds, got 0")
        self._connected = False
        self._verdict = ALIVE
        # When the data in flight since the last check that found none was first sent.
        self._in_flight_since: float | None = None

    @property
    def verdict(self) -> str:
        """:data:`ALIVE`, :data:`UNREACHABLE` or :data:`CLOSED`."""
        return self._verdict

    @property
    def is_connected(self) -> bool:
        """Whether the connect completed (:meth:`connected`)."""
        return self._connected

    def pending(self, now: float) -> str:
        """The connect has not completed at ``now``: unreachable past the limit."""
        if self._verdict == ALIVE and _seconds(now, "now") - self._opened > self._limit:
            self._verdict = UNREACHABLE
        return self._verdict

    def connected(self, now: float) -> str:
        """The connect completed at ``now``."""
        _seconds(now, "now")
        self._connected = True
        return self._verdict

    def failed(self, error_number: int) -> str:
        """A socket error (``errno``; 0 is none): :func:`reason_of` decides."""
        if isinstance(error_number, bool) or not isinstance(error_number, int):
            raise TypeError(f"error_number must be an errno int, got {shown(error_number)}")
        reason = reason_of(error_number)
        if self._verdict == ALIVE and reason is not None:
            self._verdict = reason
        return self._verdict

    def ended(self) -> str:
        """The peer's kernel closed the link (an end of file): its process is gone."""
        if self._verdict == ALIVE:
            self._verdict = CLOSED
        return self._verdict

    def sent(self, now: float) -> str:
        """A byte was handed to the kernel at ``now`` (a check's probe)."""
        now = _seconds(now, "now")
        if self._in_flight_since is None:
            self._in_flight_since = now
        return self._verdict

    def acks(self, now: float, acks: Acks | None) -> str:
        """A check at ``now`` read the link's acknowledgement state (None: the system
        cannot tell, so only errors decide). Unreachable when data is in flight and
        no ACK arrived for the limit, counted from when that data was sent at the
        earliest: an idle link's old last ACK says nothing of a byte just sent."""
        now = _seconds(now, "now")
        if acks is not None and not isinstance(acks, Acks):
            raise TypeError(f"acks must be an Acks or None, got {shown(acks)}")
        if self._verdict != ALIVE or acks is None:
            return self._verdict
        if not self._connected:
            raise ValueError("acks: a check read TCP_INFO before the link connected")
        if acks.unacked == 0:
            self._in_flight_since = None
            return self._verdict
        if self._in_flight_since is None:  # data this machine was not told was sent
            self._in_flight_since = now
        if min(acks.silent_for, now - self._in_flight_since) > self._limit:
            self._verdict = UNREACHABLE
        return self._verdict
