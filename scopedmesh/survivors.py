"""Moved to :mod:`scopedmesh.layout.survivors`; this module keeps ``import scopedmesh.survivors`` working."""

from scopedmesh.layout.survivors import lost_positions, shrink

__all__ = ["lost_positions", "shrink"]
