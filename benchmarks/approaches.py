"""The three ways to get this rank's group along every axis, measured side by side.

- ``scopedmesh``: :class:`scopedmesh.ProcessGroupMesh`, groups made on first request
  by their members only.
- ``devicemesh``: ``torch.distributed.device_mesh.init_device_mesh``.
- ``naive``: :class:`NaiveMesh`, the classic approach of ColossalAI's
  ``ProcessGroupMesh``: every rank calls ``dist.new_group(ranks)`` for every group
  of every axis, and caches all of them by their ranks.

Each ``build_*`` function returns a handle (kept alive by the caller) and this
rank's groups along each axis, in axis order. It assumes ``torch.distributed`` is
initialised. Nothing here is timed; the callers time it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["APPROACHES", "NaiveMesh", "build", "close", "preload", "total_groups"]

Groups = list[dist.ProcessGroup | None]


class NaiveMesh:
    """Every rank creates every group along an axis (ColossalAI ``ProcessGroupMesh`` style).

    Written for the benchmark from the public API only: C-order ranks, ``dist.new_group``
    called by all ranks for every group, and a ``ranks -> group`` cache holding every
    group (non-members cache torch's non-member marker, as ColossalAI does).
    """

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)
        self.rank = dist.get_rank()
        strides = [1] * len(self.shape)
        for i in range(len(self.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * self.shape[i + 1]
        self.strides = tuple(strides)
        self.coord = tuple((self.rank // s) % n for s, n in zip(self.strides, self.shape))
        self.ranks_to_group: dict[tuple[int, ...], Any] = {}

    def _ranks_along(self, coord: Sequence[int], axis: int) -> tuple[int, ...]:
        base = sum(c * s for a, (c, s) in enumerate(zip(coord, self.strides)) if a != axis)
        step = self.strides[axis]
        return tuple(base + i * step for i in range(self.shape[axis]))

    def create_group_along_axis(self, axis: int) -> dist.ProcessGroup | None:
        """Every rank calls ``new_group`` for every group along ``axis``; keep this rank's."""
        mine: dist.ProcessGroup | None = None
        others = [range(n) if a != axis else range(1) for a, n in enumerate(self.shape)]
        for coord in itertools.product(*others):
            ranks = self._ranks_along(coord, axis)
            group = dist.new_group(list(ranks))
            self.ranks_to_group[ranks] = group
            if self.rank in ranks:
                mine = group
        return mine

    def get_group_along_axis(self, axis: int) -> dist.ProcessGroup | None:
        """Recompute this rank's ranks along ``axis`` and look the group up (ColossalAI style)."""
        ranks = self._ranks_along(self.coord, axis)
        if ranks not in self.ranks_to_group:
            return self.create_group_along_axis(axis)
        group: dist.ProcessGroup | None = self.ranks_to_group[ranks]
        return group


def preload() -> None:
    """Import every approach's modules, so that no timed region pays for an import."""
    import torch.distributed.device_mesh  # noqa: F401

    import scopedmesh.mesh  # noqa: F401


def build_scopedmesh(shape: Sequence[int], names: Sequence[str]) -> tuple[Any, Groups]:
    """A scopedmesh mesh and this rank's group along each axis."""
    from scopedmesh.mesh import ProcessGroupMesh

    mesh = ProcessGroupMesh(*shape, names=names)
    return mesh, [mesh.get_group_along_axis(name) for name in names]


def build_devicemesh(shape: Sequence[int], names: Sequence[str]) -> tuple[Any, Groups]:
    """A torch DeviceMesh and this rank's group along each axis."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    return mesh, [mesh.get_group(name) for name in names]


def build_naive(shape: Sequence[int], names: Sequence[str]) -> tuple[Any, Groups]:
    """A :class:`NaiveMesh` and this rank's group along each axis (all groups made)."""
    mesh = NaiveMesh(shape)
    return mesh, [mesh.get_group_along_axis(axis) for axis in range(len(shape))]


APPROACHES: dict[str, Callable[[Sequence[int], Sequence[str]], tuple[Any, Groups]]] = {
    "scopedmesh": build_scopedmesh,
    "devicemesh": build_devicemesh,
    "naive": build_naive,
}


def build(impl: str, shape: Sequence[int], names: Sequence[str]) -> tuple[Any, Groups]:
    """Build with approach ``impl``; a ValueError names the known approaches."""
    try:
        builder = APPROACHES[impl]
    except KeyError:
        raise ValueError(f"unknown approach {impl!r}; known: {sorted(APPROACHES)}") from None
    return builder(shape, names)


def close(impl: str, handle: Any) -> None:
    """Release what ``build`` made, where the approach can (DeviceMesh never destroys)."""
    if impl == "scopedmesh":
        handle.close()


def total_groups(shape: Sequence[int]) -> int:
    """How many groups exist along all single axes of ``shape`` (what ``naive`` creates)."""
    world = math.prod(shape)
    return sum(world // n for n in shape)
