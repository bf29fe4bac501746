"""ProcessGroupMesh: the scoped-owner contract, proven on a real gloo world of 8 ranks.

One spawned world (tests/world/_workers_mesh.py: ``mesh_world``) runs every check in
sequence and reports facts per check and rank; each test below asserts one rule
of the contract against expectations written out by hand. A check that raises
on a rank fails its test with that rank's traceback.
"""

from __future__ import annotations

import gc
import tracemalloc
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import _workers_mesh as workers
import pytest
import torch.distributed as dist

from scopedmesh import MeshClosedError
from scopedmesh.c10d import groups as _c10d
from scopedmesh.layout import MeshLayout
from scopedmesh.mesh import ProcessGroupMesh
from scopedmesh.testing import run_world

WORLD = 8
RANKS = range(WORLD)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(workers.mesh_world, WORLD, timeout=400.0)


def facts(world: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return workers.facts(world, name)


# ---------------------------------------------------------- hand expectations
# 2 x 2 x 2 mesh named (dp, pp, tp) in C order: rank = 4 * dp + 2 * pp + tp.
HAND_3D: dict[str, list[list[int]]] = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp+tp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "pp+tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "dp+pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "dp+pp+tp": [[0, 1, 2, 3, 4, 5, 6, 7]],
}
COORD_3D = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def hand_group(table: list[list[int]], rank: int) -> list[int]:
    (group,) = [g for g in table if rank in g]
    return group


def live_deltas(world: list[dict[str, Any]]) -> dict[str, list[int]]:
    """live_group_count() after minus before, per check and rank (global_destroy excluded)."""
    out: dict[str, list[int]] = {}
    for check in workers.MESH_CHECKS[:-1]:
        entries = workers.entries(world, check.__name__)
        out[check.__name__] = [e["live_after"] - e["live_before"] for e in entries if e]
    return out


# ------------------------------------------------------------------- membership


@pytest.mark.parametrize("axes", ["tp", "pp", "dp"])
def test_single_axis_membership_by_all_reduce(world: list[dict[str, Any]], axes: str) -> None:
    for rank, f in enumerate(facts(world, "membership_3d")):
        expected = hand_group(HAND_3D[axes], rank)
        got = f[axes]
        assert got["members"] == expected, (rank, axes)
        assert got["sum"] == sum(expected)
        assert got["ranks_in_group"] == expected
        assert got["group_rank"] == expected.index(rank)
        assert not got["is_world"]


@pytest.mark.parametrize("axes", ["dp+tp", "pp+tp", "dp+pp", "dp+pp+tp"])
def test_several_axes_membership_by_all_reduce(world: list[dict[str, Any]], axes: str) -> None:
    for rank, f in enumerate(facts(world, "membership_3d")):
        expected = hand_group(HAND_3D[axes], rank)
        assert f[axes]["members"] == expected, (rank, axes)
        assert f[axes]["ranks_in_group"] == expected
        assert f[axes]["sum"] == sum(expected)
        assert not f[axes]["is_world"]  # even the group over all 8 ranks is the mesh's own


def test_coordinate_and_local_rank_first_last(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "membership_3d")):
        assert f["coordinate"] == COORD_3D[rank]
        for axes in HAND_3D:
            expected = hand_group(HAND_3D[axes], rank)
            got = f[axes]
            assert got["local_rank"] == expected.index(rank) == got["group_rank"]
            assert got["is_first"] == (rank == expected[0])
            assert got["is_last"] == (rank == expected[-1])


def test_axis_over_the_whole_world_is_not_world(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "world_untouched"):
        assert f["is_world"] is False
        assert f["members"] == list(RANKS)
        assert f["destroyed"] is True  # exactly its own group, not WORLD
        assert f["world_live"] is True
        assert f["world_sum"] == sum(RANKS)  # WORLD still communicates after close


