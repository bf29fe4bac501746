"""The liveness watch in 8-rank gloo worlds (2 x 2 x 2: dp, pp, tp) whose store lives here.

Each world runs ``benchmarks.heal.rank_main`` (the benchmark's training loop)
with a plan: a rank SIGKILLs itself, a rank is stopped or busy, a second rank
dies in the middle of the agreement. Every group's timeout is 60 s, so a
collective that raised rather than timed out proves the abort; the messages say
which it was. Counts and sets are asserted, never a time.
"""

from __future__ import annotations

import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import heal  # noqa: E402
from scopedmesh.c10d import closable  # noqa: E402
from scopedmesh.layout import MeshLayout  # noqa: E402

# Aborting a collective in flight needs closable gloo groups, which torch 2.9 cannot
# make (docs/limits.md, "Releases"): there a blocked collective ends at its timeout.
needs_interrupt = pytest.mark.skipif(
    not closable.supported(),
    reason="this torch cannot make closable gloo groups: a collective in flight is not aborted",
)

LAYOUT = MeshLayout(heal.SHAPE, names=heal.NAMES)
VICTIM, KILL_STEP, STEPS = 5, 3, 7
TIMEOUT_WORDS = ("timed out", "timeout")


def _figure(name: str, **values: object) -> None:
    print(f"\nRELIABILITY {name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


def _reports(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    reports: dict[int, dict[str, Any]] = result["reports"]
    assert set(reports) == set(range(8)), result["exitcodes"]
    for rank, report in reports.items():
        assert "unexpected" not in report, f"rank {rank}:\n{report['unexpected']}"
    return reports


def _shares_a_group(a: int, b: int) -> bool:
    return any(b in LAYOUT.group(LAYOUT.unravel(a), axis) for axis in heal.NAMES)


def _check_healed(reports: dict[int, dict[str, Any]], dead: list[int]) -> None:
    """The other dp slice re-forms 1 x 2 x 2 and matches the reference; the dead slice sits out."""
    resume = heal.resume_step({"reports": reports})
    assert resume in (KILL_STEP - 1, KILL_STEP)  # a step's last messages may not arrive
    expected = heal.reference(STEPS, lambda s: 2 if s < resume else 1)
    dead_slice = {r for r in range(8) if LAYOUT.unravel(r)[0] == LAYOUT.unravel(dead[0])[0]}
    for rank, report in reports.items():
        if rank in dead:
            continue
        event = report["events"][0]
        assert event["lost"] == dead, (rank, event)  # the same lost set on every survivor
        said = event.get("message", "")  # none where the step's body ended and the vote failed
        assert not any(word in said.lower() for word in TIMEOUT_WORDS), event
        if rank in dead_slice:
            assert "shares a dropped slice" in event["sat_out"], event
            continue
        assert event["shape"] == [1, 2, 2]
        assert [s for s, _ in report["losses"]] == list(range(STEPS))
        for step, loss in report["losses"]:
            assert math.isclose(loss, expected[step], rel_tol=1e-9), (rank, step, loss)


def _check_nothing_left(result: dict[str, Any], reports: dict[int, dict[str, Any]]) -> None:
    for report in reports.values():
        if "died_at" in report:
            continue
        assert report["threads_running"] == 2, report  # two threads while the watch runs
        assert report["threads_left"] == 0, report
        assert report["fds_left"] == 0, report  # descriptors opened since and still open
    assert result["watch_keys"] == []


@pytest.fixture(scope="module")
def killed() -> dict[str, Any]:
    # Rank 3 sleeps at the kill step, so rank 2 (which shares no group with rank 5)
    # is blocked in a tp all_reduce with a healthy peer when rank 5 dies.
    plan = {"steps": STEPS, "kill": {str(VICTIM): KILL_STEP}, "sleep": {"3": [KILL_STEP, 1.5]}}
    return heal.launch(plan, timeout=300)


@needs_interrupt
def test_every_survivor_learns_of_a_sigkill_and_agrees(killed: dict[str, Any]) -> None:
    reports = _reports(killed)
    assert killed["exitcodes"][VICTIM] == -9  # SIGKILL
    died = reports[VICTIM]["died_at"]
    for rank, report in reports.items():
        if rank != VICTIM:
            assert report["lost"] == [VICTIM], (rank, report["lost"])
            assert report["events"][0]["step"] in (KILL_STEP - 1, KILL_STEP)
    _check_healed(reports, [VICTIM])
    learned = [reports[r]["learned"][str(VICTIM)] - died for r in reports if r != VICTIM]
    first = [
        reports[r]["events"][0]["first_step_at"] - died
        for r in reports
        if r != VICTIM and "first_step_at" in reports[r]["events"][0]
    ]
    _figure(
        "SIGKILL of rank 5 (8 ranks, 2x2x2 dp,pp,tp, watch 20 ms)",
        learned_by_all_s=round(max(learned), 3),
        first_healed_step_s=round(max(first), 3),
    )


@needs_interrupt
def test_a_rank_blocked_with_healthy_peers_is_aborted_not_timed_out(
    killed: dict[str, Any],
) -> None:
    reports = _reports(killed)
    assert not _shares_a_group(2, VICTIM) and not _shares_a_group(3, VICTIM)
    blocked = reports[2]["events"][0]  # in a tp all_reduce with rank 3, which slept
    assert "closed by peer" in blocked["message"] or "reset by peer" in blocked["message"]
    sleeper = reports[3]["events"][0]  # its groups were shut down while it slept
    assert sleeper["type"] == "MeshClosedError", sleeper
    assert "liveness watch learned that rank(s) [5] died" in sleeper["message"]


@needs_interrupt
def test_nothing_left_after_the_watch_stops(killed: dict[str, Any]) -> None:
    _check_nothing_left(killed, _reports(killed))


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_a_stopped_or_busy_rank_is_not_declared_lost(tmp_path: Path) -> None:
    """SIGSTOP rank 6 for 2 s, then a 2 s busy loop on rank 1: alive both times (open sockets)."""
    plan = {"steps": STEPS, "stop": [6, 2, 2.0], "busy": {"1": [4, 2.0]}}
    result = heal.launch(plan, timeout=300)
    reports = _reports(result)
    expected = heal.reference(STEPS, lambda s: 2)
    for rank, report in reports.items():
        assert report["lost"] == [] and report["events"] == [], (rank, report)
        for step, loss in report["losses"]:
            assert math.isclose(loss, expected[step], rel_tol=1e-9), (rank, step, loss)
    _check_nothing_left(result, reports)


@needs_interrupt
def test_a_second_death_during_the_agreement_is_agreed_on_too() -> None:
    """Rank 6 checks in to the agreement, then dies; rank 7 agrees late: all decide {5, 6}.

    Rank 7 is stopped whole (SIGSTOP from rank 0, for 2 s) as the step begins in which
    rank 5 dies, so neither it nor its watch can check in until after rank 6's death
    is known: a rank's watch answers a member in doubt at once, so a rank merely slow in
    its own code would not hold the agreement open (the heal decided before rank 6's
    death was learned, once the abort stopped taking 40 ms)."""
    plan = {
        "steps": STEPS,
        "kill": {str(VICTIM): KILL_STEP},
        "die_checked_in": 6,
        "stop": [7, KILL_STEP, 2.0],
    }
    result = heal.launch(plan, timeout=300)
    reports = _reports(result)
    assert result["exitcodes"][6] == -9
    _check_healed(reports, [5, 6])
    _check_nothing_left(result, reports)


# ------------------------------------------------------------------ bad arguments


@pytest.fixture
def one_rank() -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"interval": 0}, ValueError, "interval must be a positive number of seconds"),
        ({"interval": -1}, ValueError, "interval must be a positive number"),
        ({"interval": float("nan")}, ValueError, "interval must be a positive number"),
        ({"interval": 10**30}, ValueError, r"interval .* \(at most 60\), got 10000"),
        ({"interval": "0.1"}, TypeError, "interval must be a number of seconds, got '0.1'"),
        ({"interval": True}, TypeError, "interval must be a number of seconds, got True"),
        ({"timeout": 0}, ValueError, "timeout must be positive"),
        ({"timeout": -5}, ValueError, "timeout must be positive"),
        ({"timeout": float("nan")}, ValueError, "timeout"),
        ({"timeout": 10**30}, ValueError, "timeout"),
        ({"timeout": "1"}, TypeError, "timeout"),
        ({"ranks": [0, 7]}, ValueError, r"ranks must be ranks of WORLD \(0..0\), got 7"),
        ({"ranks": [True]}, TypeError, "ranks must hold int ranks, got True"),
        ({"ranks": "01"}, TypeError, "ranks must be an iterable of int ranks"),
        ({"ranks": []}, ValueError, "ranks must hold at least one rank"),
        ({"host": 5}, TypeError, "host must be a non-empty str or None, got 5"),
        ({"store": "store"}, TypeError, "store must be a torch.distributed Store"),
    ],
)
def test_bad_arguments_name_the_argument_and_leave_the_store_usable(
    one_rank: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    from scopedmesh import LivenessWatch
    from scopedmesh.c10d import groups as _c10d

    store = _c10d.default_store()
    keys = store.num_keys()
    with pytest.raises(error, match=match):
        LivenessWatch(**kwargs)
    assert store.num_keys() == keys  # nothing was written
    store.set("after-bad-input", "ok")
    assert store.get("after-bad-input") == b"ok"
    store.delete_key("after-bad-input")
    with LivenessWatch(interval=0.01, timeout=timedelta(seconds=5)) as watch:
        assert watch.lost() == frozenset() and watch.is_alive(0)
        with pytest.raises(
            ValueError, match=r"rank must be one of this watch's ranks \[0\], got 3"
        ):
            watch.is_alive(3)
        with pytest.raises(TypeError, match="rank must be an int rank, got '0'"):
            watch.is_alive("0")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="tag must be 1 to 200 printable characters"):
            watch.agree(tag="a/b")
        with pytest.raises(ValueError, match="timeout must be positive"):
            watch.agree(tag="t", timeout=0)
        with pytest.raises(TypeError, match="mesh must be a ProcessGroupMesh, got 3"):
            watch.guard(3)  # type: ignore[arg-type]
        assert watch.agree(tag="alone") == frozenset()  # one member: decided at once
    assert watch.closed
    with pytest.raises(RuntimeError, match="is closed; make a new LivenessWatch"):
        watch.agree(tag="late")
    assert heal.watch_keys(store, [0]) == []


