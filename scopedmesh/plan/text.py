"""The text rendering of a plan: the rank grid, the axes table, the groups, a rank's view.

Pure functions from :class:`~scopedmesh.plan.facts.Plan` to lines of text;
:mod:`scopedmesh.plan.cli` only parses arguments and prints what these return,
and :mod:`scopedmesh.plan.svg` shares :func:`positions` and :func:`group_text`.

>>> from scopedmesh.plan.facts import make_plan
>>> print(plan_text(make_plan((2, 2), names=("dp", "tp"))), end="")
mesh dp=2 x tp=2: 4 ranks, rank = 2*dp + tp
<BLANKLINE>
  dp \\ tp | 0  1
  --------+-----
        0 | 0  1
        1 | 2  3
<BLANKLINE>
axis  size  stride  groups
dp       2       2       2
tp       2       1       2
<BLANKLINE>
dp: 2 groups of 2 ranks
  [0, 2]  [1, 3]
tp: 2 groups of 2 ranks
  [0, 1]  [2, 3]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scopedmesh.layout import MeshLayout
from scopedmesh.plan.facts import Nodes, Plan, group_coord, members, nth

__all__ = ["ELLIPSIS", "grid_lines", "group_text", "plan_text", "positions"]

MEMBERS = 16  # a summary elides the middle of a group with more ranks
WIDTH = 100  # text width the group lists wrap to
ELLIPSIS = "…"


def positions(n: int, full: bool, keep: int, head: int, tail: int) -> list[int | None]:
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


def _table(plan: Plan, lead: Sequence[int]) -> list[str]:
    """The 2-D grid of ranks through ``lead`` (the leading coordinates), split if too wide."""
    layout, labels, ndim = plan.layout, plan.labels, plan.layout.ndim
    cols = positions(layout.shape[-1], plan.full, 16, 3, 2)
    rows: list[int | None]
    if ndim == 1:
        corner, rows = labels[-1], [None]
    else:
        corner = f"{labels[-2]} \\ {labels[-1]}"
        rows = positions(layout.shape[-2], plan.full, 8, 3, 1)
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


def grid_lines(plan: Plan) -> list[str]:
    """One grid per leading coordinate; a summary shows the first two and the last."""
    layout, labels = plan.layout, plan.labels
    lead_shape = layout.shape[:-2]
    count = math.prod(lead_shape)
    lines: list[str] = []
    if not plan.full:
        lines += [f"(summarised; --full shows all {layout.size} ranks)", ""]
    shown: list[int | None] = positions(count, plan.full, 4, 2, 1)
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


def _axes_lines(plan: Plan) -> list[str]:
    header = ["axis", "size", "stride", "groups"]
    if plan.nproc is not None:
        header.append(f"at {plan.nproc} ranks per node")
    rows = [header]
    for p in plan.axes:
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


def group_text(
    layout: MeshLayout, axes: Sequence[int], coord: Sequence[int], *, full: bool, width: int = 0
) -> str:
    """A group as ``[0, 8, 16]``; unless ``full``, the middle of a large group is elided.

    >>> group_text(MeshLayout((2, 32)), (1,), (1, 0), full=False)
    '[32, 33, 34, …, 62, 63]'
    """
    size = math.prod(layout.shape[a] for a in axes)
    if full or size <= MEMBERS:
        return "[" + ", ".join(f"{r:>{width}}" for r in members(layout, coord, axes)) + "]"
    head = [str(nth(layout, coord, axes, j)) for j in range(3)]
    tail = [str(nth(layout, coord, axes, j)) for j in range(size - 2, size)]
    return "[" + ", ".join([*head, ELLIPSIS, *tail]) + "]"


def _group_lines(plan: Plan) -> list[str]:
    lines = []
    digits = len(str(plan.layout.size - 1))
    for p in plan.axes:
        groups = "group" if p.count == 1 else "groups"
        lines.append(f"{p.label}: {p.count} {groups} of {p.size} ranks")
        coords = [group_coord(plan.layout, p.axes, k) for k in p.shown()]
        if p.tail == 0:  # complete: aligned cells, several a line
            lines += _wrap(
                [group_text(plan.layout, p.axes, c, full=plan.full, width=digits) for c in coords],
                p.count,
            )
            continue
        texts = ["  " + group_text(plan.layout, p.axes, c, full=plan.full) for c in coords]
        more = f"  {ELLIPSIS} {p.count - p.head - p.tail} more groups {ELLIPSIS}"
        lines += [*texts[: p.head], more, *texts[p.head :]]
    return lines


def _rank_lines(plan: Plan) -> list[str]:
    assert plan.rank is not None
    rank, coord, node = plan.rank.rank, plan.rank.coordinate, plan.rank.node
    named = ", ".join(f"{label}={c}" for label, c in zip(plan.labels, coord))
    first = f"rank {rank}: coordinate {coord} [{named}]"
    if node is not None:
        first += f", node {node}"
    rows = []
    for g in plan.rank.groups:
        where = f"position {g.position} of {g.axis.size}"
        if g.nodes is not None:
            where += f", inside node {node}" if g.nodes == 1 else f", spans {g.nodes} nodes"
        rows.append(
            [g.axis.label, group_text(plan.layout, g.axis.axes, coord, full=plan.full), where]
        )
    return [first, *("  " + line for line in _columns(rows, [False, False, False]))]


def plan_text(plan: Plan) -> str:
    """The text ``scopedmesh plan`` prints for ``plan`` (see :mod:`scopedmesh.plan.cli`)."""
    layout, labels = plan.layout, plan.labels
    sizes = " x ".join(f"{label}={n}" for label, n in zip(labels, layout.shape))
    terms = [label if s == 1 else f"{s}*{label}" for label, s in zip(labels, plan.strides)]
    lines = [f"mesh {sizes}: {layout.size} ranks, rank = {' + '.join(terms)}"]
    if plan.nproc is not None and plan.nodes is not None:
        count, last = plan.nodes, layout.size % plan.nproc
        extra = f", the last with {last} ranks" if last else ""
        lines.append(
            f"nodes: {plan.nproc} ranks per node, {count} node{'s' * (count > 1)}{extra}"
            f" (node = rank // {plan.nproc})"
        )
    lines += ["", *grid_lines(plan), *_axes_lines(plan), "", *_group_lines(plan)]
    if plan.rank is not None:
        lines += ["", *_rank_lines(plan)]
    if plan.warnings:
        lines += ["", *plan.warnings]
    return "\n".join(lines) + "\n"


def _placement_text(nodes: Nodes, count: int) -> str:
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
