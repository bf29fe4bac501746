"""Moved to :mod:`scopedmesh.plan.cli`; this module keeps ``import scopedmesh.cli`` working."""

from scopedmesh.plan.cli import main

__all__ = ["main"]
