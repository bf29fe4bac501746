"""Moved to :mod:`scopedmesh.plan.node_plan`; this module keeps ``import scopedmesh.nodeplan`` working."""

from scopedmesh.plan.node_plan import MAX_WORLD, NodeAxis, NodePlan, make_node_plan

__all__ = ["MAX_WORLD", "NodeAxis", "NodePlan", "make_node_plan"]
