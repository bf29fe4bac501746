"""torchtitan's ``tests/unit_tests/test_parallel_dims.py``, ported to ScopedParallelDims.

The facts (mesh names, sizes, enabled flags, loss and batch meshes, spmd meshes,
expert-parallel validation) and their expected values are torchtitan's; what
changes is what builds the meshes: one ProcessGroupMesh and its views, in one
process on torch's ``fake`` backend (any world size, no peer), where torchtitan's
tests use a 1- or 8-rank gloo world. Every difference is listed in
docs/torchtitan.md ("torchtitan's own tests") and marked ``DIFFERENCE`` here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="needs the extra: pip install 'scopedmesh[torchtitan]'")

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from scopedmesh import MeshClosedError, ProcessGroupMesh
from scopedmesh.c10d.groups import live_group_count
from scopedmesh.interop.torchtitan import (
    CHECKED_VERSION,
    ScopedParallelDims,
    check_torchtitan_version,
)


@contextmanager
def scoped_dims(world_size: int, rank: int = 0, **degrees: Any) -> Iterator[ScopedParallelDims]:
    """ScopedParallelDims of ``degrees`` over a fake world of ``world_size``; nothing left after."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        before = live_group_count()
        with ProcessGroupMesh(world_size, names=("world",)) as world:
            with ScopedParallelDims(world, **degrees) as dims:
                yield dims
        assert live_group_count() == before
    finally:
        dist.destroy_process_group()


