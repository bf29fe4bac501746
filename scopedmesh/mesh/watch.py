"""The import path of earlier releases: :class:`LivenessWatch` and the names tests reach for.

The watch lives in :mod:`scopedmesh.mesh.liveness`, one module per job; this
module re-exports what was importable from here.

>>> from scopedmesh.mesh.liveness import LivenessWatch as moved
>>> LivenessWatch is moved
True
"""

from __future__ import annotations

from scopedmesh.c10d.store import WATCH_ROOT as ROOT
from scopedmesh.mesh.liveness.agreement import Agreement
from scopedmesh.mesh.liveness.deaths import CLOSED, UNREACHABLE
from scopedmesh.mesh.liveness.deaths import parse_deaths as _deaths
from scopedmesh.mesh.liveness.ring import UNREACHABLE_AFTER
from scopedmesh.mesh.liveness.ring import keep_alive as _keep_alive
from scopedmesh.mesh.liveness.ring import reason_of as _reason
from scopedmesh.mesh.liveness.watch import MAX_INTERVAL, LivenessWatch, key_names

__all__ = [
    "CLOSED",
    "MAX_INTERVAL",
    "ROOT",
    "UNREACHABLE",
    "UNREACHABLE_AFTER",
    "Agreement",
    "LivenessWatch",
    "_deaths",
    "_keep_alive",
    "_reason",
    "key_names",
]
