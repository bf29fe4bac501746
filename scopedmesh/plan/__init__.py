"""The plan layer: facts about a layout (``facts``, ``node_plan``), rendered as text,
JSON or SVG, and the ``scopedmesh plan`` command line. Pure: no torch.

>>> from scopedmesh.plan import make_plan
>>> make_plan((2, 2), names=("dp", "tp")).strides
(2, 1)
"""

from scopedmesh.plan.facts import (
    AxisPlan,
    Nodes,
    Plan,
    RankGroup,
    RankPlan,
    group_coord,
    make_plan,
    members,
    nth,
)

__all__ = [
    "AxisPlan",
    "Nodes",
    "Plan",
    "RankGroup",
    "RankPlan",
    "group_coord",
    "make_plan",
    "members",
    "nth",
]
