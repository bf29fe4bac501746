"""The formation barrier: each waiter is woken once, by the release or by an abort.

Threads stand for the members of one incarnation (scopedmesh.c10d.barrier), over one
torch ``HashStore``, each through a client of its own that runs one request at a time
(a wait holds it, as a ``TCPStore`` client's does); each member holds a real
``GroupTable`` (what a mesh's formation subscribes to) and counts its own requests.
Counts and agreement are asserted, never times: a release that comes late (past the
old 0.5 s grace) still costs one ``wait``; an abort of one member's table ends every
member's wait, with one ``wait`` each, even while a member's death is known (naming it
reads the store); an abort racing the last arrival leaves every member the same verdict.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import HashStore

from scopedmesh.c10d.barrier import STOPPED, all_formed
from scopedmesh.c10d.diagnosis import Stop
from scopedmesh.c10d.store import formation_keys, formation_stop_key
from scopedmesh.errors import GroupFormationError, MeshClosedError
from scopedmesh.mesh.group_table import GroupTable

TIMEOUT = timedelta(seconds=20)  # never reached: a member that waited it out fails the test


class _Client:
    """One member's client of the shared store: one request at a time, counted by kind."""

    def __init__(self, store: HashStore, linger: dict[str, float]) -> None:
        self.store, self.kinds, self.linger = store, Counter[str](), linger
        self.busy = threading.Lock()  # held for a request's whole length, a wait's too

    def clone(self) -> _Client:
        return _Client(self.store, {})

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any) -> Any:
            with self.busy:
                self.kinds[method] += 1
                result = getattr(self.store, method)(*args)
            time.sleep(self.linger.get(method, 0.0))  # descheduled as the request returns
            return result

        return call


class _Lost:
    """A liveness watch's answers: the ranks in ``dead`` have died."""

    def __init__(self) -> None:
        self.dead: set[int] = set()

    @property
    def ranks(self) -> tuple[int, ...]:
        return ()

    def why_lost(self, rank: int) -> str | None:
        return "has died (the test says so)" if rank in self.dead else None


def _run(
    size: int,
    delays: list[float | None],
    abort_at: tuple[int, float] | None = None,
    linger: dict[int, dict[str, float]] | None = None,
) -> tuple[list[Any], list[Counter[str]], HashStore, str]:
    """Each member arrives after its delay (None: it has died, and never does);
    ``abort_at``: (member, seconds) its table is aborted then, the dead known lost;
    ``linger[member][kind]``: that member's requests of that kind return so many seconds
    late. Returns each member's outcome (None: formed, else its error) and counts."""
    store = HashStore()
    name = f"scopedmesh-barrier-{random.random()}"
    tables = [GroupTable() for _ in range(size)]
    clients = [_Client(store, (linger or {}).get(r, {})) for r in range(size)]
    outcomes: list[Any] = ["never ended"] * size
    lost = _Lost()

    def member(r: int, delay: float) -> None:
        table = tables[r]
        stop = Stop(clients[r], "the test group", range(size), r, lost, table._why_aborted)  # type: ignore[arg-type]
        stop.subscribe = table.on_abort
        time.sleep(delay)
        try:
            all_formed(clients[r], name, size, TIMEOUT, [], stop)  # type: ignore[arg-type]
            outcomes[r] = None
        except Exception as error:  # the outcome under test
            outcomes[r] = error

    threads = [
        threading.Thread(target=member, args=(r, delay))
        for r, delay in enumerate(delays)
        if delay is not None
    ]
    for thread in threads:
        thread.start()
    if abort_at is not None:
        time.sleep(abort_at[1])
        lost.dead.update(r for r, delay in enumerate(delays) if delay is None)
        tables[abort_at[0]].abort("by the test")
    for thread in threads:
        thread.join(TIMEOUT.total_seconds() + 5)
    return outcomes, [c.kinds for c in clients], store, name


def test_a_late_release_wakes_each_waiter_once_and_leaves_no_key() -> None:
    size = 6
    outcomes, kinds, store, _ = _run(size, [0.0] * (size - 1) + [0.7])  # past the 0.5 s grace
    assert outcomes == [None] * size
    assert [k["wait"] for k in kinds] == [1] * (size - 1) + [0]
    assert sum(sum(k.values()) for k in kinds) == 3 * size + 1
    assert store.num_keys() == 0