@pytest.mark.fault  # a slow lane: .ci/run runs it
@needs_interrupt
@pytest.mark.parametrize("settle", [True, False])
def test_a_held_group_closes_once_its_collective_has_ended(settle: bool) -> None:
    """A group aborted mid-collective is held; once that collective completes, settle()
    closes it, so a peer's next collective on it fails at once instead of at the
    group's timeout (unsettled, it would wait: the case the soak hit, where that
    peer's survivors waited 60 s for it in their agreement). The unsettled run
    shows the hazard: a held group left open makes its peer time out."""
    import _workers_watch

    from scopedmesh.testing import run_world

    peer, held = run_world(_workers_watch.held_then_settled, 2, args=(settle,), timeout=240)
    assert held["interrupt_closed"] is False  # in flight: held, not closed
    if settle:
        assert held["settled"] is True
        assert any(w in peer["second"] for w in ("closed by peer", "reset by peer")), peer
    else:
        assert any(w in peer["second"].lower() for w in TIMEOUT_WORDS), peer


@pytest.mark.slow
@needs_interrupt
def test_watches_that_close_together_are_left_never_lost() -> None:
    """Rounds of watches in one 6-rank world: each round a block of ring neighbours
    (1 to 5 of them, as the ranks of a dropped slice after a heal) closes at once
    while the others relink around them. Every observer sees each of them leave and
    counts none as lost (a closing watch deletes its address before any socket ends)."""
    import _workers_watch

    from scopedmesh.testing import run_world

    rounds = 12
    results = run_world(_workers_watch.close_and_observe, 6, args=(rounds,), timeout=600)
    assert [r["wrong"] for r in results] == [[] for _ in results]
    leavers = sum(r % 5 + 1 for r in range(rounds))
    # The observer before each closing block relinked past all of it: every leaver was
    # seen to leave (left, never lost) at least once.
    assert sum(r["relinks"] for r in results) >= leavers
    _figure("closing watches (6 ranks)", rounds=rounds, leavers=leavers, false_lost=0)


