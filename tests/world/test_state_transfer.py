"""The state transfer of replicas that grow back: tensor by tensor, into the receiver's own
tensors (issue 37, deliver 6). Two gloo members in threads of this process, or two ranks
for the memory figure."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from scopedmesh.fault.state_transfer import (
    CollectiveFailed,
    broadcast_state,
    receive_state,
    send_state,
)
from scopedmesh.testing.launcher import run_world


class Counter:
    def __init__(self, samples: int) -> None:
        self.samples = samples

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "rng": torch.get_rng_state(), "tag": ("a", 1)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = int(state["samples"])
        assert state["tag"] == ("a", 1)


def _groups(size: int, timeout: float = 30.0) -> list[Any]:
    store = dist.HashStore()  # type: ignore[attr-defined]  # public; not in torch's stub exports
    groups: list[Any] = [None] * size

    def form(member: int) -> None:
        prefix = dist.PrefixStore("transfer", store)  # type: ignore[attr-defined]
        groups[member] = dist.ProcessGroupGloo(prefix, member, size, timedelta(seconds=timeout))

    _together([lambda m=m: form(m) for m in range(size)])  # type: ignore[misc]
    return groups


def _together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads; their results, or the exceptions they raised."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as error:
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def _trained(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(16, 4)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "counter": Counter(seed)}


def test_the_state_lands_in_the_receivers_own_tensors_and_new_ones_for_the_rest() -> None:
    source = _trained(1)
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    joiner = {
        "model": model,
        "optim": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),  # no momentum yet
        "counter": Counter(0),
    }
    own = {name: t.data_ptr() for name, t in model.state_dict().items()}
    pg0, pg1 = _groups(2)
    sent, received = _together(
        [lambda: send_state(pg0, source, [1]), lambda: receive_state(pg1, joiner, 0)]
    )
    assert sent == received and isinstance(sent, int) and sent > 0
    for name, tensor in source["model"].state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    # Into the joiner's own tensors: the same storage as before the transfer.
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == own
    momentum = [joiner["optim"].state[p]["momentum_buffer"] for p in model.parameters()]
    expected = [source["optim"].state[p]["momentum_buffer"] for p in source["model"].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, expected))
    assert joiner["counter"].samples == 1


def test_different_names_are_refused_before_any_tensor_lands() -> None:
    source = _trained(1)
    joiner = _trained(2)
    joiner["extra"] = torch.nn.Linear(1, 1)
    before = joiner["model"].state_dict()["0.weight"].clone()
    pg0, pg1 = _groups(2, timeout=3.0)

    def receive() -> Any:
        return receive_state(pg1, joiner, 0)  # the sender's sends then fail (3 s timeout)

    sent, received = _together([lambda: send_state(pg0, source, [1]), receive])
    assert isinstance(received, ValueError), received
    assert "every replica must register the same names" in str(received)
    assert isinstance(sent, CollectiveFailed), sent
    assert torch.equal(joiner["model"].state_dict()["0.weight"], before)


def test_a_broadcast_gives_every_member_the_roots_state() -> None:
    states = [_trained(seed) for seed in (5, 6, 7)]
    groups = _groups(3)
    results = _together(
        [
            lambda m=m: broadcast_state(groups[m], states[m], 1, m)  # type: ignore[misc]
            for m in range(3)
        ]
    )
    assert [r[0] for r in results] == ["received", "sent", "received"], results
    for state in states:
        for name, tensor in states[1]["model"].state_dict().items():
            assert torch.equal(state["model"].state_dict()[name], tensor), name
        assert state["counter"].samples == 6


def test_a_transfer_holds_about_its_largest_tensor_beside_the_state() -> None:
    """32 MiB of state in 4 tensors: the extra peak memory on either side is at most the
    largest tensor (8 MiB) and some slack, where one blob held the whole state."""
    from benchmarks.grow_memory import rank_main

    source, joiner = run_world(rank_main, 2, args=(32, 4, "tensor"), timeout=120)
    assert joiner["equal"]
    for side in (source, joiner):
        assert side["extra"] <= 8 * 2**20 + 8 * 2**20, side


@pytest.mark.parametrize("bad", [-1, 0])
def test_a_corrupt_length_is_a_value_error(bad: int) -> None:
    from scopedmesh.fault.state_transfer import _checked_length

    with pytest.raises(ValueError, match="header length"):
        _checked_length(torch.tensor([bad]))
