"""The DeviceMesh a mesh hands to torch is scoped too (DTensor, FSDP2, ``_flatten``).

torch compares DeviceMeshes by structure, and DTensor caches its sharding
decisions and redistribute plans by that key. These tests run, in one 8-rank
gloo world, every composition a user runs: blocks in a row over the same ranks,
two meshes open at once, a 1-D mesh over the whole world opened twice, a dense
mesh and an expert view, ``_flatten``/``_unflatten``, and objects kept past
their block. The first case reproduces torch's hazard with a plain
``DeviceMesh.from_group``; every other asserts that each block's work ran on
that block's own groups, that the result is right, and what is left after.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as hs
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.torch_version import TorchVersion

from scopedmesh import ProcessGroupMesh
from scopedmesh.c10d import closable as _closable
from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.device_mesh import ScopedDeviceMesh
from scopedmesh.testing import run_world

A = torch.arange(64, dtype=torch.float64).reshape(8, 8)
B = torch.arange(64, dtype=torch.float64).reshape(8, 8) % 7 - 3
PRODUCT = (A @ B).tolist()


def matmul(dm: DeviceMesh) -> Any:
    """``A @ B`` with rows of A over the first dim and columns of B over the last, replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rest = [Replicate()] * (dm.ndim - 1)
    x = distribute_tensor(A, dm, [Shard(0), *rest])
    w = distribute_tensor(B, dm, [*rest, Shard(1)] if dm.ndim > 1 else [Replicate()])
    return (x @ w).redistribute(dm, [Replicate()] * dm.ndim)


def own_names(mesh: ProcessGroupMesh) -> list[str]:
    """The names of the mesh's own groups along each axis, in mesh order."""
    names = []
    for axis in range(len(mesh.shape)):
        group = mesh.get_group_along_axis(axis)
        assert group is not None
        names.append(group.group_name)
    return names


def run_block(mesh: ProcessGroupMesh) -> dict[str, Any]:
    """One block's DTensor work on ``mesh``, and which groups it ran on."""
    dm = mesh.to_device_mesh("cpu")
    y = matmul(dm)
    return {
        "right": y.to_local().tolist() == PRODUCT,
        "ran_on": list(y.device_mesh._dim_group_names),
        "own": own_names(mesh),
        "result_mesh_is_this_blocks": y.device_mesh == dm and y.device_mesh is not None,
    }


def torch_hazard(out: dict[str, Any]) -> None:
    """Plain DeviceMesh.from_group over two blocks' groups: block 2 runs on block 1's."""
    errors = []
    for _ in range(2):
        with ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp")) as mesh:
            groups = [mesh.get_group_along_axis(a) for a in range(3)]
            ranks = torch.tensor(mesh.layout.ranks).reshape(2, 2, 2)
            dm = DeviceMesh.from_group(groups, "cpu", ranks, mesh_dim_names=("dp", "pp", "tp"))
            try:
                matmul(dm)
                errors.append(None)
            except RuntimeError as error:
                errors.append(str(error))
    out["hazard"] = errors


def blocks_in_a_row(out: dict[str, Any]) -> None:
    out["row"] = []
    for _ in range(3):
        with ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp")) as mesh:
            out["row"].append(run_block(mesh))
        out["row"][-1]["left"] = _c10d.live_group_count()


