"""The formation barrier: every member of a new group leaves it together, each woken once.

gloo's connectFullMesh can return on one member before a slower member has
finished its side of the handshake; a group destroyed in that window (say, a
mesh closed without using it) breaks the slower member's formation with
'Connection closed by peer' or 'Connect timeout'. Counting arrivals in the
store ends formation together on every member, as torch does only under
``TORCH_DIST_INIT_BARRIER=1``.

**Released.** Each member arrives with one ``add`` on ``<name>/formed``. The
one that brings the count to ``size`` arrives last: it sets
``<name>/all-formed`` to 0 (the release) and deletes the counter. Every other
member waits for the release in **one** server-side ``wait`` for the group's
whole timeout (no slices, no polling: the release wakes them all, as a death
wakes a liveness watch's members), then counts its departure on the release
key itself; the one that brings it to ``size - 1`` is the last reader, and
deletes it. Store requests per formation of ``n > 1`` members: ``3n + 1``
here (arrivals ``n``, release 1, the counter's delete 1, waits ``n - 1``,
departures ``n - 1``, the release's delete 1), at most 4 per member.

**Stopped.** A wait that must end early (the member's mesh was aborted: a
member died, or a step raised) is ended by a write, never found by a poll.
Whoever aborts the mesh wakes its barrier (``Stop.subscribe``); the barrier
then *stops* the incarnation for every member (from a short-lived thread, over
a cloned client: the waiter's wait holds its own): it adds :data:`STOPPED` (a
large negative number) to the arrival counter, so that no arrival can ever
complete it, and, unless every member had arrived already (the release
stands then), writes why (:func:`~scopedmesh.c10d.store.formation_stop_key`)
and sets the release key to :data:`STOPPED`. The release key is written once,
to one verdict, so the members agree: a waiter's departure ``add`` returns a
negative number, and a late arrival's ``add`` does, and each raises. A member
that knows at its arrival that it must stop stops the barrier in the same way
instead of arriving. A stopped barrier leaves its three keys in the store (a
member may still be on its way to read them).

>>> STOPPED < -(1 << 30)
True
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Any

from torch.distributed import distributed_c10d as c10d

from scopedmesh.c10d.diagnosis import SLICE, Stop
from scopedmesh.c10d.store import formation_keys, formation_stop_key, read, wait_timed_out
from scopedmesh.errors import GroupFormationError

STOPPED = -(1 << 40)  # added to the arrival counter and set as the release: the barrier stopped
_ARRIVALS = 1 << 40  # arrivals are the counter modulo this (stops add STOPPED, a multiple)

__all__ = ["STOPPED", "all_formed"]


def all_formed(
    store: c10d.Store,
    name: str,
    size: int,
    timeout: timedelta,
    own: list[str],
    stop: Stop | None = None,
) -> None:
    """Return once every member has finished forming incarnation ``name``; leave no key behind.

    ``own`` are the keys this member wrote for the incarnation (its gloo
    address): deleted once released, or once stopped or timed out. ``stop``
    says why to stop (see the module's docstring). One ``wait`` without
    ``stop``, or with its ``subscribe``; a ``stop`` that has something to watch
    (a liveness watch, an abort) but no ``subscribe`` is asked in slices of
    :data:`~scopedmesh.c10d.diagnosis.SLICE` instead (its caller cannot wake the wait).
    """
    if size > 1:
        _Barrier(store, name, size, stop).join(timeout, own)  # deletes ``own`` if it raises
    for key in own:
        store.delete_key(key)


class _Barrier:
    """One member's view of one barrier: its keys, and whether its wait has ended."""

    def __init__(self, store: c10d.Store, name: str, size: int, stop: Stop | None) -> None:
        self.store, self.name, self.size, self.stop = store, name, size, stop
        self.formed, self.released = formation_keys(name)
        self.lock = threading.Lock()  # the member's own steps against an abort's stop
        self.arrived = False  # this member's arrival is counted
        self.ended = False  # its wait has ended, or a stop has been written for it

    def join(self, timeout: timedelta, own: list[str]) -> None:
        """Arrive, then wait for the release (unless last); raise if stopped or timed out."""
        subscribe = self.stop.subscribe if self.stop is not None else None
        unsubscribe = subscribe(self.wake) if subscribe is not None else None
        try:
            if self._arrive():
                return
            if not self._wait(timeout, woken=unsubscribe is not None or not self._watched()):
                raise GroupFormationError(
                    f"could not form {self._group()} within {timeout}: every member connected, "
                    "but not every member arrived at the formation barrier after it (a member "
                    "died or stopped between the two)"
                )
            departures = self.store.add(self.released, 1)
            if departures < 0:
                raise self._stopped_error()
            if departures == self.size - 1:  # the last of those that waited to leave
                self.store.delete_key(self.released)
        except Exception:
            with contextlib.suppress(RuntimeError):  # the store may be what failed
                for key in own:
                    self.store.delete_key(key)
            raise
        finally:
            if unsubscribe is not None:
                unsubscribe()

    def _arrive(self) -> bool:
        """Count this member's arrival; True if it was the last (it releases the others).
        Raises instead if the barrier is stopped, stopping it first if this member must."""
        with self.lock:
            if self.ended:  # an abort stopped it already (``wake``)
                raise self._stopped_error()
            early = self.stop.why() if self.stop is not None else None
            if early is not None:  # stop the others too, at once
                self.ended = True
                self._halt(self.store, str(early), arrived=False)
                raise early
            arrivals = self.store.add(self.formed, 1)
            self.arrived = True
            if arrivals < 0:  # stopped by another member before this one arrived
                self.ended = True
                raise self._stopped_error()
            if arrivals < self.size:
                return False
            self.ended = True  # the last to arrive: nobody waits for it
        self.store.set(self.released, "0")
        self.store.delete_key(self.formed)
        return True

    def _watched(self) -> bool:
        """Whether there is something to stop for (a liveness watch, an abort)."""
        return self.stop is not None and (
            self.stop.liveness is not None or self.stop.aborted is not None
        )

    def _wait(self, timeout: timedelta, *, woken: bool) -> bool:
        """One ``wait`` for the release (``woken``: whatever must end it writes the key), else
        watched slices. False at the timeout. A stop written meanwhile is the key's verdict: the
        release key is written once, to one verdict, whoever wakes first."""
        try:
            if not woken and self.stop is not None:
                deadline = time.monotonic() + timeout.total_seconds()
                return self.stop.wait(self.store, [self.released], deadline, SLICE)
            start = time.monotonic()
            try:
                self.store.wait([self.released], timeout)
            except RuntimeError as error:
                if wait_timed_out(error, time.monotonic() - start, timeout.total_seconds()):
                    return False
                raise
            return True
        finally:
            with self.lock:  # from here on an abort writes no stop for this member
                self.ended = True

    def wake(self) -> None:
        """Stop the barrier now, from any thread (an abort's): unless this member's wait has
        ended, every member's wait ends. Returns at once: the store is written from a thread
        of its own, over a client of its own (the waiter's wait holds this member's; a new
        connection can take seconds where the store host's DNS is slow). Never raises."""
        with self.lock:
            if self.ended:
                return
            self.ended = True
            # Not Stop.why(): naming a lost member reads the store through the client the
            # waiter's wait holds. The waiters name it themselves once woken.
            aborted = self.stop.aborted if self.stop is not None else None
            reason = f"its mesh was aborted ({aborted()})" if aborted is not None else "stopped"
            arrived = self.arrived
        threading.Thread(
            target=self._halt_aside,
            args=(reason, arrived),
            name="scopedmesh-barrier-stop",
            daemon=True,
        ).start()

    def _halt_aside(self, reason: str, arrived: bool) -> None:
        with contextlib.suppress(RuntimeError):  # the store is gone: the waits time out
            self._halt(_side_client(self.store), reason, arrived=arrived)

    def _halt(self, store: c10d.Store, reason: str, *, arrived: bool) -> None:
        """Stop the incarnation for every member unless all have arrived (it is released);
        ``arrived``: this member's arrival is counted."""
        arrivals = store.add(self.formed, STOPPED) % _ARRIVALS
        if arrived and arrivals == 0:  # the counter was gone (the release deleted it)
            store.delete_key(self.formed)  # the add made it again
            return
        if arrivals >= self.size:  # every member arrived: the release stands
            return
        rank = self.stop.rank if self.stop is not None else -1
        store.set(formation_stop_key(self.name), f"rank {rank} stopped it: {reason}")
        store.set(self.released, str(STOPPED))  # a set wakes every waiter, on every store

    def _stopped_error(self) -> RuntimeError:
        """This member's own reason to stop, else the stopper's (read from the store)."""
        own = self.stop.why() if self.stop is not None else None
        if own is not None:
            return own
        try:
            told = read(self.store, formation_stop_key(self.name)) or "no reason was left"
        except RuntimeError as error:
            told = f"its reason could not be read ({error})"
        return GroupFormationError(f"could not form {self._group()}: {told}")

    def _group(self) -> str:
        return self.stop.group if self.stop is not None else f"incarnation {self.name!r}"


def _side_client(store: c10d.Store) -> c10d.Store:
    """A client for a thread other than the waiter's, whose wait holds ``store``'s connection:
    a clone, or ``store`` itself where it cannot clone (an in-process store serves both)."""
    clone: Any = getattr(store, "clone", None)
    try:
        cloned: c10d.Store = clone()
    except (RuntimeError, TypeError):
        return store
    return cloned
