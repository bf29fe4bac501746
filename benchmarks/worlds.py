"""What starting a local test world costs: ranks forked from a warm server vs spawned.

    python -m benchmarks.worlds            # the table below, as markdown
    python -m benchmarks.worlds --quick    # one repetition, 10 hypothesis examples
    python -m benchmarks.worlds --leaks 200  # the pytest process's footprint over 200 world tests

Every figure is a wall time on this machine, reported beside the ratio to one
fresh ``python -c "import torch, torch.distributed"`` measured in the same run,
so that the table compares ways, not machines:

- **first world**: ``run_world`` of an 8-rank ``all_reduce`` in a fresh process
  (for ``forkserver`` this includes starting the server and its torch import);
- **later world**: the next ``run_world`` in the same process;
- **module of 10 tests**: ``python -m pytest`` over a module of ten
  ``@pytest.mark.world(4)`` tests, one ``all_reduce`` each, no ``reuse``
  (pytest's own start and its torch import included);
- **hypothesis example**: what one ``@given`` example of a 4-rank ``all_reduce``
  property costs once its world is up: rank 0 stamps the time at the start of
  each of ``N`` examples; the mean gap between stamps.

Each case runs in its own subprocess; nothing here is asserted.

``--leaks N`` runs one pytest session of N ``world(2)`` tests (each an
``all_reduce``; among them one that kills a rank, one that destroys WORLD and
one that leaves a group undestroyed) and prints the pytest process's open file
descriptors, child processes, ``/dev/shm`` entries and RSS after the first test
and after the last.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("spawn", "forkserver")

_WORLDS = """
import sys, time
import torch, torch.distributed as dist
from scopedmesh.testing import run_world

def all_reduce(rank, world_size):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return x.item()

if __name__ == "__main__":
    times = []
    for _ in range(2):
        start = time.perf_counter()
        assert run_world(all_reduce, 8, start_method=sys.argv[1]) == [28.0] * 8
        times.append(time.perf_counter() - start)
    print(*times)
"""

_MODULE = """
import pytest, torch, torch.distributed as dist

{tests}
"""

_TEST = """
@pytest.mark.world(4)
def test_{i}(world):
    x = torch.tensor([float(world.rank)])
    dist.all_reduce(x)
    assert x.item() == 6.0
"""

_EXAMPLES = """
import time
import pytest, torch, torch.distributed as dist
from hypothesis import given, settings, strategies as hs

@settings(max_examples={n}, deadline=None, database=None)
@given(x=hs.integers(-1000, 1000))
@pytest.mark.world(4)
def test_sum(world, x):
    if world.rank == 0:
        with open({stamps!r}, "a") as f:
            f.write(f"{{time.monotonic()}}\\n")
    t = torch.tensor([float(x + world.rank)])
    dist.all_reduce(t)
    assert t.item() == 4 * x + 6
"""


_LEAK_MODULE = """
import os
import pytest, torch, torch.distributed as dist

@pytest.mark.world(2)
def test_kill_a_rank(world):
    if world.rank == 1:
        os._exit(9)
    dist.barrier()

@pytest.mark.world(2)
def test_destroy_world(world):
    dist.destroy_process_group()

@pytest.mark.world(2)
def test_leave_a_group_undestroyed(world):
    dist.barrier(group=dist.new_group([0, 1]))

@pytest.mark.world(2)
@pytest.mark.parametrize("i", range({n}))
def test_all_reduce(world, i):
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t)
    assert t.item() == 1.0
"""

_LEAK_CONFTEST = """
import json, os

FOOTPRINTS = []

def _footprint():
    pid = os.getpid()
    children = open(f"/proc/{{pid}}/task/{{pid}}/children").read().split()
    rss = [l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]
    return {{"fds": len(os.listdir("/proc/self/fd")), "children": len(children),
            "shm": len(os.listdir("/dev/shm")), "rss_kib": int(rss)}}

def pytest_runtest_logfinish(nodeid, location):
    FOOTPRINTS.append(_footprint())

def pytest_sessionfinish(session, exitstatus):
    with open({out!r}, "w") as f:
        json.dump({{"first": FOOTPRINTS[0], "last": FOOTPRINTS[-1], "tests": len(FOOTPRINTS)}}, f)
"""


def leaks(n: int) -> dict[str, object]:
    """The pytest process's footprint after the first and the last of ``n`` world tests."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        out = where / "footprint.json"
        (where / "test_leaks.py").write_text(_LEAK_MODULE.format(n=n - 3))
        (where / "conftest.py").write_text(_LEAK_CONFTEST.format(out=str(out)))
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        argv += ["-W", "ignore::UserWarning", "test_leaks.py"]
        proc = subprocess.run(argv, cwd=where, capture_output=True, text=True, timeout=3600)
        result: dict[str, object] = json.loads(out.read_text())
        result["summary"] = proc.stdout.strip().splitlines()[-1]
        return result


def _timed(argv: list[str], cwd: Path) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=1800)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return elapsed, proc.stdout


def _pytest(module: Path, method: str) -> float:
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += ["-W", "ignore::UserWarning", f"--world-start={method}", str(module)]
    return _timed(argv, module.parent)[0]


def measure(repeats: int, examples: int) -> dict[str, dict[str, float]]:
    """Median seconds of each case, by start method (and the torch import under "import")."""
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        worlds = where / "worlds.py"
        worlds.write_text(_WORLDS)
        module = where / "test_ten.py"
        module.write_text(_MODULE.format(tests="".join(_TEST.format(i=i) for i in range(10))))
        stamps = where / "stamps.txt"
        examples_module = where / "test_examples.py"
        examples_module.write_text(_EXAMPLES.format(n=examples, stamps=str(stamps)))
        imports = [
            _timed([sys.executable, "-c", "import torch, torch.distributed"], where)[0]
            for _ in range(repeats)
        ]
        rows["import"] = {"torch import": statistics.median(imports)}
        for method in METHODS:
            firsts, laters, tens, per_example = [], [], [], []
            for _ in range(repeats):
                first, later = map(
                    float, _timed([sys.executable, str(worlds), method], where)[1].split()
                )
                firsts.append(first)
                laters.append(later)
                tens.append(_pytest(module, method))
                stamps.unlink(missing_ok=True)
                _pytest(examples_module, method)
                times = [float(line) for line in stamps.read_text().split()]
                per_example.append((times[-1] - times[0]) / (len(times) - 1))
            rows[method] = {
                "first world": statistics.median(firsts),
                "later world": statistics.median(laters),
                "module of 10 tests": statistics.median(tens),
                "hypothesis example": statistics.median(per_example),
            }
    return rows


def table(rows: dict[str, dict[str, float]]) -> str:
    """The markdown table: seconds and the ratio to one torch import, per method."""
    base = rows["import"]["torch import"]
    lines = [
        f"One `import torch, torch.distributed` in a fresh interpreter: {base:.2f} s.",
        "",
        "| case | " + " | ".join(METHODS) + " |",
        "|---|" + "---:|" * len(METHODS),
    ]
    for case in rows[METHODS[0]]:
        cells = [f"{rows[m][case]:.3f} s (x{rows[m][case] / base:.3f})" for m in METHODS]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, 10 examples")
    parser.add_argument("--leaks", type=int, metavar="N", help="footprint over N world tests")
    options = parser.parse_args(argv)
    if options.leaks is not None:
        print(leaks(options.leaks))
        return
    repeats, examples = (1, 10) if options.quick else (3, 100)
    print(textwrap.dedent(table(measure(repeats, examples))))


if __name__ == "__main__":
    main()
