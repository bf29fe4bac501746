"""The README's examples run as written: its test files pass, its CLI output is real."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PLAN_PAGE = (ROOT / "docs" / "plan.md").read_text()
# As after the README's install; a no-op where the package is installed already.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}

TIMING_FREE = """from hypothesis import HealthCheck, settings

settings.register_profile("no-timing", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("no-timing")
"""


def _test_files() -> dict[str, str]:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    return {m.group(1): b for b in blocks if (m := re.match(r"# (test_\w+\.py)", b))}


def test_readme_test_files_pass(tmp_path: Path) -> None:
    files = _test_files()
    assert set(files) == {"test_tp.py"}  # docs/testing.md's files run in tests/world/test_docs.py
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    # The files as written; beside them, the suite's rule that hypothesis judges
    # results, not timings (on a loaded machine its slow-generation check failed them).
    (tmp_path / "conftest.py").write_text(TIMING_FREE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout


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