def test_indices_at_axis_subsets(world: list[dict[str, Any]]) -> None:
    # 4 x 2 mesh (pp, tp): rank = 2 * pp + tp. Stages 0 and 3 are ranks 0, 1 and 6, 7.
    hand_ends = {0: [0, 6], 6: [0, 6], 1: [1, 7], 7: [1, 7]}
    for rank, f in enumerate(facts(world, "indices_subsets")):
        assert f["ends"] == hand_ends.get(rank), rank
        assert f["ends_is_none"] == (rank not in hand_ends)  # None itself, not a sentinel
        assert f["ends_again_same"] is True  # same object (or None again) on every rank
        # pp in {0, 3} and tp == 1: ranks 1 and 7 only.
        assert f["corner"] == ([1, 7] if rank in (1, 7) else None), rank
        assert f["corner_is_none"] == (rank not in (1, 7))
        assert f["corner_again_same"] is True
        # For ranks 1 and 7 both requests name the ranks [1, 7]: one group, one call.
        assert f["corner_is_ends"] == (rank in (1, 7))
        assert f["calls"] == (rank in hand_ends), rank  # non-members make no group


def test_groups_carry_their_axes_as_torchs_description(world: list[dict[str, Any]]) -> None:
    # Flight-recorder dumps and backend logs read group_desc: "scopedmesh:<axes>".
    for f in facts(world, "descriptions"):
        assert f["tp"] == "scopedmesh:tp"
        assert f["dp+tp"] == "scopedmesh:dp,tp"  # mesh order, whatever order was asked
        assert f["unnamed"] == "scopedmesh:axis1"
        assert f["long"] == "scopedmesh:" + "x" * 188 + "…"  # bounded: 200 characters
    ends = [f["pp ends"] for f in facts(world, "descriptions")]
    assert ends == ["scopedmesh:pp[0,-1]"] * WORLD  # pp has 2 stages: every rank is an end


