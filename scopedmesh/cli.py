"""``scopedmesh plan``: a mesh's layout as text or JSON, with no process group and no GPU.

    python -m scopedmesh plan 2 4 8 --names dp pp tp --nproc-per-node 8
    python -m scopedmesh plan -1 8 --world 64 --names dp tp --rank 13
    python -m scopedmesh plan 2 2 2 --names dp pp tp --axis dp,tp --json

The text shows the mesh as a grid of ranks (one grid per leading index past two
axes), a table of the axes (group size, stride, number of groups and, with
``--nproc-per-node``, whether the groups stay inside a node), every axis's
groups, ``--rank``'s coordinate and groups, and a warning when an axis that
usually needs the fastest links (tp, sp, cp, ep, or the last axis) crosses
nodes. Worlds above 64 ranks are summarised -- a few positions of each long axis,
the first and last groups of each axis -- unless ``--full`` is given. Only
:mod:`scopedmesh.layout` is used: no torch import, no process group.

Bad arguments print one line, ``scopedmesh plan: error: ...``, on stderr and
exit with status 2.

JSON schema (``--json``; one object on one line)::

    {
      "shape": [2, 4, 8],              # axis sizes, the -1 inferred
      "names": ["dp", "pp", "tp"],     # null without --names
      "labels": ["dp", "pp", "tp"],    # names, or "axis0", "axis1", ... without
      "world": 64,                     # number of ranks
      "strides": [32, 8, 1],           # rank = sum(coordinate[i] * strides[i])
      "nproc_per_node": 8,             # null without --nproc-per-node
      "nodes": 8,                      # ceil(world / nproc_per_node), or null
      "full": true,                    # false when the lists below are summarised
      "grid": [[[0, 1, ...], ...]],    # ranks nested like the shape; null if summarised
      "axes": [                        # every single axis in mesh order, then each --axis
        {
          "axes": ["dp"],              # labels, in mesh order
          "indices": [0],              # axis indices, in mesh order
          "stride": 32,                # rank distance along the axis; null for several axes
          "size": 2,                   # ranks per group
          "count": 32,                 # number of groups
          "groups": [[0, 32], ...],    # groups, each ascending, in C order of the other axes
          "omitted": 0,                # groups left out of "groups" (0 when complete)
          "omitted_at": 32,            # groups[:omitted_at] are the first groups, the rest
                                       # the last ones; the omitted ones lie between
          "placement": "cross-node",   # "intra-node", "cross-node", "mixed" or null
          "crossing": 32,              # groups spanning more than one node, or null
          "span": [2, 2]               # fewest and most nodes a group spans, or null
        }
      ],
      "rank": {                        # null without --rank
        "rank": 13,
        "coordinate": [0, 1, 5],
        "node": 1,                     # rank // nproc_per_node, or null
        "groups": [{"axes": ["dp"], "ranks": [13, 45], "position": 0, "nodes": 2}, ...]
      },
      "warnings": ["..."]              # the warning lines of the text output
    }

Each listed group is complete, even when a summary leaves some groups out. A
summary lists no group of more than 2**20 ranks ("groups" is empty, a rank
group's "ranks" null); ``--full`` lists them all. ``span`` (and a rank group's
``nodes``) is null when counting it would cost too much: a group over several
non-adjacent axes with many ranks.

>>> main(["plan", "2", "3", "--names", "pp", "tp"])
mesh pp=2 x tp=3: 6 ranks, rank = 3*pp + tp
<BLANKLINE>
  pp \\ tp | 0  1  2
  --------+--------
        0 | 0  1  2
        1 | 3  4  5
<BLANKLINE>
axis  size  stride  groups
pp       2       3       3
tp       3       1       2
<BLANKLINE>
pp: 3 groups of 2 ranks
  [0, 3]  [1, 4]  [2, 5]
tp: 2 groups of 3 ranks
  [0, 1, 2]  [3, 4, 5]
0
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from scopedmesh.layout import MeshLayout

__all__ = ["main"]

PROG = "scopedmesh"
SMALL_WORLD = 64  # up to this many ranks, everything is shown
LIST_ALL = 8  # a summary still lists every group of an axis with this many groups
HEAD, TAIL = 2, 2  # groups shown at each end of a summarised list
MEMBERS = 16  # a summary elides the middle of a group with more ranks
WIDTH = 100  # text width the group lists wrap to
LARGE = 1 << 12  # groups with more ranks are computed from their progressions
JSON_GROUP = 1 << 20  # a summary's JSON leaves out groups with more ranks
BUDGET = 1 << 18  # most (residue, rank) pairs counted to find how many nodes a group spans
HUNGRY = frozenset({"tp", "sp", "cp", "ep"})  # axes that usually want the fastest links
ELLIPSIS = "…"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Plan N-D process-group meshes without a cluster.")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    plan = commands.add_parser(
        "plan",
        help="show a mesh's ranks, groups and node placement",
        description=(
            "Show a mesh's ranks, groups and node placement, without a process group.\n"
            "Ranks are laid out in C order: the last axis varies fastest."
        ),
        epilog=(
            "examples:\n"
            "  scopedmesh plan 2 4 8 --names dp pp tp --nproc-per-node 8\n"
            "  scopedmesh plan -1 8 --world 64 --names dp tp --rank 13\n"
            "  scopedmesh plan 2 2 2 --names dp pp tp --axis dp,tp --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "shape",
        nargs="+",
        type=int,
        metavar="SIZE",
        help="axis sizes, outermost first; one may be -1, inferred from --world",
    )
    plan.add_argument("--names", nargs="+", metavar="NAME", help="one name per axis")
    plan.add_argument("--world", type=int, metavar="W", help="number of ranks (needed by a -1)")
    plan.add_argument(
        "--axis",
        action="append",
        default=[],
        metavar="A,B",
        help="also show the groups along several axes together (repeatable)",
    )
    plan.add_argument(
        "--rank", type=int, metavar="R", help="show this rank's coordinate and groups"
    )
    plan.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="ranks per node (node = rank // N): show which groups cross nodes",
    )
    plan.add_argument("--json", action="store_true", help="print the facts as JSON")
    plan.add_argument("--full", action="store_true", help="never summarise a large world")
    return parser


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class _Options:
    shape: tuple[int, ...]
    names: tuple[str, ...] | None
    world: int | None
    axis_specs: tuple[str, ...]
    rank: int | None
    nproc: int | None
    json: bool
    full: bool


@dataclass(frozen=True)
class _Nodes:
    placement: str  # "intra-node", "cross-node" or "mixed"
    crossing: int  # groups that span more than one node
    span: tuple[int, int] | None  # fewest and most nodes a group spans


@dataclass(frozen=True)
class _AxisPlan:
    axes: tuple[int, ...]  # in mesh order
    label: str
    size: int  # ranks per group
    count: int  # number of groups
    head: int  # groups listed from the start ...
    tail: int  # ... and from the end; head + tail == count when complete
    nodes: _Nodes | None


@dataclass(frozen=True)
class _Plan:
    layout: MeshLayout
    labels: tuple[str, ...]
    strides: tuple[int, ...]
    full: bool
    axis_plans: tuple[_AxisPlan, ...]
    rank: int | None
    nproc: int | None
    warnings: tuple[str, ...]


def _resolve_shape(shape: Sequence[int], world: int | None) -> tuple[int, ...]:
    text = " ".join(map(str, shape))
    if any(n < 1 and n != -1 for n in shape):
        raise ValueError(f"axis sizes must be positive (or a single -1), got {text}")
    if list(shape).count(-1) > 1:
        raise ValueError(f"only one axis size may be -1, got {text}")
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
            raise ValueError(f"--names must be non-empty and without ',', got {name!r}")
    if len(set(result)) != len(result):
        raise ValueError(f"--names must be distinct, got {' '.join(result)}")
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
            raise ValueError(f"unknown axis {token!r} in --axis {spec}; the axes are {known}")
    return tuple(sorted(layout.axes_indices(items, argument="--axis")))


def _c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[a + 1 :]) for a in range(len(shape)))


def _residues(
    shape: Sequence[int], strides: Sequence[int], others: Iterable[int], nproc: int
) -> dict[int, int]:
    """How many groups start at each rank modulo ``nproc``.

    A group starts at a sum of multiples of the strides of ``others``. Costs
    O(min(nproc, groups) * min(nproc, size)) per axis of ``others``, never O(world).
    """
    counts = {0: 1}
    for a in others:
        size, stride = shape[a], strides[a]
        period = nproc // math.gcd(stride, nproc)
        steps = {
            (c * stride) % nproc: (size - 1 - c) // period + 1 for c in range(min(size, period))
        }
        merged: dict[int, int] = {}
        for r, m in counts.items():
            for d, k in steps.items():
                key = (r + d) % nproc
                merged[key] = merged.get(key, 0) + m * k
        counts = merged
    return counts


def _blocks(
    shape: Sequence[int], strides: Sequence[int], axes: Sequence[int]
) -> list[tuple[int, int]]:
    """``axes`` as (size, stride) blocks: neighbouring axes in C order merge into one."""
    blocks: list[tuple[int, int]] = []
    for a in axes:
        if blocks and a - 1 in axes:
            size, _ = blocks.pop()
            blocks.append((size * shape[a], strides[a]))
        else:
            blocks.append((shape[a], strides[a]))
    return blocks


def _span_counter(
    shape: Sequence[int], strides: Sequence[int], axes: Sequence[int], nproc: int, calls: int
) -> Callable[[int], int] | None:
    """How many nodes the group starting at rank ``r`` (mod ``nproc``) spans; None if too costly."""
    blocks = _blocks(shape, strides, axes)
    if len(blocks) == 1:  # an arithmetic progression
        n, s = blocks[0]
        if n == 1:
            return lambda r: 1
        if s >= nproc:  # neighbours are a node or more apart
            return lambda r: n
        return lambda r: (r + (n - 1) * s) // nproc + 1  # no node is skipped
    if math.prod(n for n, _ in blocks) * calls > BUDGET:
        return None
    offsets = [0]
    for n, s in blocks:
        offsets = [o + i * s for o in offsets for i in range(n)]
    return lambda r: len({(r + o) // nproc for o in offsets})


def _node_facts(
    shape: Sequence[int], strides: Sequence[int], axes: Sequence[int], nproc: int
) -> _Nodes:
    others = [a for a in range(len(shape)) if a not in axes]
    residues = _residues(shape, strides, others, nproc)
    extent = sum((shape[a] - 1) * strides[a] for a in axes)
    count = sum(residues.values())
    crossing = sum(m for r, m in residues.items() if r + extent >= nproc)
    placement = "intra-node" if not crossing else "cross-node" if crossing == count else "mixed"
    counter = _span_counter(shape, strides, axes, nproc, len(residues))
    span = None
    if counter is not None:
        spans = [counter(r) for r in residues]
        span = (min(spans), max(spans))
    return _Nodes(placement, crossing, span)


def _make_plan(options: _Options) -> _Plan:
    shape = _resolve_shape(options.shape, options.world)
    names = _check_names(options.names, len(shape))
    layout = MeshLayout(shape, names=names)
    labels = names if names is not None else tuple(f"axis{a}" for a in range(len(shape)))
    world = layout.size
    if options.rank is not None and not 0 <= options.rank < world:
        raise ValueError(
            f"--rank {options.rank} is not in the mesh: its ranks are 0 to {world - 1}"
        )
    nproc = options.nproc
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc-per-node must be positive, got {nproc}")
    axis_sets: list[tuple[int, ...]] = [(a,) for a in range(layout.ndim)]
    for spec in options.axis_specs:
        axes = _axis_set(layout, labels, spec)
        if axes not in axis_sets:
            axis_sets.append(axes)
    full = options.full or world <= SMALL_WORLD
    strides = _c_strides(shape)
    plans = []
    for axes in axis_sets:
        size = math.prod(shape[a] for a in axes)
        count = world // size
        head, tail = (count, 0) if full or count <= LIST_ALL else (HEAD, TAIL)
        nodes = None if nproc is None else _node_facts(shape, strides, axes, nproc)
        label = ",".join(labels[a] for a in axes)
        plans.append(_AxisPlan(axes, label, size, count, head, tail, nodes))
    warnings = tuple(
        _warning(p, nproc)
        for p in plans
        if nproc is not None
        and p.nodes is not None
        and p.nodes.crossing
        and len(p.axes) == 1
        and (p.label.lower() in HUNGRY or p.axes[0] == layout.ndim - 1)
    )
    return _Plan(layout, labels, strides, full, tuple(plans), options.rank, nproc, warnings)


def _placement_text(nodes: _Nodes, count: int) -> str:
    if nodes.placement == "intra-node":
        return "intra-node"
    if nodes.placement == "mixed":
        return f"mixed: {nodes.crossing} of {count} groups cross nodes"
    if nodes.span is None:
        return "cross-node"
    low, high = nodes.span
    return f"cross-node: {'each group spans' if low == high else 'groups span'} " + (
        f"{low} nodes" if low == high else f"{low} to {high} nodes"
    )


def _warning(p: _AxisPlan, nproc: int) -> str:
    assert p.nodes is not None
    nodes = p.nodes
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


# ---------------------------------------------------------------- the groups


def _group_coord(plan: _Plan, axes: Sequence[int], index: int) -> tuple[int, ...]:
    """The coordinate (0 on ``axes``) of the ``index``-th group along ``axes``."""
    shape = plan.layout.shape
    others = [a for a in range(len(shape)) if a not in axes]
    coord = [0] * len(shape)
    if others:
        for a, c in zip(others, MeshLayout(tuple(shape[a] for a in others)).unravel(index)):
            coord[a] = c
    return tuple(coord)


def _shown(p: _AxisPlan) -> Iterable[int]:
    return itertools.chain(range(p.head), range(p.count - p.tail, p.count))


def _group_ranks(plan: _Plan, axes: Sequence[int], coord: Sequence[int]) -> list[int]:
    """The ranks of the group along ``axes`` through ``coord``, ascending.

    ``MeshLayout.group`` gives them. A group of more than LARGE ranks is built
    from its progressions instead, fast enough for 2**20 ranks: the CLI's layouts
    have the default ranks, where the two agree (the tests check it).
    """
    layout, strides = plan.layout, plan.strides
    if math.prod(layout.shape[a] for a in axes) <= LARGE:
        return list(layout.group(coord, axes))
    base = sum(c * s for a, (c, s) in enumerate(zip(coord, strides)) if a not in axes)
    *outer, (n, s) = _blocks(layout.shape, strides, axes)
    ranks = list(range(base, base + n * s, s))
    for n, s in reversed(outer):
        ranks = [i * s + r for i in range(n) for r in ranks]
    return ranks


def _group_text(plan: _Plan, axes: Sequence[int], coord: Sequence[int], width: int = 0) -> str:
    """A group as ``[0, 8, 16]``; a summary elides the middle of a large group."""
    layout = plan.layout
    size = math.prod(layout.shape[a] for a in axes)
    if plan.full or size <= MEMBERS:
        return "[" + ", ".join(f"{r:>{width}}" for r in _group_ranks(plan, axes, coord)) + "]"
    # The CLI's layouts use the default ranks, so C order over ``axes`` is ascending.
    sub = layout.sub(coord, axes)
    inner = MeshLayout(sub.shape)
    head = [sub.ravel(inner.unravel(j)) for j in range(3)]
    tail = [sub.ravel(inner.unravel(j)) for j in range(size - 2, size)]
    return "[" + ", ".join(map(str, [*head, ELLIPSIS, *tail])) + "]"


def _rank_groups(plan: _Plan) -> list[tuple[_AxisPlan, tuple[int, ...], int, int | None]]:
    """For ``--rank``: each axis plan with the rank's base coordinate, position and node span."""
    assert plan.rank is not None
    layout, strides = plan.layout, plan.strides
    coord = layout.unravel(plan.rank)
    result = []
    for p in plan.axis_plans:
        base = tuple(0 if a in p.axes else c for a, c in enumerate(coord))
        inner = MeshLayout(tuple(layout.shape[a] for a in p.axes))
        position = inner.ravel(tuple(coord[a] for a in p.axes))
        spans = None
        if plan.nproc is not None:
            counter = _span_counter(layout.shape, strides, p.axes, plan.nproc, 1)
            start = sum(c * s for c, s in zip(base, strides))
            spans = None if counter is None else counter(start % plan.nproc)
        result.append((p, base, position, spans))
    return result


