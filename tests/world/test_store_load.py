"""What forming a group asks of torch's store: counts (never times), from benchmarks/store.py.

A world of 8 gloo ranks forms groups of 2, 4 and 8 members, each rank's store counted.
scopedmesh's own requests per formation of an n-member group are 5n + 1: per member a
generation ``add``, an arrival ``add``, a ``wait`` for the release (or, for the last to
arrive, the release ``set`` and the counter's ``delete``), a departure ``add`` and the
``delete`` of its own gloo address; the last to leave deletes the release key. A mesh
costs each member one more request, counted with its first group, 6n + 1 in all: the
``set`` of its process record at the mesh's making, which lets peers tell that it runs or
died (scopedmesh.c10d.processes). Watching the
rendezvous for deadlocks costs nothing when every member arrives within the grace period:
gloo's own wait for each address is the one request made. gloo's own
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
def test_a_meshs_first_group_asks_6n_plus_1(table: Any, size: int) -> None:
    formations = WORLD // size
    assert table["scopedmesh"][size]["own"] == formations * (6 * size + 1)


@pytest.mark.parametrize("size", [2, 4])
def test_a_meshs_later_group_asks_5n_plus_1(table: Any, size: int) -> None:
    formations = WORLD // size
    assert table["scopedmesh_later"][size]["own"] == formations * (5 * size + 1)
    assert table["scopedmesh_later"][size]["backend"] == WORLD * (1 + 2 * size)


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
    assert all(6 < cost <= 6.5 for cost in per_member), per_member
    assert per_member == sorted(per_member, reverse=True)


# ------------------------------------------------------------------ the watch's agreement


class _Counting:
    """A store that counts the requests made through it."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return attr(*args, **kwargs)

        return counted
