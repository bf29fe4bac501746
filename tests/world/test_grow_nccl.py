"""Replicas on NCCL, dry-run on the CPU (issue 39): the dp groups' NCCL path, with a stand-in.

``ProcessGroupNCCL`` is replaced, in each rank process, by a working stand-in over
gloo (tests/world/_nccl_double.py: ``nccl_stand_in``) that behaves as NCCL where
the library must care: it connects only when asked, an operation a dead or
departed peer never joins never completes until the communicator is aborted (and
then looks done), and it records each init, each abort and the storage address of
every tensor it sends. What runs is the library's own NCCL branch
(``Replicas(backend="nccl")``, scopedmesh/fault/dp_groups.py) with the dp groups'
device set to the CPU. The GPU test (tests/gpu/test_nccl_replicas.py) runs the same
rank code on CUDA tensors over NCCL.
"""

from __future__ import annotations

import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import _nccl_double
import _workers_grow as workers
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scopedmesh.c10d.nccl import join_within
from scopedmesh.fault import dp_groups
from scopedmesh.fault.state_transfer import CollectiveFailed, broadcast_state
from scopedmesh.fault.verdict import max_options

REPLICAS = 2
BOUND = 120.0  # seconds: a never-hang bound for the job, not a performance figure
ENDS = ("abort", "abort_done", "destroyed")  # a communicator's last events


