"""Moved to :mod:`scopedmesh.layout.placement`; this module keeps ``import scopedmesh.placement`` working."""

from scopedmesh.layout.placement import node_aware_ranks, node_numbers, nodes_from_env

__all__ = ["node_aware_ranks", "node_numbers", "nodes_from_env"]