# Dense (dp=4, tp=2): rank = 2 * dp + tp. Expert view (edp=2, ep=2, tp=2): rank = 4 * edp + 2 * ep + tp.
HAND_DENSE = {"dp": [[0, 2, 4, 6], [1, 3, 5, 7]], "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
HAND_EXPERT = {
    "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
}


def test_views_share_communicators_and_outlive_each_other(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "views")):
        assert f["expert_layout"] == ((2, 2, 2), ("edp", "ep", "tp"), tuple(range(8)))
        assert f["expert_coordinate"] == (rank // 4, (rank // 2) % 2, rank % 2)
        # Two meshes would make 5 groups per rank (dp, tp, edp, ep, tp); the view shares tp.
        assert f["made"] == 4
        assert f["tp_shared"] is True
        for axis, table in HAND_DENSE.items():
            assert f["sums"][f"dense {axis}"] == sum(hand_group(table, rank)), axis
        for axis, table in HAND_EXPERT.items():
            assert f["sums"][f"expert {axis}"] == sum(hand_group(table, rank)), axis
        assert f["dense_closed"] is True
        assert f["dp_destroyed"] is True  # only the dense mesh used it
        assert f["tp_alive_after_dense"] is True  # the open expert view still uses it
        assert f["tp_works_after_dense"] == hand_group(HAND_EXPERT["tp"], rank)
        assert f["live_after_dense"] == 3
        assert f["expert_tp_again"] is True
        assert f["flat_members"] == list(range(8))
        assert f["made_total"] == 5  # the flat view's one group
        assert f["live_after_both"] == 0


def test_dtensor_places_shard_k_at_coordinate_k_whatever_the_rank_order(
    world: list[dict[str, Any]],
) -> None:
    # permuted (2, 4): a=0: 3 1 7 5 | a=1: 0 2 6 4. Round-robin nodes, tp inside a node,
    # (4, 2): rows 0 2 | 4 6 | 1 3 | 5 7 (ranks 0, 2, 4, 6 on node 0): dp lists 0, 4, 1, 5.
    tables = {"permuted": [3, 1, 7, 5, 0, 2, 6, 4], "round_robin": [0, 2, 4, 6, 1, 3, 5, 7]}
    shapes = {"permuted": (2, 4), "round_robin": (4, 2)}
    full = workers.DTENSOR_FULL
    product = (workers.DTENSOR_FULL @ workers.DTENSOR_WEIGHT).tolist()  # one process
    for rank, f in enumerate(facts(world, "dtensor_any_order")):
        for label, table in tables.items():
            rows, cols = shapes[label]
            dp, tp = divmod(table.index(rank), cols)
            got = f[label]
            assert got["coordinate"] == (dp, tp), label
            assert got["local_rank_dp"] == dp, label
            r, c = 8 // rows, 4 // cols
            assert got["local"] == full[dp * r : (dp + 1) * r, tp * c : (tp + 1) * c].tolist()
            assert got["full"] == full.tolist(), label
            # A sharded matmul sums in another order than one process does: equal to rounding.
            assert len(got["matmul"]) == len(product), label
            for row, expected in zip(got["matmul"], product):
                assert row == pytest.approx(expected, rel=1e-12, abs=1e-12), label


def test_custom_ranks_permutation(world: list[dict[str, Any]]) -> None:
    # ranks=[3, 1, 7, 5, 0, 2, 6, 4] laid out 2 x 4 (a, b) in C order:
    #   a=0: 3 1 7 5
    #   a=1: 0 2 6 4
    coord = {3: (0, 0), 1: (0, 1), 7: (0, 2), 5: (0, 3), 0: (1, 0), 2: (1, 1), 6: (1, 2), 4: (1, 3)}
    hand_a = [[0, 3], [1, 2], [6, 7], [4, 5]]
    hand_b = [[1, 3, 5, 7], [0, 2, 4, 6]]
    for rank, f in enumerate(facts(world, "custom_ranks")):
        assert f["perm_coordinate"] == coord[rank]
        assert f["perm_a"] == hand_group(hand_a, rank)
        assert f["perm_b"] == hand_group(hand_b, rank)
        # Group rank k is the rank at position k: the members keep mesh order.
        assert f["perm_local_rank_b"] == coord[rank][1]
        assert f["perm_b_order"] == [[3, 1, 7, 5], [0, 2, 6, 4]][coord[rank][0]]


def test_from_layout_forms_the_groups_of_that_layout(world: list[dict[str, Any]]) -> None:
    # The permuted 2 x 4 layout of test_custom_ranks_permutation (eager: groups a and b);
    # then columns 1 and 3 of the default 2 x 4 layout, a 2 x 2 slice:
    #   a=0: 1 3
    #   a=1: 5 7
    coord = {3: (0, 0), 1: (0, 1), 7: (0, 2), 5: (0, 3), 0: (1, 0), 2: (1, 1), 6: (1, 2), 4: (1, 3)}
    hand_a = [[0, 3], [1, 2], [6, 7], [4, 5]]
    hand_b = [[1, 3, 5, 7], [0, 2, 4, 6]]
    slice_coord = {1: (0, 0), 3: (0, 1), 5: (1, 0), 7: (1, 1)}
    for rank, f in enumerate(facts(world, "from_layout")):
        assert f["perm_live"] == 2
        assert f["perm_coordinate"] == coord[rank]
        assert f["perm_a"] == hand_group(hand_a, rank)
        assert f["perm_b"] == hand_group(hand_b, rank)
        assert f["perm_timeout"] == timedelta(seconds=workers.TIMEOUT)
        if rank % 2:
            assert f["slice_coordinate"] == slice_coord[rank]
            assert f["slice_a"] == hand_group([[1, 5], [3, 7]], rank)
            assert f["slice_ab"] == [1, 3, 5, 7]
        else:
            assert f"(global rank {rank}) is not in the mesh's ranks" in f["outside"]
        assert f["leaked"] == 0


def test_custom_ranks_subset_and_outsiders(world: list[dict[str, Any]]) -> None:
    # ranks=[1, 3, 5, 7] laid out 2 x 2 (x, y): x=0: 1 3, x=1: 5 7.
    coord = {1: (0, 0), 3: (0, 1), 5: (1, 0), 7: (1, 1)}
    for rank, f in enumerate(facts(world, "custom_ranks")):
        if rank % 2:
            assert f["sub_coordinate"] == coord[rank]
            assert f["sub_x"] == hand_group([[1, 5], [3, 7]], rank)
            assert f["sub_y"] == hand_group([[1, 3], [5, 7]], rank)
            assert f["sub_xy"] == [1, 3, 5, 7]
        else:
            assert f["outside"].startswith("ValueError: ")
            assert f"global rank {rank}" in f["outside"]
            assert "not in the mesh's ranks" in f["outside"]
        assert f["beyond_world"].startswith("ValueError: ")
        assert "got rank 8" in f["beyond_world"]
        assert "must lie in the world of 8 ranks" in f["beyond_world"]


# ------------------------------------------------------------------- lifecycle


def test_construction_makes_no_group_and_first_request_makes_one(
    world: list[dict[str, Any]],
) -> None:
    for rank, f in enumerate(facts(world, "lazy_and_cached")):
        assert f["after_construction"] == (0, 0), rank  # (new_group calls, live groups)
        assert f["after_first"] == (1, 1), rank
        assert f["call_ranks"][0] == hand_group(HAND_3D["tp"], rank)


def test_repeated_requests_return_the_same_object(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "lazy_and_cached")):
        assert f["same_tp"] == [True] * 8, rank
        assert f["after_repeats"] == 1


