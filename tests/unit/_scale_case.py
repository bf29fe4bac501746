"""One scale case of tests/unit/test_mesh_scale.py, run in its own process.

    python tests/unit/_scale_case.py <case>

initialises torch's ``fake`` backend as one rank of a 65,536-rank world, runs
the case and prints its facts as one line of JSON; the test asserts on them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
from probes import error_text, record_new_groups
from torch.testing._internal.distributed.fake_pg import FakeStore

from scopedmesh.c10d import groups as _c10d
from scopedmesh.mesh import ProcessGroupMesh

WORLD = 65_536
# dp=4, pp=15, cp=7, tp=19 in the (8, 16, 16, 32) mesh: 4*8192 + 15*512 + 7*32 + 19.
RANK = 40_691
SHAPE = (8, 16, 16, 32)
NAMES = ("dp", "pp", "cp", "tp")


def _ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


class _Counter:
    """new_group-equivalent calls and registered groups, measured around each step."""

    def __init__(self, calls: list[dict[str, Any]]) -> None:
        self.calls = calls

    def state(self) -> tuple[int, int]:
        return len(self.calls), _c10d.live_group_count()


def membership_and_counts() -> dict[str, Any]:
    dist.init_process_group(
        "fake",
        store=dist.HashStore(),  # type: ignore[attr-defined]
        rank=RANK,
        world_size=WORLD,
    )
    out: dict[str, Any] = {"initial": _c10d.live_group_count()}
    original_new_group = dist.new_group
    public: list[object] = []

    def counting_new_group(*args: Any, **kwargs: Any) -> Any:
        public.append(args)
        return original_new_group(*args, **kwargs)

    dist.new_group = counting_new_group
    try:
        with record_new_groups() as calls:
            counter = _Counter(calls)
            steps: dict[str, Any] = {}

            def step(label: str, request: Callable[[], dist.ProcessGroup | None]) -> Any:
                group = request()
                steps[label] = {"state": counter.state(), "ranks": _ranks(group)}
                return group

            with ProcessGroupMesh(*SHAPE, names=NAMES) as mesh:
                steps["constructed"] = {"state": counter.state(), "ranks": None}
                out["coordinate"] = mesh.coordinate()
                tp = step("tp", lambda: mesh.get_group_along_axis("tp"))
                step("tp_again", lambda: mesh.get_group_along_axis("tp"))
                pp = step("pp", lambda: mesh.get_group_along_axis("pp"))
                step("cp", lambda: mesh.get_group_along_axis("cp"))
                dp_tp = step("dp_tp", lambda: mesh.get_group_along_axis(("dp", "tp")))
                out["tp_dp_same"] = mesh.get_group_along_axis(("tp", "dp")) is dp_tp
                out["index_same"] = mesh.get_group_along_axis((3, 0)) is dp_tp
                step("tp_dp", lambda: mesh.get_group_along_axis(("tp", "dp")))
                step("pp_ends", lambda: mesh.get_group_along_axis("pp", indices_at_axis=[0, -1]))
                step("pp_head", lambda: mesh.get_group_along_axis("pp", indices_at_axis=[0, 1]))
                step("everything", lambda: mesh.get_group_along_axis(NAMES))
                with mesh.submesh("pp", "tp") as stage:
                    out["stage_tp_same"] = stage.get_group_along_axis("tp") is tp
                    out["stage_pp_same"] = stage.get_group_along_axis("pp") is pp
                    steps["stage_shared"] = {"state": counter.state(), "ranks": None}
                    step("stage_plane", lambda: stage.get_group_along_axis(("pp", "tp")))
                steps["stage_closed"] = {"state": counter.state(), "ranks": None}
                out["names"] = sorted({c["name"].rsplit("-", 1)[0] for c in calls})
                out["world_reused"] = any(g is dist.group.WORLD for g in (tp, pp, dp_tp))
            steps["closed"] = {"state": counter.state(), "ranks": None}

            with ProcessGroupMesh(*SHAPE, names=NAMES, eager=True) as mesh:
                steps["eager"] = {"state": counter.state(), "ranks": None}
                mesh.get_group_along_axis("cp")
                steps["eager_then_get"] = {"state": counter.state(), "ranks": None}
            steps["eager_closed"] = {"state": counter.state(), "ranks": None}

            with ProcessGroupMesh(
                256, 256, names=("a", "b"), ranks=range(WORLD - 1, -1, -1)
            ) as mesh:
                out["reversed_coordinate"] = mesh.coordinate()
                step("reversed_b", lambda: mesh.get_group_along_axis("b"))
                step("reversed_a", lambda: mesh.get_group_along_axis("a"))
            steps["reversed_closed"] = {"state": counter.state(), "ranks": None}
    finally:
        dist.new_group = original_new_group
    out["steps"] = steps
    out["public_new_group_calls"] = len(public)
    out["outside"] = error_text(lambda: ProcessGroupMesh(4, ranks=[0, 1, 2, 3]))
    dist.destroy_process_group()
    return out


def fake_store() -> dict[str, Any]:
    """torch's FakeStore cannot count: the generation falls back to the first free name."""
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    out: dict[str, Any] = {"initial": _c10d.live_group_count()}
    counted: list[int] = []
    out["store_add"] = error_text(lambda: counted.append(FakeStore().add("k", 1)))
    out["store_add_returned"] = counted
    with ProcessGroupMesh(*SHAPE, names=NAMES) as mesh:
        tp = mesh.get_group_along_axis("tp")
        out["tp"] = _ranks(tp)
        out["first"] = tp.group_name  # type: ignore[union-attr]
    with ProcessGroupMesh(*SHAPE, names=NAMES) as mesh:
        out["reopened"] = mesh.get_group_along_axis("tp").group_name  # type: ignore[union-attr]
    older = ProcessGroupMesh(*SHAPE, names=NAMES)
    newer = ProcessGroupMesh(*SHAPE, names=NAMES)
    a, b = older.get_group_along_axis("tp"), newer.get_group_along_axis("tp")
    out["two_open"] = [a.group_name, b.group_name]  # type: ignore[union-attr]
    out["two_distinct"] = a is not b
    older.close()
    third = ProcessGroupMesh(*SHAPE, names=NAMES)
    out["after_older_closed"] = error_text(lambda: third.get_group_along_axis("tp"))
    out["third"] = third.get_group_along_axis("tp").group_name  # type: ignore[union-attr]
    out["live_open"] = _c10d.live_group_count()
    newer.close()
    third.close()
    out["live_closed"] = _c10d.live_group_count()
    out["expected_first"] = _c10d.group_name(out["tp"], "fake", 1)
    dist.destroy_process_group()
    return out


