"""``scopedmesh plan``: a mesh's layout as text or JSON, with no process group and no GPU.

    python -m scopedmesh plan 2 4 8 --names dp pp tp --nproc-per-node 8
    python -m scopedmesh plan -1 8 --world 64 --names dp tp --rank 13
    python -m scopedmesh plan 2 2 2 --names dp pp tp --axis dp,tp --json
    python -m scopedmesh plan 2 2 2 --names dp pp tp --nproc-per-node 4 --rank 5 --svg plan.svg

This module parses the arguments and renders the text; :mod:`scopedmesh.plan.facts`
holds the facts (and the ``--json`` schema). The text shows the mesh as a grid
of ranks (one grid per leading index past two axes), a table of the axes (group
size, stride, number of groups and, with ``--nproc-per-node``, whether the groups
stay inside a node), every axis's groups, ``--rank``'s coordinate and groups, and
a warning when an axis that usually needs the fastest links (tp, sp, cp, ep, or
the last axis) crosses nodes. Worlds above 64 ranks are summarised unless
``--full`` is given. Bad arguments print one line, ``scopedmesh plan: error:
...``, on stderr and exit with status 2.

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
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from scopedmesh.layout.mesh_layout import MeshLayout
from scopedmesh.plan.facts import Nodes, Plan, group_coord, make_plan, members, nth
from scopedmesh.plan.node_plan import make_node_plan

__all__ = ["main"]

PROG = "scopedmesh"
MEMBERS = 16  # a summary elides the middle of a group with more ranks
WIDTH = 100  # text width the group lists wrap to
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
    plan.add_argument(
        "--intra-node",
        metavar="A,B",
        help="with --nproc-per-node: also show the node-aware layout that keeps these axes "
        "inside a node (node_aware_ranks)",
    )
    plan.add_argument("--json", action="store_true", help="print the facts as JSON")
    plan.add_argument("--full", action="store_true", help="never summarise a large world")
    plan.add_argument(
        "--svg",
        metavar="FILE",
        help="also draw the plan as an SVG picture in FILE ('-': print it instead of the text)",
    )
    return parser


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


def _table(plan: Plan, lead: Sequence[int]) -> list[str]:
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


def _grid_lines(plan: Plan) -> list[str]:
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


def _group_text(plan: Plan, axes: Sequence[int], coord: Sequence[int], width: int = 0) -> str:
    """A group as ``[0, 8, 16]``; a summary elides the middle of a large group."""
    layout = plan.layout
    size = math.prod(layout.shape[a] for a in axes)
    if plan.full or size <= MEMBERS:
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
            lines += _wrap([_group_text(plan, p.axes, c, digits) for c in coords], p.count)
            continue
        texts = ["  " + _group_text(plan, p.axes, c) for c in coords]
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
        rows.append([g.axis.label, _group_text(plan, g.axis.axes, coord), where])
    return [first, *("  " + line for line in _columns(rows, [False, False, False]))]


def _text(plan: Plan) -> str:
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
    lines += ["", *_grid_lines(plan), *_axes_lines(plan), "", *_group_lines(plan)]
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
    try:
        plan = make_plan(
            args.shape,
            names=args.names,
            world=args.world,
            axis_specs=args.axis,
            rank=args.rank,
            nproc=args.nproc_per_node,
            full=args.full,
        )
        aware = None
        if args.intra_node is not None:
            aware = make_node_plan(plan.layout, args.intra_node, args.nproc_per_node)
    except (ValueError, TypeError, IndexError) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    output = json.dumps(plan.document()) + "\n" if args.json else _text(plan)
    if aware is not None and args.json:
        output = json.dumps({**plan.document(), "node_aware": aware.document(plan.labels)}) + "\n"
    elif aware is not None:
        grid = _grid_lines(dataclasses.replace(plan, layout=aware.layout))
        output += "\n" + "\n".join(aware.lines(plan.labels, grid, plan.full)) + "\n"
    if args.svg is not None:
        from scopedmesh.plan.svg import render_svg

        picture = render_svg(plan)
        if args.svg == "-":
            output = picture
        else:
            try:
                with open(args.svg, "w", encoding="utf-8") as file:
                    file.write(picture)
            except OSError as error:
                print(f"{PROG} {args.command}: error: --svg {args.svg}: {error}", file=sys.stderr)
                return 2
    try:
        sys.stdout.write(output)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