def test_axes_spelled_differently_reach_the_same_group(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "lazy_and_cached")):
        # ("dp", "tp"), ("tp", "dp"), (0, 2), (2, 0), ["dp", -1]: one group.
        assert f["same_dp_tp"] == [True] * 4, rank
        assert f["dp_tp_members"] == hand_group(HAND_3D["dp+tp"], rank)
        assert f["after_several"] == (2, 2)
        assert f["call_ranks"] == [
            hand_group(HAND_3D["tp"], rank),
            hand_group(HAND_3D["dp+tp"], rank),
        ]


def test_live_group_count_is_restored_after_every_scope(world: list[dict[str, Any]]) -> None:
    for check, deltas in live_deltas(world).items():
        assert deltas == [0] * WORLD, check
    for name in (
        "lazy_and_cached",
        "submeshes",
        "close_order",
        "skips_destroyed",
        "two_meshes",
        "exception_propagates",
        "resource_warning",
        "eager_and_create_groups",
        "defaults",
        "seed_names",
    ):
        for f in facts(world, name):
            assert f["after_exit"] == 0, name


def test_no_check_fell_back_to_public_new_group(world: list[dict[str, Any]]) -> None:
    for check in workers.MESH_CHECKS:
        for rank, entry in enumerate(workers.entries(world, check.__name__)):
            assert entry is not None
            assert entry["warnings"] == [], (check.__name__, rank)
    for f in facts(world, "lazy_and_cached"):
        assert all(name.startswith("scopedmesh-") for name in f["call_names"])