def _pair(
    events: list[tuple[Any, ...]], teardown: threading.Event | None = None
) -> list[dp_groups.DeviceGroup]:
    """Two members of one stand-in NCCL group, formed over a HashStore in two threads."""
    cls = _nccl_double.nccl_stand_in(events, teardown)
    store = dist.HashStore()  # type: ignore[attr-defined]
    groups: list[Any] = [None, None]

    def form(member: int) -> None:
        pg = cls(dist.PrefixStore("dp", store), member, 2, cls.Options())  # type: ignore[attr-defined]
        group = dp_groups.DeviceGroup(pg, torch.device("cpu"), lambda: None, 30.0)
        groups[member] = (
            group if dp_groups._connect(group, 30.0, [1 - member], member == 0) else None
        )

    threads = [threading.Thread(target=form, args=(m,)) for m in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(g is not None for g in groups)
    return groups


def test_a_wait_on_a_peer_that_never_comes_aborts_once_it_is_found_gone() -> None:
    """Member 1 never joins member 0's all-reduce (on NCCL the kernel would wait for
    it for ever). Member 0's wait asks who departed, and once told, aborts its
    communicator and raises CollectiveFailed naming why; nothing looks done."""
    events: list[tuple[Any, ...]] = []
    zero, _one = _pair(events)
    asked: list[int] = []

    def departed() -> str | None:
        asked.append(1)
        return None if len(asked) < 3 else "replicas [1] (coordinate 0) of epoch 4 died"

    zero.departed = departed
    flags = torch.tensor([0, 5], dtype=torch.int64)
    handle = zero.allreduce([flags], max_options())
    with pytest.raises(CollectiveFailed, match=r"an all-reduce .*replicas \[1\] .* died"):
        handle.wait()
    assert len(asked) == 3
    assert zero.aborted is True
    assert join_within(zero.aborts, 30.0) == []
    assert [e[0] for e in events].count("abort") == 1
    with pytest.raises(CollectiveFailed, match="aborted"):  # the group is done with
        zero.allreduce([flags], max_options())


def test_a_formation_whose_peer_never_comes_is_aborted_once_it_is_found_gone() -> None:
    """Member 1 never forms: member 0's connection (its init on a helper thread, which on
    NCCL nothing could interrupt) is given up once the peer is found gone, well before
    form_timeout, and its communicator aborted: the epoch heals instead of hanging."""
    events: list[tuple[Any, ...]] = []
    cls = _nccl_double.nccl_stand_in(events)
    pg = cls(dist.PrefixStore("dp", dist.HashStore()), 0, 2, cls.Options())  # type: ignore[attr-defined]
    asked: list[int] = []

    def departed() -> str | None:
        asked.append(1)
        return None if len(asked) < 2 else "replicas [1] (coordinate 0) of epoch 2 died"

    group = dp_groups.DeviceGroup(pg, torch.device("cpu"), departed, 30.0)
    assert dp_groups._connect(group, 600.0, [1], True) is False
    assert len(asked) == 2 and group.aborted
    assert join_within(group.aborts, 30.0) == []
    assert [e[0] for e in events] == ["abort"]


def test_a_failed_wait_never_waits_for_nccls_abort_and_nothing_destroys_during_it() -> None:
    """NCCL's abort took 0.5 s on an H200, though the kernels in flight exited within
    6 ms. A wait whose peer departed raises at once, while the stand-in's abort still
    tears down (held here until the raise), on a thread of its own; the group, dropped
    by the caller, is destroyed only after the abort ended."""
    events: list[tuple[Any, ...]] = []
    teardown = threading.Event()
    group, _one = _pair(events, teardown)
    gone = "replicas [1] (coordinate 0) of epoch 3 died"
    group.departed = lambda: gone
    aborts = group.aborts
    finalized = threading.Event()
    weakref.finalize(group.pg, lambda: (events.append(("destroyed",)), finalized.set()))
    handle = group.allreduce([torch.ones(2)], max_options())
    try:
        with pytest.raises(CollectiveFailed, match="died"):
            handle.wait()  # never returns before the teardown's end on the old code
        assert [e[0] for e in events if e[0] in ENDS] == ["abort"]  # still tearing down
        del group, handle
        assert not finalized.is_set()
        # The stand-in's collective runs on gloo, whose destroy would wait for it: end it.
        assert _one.allreduce([torch.ones(2)], max_options()).wait()
    finally:
        teardown.set()
    assert join_within(aborts, 30.0) == []
    assert finalized.wait(30)
    done = [e for e in events if e[0] in ENDS]
    assert [e[0] for e in done] == ["abort", "abort_done", "destroyed"], done
    assert done[1][3] == "scopedmesh-replicas-nccl-abort"


def test_a_peer_that_left_the_epoch_alive_counts_as_departed() -> None:
    """departures(): a peer whose listener still answers but that checked in to heal (it
    left the epoch after a failure of its own) is a reason to abort, as a dead one is."""
    from scopedmesh.c10d.store import ReplicaKeys
    from scopedmesh.fault.membership import Decision
    from scopedmesh.fault.probes import SlotProbes

    store, keys = dist.HashStore(), ReplicaKeys()  # type: ignore[attr-defined]
    probes = SlotProbes(store, keys, "127.0.0.1")
    try:
        decision = Decision(4, ((0, "a"), (1, "b")), 0, 2)
        store.set(keys.address(1, 0, "b"), probes.address)  # replica 1 answers: alive
        check = dp_groups.departures(probes, store, keys, decision, 0, 0)
        assert check() is None
        store.set(keys.checked_in(4, 1, 0), "1")
        assert check() == "replicas [1] (coordinate 0) left epoch 4 to heal"
    finally:
        probes.close()


def test_state_on_the_groups_device_goes_out_as_it_is() -> None:
    """broadcast_state over the NCCL path: every tensor on the group's device leaves
    from its own storage (no staging copy), the receiver's tensors land equal."""
    events: list[tuple[Any, ...]] = []
    groups = _pair(events)
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    out: list[Any] = [None, None]

    def cast(member: int) -> None:
        out[member] = broadcast_state(groups[member], {"model": models[member]}, 0, member)

    threads = [threading.Thread(target=cast, args=(m,)) for m in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [o[0] for o in out] == ["sent", "received"]
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    sent = {e[1] for e in events if e[0] == "sent"}
    assert {p.data_ptr() for p in models[0].parameters()} <= sent


def test_the_backend_is_checked_before_anything_is_written() -> None:
    from scopedmesh.fault.replicas import Replicas

    store = dist.HashStore()  # type: ignore[attr-defined]
    model = torch.nn.Linear(1, 1)
    with pytest.raises(TypeError, match="backend must be a str, 'gloo' or 'nccl', got 3"):
        Replicas(store, replica=0, replicas=1, state={"m": model}, backend=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"backend must be 'gloo' or 'nccl' .* got 'mpi'"):
        Replicas(store, replica=0, replicas=1, state={"m": model}, backend="mpi")
    if not dist.is_nccl_available():
        with pytest.raises(ValueError, match=r"backend='nccl' needs a torch built with NCCL"):
            Replicas(store, replica=0, replicas=1, state={"m": model}, backend="nccl")
    with pytest.raises(ValueError, match=r"must not register the name 'scopedmesh\.step'"):
        Replicas(store, replica=0, replicas=1, state={"scopedmesh.step": model})
    assert store.num_keys() == 0


def test_nccl_refuses_a_watchdog_that_would_end_the_survivors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stock ProcessGroupNCCL under TORCH_NCCL_ASYNC_ERROR_HANDLING 3 (torch's default)
    ends a process about 60 s after its communicator was aborted: a survivor of a
    death would not live on. check_backend says so, naming the variable."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", object, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dp_groups, "nccl_device", lambda: torch.device("cpu"))
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    with pytest.raises(RuntimeError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING=2"):
        dp_groups.check_backend("nccl")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    assert dp_groups.check_backend("NCCL") == "nccl"


# ------------------------------------------------------------------ a job, from outside


def test_a_killed_replica_rejoins_over_nccl_groups_formed_afresh_and_ends_equal() -> None:
    """2 replicas on the NCCL path (the stand-in). Replica 1 is SIGKILLed at a random
    moment once the job has trained; the survivor, blocked on a communicator whose peer
    will never come, finds it dead, aborts and heals; the restarted replica is admitted
    and catches up from the survivor's own tensors. Every group formed by its own init
    over its epoch's store; every replica ends with the same state, equal to a
    one-process replay; the job's step reaches job_view and travels with the state."""
    results, final, restarts, _ = workers.kill_and_rejoin(
        workers.train_on_nccl_stand_in, REPLICAS, BOUND
    )
    assert restarts == [1]
    survivor, joiner = results[(0, 0)], results[(1, 0)]
    history = survivor["history"]
    assert joiner["digest"] == survivor["digest"] and joiner["history"] == history
    losses, state = workers.reference(history, 0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([v for _, _, v in history]))
    for name, tensor in state.items():
        torch.testing.assert_close(survivor["state"][name], tensor)
    # The survivor aborted the communicator the dead replica held; nothing split.
    events = survivor["events"]
    assert [e[0] for e in events].count("abort") >= 1, events
    inits = [e for e in events if e[0] == "init"]
    assert len(inits) >= len(survivor["entered"]), (inits, survivor["entered"])
    assert all(n <= size for _, _, size, n in inits), inits  # each over its epoch's store
    # The catch-up left the survivor's registered tensors from their own storage.
    sent = {e[1] for e in events if e[0] == "sent"}
    assert set(survivor["pointers"]) <= sent, (survivor["pointers"], sorted(sent))
    # The job's step: the same count on both (it travelled with the state), in the view.
    assert survivor["step"] == joiner["step"] == len(history)
    assert final is not None and final.finished and final.step == len(history)
