"""The replicas' timeline picture (``python -m scopedmesh.launch.timeline``): its facts, read
back from the SVG, follow the protocol; docs/replicas-timeline.svg is its output."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scopedmesh.launch.timeline import Schedule, main, render_timeline

PICTURE = Path(__file__).resolve().parents[2] / "docs" / "replicas-timeline.svg"
SVG = "{http://www.w3.org/2000/svg}"


def test_the_docs_picture_is_regenerated_identically() -> None:
    assert PICTURE.read_text() == render_timeline(Schedule()), (
        "docs/replicas-timeline.svg is stale: python -m scopedmesh.launch.timeline "
        "docs/replicas-timeline.svg"
    )


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    replicas = draw(st.integers(2, 6))
    death = draw(st.integers(0, 6))
    restart = draw(st.integers(1, 4))
    return Schedule(
        replicas=replicas,
        victim=draw(st.integers(0, replicas - 1)),
        death_step=death,
        restart_steps=restart,
        attempts=death + restart + 3 + draw(st.integers(0, 4)),
    )


@given(schedules())
def test_the_picture_follows_the_protocol(schedule: Schedule) -> None:
    root = ET.fromstring(render_timeline(schedule))
    cells = [g.attrib for g in root.iter(f"{SVG}g") if g.get("class") == "step"]
    by_attempt: dict[int, dict[int, dict[str, str]]] = defaultdict(dict)
    for cell in cells:
        by_attempt[int(cell["data-attempt"])][int(cell["data-replica"])] = cell
    assert sorted(by_attempt) == list(range(schedule.attempts))
    everyone = set(range(schedule.replicas))
    step = 0
    absent_since = None
    for attempt in range(schedule.attempts):
        row = by_attempt[attempt]
        kinds = {r: c["data-kind"] for r, c in row.items()}
        assert {int(c["data-step"]) for c in row.values()} == {step}  # one step at a time
        if "failed" in kinds.values():  # a death fails the step on every member: redone
            assert set(kinds) == everyone and set(kinds.values()) == {"failed"}
            absent_since = attempt
            continue
        step += 1
        if set(row) != everyone:  # the dead replica is away; the others go on alone
            assert absent_since is not None and set(kinds.values()) == {"reduced"}
            assert everyone - set(row) == {schedule.victim}
        elif "catch-up" in kinds.values():  # admitted: it receives, the others train
            assert absent_since is not None and kinds[schedule.victim] == "catch-up"
            assert {k for r, k in kinds.items() if r != schedule.victim} == {"reduced"}
            assert attempt == absent_since + 1 + schedule.restart_steps
            absent_since = None
        else:
            assert set(kinds.values()) == {"full"} and absent_since is None
    assert step == schedule.attempts - 1  # exactly one attempt failed
    epochs = [
        int(by_attempt[a][0 if schedule.victim else 1]["data-epoch"])
        for a in range(schedule.attempts)
    ]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1, 2}  # heal, then admission


@pytest.mark.parametrize(
    "kwargs",
    [
        {"replicas": 1, "victim": 0},
        {"victim": 3},
        {"attempts": 5},
        {"death_step": -1},
        {"restart_steps": 0},
    ],
)
def test_a_schedule_that_cannot_happen_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Schedule(**kwargs)


def test_main_writes_the_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "t.svg")]) == 0
    assert (tmp_path / "t.svg").read_text() == render_timeline(Schedule())
    assert main([str(tmp_path / "no" / "such" / "t.svg")]) == 2
    assert capsys.readouterr().err.startswith("scopedmesh.launch.timeline: error: ")
