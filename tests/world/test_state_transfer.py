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
from hypothesis import given
from hypothesis import strategies as st

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


def test_an_unpicklable_source_tells_its_receivers_and_the_group_stays_usable() -> None:
    from scopedmesh.fault.state_transfer import UnmovableState

    source, joiner = _trained(1), _trained(2)
    source["counter"].samples = threading.Lock()  # type: ignore[assignment]  # pickle refuses
    pg0, pg1 = _groups(2)
    sent, received = _together(
        [lambda: send_state(pg0, source, [1]), lambda: receive_state(pg1, joiner, 0)]
    )
    assert isinstance(sent, UnmovableState) and "cannot pickle" in str(sent), sent
    assert isinstance(sent.__cause__, TypeError)
    assert isinstance(received, UnmovableState), received
    ones = [torch.ones(2), torch.ones(2)]  # nothing else was sent: the group still works
    done = _together(
        [lambda: pg0.allreduce([ones[0]]).wait(), lambda: pg1.allreduce([ones[1]]).wait()]
    )
    assert done == [True, True], done
    assert [t.tolist() for t in ones] == [[2.0, 2.0], [2.0, 2.0]]


@pytest.mark.parametrize("bad", [-2, 0])
def test_a_corrupt_length_is_a_value_error(bad: int) -> None:
    from scopedmesh.fault.state_transfer import _checked_length

    with pytest.raises(ValueError, match="header length"):
        _checked_length(torch.tensor([bad]))


# ------------------------------------------------------------------ the law, without a group

_DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.uint8]
_shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


@st.composite
def _tensor(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(_shapes)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    value = (torch.rand(shape, generator=g) * 10).to(dtype)
    if draw(st.booleans()) and value.dim() == 2 and value.shape[0] > 1 < value.shape[1]:
        value = value.t()  # not contiguous: staged through a CPU copy
    return value


_plain = st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none(), st.booleans())
_trees = st.recursive(
    st.one_of(_tensor(), _plain),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", min_size=1, max_size=2), inner, max_size=3),
    ),
    max_leaves=8,
)


class Holder:
    """Registered state that is any tree of tensors and plain data."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree

    def state_dict(self) -> Any:
        return self.tree

    def load_state_dict(self, state: Any) -> None:
        self.tree = state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is type(a) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(b) is type(a) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


class _Done:
    def wait(self) -> None: ...


@given(_trees, _trees)
def test_any_tree_arrives_equal_and_lands_in_the_receivers_matching_tensors(
    sent: Any, own: Any
) -> None:
    """pack, then the receiver's side of the wire (each tensor copied byte for byte as gloo
    would), then load: the receiver holds the source's tree; where its own tree had a
    tensor of the same dtype and shape at the same place, that very tensor holds it."""
    from scopedmesh.fault.state_transfer import _take, own_tensors, pack, unpack_header

    source, receiver = {"s": Holder(sent)}, {"s": Holder(own)}
    header, tensors = pack(source)
    mine = own_tensors(receiver)
    plan = unpack_header(bytes(header.tolist()), receiver)

    def transport(view: torch.Tensor, index: int) -> _Done:
        wire = tensors[index].contiguous().reshape(-1).view(torch.uint8)
        view.copy_(wire)
        return _Done()

    nbytes = _take(plan, receiver, transport)
    assert nbytes == sum(t.numel() * t.element_size() for t in tensors)
    assert _same(sent, receiver["s"].tree)
    for path, dtype, shape in plan.slots:
        kept = mine.get(path)
        if kept is not None and kept.dtype == dtype and tuple(kept.shape) == shape:
            landed = own_tensors(receiver)[path]
            assert landed.data_ptr() == kept.data_ptr() or kept.numel() == 0, path


def test_a_modules_state_dict_keeps_torchs_version_metadata_through_the_header() -> None:
    """Pins torch's ``_metadata`` on a module's ``state_dict()`` (an ``OrderedDict``
    attribute holding each submodule's version, which ``load_state_dict`` hands to
    ``_load_from_state_dict``): the header carries it to the receiver's load."""
    from scopedmesh.fault.state_transfer import pack, unpack_header

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    metadata = model.state_dict()._metadata  # type: ignore[attr-defined]
    assert metadata["1"]["version"] == torch.nn.BatchNorm1d._version
    header, _ = pack({"model": model})
    plan = unpack_header(bytes(header.tolist()), {"model": model})
    assert plan.tree["model"]._metadata == metadata
