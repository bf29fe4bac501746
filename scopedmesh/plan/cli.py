"""``scopedmesh plan``: a mesh's layout as text or JSON, with no process group and no GPU.

    python -m scopedmesh plan 2 4 8 --names dp pp tp --nproc-per-node 8
    python -m scopedmesh plan -1 8 --world 64 --names dp tp --rank 13
    python -m scopedmesh plan 2 2 2 --names dp pp tp --axis dp,tp --json
    python -m scopedmesh plan 2 2 2 --names dp pp tp --nproc-per-node 4 --rank 5 --svg plan.svg

This module parses the arguments and prints; :mod:`scopedmesh.plan.facts`
holds the facts (and the ``--json`` schema), :mod:`scopedmesh.plan.text` renders the text. The text shows the mesh as a grid
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
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from scopedmesh.plan.facts import make_plan
from scopedmesh.plan.node_plan import make_node_plan
from scopedmesh.plan.text import grid_lines, plan_text

__all__ = ["main"]

PROG = "scopedmesh"


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
    output = json.dumps(plan.document()) + "\n" if args.json else plan_text(plan)
    if aware is not None and args.json:
        output = json.dumps({**plan.document(), "node_aware": aware.document(plan.labels)}) + "\n"
    elif aware is not None:
        grid = grid_lines(dataclasses.replace(plan, layout=aware.layout))
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
