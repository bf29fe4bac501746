"""ProcessGroupMesh at scale: one rank of a 65,536-rank world on torch's fake backend.

Each case runs in its own process (tests/unit/_scale_case.py) so that its default
process group never meets another test's. Expectations are written here by
hand from the C-order strides of the (8, 16, 16, 32) mesh (dp, pp, cp, tp):
rank = 8192 * dp + 512 * pp + 32 * cp + tp.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TESTS = Path(__file__).resolve().parent
WORLD = 65_536
RELEASE = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
RANK = 40_691
DP, PP, CP, TP = 4, 15, 7, 19
assert RANK == 8192 * DP + 512 * PP + 32 * CP + TP


def run_case(case: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS.parent), env.get("PYTHONPATH", "")) if p
    )
    done = subprocess.run(
        [sys.executable, str(TESTS / "_scale_case.py"), case],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, f"case {case} failed:\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def counts() -> dict[str, Any]:
    return run_case("membership_and_counts")


# Hand-computed groups of RANK.
HAND_TP = list(range(RANK - TP, RANK - TP + 32))
HAND_PP = [RANK - 512 * PP + 512 * i for i in range(16)]
HAND_CP = [RANK - 32 * CP + 32 * i for i in range(16)]
HAND_DP_TP = sorted(RANK - 8192 * DP - TP + 8192 * d + t for d in range(8) for t in range(32))
HAND_PP_ENDS = [RANK - 512 * PP, RANK - 512 * PP + 512 * 15]
# ranks=range(W - 1, -1, -1) laid out 256 x 256: position p holds rank W - 1 - p.
POSITION = WORLD - 1 - RANK
# Members in mesh order (group rank k at position k): descending global ranks here.
HAND_REVERSED_B = [WORLD - 1 - (POSITION // 256 * 256 + j) for j in range(256)]
HAND_REVERSED_A = [WORLD - 1 - (i * 256 + POSITION % 256) for i in range(256)]


def test_membership_of_a_rank_in_the_middle(counts: dict[str, Any]) -> None:
    steps = counts["steps"]
    assert counts["coordinate"] == [DP, PP, CP, TP]
    assert steps["tp"]["ranks"] == HAND_TP
    assert steps["pp"]["ranks"] == HAND_PP
    assert steps["cp"]["ranks"] == HAND_CP
    assert steps["dp_tp"]["ranks"] == HAND_DP_TP
    assert steps["tp_dp"]["ranks"] == HAND_DP_TP
    assert steps["pp_ends"]["ranks"] == HAND_PP_ENDS  # pp=15 is the last stage
    assert steps["pp_head"]["ranks"] is None  # stages 0 and 1 only: not a member
    assert steps["everything"]["ranks"] == list(range(WORLD))
    assert counts["world_reused"] is False


def test_custom_rank_order_at_scale(counts: dict[str, Any]) -> None:
    assert counts["reversed_coordinate"] == [POSITION // 256, POSITION % 256]
    assert counts["steps"]["reversed_b"]["ranks"] == HAND_REVERSED_B
    assert counts["steps"]["reversed_a"]["ranks"] == HAND_REVERSED_A


def test_no_group_before_the_first_request(counts: dict[str, Any]) -> None:
    assert counts["initial"] == 1  # WORLD
    assert counts["steps"]["constructed"]["state"] == [0, 1]  # (new_group calls, live groups)


def test_one_new_group_call_per_distinct_group(counts: dict[str, Any]) -> None:
    states = {label: tuple(step["state"]) for label, step in counts["steps"].items()}
    assert states["tp"] == (1, 2)
    assert states["tp_again"] == (1, 2)  # repeated: no new call
    assert states["pp"] == (2, 3)
    assert states["cp"] == (3, 4)
    assert states["dp_tp"] == (4, 5)
    assert counts["tp_dp_same"] is True
    assert counts["index_same"] is True
    assert states["tp_dp"] == (4, 5)  # ("tp", "dp") and (3, 0) reached the same group
    assert states["pp_ends"] == (5, 6)
    assert states["pp_head"] == (5, 6)  # non-member: no call at all
    assert states["everything"] == (6, 7)
    assert len(counts["names"]) == 6 + 1  # six groups of the mesh + the sub-mesh's plane


def test_submesh_requests_of_existing_groups_make_no_call(counts: dict[str, Any]) -> None:
    states = {label: tuple(step["state"]) for label, step in counts["steps"].items()}
    assert counts["stage_tp_same"] is True
    assert counts["stage_pp_same"] is True
    assert states["stage_shared"] == (6, 7)
    assert states["stage_plane"] == (7, 8)  # a group the sub-mesh makes
    assert states["stage_closed"] == (7, 7)  # ...and destroys on its exit


def test_close_brings_the_count_back(counts: dict[str, Any]) -> None:
    states = {label: tuple(step["state"]) for label, step in counts["steps"].items()}
    assert states["closed"] == (7, 1)
    assert states["eager"] == (11, 5)  # eager=True: one group per axis
    assert states["eager_then_get"] == (11, 5)
    assert states["eager_closed"] == (11, 1)
    assert states["reversed_closed"] == (13, 1)


def test_private_path_only(counts: dict[str, Any]) -> None:
    assert counts["public_new_group_calls"] == 0
    assert all(name.startswith("scopedmesh-") for name in counts["names"])


def test_rank_outside_custom_ranks_at_scale(counts: dict[str, Any]) -> None:
    assert counts["outside"].startswith("ValueError: ")
    assert f"global rank {RANK}" in counts["outside"]


def test_torch_fake_store_cannot_count_and_the_mesh_still_works() -> None:
    facts = run_case("fake_store")
    if RELEASE <= (2, 13):  # torch <= 2.13: FakeStore.add raises
        assert facts["store_add"] is not None and facts["store_add_returned"] == []
    else:  # torch >= 2.14: it returns 1 whatever it is asked, so it still cannot count
        assert facts["store_add"] is None and facts["store_add_returned"] == [1]
    # The mesh does not ask it: the fake backend is recognised by name, on every release.
    assert facts["initial"] == 1
    assert facts["tp"] == HAND_TP
    assert facts["first"] == facts["expected_first"]
    assert facts["first"].endswith("-1")
    assert facts["reopened"] == facts["first"]  # the name was free again: nothing rendezvous
    a, b = facts["two_open"]
    assert facts["two_distinct"] is True
    assert (a, b) == (facts["first"], facts["first"][:-1] + "2")
    assert facts["after_older_closed"] is None  # no "already been created"
    assert facts["third"] == facts["first"]
    assert facts["live_open"] == 3
    assert facts["live_closed"] == 1


def test_an_expert_view_shares_the_dense_groups_at_scale() -> None:
    # Rank 40,691 = dp 79, pp 7, tp 19 (dense: 512 * dp + 32 * pp + tp); dp 79 = edp 9, ep 7.
    out = run_case("views")
    assert out["two_meshes"] == 7  # dp, pp, tp + edp, ep, pp, tp: pp and tp made twice
    assert out["with_view"] == 5  # the view reuses the dense pp and tp
    assert out["shared"] == {"edp": False, "ep": False, "pp": True, "tp": True}
    assert out["expert_ep"] == [9 * 4096 + ep * 512 + 7 * 32 + 19 for ep in range(8)]
    assert out["live_after"] == 1  # WORLD
