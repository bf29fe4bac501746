"""Run the pytest files that README.md and docs/ show, as a user runs them, in one session.

Each file is written out under a name of its own (two pages may both show a
``test_tp.py``) beside a conftest that makes hypothesis judge results, not
timings, and all of them run in one ``python -m pytest`` subprocess: one start-up
and one warm fork server for every file, as in a user's own suite. The outcome of
each file is read from pytest's JUnit XML report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# As after the README's install; a no-op where the package is installed already.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}
TIMING_FREE = """from hypothesis import HealthCheck, settings

settings.register_profile("no-timing", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("no-timing")
"""


@dataclass(frozen=True)
class Session:
    """One pytest run over several files: each file's test outcomes, and the run's output."""

    outcomes: dict[str, list[str]]  # file name -> "passed" / "failed" / "error" / "skipped"
    output: str

    def check(self, name: str) -> None:
        """Raise ``AssertionError`` unless the file ``name`` ran at least one test and all passed."""
        outcomes = self.outcomes.get(name, [])
        assert outcomes and set(outcomes) == {"passed"}, f"{name}: {outcomes}\n{self.output}"


def run_files(files: dict[str, str], directory: Path, timeout: float = 600.0) -> Session:
    """Write ``files`` (name -> text) into ``directory`` and run them in one pytest session."""
    for name, text in files.items():
        (directory / name).write_text(text)
    (directory / "conftest.py").write_text(TIMING_FREE)
    report = directory / "report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(
        [*command, f"--junitxml={report}", *files],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )
    outcomes: dict[str, list[str]] = {name: [] for name in files}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            name = case.get("classname", "").split(".")[0] + ".py"
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes.setdefault(name, []).append(kinds[0] if kinds else "passed")
    return Session(outcomes, f"exit status {run.returncode}\n{run.stdout}{run.stderr}")
