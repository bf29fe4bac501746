"""A catch-up whose source is late costs its lateness, never a heal (issue 43, finding 4).

On gloo, a point-to-point receive whose wait times out is marked completed and
its pair closed ("Application timeout caused pair closure"). The dp group's
waits used to poll ``work.wait(timedelta(seconds=0.05))``, so a source whose
registered ``state_dict()`` took 0.3 s failed every catch-up, which then fell
back to a heal. Now a wait polls completion and checks the links between.
"""

from __future__ import annotations

import _workers_links as workers
import pytest

from scopedmesh.fault.links import CHECK_EVERY
from scopedmesh.testing.launcher import run_world


@pytest.mark.parametrize("late", [0.3, 1.5])
def test_a_late_source_is_waited_for_and_its_state_lands(late: float) -> None:
    source, joiner = run_world(workers.late_source, 2, args=(late,), timeout=120)
    assert joiner["error"] is None, (
        f"the joiner, after {joiner['seconds']:.2f} s: {joiner['error']}"
    )
    assert source["error"] is None, (
        f"the source, after {source['seconds']:.2f} s: {source['error']}"
    )
    assert joiner["equal"], joiner
    assert joiner["seconds"] >= late, joiner  # it did wait for the source
    assert joiner["checks"] >= late / CHECK_EVERY / 2, joiner  # the link was checked meanwhile
    assert joiner["lost"] == [] and source["lost"] == [], (source, joiner)