def test_submesh_shares_groups_and_owns_what_it_makes(world: list[dict[str, Any]]) -> None:
    stage_ranks = {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    for rank, f in enumerate(facts(world, "submeshes")):
        assert f["stage_shape"] == ((2, 2), ("pp", "tp"), stage_ranks[rank // 4])
        assert f["stage_tp_shared"] is True  # stage.get_group_along_axis("tp") is tp
        assert f["calls_after_shared"] == 1  # ...and no new_group call for it
        assert f["stage_pp"] == hand_group(HAND_3D["pp"], rank)
        assert f["calls_after_stage_pp"] == 2
        assert f["parent_sees_stage_pp"] is True  # one group per key, whoever made it
        # The sub-mesh made it, but the open parent asked for it too: a group lives as
        # long as the last scope that uses it, so it outlives the sub-mesh.
        assert f["stage_pp_destroyed"] is False
        assert f["tp_alive"] is True  # the parent's group is untouched
        assert f["tp_still_works"] == hand_group(HAND_3D["tp"], rank)
        assert f["live_after_stage"] == 2
        assert f["pp_new_object"] is False  # asked again: the same group, not a new one
        assert f["pp_again"] == hand_group(HAND_3D["pp"], rank)
        assert f["indexed_shares_tp"] is True
        assert f["indexed_shares_pp"] is True
        assert f["pp_alive_after_indexed"] is True


def test_nested_submesh(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "submeshes")):
        pp_is_1 = (rank // 2) % 2 == 1
        assert f["inner_pp_shared"] is True
        assert f["inner_end"] == ([rank] if pp_is_1 else None), rank
        assert f["calls_after_inner"] == 2 + pp_is_1
        assert f["live_inside_inner"] == 2 + pp_is_1
        assert f["inner_end_destroyed"] is True
        assert f["stage_pp_alive_after_inner"] is True
        assert f["live_after_inner"] == 2
        assert f["calls_total"] == 2 + pp_is_1  # tp, pp and the inner end: none made twice


def test_close_order_newest_first_children_first(world: list[dict[str, Any]]) -> None:
    # Made in the order tp, dp (parent), plane (stage), pp (inner), everything (parent).
    for rank, f in enumerate(facts(world, "close_order")):
        assert f["live_open"] == 5
        assert f["order"] == ["pp", "plane", "everything", "dp", "tp"], rank
        assert f["closed"] == (True, True, True)
        assert f["live_closed"] == 0


def test_close_is_idempotent(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "close_order"):
        assert f["second_close_destroys"] == 0


def test_closing_a_submesh_leaves_the_parent_open(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "close_order"):
        assert f["stage_closed_destroys"] is True
        assert f["parent_tp_alive"] is True
        assert f["parent_still_open"] is True


def test_close_skips_groups_destroyed_by_hand(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "skips_destroyed"):
        assert f["close_error"] is None
        assert f["destroyed"] is True  # only the group still alive was destroyed


def test_close_after_global_destroy(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "global_destroy"):
        assert f["live_open"] == 4  # WORLD + tp + the stage's pp + the other mesh's (dp, tp)
        assert f["errors"] == [None, None, None]
        assert f["destroy_calls"] == []
        assert f["closed"] == (True, True, True)
        assert f["initialized"] is False
        assert f["live_after"] == 0


def test_two_meshes_open_at_once_closed_in_both_orders(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "two_meshes")):
        for order in ("a_first", "b_first"):
            row = f[order]
            tp = hand_group(HAND_3D["tp"], rank)
            assert row["distinct"] is True  # meshes do not share groups
            assert row["names_differ"] is True
            assert row["members"] == [tp, tp]
            assert row["first_dead"] is True
            assert row["second_alive"] is True  # never another mesh's group
            assert row["second_works"] == tp
            assert row["second_mesh_gives_same"] is True
            assert row["second_dead"] is True


def test_exception_ending_the_block_propagates(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "exception_propagates"):
        assert f["same_object"] is True
        assert f["closed"] is True
        assert f["live_after"] == 0
        assert f["same_object_when_close_fails"] is True
        (message,) = f["close_failure_warned"]
        assert "KeyError" in message
        assert "destroy failed" in message


def test_closed_mesh_raises_but_layout_queries_work(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "closed_mesh")):
        for name, error in f["errors"].items():
            assert error is not None, f"{name} did not raise MeshClosedError"
            assert error["runtime_error"] is True
            assert "is closed" in error["text"]
        layout = f["layout"]
        assert layout["shape"] == (2, 2, 2)
        assert layout["names"] == ("dp", "pp", "tp")
        assert layout["size"] == (2, 2, 2)
        assert layout["size_tp"] == 2
        assert layout["coordinate"] == COORD_3D[rank]
        assert layout["coordinate_pp"] == COORD_3D[rank][1]
        assert layout["local_rank_tp"] == rank % 2
        assert layout["is_first_dp"] == (rank < 4)
        assert layout["is_last_dp"] == (rank >= 4)
        assert list(layout["group_tp"]) == hand_group(HAND_3D["tp"], rank)
        assert layout["rank"] == rank
        assert "closed" in f["repr"]


def test_resource_warning_when_an_open_mesh_is_collected(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "resource_warning"):
        (message,) = f["open_warnings"]
        assert "unclosed" in message
        assert f["not_destroyed_by_del"] is True  # __del__ warns; it never destroys
        assert f["closed_warnings"] == []


def test_eager_and_create_groups(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "eager_and_create_groups")):
        single = sorted(tuple(hand_group(HAND_3D[a], rank)) for a in ("dp", "pp", "tp"))
        assert f["eager_calls"] == single
        assert f["eager_live"] == 3
        assert f["eager_then_get_calls"] == 3
        assert f["create_two"] == sorted(tuple(hand_group(HAND_3D[a], rank)) for a in ("tp", "dp"))
        assert f["create_all_total"] == 3
        assert f["tp_cached"] is True


