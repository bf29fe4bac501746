"""One verdict per step for replicas that grow back (issue 37, items 2, 3, 5 and 8).

Each test is named after what it printed before the fix (commit 2606dba).
"""

from __future__ import annotations

import math
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import _workers_verdict as workers
import pytest
import torch
import torch.distributed as dist

from scopedmesh.c10d.store import ReplicaKeys, read
from scopedmesh.fault.membership import Decision
from scopedmesh.testing.replicas import ReplicaJob

BOUND = 240.0  # seconds: a "never hang" bound for one job, not a performance figure
KEYS = ReplicaKeys()


def _decision(job: ReplicaJob) -> Decision | None:
    latest = read(job.store, KEYS.latest)
    text = None if latest is None else read(job.store, KEYS.decision(int(latest)))
    return None if latest is None or text is None else Decision.parse(int(latest), text)


def _until(job: ReplicaJob, what: str, condition: Callable[[], bool], deadline: float) -> None:
    while not condition():
        job.poll()
        if time.monotonic() > deadline:
            raise AssertionError(f"waited for {what}; failures: {job.failures[-2:]}")
        time.sleep(0.01)


def _whole(job: ReplicaJob, replicas: int, replica: int, token: str | None) -> bool:
    decision = _decision(job)
    return decision is not None and decision.size == replicas and decision.token(replica) != token


def _run(job: ReplicaJob, body: Callable[[float], None]) -> dict[tuple[int, int], Any]:
    deadline = time.monotonic() + BOUND
    job.start()
    try:
        body(deadline)
        _until(job, "every rank to report", lambda: job.done, deadline)
    finally:
        job.stop()
    return job.results


# ------------------------------------------------------------------ item 2, deliver 3


@pytest.mark.fault
def test_rng_counter_and_batchnorm_differ_after_a_rejoin_were_a_step_behind() -> None:
    """Before: ``registered state differs between replicas: ['model.1.num_batches_tracked',
    'model.1.running_mean', 'model.1.running_var', 'progress.rng', 'progress.samples']``
    (the weights were equal)."""
    rng = random.Random()
    job = ReplicaJob(
        workers.stateful, replicas=2, local=1, args=(2,), max_restarts=3, restart_delay=1.0
    )

    def cycles(deadline: float) -> None:
        _until(job, "the first epoch", lambda: _whole(job, 2, 1, None), deadline)
        for _ in range(3):
            time.sleep(rng.uniform(0.3, 0.8))
            decision = _decision(job)
            token = decision.token(1) if decision is not None else None
            assert job.kill(1, 0) is not None
            _until(job, "replica 1 back", lambda t=token: _whole(job, 2, 1, t), deadline)
        time.sleep(0.3)
        job.store.set(workers.STOP, str(int(read(job.store, workers.STEP) or 0) + 10))

    results = _run(job, cycles)
    assert [r for r, _ in job.restarts] == [1, 1, 1]
    # The last incarnation caught up in the background (received alone, in its first step).
    assert results[(1, 0)]["caught_up"] == 1 and len(results[(1, 0)]["received"]) == 1, results
    first, second = results[(0, 0)]["digests"], results[(1, 0)]["digests"]
    assert set(first) == set(second)
    assert {"model.1.running_mean", "progress.rng", "progress.samples"} <= set(first)
    differ = sorted(k for k in first if first[k] != second[k])
    assert differ == [], f"registered state differs between replicas: {differ}"
    assert results[(0, 0)]["step"] == results[(1, 0)]["step"]


# ------------------------------------------------------------------ item 3, deliver 5


def _faulty(case: str) -> dict[tuple[int, int], Any]:
    job = ReplicaJob(
        workers.faulty,
        replicas=2,
        local=2,
        args=(2, case, 150),
        max_restarts=1,
        restart_delay=0.5,
    )

    def kill_once(deadline: float) -> None:
        _until(job, "the first epoch", lambda: _whole(job, 2, 1, None), deadline)
        time.sleep(0.3)
        decision = _decision(job)
        token = decision.token(1) if decision is not None else None
        assert job.kill(1, 1) is not None
        _until(job, "replica 1's restart", lambda: len(job.restarts) == 1, deadline)
        del token

    return _run(job, kill_once)


def _raised(result: dict[str, Any]) -> list[str]:
    return [detail for _, what, detail in result["events"] if what not in ("redo",)]


