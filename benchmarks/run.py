"""Run every benchmark case, print the tables and write the results as JSON.

    python -m benchmarks.run            # the full harness (about 15 minutes)
    python -m benchmarks.run --quick    # tiny worlds, one run each (under a minute)

Each run of each case is a fresh subprocess (``python -m benchmarks.worker``),
because torch allows one world per process. Approaches are interleaved run by
run, so a change in machine load hits them alike; each figure is the median of
the runs, with their min and max. A setup series (one approach, one shape) stops
growing the world once a run exceeds ``--budget`` seconds, and says where.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import report

__all__ = ["Config", "full_config", "main", "quick_config", "run_all", "shape_for"]

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "benchmarks" / "README.md"

SETUP_APPROACHES = ("scopedmesh", "devicemesh", "naive")
SCALING_APPROACHES = ("scopedmesh", "devicemesh")
LOOKUP_APPROACHES = ("scopedmesh", "devicemesh", "naive", "dict")
SUBMESH_APPROACHES = ("scopedmesh", "devicemesh")


def shape_for(axes: int, world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The benchmark's mesh of ``axes`` axes over ``world`` ranks, and its axis names.

    >>> shape_for(3, 1024), shape_for(4, 1024)
    (((16, 8, 8), ('dp', 'pp', 'tp')), ((4, 4, 8, 8), ('dp', 'pp', 'cp', 'tp')))
    """
    inner = {3: (8, 8), 4: (4, 8, 8)}[axes]
    names = {3: ("dp", "pp", "tp"), 4: ("dp", "pp", "cp", "tp")}[axes]
    rest = math.prod(inner)
    if world % rest or world < rest:
        raise ValueError(f"a world of {world} ranks does not fit a {axes}-axis mesh {inner}")
    return (world // rest, *inner), names


@dataclass(frozen=True)
class Config:
    """What to run; :func:`full_config` and :func:`quick_config` are the two presets."""

    setup_worlds: tuple[int, ...]
    scaling_worlds: tuple[int, ...]
    lookup_world: int
    submesh_world: int
    real_shape: tuple[int, ...]
    repeats: int
    scaling_repeats: int
    real_repeats: int
    budget: float
    long_run: float
    min_repeats: int
    memory_max_seconds: float
    min_time: float
    timeit_repeat: int
    real_timeout: float
    axes: tuple[int, ...] = (3, 4)
    cases: tuple[str, ...] = ("setup", "lookup", "submesh", "real")
    quick: bool = False


def full_config() -> Config:
    return Config(
        setup_worlds=(2**10, 2**13, 2**16, 2**20),
        scaling_worlds=tuple(2**k for k in range(10, 21)),
        lookup_world=2**16,
        submesh_world=2**16,
        real_shape=(2, 2, 2),
        repeats=5,
        scaling_repeats=3,
        real_repeats=5,
        budget=60.0,
        long_run=10.0,
        min_repeats=3,
        memory_max_seconds=15.0,
        min_time=0.2,
        timeit_repeat=5,
        real_timeout=300.0,
    )


def quick_config() -> Config:
    return Config(
        setup_worlds=(2**8, 2**9),
        scaling_worlds=(2**8, 2**9),
        lookup_world=2**8,
        submesh_world=2**8,
        real_shape=(2, 1, 1),
        repeats=1,
        scaling_repeats=1,
        real_repeats=1,
        budget=20.0,
        long_run=10.0,
        min_repeats=1,
        memory_max_seconds=5.0,
        min_time=0.002,
        timeit_repeat=1,
        real_timeout=45.0,
        quick=True,
    )


# ------------------------------------------------------------ subprocesses


Job = tuple[str, str, tuple[int, ...], tuple[str, ...], tuple[str, ...], int]
"""(case, approach, shape, names, extra worker arguments, repeat index)"""


class Server:
    """A ``python -m benchmarks.worker --serve`` process: torch imported once, a fork per run.

    It enforces each run's timeout itself (killing the run's process group), so
    every request gets exactly one reply line. If it dies, the next request
    starts a new one.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = "1"  # see worker.run_case: one torch thread per process
        return subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", "--serve"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def run(self, argv: Sequence[str], timeout: float) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"argv": list(argv), "timeout": timeout}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError) as error:
            line = ""
            reason = repr(error)
        else:
            reason = f"exit code {self.proc.poll()}"
        if not line:
            self.close()
            return {"error": f"the benchmark server died ({reason})"}
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Runner:
    """Runs each job in its own process, keeps every raw result, logs progress."""

    def __init__(self, config: Config, log: Callable[[str], Any], server: Server) -> None:
        self.config = config
        self.log = log
        self.server = server
        self.raw: list[dict[str, Any]] = []
        self.stopped: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []

    def execute(self, job: Job, timeout: float) -> dict[str, Any]:
        case, impl, shape, names, extra, rep = job
        argv = [
            "--case",
            case,
            "--impl",
            impl,
            "--shape",
            ",".join(map(str, shape)),
            "--names",
            ",".join(names),
            "--min-time",
            str(self.config.min_time),
            "--timeit-repeat",
            str(self.config.timeit_repeat),
            *extra,
        ]
        result = self.server.run(argv, timeout)
        result = {
            "case": case,
            "impl": impl,
            "shape": list(shape),
            "names": list(names),
            "world": math.prod(shape),
            **result,
            "rep": rep,
        }
        self.raw.append(result)
        if "error" in result:
            self.errors.append(result)
        self.log(_progress(result))
        return result

    # ------------------------------------------------------------ cases

    def setup(self) -> None:
        """Cases (a) and (e): every world of both, approaches interleaved run by run."""
        c = self.config
        timeout = c.budget + 12 * c.memory_max_seconds + 60
        for axes in c.axes:
            worlds = sorted(set(c.setup_worlds) | (set(c.scaling_worlds) if axes == 3 else set()))
            stopped: set[str] = set()
            for world in worlds:
                main_point = world in c.setup_worlds
                impls = SETUP_APPROACHES if main_point else SCALING_APPROACHES
                shape, names = shape_for(axes, world)
                times: dict[str, list[float]] = {impl: [] for impl in impls}
                for rep in range(c.repeats if main_point else c.scaling_repeats):
                    for impl in impls:
                        done = times[impl]
                        long = len(done) >= c.min_repeats and statistics.median(done) > c.long_run
                        if impl in stopped or long:
                            continue
                        memory = impl == "scopedmesh" or rep == 0
                        extra: tuple[str, ...] = ("--memory-max-seconds", str(c.memory_max_seconds))
                        extra += ("--memory",) if memory else ()
                        result = self.execute(("setup", impl, shape, names, extra, rep), timeout)
                        killed = result.get("error") == "timeout"
                        if "seconds" in result:
                            done.append(result["seconds"])
                        if killed or result.get("seconds", 0.0) > c.budget:
                            stopped.add(impl)
                            reason = f"a run took > {c.budget:g} s" + (
                                " (killed)" if killed else ""
                            )
                            self.stopped.append(
                                {
                                    "case": "setup",
                                    "impl": impl,
                                    "axes": axes,
                                    "world": world,
                                    "reason": reason,
                                }
                            )

    def timed_calls(self, case: str, world: int, impls: Sequence[str]) -> None:
        """Cases (b) and (c): ns per call, approaches interleaved run by run."""
        shape, names = shape_for(3, world)
        for rep in range(self.config.repeats):
            for impl in impls:
                self.execute((case, impl, shape, names, (), rep), 300.0)

    def real(self) -> None:
        """Case (d): one gloo world per run; the approaches' order rotates run by run."""
        c = self.config
        names = ("dp", "pp", "tp")
        for rep in range(c.real_repeats):
            extra = ("--rotate", str(rep), "--timeout", str(c.real_timeout))
            self.execute(("real", "all", c.real_shape, names, extra, rep), c.real_timeout + 60)


def _progress(result: dict[str, Any]) -> str:
    head = (
        f"{result['case']:<8} {result['impl']:<11} world {result['world']:>8} rep {result['rep']}"
    )
    if "error" in result:
        return f"{head}: ERROR {result['error']} {result.get('stderr', '')}"
    if result["case"] == "setup":
        mem = f", peak {result['peak_bytes']} B" if "peak_bytes" in result else ""
        return f"{head}: {result['seconds']:.4f} s, {result['helper_calls']} new_group calls{mem}"
    if result["case"] == "real":
        return f"{head}: " + ", ".join(f"{k} {v:.3f} s" for k, v in result["seconds"].items())
    return f"{head}: {result['ns_per_call']:.0f} ns/call"


# ------------------------------------------------------------------ driver


def machine() -> dict[str, Any]:
    """The facts about this machine that the README table is quoted with."""
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "platform": platform.platform(),
    }


