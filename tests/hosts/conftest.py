"""tests/hosts holds scripts for the two-host harness (``bash .ci/two_hosts``), and the
``hosts`` lane (``test_*.py``) that runs them.

The scripts need root, network namespaces and the environment the harness sets, so
pytest collects nothing but ``test_*.py`` here, not even the scripts' doctests
(``--doctest-modules`` would import them).
"""

from __future__ import annotations

from pathlib import Path


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """Leave out every module here but the lane's tests."""
    if collection_path.suffix == ".py" and not collection_path.name.startswith("test_"):
        return True
    return None
