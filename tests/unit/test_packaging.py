"""Packaging facts that a build would only reveal later: one version, the plugin's entry point."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import scopedmesh

ROOT = Path(__file__).resolve().parents[2]


def test_version_has_one_source() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "scopedmesh.__version__"}
    assert re.fullmatch(
        r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", scopedmesh.__version__
    )


def test_pytest_plugin_entry_point_and_testing_extra() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"scopedmesh": "scopedmesh.testing.plugin"}
    assert any(req.startswith("pytest") for req in project["optional-dependencies"]["testing"])


def test_changelog_has_unreleased_and_release_procedure() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert "## How to cut a release" in text
    for heading in re.findall(r"^## \[.*$", text, re.M):  # each released version, dated
        assert heading == "## [Unreleased]" or re.fullmatch(
            r"## \[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}", heading
        ), heading


def test_readme_stays_a_front_page() -> None:
    """The README is read whole, by people deciding whether to use the library: detail goes to docs/."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12_000, f"README.md is {size} bytes; move detail to docs/ (limit 12,000)"
