"""Conversions between a ProcessGroupMesh and torch's DeviceMesh.

DTensor, FSDP2 and tensor parallelism take a ``DeviceMesh``; hand them one built
over the mesh's own groups, so the mesh stays their single owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from scopedmesh.layout import Axis, MeshLayout

if TYPE_CHECKING:
    from scopedmesh.mesh import ProcessGroupMesh

__all__ = ["layout_of", "to_device_mesh"]


def to_device_mesh(
    mesh: ProcessGroupMesh, device_type: str, axes: Sequence[Axis] | None = None
) -> DeviceMesh:
    """A ``DeviceMesh`` over ``axes`` (default: all) of ``mesh``, through this rank.

    Its groups are the mesh's own (missing ones are made now, so every member
    must call this in the same order). It is valid while ``mesh`` is open: when
    the mesh closes, its groups are destroyed and the DeviceMesh is unusable.
    Costs O(size of the selected axes) for the rank tensor DeviceMesh requires.
    """
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"device_type must be a device name such as 'cpu', got {device_type!r}")
    layout = mesh.layout
    chosen = tuple(range(layout.ndim)) if axes is None else layout.axes_indices(axes)
    sub = layout.sub(mesh.coordinate(), chosen)
    names = tuple(layout.axis_name(a) if layout.names else f"axis{a}" for a in chosen)
    groups = [mesh.get_group_along_axis(a) for a in chosen]
    ranks = torch.tensor(sub.ranks, dtype=torch.int).reshape(sub.shape)
    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh_dim_names=names)  # type: ignore[arg-type]
    return DeviceMesh.from_group(groups, device_type, ranks, mesh_dim_names=names)  # type: ignore[arg-type]


def layout_of(device_mesh: DeviceMesh) -> MeshLayout:
    """The MeshLayout of a ``DeviceMesh``: its rank tensor and dimension names.

    Useful to compare a DeviceMesh with a mesh: ``layout_of(dm) == mesh.layout``.
    """
    ranks = device_mesh.mesh.flatten().tolist()
    return MeshLayout(tuple(device_mesh.mesh.shape), device_mesh.mesh_dim_names, ranks)
