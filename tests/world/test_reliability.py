"""Lifetime rules under stress: soak, faults, exception safety, misuse, independence.

Every check runs in real gloo worlds over loopback (``scopedmesh.testing.run_world``).
A world costs seconds to start, so each world runs many checks and the tests
assert on what it returns. Long variants are marked ``slow`` (``pytest -m slow``);
the figures they print (``-s``) are the ones in RELIABILITY.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import _workers_ci
import _workers_death
import _workers_independence
import _workers_soak
import pytest

from scopedmesh.testing import WorldError, free_port, run_world

WORLD = 4
# Seconds: generous "never hang" bounds, not performance assertions.
CLOSE_BOUND = 10.0
FORMATION_BOUND = 10.0  # a 1 s mesh timeout must surface well before this
MIB = 1024


def _figure(name: str, **values: object) -> None:
    """One line a human (and RELIABILITY.md) can read; shown with ``pytest -s``."""
    print(f"\nRELIABILITY {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


# ================================================================== 1. soak


def _check_soak(results: list[dict[str, Any]], cycles: int, rss_bound_mib: int) -> None:
    for r in results:
        assert r["cycles"] == cycles
        assert r["groups_made"] == 4 * cycles, r
        assert r["leaked"] == 0, f"rank {r['rank']} leaked {r['leaked']} groups"
        assert r["bad_sums"] == 0, f"rank {r['rank']}: a collective on a fresh group failed"
        assert r["final_live"] == r["baseline"]
        assert r["tags"] <= 2, "torch's tags_to_pg grew with every group made"
    growth = {r["rank"]: r["rss_end_kib"] - r["rss_start_kib"] for r in results}
    measured = cycles - 5
    # Growth over the second half alone: flat there means bounded, not merely small.
    second_half = {
        r["rank"]: r["rss_end_kib"] - min(r["samples"], key=lambda s: abs(s[0] - cycles // 2))[1]
        for r in results
    }
    _figure(
        f"soak {cycles} cycles",
        groups_made_per_rank=results[0]["groups_made"],
        leaked=sum(r["leaked"] for r in results),
        rss_growth_kib=growth,
        second_half_growth_kib=second_half,
        kib_per_cycle={k: round(v / measured, 2) for k, v in growth.items()},
        store_keys_per_cycle=round(results[0]["store_keys_added"] / measured, 2),
        seconds=round(max(r["seconds"] for r in results), 1),
    )
    assert max(growth.values()) < rss_bound_mib * MIB, growth


def test_soak_short(ci: dict[str, Any]) -> None:
    """50 open/request/close cycles: no group outlives its cycle, memory stays flat."""
    _check_soak(_section(ci, "soak"), 50, rss_bound_mib=32)


@pytest.mark.slow
def test_soak_long() -> None:
    """1,000 cycles (4,000 groups made and destroyed per rank), in a world of its own."""
    results = run_world(_workers_soak.soak, WORLD, args=(1000, 5), timeout=1800, init_timeout=60)
    _check_soak(results, 1000, rss_bound_mib=64)


# ============================================ 2-4. faults, exceptions, misuse


@pytest.fixture(scope="module")
def ci(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 4-rank world runs _workers_ci.ci_world; the tests below read its reports.

    Its last section kills rank 3 inside a scope, so the launcher raises.
    """
    outdir = tmp_path_factory.mktemp("ci_world")
    started = time.monotonic()
    error: WorldError | None = None
    try:
        run_world(
            _workers_ci.ci_world,
            WORLD,
            args=(free_port(), str(outdir), 50, 25, 3),
            timeout=600,
            init_timeout=30,
            grace=30,
        )
    except WorldError as exc:
        error = exc
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in outdir.glob("rank*.json")}
    assert set(reports) == set(range(WORLD)), error
    _figure("CI world", seconds=round(time.monotonic() - started, 1))
    return {"error": error, "reports": reports}


