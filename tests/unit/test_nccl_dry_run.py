"""What torch release and environment a guarded NCCL mesh needs (scopedmesh.c10d.nccl).

torch's NCCL watchdog ends a healed survivor about 60 s after the death unless
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 0 or 2 (stock ``ProcessGroupNCCL``);
torch 2.14 added ``nccl2`` (``TORCH_DIST_USE_NCCL2=1``), 2.15 made it the
default (``=0`` for the stock one). Each release is told apart the way the
module does: by torch's backend registry, else by release and variable. The
environment is a plain dict here: nothing touches ``os.environ``.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed import distributed_c10d as c10d

from scopedmesh.c10d import nccl

VARIABLE, DEPRECATED = nccl.ASYNC_ERROR_HANDLING


def _creator(*args: Any) -> None:  # stands for torch 2.14+'s nccl2 creator
    return None


@pytest.fixture
def release(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pretend to be torch ``(major, minor)``: nccl2 exists from 2.14; "nccl" unregistered."""

    def pretend(version: tuple[int, int], registered: object = None) -> None:
        if version >= (2, 14):
            monkeypatch.setattr(c10d, "_create_nccl2_process_group", _creator, raising=False)
        else:
            monkeypatch.delattr(c10d, "_create_nccl2_process_group", raising=False)
        monkeypatch.setattr(nccl, "_release", lambda: version)
        plugins = dict(dist.Backend._plugins)
        plugins.pop("NCCL", None)
        if registered is not None:
            plugins["NCCL"] = dist.Backend._BackendPlugin(registered, True)
        monkeypatch.setattr(dist.Backend, "_plugins", plugins)

    return pretend


@pytest.mark.parametrize(
    ("version", "env", "flavour"),
    [
        ((2, 11), {}, "stock"),
        ((2, 13), {nccl.USE_NCCL2: "1"}, "stock"),  # no nccl2 before 2.14
        ((2, 14), {}, "stock"),
        ((2, 14), {nccl.USE_NCCL2: "1"}, "nccl2"),
        ((2, 15), {}, "nccl2"),
        ((2, 15), {nccl.USE_NCCL2: "0"}, "stock"),
        ((2, 15), {nccl.USE_NCCL2: "1"}, "nccl2"),
    ],
)
def test_nccl_resolves_by_release_and_variable_before_torch_registers_it(
    release: Any, version: tuple[int, int], env: dict[str, str], flavour: str
) -> None:
    release(version)
    assert nccl.nccl_flavour(env) == flavour


@pytest.mark.parametrize("version", [(2, 14), (2, 15)])
def test_once_registered_torchs_registry_decides_not_the_variable(
    release: Any, version: tuple[int, int]
) -> None:
    release(version, registered=_creator)
    assert nccl.nccl_flavour({nccl.USE_NCCL2: "0"}) == "nccl2"
    release(version, registered=lambda *args: None)  # the stock creator
    assert nccl.nccl_flavour({nccl.USE_NCCL2: "1"}) == "stock"


@pytest.mark.parametrize("version", [(2, 11), (2, 12), (2, 13), (2, 14)])
@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl", "cpu:gloo,cuda:nccl", "nccl-legacy"])
def test_stock_nccl_is_refused_until_error_handling_is_0_or_2(
    release: Any, version: tuple[int, int], backend: str
) -> None:
    release(version)
    for env in ({}, {VARIABLE: "1"}, {VARIABLE: "3"}, {VARIABLE: "x"}, {DEPRECATED: "1"}):
        with pytest.raises(RuntimeError, match=f"Set {VARIABLE}=2 \\(or 0\\)") as refused:
            nccl.check_error_handling(backend, env)
        assert backend in str(refused.value)
        shown = next(iter(env.values()), "unset")
        assert f"is {shown}" in str(refused.value)
    for env in ({VARIABLE: "2"}, {VARIABLE: "0"}, {VARIABLE: " 2 "}, {DEPRECATED: "2"}):
        nccl.check_error_handling(backend, env)


