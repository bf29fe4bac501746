"""Conversions between a ProcessGroupMesh and torch's DeviceMesh (above the mesh).

DTensor, FSDP2 and tensor parallelism take a ``DeviceMesh``; hand them one built
over the mesh's own groups, so the mesh stays their single owner::

    with ProcessGroupMesh(2, 2, 2, names=("dp", "pp", "tp")) as mesh:
        dm = mesh.to_device_mesh("cpu")       # axes dp, pp, tp; no new group
        fully_shard(model, mesh=dm["dp"])     # FSDP2 over the mesh's dp group
    # the groups under dm are destroyed here: using dm raises MeshClosedError
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

from scopedmesh.errors import shown
from scopedmesh.layout.mesh_layout import Axis, MeshLayout
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["layout_of", "to_device_mesh"]


def to_device_mesh(
    mesh: ProcessGroupMesh, device_type: str, axes: Sequence[Axis] | None = None
) -> DeviceMesh:
    """A ``DeviceMesh`` over ``axes`` (default: all, in mesh order) of ``mesh``, through this rank.

    Its groups are the mesh's own (missing ones are made now, so every member
    must call this in the same order). Unnamed axes are called ``axis0``,
    ``axis1``, ... Costs O(size of the selected axes) for the rank tensor
    DeviceMesh requires. ``device_type`` is a device type without an index
    (``'cpu'``, ``'cuda'``), as for ``init_device_mesh``; anything else is a
    ``ValueError``.

    The DeviceMesh belongs to the mesh's scope (a
    :class:`~scopedmesh.c10d.device_mesh.ScopedDeviceMesh`): it equals only a
    DeviceMesh over the same groups, so DTensor's caches never carry another
    block's work onto these groups, nor this block's onto another's; the
    meshes torch derives from it (``dm["tp"]``, ``dm["dp", "cp"]._flatten()``,
    ``_unflatten``) are scoped too, and a group torch makes for them is
    destroyed when the mesh closes. After that, using the DeviceMesh, or a
    DTensor on it, raises :class:`~scopedmesh.errors.MeshClosedError`.

    Shard ``k`` of an axis lands on the rank at position ``k`` along it,
    whatever order the mesh lays its ranks in: the mesh's groups keep their
    members in mesh order. Only on a torch whose internals scopedmesh does not
    recognise (groups then list members ascending) is an axis whose ranks do
    not ascend refused with a ``ValueError``.

    >>> import torch.distributed as dist
    >>> from scopedmesh import ProcessGroupMesh
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> with ProcessGroupMesh(1, 1, names=("dp", "tp")) as mesh:
    ...     dm = to_device_mesh(mesh, "cpu")
    ...     dm.mesh_dim_names, dm.get_group("tp") is mesh.get_group_along_axis("tp")
    (('dp', 'tp'), True)
    >>> dist.destroy_process_group()
    """
    if not isinstance(mesh, ProcessGroupMesh):
        raise TypeError(f"mesh must be a ProcessGroupMesh, got {shown(mesh)}")
    return mesh.to_device_mesh(device_type, axes)


def layout_of(device_mesh: DeviceMesh) -> MeshLayout:
    """The MeshLayout of a ``DeviceMesh``: its rank tensor and dimension names.

    Useful to compare a DeviceMesh with a mesh: ``layout_of(dm) == mesh.layout``.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch DeviceMesh, got {shown(device_mesh)}")
    ranks = device_mesh.mesh.flatten().tolist()
    return MeshLayout(tuple(device_mesh.mesh.shape), device_mesh.mesh_dim_names, ranks)
