"""Heal after a SIGKILL: from a rank's death to the survivors' first step on the re-formed mesh.

    .venv/bin/python -m benchmarks.heal                    # 2x2x2, 4x2, 8x1: 20 kills each
    .venv/bin/python -m benchmarks.heal --shapes 4x4 --kills 5   # 16 ranks
    .venv/bin/python -m benchmarks.heal --standby on       # survivors' groups formed ahead
    .venv/bin/python -m benchmarks.heal --against torchft  # side by side with torchft 0.2.0
    .venv/bin/python -m benchmarks.heal --against torchft --burn  # the same, under load
    .venv/bin/python -m benchmarks.heal --against torchft --burn --standby on  # ours with standby groups
    .venv/bin/python -m benchmarks.heal --backend nccl     # on a GPU host (benchmarks.heal_nccl)
    .venv/bin/python -m benchmarks.heal --grow             # grow back (benchmarks.grow)

The command (:func:`main`) runs :mod:`benchmarks.heal_random`: the launcher
SIGKILLs a random rank from outside at a random moment, inside a collective or
between two, while every step all-reduces 4 MiB along ``dp``. Per kill a row of
seconds from the kill until the latest survivor that trains on has learned
it (``detect``), raised (``abort``), agreed, formed its new groups
(``re-form``) and completed its first step on them; per shape a line; last,
``heal: median X s, max Y s over N kills (...)`` over every kill.

Other modes are modules of their own, each with a ``main(args) -> int``, that
:func:`mode` picks from the arguments (``--against torchft``:
:mod:`benchmarks.heal_torchft`; ``--backend nccl``: :mod:`benchmarks.heal_nccl`;
``--grow``: :mod:`benchmarks.grow`); the modules import this one never, so nothing
imports in a circle. The pieces they share are in :mod:`benchmarks.heal_common`.

The world the watch's tests run (``tests/world/test_watch.py``: ``heal.launch``,
``heal.check``, ...) is :mod:`benchmarks.heal_plan`; its names are re-exported here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import heal_random
from benchmarks.heal_common import PHASES, burners, load, reference, summary
from benchmarks.heal_plan import (
    NAMES,
    SHAPE,
    check,
    launch,
    phases,
    rank_main,
    resume_step,
    watch_keys,
)

__all__ = [  # the watch's tests' world (benchmarks.heal_plan), and the command
    "NAMES",
    "SHAPE",
    "check",
    "launch",
    "main",
    "mode",
    "phases",
    "rank_main",
    "reference",
    "resume_step",
    "watch_keys",
]


def mode(args: argparse.Namespace) -> str | None:
    """The module that runs ``args`` other than as outside kills on gloo, or None.

    Each such module has ``main(args: argparse.Namespace) -> int`` and fills in
    the defaults it needs (``args.kills``, ``args.timeout`` are None when not given).
    """
    if args.against == "torchft":
        return "benchmarks.heal_torchft"
    if args.backend == "nccl":
        return "benchmarks.heal_nccl"
    if args.grow:
        return "benchmarks.grow"
    return None


def parser() -> argparse.ArgumentParser:
    """The command's arguments, every mode's (a mode adds its own here)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, help="kills per shape (20; against torchft: 10)")
    parser.add_argument(
        "--shapes", default="2x2x2,4x2,8x1", help="of " + ",".join(heal_random.SHAPES)
    )
    parser.add_argument(
        "--timeout", type=float, help="collective timeout, s (60; against torchft: 10, on both)"
    )
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--against", choices=["torchft"], help="side by side with torchft")
    parser.add_argument("--out", type=Path, help="write every kill's figures here (JSON)")
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], default="gloo", help="nccl: on a GPU host"
    )
    parser.add_argument(
        "--grow", action="store_true", help="grow back: kill, restart, rejoin (benchmarks.grow)"
    )
    parser.add_argument(
        "--burn", action="store_true", help="under load: a CPU burner per core beside the run"
    )
    parser.add_argument(
        "--standby",
        choices=["on", "off", "both"],
        help="groups for the survivors formed before the kill (gloo: off by default; "
        "nccl: both, kills alternating)",
    )
    parser.add_argument("--bound", action="store_true", help="nccl: WORLD bound to the device")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="nccl: the same code on gloo, on the CPU"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.burn:
        count = os.cpu_count() or 1
        print(f"under load: {count} CPU burners (one per core) beside the run", flush=True)
        with burners(count):
            return run(args, argv)
    return run(args, argv)


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The mode ``args`` asks for (:func:`mode`), or the outside kills on gloo."""
    other = mode(args)
    if other is not None:
        module: Any = importlib.import_module(other)
        code: int = module.main(args)
        return code
    args.kills = 20 if args.kills is None else args.kills
    args.timeout = 60.0 if args.timeout is None else args.timeout
    if args.standby == "both":
        raise SystemExit("heal: --standby both alternates on NCCL only (--backend nccl)")
    standby = args.standby == "on"
    rng = random.Random(args.seed)
    started, load_before = time.monotonic(), load()
    every: list[list[float]] = []
    record: list[dict[str, Any]] = []
    all_kills: list[heal_random.Kill] = []
    shapes = args.shapes.split(",")
    for shape in shapes:
        plan = heal_random.plan_for(shape, timeout=args.timeout, standby=standby)
        names = ", ".join(plan["names"])
        print(
            f"{shape} ({names}), {math.prod(plan['shape'])} ranks, {args.kills} kills, "
            f"mesh timeout {args.timeout:g} s, standby {'on' if standby else 'off'}, {load()}",
            flush=True,
        )
        print(
            f"{'kill':>4} {'rank':>4} {'step':>4} {'killed in':<14} "
            + " ".join(f"{p:>10}" for p in PHASES)
            + "  survivors raised in",
            flush=True,
        )
        rows = []
        kills: list[heal_random.Kill] = []
        mid = 0
        for number in range(args.kills):
            kill = heal_random.launch(plan, rng)
            heal_random.check(kill, plan)
            row = heal_random.phases(kill)
            rows.append(row)
            kills.append(kill)
            mid += kill.where.endswith("all_reduce")
            raised = ", ".join(heal_random.survivor_errors(kill))
            print(
                f"{number + 1:>4} {kill.victim:>4} {kill.step:>4} {kill.where:<14} "
                + " ".join(f"{t:>10.3f}" for t in row)
                + f"  {raised}",
                flush=True,
            )
            record.append(
                {
                    "shape": shape,
                    "victim": kill.victim,
                    "step": kill.step,
                    "where": kill.where,
                    "delay": kill.delay,
                    "phases": dict(zip(PHASES, row)),
                    "breakdown": dict(zip(heal_random.BREAKDOWN, heal_random.breakdown(kill))),
                    "step_before_kill": kill.per_step,
                    "raised_in": raised,
                    "launcher_marks": kill.marks,
                }
            )
        every += rows
        all_kills += kills
        print(
            f"{shape}: {summary(rows)}; killed inside a collective {mid} of {len(rows)}; {load()}",
            flush=True,
        )
        print(f"{shape} {heal_random.breakdown_line(kills)}", flush=True)
    wall = time.monotonic() - started
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": "python -m benchmarks.heal " + " ".join(argv or sys.argv[1:]),
                    "torch": torch.__version__,
                    "wall_s": wall,
                    "load_before": load_before,
                    "load_after": load(),
                    "kills": record,
                    "summary": "heal: " + summary(every),
                },
                indent=1,
            )
            + "\n"
        )
    print(f"heal {heal_random.breakdown_line(all_kills)}", flush=True)
    print(f"wall {wall:.0f} s; {load_before} before, {load()} after", flush=True)
    print(f"heal: {summary(every)}")  # the last line, as tests/world/test_benchmarks.py reads it
    return 0


if __name__ == "__main__":
    sys.exit(main())
