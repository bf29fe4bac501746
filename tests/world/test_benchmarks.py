"""The benchmark harness is tested so it cannot silently rot.

One smoke run (``python -m benchmarks.run --quick``: tiny worlds, one run each)
is shared by the tests below. They check what the harness records and the
figures that are not timings: group-creation counts and the memory byte bound.
No test asserts a time.
"""

from __future__ import annotations

import doctest
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import report  # noqa: E402
from benchmarks.run import quick_config, shape_for  # noqa: E402

# Each test runs a benchmark as a user runs it: the launch lane.
pytestmark = pytest.mark.launch

MEMORY_BOUND = 256 * 1024  # bytes: the bound on the mesh's peak Python memory


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hang, not a timing assertion
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results: dict[str, Any] = json.loads(out.read_text())
    results["stdout"] = proc.stdout
    results["markdown"] = out.with_suffix(".md").read_text()
    return results


def _setup_runs(smoke: dict[str, Any], impl: str) -> list[dict[str, Any]]:
    runs = [r for r in smoke["raw"] if r["case"] == "setup" and r["impl"] == impl]
    assert runs, f"no setup runs of {impl}"
    return runs


def test_every_case_and_approach_ran_without_errors(smoke: dict[str, Any]) -> None:
    assert smoke["errors"] == []
    config = quick_config()
    ran = {(r["case"], r["impl"], r["world"], len(r["shape"])) for r in smoke["raw"]}
    for axes in config.axes:
        for world in config.setup_worlds:
            for impl in ("scopedmesh", "devicemesh", "naive"):
                assert ("setup", impl, world, axes) in ran
    for world in config.scaling_worlds:
        for impl in ("scopedmesh", "devicemesh"):
            assert ("setup", impl, world, 3) in ran
    for impl in ("scopedmesh", "devicemesh", "naive", "dict"):
        assert ("lookup", impl, config.world, 3) in ran
    for impl in ("scopedmesh", "devicemesh"):
        assert ("submesh", impl, config.world, 3) in ran
    for impl in ("scopedmesh", "floor"):
        assert ("coldstart", impl, config.world, 3) in ran
    (real,) = [r for r in smoke["raw"] if r["case"] == "real"]
    assert set(real["seconds"]) == {"scopedmesh", "devicemesh", "naive", "floor"}
    assert len(real["per_rank"]) == math.prod(config.real_shape)
    assert {r["torch_threads"] for r in smoke["raw"]} == {1}


def test_cold_start_is_broken_down_and_adds_up(smoke: dict[str, Any]) -> None:
    for run in (r for r in smoke["raw"] if r["case"] == "coldstart"):
        steps = ["import", "construct", "group1", "group2", "group3"]
        parts = [run[f"{step}_seconds"] for step in steps]
        assert all(p >= 0 for p in parts) and run["seconds"] == pytest.approx(sum(parts)), run
        if run["impl"] == "floor":  # nothing to import or construct
            assert parts[:2] == [0.0, 0.0], run


def test_torch_copy_is_measured_beside_scopedmesh_own_time(smoke: dict[str, Any]) -> None:
    for run in _setup_runs(smoke, "scopedmesh"):
        assert 0 < run["copy_seconds"] and 0 < run["helper_seconds"] < run["seconds"], run
    for entry in (e for e in smoke["summary"]["setup"] if e["impl"] == "scopedmesh"):
        own, total = entry["own_seconds"]["median"], entry["seconds"]["median"]
        assert own == pytest.approx(total - entry["helper_seconds"]["median"]), entry


def test_scopedmesh_makes_exactly_one_new_group_call_per_requested_group(
    smoke: dict[str, Any],
) -> None:
    for run in _setup_runs(smoke, "scopedmesh"):
        ndim = len(run["shape"])
        assert run["requested_groups"] == ndim
        assert run["helper_calls"] == ndim, run
        assert run["groups_registered"] == ndim, run
        assert run["warnings"] == [], "scopedmesh fell back to public new_group"


