"""Every python block in docs/ runs: pytest files (``# test_*.py``) under the plugin, the rest as scripts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import ENV, TIMING_FREE

DOCS = Path(__file__).resolve().parent.parent / "docs"
# Pages whose blocks their own tests run.
OWN_TESTS = frozenset({"testing.md", "GPU.md"})


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        if page.name in OWN_TESTS:
            continue
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            found.append((page.name, i, block))
    return found


def test_docs_have_python_blocks() -> None:
    assert any(page == "views.md" for page, _, _ in _blocks())


@pytest.mark.parametrize(("page", "index", "block"), _blocks(), ids=lambda v: str(v)[:20])
def test_docs_block_runs(page: str, index: int, block: str, tmp_path: Path) -> None:
    name = re.match(r"# (test_\w+\.py)", block)
    if name is not None:
        (tmp_path / name.group(1)).write_text(block)
        (tmp_path / "conftest.py").write_text(TIMING_FREE)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name.group(1)]
    else:
        (tmp_path / "block.py").write_text(block)
        command = [sys.executable, "block.py"]
    run = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=ENV
    )
    assert run.returncode == 0, f"{page} block {index}:\n{run.stdout}{run.stderr}"