def test_the_current_variable_wins_over_the_deprecated_one(release: Any) -> None:
    release((2, 13))
    with pytest.raises(RuntimeError, match=f"{VARIABLE} is 3"):
        nccl.check_error_handling("nccl", {VARIABLE: "3", DEPRECATED: "2"})
    nccl.check_error_handling("nccl", {VARIABLE: "2", DEPRECATED: "3"})


def test_nccl2_and_gloo_need_nothing(release: Any) -> None:
    release((2, 15))
    for backend in ("nccl", "nccl2", "cuda:nccl2", "gloo", "fake", "cpu:gloo,cuda:nccl"):
        nccl.check_error_handling(backend, {})
    nccl.check_error_handling(None, {})
    with pytest.raises(RuntimeError, match=VARIABLE):  # the stock backend, asked for by name
        nccl.check_error_handling("nccl-legacy", {})
    with pytest.raises(RuntimeError, match=VARIABLE):  # rolled back to the stock backend
        nccl.check_error_handling("nccl", {nccl.USE_NCCL2: "0"})


@given(st.lists(st.sampled_from(["gloo", "nccl", "fake", "nccl2", "ucc"]), min_size=1, max_size=3))
def test_every_group_but_plain_gloo_is_aborted(names: list[str]) -> None:
    devices = ["cpu", "cuda", "xpu"]
    mixed = ",".join(f"{d}:{n}" for d, n in zip(devices, names))
    assert nccl.aborts(mixed) is (set(names) != {"gloo"})
    assert nccl.aborts(names[0]) is (names[0] != "gloo")


def test_the_unsplit_block_restores_worlds_device_outside_a_world() -> None:
    """Without a world there is nothing to hide: the block runs and leaves no trace."""
    assert not dist.is_initialized()
    with nccl.unsplit():
        assert not dist.is_initialized()


# ------------------------------------------------------------------ the torch names nccl.py uses
# docs/ARCHITECTURE.md lists each; a release that moves one fails here, not in a heal.

RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def test_torch_splits_new_groups_from_world_only_when_world_has_a_bound_device() -> None:
    """unsplit() relies on this: torch's helper asks WORLD's bound device whether to split."""
    source = inspect.getsource(inspect.unwrap(c10d._new_process_group_helper))
    assert "_get_default_group().bound_device_id" in source
    assert "split_from" in source


def test_a_groups_bound_device_can_be_set_and_cleared() -> None:
    group = dist.ProcessGroup(0, 1)  # type: ignore[call-arg]
    assert group.bound_device_id is None
    group.bound_device_id = torch.device("cuda", 0)
    assert group.bound_device_id == torch.device("cuda", 0)
    group.bound_device_id = None
    assert group.bound_device_id is None


def test_process_groups_abort_and_nccls_group_call_exist() -> None:
    assert callable(getattr(dist.ProcessGroup, "abort", None))
    assert isinstance(dist.Backend._plugins, dict)
    assert hasattr(dist.Backend, "_BackendPlugin")
    if dist.is_nccl_available():  # a CUDA build: the stock backend's group call
        nccl_class = c10d.ProcessGroupNCCL
        assert callable(nccl_class._group_start) and callable(nccl_class._group_end)
    if RELEASE >= (2, 14):
        assert callable(c10d._create_nccl2_process_group)
    else:
        assert not hasattr(c10d, "_create_nccl2_process_group")


def test_a_failed_abort_is_told_by_every_later_refusal() -> None:
    """The watch's thread never raises out of an abort (its other meshes must still be
    aborted); what failed is chained to the mesh's next refusal instead."""
    from scopedmesh import MeshClosedError
    from scopedmesh.mesh.group_table import GroupTable

    table = GroupTable()
    table.abort("when the test said so")  # no group: nothing to fail
    with pytest.raises(MeshClosedError, match=r"shut down when the test said so\. Close") as plain:
        table.check_not_aborted("the mesh")
    assert plain.value.__cause__ is None
    failure = RuntimeError("ncclInternalError")
    table.abort_failures.append(failure)
    with pytest.raises(MeshClosedError, match="aborting them failed too: RuntimeError") as told:
        table.check_not_aborted("the mesh")
    assert told.value.__cause__ is failure
