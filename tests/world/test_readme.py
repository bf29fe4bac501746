"""The README's examples run as written: its test files pass, its CLI output is real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _doc_files import ENV, ROOT, run_files

README = (ROOT / "README.md").read_text()
PLAN_PAGE = (ROOT / "docs" / "plan.md").read_text()


def _test_files() -> dict[str, str]:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    return {m.group(1): b for b in blocks if (m := re.match(r"# (test_\w+\.py)", b))}


@pytest.mark.launch
def test_readme_test_files_pass(tmp_path: Path) -> None:
    files = _test_files()
    assert set(files) == {"test_tp.py"}  # docs/testing.md's files run in tests/world/test_docs.py
    session = run_files(files, tmp_path)
    for name in files:
        session.check(name)


def test_the_plan_page_output_is_what_the_cli_prints() -> None:
    block = re.search(
        r"```console\n\$ \.venv/bin/python -m (scopedmesh plan [^\n]*)\n(.*?)```", PLAN_PAGE, re.S
    )
    assert block is not None
    command, shown = block.group(1), block.group(2)
    run = subprocess.run(
        [sys.executable, "-m", *command.split()],
        capture_output=True,
        text=True,
        check=True,
        env=ENV,
    )
    assert run.stdout == shown