# ------------------------------------------------------------------ the soak


@pytest.mark.slow
@needs_interrupt
def test_soak_200_heals_leave_nothing_behind() -> None:
    """200 worlds, each losing a random rank at a random step: every heal checked like the
    benchmark's (the reference losses, the lost set, fds, threads, store keys); figures printed.

    Counts, never times: per heal, every rank that lived had one watch thread while
    the watch ran, and none, no descriptor and no watch key once it stopped.
    """
    import random
    import statistics
    import time

    rng = random.Random(50)
    heals = 200
    totals: list[float] = []
    running = threads_left = fds_left = keys_left = 0
    started = time.monotonic()
    for _ in range(heals):
        victim, step = rng.randrange(8), rng.randrange(1, 8)
        result = heal.launch({"steps": 9, "kill": {str(victim): step}}, timeout=300)
        heal.check(result, victim, step, 9)  # raises on a wrong loss, lost set or leftover
        totals.append(heal.phases(result, victim)[-1])
        lived = [rep for r, rep in result["reports"].items() if r != victim]
        running += sum(rep["threads_running"] for rep in lived)
        threads_left += sum(rep["threads_left"] for rep in lived)
        fds_left += sum(rep["fds_left"] for rep in lived)
        keys_left += len(result["watch_keys"])
    assert (running, threads_left, fds_left, keys_left) == (2 * 7 * heals, 0, 0, 0)
    _figure(
        f"soak: {heals} SIGKILLs healed (8 ranks, 2x2x2)",
        heals=len(totals),
        wall_s=round(time.monotonic() - started),
        median_s=round(statistics.median(totals), 3),
        max_s=round(max(totals), 3),
        threads_left=threads_left,
        fds_left=fds_left,
        store_keys_left=keys_left,
    )


