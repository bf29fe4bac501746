"""The formation barrier: each waiter is woken once, by the release or by an abort.

Threads stand for the members of one incarnation (scopedmesh.c10d.barrier), over one
torch ``HashStore``; each member holds a real ``GroupTable`` (what a mesh's formation
subscribes to) and counts its own store requests. Counts and agreement are asserted,
never times: a release that comes late (past the old 0.5 s grace) still costs one
``wait``, an abort of one member's table ends every member's wait, with one ``wait``
each, and an abort racing the last arrival leaves every member with the same verdict.
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


class _Counting:
    """One member's view of the shared store, counting its requests by kind."""

    def __init__(self, store: Any, linger: dict[str, float]) -> None:
        self.store, self.kinds, self.linger = store, Counter[str](), linger

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any) -> Any:
            self.kinds[method] += 1
            result = getattr(self.store, method)(*args)
            time.sleep(self.linger.get(method, 0.0))  # descheduled as the request returns
            return result

        return call


def _run(
    size: int,
    delays: list[float],
    abort_at: tuple[int, float] | None = None,
    linger: dict[int, dict[str, float]] | None = None,
) -> tuple[list[Any], list[Counter[str]], HashStore, str]:
    """Each member arrives after its delay; ``abort_at``: (member, seconds) its table is
    aborted then; ``linger[member][kind]``: that member's requests of that kind return
    so many seconds late. Returns each member's outcome (None: formed, else its error) and counts."""
    store = HashStore()
    name = f"scopedmesh-barrier-{random.random()}"
    tables = [GroupTable() for _ in range(size)]
    counted = [_Counting(store, (linger or {}).get(r, {})) for r in range(size)]
    outcomes: list[Any] = ["never ended"] * size

    def member(r: int) -> None:
        table = tables[r]
        stop = Stop(
            store, "the test group", range(size), r, None, table._why_aborted, table.on_abort
        )
        time.sleep(delays[r])
        try:
            all_formed(counted[r], name, size, r, TIMEOUT, [], stop)  # type: ignore[arg-type]
            outcomes[r] = None
        except Exception as error:  # the outcome under test
            outcomes[r] = error

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    if abort_at is not None:
        time.sleep(abort_at[1])
        tables[abort_at[0]].abort("by the test")
    for thread in threads:
        thread.join(TIMEOUT.total_seconds() + 5)
    return outcomes, [c.kinds for c in counted], store, name


def test_a_late_release_wakes_each_waiter_once_and_leaves_no_key() -> None:
    size = 6
    outcomes, kinds, store, _ = _run(size, [0.0] * (size - 1) + [0.7])  # past the 0.5 s grace
    assert outcomes == [None] * size
    assert [k["wait"] for k in kinds] == [1] * (size - 1) + [0]
    assert sum(sum(k.values()) for k in kinds) == 3 * size + 1
    assert store.num_keys() == 0


def test_an_abort_of_one_member_ends_every_wait_at_once_with_its_reason() -> None:
    size = 5
    # Members 0..3 wait; member 4 comes 0.6 s late, after member 1's table is aborted.
    outcomes, kinds, store, name = _run(size, [0.0] * 4 + [0.6], abort_at=(1, 0.3))
    assert isinstance(outcomes[1], MeshClosedError), outcomes  # its own reason
    for r in (0, 2, 3, 4):
        assert isinstance(outcomes[r], GroupFormationError), outcomes
        assert "rank 1 stopped it" in str(outcomes[r]) and "aborted" in str(outcomes[r])
    assert [k["wait"] for k in kinds] == [1, 1, 1, 1, 0]  # the late one never waits
    formed, released = formation_keys(name)
    # Stopped: the release says so, and no arrival can complete the counter any more.
    assert STOPPED <= int(store.get(released)) < STOPPED + size and int(store.get(formed)) < 0
    assert store.check([formation_stop_key(name)])


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


@settings(max_examples=30)
@given(
    st.integers(2, 5),
    st.lists(st.floats(0.0, 0.05), min_size=5, max_size=5),
    st.integers(0, 4),
    st.floats(0.0, 0.06),
)
def test_an_abort_racing_the_last_arrival_leaves_every_member_the_same_verdict(
    size: int, delays: list[float], aborted: int, at: float
) -> None:
    outcomes, kinds, _, _ = _run(size, delays[:size], abort_at=(aborted % size, at))
    assert "never ended" not in outcomes
    formed = [outcome is None for outcome in outcomes]
    assert all(formed) or not any(formed), outcomes
    assert all(k["wait"] <= 1 for k in kinds)