def run_all(config: Config, *, log: Callable[[str], Any]) -> dict[str, Any]:
    """Run the cases of ``config``; return the raw results, summary and target verdicts."""
    started = time.time()
    load_before = os.getloadavg()
    server = Server()
    runner = Runner(config, log, server)
    try:
        if "setup" in config.cases:
            runner.setup()
        if "lookup" in config.cases:
            runner.timed_calls("lookup", config.lookup_world, LOOKUP_APPROACHES)
        if "submesh" in config.cases:
            runner.timed_calls("submesh", config.submesh_world, SUBMESH_APPROACHES)
        if "real" in config.cases:
            runner.real()
    finally:
        server.close()
    summary = report.summarize(runner.raw)
    return {
        "meta": {
            "command": "python -m benchmarks.run " + " ".join(sys.argv[1:]),
            "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
            "runtime_seconds": time.time() - started,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "machine": machine(),
            "config": asdict(config),
        },
        "summary": summary,
        "stopped": runner.stopped,
        "errors": runner.errors,
        "targets": report.targets(summary, config),
        "raw": runner.raw,
    }


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        "--smoke",
        action="store_true",
        dest="quick",
        help="tiny worlds, one run each, few iterations (< 60 s)",
    )
    parser.add_argument(
        "--cases", default=None, help="comma-separated subset of setup,lookup,submesh,real"
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs per figure")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="stop a setup series once a run exceeds this many seconds",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/latest.json, or smoke.json)",
    )
    parser.add_argument(
        "--no-readme", action="store_true", help="do not put the tables into benchmarks/README.md"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    config = quick_config() if args.quick else full_config()
    overrides: dict[str, Any] = {}
    if args.cases:
        overrides["cases"] = tuple(args.cases.split(","))
    if args.repeats:
        overrides.update(repeats=args.repeats, real_repeats=args.repeats)
        overrides["scaling_repeats"] = min(args.repeats, config.scaling_repeats)
    if args.budget:
        overrides["budget"] = args.budget
    config = Config(**{**asdict(config), **overrides})
    results = run_all(config, log=lambda line: print(line, file=sys.stderr, flush=True))
    text = report.render(results)
    print(text)
    out = args.out or RESULTS / ("smoke.json" if config.quick else "latest.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(text + "\n")
    if not config.quick and not args.no_readme and README.exists():
        report.update_readme(README, text)
    print(f"\nwrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