# ------------------------------------------------------------------ a kill from outside


@needs_interrupt
@pytest.mark.parametrize("delay", [0.0, 0.013])
def test_a_kill_inside_a_collective_of_4_releases_every_survivor(delay: float) -> None:
    """Rank 3 of a 4-member dp group is SIGKILLed by another process (rank 0's thread)
    while every rank runs all_reduces back to back. Its ring neighbours fail at once;
    a rank waiting on a neighbour that failed out of the collective is released too
    (a failed collective's work, kept alive by the traceback of the error being
    handled, used to keep the neighbour's connections open: 60 s, issue 29). Each
    survivor heals inside its ``except`` block; the group timeout is 60 s, so no
    error may speak of a timeout."""
    import _workers_watch

    from scopedmesh.testing import run_world

    results = run_world(
        _workers_watch.killed_inside_a_collective,
        4,
        args=(3, delay, 4),
        allow_exit=[3],
        timeout=240,
    )
    assert results[3] is None  # the victim reported nothing: it was killed
    for rank in (0, 1, 2):
        out = results[rank]
        assert not any(word in out["error"].lower() for word in TIMEOUT_WORDS), out
        assert out["lost"] == [3] and "sat_out" not in out, out
        assert out["shape"] == [3, 1] and out["sums"] == [3.0, 3.0, 3.0], out


# ------------------------------------------------------------------ the abort is a state


@needs_interrupt
def test_an_aborted_mesh_refuses_every_group_formed_before_or_first_requested_after() -> None:
    """Rank 3 of a guarded 2 x 2 mesh dies. On ranks 0 and 1 the tp group, first
    requested after the watch learned of the death, is refused (it used to form and
    work); so are the dp group formed before, multi-axis groups, a sub-mesh's and a
    DeviceMesh's: each with MeshClosedError. The survivors then heal as usual."""
    import _workers_watch

    from scopedmesh.testing import run_world

    results = run_world(_workers_watch.refused_after_the_abort, 4, allow_exit=[3], timeout=240)
    assert results[3] is None
    for rank in (0, 1, 2):
        out = results[rank]
        assert out["lost"] == [3], out
        for what, answer in out["answers"].items():
            assert answer.startswith("MeshClosedError"), (rank, what, answer)
            assert "rank(s) [3] died" in answer, (rank, what, answer)
    assert results[0]["healed"] == results[1]["healed"] == ([1, 2], 2.0)
    assert results[2]["healed"] == "sat out"


# ------------------------------------------------------------------ never silent


def test_a_watch_with_1100_open_fds_learns_of_a_death() -> None:
    """select() refused descriptors above 1023 on the watch thread, silently: a death
    went unseen for good. Every rank here holds 1,100 more open descriptors."""
    import _workers_watch

    from scopedmesh.testing import run_world

    results = run_world(_workers_watch.many_fds_then_a_death, 3, args=(1100,), allow_exit=[2])
    for out in results[:2]:
        assert out["highest_fd"] > 1100, out
        assert out["lost"] == out["lost_call"] == [2], out


@pytest.mark.fault  # a slow lane: .ci/run runs it
def test_a_store_error_while_relinking_is_survived_and_reported_once() -> None:
    import _workers_watch

    from scopedmesh.testing import run_world

    results = run_world(_workers_watch.store_fails_while_relinking, 3, allow_exit=[1])
    first, other = results[0], results[2]
    assert first["failures_left"] == 0, first  # the injected errors were all hit
    assert first["successor"] == 2 and first["lost"] == [1], first
    assert "injected store failure in compare_set" in first["first_lost"], first
    assert first["second_lost"] == [1], first  # reported once, and the watch goes on
    assert other["lost"] == other["second_lost"] == [1], other


