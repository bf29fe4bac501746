"""The fault protocol, explored: hypothesis schedules deaths, exceptions, departures, slow
members and cut collectives among the members of one or two meshes under one watch (or
twins: two meshes over the same members, stepped by turns; a mesh two ranks a slice, whose
heal drops a lost rank's whole slice), and checks the protocol's rules after every event
(:mod:`_protocol_sim`).

A failure prints the shrunk schedule (hypothesis's steps) and the rule it broke; a
seed replays a run (``--hypothesis-seed``).
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from _protocol_sim import BUG, KEPT_RUNTIME, KEPT_VALUE, LEAVING_VALUE, Simulation
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

EXAMPLES = int(os.environ.get("SCOPEDMESH_SIM_EXAMPLES", "2000"))
DRAIN = 20_000  # requests the end of a run may take to finish every live member


class Protocol(RuleBasedStateMachine):
    """One run: a world, a schedule of events, then every live member runs to its end."""

    sim: Simulation

    @initialize(
        size=st.integers(2, 5),
        meshes=st.sampled_from([1, 2]),
        steps=st.integers(2, 4),
        twins=st.booleans(),
        width=st.sampled_from([1, 2]),
    )
    def world(
        self, size: int, meshes: int, steps: int, twins: bool = False, width: int = 1
    ) -> None:
        """``size`` members on ``meshes`` meshes (or twins); ``width`` 2: one 2 x 2 (dp, tp)
        mesh, 3 x 2 where ``size`` is 5, whatever ``size`` and ``meshes`` say."""
        if width > 1:  # one (dp, tp) mesh, 2 x 2 or 3 x 2, healed along dp
            size, meshes = (6 if size == 5 else 4), 1
        self.sim = Simulation(size, meshes if size >= 4 else 1, steps, twins, width)
        self.kills = 0

    @rule(choice=st.integers(0, 15), cut_late=st.booleans())
    def act(self, choice: int, cut_late: bool) -> None:
        """One request of one runnable thread (the clock moves when none can run)."""
        self.sim.run(choice, cut_late)

    @rule(choice=st.integers(0, 15), times=st.integers(1, 12), cut_late=st.booleans())
    def act_several(self, choice: int, times: int, cut_late: bool) -> None:
        for _ in range(times):
            self.sim.run(choice, cut_late)

    @rule(rank=st.integers(0, 4))
    def kill(self, rank: int) -> None:
        """SIGKILL, at whatever moment the schedule reached."""
        if self.kills < 2 and rank < len(self.sim.members):
            self.kills += 1
            self.sim.kill(rank)

    @rule(
        rank=st.integers(0, 4),
        ahead=st.integers(0, 2),
        what=st.sampled_from([KEPT_RUNTIME, KEPT_VALUE, LEAVING_VALUE, BUG]),
    )
    def arm(self, rank: int, ahead: int, what: str) -> None:
        """The member's step (this one or one ahead) raises ``what``."""
        if rank < len(self.sim.members):
            member = self.sim.members[rank]
            member.armed[member.step + ahead] = what

    @rule(rank=st.integers(0, 4), seconds=st.sampled_from([0.05, 0.4, 3.0, 45.0]))
    def slow(self, rank: int, seconds: float) -> None:
        """The member's next step computes for ``seconds`` (45: past the watch's timeout)."""
        if rank < len(self.sim.members):
            self.sim.members[rank].slow = seconds

    @invariant()
    def rules_hold(self) -> None:
        self.sim.check()
        assert not self.sim.problems, self.sim.problems

    def teardown(self) -> None:
        """Every live member runs to its end: nobody waits for ever, or past a bound."""
        sim = getattr(self, "sim", None)
        if sim is None:
            return
        for turn in range(DRAIN):
            if not sim.run(turn, False):
                break
        sim.check()
        if currently_in_test_context():  # hypothesis's statistics (not the seeded lane's)
            for what in sorted(sim.seen):
                event(what)
        stuck = [
            f"rank {m.rank} waits on {m.pending!r} at t={sim.now:.2f}"
            for m in sim.members
            if m.state == "running"
        ]
        assert not stuck and not sim.problems, [*sim.problems, *stuck]


Protocol.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None)
TestProtocol = Protocol.TestCase


def explore(seed: int, schedule: list[str], steps: int = 40) -> None:
    """One schedule drawn from ``seed`` (the same rules as :class:`Protocol`, without
    hypothesis's engine), its calls appended to ``schedule``. Raises where a rule breaks."""
    draw = random.Random(seed)
    machine = Protocol()
    size, meshes, total = draw.randint(2, 5), draw.choice([1, 2]), draw.randint(2, 4)
    twins, width = draw.random() < 0.5, draw.choice([1, 2])
    schedule.append(
        f"state.world(size={size}, meshes={meshes}, steps={total}, twins={twins}, width={width})"
    )
    machine.world(size, meshes, total, twins, width)
    for _ in range(steps):
        rule = draw.choices(["act", "act_several", "kill", "arm", "slow"], [4, 4, 1, 1, 1])[0]
        if rule == "act":
            args: dict[str, Any] = {"choice": draw.randint(0, 15), "cut_late": draw.random() < 0.5}
        elif rule == "act_several":
            args = {
                "choice": draw.randint(0, 15),
                "times": draw.randint(1, 8),
                "cut_late": draw.random() < 0.5,
            }
        elif rule == "kill":
            args = {"rank": draw.randint(0, 4)}
        elif rule == "arm":
            what = draw.choice([KEPT_RUNTIME, KEPT_VALUE, LEAVING_VALUE, BUG])
            args = {"rank": draw.randint(0, 4), "ahead": draw.randint(0, 2), "what": what}
        else:
            args = {"rank": draw.randint(0, 4), "seconds": draw.choice([0.05, 0.4, 3.0, 45.0])}
        schedule.append(f"state.{rule}({', '.join(f'{k}={v!r}' for k, v in args.items())})")
        getattr(machine, rule)(**args)
        machine.rules_hold()
    schedule.append("state.teardown()")
    machine.teardown()


@pytest.mark.fault
def test_12000_seeded_schedules() -> None:
    """The lane's exploration: 12,000 schedules, each from a seed (a failure names the seed
    and prints its schedule; ``explore(seed)`` replays it). Half of them on a mesh two ranks
    a slice, whose worlds are larger: 12,000 take about the time 20,000 flat ones took."""
    first = int(os.environ.get("SCOPEDMESH_SIM_SEED", "0"))
    for seed in range(first, first + 12_000):
        schedule: list[str] = []
        try:
            explore(seed, schedule)
        except Exception as error:
            raise AssertionError(f"seed {seed}: {error}\n" + "\n".join(schedule)) from error
