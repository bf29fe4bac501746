"""The job's step as a launcher reads it (issue 39): written by one slot, at most once a
second between epochs, exact at the end; and it travels with the registered state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from scopedmesh import JobView, job_view
from scopedmesh.c10d.store import ReplicaKeys
from scopedmesh.fault import records
from scopedmesh.fault.membership import Decision
from scopedmesh.fault.state_transfer import own_tensors, pack, unpack_header

KEYS = ReplicaKeys()


class Writes:
    """A store that counts its writes (the requests a replica would make)."""

    def __init__(self) -> None:
        self.store = dist.HashStore()  # type: ignore[attr-defined]
        self.sets: list[tuple[str, str]] = []

    def set(self, key: str, value: str) -> None:
        self.sets.append((key, value))
        self.store.set(key, value)


def test_the_step_reaches_the_store_at_most_once_a_second_and_exactly_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr(records.time, "monotonic", lambda: clock[0])
    writes = Writes()
    recs = records.Records(writes, KEYS, replicas=2, local=1, probes=None)
    count = records.StepCount()
    decision = Decision(0, ((0, "a"), (1, "b")), 0, 2)
    writes.store.set(KEYS.decision(0), decision.text())  # what Records.decide writes
    recs.entered(0, count.value)  # the source's first slot, once the epoch formed
    assert writes.sets == [(KEYS.step, "0"), (KEYS.latest, "0")]
    # 50 agreed steps within one second, then 50 by a slot that does not report: no write
    due = [recs.count(count, reports=True) for _ in range(50)]
    due += [recs.count(count, reports=False) for _ in range(50)]
    assert count.value == 100 and due == [None] * 100
    clock[0] += 1.0
    write = recs.count(count, reports=True)  # a second later: one write, made by the caller
    assert write is not None and len(writes.sets) == 2
    write()
    assert count.value == 101 and writes.sets[2:] == [(KEYS.step, "101")]
    assert recs.count(count, reports=True) is None
    assert len(writes.sets) == 3
    recs.finished(decision, count.value)
    assert writes.sets[3:] == [(KEYS.step, "102"), (KEYS.finished, decision.text())]
    view = job_view(writes.store)
    assert view == JobView(decision, finished=True, step=102)
    assert (view.epoch, view.replicas) == (0, (0, 1))


def test_a_store_without_a_step_shows_none() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    store.set(KEYS.decision(3), Decision(3, ((1, "x"),), 1, 5).text())
    store.set(KEYS.latest, "3")
    view = job_view(store)
    assert view is not None and view.step is None and not view.finished


def test_the_count_travels_with_the_state_and_its_name_is_reserved() -> None:
    model = torch.nn.Linear(2, 1)
    state, count = records.with_step({"model": model})
    count.value = 41
    header, tensors = pack(state)
    other, theirs = records.with_step({"model": torch.nn.Linear(2, 1)})
    plan = unpack_header(bytes(header.tolist()), other)
    mine: dict[Any, torch.Tensor] = own_tensors(other)
    for index, (path, _, _) in enumerate(plan.slots):
        mine[path].copy_(tensors[index])
    plan.load(other, [mine[p] for p, _, _ in plan.slots])
    assert theirs.value == 41
    with pytest.raises(ValueError, match=r"must not register the name 'scopedmesh\.step'"):
        records.with_step({"scopedmesh.step": model})
