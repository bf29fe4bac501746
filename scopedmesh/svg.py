"""Moved to :mod:`scopedmesh.plan.svg`; this module keeps ``import scopedmesh.svg`` working."""

from scopedmesh.plan.svg import NODE_COLOURS, render_svg

__all__ = ["NODE_COLOURS", "render_svg"]
