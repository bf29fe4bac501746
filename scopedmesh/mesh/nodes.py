"""Where ranks are: every rank's node, and a mesh whose chosen axes stay inside a node.

:func:`world_nodes` answers from torchrun's environment when present (no
communication), else with **one all-gather of host names over WORLD**, the one
collective this module performs. :func:`node_aware_mesh` hands the nodes to
:func:`scopedmesh.layout.placement.node_aware_ranks` and returns a ``ProcessGroupMesh``
over that table.

>>> import torch.distributed as dist
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
>>> world_nodes(source="hostname")
(0,)
>>> with node_aware_mesh(1, 1, names=("dp", "tp"), intra_node="tp", nodes=["a"]) as mesh:
...     mesh.layout.ranks
(0,)
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import os
import socket
from collections.abc import Hashable, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from scopedmesh.c10d.checks import check_timeout
from scopedmesh.errors import shown
from scopedmesh.layout import Axes, MeshLayout
from scopedmesh.layout.placement import node_aware_ranks, node_numbers, nodes_from_env
from scopedmesh.mesh.process_group_mesh import ProcessGroupMesh

__all__ = ["node_aware_mesh", "world_nodes"]

Source = Literal["auto", "env", "hostname"]
HOST_BYTES = 256  # a host name is at most 255 bytes (RFC 1035); one fixed-size tensor a rank
DEFAULT_TIMEOUT = timedelta(seconds=60)


def world_nodes(
    *, source: Source = "auto", host: str | None = None, timeout: timedelta | float | None = None
) -> tuple[int, ...]:
    """The node (0, 1, ...; numbered by lowest rank) of every rank of WORLD.

    ``source="env"`` reads torchrun's variables (``GROUP_RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``RANK``, ``WORLD_SIZE``; see
    :func:`~scopedmesh.layout.placement.nodes_from_env`) and communicates with no one.
    ``source="hostname"`` all-gathers every rank's ``host`` (default
    ``socket.gethostname()``) over WORLD: every rank must call it, and it waits
    at most ``timeout`` (default 60 s) before a ``TimeoutError`` naming what it
    waited for. ``"auto"`` uses the environment under torchrun, else host names.
    """
    if source not in ("auto", "env", "hostname"):
        raise ValueError(f"source must be 'auto', 'env' or 'hostname', got {shown(source)}")
    if not dist.is_initialized():
        raise RuntimeError(
            "world_nodes needs torch.distributed: call torch.distributed.init_process_group() first"
        )
    wait = DEFAULT_TIMEOUT if timeout is None else check_timeout(timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if source != "hostname":
        nodes = nodes_from_env(os.environ)
        if nodes is not None:
            seen = (int(os.environ["RANK"]), len(nodes))
            if seen != (rank, world):
                raise ValueError(
                    f"torchrun's environment (RANK={seen[0]}, WORLD_SIZE={seen[1]}) does not "
                    f"describe this process group (rank {rank} of {world}); use "
                    f"source='hostname' or pass each rank's node"
                )
            return nodes
        if source == "env":
            raise ValueError(
                "source='env' needs torchrun's GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, RANK "
                "and WORLD_SIZE in the environment; use source='hostname' elsewhere"
            )
    return node_numbers(_gather_hosts(host, wait, rank, world))


def _gather_hosts(host: str | None, wait: timedelta, rank: int, world: int) -> list[str]:
    """Every rank's host name, by one all-gather of fixed-size byte tensors over WORLD."""
    name = socket.gethostname() if host is None else host
    if not isinstance(name, str):
        raise TypeError(f"host must be a string, got {shown(name)}")
    if not name:
        raise ValueError("host must be a non-empty string, got ''")
    if "\x00" in name:  # the all-gather pads with NUL bytes: a NUL would cut the name short
        raise ValueError(f"host must not contain a NUL character, got {shown(name)}")
    try:
        data = name.encode()
    except UnicodeEncodeError:
        raise ValueError(f"host must be encodable as UTF-8, got {shown(name)}") from None
    if len(data) >= HOST_BYTES:
        raise ValueError(f"host must be under {HOST_BYTES} bytes, got {len(data)}: {shown(name)}")
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # nccl moves only GPU tensors
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.zeros(HOST_BYTES, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(every, mine, async_op=True)
    assert work is not None  # async_op=True returns the work
    try:
        done = work.wait(wait)
    except RuntimeError as error:
        raise TimeoutError(
            f"rank {rank} waited {wait.total_seconds():g} s for the host names of all {world} "
            f"ranks (one all-gather over WORLD) and did not get them: every rank must call "
            f"world_nodes / node_aware_mesh; the failure was: {error}"
        ) from error
    if done is False:
        raise TimeoutError(
            f"rank {rank} waited {wait.total_seconds():g} s for the host names of all {world} "
            f"ranks (one all-gather over WORLD): every rank must call world_nodes / "
            f"node_aware_mesh"
        )
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in every]


def node_aware_mesh(
    *shape: int | Sequence[int],
    intra_node: Axes,
    names: Sequence[str] | None = None,
    nodes: Source | Sequence[Hashable] = "auto",
    host: str | None = None,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    pg_options: Any = None,
    eager: bool = False,
) -> ProcessGroupMesh:
    """A ``ProcessGroupMesh`` over WORLD whose ``intra_node`` axes never cross a node.

    ``nodes`` is a source for :func:`world_nodes` (``"auto"``, ``"env"``,
    ``"hostname"``) or every rank's node label. The table follows
    :func:`~scopedmesh.layout.placement.node_aware_ranks`; the other arguments are
    ``ProcessGroupMesh``'s (``timeout`` also bounds the host-name all-gather).
    Every rank computes the same table; only ``"hostname"`` (or ``"auto"``
    outside torchrun) communicates, once, at construction.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "node_aware_mesh needs torch.distributed: call "
            "torch.distributed.init_process_group() first"
        )
    dims = shape[0] if len(shape) == 1 and isinstance(shape[0], Sequence) else shape
    if isinstance(nodes, str):
        if nodes not in ("auto", "env", "hostname"):
            raise ValueError(
                f"nodes must be 'auto', 'env', 'hostname' or a node label per rank, got {shown(nodes)}"
            )
        labels: Sequence[Hashable] = world_nodes(source=nodes, host=host, timeout=timeout)  # type: ignore[arg-type]
    else:
        labels = nodes
        if isinstance(labels, Sequence) and len(labels) != dist.get_world_size():
            raise ValueError(
                f"nodes must label every rank of the world ({dist.get_world_size()} ranks), "
                f"got {len(labels)} labels"
            )
    table = node_aware_ranks(dims, labels, intra_node, names=names)  # type: ignore[arg-type]
    return ProcessGroupMesh.from_layout(
        MeshLayout(dims, names, table),  # type: ignore[arg-type]
        backend=backend,
        timeout=timeout,
        pg_options=pg_options,
        eager=eager,
    )
