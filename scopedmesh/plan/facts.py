"""The facts ``scopedmesh plan`` prints: a mesh's groups, their nodes, one rank's view.

Pure integer facts from :class:`~scopedmesh.layout.mesh_layout.MeshLayout` (no torch), which
:mod:`scopedmesh.plan.cli` renders as text; the group arithmetic is in
:mod:`scopedmesh.plan.arithmetic`. Above 64 ranks (unless ``full``) the lists
are summarised and nothing costs O(world). Bad input raises ``ValueError`` naming
the CLI option at fault.

>>> plan = make_plan((2, 4, 8), names=("dp", "pp", "tp"), nproc=8, rank=13)
>>> [(p.label, p.count, p.nodes and p.nodes.placement) for p in plan.axes]
[('dp', 32, 'cross-node'), ('pp', 16, 'cross-node'), ('tp', 8, 'intra-node')]
>>> members(plan.layout, (0, 1, 5), (1,)), plan.rank and [g.nodes for g in plan.rank.groups]
(range(5, 37, 8), [2, 4, 1])

:meth:`Plan.document` is what ``--json`` prints, on one line::

    {"shape": [2, 4, 8], "world": 64,  # axis sizes (the -1 inferred), number of ranks
     "names": ["dp", "pp", "tp"],      # null without --names
     "labels": ["dp", "pp", "tp"],     # names, or "axis0", "axis1", ... without
     "strides": [32, 8, 1],            # rank = sum(coordinate[i] * strides[i])
     "nproc_per_node": 8, "nodes": 8,  # and ceil(world / nproc_per_node); or nulls
     "full": true,                     # false when the lists below are summarised
     "grid": [[[0, 1, ...], ...]],     # ranks nested like the shape; null if summarised
     "axes": [{                        # every single axis in mesh order, then each --axis
       "axes": ["dp"], "indices": [0],  # labels and axis indices, in mesh order
       "stride": 32,                   # rank distance along the axis; null for several
       "size": 2, "count": 32,         # ranks per group, number of groups
       "groups": [[0, 32], ...],       # ascending groups, in C order of the other axes
       "omitted": 0, "omitted_at": 32,  # groups left out, between [:omitted_at] and the rest
       "placement": "cross-node",      # "intra-node", "cross-node", "mixed" or null
       "crossing": 32,                 # groups spanning more than one node, or null
       "span": [2, 2]}],               # fewest and most nodes a group spans, or null
     "rank": {"rank": 13, "coordinate": [0, 1, 5],  # null without --rank
              "node": 1,               # rank // nproc_per_node, or null
              "groups": [{"axes": ["dp"], "ranks": [13, 45], "position": 0, "nodes": 2}]},
     "warnings": ["..."]}              # the warning lines of the text output

Listed groups are complete; a summary lists no group of more than 2**20 ranks
("groups" empty, a rank group's "ranks" null). "span" and a rank group's "nodes"
are null when counting would cost too much: a large group not evenly spaced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scopedmesh.errors import clipped, shown
from scopedmesh.layout.mesh_layout import MeshLayout
from scopedmesh.plan.arithmetic import group_coord, members, nested, nth, residues, spans

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

SMALL_WORLD = 64  # up to this many ranks, everything is listed
LIST_ALL = 8  # a summary still lists every group of an axis with this many groups
HEAD, TAIL = 2, 2  # groups listed at each end of a summarised axis
JSON_GROUP = 1 << 20  # a summary's JSON leaves out groups with more ranks
HUNGRY = frozenset({"tp", "sp", "cp", "ep"})  # axes that usually want the fastest links


@dataclass(frozen=True)
class Nodes:
    """Where an axis's groups sit, at ``nproc`` ranks per node (node = rank // nproc)."""

    placement: str  # "intra-node", "cross-node" or "mixed"
    crossing: int  # groups that span more than one node
    span: tuple[int, int] | None  # fewest and most nodes a group spans; None if too costly


@dataclass(frozen=True)
class AxisPlan:
    """The groups along one set of axes, of which ``head`` + ``tail`` are listed."""

    axes: tuple[int, ...]  # in mesh order
    label: str
    size: int  # ranks per group
    count: int  # number of groups
    head: int  # groups listed from the start ...
    tail: int  # ... and from the end; head + tail == count when complete
    nodes: Nodes | None

    def shown(self) -> list[int]:
        """The indices of the listed groups."""
        return [*range(self.head), *range(self.count - self.tail, self.count)]


@dataclass(frozen=True)
class RankGroup:
    """One rank's group along ``axis.axes``."""

    axis: AxisPlan
    position: int  # the rank's index in the ascending group
    nodes: int | None  # nodes the group spans; None without nproc or if too costly


