"""What the scripts run by the two-host harness share."""

from __future__ import annotations

import time
from pathlib import Path


def wait_file(path: Path, seconds: float) -> None:
    """Until ``path`` exists; ``TimeoutError`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {seconds:g} s")
        time.sleep(0.02)
