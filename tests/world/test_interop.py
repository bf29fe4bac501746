"""Tests for scopedmesh.mesh.interop: a mesh handed to torch's DeviceMesh, DTensor, TP, FSDP2 and DDP.

Layout facts are checked in this process on the ``fake`` backend (any world size,
no communication); real collectives run once, in one 4-rank gloo world whose
results several tests read.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from scopedmesh import AxisError, MeshClosedError, MeshLayout, ProcessGroupMesh
from scopedmesh.c10d import groups as _c10d
from scopedmesh.c10d.device_mesh import ScopedDeviceMesh
from scopedmesh.mesh.interop import layout_of, to_device_mesh
from scopedmesh.testing import run_world

# ------------------------------------------------------------ what each rank runs

FULL = torch.arange(24, dtype=torch.float64).reshape(4, 6)


def make_linear() -> nn.Linear:
    """The same small model on every rank (and in the test process)."""
    torch.manual_seed(0)
    return nn.Linear(3, 2).double()


def batch(rank: int) -> torch.Tensor:
    """A batch that differs on every rank, so averaging over the wrong ranks shows."""
    return torch.arange(12, dtype=torch.float64).reshape(4, 3) * (rank + 1) / 10


def local_grad(rank: int) -> list[list[float]]:
    """The weight gradient ``rank`` computes alone, without any averaging."""
    model = make_linear()
    model(batch(rank)).square().sum().backward()
    assert model.weight.grad is not None
    return model.weight.grad.tolist()  # type: ignore[no-any-return]


def _device_mesh_checks(mesh: ProcessGroupMesh, out: dict[str, Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dp = mesh.get_group_along_axis("dp")
    tp = mesh.get_group_along_axis("tp")
    dm = mesh.to_device_mesh("cpu")
    out["layout"] = layout_of(dm)
    out["dim_names"] = dm.mesh_dim_names
    out["coordinate"] = tuple(dm.get_coordinate() or ())
    out["same_groups"] = dm.get_group("dp") is dp and dm.get_group("tp") is tp
    out["sliced_tp_group"] = dm["tp"].get_group() is tp

    # distribute_tensor round trip: rows over dp, columns over tp.
    d = distribute_tensor(FULL, dm, [Shard(0), Shard(1)])
    out["local"] = d.to_local().tolist()
    out["full"] = d.full_tensor().tolist()
    out["redistributed"] = d.redistribute(dm, [Replicate(), Shard(0)]).full_tensor().tolist()

    # A DeviceMesh over some axes, in another order.
    tp_dp = mesh.to_device_mesh("cpu", axes=("tp", "dp"))
    out["tp_dp_layout"] = layout_of(tp_dp)
    out["tp_dp_full"] = distribute_tensor(FULL, tp_dp, [Shard(1), Shard(0)]).full_tensor().tolist()
    with mesh.submesh("tp") as sub:
        sub_dm = sub.to_device_mesh("cpu")
        out["submesh_layout"] = layout_of(sub_dm)
        out["submesh_group"] = sub_dm.get_group() is tp


def _tp_fsdp_checks(mesh: ProcessGroupMesh, out: dict[str, Any]) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dm = mesh.to_device_mesh("cpu")
    torch.manual_seed(1)
    dense = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    expected = dense(x)
    expected.sum().backward()

    tp_model = parallelize_module(
        copy.deepcopy(dense), dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    out["tp_error"] = (tp_model(x) - expected).abs().max().item()

    fsdp_model = copy.deepcopy(dense)
    fsdp_model.zero_grad()
    fully_shard(fsdp_model, mesh=dm["dp"])
    y = fsdp_model(x)
    y.sum().backward()
    grad = fsdp_model[0].weight.grad
    assert dense[0].weight.grad is not None and grad is not None
    out["fsdp_error"] = (y - expected).abs().max().item()
    # FSDP2 averages over dp; every dp rank saw the same x, so the average is the local grad.
    out["fsdp_grad_error"] = (grad.full_tensor() - dense[0].weight.grad).abs().max().item()


def _ddp_checks(mesh: ProcessGroupMesh, out: dict[str, Any]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    dp = mesh.get_group_along_axis("dp")
    model = make_linear()
    ddp = DistributedDataParallel(model, process_group=dp)
    ddp(batch(dist.get_rank())).square().sum().backward()
    assert model.weight.grad is not None
    out["ddp_grad"] = model.weight.grad.tolist()
    out["dp_ranks"] = mesh.get_ranks_in_group(dp) if dp is not None else []


def device_mesh_world(rank: int, world_size: int) -> dict[str, Any]:
    """Every interop check on a ``(dp=2, tp=2)`` mesh of 4 ranks."""
    out: dict[str, Any] = {"rank": rank}
    with ProcessGroupMesh(2, 2, names=("dp", "tp")) as mesh:
        out["mesh_layout"] = mesh.layout
        out["mesh_coordinate"] = mesh.coordinate()
        _device_mesh_checks(mesh, out)
        _tp_fsdp_checks(mesh, out)
        _ddp_checks(mesh, out)
        # WORLD + the mesh's dp and tp groups: DTensor, TP, FSDP2, DDP made none of their own.
        out["live_groups_in_scope"] = _c10d.live_group_count()
    out["live_groups_after_close"] = _c10d.live_group_count()
    try:
        mesh.to_device_mesh("cpu")
    except MeshClosedError as error:
        out["closed_error"] = str(error)
    # WORLD is untouched by the mesh's close.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["world_sum"] = t.item()
    return out


# ------------------------------------------------------------ the tests

# ------------------------------------------------------------ fake backend


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a previous test left torch.distributed initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 5, 7])
def test_device_mesh_has_the_mesh_layout_and_groups(rank: int) -> None:
    with fake_world(rank, 8), ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp")) as mesh:
        tp = mesh.get_group_along_axis("tp")
        before = _c10d.live_group_count()
        dm = mesh.to_device_mesh("cpu")
        assert isinstance(dm, DeviceMesh)
        assert _c10d.live_group_count() == before + 2  # dp and pp made now; tp reused
        assert layout_of(dm) == mesh.layout
        assert dm.mesh_dim_names == ("dp", "pp", "tp")
        assert tuple(dm.get_coordinate() or ()) == mesh.coordinate()
        for axis in ("dp", "pp", "tp"):
            assert dm.get_group(axis) is mesh.get_group_along_axis(axis)
            assert dm[axis].get_group() is mesh.get_group_along_axis(axis)
        assert dm.get_group("tp") is tp
        again = to_device_mesh(mesh, "cpu")
        assert _c10d.live_group_count() == before + 2  # a second DeviceMesh makes no group
        assert layout_of(again) == layout_of(dm)


@pytest.mark.parametrize(
    ("axes", "names"),
    [
        (("tp",), ("tp",)),
        (("pp", "tp"), ("pp", "tp")),
        (("tp", "dp"), ("tp", "dp")),
        ((2, 0), ("tp", "dp")),
    ],
)
def test_device_mesh_over_some_axes_in_any_order(
    axes: tuple[Any, ...], names: tuple[str, ...]
) -> None:
    with fake_world(6, 8), ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp")) as mesh:
        dm = mesh.to_device_mesh("cpu", axes=axes)
        assert dm.mesh_dim_names == names
        assert layout_of(dm) == mesh.layout.sub(mesh.coordinate(), axes)
        assert 6 in layout_of(dm)
        for name in names:
            assert dm.get_group(name) is mesh.get_group_along_axis(name)


def test_device_mesh_of_a_submesh_and_of_unnamed_axes() -> None:
    with fake_world(3, 8), ProcessGroupMesh(2, 4) as mesh:
        dm = mesh.to_device_mesh("cpu")
        assert dm.mesh_dim_names == ("axis0", "axis1")
        assert dm.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        with mesh.submesh(1) as row:
            sub = row.to_device_mesh("cpu")
            assert sub.mesh.tolist() == [0, 1, 2, 3]
            assert sub.get_group() is mesh.get_group_along_axis(1)


def test_device_mesh_over_a_subset_of_the_world() -> None:
    with fake_world(6, 8), ProcessGroupMesh(2, 2, ranks=[2, 3, 6, 7], names=("dp", "tp")) as mesh:
        dm = mesh.to_device_mesh("cpu")
        assert dm.mesh.tolist() == [[2, 3], [6, 7]]
        assert tuple(dm.get_coordinate() or ()) == (1, 0)
        assert layout_of(dm) == mesh.layout


def test_layout_of_a_torch_made_device_mesh() -> None:
    with fake_world(0, 8):
        dm = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        assert layout_of(dm) == MeshLayout((2, 4), names=("dp", "tp"))
        assert layout_of(dm["tp"]) == MeshLayout((4,), names=("tp",))


def test_descending_ranks_along_an_axis_keep_their_order() -> None:
    # Rank 0 sits at tp=1: its tp group lists rank 1 first, so DTensor's shard 1 lands on it.
    with fake_world(0, 4), ProcessGroupMesh(2, 2, ranks=[1, 0, 3, 2], names=("dp", "tp")) as mesh:
        dm = mesh.to_device_mesh("cpu")
        assert dm.mesh.tolist() == [[1, 0], [3, 2]]
        assert tuple(dm.get_coordinate() or ()) == (0, 1)
        assert dist.get_process_group_ranks(dm.get_group("tp")) == [1, 0]
        assert mesh.local_rank("tp") == 1


def test_descending_ranks_are_refused_where_groups_sort_their_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A torch whose groups can only list members ascending (the public fallback).
    monkeypatch.setattr(_c10d, "keeps_member_order", lambda: False)
    with fake_world(0, 4), ProcessGroupMesh(2, 2, ranks=[1, 0, 3, 2], names=("dp", "tp")) as mesh:
        with pytest.raises(ValueError, match=r"axis 'tp' lists ranks out of ascending order"):
            mesh.to_device_mesh("cpu")
        assert mesh.local_rank("tp") == 0  # members ascend: rank 0 is group rank 0


def test_bad_arguments_and_closed_mesh() -> None:
    with fake_world(0, 4):
        with ProcessGroupMesh(2, 2, names=("dp", "tp")) as mesh:
            with pytest.raises(TypeError, match="device_type must be a device name"):
                mesh.to_device_mesh("")
            with pytest.raises(TypeError, match="device_type must be a device name"):
                mesh.to_device_mesh(None)  # type: ignore[arg-type]
            with pytest.raises(
                ValueError,
                match=r"device_type must be a device type without an index, such as 'cuda', "
                r"got 'cuda:0'",
            ):
                mesh.to_device_mesh("cuda:0")
            with pytest.raises(
                ValueError, match=r"device_type must be a device type torch knows.*'nonsense'"
            ):
                mesh.to_device_mesh("nonsense")
            with pytest.raises(ValueError, match=r"without an index, such as 'cpu', got 'cpu:0'"):
                to_device_mesh(mesh, "cpu:0")
            with pytest.raises(
                AxisError, match=r"unknown axis 'tpp'; this mesh's axes are \('dp', 'tp'\)"
            ):
                mesh.to_device_mesh("cpu", axes=("tpp",))
            with pytest.raises(ValueError, match="must be distinct"):
                mesh.to_device_mesh("cpu", axes=("tp", 1))
        with pytest.raises(MeshClosedError, match="is closed"):
            mesh.to_device_mesh("cpu")
        with pytest.raises(TypeError, match="mesh must be a ProcessGroupMesh"):
            to_device_mesh(mesh.layout, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device_mesh must be a torch DeviceMesh"):
        layout_of(range(4))  # type: ignore[arg-type]


def test_device_meshes_are_equal_only_over_the_same_incarnations() -> None:
    """torch's DeviceMesh equality is structural; a scoped one adds its groups."""
    with fake_world(0, 4), ProcessGroupMesh(2, 2, names=("dp", "tp")) as first:
        dm = first.to_device_mesh("cpu")
        again = to_device_mesh(first, "cpu")
        assert isinstance(dm, ScopedDeviceMesh) and dm is not again
        assert dm == again and hash(dm) == hash(again)  # the same groups: one cache entry
        assert dm["tp"] == again["tp"] and isinstance(dm["tp"], ScopedDeviceMesh)
        assert copy.deepcopy(dm) is dm and copy.copy(dm) is dm
        with ProcessGroupMesh(2, 2, names=("dp", "tp")) as second:
            other = second.to_device_mesh("cpu")
            assert layout_of(other) == layout_of(dm)  # the same structure ...
            assert other != dm and hash(other) != hash(dm)  # ... over other groups
            assert other["tp"] != dm["tp"]
        groups = [first.get_group_along_axis(a) for a in ("dp", "tp")]
        plain = DeviceMesh.from_group(groups, "cpu", dm.mesh, mesh_dim_names=("dp", "tp"))
        assert plain == DeviceMesh.from_group(groups, "cpu", dm.mesh, mesh_dim_names=("dp", "tp"))
        assert plain != dm and dm != plain  # torch's own is never equal to a scoped one
        with pytest.raises(MeshClosedError, match=r"this DeviceMesh belongs to .*which is closed"):
            other.get_group("tp")
        with pytest.raises(MeshClosedError, match=r"this DeviceMesh belongs to .*which is closed"):
            other["dp"]
    with pytest.raises(MeshClosedError, match=r"this DeviceMesh belongs to .*which is closed"):
        dm._flatten("dp_tp")


