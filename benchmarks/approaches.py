"""The approaches measured side by side, each giving this rank's group along every axis.

``scopedmesh`` makes a group on first request, by its members only; ``devicemesh``
is torch's ``init_device_mesh``; ``naive`` is ColossalAI's classic
``ProcessGroupMesh``: every rank calls ``new_group`` for every group of every axis
and caches them all by their ranks; ``floor`` is the bare floor,
``new_group(ranks, use_local_synchronization=True)`` for the same groups the mesh
makes, and nothing else.

>>> members((2, 2, 2), 5, 0), members((2, 2, 2), 5, 2)
([1, 5], [4, 5])
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["APPROACHES", "NaiveMesh", "build", "close", "measure", "members", "preload"]

APPROACHES = ("scopedmesh", "devicemesh", "naive", "floor")


def members(shape: Sequence[int], rank: int, axis: int) -> list[int]:
    """The C-order group of ``rank`` along ``axis``: a reference independent of scopedmesh."""
    stride = math.prod(shape[axis + 1 :])
    base = rank - (rank // stride) % shape[axis] * stride
    return [base + i * stride for i in range(shape[axis])]


class NaiveMesh:
    """Every rank creates every group along an axis; a lookup recomputes this rank's ranks."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape, self.rank = tuple(shape), dist.get_rank()
        self.strides = tuple(math.prod(shape[a + 1 :]) for a in range(len(shape)))
        self.coord = tuple((self.rank // s) % n for s, n in zip(self.strides, self.shape))
        self.ranks_to_group: dict[tuple[int, ...], Any] = {}  # non-members cache torch's marker

    def _ranks_along(self, coord: Sequence[int], axis: int) -> tuple[int, ...]:
        base = sum(c * s for a, (c, s) in enumerate(zip(coord, self.strides)) if a != axis)
        return tuple(base + i * self.strides[axis] for i in range(self.shape[axis]))

    def get_group_along_axis(self, axis: int) -> Any:
        ranks = self._ranks_along(self.coord, axis)
        if ranks not in self.ranks_to_group:
            others = [range(n) if a != axis else range(1) for a, n in enumerate(self.shape)]
            for coord in itertools.product(*others):
                group_ranks = self._ranks_along(coord, axis)
                self.ranks_to_group[group_ranks] = dist.new_group(list(group_ranks))
        return self.ranks_to_group[ranks]


def preload() -> None:
    """Import every approach's modules, so that no timed region pays for an import."""
    import torch.distributed.device_mesh  # noqa: F401

    import scopedmesh.mesh  # noqa: F401


def build(impl: str, shape: Sequence[int], names: Sequence[str]) -> tuple[Any, list[Any]]:
    """A handle to keep alive and this rank's group along each axis, made by ``impl``."""
    if impl == "scopedmesh":
        from scopedmesh.mesh import ProcessGroupMesh

        mesh = ProcessGroupMesh(*shape, names=names)
        return mesh, [mesh.get_group_along_axis(name) for name in names]
    if impl == "devicemesh":
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
        return device_mesh, [device_mesh.get_group(name) for name in names]
    axes = range(len(shape))
    if impl == "naive":
        naive = NaiveMesh(shape)
        return naive, [naive.get_group_along_axis(axis) for axis in axes]
    if impl == "floor":
        rank = dist.get_rank()
        floor = [
            dist.new_group(members(shape, rank, a), use_local_synchronization=True) for a in axes
        ]
        return floor, floor
    raise ValueError(f"unknown approach {impl!r}; known: {APPROACHES}")


def close(impl: str, handle: Any) -> None:
    """Release what ``build`` made, where the approach can (DeviceMesh never destroys)."""
    if impl == "scopedmesh":
        handle.close()
    for group in handle if impl == "floor" else ():
        dist.destroy_process_group(group)


def measure(rank: int, world: int, shape: Sequence[int], names: Sequence[str], order: Sequence[str]) -> dict[str, float]:  # fmt: skip
    """Case (d) on each rank: seconds from a barrier until every group's first all_reduce is done.

    The approaches run one after another in ``order``, each after a barrier;
    their modules are imported and WORLD's connections warmed first.
    """
    torch.set_num_threads(1)
    preload()
    dist.all_reduce(torch.ones(1))
    seconds: dict[str, float] = {}
    handles = []
    for impl in order:
        dist.barrier()
        start = time.perf_counter()
        handles.append((impl, build(impl, shape, names)))
        sums = [torch.ones(1) for _ in shape]
        for value, group in zip(sums, handles[-1][1][1]):
            dist.all_reduce(value, group=group)
        seconds[impl] = time.perf_counter() - start
        if [v.item() for v in sums] != [float(n) for n in shape]:
            raise RuntimeError(f"{impl}: all_reduce sums {sums}, expected group sizes {shape}")
    dist.barrier()
    for impl, (handle, _) in reversed(handles):
        close(impl, handle)
    return seconds
