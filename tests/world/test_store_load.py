"""What forming a group asks of torch's store: counts (never times), from benchmarks/store.py.

A world of 8 gloo ranks forms groups of 2, 4 and 8 members, each rank's store counted.
scopedmesh's own requests per formation of an n-member group are 5n + 1: per member a
generation ``add``, an arrival ``add``, a ``wait`` for the release (or, for the last to
arrive, the release ``set`` and the counter's ``delete``), a departure ``add`` and the
``delete`` of its own gloo address; the last to leave deletes the release key. gloo's own
rendezvous costs each member 1 + 2n (its address set, then a wait and a get per member),
the same under torch's public new_group, which deletes nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.store import SIZES, WORLD, counts


@pytest.fixture(scope="module")
def table() -> dict[str, dict[int, dict[str, int]]]:
    return counts()


@pytest.mark.parametrize("size", SIZES)
def test_scopedmesh_asks_5n_plus_1_per_formation(table: Any, size: int) -> None:
    formations = WORLD // size
    assert table["scopedmesh"][size]["own"] == formations * (5 * size + 1)


@pytest.mark.parametrize("size", SIZES)
def test_the_backend_rendezvous_is_torchs_own(table: Any, size: int) -> None:
    assert table["scopedmesh"][size]["backend"] == WORLD * (1 + 2 * size)
    assert table["new_group"][size] == {
        "own": 0,
        "backend": WORLD * (1 + 2 * size),
        "all": WORLD * (1 + 2 * size),
        "bytes": table["new_group"][size]["bytes"],
    }


def test_scopedmesh_per_member_cost_does_not_grow_with_the_group(table: Any) -> None:
    per_member = [table["scopedmesh"][n]["own"] / WORLD for n in SIZES]
    assert all(5 < cost <= 5.5 for cost in per_member), per_member
    assert per_member == sorted(per_member, reverse=True)
