"""torchtitan's ``ParallelDims`` over one ``ProcessGroupMesh`` and its views.

torchtitan's :meth:`ParallelDims.build_mesh` unflattens a 1-D world DeviceMesh
four or five times (dataloading, dense, sparse meshes) and flattens one (loss);
torch makes a process group per dimension of each, so one rank set gets several
communicators, and none is ever destroyed. :class:`ScopedParallelDims` is that
same ``ParallelDims`` (torchtitan's own accessors, validation and ``spmd_meshes``
run unchanged) whose ``build_mesh`` lays each of those meshes out as a
:meth:`~scopedmesh.ProcessGroupMesh.view` of one mesh instead. The views share
the mesh's group table, so every rank set has one communicator whichever
mesh asks for it; an axis torchtitan puts on the ``fake`` backend (degree 1,
where it does) gets a fake group, no real one; and ``close()`` (or leaving the
``with`` block) destroys every group the meshes made::

    import torch.testing._internal.distributed.fake_pg  # torch's "fake" backend, as torchtitan needs

    with ProcessGroupMesh(8, names=("world",)) as world:
        with ScopedParallelDims(world, dp_shard=4, tp=2, spmd_backend="partial_dtensor") as dims:
            model = parallelize_llama(model, parallel_dims=dims, ...)
            ...  # train
    # every group of the block is destroyed here

Why a subclass that overrides ``build_mesh``: torchtitan passes a
``ParallelDims`` everywhere and only ``build_mesh`` makes groups; everything
else reads the fields it fills (``_world_mesh``, ``_global_meshes``,
``_single_axis_meshes``, ``_spmd_meshes``). Filling those fields from views keeps
every other line torchtitan's. The fields and their layouts are those of the
torchtitan release named in :data:`CHECKED_VERSION`; another release is refused
with an error that names it (``docs/torchtitan.md``).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from types import TracebackType

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed.parallel_dims import ParallelDims

from scopedmesh.errors import shown
from scopedmesh.layout import Axis
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["CHECKED_VERSION", "ScopedParallelDims", "check_torchtitan_version"]

CHECKED_VERSION = "0.3.0"
"""The torchtitan release whose ``ParallelDims.build_mesh`` this module reproduces."""

_BACKENDS = ("partial_dtensor", "full_dtensor", "spmd_types")


def check_torchtitan_version(version: str | None = None) -> str:
    """The installed torchtitan version, if it is :data:`CHECKED_VERSION`; else a ``RuntimeError``.

    >>> check_torchtitan_version("0.3.0")
    '0.3.0'
    >>> check_torchtitan_version("0.4.0")
    Traceback (most recent call last):
    ...
    RuntimeError: scopedmesh.interop.torchtitan was checked against torchtitan 0.3.0 only, ...
    """
    found = importlib.metadata.version("torchtitan") if version is None else version
    if found != CHECKED_VERSION:
        raise RuntimeError(
            f"scopedmesh.interop.torchtitan was checked against torchtitan {CHECKED_VERSION} "
            f"only, and torchtitan {found} is installed: its ParallelDims.build_mesh may lay "
            "out or name its meshes differently. Install the checked release with "
            f"pip install 'torchtitan=={CHECKED_VERSION}' (or pip install 'scopedmesh[torchtitan]')"
        )
    return found


def _check_degree(value: object, argument: str, *, auto: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument} must be an int, got {shown(value)}")
    if value < 1 and not (auto and value == -1):
        expected = "a positive int, or -1 (the rest of the mesh)" if auto else "a positive int"
        raise ValueError(f"{argument} must be {expected}, got {value}")
    return value


class ScopedParallelDims(ParallelDims):  # type: ignore[misc]  # torchtitan ships no types
    """torchtitan's ``ParallelDims`` whose meshes are views of ``mesh``, closed with this object.

    ``mesh`` is an open :class:`~scopedmesh.ProcessGroupMesh` over the ranks that
    train (any shape: only its ranks, in C order, count; its size is torchtitan's
    ``world_size``). The degrees are torchtitan's (``dp_shard=-1`` takes the rest).
    Nothing is made until ``build_mesh`` (torchtitan calls it on first use of any
    mesh); each rank then makes one group per distinct rank set it belongs to.
    ``close()`` closes the views, which destroys their groups (``mesh``'s own
    are destroyed when ``mesh`` closes); afterwards every DeviceMesh handed out
    raises :class:`~scopedmesh.errors.MeshClosedError` when used.
    """

    # Eight keyword arguments are torchtitan's own signature, plus the mesh and device.
    def __init__(
        self,
        mesh: ProcessGroupMesh,
        *,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        spmd_backend: str = "spmd_types",
        device_type: str = "cpu",
    ) -> None:
        check_torchtitan_version()
        if not isinstance(mesh, ProcessGroupMesh):
            raise TypeError(f"mesh must be a ProcessGroupMesh, got {shown(mesh)}")
        if mesh.closed:
            raise ValueError(f"mesh must be open, got {mesh!r}")
        degrees = {"dp_replicate": dp_replicate, "cp": cp, "tp": tp, "pp": pp, "ep": ep}
        for name, value in degrees.items():
            _check_degree(value, name)
        _check_degree(dp_shard, "dp_shard", auto=True)
        if spmd_backend not in _BACKENDS:
            raise ValueError(f"spmd_backend must be one of {_BACKENDS}, got {shown(spmd_backend)}")
        world = mesh.layout.size
        _check_product(world, dp_replicate, dp_shard, cp, tp, pp, ep)
        super().__init__(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            cp=cp,
            tp=tp,
            pp=pp,
            ep=ep,
            world_size=world,
            spmd_backend=spmd_backend,
        )
        self._scopedmesh_root = mesh
        self._scopedmesh_device = device_type
        self._scopedmesh_views: list[ProcessGroupMesh] = []

    # ------------------------------------------------------------------ lifetime

    def __enter__(self) -> ScopedParallelDims:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the views (newest first): every group only they hold is destroyed. Idempotent."""
        views, self._scopedmesh_views = self._scopedmesh_views, []
        for view in reversed(views):
            view.close()

    @property
    def views(self) -> tuple[ProcessGroupMesh, ...]:
        """The views ``build_mesh`` laid over the mesh, oldest first (empty before it, or after close)."""
        return tuple(self._scopedmesh_views)

    # ------------------------------------------------------------------ meshes

    def _view_mesh(self, names: Sequence[str], degrees: Sequence[int]) -> DeviceMesh:
        """A DeviceMesh over a new view ``degrees`` named ``names``; torchtitan's absent axes on fake."""
        view = self._scopedmesh_root.view(*degrees, names=tuple(names))
        self._scopedmesh_views.append(view)
        fake: dict[Axis, str] = {
            n: "fake" for n, d in zip(names, degrees) if not self._mesh_exist(n, d)
        }
        return view.to_device_mesh(self._scopedmesh_device, backend_override=fake)

    def build_mesh(self) -> DeviceMesh:
        """torchtitan 0.3.0's ``build_mesh``, each unflattened or flattened mesh a view of one mesh.

        Fills the same fields with meshes of the same names, shapes and ranks; a
        second call (torchtitan calls it lazily) closes the first call's views.
        """
        if self._scopedmesh_views:
            self.close()
        if self._scopedmesh_root.closed:
            raise ValueError(f"the mesh of these ParallelDims is closed: {self._scopedmesh_root!r}")
        _require_fake_backend()
        pp, cp, tp, ep = self.pp, self.cp, self.tp, self.ep
        dp_replicate, dp_shard = self.dp_replicate, self.dp_shard
        batch, fsdp = dp_replicate * dp_shard, dp_shard * cp
        efsdp = fsdp * tp // ep
        world = self._view_mesh(("world",), (self.world_size,))
        dataloading = self._view_mesh(("pp", "batch", "cp", "tp"), (pp, batch, cp, tp))
        loss = self._view_mesh(("pp", "loss_mesh", "tp"), (pp, batch * cp, tp))["loss_mesh"]
        spmd_dense: DeviceMesh | None = None
        if self.spmd_backend == "partial_dtensor":
            dense = self._view_mesh(
                ("pp", "dp_replicate", "fsdp", "tp"), (pp, dp_replicate, fsdp, tp)
            )
        else:
            names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
            dense = self._view_mesh(names, (pp, dp_replicate, dp_shard, cp, tp))
            if self.spmd_backend == "spmd_types":
                fwdbwd = self._view_mesh(("pp", "dp", "cp", "tp"), (pp, batch, cp, tp))
                spmd_dense = fwdbwd["dp", "cp", "tp"]
        sparse = self._view_mesh(
            ("pp", "dp_replicate", "efsdp", "ep"), (pp, dp_replicate, efsdp, ep)
        )
        self._world_mesh = world
        self._fill_fields(dataloading, loss, dense, sparse, spmd_dense)
        return world

    def _fill_fields(
        self,
        dataloading: DeviceMesh,
        loss: DeviceMesh,
        dense: DeviceMesh,
        sparse: DeviceMesh,
        spmd_dense: DeviceMesh | None,
    ) -> None:
        """The fields torchtitan's ``build_mesh`` fills, from these meshes, as it fills them."""
        self._global_meshes = {"dataloading": dataloading, "loss": loss, "dense": dense}
        self._global_meshes["sparse"] = sparse
        if spmd_dense is not None:
            self._global_meshes["spmd_dense_for_fwdbwd"] = spmd_dense
        if self.spmd_backend == "spmd_types" and self.ep > 1:
            self._global_meshes["spmd_sparse_for_fwdbwd"] = sparse["dp_replicate", "efsdp", "ep"]
        self._multi_axis_meshes: dict[tuple[str, ...], DeviceMesh] = {}
        self._single_axis_meshes = {
            "pp": dataloading["pp"],
            "batch": dataloading["batch"],
            "loss": loss,
            "dp_replicate": dense["dp_replicate"],
            "cp": dataloading["cp"],
            "tp": dataloading["tp"],
            "ep": sparse["ep"],
            "efsdp": sparse["efsdp"],
        }
        if self.spmd_backend == "partial_dtensor":
            self._single_axis_meshes["fsdp"] = dense["fsdp"]
        else:
            self._single_axis_meshes["dp_shard"] = dense["dp_shard"]
            if spmd_dense is not None:
                self._single_axis_meshes["dp"] = spmd_dense["dp"]
        self._validate_meshes()
        dense_axes = {
            "partial_dtensor": ["dp_replicate", "fsdp", "tp"],
            "full_dtensor": ["dp_replicate", "dp_shard", "cp", "tp"],
            "spmd_types": ["dp", "cp", "tp"],
        }[self.spmd_backend]
        activated = (
            self.get_activated_mesh(dense_axes),
            self.get_activated_mesh(["dp_replicate", "efsdp", "ep"]),
        )
        self._spmd_meshes = [m for m in activated if m is not None]

    def __repr__(self) -> str:
        degrees = ", ".join(
            f"{name}={getattr(self, name)}"
            for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        )
        return f"ScopedParallelDims({degrees}, over {self._scopedmesh_root!r})"