def _section(ci: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Section ``name`` of every rank's report (with rank and baseline), checked for crashes."""
    rows = []
    for rank, report in sorted(ci["reports"].items()):
        assert name in report, f"rank {rank} never reached section {name!r}"
        section = report[name]
        assert "unexpected" not in section, f"rank {rank}, {name}:\n{section['unexpected']}"
        rows.append({"rank": rank, "baseline": report["baseline"], **section, "_report": report})
    return rows


def _formation_error(report: dict[str, Any], axis_text: str, ranks: str) -> None:
    assert report["type"] == "GroupFormationError", report
    assert axis_text in report["message"], report["message"]
    assert f"over ranks {ranks}" in report["message"], report["message"]
    assert "within 0:00:01" in report["message"]  # _workers_faults.MISSING_TIMEOUT
    assert "The members that did not arrive:" in report["message"]  # says what each does
    assert report["seconds"] < FORMATION_BOUND


def test_missing_member_gets_clear_error_not_hang(ci: dict[str, Any]) -> None:
    """A member never asks: its peers get GroupFormationError within the mesh's timeout."""
    by_rank = {r["rank"]: r for r in _section(ci, "missing")}
    # Phase one: rank 3 never asks for tp [2, 3]; phase two: rank 2 never asks.
    _formation_error(by_rank[2]["first"], "axis 'tp'", "[2, 3]")
    _formation_error(by_rank[3]["second"], "axis 'tp'", "[2, 3]")
    for rank in (0, 1):  # their tp group [0, 1] is complete
        assert by_rank[rank]["first"]["sum"] == 2
        assert by_rank[rank]["second"]["sum"] == 2
    assert "first" not in by_rank[3] and "second" not in by_rank[2]
    # Several axes: rank 0 never asks; ranks 1-3 all get the error naming both axes.
    for rank in (1, 2, 3):
        _formation_error(by_rank[rank]["multi"], "axes ('dp', 'tp')", "[0, 1, 2, 3]")


def test_every_mesh_closes_cleanly_after_missing_member(ci: dict[str, Any]) -> None:
    for r in _section(ci, "missing"):
        assert r["first_closed"] and r["second_closed"] and r["multi_closed"]
        assert r["first_live"] == r["second_live"] == r["baseline"]
        assert r["_report"]["missing_live"] == r["baseline"]


def test_group_forms_again_once_every_member_asks(ci: dict[str, Any]) -> None:
    """After a failed formation the members' generation counts agree again (bug fixed)."""
    for r in _section(ci, "missing"):
        assert r["first_retry"].get("sum") == 2, r["first_retry"]
        assert r["second_retry"].get("sum") == 2, r["second_retry"]
        assert r["multi_retry"].get("sum") == 4, r["multi_retry"]


def test_eager_constructor_that_fails_leaves_nothing(ci: dict[str, Any]) -> None:
    """eager=True without one member: the constructor raises, closes what it made, no warning."""
    rows = _section(ci, "eager_missing")
    for r in rows:
        assert r["leaked"] == 0, r
        assert r["retry"] == [2, 2]
        if r["rank"] != 3:
            assert r["resource_warnings"] == [], r
            if r["outcome"] != "made":
                assert r["outcome"]["type"] == "GroupFormationError"
                assert r["seconds"] < FORMATION_BOUND
    outcomes = {r["rank"]: r.get("outcome") for r in rows}
    # [1, 3] and [2, 3] lack rank 3; then [0, 1] lacks rank 1, whose constructor already failed.
    assert all(outcomes[rank] != "made" for rank in (0, 1, 2)), outcomes


def test_group_destroyed_by_hand_is_skipped_by_close(ci: dict[str, Any]) -> None:
    for r in _section(ci, "hand_destroyed"):
        assert r["inside"] == 1  # only tp is left
        assert r["other_group_sum"] == 2  # the mesh's other group is untouched
        assert r["closed"] and r["leaked"] == 0 and r["tp_live"] is False
        # Asking for the destroyed group again is a clear error, not a dead group.
        assert r["asked_again"] != "returned", "the mesh handed out a destroyed group"
        assert r["asked_again"]["type"] == "RuntimeError", r
        assert "destroyed outside this mesh" in r["asked_again"]["message"]
        assert "axis 'dp'" in r["asked_again"]["message"]


def test_global_destroy_inside_scope_raises_nothing(ci: dict[str, Any]) -> None:
    for r in _section(ci, "global_destroy"):
        assert r["raised"] is None, r
        assert r["closed"] == [True, True]
        assert r["initialized"] is False
        assert r["new_world_sums"] == [2, 2, 4]  # a new world works as usual
        assert r["live_after"] == 1


def test_exception_in_nested_scopes_propagates_unchanged(ci: dict[str, Any]) -> None:
    """mesh -> sub-mesh -> sub-sub-mesh: the same exception object, its traceback, no leak."""
    for r in _section(ci, "exception"):
        assert r["swallowed"] == 0
        for kind in ("Boom", "KeyboardInterrupt", "GroupFormationError"):
            e = r[kind]
            assert e["same_object"], (kind, e)
            assert e["frames"][-1] == ("_raise_boom" if kind == "Boom" else "_nested_scopes")
            assert "_nested_scopes" in e["frames"]
            assert e["context"] == "None" and e["cause"] == "None"  # nothing chained onto it
            assert e["groups"] == 3 and e["live_groups"] == [False, False, False]
            assert e["closed"] == [True, True, True]
            assert e["leaked"] == 0 and e["warnings"] == []


def test_failing_destroy_still_releases_the_rest(ci: dict[str, Any]) -> None:
    """A destroy that raises in close(): the other groups go, and no exception is lost."""
    for r in _section(ci, "close_fails"):
        plain = r["no_exception"]
        assert plain["raised"] == {"type": "RuntimeError", "message": "injected destroy failure"}
        assert plain["closed"] and plain["still_live"] == 1, plain  # only the failed one
        assert plain["warnings"] == []
        flight = r["in_flight"]
        assert flight["raised"] == {"type": "Boom", "message": "the block failed"}
        assert flight["still_live"] == 1, flight
        assert len(flight["warnings"]) == 1
        assert flight["warnings"][0].startswith("RuntimeWarning: closing")
        assert "injected destroy failure" in flight["warnings"][0]
        assert plain["leaked_after_cleanup"] == flight["leaked_after_cleanup"] == 0


def test_misuse_has_defined_behaviour(ci: dict[str, Any]) -> None:
    for r in _section(ci, "misuse"):
        sub = r["sub_after_parent"]
        assert sub["sub_closed"] and sub["group_live"] is False
        for call in ("get_group", "create_groups", "submesh", "enter", "parent_get_group"):
            assert sub[call]["type"] == "MeshClosedError", (call, sub[call])
            assert "is closed" in sub[call]["message"]
        assert sub["close_again"]["type"] == "none"  # close is idempotent
        assert len(sub["layout_queries"]) == 4  # layout queries keep working
        enter = r["enter"]
        assert enter["closed"]["type"] == "MeshClosedError"
        assert enter["nested"]["type"] == "RuntimeError"
        assert "already entered" in enter["nested"]["message"]
        assert enter["open_after_nested"] is True  # the failed re-entry closed nothing
        assert enter["after_exit"]["type"] == "MeshClosedError"
        assert enter["group_live_after_exit"] is False
        parent = r["parent_closed_first"]
        assert parent["child_closed"] and parent["parent_closed"]
        assert parent["owned_live"] is False and parent["kept_live"] is False
        assert parent["child_get"]["type"] == "MeshClosedError"
        assert r["leaked"] == 0


def test_mesh_collected_while_open_warns_and_destroys_nothing(ci: dict[str, Any]) -> None:
    for r in _section(ci, "collected"):
        assert len(r["plain"]) == 1 and r["plain"][0].startswith("unclosed <ProcessGroupMesh")
        assert r["plain_source"] == ["ProcessGroupMesh"]  # ResourceWarning(source=mesh)
        assert r["group_live"] is True  # __del__ destroys nothing
        assert len(r["cycle"]) == 1  # the root warns; its sub-mesh does not
        assert r["failed_constructor"] == []  # never opened: nothing to warn about
        assert r["leaked_before_cleanup"] == 2
        assert r["leaked_group_sum"] == 2  # the leaked group still works ...
        assert r["fresh_sums"] == [2, 2]  # ... and a new mesh over the same ranks forms its own


# ================================================================= death


def _check_death(
    error: WorldError | None, reports: dict[int, dict[str, Any]], victim: int, seconds: float
) -> None:
    assert error is not None, "the victim rank did not die"
    assert set(error.failures) == {victim}, error.failures  # the launcher names the dead rank
    assert "exited with code 17" in error.failures[victim]
    assert str(error).startswith(f"rank {victim} of a world of {WORLD} failed")
    assert error.still_running == []  # every survivor finished within the grace period
    survivors = {rank: rep["death"] for rank, rep in reports.items() if rank != victim}
    assert set(survivors) == set(range(WORLD)) - {victim}
    for rank, rep in survivors.items():
        assert "unexpected" not in rep, rep["unexpected"]
        assert rep["inside"] == 3
        assert rep["collective"] != "completed", rep  # the dead peer is noticed ...
        assert rep["collective_seconds"] < CLOSE_BOUND
        assert rep["close_seconds"] < CLOSE_BOUND  # ... and close() returns promptly
        assert rep["closed"] == [True, True]
        assert rep["leaked"] == 0, (rank, rep)
    _figure(
        f"peer death (victim rank {victim})",
        close_seconds_max=round(max(r["close_seconds"] for r in survivors.values()), 4),
        collective_error=sorted({r["collective"]["type"] for r in survivors.values()}),
        seconds=round(seconds, 1),
    )


def test_peer_death_inside_scope(ci: dict[str, Any]) -> None:
    """Rank 3 dies inside a scope: survivors' close() returns, the launcher names rank 3."""
    _check_death(ci["error"], ci["reports"], 3, 0.0)


@pytest.mark.slow
def test_store_host_death_inside_scope(tmp_path: Path) -> None:
    """Rank 0, which hosts the TCPStore, dies inside a scope."""
    started = time.monotonic()
    error: WorldError | None = None
    try:
        run_world(
            _workers_death.death_world,
            WORLD,
            args=(0, str(tmp_path)),
            timeout=300,
            init_timeout=30,
            grace=30,
        )
    except WorldError as exc:
        error = exc
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    _check_death(error, reports, 0, time.monotonic() - started)


# ========================================================== 6. independence


def test_schedules_are_identical_on_every_rank() -> None:
    """A schedule is a pure function of its seed (ranks rebuild it independently)."""
    assert _workers_independence.schedule(7, 12) == _workers_independence.schedule(7, 12)
    kinds = {op[0] for s in range(50) for op in _workers_independence.schedule(s, 12)}
    assert kinds == {"open", "request", "sub", "close"}
    for s in range(50):  # every mesh a schedule opens, it closes
        ops = _workers_independence.schedule(s, 12)
        for name in "AB":
            opens = sum(1 for k, n, _ in ops if n == name and k == "open")
            closes = sum(1 for k, n, _ in ops if n == name and k == "close")
            assert opens == closes


def _check_independence(results: list[dict[str, Any]], schedules: int, seed: int) -> None:
    for r in results:
        assert r["schedules"] == schedules
        assert r["lost"] == [], f"rank {r['rank']}: {r['lost'][:5]}"
        assert r["final_live"] == 0
    _figure(
        f"independence {schedules} schedules (seed {seed})",
        ops_per_rank=results[0]["ops"],
        groups_made=sum(r["groups_made"] for r in results),
        collective_checks=sum(r["collective_checks"] for r in results),
        lost=sum(len(r["lost"]) for r in results),
    )


def test_independence_of_overlapping_meshes(ci: dict[str, Any]) -> None:
    """25 random interleavings of two meshes over the same ranks: neither loses a group."""
    _check_independence(_section(ci, "independence"), 25, seed=0)


@pytest.mark.slow
def test_independence_of_overlapping_meshes_long() -> None:
    """100 interleavings, in a world of their own."""
    results = run_world(
        _workers_independence.independence, WORLD, args=(100, 12, 1), timeout=900, init_timeout=60
    )
    _check_independence(results, 100, seed=1)
