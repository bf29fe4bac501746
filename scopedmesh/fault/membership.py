"""The membership of a replicated job: kept importable here; the rules live in
:mod:`scopedmesh.fault.protocol.membership`.

>>> from scopedmesh.fault.protocol import membership
>>> Decision is membership.Decision and propose is membership.propose
True
"""

from __future__ import annotations

from scopedmesh.fault.protocol.membership import (
    Decision,
    JobShape,
    Joining,
    complete_joiners,
    never_announced,
    no_state_left,
    propose,
)

__all__ = [
    "Decision",
    "JobShape",
    "Joining",
    "complete_joiners",
    "never_announced",
    "no_state_left",
    "propose",
]
