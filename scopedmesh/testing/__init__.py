"""Helpers for testing code that uses scopedmesh: run a function on a small local world.

Names load on first use, so the pytest plugin (:mod:`scopedmesh.testing.plugin`)
can register itself without importing torch.

>>> from scopedmesh.testing import run_world, WorldError, free_port
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scopedmesh.testing.launcher import WorldError, free_port, run_world

__all__ = ["WorldError", "free_port", "run_world"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from scopedmesh.testing import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'scopedmesh.testing' has no attribute {name!r}")
