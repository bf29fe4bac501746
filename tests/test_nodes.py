"""world_nodes and node_aware_mesh on real gloo worlds (the two-node launch is test_multinode)."""

from __future__ import annotations

import _workers_nodes as workers
import pytest

from scopedmesh.placement import node_aware_ranks
from scopedmesh.testing import run_world


def test_host_names_and_torchrun_env_give_the_nodes_and_the_mesh_keeps_tp_inside() -> None:
    results = run_world(workers.nodes_and_mesh, 4, timeout=240)
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


def test_a_rank_that_never_joins_the_host_gather_is_a_timeout_error() -> None:
    message = run_world(workers.host_gather_times_out, 2, timeout=120)[0]
    assert "rank 0 waited 1.5 s for the host names of all 2 ranks" in message
    assert "every rank must call world_nodes / node_aware_mesh" in message


def test_bad_arguments_are_refused_before_any_communication() -> None:
    from scopedmesh.nodes import node_aware_mesh, world_nodes

    with pytest.raises(RuntimeError, match="init_process_group"):
        world_nodes()
    with pytest.raises(RuntimeError, match="init_process_group"):
        node_aware_mesh(2, intra_node=0, nodes=[0, 0])
    with pytest.raises(ValueError, match="source must be 'auto', 'env' or 'hostname', got 'dns'"):
        world_nodes(source="dns")  # type: ignore[arg-type]
