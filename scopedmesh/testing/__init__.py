"""Helpers for testing code that uses scopedmesh: run a function on a small local world.

>>> from scopedmesh.testing import run_world, WorldError, free_port
"""

from __future__ import annotations

from scopedmesh.testing.launcher import WorldError, free_port, run_world

__all__ = ["WorldError", "free_port", "run_world"]