def test_constructor_defaults_reach_the_groups(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "defaults"):
        assert f["backend"] == "gloo"
        assert f["timeout_passed"] == 17.0
        assert f["options_passed"] is True
        # gloo keeps the timeout on its backend options (None: torch lacks the internals).
        assert f["backend_timeout"] in (17.0, None)
        assert f["stage_timeout_passed"] == 17.0
        assert f["stage_options_passed"] is True
        assert f["timedelta_timeout"] == 9.0
        assert f["timedelta_backend_timeout"] in (9.0, None)
        assert f["default_backend"] == "gloo"  # the world's backend when none is given
        assert f["calls"] == 1


def test_backend_timeout_is_readable_on_this_torch(world: list[dict[str, Any]]) -> None:
    # Pins the introspection used above, so its None fallback cannot hide a regression.
    assert {f["backend_timeout"] for f in facts(world, "defaults")} == {17.0}


def test_pg_options_differing_for_an_existing_group(world: list[dict[str, Any]]) -> None:
    for f in facts(world, "defaults"):
        assert f["same_options_ok"] is True
        assert f["other_options"].startswith("ValueError: pg_options differ")
        assert "a mesh keeps one group per (ranks, backend)" in f["other_options"]


def test_seed_compatible_names(world: list[dict[str, Any]]) -> None:
    for rank, f in enumerate(facts(world, "seed_names")):
        assert f["size"] == (2, 2, 2)
        assert f["size_tp"] == 2
        assert f["size_0"] == 2
        assert f["coordinate"] == COORD_3D[rank]
        assert f["coordinate_pp"] == COORD_3D[rank][1]
        assert f["coordinate_neg"] == COORD_3D[rank][2]
        assert f["create_then_get"] is True
        assert f["ranks_in_group"] == hand_group(HAND_3D["tp"], rank)
        assert f["pp_at_1"] == ([rank] if COORD_3D[rank][1] == 1 else None)
        assert f["ravel"] == 2
        assert f["unravel"] == (1, 0, 1)
        dp, pp, _ = COORD_3D[rank]
        assert f["coords"] == [(dp, pp, 0), (dp, pp, 1)]
        assert f["closed"] is True
        assert f["tp_dead"] is True


# --------------------------------------------------- no world, or one in-process rank


def test_static_seed_helpers_without_a_process_group() -> None:
    assert ProcessGroupMesh.ravel((1, 2), (2, 3)) == 5
    assert ProcessGroupMesh.ravel((1, 4), (2, 3), mode="wrap") == 4
    assert ProcessGroupMesh.ravel((5, -1), (2, 3), mode="clip") == 3
    assert ProcessGroupMesh.unravel(6, (2, 2, 2)) == (1, 1, 0)
    assert ProcessGroupMesh.get_coords_along_axis((0, 1, 0), 2, [0, 1]) == [(0, 1, 0), (0, 1, 1)]
    assert ProcessGroupMesh.get_coords_along_axis((0, 0), (0, 1), [[0, 1], [1]]) == [
        (0, 1),
        (1, 1),
    ]
    assert type(ProcessGroupMesh.ravel((1, 1), (2, 2))) is int


