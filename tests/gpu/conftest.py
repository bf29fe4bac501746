"""The GPU suite: every test here is marked ``gpu`` and skipped, with the reason, without a GPU.

Run it with ``bash .ci/gpu`` on a host with CUDA devices (docs/GPU.md). On one GPU
each world is two ranks on it, each presenting its own NCCL host id (a test rig
for the library's logic, not a supported NCCL setup); on 2 or more, a rank per GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the worker module beside the tests

from gpu_workers import gpus

REASON = "needs a CUDA device and NCCL (see docs/GPU.md: bash .ci/gpu)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    enough = gpus() >= 1
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents and "cpu_dry_run" not in item.name:
            item.add_marker(pytest.mark.gpu)
            if not enough:
                item.add_marker(pytest.mark.skip(reason=REASON))