# ------------------------------------------------------- real collectives


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(device_mesh_world, 4, timeout=240.0)


def test_device_mesh_in_a_real_world(world: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(world):
        assert out["layout"] == out["mesh_layout"] == MeshLayout((2, 2), names=("dp", "tp"))
        assert out["dim_names"] == ("dp", "tp")
        assert out["coordinate"] == out["mesh_coordinate"] == divmod(rank, 2)
        assert out["same_groups"] and out["sliced_tp_group"] and out["submesh_group"]
        assert out["tp_dp_layout"] == MeshLayout((2, 2), names=("tp", "dp"), ranks=[0, 2, 1, 3])
        assert out["submesh_layout"] == MeshLayout(
            (2,), names=("tp",), ranks=[2 * (rank // 2), 2 * (rank // 2) + 1]
        )


def test_distribute_tensor_round_trips(world: list[dict[str, Any]]) -> None:
    full = FULL.tolist()
    for rank, out in enumerate(world):
        dp, tp = divmod(rank, 2)
        assert out["local"] == FULL[2 * dp : 2 * dp + 2, 3 * tp : 3 * tp + 3].tolist()
        assert out["full"] == full
        assert out["redistributed"] == full
        assert out["tp_dp_full"] == full


def test_tensor_parallel_and_fsdp2_run_on_it(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["tp_error"] < 1e-12
        assert out["fsdp_error"] < 1e-12
        assert out["fsdp_grad_error"] < 1e-12


def test_ddp_averages_gradients_over_exactly_the_dp_group(world: list[dict[str, Any]]) -> None:
    layout = MeshLayout((2, 2), names=("dp", "tp"))
    alone = [torch.tensor(local_grad(r), dtype=torch.float64) for r in range(4)]
    world_mean = torch.stack(alone).mean(0)
    for rank, out in enumerate(world):
        dp_ranks = layout.group(layout.unravel(rank), "dp")
        assert out["dp_ranks"] == list(dp_ranks) == [rank % 2, rank % 2 + 2]
        expected = torch.stack([alone[r] for r in dp_ranks]).mean(0)
        grad = torch.tensor(out["ddp_grad"], dtype=torch.float64)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(grad, world_mean)  # not the world's average
        assert not torch.allclose(grad, alone[rank])  # nor this rank's own gradient


def test_closing_the_mesh_destroys_every_group_torch_used(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["live_groups_in_scope"] == 3  # WORLD, dp, tp: torch made none of its own
        assert out["live_groups_after_close"] == 1  # WORLD only
        assert "is closed" in out["closed_error"]
        assert out["world_sum"] == 4.0  # WORLD still works


@pytest.mark.world(2)
def test_backend_override_gives_an_axis_a_group_of_that_backend(world: Any) -> None:
    import torch.testing._internal.distributed.fake_pg  # registers "fake"

    before = _c10d.live_group_count()
    with ProcessGroupMesh(1, 2, names=("pp", "tp")) as mesh:
        dm = mesh.to_device_mesh("cpu", backend_override={"pp": "fake"})
        pp, tp = dm.get_group("pp"), dm.get_group("tp")
        assert dist.get_backend(pp) == "fake"
        assert pp is mesh.get_group_along_axis("pp", backend="fake")  # the mesh's, kept once
        assert tp is mesh.get_group_along_axis("tp")  # not overridden: the mesh's backend
        assert dm.mesh_dim_names == ("pp", "tp")
        x = torch.ones(1)
        dist.all_reduce(x, group=tp)
        assert x.item() == 2.0
        again = mesh.to_device_mesh("cpu", backend_override={0: "fake"})
        assert again.get_group("pp") is pp
        assert _c10d.live_group_count() == before + 2
        with pytest.raises(TypeError, match=r"backend_override must map axes to backend names"):
            mesh.to_device_mesh("cpu", backend_override=["pp"])  # type: ignore[arg-type]
        with pytest.raises(AxisError, match=r"unknown backend_override 'dp'"):
            mesh.to_device_mesh("cpu", backend_override={"dp": "fake"})
        with pytest.raises(ValueError, match=r"backend_override\['tp'\] 'nonsense'"):
            mesh.to_device_mesh("cpu", backend_override={"tp": "nonsense"})
    assert _c10d.live_group_count() == before
