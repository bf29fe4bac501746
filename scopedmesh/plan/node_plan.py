"""What ``scopedmesh plan ... --nproc-per-node N --intra-node A,B`` adds (pure, no torch).

The node-aware table of :func:`~scopedmesh.layout.placement.node_aware_ranks` for ranks
numbered node by node (node = rank // N, as torchrun numbers them), and where
each axis's groups then sit. ``--json`` adds it as ``"node_aware"``::

    {"intra_node": ["dp", "tp"],     # the axes kept inside a node, in mesh order
     "ranks": [0, 1, 4, 5, ...],     # the table: ranks= for MeshLayout / ProcessGroupMesh
     "grid": [[[0, 1], ...]],        # the same, nested like the shape
     "axes": [{"axes": ["dp"], "placement": "intra-node",  # or "cross-node", "mixed"
               "span": [1, 1],       # fewest and most nodes a group spans
               "groups": [[0, 2], ...]}]}  # ascending, in C order of the other axes

>>> plan = make_node_plan(MeshLayout((2, 2, 2), names=("dp", "pp", "tp")), "dp,tp", 4)
>>> plan.layout.ranks
(0, 1, 4, 5, 2, 3, 6, 7)
>>> [(a.label, a.placement, a.span) for a in plan.axes]
[('dp', 'intra-node', (1, 1)), ('pp', 'cross-node', (2, 2)), ('tp', 'intra-node', (1, 1)), ('dp,tp', 'intra-node', (1, 1))]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scopedmesh.errors import clipped, shown
from scopedmesh.layout.mesh_layout import MeshLayout
from scopedmesh.layout.placement import node_aware_ranks
from scopedmesh.plan.arithmetic import nested

__all__ = ["MAX_WORLD", "NodeAxis", "NodePlan", "make_node_plan"]

MAX_WORLD = 1 << 22  # the table is O(world): beyond this the CLI refuses rather than crawl
WIDTH = 100  # text width the group lists wrap to


@dataclass(frozen=True)
class NodeAxis:
    """The groups along ``axes`` in the node-aware layout, and the nodes they span."""

    axes: tuple[int, ...]
    label: str
    placement: str  # "intra-node", "cross-node" or "mixed"
    span: tuple[int, int]
    groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class NodePlan:
    """The node-aware layout at ``nproc`` ranks per node."""

    layout: MeshLayout
    intra: tuple[int, ...]
    nproc: int
    axes: tuple[NodeAxis, ...]

    def document(self, labels: Sequence[str]) -> dict[str, object]:
        """The ``"node_aware"`` entry of ``--json``."""
        return {
            "intra_node": [labels[a] for a in self.intra],
            "ranks": list(self.layout.ranks),
            "grid": nested(self.layout.ranks, self.layout.shape),
            "axes": [
                {
                    "axes": [labels[i] for i in a.axes],
                    "placement": a.placement,
                    "span": list(a.span),
                    "groups": [list(g) for g in a.groups],
                }
                for a in self.axes
            ],
        }

    def lines(self, labels: Sequence[str], grid: list[str], full: bool) -> list[str]:
        """The text section: a heading, ``grid`` (the table's grid lines), each axis's groups."""
        inside = ", ".join(labels[a] for a in self.intra) or "no axis"
        lines = [f"node-aware layout: {inside} inside a node (node = rank // {self.nproc})", ""]
        lines += grid
        width = max(len(a.label) for a in self.axes)
        for a in self.axes:
            where = a.placement
            if a.placement != "intra-node":
                low, high = a.span
                where += (
                    f": groups span {low} to {high} nodes"
                    if low != high
                    else (f": each group spans {low} nodes")
                )
            lines.append(f"{a.label:<{width}}  {where}")
            if not full:
                lines.append(f"{'':<{width}}  (--full lists the groups)")
                continue
            line = ""
            for group in (str(list(g)) for g in a.groups):
                if line and len(line) + len(group) + width + 4 > WIDTH:
                    lines.append(f"{'':<{width}}  {line}")
                    line = ""
                line = f"{line}  {group}" if line else group
            lines.append(f"{'':<{width}}  {line}")
        return lines


def make_node_plan(layout: MeshLayout, spec: str, nproc: int | None) -> NodePlan:
    """The node-aware plan for ``--intra-node SPEC`` over ``layout``'s shape and names."""
    if not isinstance(layout, MeshLayout):
        raise TypeError(f"layout must be a MeshLayout, got {shown(layout)}")
    if not isinstance(spec, str):
        raise TypeError(
            f"--intra-node must be axis names or indices joined by ',', got {shown(spec)}"
        )
    if nproc is None:
        raise ValueError("--intra-node needs --nproc-per-node, the number of ranks per node")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"--nproc-per-node must be a positive int, got {shown(nproc)}")
    if layout.size > MAX_WORLD:
        raise ValueError(f"--intra-node lists every rank: at most {MAX_WORLD}, got {layout.size}")
    labels = layout.names or tuple(f"axis{a}" for a in range(layout.ndim))
    intra = []
    for token in (t.strip() for t in spec.split(",")):
        if token in labels:
            intra.append(labels.index(token))
        elif token.lstrip("-").isdigit():
            intra.append(layout.axis_index(int(token), argument="--intra-node"))
        else:
            known = ", ".join(labels)
            raise ValueError(
                f"unknown axis {shown(token)} in --intra-node {clipped(spec)}; the axes are {clipped(known)}"
            )
    if len(set(intra)) != len(intra):
        raise ValueError(f"--intra-node must name distinct axes, got {clipped(spec)}")
    if layout.size % nproc:
        raise ValueError(
            f"--intra-node needs whole nodes: {layout.size} ranks is not a multiple of "
            f"--nproc-per-node {nproc}"
        )
    nodes = [r // nproc for r in range(layout.size)]
    table = node_aware_ranks(layout.shape, nodes, tuple(intra), names=layout.names)
    aware = MeshLayout(layout.shape, names=layout.names, ranks=table)
    sets: list[tuple[int, ...]] = [(a,) for a in range(layout.ndim)]
    if len(intra) > 1:
        sets.append(tuple(sorted(intra)))
    axes = []
    for axis_set in sets:
        groups = aware.groups(axis_set)
        spans = [len({r // nproc for r in g}) for g in groups]
        placement = "intra-node" if max(spans) == 1 else "cross-node" if min(spans) > 1 else "mixed"
        label = ",".join(labels[a] for a in axis_set)
        axes.append(NodeAxis(axis_set, label, placement, (min(spans), max(spans)), groups))
    return NodePlan(aware, tuple(sorted(intra)), nproc, tuple(axes))
