"""Tests for the pytest plugin (scopedmesh.testing.plugin), run through ``pytester``.

Each spawned world costs seconds of imports, so each pytester run holds several
cases. Every run checks that no rank process outlives it.
"""

from __future__ import annotations

import json

# pytester's in-process runs restore sys.modules afterwards: the fork server's module,
# imported again, would start a second server, so it is imported here, before any run.
import multiprocessing.forkserver  # noqa: F401
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# pytester's in-process runs restore sys.modules afterwards; torch cannot be imported
# twice in one process, so the launcher (and torch) are imported here, before any run.
import scopedmesh.testing.launcher
import scopedmesh.testing.reuse  # noqa: F401

pytest_plugins = ("pytester",)

HEADER = """
import json

# pytester's in-process runs restore sys.modules afterwards: the fork server's module,
# imported again, would start a second server, so it is imported here, before any run.
import multiprocessing.forkserver  # noqa: F401
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

PIDS = Path({pids!r})


def record(name, rank):
    PIDS.joinpath(f"{{name}}-{{rank}}.pid").write_text(str(os.getpid()))
"""


def _write(pytester: pytest.Pytester, pid_dir: Path, body: str) -> None:
    pytester.makepyfile(HEADER.format(pids=str(pid_dir)) + body)


def _pids(pid_dir: Path, name: str) -> set[int]:
    return {int(p.read_text()) for p in pid_dir.glob(f"{name}-*.pid")}


def _assert_gone(pids: set[int]) -> None:
    assert pids
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie is gone for good but not yet reaped: its state says so.
        stat = Path(f"/proc/{pid}/stat")
        assert stat.exists() and stat.read_text().split(") ")[1].startswith("Z"), pid


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore::UserWarning", *args)