def two_meshes_at_once(out: dict[str, Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with ProcessGroupMesh(2, 4, names=("dp", "tp")) as second:
        first = ProcessGroupMesh(2, 4, names=("dp", "tp"))
        with first:
            out["both_first"] = run_block(first)
            out["both_second"] = run_block(second)
            kept = distribute_tensor(A, second.to_device_mesh("cpu"), [Shard(0), Replicate()])
        out["both_after_first_closed"] = run_block(second)
        out["both_kept_full"] = kept.full_tensor().tolist() == A.tolist()
        out["both_kept_ran_on"] = list(kept.device_mesh._dim_group_names)
    out["both_left"] = _c10d.live_group_count()


def whole_world_twice(out: dict[str, Any]) -> None:
    out["whole"] = []
    for _ in range(2):
        with ProcessGroupMesh(8, names=("world",)) as mesh:
            out["whole"].append(run_block(mesh))
        out["whole"][-1]["left"] = _c10d.live_group_count()


def dense_and_expert(out: dict[str, Any]) -> None:
    with ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp")) as dense:
        expert = dense.view(2, 4, names=("edp", "ep"))
        with expert:
            out["dense"] = run_block(dense)
            out["expert"] = run_block(expert)
            dense.close()
            out["expert_after_dense_closed"] = run_block(expert)
    out["dense_expert_left"] = _c10d.live_group_count()


def flatten_and_unflatten(out: dict[str, Any]) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    out["flat"] = []
    for _ in range(2):
        with ProcessGroupMesh(2, 2, 2, names=("dp", "cp", "tp")) as mesh:
            dm = mesh.to_device_mesh("cpu")
            before = _c10d.live_group_count()
            flat = dm["dp", "cp"]._flatten("dp_cp")
            group = flat.get_group()
            d = distribute_tensor(A, flat, [Shard(0)])
            out["flat"].append(
                {
                    "scoped": isinstance(flat, ScopedDeviceMesh),
                    "ranks": dist.get_process_group_ranks(group),
                    "expected": list(mesh.layout.group(mesh.coordinate(), ("dp", "cp"))),
                    "full": d.full_tensor().tolist() == A.tolist(),
                    "made": _c10d.live_group_count() - before,
                    "again_same": dm["dp", "cp"]._flatten("dp_cp") is flat,
                }
            )
        out["flat"][-1]["left"] = _c10d.live_group_count()
    if not hasattr(DeviceMesh, "_unflatten"):
        return
    with ProcessGroupMesh(8, names=("world",)) as mesh:
        dm = mesh.to_device_mesh("cpu")
        grid = dm._unflatten(0, (2, 4), ("a", "b"))
        y = matmul(grid)
        out["unflat"] = {
            "scoped": isinstance(grid, ScopedDeviceMesh),
            "right": y.to_local().tolist() == PRODUCT,
            "b_ranks": dist.get_process_group_ranks(grid.get_group("b")),
        }
    out["unflat"]["left"] = _c10d.live_group_count()


def kept_past_the_block(out: dict[str, Any]) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    with ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp")) as mesh:
        dm = mesh.to_device_mesh("cpu")
        x = distribute_tensor(A, dm, [Shard(0), Shard(1), Shard(0)])
        model = fully_shard(nn.Linear(8, 8).double(), mesh=dm["dp"])
        model(A).sum().backward()  # works in the block
    kept: dict[str, Any] = {
        "full_tensor": lambda: x.full_tensor(),
        "get_group": lambda: dm.get_group("tp"),
        "slice": lambda: dm["tp"],
        "flatten": lambda: dm["dp", "pp"]._flatten("dp_pp"),
        "fsdp2_forward": lambda: model(A),
        "local_add": lambda: (x + x).to_local(),
    }
    out["kept"] = {}
    for what, use in kept.items():
        try:
            use()
            out["kept"][what] = "no error"
        except Exception as error:
            out["kept"][what] = f"{type(error).__name__}: {error}"
    out["kept_left"] = _c10d.live_group_count()
    out["closable"] = _closable.supported()


def caches_after_close(out: dict[str, Any]) -> None:
    """What DTensor still holds of a closed block: nothing of its meshes."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute as redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    native = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", lambda: (0, 0))

    def cached() -> int:
        """Python's cached decisions, plus the C++ fast path's hits and misses (2.10+)."""
        return propagator.propagate_op_sharding.cache_info().currsize + sum(native())

    with ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp")) as mesh:
        run_block(mesh)
        out["cache_in_block"] = cached()
    out["cache_after"] = cached()
    planners = getattr(redistribute, "_planner_cache", {})
    out["planners_of_closed_meshes"] = sum(
        1 for key in planners if isinstance(key[0](), ScopedDeviceMesh)
    )


def compiled_across_blocks(out: dict[str, Any]) -> None:
    """A function compiled once, called in three blocks with the DeviceMesh as an argument."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    def gather_rows(local: torch.Tensor, dm: DeviceMesh) -> torch.Tensor:
        x = DTensor.from_local(local, dm, [Shard(0), Replicate()])
        return x.redistribute(dm, [Replicate(), Replicate()]).to_local() * 2

    def square(x: Any) -> Any:  # DTensor in and out; the mesh is never touched
        return (x @ x).relu() * 2

    compiled = torch.compile(gather_rows, backend="aot_eager")
    compiled_square = torch.compile(square, backend="aot_eager")
    local = A[2 * (dist.get_rank() // 4) : 2 * (dist.get_rank() // 4) + 2]
    out["compiled"], out["compiled_dtensor"] = [], []
    for _ in range(3):
        with ProcessGroupMesh(2, 4, names=("dp", "tp")) as mesh:
            dm = mesh.to_device_mesh("cpu")
            try:
                y = compiled(local, dm)
                out["compiled"].append(y.tolist() == (2 * A[:4]).tolist())
            except Exception as error:
                out["compiled"].append(f"{type(error).__name__}: {str(error)[:300]}")
            z = compiled_square(distribute_tensor(B, dm, [Shard(0), Replicate()]))
            out["compiled_dtensor"].append(
                z.full_tensor().tolist() == ((B @ B).relu() * 2).tolist()
                and list(z.device_mesh._dim_group_names) == own_names(mesh)
            )


CASES = (
    torch_hazard,
    blocks_in_a_row,
    two_meshes_at_once,
    whole_world_twice,
    dense_and_expert,
    flatten_and_unflatten,
    kept_past_the_block,
    caches_after_close,
    compiled_across_blocks,
)


def scoped_dtensor_world(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"start": _c10d.live_group_count()}
    for case in CASES:
        case(out)
    t = torch.ones(1)
    dist.all_reduce(t)  # WORLD untouched by every close
    out["world_sum"] = t.item()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(scoped_dtensor_world, 8, timeout=300.0)


def check_block(block: dict[str, Any]) -> None:
    assert block["right"], "the block's result is A @ B"
    assert block["ran_on"] == block["own"], "the block's work ran on its own groups"
    assert block["result_mesh_is_this_blocks"]


def test_torch_reuses_a_closed_blocks_device_mesh(world: list[dict[str, Any]]) -> None:
    """The hazard, with torch's own DeviceMesh: block 2 is routed to block 1's groups."""
    for out in world:
        first, second = out["hazard"]
        assert first is None
        assert second is not None and "Could not resolve the process group" in second
        assert "scopedmesh-" in second and second.rstrip().endswith("-1")  # block 1's


def test_three_blocks_in_a_row_each_run_on_their_own_groups(world: list[dict[str, Any]]) -> None:
    for out in world:
        for block in out["row"]:
            check_block(block)
            assert block["left"] == 1  # WORLD
        assert len({tuple(block["own"]) for block in out["row"]}) == 3  # three incarnations


def test_two_meshes_open_at_once_over_the_same_ranks(world: list[dict[str, Any]]) -> None:
    for out in world:
        first, second = out["both_first"], out["both_second"]
        check_block(first)
        check_block(second)
        assert set(first["own"]).isdisjoint(second["own"])
        after = out["both_after_first_closed"]
        check_block(after)
        assert after["own"] == second["own"]
        assert out["both_kept_full"] and out["both_kept_ran_on"] == second["own"]
        assert out["both_left"] == 1


def test_a_whole_world_mesh_opened_twice(world: list[dict[str, Any]]) -> None:
    for out in world:
        for block in out["whole"]:
            check_block(block)
            assert block["left"] == 1
        first, second = out["whole"]
        assert first["own"] != second["own"]


def test_a_dense_mesh_and_an_expert_view(world: list[dict[str, Any]]) -> None:
    for out in world:
        for name in ("dense", "expert", "expert_after_dense_closed"):
            check_block(out[name])
        assert out["dense_expert_left"] == 1


def test_flattened_and_unflattened_dims_belong_to_the_scope(world: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(world):
        for block in out["flat"]:
            assert block["scoped"] and block["full"] and block["again_same"]
            assert block["ranks"] == block["expected"]
            assert block["made"] == 1  # torch's flattened group, adopted by the scope
            assert block["left"] == 1  # and destroyed with it: WORLD only
        if "unflat" in out:  # releases with DeviceMesh._unflatten
            unflat = out["unflat"]
            assert unflat["scoped"] and unflat["right"]
            assert unflat["b_ranks"] == [4 * (rank // 4) + i for i in range(4)]
            assert unflat["left"] == 1


def test_objects_kept_past_their_block_say_the_mesh_closed(world: list[dict[str, Any]]) -> None:
    for out in world:
        kept = out["kept"]
        for what in ("full_tensor", "get_group", "slice", "flatten"):
            assert kept[what].startswith("MeshClosedError: this DeviceMesh belongs to "), kept
            assert "which is closed" in kept[what]
        # FSDP2 keeps the dp group itself, not only the DeviceMesh, and torch checks the
        # group before calling it: where gloo groups are closable, the group's name says so.
        if out["closable"]:
            assert "shut down when its mesh closed" in kept["fsdp2_forward"], kept
        # else (torch 2.9): a destroyed gloo group still communicates, as torch's own do
        assert kept["local_add"] == "no error"  # no communication: the local shard only
        assert out["kept_left"] == 1


def test_dtensor_keeps_nothing_of_a_closed_blocks_meshes(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["cache_in_block"] > 0
        assert out["cache_after"] == 0
        assert out["planners_of_closed_meshes"] == 0
        assert out["start"] == 1 and out["world_sum"] == 8.0


def test_a_compiled_graph_never_runs_on_a_closed_blocks_groups(
    world: list[dict[str, Any]],
) -> None:
    for out in world:
        assert out["compiled_dtensor"] == [True, True, True]  # every release
        if TorchVersion(torch.__version__) >= "2.12":  # DeviceMesh is an opaque type to dynamo
            assert out["compiled"] == [True, True, True]
        else:  # dynamo takes only torch's own DeviceMesh class: it refuses, loudly, every time
            assert all("ScopedDeviceMesh" in str(result) for result in out["compiled"])


# ------------------------------------------------ hypothesis: a mesh per example

SHAPES = [((4,), ("w",)), ((2, 2), ("dp", "tp")), ((1, 4), ("dp", "tp")), ((4, 1), ("dp", "tp"))]


@settings(max_examples=12, deadline=None, database=None)
@given(
    case=hs.sampled_from(SHAPES),
    rows=hs.integers(1, 3),
    shard_last=hs.booleans(),
)
@pytest.mark.world(4)
def test_every_example_opens_a_mesh_and_uses_dtensor(
    world: Any, case: Any, rows: int, shard_last: bool
) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    shape, names = case
    a = torch.arange(4 * rows * 4, dtype=torch.float64).reshape(4 * rows, 4)
    with ProcessGroupMesh(*shape, names=names) as mesh:
        dm = mesh.to_device_mesh("cpu")
        last = [Shard(1) if shard_last else Replicate()]
        x = distribute_tensor(a, dm, [Shard(0)] + last * (dm.ndim - 1))
        y = (x @ x.T.redistribute(dm, [Replicate()] * dm.ndim)).redistribute(
            dm, [Replicate()] * dm.ndim
        )
        assert y.to_local().tolist() == (a @ a.T).tolist()
        assert list(y.device_mesh._dim_group_names) == own_names(mesh)
    assert _c10d.live_group_count() == 1


# ------------------------------------- FSDP2's combined meshes: DeviceMesh._concatenate

CONCATENATES = hasattr(DeviceMesh, "_concatenate") and "_preserve_rank_order" in getattr(
    DeviceMesh, "__annotations__", {}
)


@pytest.mark.skipif(
    not CONCATENATES,
    reason="this torch's DeviceMesh has no _preserve_rank_order field for _concatenate to "
    "copy (torch 2.13): two FSDP2 models open at once can share a combined mesh there "
    "(docs/lifetime.md)",
)
@pytest.mark.world(4)
def test_two_fsdp2_models_on_two_open_meshes_never_share_a_combined_mesh(world: Any) -> None:
    """FSDP2 + TP and HSDP on two open meshes of one structure, steps interleaved.

    FSDP2 builds each parameter's combined mesh with the static
    ``DeviceMesh._concatenate``, as torch's own class: it must still be distinct
    per scope, so no DTensor of one model ever carries the other's mesh, and the
    model left open goes on after the other closes.
    """
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def build(dm: DeviceMesh, hsdp: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).double()
        if hsdp:
            return fully_shard(model, mesh=dm)  # (replicate, shard): HSDP
        parallelize_module(model, dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return fully_shard(model, mesh=dm["dp"])

    def meshes(model: nn.Module) -> list[DeviceMesh]:
        found = []
        for p in model.parameters():
            for t in (p, p.grad):
                if isinstance(t, DTensor):
                    found.append(t.device_mesh)
        return found

    x = A[:, :8].clone()
    for hsdp in (False, True):
        with ProcessGroupMesh(2, 2, names=("dp", "tp")) as mesh_a:
            mesh_b = ProcessGroupMesh(2, 2, names=("dp", "tp")).__enter__()
            own = [set(own_names(m)) for m in (mesh_a, mesh_b)]
            dms = [m.to_device_mesh("cpu") for m in (mesh_a, mesh_b)]
            joined = [DeviceMesh._concatenate([dm["dp"], dm["tp"]]) for dm in dms]
            assert type(joined[0]) is DeviceMesh  # torch's own class, not bound to a scope
            assert joined[0] != joined[1] and hash(joined[0]) != hash(joined[1])
            assert joined[0] == DeviceMesh._concatenate([dms[0]["dp"], dms[0]["tp"]])
            assert copy.deepcopy(joined[0]._preserve_rank_order) == joined[0]._preserve_rank_order
            models = [build(dm, hsdp) for dm in dms]
            optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
            losses: list[list[float]] = [[], []]
            for _ in range(3):
                for i, (model, optim) in enumerate(zip(models, optims)):
                    loss = model(x).sum()
                    loss.backward()
                    optim.step()
                    losses[i].append(loss.item())
            assert losses[0] == losses[1]
            for i, model in enumerate(models):
                found = meshes(model)
                assert found and all(set(m._dim_group_names) <= own[i] for m in found), hsdp
                other = meshes(models[1 - i])
                assert all(m != n for m in found for n in other), hsdp
        with torch.no_grad():  # model A's block closed: model B goes on, on its own groups
            full = [p.full_tensor() for p in models[1].parameters()]
        assert all(t.isfinite().all() for t in full)
        mesh_b.__exit__(None, None, None)
    assert _c10d.live_group_count() == 1