def test_a_failure_of_the_watch_thread_surfaces_in_the_next_query(one_rank: Any) -> None:
    import time

    import _workers_watch

    from scopedmesh import LivenessWatch

    with LivenessWatch(interval=0.01, timeout=timedelta(seconds=5)) as watch:
        faulty = _workers_watch.FailingStore(watch._waiting_store, "delete_key", 1)
        faulty.armed = True
        watch._waiting_store = faulty
        watch._store.set(watch.keys.wake(watch.rank), "1")  # news: the store thread wakes
        deadline = time.monotonic() + 10
        while watch._failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        match = r"its thread failed while waiting for news \(it goes on\): .* injected"
        with pytest.raises(RuntimeError, match=match):
            watch.lost()
        watch._store.set(watch.keys.wake(watch.rank), "1")  # it goes on: it wakes again
        deadline = time.monotonic() + 10
        while watch._store.check([watch.keys.wake(watch.rank)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not watch._store.check([watch.keys.wake(watch.rank)])
        assert watch.lost() == frozenset()  # reported once
        watch._waiting_store = faulty.store


def test_guard_warns_once_where_groups_cannot_be_closed(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    from scopedmesh import LivenessWatch, ProcessGroupMesh

    monkeypatch.setattr(closable, "supported", lambda: False)
    with LivenessWatch(interval=0.01, timeout=timedelta(seconds=5)) as watch:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                watch.guard(ProcessGroupMesh(1, names=("dp",))).close()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1, said
    assert "cannot abort a collective in flight" in said[0]


def test_close_after_an_error_never_hides_it(one_rank: Any) -> None:
    """The store failing in close() (its host gone, say) is a warning after the error
    that ended the block, never a replacement for it."""
    import _workers_watch

    from scopedmesh import LivenessWatch

    store = None
    with pytest.warns(RuntimeWarning, match="closing .* after ValueError also failed"):
        with pytest.raises(ValueError, match="the original error"):
            with LivenessWatch(interval=0.01, timeout=timedelta(seconds=5)) as watch:
                store = watch._store
                failing = _workers_watch.FailingStore(store, "compare_set", 10**9)
                failing.armed = True
                watch._store = failing
                raise ValueError("the original error")
    assert watch.closed and store is not None


@pytest.mark.soak  # a lane .ci/run runs (and slow: not in the README's command)
@needs_interrupt
def test_soak_kills_from_outside_at_random_moments() -> None:
    """Worlds of 8 ranks (4 x 2, 2 x 4 and 8 x 1 dp x tp), each losing a random rank,
    SIGKILLed by another rank's thread at a random moment while every rank runs dp
    all_reduces: no survivor waits for a timeout, every one agrees on the dead rank,
    and those that go on sum over the re-formed dp groups. 12 worlds (4 a shape) in CI;
    ``SCOPEDMESH_SOAK_KILLS=30`` (or more) for a longer soak."""
    import random

    import _workers_watch

    from scopedmesh.testing import run_world

    kills = int(os.environ.get("SCOPEDMESH_SOAK_KILLS", "12"))
    rng = random.Random(29)
    for kill in range(kills):
        dp = (4, 2, 8)[kill % 3]
        victim, delay = rng.randrange(8), rng.uniform(0.0, 0.05)
        results = run_world(
            _workers_watch.killed_inside_a_collective,
            8,
            args=(victim, delay, dp),
            allow_exit=[victim],
            timeout=240,
        )
        tp = 8 // dp
        for rank, out in enumerate(results):
            if rank == victim:
                assert out is None
                continue
            assert not any(word in out["error"].lower() for word in TIMEOUT_WORDS), out
            assert out["lost"] == [victim], (kill, out)
            if rank // tp == victim // tp:  # the victim's dp slice sits out
                assert "sat_out" in out, (kill, out)
            else:
                assert out["shape"] == [dp - 1, tp], (kill, out)
                assert out["sums"] == [float(dp - 1)] * 3, (kill, out)
    _figure(f"soak: {kills} SIGKILLs from outside, inside collectives (8 ranks)", kills=kills)


def test_guard_refuses_a_mesh_on_worlds_stock_nccl_that_torchs_watchdog_would_end(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mesh with no backend of its own runs on WORLD's: on stock NCCL (played here on the
    CPU: WORLD's backend reads as ``nccl``), guard() refuses until the launcher sets
    TORCH_NCCL_ASYNC_ERROR_HANDLING to 2 or 0, and never sets it itself."""
    from scopedmesh import LivenessWatch, ProcessGroupMesh
    from scopedmesh.fault.liveness import watch as watch_module

    monkeypatch.setattr(watch_module.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setenv("TORCH_DIST_USE_NCCL2", "0")  # the stock backend on every release
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    with LivenessWatch(interval=0.05) as watch, ProcessGroupMesh(1) as mesh:
        with pytest.raises(RuntimeError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING is unset"):
            watch.guard(mesh)
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # never set silently
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        assert watch.guard(mesh) is mesh
