"""One mesh formation at 1,024 members: scopedmesh's store requests, per member and per group.

``python -m benchmarks.formation --json`` runs 1,024 members, each a thread of one
process with a torch world of its own (torch's threaded-world harness), through
scopedmesh's real formation: ``ProcessGroupMesh``, the generation counter, torch's
private group construction, the formation barrier, ``close``. The backend is torch's
``FakeProcessGroup`` under another name, which makes no store request, so these are
scopedmesh's own requests alone; the store is one ``HashStore``, each member's
requests counted by a store of its own. What is real and what is stood in for:
benchmarks/formation.py's docstring.

Per formation of an n-member group, at n = 32 and n = 1,024 alike: a mesh's first
group 5n + 1, a later group 4n + 1 (a generation ``add``, an arrival ``add``, a
``wait`` for the release and a departure ``add``; the last to arrive sets the release
and deletes the counter instead; the last to leave deletes the release; the mesh's
making adds each member's process record, one ``set``). On gloo each member also
deletes its address (+n: tests/world/test_store_load.py's 6n + 1 and 5n + 1 at 8
ranks). Counts, never times, at the default grace (0.5 s): 1,024 threads on 2 cores
reach the barrier over seconds, and each waiting member still makes one ``wait``
(issue 45: it used to ask again every 0.1 s past the grace, 36,987 waits instead of
1,023).
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.formation import MEMBERS, counts

# A subprocess of 1,024 threads: 10 to 30 s on 2 cores. Run as a user runs it.
pytestmark = pytest.mark.launch

N = MEMBERS
SIDE = 32


@pytest.fixture(scope="module")
def table() -> dict[str, dict[str, Any]]:
    return counts()


def test_a_1024_member_group_first_in_its_mesh_asks_5n_plus_1(table: Any) -> None:
    row = table["line"]
    assert (row["group_size"], row["groups"]) == (N, 1)
    assert row["per_group"] == [5 * N + 1]
    # Per member: record, generation, arrival, then a wait and a departure (or, last to
    # arrive, the release's set and the counter's delete); the last to leave: one more.
    assert row["per_member"] == {"5": N - 1, "6": 1}
    assert row["kinds"] == {
        "own add": N + N + (N - 1),  # generations, arrivals, departures
        "own delete_key": 2,  # the arrival counter, the release
        "own set": N + 1,  # process records, the release
        "own wait": N - 1,  # every member but the last to arrive
    }
    assert row["backend"] == 0


@pytest.mark.parametrize("step", ["line", "square_axis1", "square_axis0", "square_both"])
def test_each_waiting_member_is_woken_once(table: Any, step: str) -> None:
    # However late the last member arrives: the release wakes each waiter, nothing polls.
    assert table[step]["most_waits"] == 1


def test_a_32_by_32_meshs_first_axis_asks_5n_plus_1_per_group(table: Any) -> None:
    row = table["square_axis1"]
    assert (row["group_size"], row["groups"]) == (SIDE, SIDE)
    assert row["per_group"] == [5 * SIDE + 1]  # every one of the 32 groups
    assert row["per_member"] == {"5": N - SIDE, "6": SIDE}
    assert row["kinds"] == {
        "own add": SIDE * (3 * SIDE - 1),
        "own delete_key": 2 * SIDE,
        "own set": N + SIDE,
        "own wait": SIDE * (SIDE - 1),
    }
    assert row["backend"] == 0


def test_a_32_by_32_meshs_second_axis_asks_4n_plus_1_per_group(table: Any) -> None:
    row = table["square_axis0"]
    assert (row["group_size"], row["groups"]) == (SIDE, SIDE)
    assert row["per_group"] == [4 * SIDE + 1]
    assert row["per_member"] == {"4": N - SIDE, "5": SIDE}
    assert row["kinds"] == {
        "own add": SIDE * (3 * SIDE - 1),
        "own delete_key": 2 * SIDE,
        "own set": SIDE,  # the releases only: the records were written at the making
        "own wait": SIDE * (SIDE - 1),
    }
    assert row["backend"] == 0


def test_a_later_1024_member_group_asks_4n_plus_1(table: Any) -> None:
    row = table["square_both"]
    assert (row["group_size"], row["groups"]) == (N, 1)
    assert row["per_group"] == [4 * N + 1]
    assert row["per_member"] == {"4": N - 1, "5": 1}
    assert row["backend"] == 0


def test_a_members_cost_does_not_grow_with_its_group(table: Any) -> None:
    # The same requests per member in a group of 32 as in one of 1,024.
    assert table["square_axis1"]["per_member"].keys() == table["line"]["per_member"].keys()
    assert table["square_axis0"]["per_member"].keys() == table["square_both"]["per_member"].keys()


@pytest.mark.parametrize("step", ["line_close", "square_close"])
def test_closing_a_mesh_asks_the_store_nothing(table: Any, step: str) -> None:
    assert table[step]["per_member"] == {"0": N}
    assert table[step]["kinds"] == {}


def test_docstring_examples() -> None:
    import doctest

    from benchmarks import formation

    failed, _ = doctest.testmod(formation)
    assert failed == 0