def dims_of(world_size: int, **degrees: Any) -> ScopedParallelDims:
    """Validation only: the mesh is built lazily, so a fake world is opened and closed here."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with ProcessGroupMesh(world_size, names=("world",)) as world:
            return ScopedParallelDims(world, **degrees)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- TestParallelDimsValidation


def test_basic_initialization() -> None:
    dims = dims_of(8, dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, ep=1)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep) == (
        2,
        2,
        1,
        2,
        1,
        1,
    )
    assert dims.world_size == 8


def test_auto_calculate_dp_shard() -> None:
    assert dims_of(8, dp_replicate=2, dp_shard=-1, tp=2).dp_shard == 2


def test_validation_invalid_world_size() -> None:
    # DIFFERENCE: ValueError naming the product (torchtitan: AssertionError); the world
    # size is the mesh's, so the invalid case is degrees that do not fill a 10-rank mesh.
    with pytest.raises(ValueError, match=r"must be the mesh's 10 ranks, got 2\*2\*1\*2\*1 = 8"):
        dims_of(10, dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, ep=1)


def test_validation_zero_parallelism() -> None:
    # DIFFERENCE: ValueError (torchtitan: AssertionError).
    with pytest.raises(ValueError, match="dp_replicate must be a positive int, got 0"):
        dims_of(1, dp_replicate=0, dp_shard=1)


def test_validation_invalid_dp_shard() -> None:
    # DIFFERENCE: ValueError (torchtitan: AssertionError).
    with pytest.raises(ValueError, match=r"dp_shard must be a positive int, or -1"):
        dims_of(1, dp_replicate=1, dp_shard=0)


def test_enabled_properties() -> None:
    dims = dims_of(8, dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, ep=1)
    assert dims.dp_enabled and dims.dp_replicate_enabled and dims.dp_shard_enabled
    assert not dims.cp_enabled and dims.tp_enabled and not dims.pp_enabled
    assert not dims.ep_enabled and dims.fsdp_enabled
    dims = dims_of(2, dp_replicate=1, dp_shard=1, cp=2)
    assert not dims.dp_enabled and dims.cp_enabled and dims.dp_cp_enabled and dims.fsdp_enabled
    assert dims_of(2, dp_shard=2, ep=2).ep_enabled  # EP does not count in world_size
    assert dims_of(2, dp_shard=1, pp=2).pp_enabled


def test_non_data_parallel_size() -> None:
    assert dims_of(48, dp_replicate=2, dp_shard=2, cp=2, tp=3, pp=2).non_data_parallel_size == 12


def test_seq_len_divisor() -> None:
    assert dims_of(16, dp_replicate=2, dp_shard=1, cp=2, tp=4).seq_len_divisor == 16


# ---------------------------------------------------------------- TestParallelDimsMeshOperations


def test_get_mesh_invalid_name() -> None:
    with scoped_dims(1, dp_shard=1, spmd_backend="partial_dtensor") as dims:
        dims.build_mesh()
        with pytest.raises(ValueError, match="Invalid mesh dim"):
            dims.get_mesh("invalid_mesh")


def test_get_mesh_lazy_initialization() -> None:
    with scoped_dims(1, dp_shard=1) as dims:
        assert len(dims._single_axis_meshes) == 0
        assert dims.get_optional_mesh("tp") is None  # tp has size 1; build_mesh ran
        assert len(dims._single_axis_meshes) > 0
        assert len(dims.views) > 0


def test_single_rank_mesh_operations() -> None:
    with scoped_dims(1, dp_shard=1, spmd_backend="partial_dtensor") as dims:
        world_mesh = dims.build_mesh()
        assert world_mesh.size() == 1
        meshes = dims._single_axis_meshes
        for name in ("pp", "batch", "loss", "dp_replicate", "fsdp", "cp", "tp"):
            assert name in meshes
        for name in ("dp_replicate", "fsdp", "tp", "batch", "loss", "pp", "cp", "ep", "efsdp"):
            assert meshes[name].size() == 1, name
        assert dims.get_optional_mesh(["dp_replicate", "fsdp"]) is None
        assert dims.get_optional_mesh(["dp_replicate", "efsdp"]) is None
        for name in ("tp", "dp_replicate", "pp", "cp"):
            assert dims.get_optional_mesh(name) is None
        assert len(dims.get_all_one_dimensional_meshes()) == 0
        assert dims.world_mesh.size() == 1


def test_expert_parallelism_validation() -> None:
    assert dims_of(2, dp_replicate=1, dp_shard=2, ep=2).ep_enabled
    # DIFFERENCE: torchtitan accepts ep=3 over dp_shard*cp*tp = 2 (its dataclass does not
    # check; its build_mesh then fails, efsdp being 2 // 3 = 0). Refused here, at once.
    with pytest.raises(ValueError, match=r"ep must divide dp_shard\*cp\*tp = 2"):
        dims_of(4, dp_replicate=2, dp_shard=2, ep=3)
    dims = dims_of(4, dp_replicate=2, dp_shard=2, ep=2)
    assert dims.ep_enabled and dims.dp_replicate_enabled and dims.dp_shard_enabled


# ---------------------------------------------------------------- TestSpmdMeshes


def test_legacy_spmd_meshes() -> None:
    # DIFFERENCE: torchtitan's current test says spmd_backend="default"; 0.3.0 calls the
    # legacy path "partial_dtensor".
    with scoped_dims(8, dp_replicate=2, dp_shard=2, tp=2, spmd_backend="partial_dtensor") as dims:
        meshes = dims.spmd_meshes()
        flat = {axis for m in meshes for axis in (m.mesh_dim_names or ())}
        assert "dp_shard" not in flat
        dense = next(m for m in meshes if "tp" in (m.mesh_dim_names or ()))
        assert set(dense.mesh_dim_names) == {"dp_replicate", "fsdp", "tp"}


def test_full_dtensor_spmd_meshes() -> None:
    with scoped_dims(8, dp_replicate=2, dp_shard=2, tp=2, spmd_backend="full_dtensor") as dims:
        dense = next(m for m in dims.spmd_meshes() if "tp" in (m.mesh_dim_names or ()))
        assert dense.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")


def test_spmd_types_dense_mesh() -> None:
    # Not in torchtitan's tests: 0.3.0's default backend folds dp into one logical axis.
    with scoped_dims(8, dp_replicate=2, dp_shard=2, tp=2) as dims:
        assert dims.spmd_dense_mesh().mesh_dim_names == ("dp", "cp", "tp")
        assert dims.get_mesh("dp").size() == 4
        assert dims.get_mesh("dp_shard").size() == 2


# ---------------------------------------------------------------- TestParallelDimsWorld8MeshOperations


@pytest.mark.parametrize("rank", [0, 5])
def test_world_size_8_mesh_operations(rank: int) -> None:
    # DIFFERENCE: spmd_backend="partial_dtensor" (the test's 'fsdp' axis); torchtitan's
    # current test relies on its default, which 0.3.0 changed to "spmd_types".
    degrees = dict(dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, ep=1)
    with scoped_dims(8, rank, spmd_backend="partial_dtensor", **degrees) as dims:
        world_mesh = dims.build_mesh()
        assert world_mesh.size() == 8
        meshes = dims._single_axis_meshes
        for name in ("pp", "batch", "loss", "dp_replicate", "fsdp", "cp", "tp", "ep", "efsdp"):
            assert name in meshes
        sizes = {"pp": 1, "batch": 4, "loss": 4, "dp_replicate": 2, "fsdp": 2, "cp": 1, "tp": 2}
        sizes.update(ep=1, efsdp=4)
        assert {name: meshes[name].size() for name in sizes} == sizes
        assert dims.get_mesh(["dp_replicate", "fsdp"]).shape == (2, 2)
        assert dims.get_optional_mesh(["dp_replicate", "efsdp"]) is None  # efsdp: ep > 1 only
        for name in ("tp", "dp_replicate", "fsdp", "batch", "loss"):
            assert dims.get_mesh(name) is not None
        for name in ("pp", "cp", "ep"):
            assert dims.get_optional_mesh(name) is None
        assert dims.get_mesh(["dp_replicate", "fsdp"]).ndim == 2
        one_d = dims.get_all_one_dimensional_meshes()
        # DIFFERENCE: torchtitan's test lists 'efsdp' here, but 0.3.0 itself leaves it out at
        # ep = 1 (its _mesh_exist: efsdp exists only when ep > 1, and the axis is fake).
        assert set(one_d) == {"dp_replicate", "fsdp", "tp", "batch", "loss"}
        assert dims.world_mesh.size() == 8
        assert dims.dp_enabled and dims.dp_replicate_enabled and dims.dp_shard_enabled
        assert dims.fsdp_enabled and dims.tp_enabled
        assert not (dims.cp_enabled or dims.pp_enabled or dims.ep_enabled)
        assert dims.non_data_parallel_size == 2
        assert dims.seq_len_divisor == 4
        # Beyond torchtitan's facts: the ranks of each mesh, as torchtitan lays them out.
        assert dims.get_mesh("tp").mesh.tolist() == [rank - rank % 2, rank - rank % 2 + 1]
        assert dims.get_mesh("loss").mesh.tolist() == [rank % 2 + 2 * i for i in range(4)]


# ---------------------------------------------------------------- beyond torchtitan's tests


def test_meshes_are_views_and_close_with_the_dims() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        with ProcessGroupMesh(2, 4, names=("a", "b")) as mesh:  # any shape: only its ranks count
            before = live_group_count()
            dims = ScopedParallelDims(mesh, dp_shard=4, tp=2, spmd_backend="partial_dtensor")
            tp = dims.get_mesh("tp")
            assert live_group_count() > before
            assert tp.get_group() is dims.get_mesh(["fsdp", "tp"])["tp"].get_group()  # shared
            assert all(not view.closed for view in dims.views)
            views = dims.views
            dims.close()
            assert all(view.closed for view in views) and dims.views == ()
            assert live_group_count() == before
            with pytest.raises(MeshClosedError):
                tp.get_group()
            dims.close()  # idempotent
    finally:
        dist.destroy_process_group()


def test_bad_arguments_name_what_was_expected() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with ProcessGroupMesh(4) as mesh:
            with pytest.raises(TypeError, match="mesh must be a ProcessGroupMesh"):
                ScopedParallelDims(mesh.layout)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="tp must be an int, got '2'"):
                ScopedParallelDims(mesh, tp="2")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="spmd_backend must be one of"):
                ScopedParallelDims(mesh, spmd_backend="default")
            with pytest.raises(
                ValueError, match=r"dp_shard=-1 takes the rest.*= 3 does not divide"
            ):
                ScopedParallelDims(mesh, tp=3)
        with pytest.raises(ValueError, match="mesh must be open"):
            ScopedParallelDims(mesh)
    finally:
        dist.destroy_process_group()


def test_another_torchtitan_release_is_refused_by_name() -> None:
    assert check_torchtitan_version() == CHECKED_VERSION
    with pytest.raises(RuntimeError, match=r"checked against torchtitan 0\.3\.0 only.*0\.4\.0"):
        check_torchtitan_version("0.4.0")


@pytest.mark.parametrize("spmd_backend", ["partial_dtensor", "spmd_types"])
def test_expert_meshes_are_built_from_the_sparse_view(spmd_backend: str) -> None:
    # Not trained here (docs/torchtitan.md): the sparse mesh's sizes and ranks only.
    with scoped_dims(8, 6, dp_shard=4, tp=2, ep=4, spmd_backend=spmd_backend) as dims:
        assert dims.get_mesh("ep").size() == 4 and dims.get_mesh("efsdp").size() == 2
        assert dims.get_mesh("ep").mesh.tolist() == [4, 5, 6, 7]  # efsdp x ep = 2 x 4, C order
        assert dims.get_mesh("efsdp").mesh.tolist() == [2, 6]
        assert "efsdp" in dims.get_all_one_dimensional_meshes()
        if spmd_backend == "spmd_types":
            sparse = dims.spmd_sparse_mesh()
            assert sparse is not None and sparse.mesh_dim_names == ("dp_replicate", "efsdp", "ep")
