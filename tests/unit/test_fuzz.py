"""Bad input loses nothing: every pure public entry answers nasty arguments with a clear error.

Each call gets one argument replaced by a nasty value (huge and non-finite numbers,
huge strings, wrong types, nested and self-containing containers). The answer must
be a result or a ``TypeError``/``ValueError``/``KeyError``/``IndexError`` (a subclass
counts) with a message, within a few seconds. The torch-backed entries (a mesh,
healing, nodes) get the same in one gloo world: tests/world/test_bad_input.py.
"""

from __future__ import annotations

import reprlib
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from probes import ALLOWED, MESSAGE_LIMIT, nasty_values

from scopedmesh import MeshLayout, ProcessGroupMesh, node_aware_ranks, shrink
from scopedmesh.layout.placement import node_numbers, nodes_from_env
from scopedmesh.layout.survivors import lost_positions
from scopedmesh.plan import make_plan
from scopedmesh.plan.cli import main as cli
from scopedmesh.plan.node_plan import make_node_plan
from scopedmesh.testing import strategies as sst
from scopedmesh.testing.world import spec_from_marker

SECONDS = 30  # a never-hang bound per call, not a speed claim (5 s failed a 10**6-rank range at load 25 on 2 cores)


NASTY = nasty_values()

LAYOUT = MeshLayout((2, 2, 2), names=("dp", "pp", "tp"))
PLAN = make_plan((2, 2), names=("dp", "tp"))

# (name, function, good arguments): each argument in turn is replaced by a nasty value.
CALLS: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("MeshLayout", MeshLayout, ((2, 2), ("dp", "tp"), [0, 1, 2, 3])),
    ("layout.ravel", LAYOUT.ravel, ((0, 1, 0), "raise")),
    ("layout.unravel", LAYOUT.unravel, (5,)),
    ("layout.group", LAYOUT.group, ((0, 1, 0), "tp", None)),
    ("layout.compact_group", LAYOUT.compact_group, ((0, 1, 0), ("dp", "tp"), None)),
    ("layout.ordered_group", LAYOUT.ordered_group, ((0, 1, 0), "pp", [0, -1])),
    ("layout.groups", LAYOUT.groups, ("pp", [0, -1])),
    ("layout.coords_along", LAYOUT.coords_along, ((0, 1, 0), "tp", None)),
    ("layout.sub", LAYOUT.sub, ((0, 1, 0), ("pp", "tp"))),
    ("layout[]", LAYOUT.__getitem__, ((0, slice(None)),)),
    ("layout.axis_index", LAYOUT.axis_index, ("tp",)),
    ("layout.axes_indices", LAYOUT.axes_indices, (("tp", 0),)),
    ("layout.axis_name", LAYOUT.axis_name, (1,)),
    ("layout.reshape", LAYOUT.reshape, ((4, 2), ("a", "b"))),
    ("shrink", shrink, (LAYOUT, [3], "dp")),
    ("lost_positions", lost_positions, (LAYOUT, [3], "dp")),
    ("node_aware_ranks", node_aware_ranks, ((2, 2), [0, 0, 1, 1], "dp")),
    ("node_numbers", node_numbers, ([0, 0, 1, 1],)),
    ("nodes_from_env", nodes_from_env, ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},)),
    ("ProcessGroupMesh.ravel", ProcessGroupMesh.ravel, ((0, 1), (2, 2), "raise")),
    ("ProcessGroupMesh.unravel", ProcessGroupMesh.unravel, (3, (2, 2))),
    (
        "ProcessGroupMesh.get_coords_along_axis",
        ProcessGroupMesh.get_coords_along_axis,
        ((0, 1), 0, [0, 1]),
    ),
    ("make_plan", make_plan, ((2, 2),)),
    ("make_node_plan", make_node_plan, (MeshLayout((4, 2), names=("dp", "tp")), "tp", 2)),
    ("spec_from_marker", spec_from_marker, ((4,), {"mesh": (2, 2)})),
    ("strategies.layouts", lambda m: sst.layouts(max_axes=m), (3,)),
    ("strategies.coordinates", sst.coordinates, (LAYOUT,)),
    ("strategies.rank_tables", sst.rank_tables, (4,)),
]


@contextmanager
def bounded(label: str) -> Iterator[None]:
    def alarm(signum: int, frame: FrameType | None) -> None:
        raise AssertionError(f"{label} still running after {SECONDS} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def outcome(label: str, call: Callable[[], Any]) -> str:
    """'ok' or the error's type name; fails on any other error or an empty message."""
    with bounded(label):
        try:
            call()
        except ALLOWED as error:
            assert str(error), f"{label}: {type(error).__name__} without a message"
            assert len(str(error)) <= MESSAGE_LIMIT, f"{label}: {len(str(error))} characters"
            return type(error).__name__
        except Exception as error:  # the point of the test: name what escaped
            raise AssertionError(
                f"{label} raised {type(error).__name__}: {error!r:.300}"
            ) from error
    return "ok"


def test_every_pure_entry_answers_every_nasty_argument() -> None:
    tally: Counter[str] = Counter()
    escaped: list[str] = []
    for name, function, good in CALLS:
        for position in range(len(good)):
            for nasty in NASTY:
                args = list(good)
                args[position] = nasty
                label = f"{name}(arg {position} = {reprlib.repr(nasty)})"
                try:
                    tally[outcome(label, partial(function, *args))] += 1
                except AssertionError as failure:
                    tally["escaped"] += 1
                    escaped.append(str(failure).splitlines()[0])
    print("calls by outcome:", dict(tally))  # shown with -s; the note quotes it
    assert not escaped, "\n".join(escaped)
    assert sum(tally.values()) == sum(len(g) for _, _, g in CALLS) * len(NASTY)
    assert tally["TypeError"] + tally["ValueError"] > tally["ok"]


@pytest.mark.parametrize("nasty", NASTY, ids=lambda v: type(v).__name__)
def test_the_cli_answers_nasty_words_with_a_status(nasty: Any) -> None:
    word = reprlib.repr(nasty) if not isinstance(nasty, str) else nasty[:10_000]
    words = ["plan", word, "2", "--names", word, "x"]
    with bounded("scopedmesh plan"):
        assert cli(words) in (0, 2)  # a plan (a huge world is summarised) or one error line


@settings(max_examples=200)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=20)
        | st.binary(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.tuples(inner, inner)
            | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=12,
    ),
    st.sampled_from(range(len(CALLS))),
    st.data(),
)
def test_generated_nested_values_get_a_clear_answer(
    value: Any, which: int, data: st.DataObject
) -> None:
    name, function, good = CALLS[which]
    position = data.draw(st.integers(0, len(good) - 1))
    args = list(good)
    args[position] = value
    outcome(f"{name}(arg {position} = {reprlib.repr(value)})", partial(function, *args))
