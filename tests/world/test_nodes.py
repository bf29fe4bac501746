"""world_nodes and node_aware_mesh on real gloo worlds (the two-node launch is test_multinode)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from scopedmesh.layout.placement import node_aware_ranks
from scopedmesh.mesh.nodes import node_aware_mesh, world_nodes
from scopedmesh.testing import run_world

# ------------------------------------------------------------ what each rank runs


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


# ------------------------------------------------------------ the tests


def test_host_names_and_torchrun_env_give_the_nodes_and_the_mesh_keeps_tp_inside() -> None:
    results = run_world(nodes_and_mesh, 4, timeout=240)
    interleaved = (0, 1, 0, 1)
    table = node_aware_ranks((2, 2), interleaved, "tp", names=("dp", "tp"))
    assert table == (0, 2, 1, 3)
    for rank, result in enumerate(results):
        assert result["hosts"] == interleaved
        assert result["table"] == table
        assert result["tp"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert result["tp_nodes"] == 2 * (1 << (rank % 2))  # both members on this rank's node
        assert result["dp_ranks"] == (1 if rank in (0, 1) else 5)  # dp pairs {0,1} and {2,3}
        assert "source='env' needs torchrun's GROUP_RANK" in str(result["env_error"])
        assert result["env"] == (0, 0, 1, 1)
        assert result["env_table"] == (0, 2, 1, 3)  # dp inside a node: dp groups {0,1}, {2,3}
        assert result["env_dp"] == ([0, 1] if rank < 2 else [2, 3])
        assert result["errors"] == [
            f"ValueError: torchrun's environment (RANK={(rank + 1) % 4}, WORLD_SIZE=4) does not "
            f"describe this process group (rank {rank} of 4); use source='hostname' or pass "
            "each rank's node",
            "ValueError: host must be a non-empty string, got ''",
            "ValueError: timeout must be positive, got -1",
            "ValueError: nodes must be 'auto', 'env', 'hostname' or a node label per rank, "
            "got 'dns'",
            "ValueError: nodes must label every rank of the world (4 ranks), got 3 labels",
        ]


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_a_rank_that_never_joins_the_host_gather_is_a_timeout_error() -> None:
    message = run_world(host_gather_times_out, 2, timeout=120)[0]
    assert "rank 0 waited 1.5 s for the host names of all 2 ranks" in message
    assert "every rank must call world_nodes / node_aware_mesh" in message


def test_bad_arguments_are_refused_before_any_communication() -> None:
    from scopedmesh.mesh.nodes import node_aware_mesh, world_nodes

    with pytest.raises(RuntimeError, match="init_process_group"):
        world_nodes()
    with pytest.raises(RuntimeError, match="init_process_group"):
        node_aware_mesh(2, intra_node=0, nodes=[0, 0])
    with pytest.raises(ValueError, match="source must be 'auto', 'env' or 'hostname', got 'dns'"):
        world_nodes(source="dns")  # type: ignore[arg-type]