def test_mesh_needs_an_initialised_world() -> None:
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ProcessGroupMesh(1)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo world in this process, for checks that need pytest's own tools."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_resource_warning_with_pytest_warns() -> None:
    mesh = ProcessGroupMesh(1, names=("tp",))
    group = mesh.get_group_along_axis("tp")
    assert group is not None
    with pytest.warns(ResourceWarning, match="unclosed"):
        del mesh
        gc.collect()
    assert _c10d.destroy(group) is True  # the warning did not destroy it
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with ProcessGroupMesh(1) as closed:
            closed.get_group_along_axis(0)
        del closed
        gc.collect()


@pytest.mark.usefixtures("one_rank")
def test_closed_mesh_error_message() -> None:
    with ProcessGroupMesh(1, names=("tp",)) as mesh:
        pass
    with pytest.raises(MeshClosedError, match="is closed; its groups were destroyed"):
        mesh.get_group_along_axis("tp")
    with pytest.raises(RuntimeError):
        mesh.create_groups()
    assert mesh.coordinate() == (0,)


@pytest.mark.usefixtures("one_rank")
def test_slicing_returns_the_open_submesh_until_it_closes() -> None:
    with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
        first = mesh["tp"]
        assert mesh["tp"] is first
        assert mesh[1] is first  # the same axes, spelled differently
        assert mesh["dp", "tp"] is not first
        assert mesh.submesh("tp") is not first  # submesh() always opens a new scope
        first.close()
        again = mesh["tp"]
        assert again is not first and not again.closed
    assert again.closed


@pytest.mark.usefixtures("one_rank")
def test_a_mesh_needs_at_least_one_axis() -> None:
    with pytest.raises(TypeError, match="needs a shape"):
        ProcessGroupMesh()
    with pytest.raises(ValueError, match="at least one axis"):
        ProcessGroupMesh([])


# ============================================ from_layout, on a fake world in this process

FAKE_WORLD = 1 << 20
FAKE_RANK = 5


