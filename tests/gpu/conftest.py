"""The GPU suite: every test here is marked ``gpu`` and skipped, with the reason, without 2 GPUs.

Run it with ``bash .ci/gpu`` on a host with two or more CUDA devices (docs/GPU.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the worker module beside the tests

from gpu_workers import gpus

REASON = "needs 2 or more CUDA devices and NCCL (see docs/GPU.md: bash .ci/gpu)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    enough = gpus() >= 2
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents and "cpu_dry_run" not in item.name:
            item.add_marker(pytest.mark.gpu)
            if not enough:
                item.add_marker(pytest.mark.skip(reason=REASON))