@pytest.mark.fault
@pytest.mark.parametrize(
    ("case", "cause"),
    [("names", "ValueError"), ("datetime", "UnpicklingError")],
)
def test_a_joiner_that_cannot_load_raised_keyerror_or_unpicklingerror_past_the_verdict(
    case: str, cause: str
) -> None:
    """Before: the joiner's coordinate 0 raised ``KeyError: 'extra'`` (``names``) or
    ``UnpicklingError: Weights only load failed`` (``datetime``) out of ``all_reduce_``,
    skipping the verdict: its replica's other rank waited in the MAX."""
    results = _faulty(case)
    for coordinate in range(2):  # the joiner's two ranks: the same verdict, an error
        raised = _raised(results[(1, coordinate)])
        assert len(raised) == 1 and raised[0].startswith("StepError"), results[(1, coordinate)]
        assert "replica 1 coordinate 0" in raised[0], raised
    assert cause in _raised(results[(1, 0)])[0], results[(1, 0)]
    for coordinate in range(2):  # replica 0: that step failed (redo), then on alone
        survivor = results[(0, coordinate)]
        assert _raised(survivor) == [], survivor
        assert survivor["step"] == 150
        assert any(what == "redo" for _, what, _ in survivor["events"]), survivor


@pytest.mark.fault
def test_an_unpicklable_source_raised_typeerror_out_of_boundary() -> None:
    """Before: the source's coordinate 0 raised ``TypeError: cannot pickle '_thread.lock'
    object`` out of ``boundary()``, skipping its replica's MAX (and each later source
    would have failed in turn)."""
    results = _faulty("lock")
    for key, result in results.items():  # one verdict, everywhere: the state cannot move
        raised = _raised(result)
        assert len(raised) == 1 and raised[0].startswith("StepError"), (key, result)
        assert "replica 0 coordinate 0 (the source) could not pack" in raised[0], raised
        assert not any("Timeout" in detail for _, _, detail in result["events"]), result
    assert "TypeError: cannot pickle" in _raised(results[(0, 0)])[0]
    assert results[(0, 0)]["step"] == results[(0, 1)]["step"]


# ------------------------------------------------------------------ item 5, deliver 4


@pytest.mark.fault
@pytest.mark.parametrize("split", [0, 1])
def test_replicas_end_on_one_final_step_had_no_finish(split: int) -> None:
    """Before: ``AttributeError: '_Splitting' object has no attribute 'finish'``."""
    job = ReplicaJob(workers.finishing, replicas=2, local=1, args=(2, 12, split), max_restarts=0)
    results = _run(job, lambda deadline: None)
    first, second = results[(0, 0)], results[(1, 0)]
    assert first["step"] == second["step"] == 12
    assert first["digests"] == second["digests"]
    # The member that committed the last step alone saw finish() say "not yet" once.
    assert {first["unfinished"], second["unfinished"]} == {0, 1}, (first, second)
    for result in (first, second):  # a restart after the end: told at once, no wait
        assert result["later"].startswith("JobFinishedError: "), result["later"]
        assert "finished" in result["later"] and "exit" in result["later"], result["later"]


# ------------------------------------------------------------------ item 8


def test_bad_store_and_poll_are_refused_before_any_side_effect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: ``Replicas(store=None)`` raised ``AttributeError: 'NoneType' object has no
    attribute 'set'`` after its listener opened and WORLD's broadcast ran."""
    from scopedmesh.fault import replicas as module

    opened: list[object] = []  # side effects: a listener, a collective

    class Listener:
        def setblocking(self, flag: bool) -> None: ...

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", 1)

        def close(self) -> None: ...

    def listen(*args: object, **kwargs: object) -> Listener:
        opened.append(("listener", args))
        return Listener()

    monkeypatch.setattr(socket, "create_server", listen)
    monkeypatch.setattr(module.dist, "broadcast", lambda *a, **k: opened.append(("bcast", a)))
    monkeypatch.setattr(module.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: 1)
    model = torch.nn.Linear(1, 1)
    with pytest.raises(TypeError, match=r"store must be a torch\.distributed\.Store"):
        module.Replicas(None, replica=0, replicas=1, state={"model": model})
    store = dist.HashStore()  # type: ignore[attr-defined]
    for poll in (-1, 0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"poll must be a positive, finite number"):
            module.Replicas(store, replica=0, replicas=1, state={"model": model}, poll=poll)
    with pytest.raises(TypeError, match="poll must be a number"):
        module.Replicas(store, replica=0, replicas=1, state={"model": model}, poll="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="host must be a str"):
        module.Replicas(store, replica=0, replicas=1, state={"model": model}, host=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group must be a ProcessGroup"):
        module.Replicas(store, replica=0, replicas=1, state={"model": model}, group="w")  # type: ignore[arg-type]
    assert opened == [] and store.num_keys() == 0


def test_the_replicas_own_collectives_use_its_groups_device() -> None:
    """Before: ``ImportError: cannot import name 'group_device'`` (a CPU tensor went to
    WORLD whatever its backend: an NCCL-only WORLD failed at construction)."""
    from scopedmesh.fault.replicas import group_device

    assert group_device("gloo") == torch.device("cpu")
    assert group_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    if torch.cuda.is_available():
        assert group_device("nccl") == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(RuntimeError, match="NCCL-only group needs CUDA"):
            group_device("nccl")
