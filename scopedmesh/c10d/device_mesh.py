"""A torch ``DeviceMesh`` built over a layout, this rank's coordinate and existing groups.

Below the mesh: it knows a layout, a coordinate and a way to get each axis's
group, never :class:`~scopedmesh.mesh.process_group_mesh.ProcessGroupMesh` itself, so the mesh
can call it and :mod:`scopedmesh.mesh.interop` can sit above the mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from scopedmesh.errors import shown
from scopedmesh.layout.mesh_layout import Axis, MeshLayout

__all__ = ["build_device_mesh"]


def build_device_mesh(
    layout: MeshLayout,
    coord: tuple[int, ...],
    device_type: str,
    axes: Sequence[Axis] | None,
    group_along: Callable[[int], ProcessGroup | None],
    *,
    keeps_order: bool,
) -> DeviceMesh:
    """A ``DeviceMesh`` over ``axes`` (default: all) through ``coord``.

    ``group_along(axis_index)`` gives the group of each selected axis; it is
    called only once the axes have been checked, in the order of ``axes``.
    ``keeps_order``: the groups list their members in mesh order, so DTensor's
    shard ``k`` lands on the rank at position ``k`` whatever the rank order;
    otherwise members ascend, and an axis whose ranks do not is refused.
    """
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(
            f"device_type must be a device name such as 'cpu', got {shown(device_type)}"
        )
    chosen = tuple(range(layout.ndim)) if axes is None else layout.axes_indices(axes)
    sub = layout.sub(coord, chosen)
    ranks = torch.tensor(sub.ranks, dtype=torch.int).reshape(sub.shape)
    names = tuple(layout.axis_name(a) if layout.names else f"axis{a}" for a in chosen)
    for dim, name in enumerate(names):
        if not keeps_order and sub.shape[dim] > 1 and not bool((ranks.diff(dim=dim) > 0).all()):
            raise ValueError(
                f"axis {name!r} lists ranks out of ascending order ({ranks.tolist()}); torch "
                "orders a group's members by global rank, so DTensor would misplace shards. "
                "Lay the mesh over ranks that ascend along the axes you convert (this torch's "
                "groups cannot keep their members in mesh order)"
            )
    groups: list[ProcessGroup] = []
    for a in chosen:
        group = group_along(a)
        if group is None:  # cannot happen: without indices, every rank is in its group
            raise RuntimeError(f"this rank has no group along axis {names[len(groups)]!r}")
        groups.append(group)
    return DeviceMesh.from_group(groups, device_type, ranks, mesh_dim_names=names)
