"""Moved to :mod:`scopedmesh.mesh.heal`; this module keeps ``import scopedmesh.heal`` working."""

from scopedmesh.mesh.heal import LostRankError, agree_on_lost, reform

__all__ = ["LostRankError", "agree_on_lost", "reform"]