def views() -> dict[str, Any]:
    """Dense (dp=128, pp=16, tp=32) and expert (edp=16, ep=8, pp=16, tp=32) over 2^16 ranks.

    The expert layout splits dp into (edp, ep): its pp and tp groups are the dense ones.
    """
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    out: dict[str, Any] = {}
    dense_axes, expert_axes = ("dp", "pp", "tp"), ("edp", "ep", "pp", "tp")
    with record_new_groups() as calls:
        with (
            ProcessGroupMesh(128, 16, 32, names=dense_axes) as dense,
            ProcessGroupMesh(16, 8, 16, 32, names=expert_axes) as expert,
        ):
            for axis in dense_axes:
                dense.get_group_along_axis(axis)
            for axis in expert_axes:
                expert.get_group_along_axis(axis)
            out["two_meshes"] = len(calls)
        calls.clear()
        with ProcessGroupMesh(128, 16, 32, names=dense_axes) as dense:
            with dense.view(16, 8, 16, 32, names=expert_axes) as expert:
                groups = {a: dense.get_group_along_axis(a) for a in dense_axes}
                shared = [expert.get_group_along_axis(a) is groups.get(a) for a in expert_axes]
                out["shared"] = dict(zip(expert_axes, shared))
                out["expert_ep"] = _ranks(expert.get_group_along_axis("ep"))
                out["with_view"] = len(calls)
        out["live_after"] = _c10d.live_group_count()
    dist.destroy_process_group()
    return out


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "views": views,
    "membership_and_counts": membership_and_counts,
    "fake_store": fake_store,
}

if __name__ == "__main__":
    print(json.dumps(CASES[sys.argv[1]]()))