def _check_product(world: int, *degrees: int) -> None:
    dp_replicate, dp_shard, cp, tp, pp, ep = degrees
    rest = dp_replicate * cp * tp * pp
    shard = world // rest if dp_shard == -1 else dp_shard
    if dp_shard == -1 and world % rest:
        raise ValueError(
            f"dp_shard=-1 takes the rest of the mesh, but dp_replicate*cp*tp*pp = {rest} "
            f"does not divide the mesh's {world} ranks"
        )
    if dp_replicate * shard * cp * tp * pp != world:
        raise ValueError(
            f"dp_replicate*dp_shard*cp*tp*pp must be the mesh's {world} ranks, got "
            f"{dp_replicate}*{shard}*{cp}*{tp}*{pp} = {dp_replicate * shard * cp * tp * pp}"
        )
    if (shard * cp * tp) % ep:
        raise ValueError(
            f"ep must divide dp_shard*cp*tp = {shard * cp * tp} (the expert mesh borrows "
            f"from them), got ep={ep}"
        )


def _require_fake_backend() -> None:
    if "fake" not in dist.Backend.backend_list:
        raise RuntimeError(
            "torchtitan puts the axes it does not use on torch's 'fake' backend, which this "
            "torch registers only when torch.testing._internal.distributed.fake_pg is "
            "imported (torchtitan's own build_mesh needs it too); import it before building"
        )