def test_baselines_call_new_group_for_every_group_of_every_axis(smoke: dict[str, Any]) -> None:
    # Proves the counter sees torch's own new_group path, not only scopedmesh's.
    for impl in ("devicemesh", "naive"):
        for run in _setup_runs(smoke, impl):
            shape = run["shape"]
            assert run["helper_calls"] == sum(math.prod(shape) // n for n in shape), run
            assert run["groups_registered"] == len(shape), run


def test_scopedmesh_peak_memory_is_under_the_bound(smoke: dict[str, Any]) -> None:
    runs = _setup_runs(smoke, "scopedmesh")
    assert all("peak_bytes" in r for r in runs), "scopedmesh memory is traced on every run"
    for run in runs:
        assert 0 < run["retained_bytes"] <= run["peak_bytes"] < MEMORY_BOUND, run


def test_results_carry_machine_command_summary_and_targets(smoke: dict[str, Any]) -> None:
    meta = smoke["meta"]
    assert meta["command"].startswith("python -m benchmarks.run")
    assert {"nproc", "python", "torch", "cpu"} <= set(meta["machine"])
    assert meta["config"]["quick"] is True
    summary = smoke["summary"]
    assert {e["impl"] for e in summary["setup"]} == {"scopedmesh", "devicemesh", "naive"}
    for entry in summary["setup"]:
        assert entry["seconds"]["min"] <= entry["seconds"]["median"] <= entry["seconds"]["max"]
    assert {t["case"] for t in smoke["targets"]} == {"a", "b", "c", "d", "f"}
    assert all(t["met"] is not None for t in smoke["targets"]), smoke["targets"]
    headings = ("(a) setup", "(e) scaling", "(b) cached lookup", "(c) sub-mesh", "(d) real")
    for heading in (*headings, "(f) cold start", "÷ floor", "per-member copy"):
        assert heading in smoke["stdout"]
        assert heading in smoke["markdown"]
    assert "### Targets" in smoke["stdout"]


def test_stat_and_formatting() -> None:
    assert report.stat([5.0, 1.0, 3.0, 2.0]) == {"median": 2.5, "min": 1.0, "max": 5.0, "n": 4}
    assert report.fmt_seconds(2e-7) == "0.2 µs"
    assert report.fmt_bytes(3 * 1024**2) == "3.0 MiB"


def test_shapes_are_the_documented_ones() -> None:
    assert shape_for(3, 2**20) == ((2**14, 8, 8), ("dp", "pp", "tp"))
    assert shape_for(4, 2**20) == ((2**12, 4, 8, 8), ("dp", "pp", "cp", "tp"))
    with pytest.raises(ValueError, match="does not fit"):
        shape_for(4, 128)


def test_update_readme_replaces_only_between_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{report.BEGIN}\nold\n{report.END}\ntail\n")
    report.update_readme(readme, "new table")
    assert readme.read_text() == f"head\n{report.BEGIN}\nnew table\n{report.END}\ntail\n"
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        report.update_readme(readme, "x")


def test_docstring_examples() -> None:
    from benchmarks import cases, harness, run

    for module in (report, run, cases, harness):
        failed, _ = doctest.testmod(module)
        assert failed == 0, module.__name__


def test_dtensor_scope_benchmark_runs_every_case() -> None:
    """``python -m benchmarks.dtensor_scope``: the four cases, each timed, in one short run."""
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.dtensor_scope", "--rounds", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(
        r"^(torch warm|scoped warm|scoped after a close|torch cold) +(\S+) +(\S+)$",
        run.stdout,
        re.M,
    )
    assert [case for case, _, _ in rows] == [
        "torch warm",
        "scoped warm",
        "scoped after a close",
        "torch cold",
    ], run.stdout
    assert float(rows[0][2]) == 1.0 and all(float(ms) > 0 for _, ms, _ in rows)


# ------------------------------------------------------------------ heal (benchmarks/heal.py)

HEAL_NUMBER = r"-?\d+\.\d+"  # negative when a survivor raised before the kill (see below)
HEAL_SUMMARY = (
    rf"median {HEAL_NUMBER} s, max {HEAL_NUMBER} s over {{n}} kills \(detect {HEAL_NUMBER}, "
    rf"abort {HEAL_NUMBER}, agree {HEAL_NUMBER}, re-form {HEAL_NUMBER}, first step {HEAL_NUMBER}\)"
)


def test_heal_model_equals_plain_data_parallelism_step_by_step() -> None:
    """The heal benchmark's model and 4 MiB bucket, two replicas summed here: the reference."""
    from benchmarks import heal_random as hr

    sizes = {"dp": 2, "tp": 1}
    replicas = [hr.initial(sizes, {"dp": r, "tp": 0}) for r in range(2)]
    losses = []
    for step in range(4):
        buckets = []
        for r, weights in enumerate(replicas):
            bucket, _ = hr.gradients(weights, step, sizes, {"dp": r, "tp": 0}, lambda t, a: None)
            buckets.append(bucket)
        assert buckets[0].numel() * 8 == 4 * 1024 * 1024  # the all_reduce carries 4 MiB
        losses.append([hr.apply(w, buckets[0] + buckets[1], 2) for w in replicas])
    expected = hr.small_reference(4, lambda s: 2)
    assert [a for a, b in losses] == [b for a, b in losses]
    assert [a for a, _ in losses] == pytest.approx(expected, rel=1e-12)
    big = hr.reference_big(replicas[0].big.numel(), 4, lambda s: 2)
    assert float((replicas[0].big - big).abs().max()) < 1e-12


