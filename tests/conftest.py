"""Suite-wide settings: hypothesis judges results, never timings; torch's C++ log stays quiet.

A per-example deadline is a timed assertion, and so is the health check for
slow input generation; on a loaded machine both fail correct code. The other
health checks (too much filtering, too large data) stay on.

Many tests time out or fail on purpose (a peer that never asks, a dead rank, a
stale gloo address in hazard 1), and torch's C++ layer logs a warning for each
expired socket wait and an error for each failed gloo connection; what matters
reaches the test as an exception. ``TORCH_CPP_LOG_LEVEL`` is read once, when torch
loads, so it is set here, before any test imports torch or starts a world (whose
ranks inherit it). Only this suite's processes see it: a user's run of the
library or of the plugin keeps torch's own setting.
"""

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
# torch warns at import when numpy is absent; pyproject's filter covers pytest's own
# process, this one the fork server, the ranks and the subprocesses the tests start.
os.environ.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy:UserWarning")

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("scopedmesh", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("scopedmesh")


# The marked lanes. Each is also `slow`, so the README's `-m "not slow"` leaves it
# out; .ci/run runs them after it (`-m "launch or fault or soak or hosts"`). A test
# marked `slow` alone is an at-length form (fuzzing, 1,000-cycle soaks), run by hand.
LANES = ("launch", "fault", "soak", "hosts")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of a lane `slow` too, before `-m` selects."""
    for item in items:
        if any(item.get_closest_marker(lane) for lane in LANES):
            item.add_marker(pytest.mark.slow)