@pytest.fixture
def fake_world() -> Iterator[None]:
    """Rank 5 of a 2^20-rank world on torch's ``fake`` backend, in this process."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    dist.init_process_group(
        "fake",
        store=dist.HashStore(),  # type: ignore[attr-defined]
        rank=FAKE_RANK,
        world_size=FAKE_WORLD,
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ranks_of(group: dist.ProcessGroup | None) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


@pytest.mark.usefixtures("fake_world")
def test_from_layout_is_the_constructor_over_that_layout() -> None:
    names = ("dp", "pp", "tp")
    layout = MeshLayout((FAKE_WORLD // 64, 8, 8), names=names)
    live0 = _c10d.live_group_count()
    built = ProcessGroupMesh(FAKE_WORLD // 64, 8, 8, names=names, timeout=30)
    with ProcessGroupMesh.from_layout(layout, timeout=30, eager=True) as mesh:
        assert mesh.layout == layout == built.layout
        assert mesh.coordinate() == built.coordinate() == (0, 0, 5)
        assert (mesh.backend, mesh.timeout, mesh.pg_options) == (None, timedelta(seconds=30), None)
        assert (built.backend, built.timeout, built.pg_options) == (
            mesh.backend,
            mesh.timeout,
            None,
        )
        assert _c10d.live_group_count() - live0 == 3  # eager: one group per axis
        assert _ranks_of(mesh.get_group_along_axis("tp")) == list(range(8))
        assert _ranks_of(mesh.get_group_along_axis("pp")) == list(range(5, 64, 8))
        assert mesh.submesh("pp", "tp").get_group_along_axis("tp") is mesh.get_group_along_axis(
            "tp"
        )
    built.close()
    assert _c10d.live_group_count() == live0


@pytest.mark.usefixtures("fake_world")
def test_from_layout_keeps_a_permuted_table_and_a_slice() -> None:
    # ranks [7, 5, 3, 1] laid out 2 x 2: rank 5 sits at (0, 1); members keep mesh order.
    with ProcessGroupMesh.from_layout(MeshLayout((2, 2), ranks=[7, 5, 3, 1])) as mesh:
        assert mesh.coordinate() == (0, 1)
        assert _ranks_of(mesh.get_group_along_axis(0)) == [5, 1]
        assert _ranks_of(mesh.get_group_along_axis(1)) == [7, 5]
    # Columns 1 and 2 of a 4 x 4 grid: rows 1 2 | 5 6 | 9 10 | 13 14; rank 5 at (1, 0).
    sliced = MeshLayout((4, 4), names=("r", "c"))[:, 1:3]
    with ProcessGroupMesh.from_layout(sliced) as mesh:
        assert (mesh.shape, mesh.coordinate()) == ((4, 2), (1, 0))
        assert _ranks_of(mesh.get_group_along_axis("r")) == [1, 5, 9, 13]
        assert _ranks_of(mesh.get_group_along_axis("c")) == [5, 6]


@pytest.mark.usefixtures("fake_world")
def test_from_layout_checks_its_arguments_like_the_constructor() -> None:
    layout = MeshLayout((8,))
    live0 = _c10d.live_group_count()
    refused: list[tuple[type[Exception], str, dict[str, Any]]] = [
        (TypeError, "layout must be a MeshLayout, got \\(2, 2\\)", {"layout": (2, 2)}),
        (ValueError, "layout must have at least one axis", {"layout": MeshLayout(())}),
        (
            ValueError,
            "ranks must lie in the world of 1048576 ranks",
            {"layout": MeshLayout((2,), ranks=[FAKE_RANK, FAKE_WORLD])},
        ),
        (
            ValueError,
            "global rank 5\\) is not in the mesh's ranks",
            {"layout": MeshLayout((2,), ranks=[0, 1])},
        ),
        (TypeError, "eager must be a bool, got 'yes'", {"eager": "yes"}),
        (ValueError, "timeout must be positive, got -1", {"timeout": -1}),
        (ValueError, "timeout must be a finite number of seconds", {"timeout": float("nan")}),
        (TypeError, "timeout must be a timedelta or a number of seconds", {"timeout": "5"}),
        (ValueError, "backend 'bogus' is not available", {"backend": "bogus"}),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # a refused mesh was never open
        for error, message, change in refused:
            kwargs: dict[str, Any] = {"layout": layout, **change}
            with pytest.raises(error, match=message):
                ProcessGroupMesh.from_layout(**kwargs)
            gc.collect()
        with pytest.raises(TypeError):
            ProcessGroupMesh.from_layout(layout, "gloo")  # type: ignore[misc]  # keywords only
    assert _c10d.live_group_count() == live0


@pytest.mark.usefixtures("fake_world")
def test_from_layout_does_not_expand_a_layout_over_the_default_ranks() -> None:
    # The rank table of 2^20 ranks would take megabytes; the mesh needs O(ndim).
    layout = MeshLayout((FAKE_WORLD // 64, 8, 8), names=("dp", "pp", "tp"))
    tracemalloc.start()
    try:
        mesh = ProcessGroupMesh.from_layout(layout)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mesh.close()
    assert peak < 256 * 1024, peak


@pytest.mark.usefixtures("fake_world")
def test_group_defaults_are_read_only_properties() -> None:
    with ProcessGroupMesh(8, ranks=range(8), backend="fake", timeout=timedelta(minutes=1)) as mesh:
        assert (mesh.backend, mesh.timeout) == ("fake", timedelta(seconds=60))
        with pytest.raises(AttributeError):
            mesh.timeout = timedelta(seconds=1)  # type: ignore[misc]
        stage = mesh.submesh(0)
        assert (stage.backend, stage.timeout, stage.pg_options) == ("fake", mesh.timeout, None)