def test_heal_benchmark_kills_from_outside_and_prints_its_lines(tmp_path: Path) -> None:
    """One outside SIGKILL in a 4 x 1 world: the row, the shape's line, the last line, the JSON."""
    out = tmp_path / "heal.json"
    args = ["--shapes", "4x1", "--kills", "1", "--timeout", "10", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.heal", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang, not a timing assertion
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("4x1 (dp, tp), 4 ranks, 1 kills"), lines
    # A phase may be negative: a survivor whose collectives ended before the kill (the
    # victim died after its last one) has its "abort" column before the kill.
    row = re.fullmatch(r" +1 +([0-3]) +\d+ (.{14})(?: +-?\d+\.\d+){5}  (.+)", lines[2])
    assert row, lines[2]
    assert re.fullmatch(rf"4x1: {HEAL_SUMMARY.format(n=1)}; killed inside .*", lines[3]), lines[3]
    assert re.fullmatch(rf"heal: {HEAL_SUMMARY.format(n=1)}", lines[-1]), lines[-1]
    breakdown = r"breakdown, medians: detect -?\d\.\d{3} \(\+-?\d+ ms\), abort .*"
    assert re.fullmatch(rf"4x1 {breakdown}", lines[4]), lines[4]
    assert re.fullmatch(rf"heal {breakdown}", lines[-3]), lines[-3]
    record = json.loads(out.read_text())
    (kill,) = record["kills"]
    assert kill["victim"] == int(row.group(1)) and kill["where"] == row.group(2).strip()
    assert record["summary"] == lines[-1]


# ------------------------------------------------------------------ the heal benchmarks' layout


def _benchmark_imports(path: Path) -> set[str]:
    """The ``benchmarks.*`` modules ``path`` imports, anywhere in it (lazy imports too)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            found.update(f"benchmarks.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            found.add(str(node.module))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("benchmarks."))
    return found


def test_heal_benchmarks_import_in_one_direction() -> None:
    """heal (the command) -> its modes -> heal_common: no module imports one above it."""
    graph = {
        f"benchmarks.{path.stem}": _benchmark_imports(path)
        for path in sorted((REPO / "benchmarks").glob("heal*.py"))
    }
    assert graph["benchmarks.heal_common"] == set()  # the shared pieces depend on no benchmark
    for module, imported in graph.items():
        if module != "benchmarks.heal":
            assert "benchmarks.heal" not in imported, module  # only the command dispatches

    def reaches(start: str, target: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(
            nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt}))
            for nxt in graph.get(start, ())
        )

    assert [m for m in graph if reaches(m, m)] == []  # no circle, however long


def test_heal_common_docstring_examples() -> None:
    from benchmarks import heal_common

    failed, _ = doctest.testmod(heal_common)
    assert failed == 0


def test_a_rank_that_checks_in_then_dies_had_checked_in() -> None:
    """Rank 6 checks in through the agreement's own protocol, then SIGKILLs itself.

    Every survivor reads, after agreeing, how the agreement accounted for each
    member: rank 6 as ``alive`` (it checked in itself), rank 5 (killed before) by the
    store's list of deaths (no entry is written for it); all decide {5, 6}. Rank 7,
    stopped whole for 2 s as the step begins, holds the agreement open until rank 6's
    death is known.
    """
    from benchmarks import heal_plan

    plan = {"steps": 7, "kill": {"5": 3}, "die_checked_in": 6, "stop": [7, 3, 2.0]}
    result = heal_plan.launch(plan, timeout=300)
    reports = result["reports"]
    assert result["exitcodes"][6] == -9 and result["exitcodes"][5] == -9
    survivors = sorted(set(range(8)) - {5, 6})
    assert set(reports) >= set(survivors), result["exitcodes"]
    for rank in survivors:
        assert "unexpected" not in reports[rank], reports[rank]["unexpected"]
        event = reports[rank]["events"][0]
        assert event["accounted"]["6"] == "alive", (rank, event["accounted"])
        assert event["accounted"]["5"] == "listed dead", (rank, event["accounted"])
        assert event["lost"] == [5, 6], (rank, event)
    assert result["watch_keys"] == []