def test_pass_fail_on_one_rank_and_crash(pytester: pytest.Pytester, tmp_path: Path) -> None:
    _write(
        pytester,
        tmp_path,
        """
@pytest.mark.parametrize("scale", [10.0])
@pytest.mark.world(2, mesh=(1, 2), names=("dp", "tp"))
def test_pass(world, mesh, scale):
    record("pass", world.rank)
    assert (world.rank, world.world_size) == (dist.get_rank(), 2)
    x = torch.tensor([scale * world.rank])
    dist.all_reduce(x, group=mesh.get_group_along_axis("tp"))
    assert x.item() == 10.0 and mesh.coordinate() == (0, world.rank)


@pytest.mark.world(2)
def test_fail_on_rank_1(world):
    record("fail", world.rank)
    seen = world.rank
    assert seen == 0


@pytest.mark.world(2)
def test_crash_on_rank_1(world):
    record("crash", world.rank)
    if world.rank == 1:
        os._exit(3)
""",
    )
    result = _run(pytester)
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "rank 1 of a world of 2 failed" in out
    assert "--- rank 1 ---" in out
    assert "in test_fail_on_rank_1" in out  # the rank's traceback
    assert "assert 1 == 0" in out  # with pytest's assertion rewriting
    assert "rank 1 ended without reporting a result: its process exited with code 3" in out
    assert "rank 0 of" not in out
    for name in ("pass", "fail", "crash"):
        _assert_gone(_pids(tmp_path, name))


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_hang_fails_after_the_timeout(pytester: pytest.Pytester, tmp_path: Path) -> None:
    _write(
        pytester,
        tmp_path,
        """
import time


@pytest.mark.world(2, timeout=10)
def test_hang(world):
    record("hang", world.rank)
    if world.rank == 1:
        time.sleep(3600)
""",
    )
    result = _run(pytester)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "world of 2 ranks timed out after 10 s; ranks still running: [" in out
    _assert_gone(_pids(tmp_path, "hang"))


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_reused_world_serves_a_module_and_restarts_after_a_failure(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    _write(
        pytester,
        tmp_path,
        """
import time

pytestmark = pytest.mark.world(2, reuse=True, mesh=(2,), names=("tp",))


def _check(world, mesh, name):
    record(name, world.rank)
    x = torch.tensor([1.0])
    dist.all_reduce(x, group=mesh.get_group_along_axis("tp"))
    assert x.item() == 2.0


def test_a(world, mesh):
    _check(world, mesh, "a")


def test_b(world, mesh):
    _check(world, mesh, "b")


def test_c_fails_on_rank_0(world):
    record("c", world.rank)
    assert world.rank == 1


def test_d(world, mesh):
    _check(world, mesh, "d")


@pytest.mark.world(2, reuse=True, timeout=10)
def test_e_hangs_on_rank_0(world):
    record("e", world.rank)
    if world.rank == 0:
        time.sleep(3600)


def test_f(world, mesh):
    _check(world, mesh, "f")
""",
    )
    result = _run(pytester)
    result.assert_outcomes(passed=4, failed=2)
    out = result.stdout.str()
    assert "rank 0 of a world of 2 failed" in out
    assert "world of 2 ranks timed out after 10 s; ranks still running: [0]" in out
    a, b, c, d, f = (_pids(tmp_path, name) for name in "abcdf")
    assert a == b == c  # one world served a, b and c
    assert d.isdisjoint(c)  # c failed: d got a new world
    assert f.isdisjoint(d)  # e hung: f got a new world
    _assert_gone(a | d | _pids(tmp_path, "e") | f)


def test_bad_markers_and_fixtures_are_errors_naming_the_argument(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
import pytest


@pytest.mark.world(0)
def test_size():
    pass


@pytest.mark.world(2, timeout=-1)
def test_timeout():
    pass


@pytest.mark.world(4, mesh=(3,))
def test_mesh_shape():
    pass


@pytest.mark.world(2, backend="gloo", colour="red")
def test_unknown_option():
    pass


def test_world_fixture_without_marker(world):
    pass


@pytest.mark.world(2)
def test_mesh_fixture_without_shape(mesh):
    pass


def test_plain():
    pass
"""
    )
    result = _run(pytester)
    result.assert_outcomes(passed=1, errors=6)
    result.stdout.fnmatch_lines_random(
        [
            "*ValueError: world(size): size must be >= 1, got 0",
            "*ValueError: world(timeout=...): timeout must be finite and > 0, got -1",
            "*ValueError: world(mesh=...): a mesh of shape (3,) does not lay out 4 ranks",
            "*TypeError: world(): unknown option 'colour'*",
            "*ValueError: the world fixture needs the test marked @pytest.mark.world(size)",
            "*ValueError: the mesh fixture needs a mesh shape in the marker*",
        ]
    )


def test_marker_is_registered_and_loading_the_plugin_leaves_torch_out(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.world(size, *, backend='gloo', timeout=120*"])
    code = "import sys, scopedmesh.testing.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


HYPOTHESIS_TESTS = """
import json
from hypothesis import Phase, example, given, settings, strategies as hs
from hypothesis.database import DirectoryBasedExampleDatabase


def seen(name, rank, value):
    with PIDS.joinpath(f"{name}-{rank}.seen").open("a") as f:
        f.write(json.dumps(value) + "\\n")


@settings(max_examples=30, deadline=None)
@example(x=-7, shape=(4,))
@given(x=hs.integers(-1000, 1000), shape=hs.sampled_from([(4,), (2, 2), (1, 4)]))
@pytest.mark.world(4)
def test_lockstep(world, x, shape):
    from scopedmesh import ProcessGroupMesh
    record("lockstep", world.rank)
    seen("lockstep", world.rank, [x, list(shape)])
    with ProcessGroupMesh(*shape) as mesh:
        t = torch.tensor([float(x + world.rank)])
        dist.all_reduce(t, group=mesh.get_group_along_axis(len(shape) - 1))
        ranks = mesh.layout.group(mesh.coordinate(), len(shape) - 1)
        assert t.item() == len(ranks) * x + sum(ranks)


# An explicit database: hypothesis's "ci" profile (loaded where CI is set) has none.
@settings(max_examples=40, deadline=None, database=DirectoryBasedExampleDatabase(PIDS / "db"))
@given(x=hs.integers(0, 1000))
@pytest.mark.world(4)
def test_fails_on_rank_1_from_17(world, x):
    record("shrink", world.rank)
    seen("shrink", world.rank, x)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    if world.rank == 1:
        assert x < 17


@settings(deadline=None, phases=[Phase.explicit])
@example(x=3)
@pytest.mark.world(2, timeout=5)
@given(x=hs.integers())
def test_hangs_on_rank_0(world, x):
    record("hang", world.rank)
    if world.rank == 0:
        import time
        time.sleep(3600)


@pytest.mark.world(2)
def test_after_the_hang(world):
    record("after", world.rank)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    assert t.item() == 2.0
"""


def _seen(pid_dir: Path, name: str) -> dict[str, list[object]]:
    return {
        p.name: [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(pid_dir.glob(f"{name}-*.seen"))
    }


@pytest.mark.launch  # a slow lane: .ci/run runs it (a user's hypothesis file, run by pytest)
def test_hypothesis_drives_a_world_in_lockstep_and_shrinks_a_failure(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    _write(pytester, tmp_path, HYPOTHESIS_TESTS)
    result = _run(pytester)
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()

    # Every example ran on every rank, in the same order: hypothesis draws in pytest only.
    lockstep = _seen(tmp_path, "lockstep")
    assert len(lockstep) == 4
    runs = list(lockstep.values())
    assert all(run == runs[0] for run in runs)
    assert runs[0][0] == [-7, [4]] and len(runs[0]) > 10  # @example first, then drawn ones

    # The failure on rank 1 shrank to the smallest x, and the report shows rank 1's traceback.
    assert "rank 1 of a world of 4 failed" in out
    assert "in test_fails_on_rank_1_from_17" in out
    assert "assert 17 < 17" in out
    assert "x=17" in out
    shrink = _seen(tmp_path, "shrink")
    assert shrink["shrink-0.seen"][-1] == 17  # the last example replayed is the shrunk one

    # A hung example fails within the marker's timeout; the next test gets a fresh world.
    # Rank 0 hangs; rank 1, whose example returns at once, may still be starting it after
    # 5 s on a loaded machine (a CI run with a torch download beside it: "[0, 1]").
    assert re.search(r"world of 2 ranks timed out after 5 s; ranks still running: \[0(, 1)?\]", out)
    assert _pids(tmp_path, "after").isdisjoint(_pids(tmp_path, "hang"))
    for name in ("lockstep", "shrink", "hang", "after"):
        _assert_gone(_pids(tmp_path, name))

    # The example database: a second run replays the saved failure first.
    for p in tmp_path.glob("shrink-*.seen"):
        p.unlink()
    again = _run(pytester, "-k", "fails_on_rank_1")
    again.assert_outcomes(failed=1, deselected=3)
    assert _seen(tmp_path, "shrink")["shrink-1.seen"][0] == 17


LEAK_TESTS = """
@pytest.mark.world(2)
@pytest.mark.parametrize("i", range({n}))
def test_all_reduce(world, i):
    record(f"sum{{i}}", world.rank)
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t)
    assert t.item() == 1.0


@pytest.mark.xfail(strict=True)
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
    group = dist.new_group([0, 1])
    dist.barrier(group=group)


@pytest.mark.world(2)
def test_after_the_poison(world):
    group = dist.new_group([0, 1])
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=group)
    assert t.item() == 2.0 and dist.get_world_size() == 2
"""


def _footprint() -> tuple[int, int, int]:
    """This process's open fds, its child processes, and the files in /dev/shm."""
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    return len(os.listdir("/proc/self/fd")), len(children), len(os.listdir("/dev/shm"))


def test_no_leak_and_no_poison_between_world_tests(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    _write(pytester, tmp_path, LEAK_TESTS.format(n=1))
    _run(pytester).assert_outcomes(passed=4, xfailed=1)  # starts the fork server, if not yet
    before = _footprint()
    _write(pytester, tmp_path, LEAK_TESTS.format(n=20))
    _run(pytester).assert_outcomes(passed=23, xfailed=1)
    assert _footprint() == before
    _assert_gone(set().union(*(_pids(tmp_path, f"sum{i}") for i in range(20))))
