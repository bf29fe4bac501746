"""The supported torch range is stated once per place, and every place says the same.

``.ci/compat`` holds the matrix of releases the suite runs against; the lowest
is ``pyproject.toml``'s floor, the README states the range, and
``COMPATIBILITY.md`` has a row for each release.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _matrix() -> list[str]:
    script = (ROOT / ".ci" / "compat").read_text()
    found = re.search(r"^MATRIX=\(([^)]*)\)", script, re.M)
    assert found is not None, "MATRIX=(...) not found in .ci/compat"
    return found.group(1).split()


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def test_matrix_is_ordered_and_names_full_releases() -> None:
    matrix = _matrix()
    assert matrix, "empty matrix"
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", r) for r in matrix), matrix
    assert matrix == sorted(matrix, key=_key)


def test_pyproject_floor_is_the_lowest_tested_release() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"torch>=([0-9.]+)"', pyproject)
    assert found is not None, "torch requirement not found in pyproject.toml"
    lowest = _matrix()[0]
    assert _key(found.group(1)) == _key(lowest)[: len(_key(found.group(1)))], (
        found.group(1),
        lowest,
    )


def test_readme_states_the_tested_range() -> None:
    readme = (ROOT / "README.md").read_text()
    matrix = _matrix()
    low, high = (".".join(r.split(".")[:2]) for r in (matrix[0], matrix[-1]))
    assert f"**Supported torch: {low} to {high}" in readme
    assert "(COMPATIBILITY.md)" in readme


def test_compatibility_md_has_a_row_per_release() -> None:
    table = (ROOT / "COMPATIBILITY.md").read_text()
    for release in _matrix():
        assert re.search(rf"^\| {re.escape(release)}\b", table, re.M), release