@dataclass(frozen=True)
class RankPlan:
    """One rank's coordinate, node and groups (one per axis plan)."""

    rank: int
    coordinate: tuple[int, ...]
    node: int | None
    groups: tuple[RankGroup, ...]


@dataclass(frozen=True)
class Plan:
    """Everything ``scopedmesh plan`` shows about a layout with the default ranks."""

    layout: MeshLayout
    labels: tuple[str, ...]
    strides: tuple[int, ...]  # rank = sum(coordinate[i] * strides[i])
    full: bool  # False when long lists are summarised
    nproc: int | None
    axes: tuple[AxisPlan, ...]
    rank: RankPlan | None
    warnings: tuple[str, ...]

    @property
    def nodes(self) -> int | None:
        """The number of nodes, the last possibly partial."""
        return None if self.nproc is None else -(-self.layout.size // self.nproc)

    def document(self) -> dict[str, object]:
        """The ``--json`` document (schema in the module docstring)."""
        layout, labels = self.layout, self.labels

        def listed(p: AxisPlan) -> bool:
            return self.full or p.size <= JSON_GROUP

        axes = []
        for p in self.axes:
            nodes = p.nodes
            shown = p.shown() if listed(p) else []
            groups = [list(members(layout, group_coord(layout, p.axes, k), p.axes)) for k in shown]
            axes.append(
                {
                    "axes": [labels[a] for a in p.axes],
                    "indices": list(p.axes),
                    "stride": self.strides[p.axes[0]] if len(p.axes) == 1 else None,
                    "size": p.size,
                    "count": p.count,
                    "groups": groups,
                    "omitted": p.count - len(groups),
                    "omitted_at": min(p.head, len(groups)),
                    "placement": None if nodes is None else nodes.placement,
                    "crossing": None if nodes is None else nodes.crossing,
                    "span": None if nodes is None or nodes.span is None else list(nodes.span),
                }
            )
        rank: dict[str, object] | None = None
        if self.rank is not None:
            coord = self.rank.coordinate
            rank = {"rank": self.rank.rank, "coordinate": list(coord), "node": self.rank.node}
            rank["groups"] = [
                {
                    "axes": [labels[a] for a in g.axis.axes],
                    "ranks": list(members(layout, coord, g.axis.axes)) if listed(g.axis) else None,
                    "position": g.position,
                    "nodes": g.nodes,
                }
                for g in self.rank.groups
            ]
        return {
            "shape": list(layout.shape),
            "names": None if layout.names is None else list(layout.names),
            "labels": list(labels),
            "world": layout.size,
            "strides": list(self.strides),
            "nproc_per_node": self.nproc,
            "nodes": self.nodes,
            "full": self.full,
            "grid": nested(layout.ranks, layout.shape) if self.full else None,
            "axes": axes,
            "rank": rank,
            "warnings": list(self.warnings),
        }


def make_plan(
    shape: Sequence[int],
    *,
    names: Sequence[str] | None = None,
    world: int | None = None,
    axis_specs: Sequence[str] = (),
    rank: int | None = None,
    nproc: int | None = None,
    full: bool = False,
) -> Plan:
    """The plan for ``scopedmesh plan SHAPE --names ... --world W --axis A,B ...``."""
    layout = MeshLayout(_resolve_shape(shape, world), names=_check_names(names, len(shape)))
    labels = layout.names or tuple(f"axis{a}" for a in range(layout.ndim))
    if rank is not None and not 0 <= rank < layout.size:
        raise ValueError(f"--rank {rank} is not in the mesh: its ranks are 0 to {layout.size - 1}")
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc-per-node must be positive, got {nproc}")
    axis_sets: list[tuple[int, ...]] = [(a,) for a in range(layout.ndim)]
    for spec in axis_specs:
        axes = _axis_set(layout, labels, spec)
        if axes not in axis_sets:
            axis_sets.append(axes)
    full = full or layout.size <= SMALL_WORLD
    plans: list[AxisPlan] = []
    warnings: list[str] = []
    for axes in axis_sets:
        size = math.prod(layout.shape[a] for a in axes)
        count = layout.size // size
        head, tail = (count, 0) if full or count <= LIST_ALL else (HEAD, TAIL)
        nodes = None if nproc is None else _node_facts(layout, axes, nproc)
        p = AxisPlan(axes, ",".join(labels[a] for a in axes), size, count, head, tail, nodes)
        plans.append(p)
        hungry = p.label.lower() in HUNGRY or axes == (layout.ndim - 1,)
        if nproc is not None and nodes is not None and nodes.crossing and len(axes) == 1 and hungry:
            warnings.append(_warning(p, nodes, nproc))
    rank_plan = None
    if rank is not None:
        coord = layout.unravel(rank)
        groups = []
        for p in plans:
            inner = MeshLayout(tuple(layout.shape[a] for a in p.axes))
            position = inner.ravel(tuple(coord[a] for a in p.axes))
            counts = None if nproc is None else spans(layout, coord, p.axes, nproc, [0])
            groups.append(RankGroup(p, position, None if counts is None else counts[0]))
        node = None if nproc is None else rank // nproc
        rank_plan = RankPlan(rank, coord, node, tuple(groups))
    strides = tuple(math.prod(layout.shape[a + 1 :]) for a in range(layout.ndim))
    return Plan(layout, labels, strides, full, nproc, tuple(plans), rank_plan, tuple(warnings))


def _resolve_shape(shape: Sequence[int], world: int | None) -> tuple[int, ...]:
    text = " ".join(map(shown, shape))
    if any(n < 1 and n != -1 for n in shape):
        raise ValueError(f"axis sizes must be positive (or a single -1), got {clipped(text)}")
    if list(shape).count(-1) > 1:
        raise ValueError(f"only one axis size may be -1, got {clipped(text)}")
    if world is not None and world < 1:
        raise ValueError(f"--world must be positive, got {world}")
    known = math.prod(n for n in shape if n != -1)
    if -1 in shape:
        if world is None:
            raise ValueError(f"the -1 in shape {text} needs --world to infer it")
        if world % known:
            raise ValueError(
                f"cannot infer the -1 in shape {text}: --world {world} is not a multiple of {known}"
            )
        return tuple(world // known if n == -1 else n for n in shape)
    if world is not None and world != known:
        raise ValueError(f"shape {text} holds {known} ranks but --world is {world}")
    return tuple(shape)


def _check_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if len(names) == 1 and "," in names[0]:
        names = names[0].split(",")
    result = tuple(name.strip() for name in names)
    if len(result) != ndim:
        given = f"{len(result)} name{'s' * (len(result) != 1)}"
        raise ValueError(f"--names gives {given} but the shape has {ndim} axes")
    for name in result:
        if not name or "," in name:
            raise ValueError(f"--names must be non-empty and without ',', got {shown(name)}")
    if len(set(result)) != len(result):
        raise ValueError(f"--names must be distinct, got {clipped(' '.join(result))}")
    return result


def _axis_set(layout: MeshLayout, labels: tuple[str, ...], spec: str) -> tuple[int, ...]:
    """``--axis dp,tp`` as axis indices in mesh order."""
    items: list[int | str] = []
    for token in (t.strip() for t in spec.split(",")):
        if token in labels:
            items.append(labels.index(token))
        elif token.lstrip("-").isdigit():
            items.append(int(token))
        else:
            known = ", ".join(labels)
            raise ValueError(
                f"unknown axis {shown(token)} in --axis {clipped(spec)}; the axes are {clipped(known)}"
            )
    return tuple(sorted(layout.axes_indices(items, argument="--axis")))


# ---------------------------------------------------------------------- nodes


def _node_facts(layout: MeshLayout, axes: tuple[int, ...], nproc: int) -> Nodes:
    """Placement, crossing count and node span of the groups along ``axes``."""
    starts = residues(layout, axes, nproc)
    origin = (0,) * layout.ndim
    extent = nth(layout, origin, axes, math.prod(layout.shape[a] for a in axes) - 1)
    count = sum(starts.values())
    crossing = sum(m for r, m in starts.items() if r + extent >= nproc)
    placement = "intra-node" if not crossing else "cross-node" if crossing == count else "mixed"
    # The group starting at residue r spans the nodes of the origin group shifted by r.
    counts = spans(layout, origin, axes, nproc, list(starts))
    return Nodes(placement, crossing, None if counts is None else (min(counts), max(counts)))


def _warning(p: AxisPlan, nodes: Nodes, nproc: int) -> str:
    if nodes.placement == "mixed":
        how = f"{nodes.crossing} of {p.count} groups span more than one node"
    elif nodes.span is not None and nodes.span[0] == nodes.span[1]:
        how = f"each spans {nodes.span[0]} nodes"
    else:
        how = "every group spans more than one node"
    why = (
        f"{p.label} traffic"
        if p.label.lower() in HUNGRY
        else "the last axis usually carries tensor parallel, whose traffic"
    )
    return (
        f"warning: {p.label} groups cross nodes ({how} at {nproc} ranks per node): "
        f"{why} would go over the network instead of NVLink"
    )
