"""Top-level worker functions for tests/test_nodes.py (spawned children import them by name)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from scopedmesh.nodes import node_aware_mesh, world_nodes


def _sum(value: int, group: dist.ProcessGroup | None) -> int:
    t = torch.tensor([value])
    dist.all_reduce(t, group=group)
    return int(t.item())


def nodes_and_mesh(rank: int, world_size: int) -> dict[str, object]:
    """Nodes from host names (dealt round-robin), then from a torchrun-like environment."""
    host = f"node-{'ab'[rank % 2]}"  # ranks 0, 2 on node-a; 1, 3 on node-b
    result: dict[str, object] = {"hosts": world_nodes(source="hostname", host=host)}
    with node_aware_mesh(
        2, 2, names=("dp", "tp"), intra_node="tp", nodes="hostname", host=host, timeout=30
    ) as mesh:
        tp = mesh.get_group_along_axis("tp")
        result["table"] = mesh.layout.ranks
        result["tp"] = mesh.get_ranks_in_group(tp)
        result["tp_nodes"] = _sum(1 << (rank % 2), tp)  # one bit a node: 1 or 2 if on one node
        result["dp_ranks"] = _sum(rank, mesh.get_group_along_axis("dp"))
    try:
        world_nodes(source="env")
    except ValueError as error:
        result["env_error"] = str(error)
    per_node = 2
    os.environ.update(
        GROUP_RANK=str(rank // per_node),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_WORLD_SIZE=str(world_size // per_node),
    )
    result["env"] = world_nodes()  # "auto" finds torchrun's variables: no communication
    with node_aware_mesh(2, 2, names=("dp", "tp"), intra_node="dp", timeout=30) as mesh:
        dp = mesh.get_group_along_axis("dp")
        result["env_table"] = mesh.layout.ranks
        result["env_dp"] = mesh.get_ranks_in_group(dp)
    other = (rank + 1) % world_size  # a consistent torchrun environment, but another rank's
    os.environ.update(RANK=str(other), GROUP_RANK=str(other // 2), LOCAL_RANK=str(other % 2))
    errors = []
    calls = [
        lambda: world_nodes(source="env"),
        lambda: world_nodes(source="hostname", host=""),
        lambda: world_nodes(source="hostname", timeout=-1),
        lambda: node_aware_mesh(2, 2, intra_node=1, nodes="dns"),
        lambda: node_aware_mesh(2, 2, intra_node=1, nodes=[0, 0, 1]),
    ]
    for call in calls:
        try:
            call()
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    result["errors"] = errors
    return result


def host_gather_times_out(rank: int, world_size: int) -> str:
    """Rank 0 gathers host names; rank 1 never joins, but stays alive past the timeout."""
    if rank == 1:
        time.sleep(6)
        return ""
    try:
        world_nodes(source="hostname", timeout=1.5)
    except TimeoutError as error:
        return str(error)
    return "no error"
