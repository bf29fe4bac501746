"""The group cache's error for a group that could not be made."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from scopedmesh.errors import GroupFormationError
from scopedmesh.mesh.group_table import formation_error

MEETING_FAILURES = [
    "Wait timeout after 2000ms, keys: /scopedmesh-abc-1/all-formed",
    "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38103",
    "Gloo connectFullMesh failed with ... Connect timeout",
    "Socket Timeout",
]
# Recognised by type and backend, not by these words: a gloo group's construction
# fails only when its members do not meet, whatever torch says.
MEETING_FAILURES += ["an error whose words name no cause"]
BACKEND_FAILURES = [
    "ProcessGroupNCCL is only supported with GPUs, no GPUs found!",
    "nccl2 requires at least one CUDA device",
]


@pytest.mark.parametrize("text", MEETING_FAILURES)
def test_members_that_did_not_meet_get_the_likely_causes(text: str) -> None:
    error = formation_error(
        "gloo", "axis 'tp'", range(2, 4), timedelta(seconds=2), RuntimeError(text)
    )
    message = str(error)
    assert isinstance(error, GroupFormationError)
    assert "could not form the gloo process group along axis 'tp' over ranks [2, 3]" in message
    assert "within 0:00:02" in message
    assert "never requested" in message and "died" in message and "different orders" in message
    assert message.endswith(f"torch said: {text}")


@pytest.mark.parametrize("text", BACKEND_FAILURES)
def test_a_backend_failure_is_reported_as_what_it_is(text: str) -> None:
    error = formation_error("nccl", "axis 'dp'", (0, 4), None, RuntimeError(text))
    message = str(error)
    assert isinstance(error, GroupFormationError)
    assert (
        message
        == f"the nccl backend failed to make the process group along axis 'dp' over ranks [0, 4]: {text}"
    )
    assert "never requested" not in message


def test_a_store_wait_that_timed_out_is_a_meeting_failure_on_any_backend() -> None:
    timed_out = dist.DistStoreError("the words do not matter")
    message = str(formation_error("nccl", "axis 'dp'", (0, 4), None, timed_out))
    assert message.startswith("could not form the nccl process group along axis 'dp'")
    assert "never requested" in message


def test_a_lost_store_is_said_to_be_lost_whatever_its_words() -> None:
    lost = dist.DistNetworkError("a wait timed out")  # words of a timeout, type of a lost store
    message = str(formation_error("gloo", "axis 'dp'", (0, 4), None, lost))
    assert "lost its connection to torch's store" in message
    assert "never requested" not in message