def test_an_abort_of_one_member_ends_every_wait_at_once_with_its_reason() -> None:
    size = 6
    # Members 0..3 wait; 4 and 5 have died: only member 1's abort can end the waits.
    outcomes, kinds, store, name = _run(size, [0.0] * 4 + [None, None], abort_at=(1, 0.3))
    for r in range(4):  # each names a dead member itself (its own liveness)
        assert isinstance(outcomes[r], GroupFormationError), outcomes
        assert "rank 4 has died" in str(outcomes[r]), outcomes
    assert [k["wait"] for k in kinds] == [1, 1, 1, 1, 0, 0]
    formed, released = formation_keys(name)
    # Stopped: the release says so, and no arrival can complete the counter any more.
    assert STOPPED <= int(store.get(released)) < STOPPED + size and int(store.get(formed)) < 0
    assert "rank 1 stopped it" in store.get(formation_stop_key(name)).decode()


@pytest.mark.fault  # a slow lane: 0.4 s
def test_a_member_that_arrives_after_a_stop_never_waits() -> None:
    outcomes, kinds, _, _ = _run(3, [0.0, 0.0, 0.4], abort_at=(0, 0.2))
    assert isinstance(outcomes[0], MeshClosedError), outcomes  # its own mesh's abort
    for r in (1, 2):
        assert isinstance(outcomes[r], GroupFormationError), outcomes
        assert "rank 0 stopped it: its mesh was aborted" in str(outcomes[r]), outcomes
    assert [k["wait"] for k in kinds] == [1, 1, 0]


@pytest.mark.fault  # a slow lane: 0.5 s each (the README's suite is at its budget)
@pytest.mark.parametrize("deleted", [False, True])
def test_an_abort_after_the_release_leaves_it_standing(deleted: bool) -> None:
    """Member 0's table is aborted once every member has arrived, before its wait returns,
    and before (or after: ``deleted``) the last arrival deletes the counter: the release
    stands (member 0 forms, as the others do) and the stop leaves no key behind."""
    size = 3
    last = {"set": 0.0 if deleted else 0.4}  # member 2 lingers between release and delete
    outcomes, kinds, store, _ = _run(
        size, [0.0, 0.0, 0.1], abort_at=(0, 0.25), linger={0: {"wait": 0.4}, 2: last}
    )
    assert outcomes == [None] * size
    assert [k["wait"] for k in kinds] == [1, 1, 0]
    assert store.num_keys() == 0


@pytest.mark.fault  # a slow lane: about 1 s
@settings(max_examples=15)
@given(
    st.integers(2, 5),
    st.lists(st.floats(0.0, 0.05), min_size=5, max_size=5),
    st.integers(0, 4),
    st.floats(0.0, 0.06),
)
def test_an_abort_racing_the_last_arrival_leaves_every_member_the_same_verdict(
    size: int, delays: list[float], aborted: int, at: float
) -> None:
    outcomes, kinds, _, _ = _run(size, list(delays[:size]), abort_at=(aborted % size, at))
    assert "never ended" not in outcomes
    formed = [outcome is None for outcome in outcomes]
    assert all(formed) or not any(formed), outcomes
    assert all(k["wait"] <= 1 for k in kinds)


def test_a_member_that_never_arrives_ends_the_wait_at_the_timeout_saying_so() -> None:
    store, name = HashStore(), "scopedmesh-barrier-alone"
    client = _Client(store, {})
    table = GroupTable()
    stop = Stop(client, "the test group", range(2), 0, _Lost(), table._why_aborted)  # type: ignore[arg-type]
    stop.subscribe = table.on_abort
    with pytest.raises(GroupFormationError, match="could not form the test group within") as error:
        all_formed(client, name, 2, timedelta(seconds=0.3), [], stop)  # type: ignore[arg-type]
    assert "not every member arrived at the formation barrier" in str(error.value)
    assert client.kinds["wait"] == 1  # one wait for the whole timeout, no slices
