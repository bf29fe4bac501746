"""Moved to :mod:`scopedmesh.mesh.nodes`; this module keeps ``import scopedmesh.nodes`` working."""

from scopedmesh.mesh.nodes import node_aware_mesh, world_nodes

__all__ = ["node_aware_mesh", "world_nodes"]
