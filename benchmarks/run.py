"""Run the benchmark cases, print the tables, write the results as JSON.

    python -m benchmarks.run            # everything (about 10-15 minutes)
    python -m benchmarks.run --quick    # tiny worlds, one run each (under a minute)

Each run is a fresh process; approaches are interleaved run by run, so a change
in load hits them alike. ``benchmarks/README.md`` describes the method.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks import cases, report
from benchmarks.harness import run_forked

__all__ = ["Config", "main", "quick_config", "run_all", "shape_for"]

README = Path(__file__).resolve().parent / "README.md"
NAMES = {3: ("dp", "pp", "tp"), 4: ("dp", "pp", "cp", "tp")}


def shape_for(axes: int, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The benchmark's mesh of ``axes`` axes over ``world`` ranks, and its axis names.

    >>> shape_for(3, 1024), shape_for(4, 1024)
    (((16, 8, 8), ('dp', 'pp', 'tp')), ((4, 4, 8, 8), ('dp', 'pp', 'cp', 'tp')))
    """
    inner = {3: (8, 8), 4: (4, 8, 8)}[axes]
    if world % math.prod(inner) or world < math.prod(inner):
        raise ValueError(f"a world of {world} ranks does not fit a {axes}-axis mesh {inner}")
    return (world // math.prod(inner), *inner), NAMES[axes]


@dataclass(frozen=True)
class Config:
    """What to run (times in seconds): the full run; :func:`quick_config` is the smoke run."""

    setup_worlds: tuple[int, ...] = (2**10, 2**13, 2**16, 2**20)
    scaling_worlds: tuple[int, ...] = tuple(2**k for k in range(10, 21))
    world: int = 2**16  # of (b), (c) and (f)
    real_shape: tuple[int, ...] = (2, 2, 2)
    repeats: int = 5  # runs per figure; 3 for the worlds only (e) needs
    scaling_repeats: int = 3
    budget: float = 60.0  # a setup series stops after a run this long
    long_run: float = 10.0  # ... and a point after min_repeats runs with this median
    min_repeats: int = 3
    memory_max: float = 15.0  # no memory trace after a longer timed pass
    min_time: float = 0.2  # timeit: seconds per repeat
    timeit_repeat: int = 5
    real_timeout: float = 300.0
    axes: tuple[int, ...] = (3, 4)
    cases: tuple[str, ...] = ("setup", "lookup", "submesh", "coldstart", "real")
    quick: bool = False


def quick_config() -> Config:
    worlds = (2**8, 2**9)
    # fmt: off
    return Config(worlds, worlds, 2**8, (2, 1, 1), repeats=1, scaling_repeats=1, budget=20.0,
                  min_repeats=1, memory_max=5.0, min_time=0.002, timeit_repeat=1,
                  real_timeout=45.0, quick=True)
    # fmt: on


def run_all(config: Config, *, log: Callable[[str], Any], note: str = "") -> dict[str, Any]:
    """Run the cases of ``config``; return the raw results, summary and target verdicts."""
    c, raw, stopped = config, [], []
    started, load_before = time.time(), os.getloadavg()

    def execute(case: str, impl: str, shape: Sequence[int], rep: int, limit: float = 300.0, **kw: Any) -> Any:  # fmt: skip
        args = {"shape": tuple(shape), "names": NAMES[len(shape)], **kw}
        result = run_forked(getattr(cases, case), args | ({} if case == "real" else {"impl": impl}), limit)  # fmt: skip
        head = {"case": case, "impl": impl, "shape": list(shape), "names": list(args["names"])}
        raw.append({**head, "world": math.prod(shape), **result, "rep": rep})
        figure = result.get("seconds", result.get("ns_per_call"))
        figure = f"ERROR {result['error']} {result.get('stderr', '')}" if "error" in result else figure  # fmt: skip
        log(f"{case:<9} {impl:<10} world {math.prod(shape):>8} rep {rep}: {figure}")
        return result

    for axes in c.axes if "setup" in c.cases else ():  # (a) and (e), interleaved run by run
        out: set[str] = set()
        for world in sorted(set(c.setup_worlds) | set(c.scaling_worlds if axes == 3 else ())):
            main_point = world in c.setup_worlds
            times = {impl: [] for impl in ("scopedmesh", "devicemesh", "naive")[: 2 + main_point]}
            for rep in range(c.repeats if main_point else c.scaling_repeats):
                for impl, done in times.items():
                    if impl in out or (len(done) >= c.min_repeats and statistics.median(done) > c.long_run):  # fmt: skip
                        continue
                    memory = {"memory": impl == "scopedmesh" or rep == 0, "memory_max": c.memory_max}  # fmt: skip
                    result = execute("setup", impl, shape_for(axes, world)[0], rep, c.budget * 5, **memory)  # fmt: skip
                    done += [result["seconds"]] if "seconds" in result else []
                    if result.get("error") == "timeout" or result.get("seconds", 0.0) > c.budget:
                        out.add(impl)
                        where = {"axes": axes, "world": world, "reason": f"a run took > {c.budget:g} s"}  # fmt: skip
                        stopped.append({"case": "setup", "impl": impl, **where})
    timed = {"min_time": c.min_time, "repeat": c.timeit_repeat}
    for case, world, impls, kw in (
        ("lookup", c.world, ("scopedmesh", "devicemesh", "naive", "dict"), timed),
        ("submesh", c.world, ("scopedmesh", "devicemesh"), timed),
        ("coldstart", c.world, ("scopedmesh", "floor"), {"limit": 180.0}),
    ):
        for rep in range(c.repeats if case in c.cases else 0):
            for impl in impls:
                execute(case, impl, shape_for(3, world)[0], rep, **kw)
    for rep in range(c.repeats if "real" in c.cases else 0):
        kw = {"rotate": rep, "timeout": c.real_timeout}
        execute("real", "all", c.real_shape, rep, c.real_timeout + 60, **kw)
    summary = report.summarize(raw)
    cpu = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]  # fmt: skip
    machine = {"nproc": len(os.sched_getaffinity(0)), "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}  # fmt: skip
    machine["cpu"] = cpu[0].split(":", 1)[1].strip() if cpu else "unknown"
    meta = {"command": "python -m benchmarks.run " + " ".join(sys.argv[1:]), "note": note}
    meta |= {"started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")}
    meta |= {"runtime_seconds": time.time() - started, "load_average_before": load_before}
    meta |= {"load_average_after": os.getloadavg(), "machine": machine, "config": asdict(config)}
    errors, targets = [r for r in raw if "error" in r], report.targets(summary, config)
    return {"meta": meta, "summary": summary, "stopped": stopped, "errors": errors, "targets": targets, "raw": raw}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python -m benchmarks.run", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add("--quick", "--smoke", action="store_true", help="tiny worlds, one run each (< 60 s)")
    add("--cases", help="comma-separated subset of " + ",".join(Config.cases))
    add("--repeats", type=int, help="runs per figure")
    add("--budget", type=float, help="stop a setup series once a run exceeds this many seconds")
    add("--out", type=Path, help="JSON path (default results/latest.json, or smoke.json)")
    add("--no-readme", action="store_true", help="do not put the tables into benchmarks/README.md")
    add("--note", default="", help="a remark for the machine line, e.g. other load")
    args = parser.parse_args(argv)
    config = quick_config() if args.quick else Config()
    if args.cases:
        config = replace(config, cases=tuple(args.cases.split(",")))
    if args.repeats:
        config = replace(config, repeats=args.repeats, scaling_repeats=min(args.repeats, 3))
    if args.budget:
        config = replace(config, budget=args.budget)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    results = run_all(config, log=log, note=f"; {args.note}" if args.note else "")
    print(text := report.render(results))
    out = args.out or README.parent / "results" / ("smoke.json" if args.quick else "latest.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(text + "\n")
    if not args.quick and not args.no_readme:
        report.update_readme(README, text)
    print(f"\nwrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
