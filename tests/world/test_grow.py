"""Grow back: a killed replica restarts, rejoins the running job and catches up (issue 34).

A :class:`~scopedmesh.testing.replicas.ReplicaJob` runs 3 replicas of 2 gloo ranks
(``_workers_grow.train``), each replica its own world, the job's store in this
process. Kills are sent from here (SIGKILL) at random moments; the job restarts
the killed replica. Afterwards every replica must hold the same weights and
optimizer state, the shape must be 3 x 2 again, and the losses must match a
one-process replay of the membership schedule the job went through.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import _workers_grow as workers
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from scopedmesh import job_view
from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.fault.membership import Decision, complete_joiners, propose
from scopedmesh.testing.replicas import ReplicaJob

REPLICAS, LOCAL = 3, 2
BOUND = 240.0  # seconds: a generous "never hang" bound for one job, not a performance figure
KEYS = ReplicaKeys()


# ------------------------------------------------------------------ pure membership

tokens = st.text(alphabet="0123456789abcdef", min_size=1, max_size=14)


@given(
    st.dictionaries(st.integers(0, 63), tokens, max_size=8),
    st.dictionaries(st.integers(0, 63), tokens, max_size=8),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.booleans(),
    st.frozensets(st.integers(0, 63), max_size=8),
)
def test_a_proposal_keeps_survivors_adds_joiners_and_round_trips(
    survivors: dict[int, str],
    joiners: dict[int, str],
    epoch: int,
    joins: int,
    catch_up: bool,
    behind: frozenset[int],
) -> None:
    if not survivors and not joiners:
        with pytest.raises(ValueError, match="at least one"):
            propose(epoch, survivors, joiners, joins, catch_up=catch_up, behind=behind)
        return
    decision = propose(epoch, survivors, joiners, joins, catch_up=catch_up, behind=behind)
    assert Decision.parse(epoch, decision.text()) == decision
    assert set(decision.replicas) == set(survivors) | set(joiners)
    assert list(decision.replicas) == sorted(decision.replicas)
    for replica, token in survivors.items():  # a live incarnation is never replaced
        assert decision.token(replica) == token
    # The source holds live state: a survivor that is not behind, where one is.
    in_step = [r for r in survivors if r not in behind]
    assert decision.source == min(in_step or survivors or joiners)
    # Fresh (caught up in the background): an admission's joiners that are not survivors.
    new = {r for r in joiners if r not in survivors}
    assert set(decision.fresh) == (new if catch_up and survivors else set())
    assert decision.source not in decision.fresh
    assert [decision.index(r) for r in decision.replicas] == list(range(decision.size))


def test_only_a_replica_whose_every_slot_announced_one_token_joins() -> None:
    announced = [(0, 0, "a"), (0, 1, "a"), (1, 0, "b"), (1, 1, "c"), (2, 0, "d"), (2, 1, None)]
    assert complete_joiners(announced, 2) == {0: "a"}
    assert complete_joiners([(3, 0, "e")], 2) == {}


def _form_in_threads(size: int) -> tuple[Any, list[Any]]:
    store = dist.HashStore()  # type: ignore[attr-defined]  # public; not in torch's stub exports
    groups: list[Any] = [None] * size

    def form(member: int) -> None:
        prefix = dist.PrefixStore(KEYS.group(7, 1), store)  # type: ignore[attr-defined]
        groups[member] = dist.ProcessGroupGloo(prefix, member, size, timedelta(seconds=30))

    threads = [threading.Thread(target=form, args=(m,)) for m in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return store, groups


def test_gloo_writes_one_address_per_member_where_replica_keys_say() -> None:
    """Pins ReplicaKeys.gloo_address on the installed torch: the clean-up deletes these."""
    store, groups = _form_in_threads(3)
    assert all(g is not None for g in groups)
    assert store.num_keys() == 3
    for member in range(3):
        assert store.check([KEYS.gloo_address(7, 1, member)]), member
        store.delete_key(KEYS.gloo_address(7, 1, member))
    assert store.num_keys() == 0


def test_bad_arguments_are_refused_before_anything_is_written() -> None:
    from scopedmesh.fault.replicas import Replicas

    store = dist.HashStore()  # type: ignore[attr-defined]
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"replica must be in 0\.\.2, got 3"):
        Replicas(store, replica=3, replicas=3, state={"model": model})
    with pytest.raises(TypeError, match="replicas must be an int"):
        Replicas(store, replica=0, replicas="3", state={"model": model})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state\['x'\] must have state_dict"):
        Replicas(store, replica=0, replicas=3, state={"x": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="timeout"):
        Replicas(store, replica=0, replicas=3, state={"model": model}, timeout=-1)
    assert store.num_keys() == 0


# ------------------------------------------------------------------ the job, from outside


def _decision(job: ReplicaJob) -> Decision | None:
    view = job_view(job.store)  # the public launcher's view
    return None if view is None else view.decision


def _full(job: ReplicaJob) -> bool:
    decision = _decision(job)
    return decision is not None and decision.size == REPLICAS


def _regrown(job: ReplicaJob, replica: int, token: str | None) -> bool:
    """Whether the job is whole again with a new incarnation of ``replica``."""
    decision = _decision(job)
    return _full(job) and decision is not None and decision.token(replica) != token


def _stop_soon(job: ReplicaJob) -> None:
    """Have a job started with ``steps=-1`` stop 10 steps on, once whole."""
    job.store.set(workers.STOP, str(int(read(job.store, workers.STEP) or 0) + 10))


def _joins(job: ReplicaJob) -> int:
    return int(read(job.store, KEYS.joins) or 0)


def _until(job: ReplicaJob, what: str, condition: Callable[[], bool], deadline: float) -> None:
    while not condition():
        job.poll()
        if time.monotonic() > deadline:
            raise AssertionError(f"waited for {what}; failures: {job.failures[-2:]}")
        time.sleep(0.01)


def _finish(job: ReplicaJob, deadline: float) -> dict[tuple[int, int], Any]:
    _until(job, "every replica to finish", lambda: job.done, deadline)
    return job.results


def _check_converged(results: dict[tuple[int, int], Any]) -> None:
    """Same state everywhere, full shape, and the losses of a one-process replay."""
    assert set(results) == {(r, c) for r in range(REPLICAS) for c in range(LOCAL)}
    for (replica, coordinate), result in results.items():
        assert result["replicas"] == tuple(range(REPLICAS)), (replica, result["replicas"])
        assert result["dp_group"], (replica, coordinate)  # Replicas.dp_group, still held
        assert result["digest"] == results[(0, coordinate)]["digest"], (replica, coordinate)
        assert result["history"] == results[(0, coordinate)]["history"]
        # The replica's own scoped mesh (over its WORLD, as tp) summed its ranks every step.
        assert result["inside"] == {"sums": [LOCAL * (LOCAL + 1) / 2], "ranks": list(range(LOCAL))}
    for coordinate in range(LOCAL):
        history = results[(0, coordinate)]["history"]
        assert [s for s, _, _ in history] == list(range(len(history)))  # no step twice, none lost
        losses, state = workers.reference(history, coordinate)
        recorded = torch.tensor([loss for _, _, loss in history])
        torch.testing.assert_close(torch.tensor(losses), recorded, rtol=1e-5, atol=1e-6)
        for name, tensor in state.items():
            torch.testing.assert_close(results[(0, coordinate)]["state"][name], tensor)


def _start(steps: int, pace: float, restart_delay: float = 0.0) -> ReplicaJob:
    job = ReplicaJob(
        workers.train,
        replicas=REPLICAS,
        local=LOCAL,
        args=(REPLICAS, steps, pace),
        max_restarts=8,
        restart_delay=restart_delay,
    )
    job.start()
    return job


def _caught_up_in_the_background(results: dict[tuple[int, int], Any], joiner: int) -> list[int]:
    """The epochs in which ``joiner`` received the state while no other member did (a
    catch-up; a broadcast gives every member but the source the state)."""
    received: dict[int, set[int]] = {}
    for (replica, _), result in results.items():
        for epoch, role, nbytes, _ in result["transfers"]:
            if role == "received":
                assert nbytes > 0
                received.setdefault(epoch, set()).add(replica)
    return sorted(epoch for epoch, replicas in received.items() if replicas == {joiner})


def _shapes(results: dict[tuple[int, int], Any]) -> list[tuple[int, ...]]:
    """The membership schedule: each run of steps with one set of replicas."""
    schedule: list[tuple[int, ...]] = []
    for _, members, _ in results[(0, 0)]["history"]:
        if not schedule or schedule[-1] != members:
            schedule.append(members)
    return schedule


@pytest.mark.fault
def test_a_killed_replica_restarts_rejoins_and_every_replica_ends_equal() -> None:
    rng = random.Random()
    job = _start(steps=40, pace=0.05, restart_delay=1.0)  # the heal is over by then
    deadline = time.monotonic() + BOUND
    try:
        _until(job, "the first epoch", lambda: _full(job), deadline)
        time.sleep(rng.uniform(0.2, 1.5))  # a random moment: in a step, a collective, a sleep
        victim = (rng.randrange(REPLICAS), rng.randrange(LOCAL))
        assert job.kill(*victim) is not None
        results = _finish(job, deadline)
    finally:
        job.stop()
    assert [r for r, _ in job.restarts] == [victim[0]]
    _check_converged(results)
    shapes = _shapes(results)
    survivors = tuple(r for r in range(REPLICAS) if r != victim[0])
    assert shapes[-1] == tuple(range(REPLICAS)), shapes
    assert survivors in shapes, shapes  # the job trained on without the dead replica
    # Before it: the full job, or nothing (a kill before the first agreed step).
    assert shapes[: shapes.index(survivors)] in ([], [tuple(range(REPLICAS))]), shapes
    # Admitted a second after the heal: it caught up while the survivors stepped on (a step
    # with the survivors alone as contributors, the last before the full ones).
    assert len(_caught_up_in_the_background(results, victim[0])) == 1, [
        r["transfers"] for r in results.values()
    ]
    # Its coordinate 0 skipped that step's compute (catching_up); the survivors never did.
    assert {k: r["skipped"] for k, r in results.items()} == {
        k: int(k == (victim[0], 0)) for k in results
    }
    print(f"\nRELIABILITY grow: killed {victim}, schedule {shapes}")


@pytest.mark.soak
def test_five_kill_rejoin_cycles_leak_no_keys_fds_or_threads() -> None:
    rng = random.Random()
    job = _start(steps=-1, pace=0.05)  # until this test says when
    deadline = time.monotonic() + 5 * BOUND
    keys: list[int] = []
    try:
        _until(job, "the full shape", lambda: _full(job), deadline)
        for _ in range(5):
            keys.append(job.store.num_keys())
            time.sleep(rng.uniform(0.2, 1.0))
            victim = (rng.choice([1, 2]), rng.randrange(LOCAL))  # replica 0 lives throughout
            decision = _decision(job)
            token = decision.token(victim[0]) if decision is not None else None
            assert job.kill(*victim) is not None
            _until(
                job, "the full shape", lambda v=victim[0], t=token: _regrown(job, v, t), deadline
            )
        keys.append(job.store.num_keys())
        _stop_soon(job)
        results = _finish(job, deadline)
    finally:
        job.stop()
    _check_converged(results)
    # At most, at full shape (before the new epoch's first step cleans up): shape, joins,
    # latest, step, cleaned, two decisions; per slot: the last epoch's check-in, the new
    # epoch's ready key and gloo address, its announcement, and two incarnations' addresses.
    # A constant, whatever the number of cycles.
    bound = 7 + 6 * REPLICAS * LOCAL
    assert max(keys) <= bound, keys
    for coordinate in range(LOCAL):
        samples = results[(0, coordinate)]["samples"]
        full = [(fds, threads) for _, size, fds, threads in samples if size == REPLICAS]
        assert len(full) >= 6, samples  # the first epoch and five regrowths
        assert {t for _, t in full} == {full[0][1]}, samples
        assert max(f for f, _ in full) <= full[0][0] + 2, samples
    print(f"\nRELIABILITY grow 5 cycles: store keys at full shape {keys}")


@pytest.mark.fault
def test_a_kill_during_admission_ends_in_one_consistent_epoch() -> None:
    """The joiner or a survivor dies while the joiner is being admitted."""
    rng = random.Random()
    job = _start(steps=-1, pace=0.05)  # until told: the job must not end between the kills
    deadline = time.monotonic() + 2 * BOUND
    try:
        _until(job, "the first epoch", lambda: _full(job), deadline)
        assert job.kill(1, rng.randrange(LOCAL)) is not None
        joins = _joins(job)
        _until(job, "the restarted replica to announce", lambda: _joins(job) > joins, deadline)
        time.sleep(rng.uniform(0.0, 0.3))  # inside the admission: decision, formation, transfer
        second = (rng.choice([1, 2]), rng.randrange(LOCAL))
        decision = _decision(job)
        token = decision.token(second[0]) if decision is not None else None
        assert job.kill(*second) is not None
        _until(job, "the full shape", lambda: _regrown(job, second[0], token), deadline)
        _stop_soon(job)
        results = _finish(job, deadline)
    finally:
        job.stop()
    _check_converged(results)
    print(f"\nRELIABILITY grow, kill during admission: {second}, schedule {_shapes(results)}")


@pytest.mark.fault
def test_a_joiner_arriving_while_a_second_replica_dies_is_admitted() -> None:
    rng = random.Random()
    job = _start(steps=-1, pace=0.05)  # until told: the job must not end between the kills
    deadline = time.monotonic() + 2 * BOUND
    try:
        _until(job, "the first epoch", lambda: _full(job), deadline)
        assert job.kill(1, rng.randrange(LOCAL)) is not None
        joins = _joins(job)
        _until(job, "replica 1 to announce itself", lambda: _joins(job) > joins, deadline)
        decision = _decision(job)
        token = decision.token(2) if decision is not None else None
        assert job.kill(2, rng.randrange(LOCAL)) is not None
        _until(job, "the full shape", lambda: _regrown(job, 2, token), deadline)
        _stop_soon(job)
        results = _finish(job, deadline)
    finally:
        job.stop()
    assert sorted(r for r, _ in job.restarts) == [1, 2]
    _check_converged(results)
    print(f"\nRELIABILITY grow, joiner while a second dies: schedule {_shapes(results)}")


@pytest.mark.fault
def test_replicas_sharded_with_fsdp2_grow_back_equal_to_an_unsharded_replay() -> None:
    """Inside each replica, FSDP2 over a scoped DeviceMesh of its WORLD; a rank killed
    from outside: its replica restarts, catches up on FSDP2's DTensor state, and every
    replica ends with the weights of a one-process, unsharded replay."""
    import _workers_grow_fsdp as fsdp

    rng = random.Random()
    job = ReplicaJob(
        fsdp.train_fsdp,
        replicas=REPLICAS,
        local=LOCAL,
        args=(REPLICAS, 0.05),
        max_restarts=4,
        restart_delay=1.0,
    )
    job.start()
    deadline = time.monotonic() + BOUND
    try:
        _until(job, "the first epoch", lambda: _full(job), deadline)
        time.sleep(rng.uniform(0.3, 1.0))
        victim = (rng.randrange(1, REPLICAS), rng.randrange(LOCAL))
        decision = _decision(job)
        token = decision.token(victim[0]) if decision is not None else None
        assert job.kill(*victim) is not None
        _until(job, "the full shape", lambda: _regrown(job, victim[0], token), deadline)
        job.store.set(fsdp.STOP, str(int(read(job.store, fsdp.STEP) or 0) + 5))
        results = _finish(job, deadline)
    finally:
        job.stop()
    assert set(results) == {(r, c) for r in range(REPLICAS) for c in range(LOCAL)}
    history = results[(0, 0)]["history"]
    assert [s for s, _, _ in history] == list(range(len(history)))
    losses, weights = fsdp.reference(history, LOCAL)
    for (replica, coordinate), result in results.items():
        assert result["replicas"] == tuple(range(REPLICAS)), (replica, result["replicas"])
        # Registered state: one trajectory per coordinate (its own losses), the same steps.
        assert result["history"] == results[(0, coordinate)]["history"], (replica, coordinate)
        assert [h[:2] for h in result["history"]] == [h[:2] for h in history]
        assert result["digest"] == results[(0, coordinate)]["digest"], (replica, coordinate)
        recorded = torch.tensor([loss for _, _, loss in result["history"]])
        expected = torch.tensor([step[coordinate] for step in losses])
        torch.testing.assert_close(recorded, expected, rtol=1e-5, atol=1e-6)
        for name, tensor in weights.items():
            torch.testing.assert_close(result["full"][name], tensor)
    assert len(_caught_up_in_the_background(results, victim[0])) == 1
    print(f"\nRELIABILITY grow fsdp2: killed {victim}, schedule {_shapes(results)}")


def _example() -> Any:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "grow_replicas.py"
    spec = importlib.util.spec_from_file_location("grow_replicas", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


EXAMPLE_STEPS = 60  # the kill lands 0.2 to 1.5 s after the job formed


@pytest.mark.launch
def test_the_example_under_the_launcher_grows_back_with_equal_state() -> None:
    """``scopedmesh replicas`` (3 torchrun agents, --max-restarts 3); a worker of a random
    replica SIGKILLed from outside at a random moment; the launcher exits 0.

    The victim's agent restarts it once (TORCHELASTIC_RESTART_COUNT 1): its workers' first
    try joins (no start lost to the previous try's gloo addresses, pytorch#135712)."""
    result = _example().launch(
        replicas=REPLICAS, nproc=LOCAL, steps=EXAMPLE_STEPS, timeout=240, pace=0.02
    )
    text = result.text()
    assert not result.timed_out, text[-6000:]
    assert result.killed is not None, text[-6000:]
    victim = result.killed[0]
    assert result.returncode == 0, (result.returncode, text[-6000:])
    assert "every replica's workers exited 0" in text, text[-6000:]
    done = result.done()
    assert set(done) == {(r, c) for r in range(REPLICAS) for c in range(LOCAL)}, text[-6000:]
    for (replica, coordinate), (steps, digest) in done.items():
        assert steps >= EXAMPLE_STEPS and steps == done[(0, 0)][0], (replica, coordinate, steps)
        assert digest == done[(0, coordinate)][1], (replica, coordinate, text[-6000:])
    sizes = {line.rsplit("sizes ", 1)[1].split()[0] for _, line in result.lines if "done:" in line}
    assert len(sizes) == 1, sizes  # the membership history is registered state: one for all
    (history,) = sizes
    assert "2" in history and history.endswith("3"), history  # shrank, then grew back
    starts = {
        replica: sorted(
            int(line.rsplit("(restart ", 1)[1].rstrip(")"))
            for r, line in result.lines
            if r == replica and "started (restart" in line
        )
        for replica in range(REPLICAS)
    }
    # The victim started twice, through torchrun's restart; the others once.
    expected = {r: [0] * LOCAL + ([1] * LOCAL if r == victim else []) for r in range(REPLICAS)}
    assert starts == expected, (starts, text[-6000:])
    assert result.killed_at is not None
    restarted = [
        seen
        for (r, line), seen in zip(result.lines, result.seen)
        if r == victim and "started (restart 1)" in line
    ]
    finished = max(s for (_, line), s in zip(result.lines, result.seen) if "done:" in line)
    print(
        f"\nRELIABILITY grow torchrun: history {history[:3]}..{history[-3:]} "
        f"({len(history)} steps); kill to restarted worker {min(restarted) - result.killed_at:.1f} s, "
        f"to the end {finished - result.killed_at:.1f} s"
    )
