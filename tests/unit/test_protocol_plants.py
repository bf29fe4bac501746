"""The simulation can fail: each bug below, planted alone, makes it fail with a shrunk
schedule (printed with ``-s``). Marked ``slow`` alone (run by hand: ``pytest -m slow
tests/unit/test_protocol_plants.py -s``): each plant explores until it fails, then
hypothesis shrinks the schedule, a minute or two in all.

The fourth plant of issue 43 (a link's verdict from "a byte in flight at each check")
is planted against the link machine's own property test, in ``test_links.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from test_protocol_simulation import Protocol

from scopedmesh.fault.liveness import agreement as step_driving
from scopedmesh.fault.liveness.deaths import DeathRecord
from scopedmesh.fault.protocol import agreement as agreeing
from scopedmesh.fault.protocol import verdict as rules


def _always_commits(mine: int, highest: int, flag: int) -> bool:
    return True


def _name_without_members(members: Any, tag: str) -> str:
    return tag


def _never_departs(self: DeathRecord, store: Any, reason: str) -> None:
    return None


def _key_without_line(members: Any, line: str) -> str:
    return agreeing.members_key(members)


def _reforms_at_once(self: rules.Verdict) -> bool:
    return self.agreed


def _members_minus_lost(self: rules.Lineup, lost: Any) -> rules.Lineup | None:
    left = [rank for rank in self.ranks if rank not in set(lost)]
    if len(left) == len(self.ranks):
        return self
    return rules.Lineup.of(left) if left else None


PLANTS = {
    "a member in doubt that always commits": [(rules, "doubt_commits", _always_commits)],
    "agreement keys without the mesh's members": [
        (agreeing, "agreement_name", _name_without_members),
        (rules, "agreement_name", _name_without_members),
    ],
    "a departure never recorded": [(DeathRecord, "depart", _never_departs)],
    "one key for every mesh over the same ranks (twins share counts)": [
        (owner, "line_key", _key_without_line) for owner in (agreeing, rules, step_driving)
    ],
    "a member in doubt that commits re-forms at once (twins deadlock)": [
        (rules.Verdict, "reforms", property(_reforms_at_once))
    ],
    "the members minus the lost go on (a heal that drops a slice loses the line)": [
        (rules.Lineup, "after", _members_minus_lost)
    ],
}


@pytest.fixture(params=sorted(PLANTS))
def planted(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for owner, name, bug in PLANTS[request.param]:
        monkeypatch.setattr(owner, name, bug)
    yield request.param


@pytest.mark.slow
def test_the_simulation_finds_each_planted_bug(planted: str, capsys: Any) -> None:
    explore = settings(
        max_examples=20_000,
        stateful_step_count=40,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=False,
        report_multiple_bugs=False,
    )
    with pytest.raises(Exception) as failed:
        run_state_machine_as_test(Protocol, settings=explore)
    schedule = "\n".join(getattr(failed.value, "__notes__", []))
    with capsys.disabled():
        print(f"\n== planted: {planted}\n{schedule}\n{type(failed.value).__name__}: {failed.value}")
    assert "state.teardown()" in schedule, schedule  # a shrunk schedule, printed
