"""Wall time of N ``@pytest.mark.world`` tests, each in its own world and in one reused world.

    python examples/world_reuse.py --tests 6 --size 2

Writes a test module of N tests (an all_reduce over a mesh's axis each) to a
temporary directory and times ``python -m pytest`` on it twice: with
``reuse=False`` (a world per test) and ``reuse=True`` (one world for the module).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEMPLATE = """
import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.world({size}, reuse={reuse}, mesh=({size},), names=("tp",))

"""

CASE = """
def test_{k}(world, mesh):
    x = torch.tensor([float(world.rank)])
    dist.all_reduce(x, group=mesh.get_group_along_axis("tp"))
    assert x.item() == {total}
"""


def _time(directory: Path, tests: int, size: int, reuse: bool) -> float:
    source = TEMPLATE.format(size=size, reuse=reuse)
    source += "".join(CASE.format(k=k, total=float(sum(range(size)))) for k in range(tests))
    path = directory / f"test_reuse_{reuse}.py".lower()
    path.write_text(source)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=directory,
        check=True,
        capture_output=True,
        timeout=60 + 60 * tests,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", type=int, default=6, help="number of tests in the module")
    parser.add_argument("--size", type=int, default=2, help="ranks per world")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = _time(Path(tmp), args.tests, args.size, reuse=False)
        reused = _time(Path(tmp), args.tests, args.size, reuse=True)
    print(f"{args.tests} tests on a world of {args.size} ranks (wall time of python -m pytest)")
    print(f"  a world per test (reuse=False): {fresh:6.1f} s")
    print(f"  one reused world (reuse=True):  {reused:6.1f} s  ({fresh / reused:.1f}x faster)")


if __name__ == "__main__":
    main()
