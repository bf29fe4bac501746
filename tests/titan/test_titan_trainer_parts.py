"""The replicated trainer's parts that need no job: its config section, torchtitan's
config functions as its own, the data position, the CPU shims (under a second)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan", reason="needs the extra: pip install 'scopedmesh[torchtitan]'")

import torch

from scopedmesh.interop import titan_configs
from scopedmesh.interop.titan_trainer import (
    DataStream,
    ReplicasSection,
    ReplicatedTrainer,
    _resolved,
)


class Loader:
    """A data loader of numbered batches with torchtitan's stateful interface."""

    def __init__(self) -> None:
        self.next = 0

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]

    def __iter__(self) -> Iterator[Any]:
        while True:
            self.next += 1
            yield ({"input": torch.tensor([self.next - 1])}, torch.tensor([self.next - 1]))


def _numbers(batches: list[Any]) -> list[int]:
    return [int(labels) for _, labels in batches]


def _stream() -> DataStream:
    return DataStream(Loader(), iter)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["commit", "redo", "seek"]), max_size=12), st.integers(0, 9))
def test_a_step_takes_the_batches_of_its_position(actions: list[str], to: int) -> None:
    stream, per = _stream(), 2
    for action in actions:
        taken = _numbers(stream.take(per))
        assert taken == list(range(stream.position, stream.position + per))
        if action == "commit":
            stream.commit(per)
        elif action == "redo":  # a step not committed: the same batches again
            assert _numbers(stream.take(per)) == taken
        else:  # a joiner or a checkpoint: replays its shard up to there
            stream.seek(to)
    assert _numbers(stream.take(per)) == [stream.position, stream.position + 1]


def test_the_section_reads_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCOPEDMESH_REPLICA", "2")
    monkeypatch.setenv("SCOPEDMESH_REPLICAS", "3")
    monkeypatch.setenv("SCOPEDMESH_JOB_STORE", "10.0.0.1:29400")
    monkeypatch.delenv("SCOPEDMESH_BACKEND", raising=False)
    section = _resolved(ReplicasSection(enable=True))
    assert (section.replica, section.replicas, section.job_store, section.backend) == (
        2,
        3,
        "10.0.0.1:29400",
        "gloo",
    )
    explicit = _resolved(ReplicasSection(enable=True, replica=0, job_store="h:1", backend="nccl"))
    assert (explicit.replica, explicit.job_store, explicit.backend) == (0, "h:1", "nccl")


@pytest.mark.parametrize(
    ("section", "env", "message"),
    [
        (ReplicasSection(enable=True), {}, "scopedmesh.replica is unset and so is SCOPEDMESH_REPLICA"),
        (ReplicasSection(replica=3, replicas=3, job_store="h:1"), {}, "scopedmesh.replica must be in 0..2"),
        (ReplicasSection(replica=0, replicas=1, job_store="h"), {}, "scopedmesh.job_store must be HOST:PORT"),
        (ReplicasSection(replica=0, replicas=1, job_store="h:1", backend="mpi"), {}, "'gloo' or 'nccl'"),
        (ReplicasSection(replicas=2, job_store="h:1"), {"SCOPEDMESH_REPLICA": "x"}, "SCOPEDMESH_REPLICA must be an int"),
        (ReplicasSection(replica=0, replicas=1, job_store="h:1", finish_wait=-1), {}, "finish_wait must be >= 0"),
    ],
)  # fmt: skip
def test_a_bad_section_names_the_field(
    section: ReplicasSection, env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("SCOPEDMESH_REPLICA", "SCOPEDMESH_REPLICAS", "SCOPEDMESH_JOB_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        _resolved(section)


def test_torchtitans_config_functions_become_the_replicated_trainers() -> None:
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = ConfigManager().parse_args(
        ["--module", "scopedmesh.interop.titan_configs", "--config", "llama3_debugmodel",
         "--scopedmesh.enable", "--scopedmesh.replica", "1", "--training.steps", "7"]
    )  # fmt: skip
    assert isinstance(config, ReplicatedTrainer.Config)
    assert config.build.__self__._owner is ReplicatedTrainer  # type: ignore[attr-defined]
    assert (config.scopedmesh.enable, config.scopedmesh.replica, config.training.steps) == (
        True,
        1,
        7,
    )
    theirs = llama3_debugmodel()
    assert config.optimizer == theirs.optimizer and config.lr_scheduler == theirs.lr_scheduler
    with pytest.raises(AttributeError, match="no torchtitan model's config is named 'nope'"):
        titan_configs.nope  # noqa: B018
    with pytest.raises(TypeError, match=r"torchtitan Trainer\.Config"):
        titan_configs.replicated(object())


def test_torchfts_config_has_no_home_here() -> None:
    torchft = pytest.importorskip("torchtitan.experiments.torchft.llama3.config_registry")
    with pytest.raises(ValueError, match=r"fields \['fault_tolerance'\]"):
        titan_configs.replicated(torchft.llama3_torchft_debugmodel())


def test_on_cpu_torchtitans_device_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from scopedmesh.interop.titan_trainer import CPU_TARGETS, run_on_cpu

    for module_name, names in CPU_TARGETS:  # monkeypatch puts torchtitan's own back
        module = importlib.import_module(module_name)
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))
    patched = run_on_cpu()
    assert len(patched) == sum(len(names) for _, names in CPU_TARGETS)
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    assert utils.device_type == dist_utils.device_type == metrics.device_type == "cpu"
    assert metrics.device_module.get_device_name(None) == "cpu"
    assert dist_utils.get_local_device() == torch.device("cpu")
    assert utils.device_module.get_device_properties(None).total_memory > 0
    assert utils.device_module.is_available is torch.cpu.is_available  # the rest: torch.cpu