# ---------------------------------------------------------------------- text


def _positions(n: int, full: bool, keep: int, head: int, tail: int) -> list[int | None]:
    """Positions 0..n-1, or in a summary of a long axis the ends around a None (shown as …)."""
    if full or n <= keep:
        return list(range(n))
    return [*range(head), None, *range(n - tail, n)]


def _per_line(fit: int, count: int) -> int:
    """How many of ``count`` cells to put on a line that fits ``fit``: a divisor if a good one."""
    if count <= fit:
        return count
    divisor = max(d for d in range(1, fit + 1) if count % d == 0)
    return divisor if 2 * divisor > fit else fit


def _table(plan: _Plan, lead: Sequence[int]) -> list[str]:
    """The 2-D grid of ranks through ``lead`` (the leading coordinates), split if too wide."""
    layout, labels, ndim = plan.layout, plan.labels, plan.layout.ndim
    cols = _positions(layout.shape[-1], plan.full, 16, 3, 2)
    rows: list[int | None]
    if ndim == 1:
        corner, rows = labels[-1], [None]
    else:
        corner = f"{labels[-2]} \\ {labels[-1]}"
        rows = _positions(layout.shape[-2], plan.full, 8, 3, 1)
    body: list[tuple[str, list[str]]] = []
    for r in rows:
        if r is None and ndim > 1:
            body.append((ELLIPSIS, [ELLIPSIS] * len(cols)))
            continue
        at = tuple(lead) if r is None else (*lead, r)
        cells = [ELLIPSIS if c is None else str(layout.ravel((*at, c))) for c in cols]
        body.append(("rank" if ndim == 1 else str(r), cells))
    head = [ELLIPSIS if c is None else str(c) for c in cols]
    width = max(len(str(layout.size - 1)), len(str(layout.shape[-1] - 1)))
    lw = max(len(corner), *(len(label) for label, _ in body))
    per = _per_line(max(1, (WIDTH - lw - 3) // (width + 2)), len(cols))

    def line(label: str, row: list[str]) -> str:
        return f"  {label:>{lw}} | " + "  ".join(f"{s:>{width}}" for s in row)

    lines: list[str] = []
    for i in range(0, len(cols), per):
        top = line(corner, head[i : i + per])
        rule = "  " + "-" * lw + "-+-" + "-" * (len(top) - lw - 5)
        if i:
            lines.append("")
        lines += [top, rule]
        lines += [line(label, row[i : i + per]) for label, row in body]
    return lines


def _grid_lines(plan: _Plan) -> list[str]:
    """One grid per leading coordinate; a summary shows the first two and the last."""
    layout, labels = plan.layout, plan.labels
    lead_shape = layout.shape[:-2]
    count = math.prod(lead_shape)
    lines: list[str] = []
    if not plan.full:
        lines += [f"(summarised; --full shows all {layout.size} ranks)", ""]
    shown: list[int | None] = _positions(count, plan.full, 4, 2, 1)
    for k in shown:
        if k is None:
            lines += [f"{ELLIPSIS} {count - 3} more grids {ELLIPSIS}", ""]
            continue
        lead = MeshLayout(lead_shape).unravel(k) if lead_shape else ()
        if lead:
            lines.append(", ".join(f"{label}={c}" for label, c in zip(labels, lead)))
        lines += [*_table(plan, lead), ""]
    return lines


def _columns(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            (cell.rjust(w) if r else cell.ljust(w)) for cell, w, r in zip(row, widths, right)
        ).rstrip()
        for row in rows
    ]


def _axes_lines(plan: _Plan) -> list[str]:
    header = ["axis", "size", "stride", "groups"]
    if plan.nproc is not None:
        header.append(f"at {plan.nproc} ranks per node")
    rows = [header]
    for p in plan.axis_plans:
        stride = str(plan.strides[p.axes[0]]) if len(p.axes) == 1 else "-"
        row = [p.label, str(p.size), stride, str(p.count)]
        if p.nodes is not None:
            row.append(_placement_text(p.nodes, p.count))
        rows.append(row)
    return _columns(rows, [False, True, True, True, False])


def _wrap(texts: list[str], count: int) -> list[str]:
    """Equal-width cells, as many a line as fit in WIDTH; a group too long alone is broken."""
    cell = max(map(len, texts)) + 2
    if cell > WIDTH:
        lines = []
        for text in texts:
            first, *parts = text.split(", ")
            line = "  " + first
            for part in parts:
                if len(line) + len(part) + 3 > WIDTH:
                    lines.append(line + ",")
                    line = "   " + part
                else:
                    line += ", " + part
            lines.append(line)
        return lines
    per = _per_line(WIDTH // cell, count)
    return [
        "  " + "  ".join(t.ljust(cell - 2) for t in texts[i : i + per]).rstrip()
        for i in range(0, len(texts), per)
    ]


def _group_lines(plan: _Plan) -> list[str]:
    lines = []
    digits = len(str(plan.layout.size - 1))
    for p in plan.axis_plans:
        groups = "group" if p.count == 1 else "groups"
        lines.append(f"{p.label}: {p.count} {groups} of {p.size} ranks")
        if p.tail == 0:  # complete: aligned cells, several a line
            texts = [
                _group_text(plan, p.axes, _group_coord(plan, p.axes, k), digits)
                for k in range(p.count)
            ]
            lines += _wrap(texts, p.count)
            continue
        for k in range(p.head):
            lines.append("  " + _group_text(plan, p.axes, _group_coord(plan, p.axes, k)))
        lines.append(f"  {ELLIPSIS} {p.count - p.head - p.tail} more groups {ELLIPSIS}")
        for k in range(p.count - p.tail, p.count):
            lines.append("  " + _group_text(plan, p.axes, _group_coord(plan, p.axes, k)))
    return lines


def _rank_lines(plan: _Plan) -> list[str]:
    assert plan.rank is not None
    coord = plan.layout.unravel(plan.rank)
    named = ", ".join(f"{label}={c}" for label, c in zip(plan.labels, coord))
    node = None if plan.nproc is None else plan.rank // plan.nproc
    first = f"rank {plan.rank}: coordinate {coord} [{named}]"
    if node is not None:
        first += f", node {node}"
    rows = []
    for p, base, position, spans in _rank_groups(plan):
        where = f"position {position} of {p.size}"
        if spans is not None:
            where += f", inside node {node}" if spans == 1 else f", spans {spans} nodes"
        text = _group_text(plan, p.axes, base)
        rows.append([p.label, text, where])
    return [first, *("  " + line for line in _columns(rows, [False, False, False]))]


def _text(plan: _Plan) -> str:
    layout, labels = plan.layout, plan.labels
    sizes = " x ".join(f"{label}={n}" for label, n in zip(labels, layout.shape))
    terms = [label if s == 1 else f"{s}*{label}" for label, s in zip(labels, plan.strides)]
    lines = [f"mesh {sizes}: {layout.size} ranks, rank = {' + '.join(terms)}"]
    if plan.nproc is not None:
        count, last = -(-layout.size // plan.nproc), layout.size % plan.nproc
        extra = f", the last with {last} ranks" if last else ""
        lines.append(
            f"nodes: {plan.nproc} ranks per node, {count} node{'s' * (count > 1)}{extra}"
            f" (node = rank // {plan.nproc})"
        )
    lines += ["", *_grid_lines(plan), *_axes_lines(plan), "", *_group_lines(plan)]
    if plan.rank is not None:
        lines += ["", *_rank_lines(plan)]
    if plan.warnings:
        lines += ["", *plan.warnings]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- JSON


def _nested(ranks: Sequence[int], shape: Sequence[int]) -> object:
    if len(shape) == 1:
        return list(ranks)
    step = len(ranks) // shape[0]
    return [_nested(ranks[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _json(plan: _Plan) -> str:
    layout, labels = plan.layout, plan.labels
    axes = []
    for p in plan.axis_plans:
        nodes = p.nodes
        shown = list(_shown(p)) if plan.full or p.size <= JSON_GROUP else []
        axes.append(
            {
                "axes": [labels[a] for a in p.axes],
                "indices": list(p.axes),
                "stride": plan.strides[p.axes[0]] if len(p.axes) == 1 else None,
                "size": p.size,
                "count": p.count,
                "groups": [
                    _group_ranks(plan, p.axes, _group_coord(plan, p.axes, k)) for k in shown
                ],
                "omitted": p.count - len(shown),
                "omitted_at": min(p.head, len(shown)),
                "placement": None if nodes is None else nodes.placement,
                "crossing": None if nodes is None else nodes.crossing,
                "span": None if nodes is None or nodes.span is None else list(nodes.span),
            }
        )
    rank: object = None
    if plan.rank is not None:
        coord = layout.unravel(plan.rank)
        rank = {
            "rank": plan.rank,
            "coordinate": list(coord),
            "node": None if plan.nproc is None else plan.rank // plan.nproc,
            "groups": [
                {
                    "axes": [labels[a] for a in p.axes],
                    "ranks": (
                        _group_ranks(plan, p.axes, coord)
                        if plan.full or p.size <= JSON_GROUP
                        else None
                    ),
                    "position": position,
                    "nodes": spans,
                }
                for p, _, position, spans in _rank_groups(plan)
            ],
        }
    document = {
        "shape": list(layout.shape),
        "names": None if layout.names is None else list(layout.names),
        "labels": list(labels),
        "world": layout.size,
        "strides": list(plan.strides),
        "nproc_per_node": plan.nproc,
        "nodes": None if plan.nproc is None else -(-layout.size // plan.nproc),
        "full": plan.full,
        "grid": _nested(layout.ranks, layout.shape) if plan.full else None,
        "axes": axes,
        "rank": rank,
        "warnings": list(plan.warnings),
    }
    return json.dumps(document) + "\n"


# ---------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``scopedmesh plan ...``; return the exit status (0, or 2 for bad arguments)."""
    try:
        args, extra = _parser().parse_known_args(argv)
    except SystemExit as stop:  # --help, or an error already printed on one line
        return stop.code if isinstance(stop.code, int) else 2
    if extra:
        print(
            f"{PROG} {args.command}: error: unrecognized arguments: {' '.join(extra)}",
            file=sys.stderr,
        )
        return 2
    options = _Options(
        shape=tuple(args.shape),
        names=None if args.names is None else tuple(args.names),
        world=args.world,
        axis_specs=tuple(args.axis),
        rank=args.rank,
        nproc=args.nproc_per_node,
        json=args.json,
        full=args.full,
    )
    try:
        plan = _make_plan(options)
    except (ValueError, TypeError, IndexError) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    output = _json(plan) if options.json else _text(plan)
    try:
        sys.stdout.write(output)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
