"""A deterministic simulation of the fault protocol: N members, one store, one clock.

Each member runs the documented ``watch.step`` loop on its mesh. Its step's
verdict is the library's own generator (:func:`scopedmesh.fault.protocol.verdict.verdict`,
with the agreement inside it), carried out by the library's own drivers
(:class:`~scopedmesh.fault.liveness.agreement.Driver`, :class:`~scopedmesh.fault.
liveness.agreement.StepDriver`) over the library's :class:`~scopedmesh.fault.
liveness.deaths.DeathRecord` and :class:`~scopedmesh.fault.protocol.verdict.Ledger`:
only the store, the clock, the collectives and the sockets are simulated.

Every member has two *threads*, each a generator of requests: its main thread
(the training loop) and its watch's store thread (woken through its wake key;
it reads the lists of deaths, stops and asks, and answers asks). A scheduler
picks which runnable thread carries out its next request: one store request
at a time, so every interleaving of the protocol's atomic writes is reachable.
A request that waits (a collective, the formation of a mesh's vote group at a
step's start, which every member of that mesh must reach, a sleep, a wait for
the abort) makes its
thread runnable only once what it waits for has happened or its time has come;
the clock moves only when no thread can run.

Faults: a member killed at any moment (its sockets close: its collectives fail
for every peer; its ring watcher declares it); an exception in a step (kept by
the loop, or leaving it: the member's watch closes as a departure); a bug that
raises on every attempt; slow compute; a collective that completes for some
members and is cut for the others (the doubt the vote exists for).

A mesh may be two-dimensional (``width`` ranks per slice of the axis it heals
along, as a (dp, tp) mesh healed along dp): a heal then drops every slice that
holds a lost rank, as ``reform`` does (the library's ``shrink``), and a member
that shared a dropped slice sits out of that mesh (``LostRankError``); with
twins it goes on stepping the other mesh, which is one rank a slice.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from scopedmesh.c10d.store import WatchKeys
from scopedmesh.fault.liveness.agreement import Driver, StepDriver, ledger_requests
from scopedmesh.fault.liveness.deaths import CLOSED, DeathRecord, departure
from scopedmesh.fault.protocol import agreement as agreeing
from scopedmesh.fault.protocol import verdict as rules
from scopedmesh.layout.mesh_layout import MeshLayout
from scopedmesh.layout.survivors import shrink

PREFIX = "sim"
LIMIT = 30.0  # the watch's timeout: every agreement's limit
DETECTION = 0.05  # seconds from a death (or a departure) to its watcher's declaration

# What a member's step raises, armed by the schedule.
KEPT_RUNTIME = "a RuntimeError the loop keeps"
KEPT_VALUE = "a ValueError the loop keeps"
LEAVING_VALUE = "a ValueError that leaves the loop"
BUG = "a RuntimeError on every attempt (a bug in the step)"


class SimStore:
    """A store with torch's semantics for what the protocol asks (append, add, compare_set,
    multi_get, multi_set, check, delete_key, set, get); setting a member's wake key wakes
    its store thread."""

    def __init__(self, sim: Simulation) -> None:
        self.sim, self.data = sim, {}  # type: Simulation, dict[str, bytes]

    def append(self, key: str, value: str) -> None:
        self.data[key] = self.data.get(key, b"") + value.encode()

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.sim.reading(key)
        current = self.data.get(key)
        if current is None:
            if expected == "":
                self.data[key] = desired.encode()
                self.sim.written(key)
                return desired.encode()
            return expected.encode()
        if current == expected.encode():
            self.data[key] = desired.encode()
            return desired.encode()
        return current

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()
        self.sim.woken(key)

    def multi_set(self, keys: list[str], values: list[str]) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data.get(key, b"") for key in keys]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


@dataclass
class View:
    """One member's handle on one incarnation of its mesh (as a guarded ProcessGroupMesh)."""

    name: str
    members: tuple[int, ...]
    generation: int
    since: tuple[str, int]
    aborted: bool = False
    seq: dict[str, int] = field(default_factory=dict)  # collectives issued, per group
    formed: bool = False  # its step's vote group (formed by every member, at a block's start)

    def abort(self, why: str) -> None:
        self.aborted = True


@dataclass
class Collective:
    """A collective of one incarnation: contributions, and whether a closed socket cut it."""

    members: tuple[int, ...]
    given: dict[int, int] = field(default_factory=dict)
    cut: bool = False  # cut before it completed: everyone waiting gets an error
    cut_late: set[int] = field(default_factory=set)  # completed, but these never read it

    @property
    def complete(self) -> bool:
        return not self.cut and len(self.given) == len(self.members)


# Requests of the simulation's own (the rest are the protocol's).
@dataclass(frozen=True)
class Collect:
    """Take part in the step's collective; answered with whether it completed here."""


@dataclass(frozen=True)
class Form:
    """Form the mesh's vote group (``Step.__enter__``): waits until every member of the
    incarnation arrived, or it is aborted; answered with whether it formed."""


@dataclass(frozen=True)
class Until:
    """Wait until simulated time ``at`` (slow compute)."""

    at: float


@dataclass
class Line:
    """One mesh a member steps on and the meshes re-formed from it (with twins, two over
    the same members, stepped by turns): its incarnation now, its layout (the heal axis
    first), its step (= the steps it committed), the steps it committed in order, where
    the member committed a step in doubt, the ranks that step lost (its re-forming waits
    for the next step), and whether the member sat out of it (a dropped slice)."""

    view: View
    layout: MeshLayout
    step: int = 0
    log: list[int] = field(default_factory=list)
    deferred: frozenset[int] | None = None
    out: bool = False


@dataclass
class Member:
    rank: int
    mesh: str
    record: DeathRecord
    lines: dict[str, Line]
    current: str = ""  # the line its main thread steps on now
    ledger: rules.Ledger = field(default_factory=rules.Ledger)
    lock: threading.Lock = field(default_factory=threading.Lock)
    members: dict[str, rules.Lineup] = field(default_factory=dict)
    tags: set[str] = field(default_factory=set)
    armed: dict[int, str] = field(default_factory=dict)  # step -> what it raises
    slow: float = 0.0  # compute time of its next step
    state: str = "running"  # running, done, dead, left, lost, failed
    error: BaseException | None = None
    news: bool = False  # its wake key was set
    heard: int = 0  # the record's count of news when its main thread last slept
    answers: list[tuple[str, int]] = field(default_factory=list)  # asks to answer
    declares: list[tuple[int, str]] = field(default_factory=list)  # deaths it saw on its ring
    main: Iterator[Any] | None = None
    pending: Any = None  # the main thread's request not carried out yet
    store_work: Iterator[Any] | None = None
    store_pending: Any = None
    members_now: tuple[int, ...] = ()  # the members its main thread's agreement is among
    closing: bool = False  # its main thread closes the watch (it answers, as the store's)
    stops: set[tuple[int, str, int]] = field(default_factory=set)  # the stops it learned
    deadline: float = 0.0  # when its wait for the abort ends

    @property
    def line(self) -> Line:
        return self.lines[self.current]

    @property
    def view(self) -> View:
        """The incarnation of the mesh its main thread steps on now."""
        return self.line.view

    @view.setter
    def view(self, view: View) -> None:
        self.line.view = view

    @property
    def step(self) -> int:
        return self.line.step

    @property
    def log(self) -> list[int]:
        return self.line.log

    def views(self) -> list[View]:
        """Every mesh it holds now (the watch guards them all)."""
        return [line.view for line in self.lines.values()]


class Simulation:
    """``size`` members under one watch, on ``meshes`` disjoint meshes, ``steps`` steps each;
    with ``twins``, every member steps on two meshes over the same members, by turns (two
    models on the same ranks: each mesh its own line of keys, :func:`~scopedmesh.fault.
    protocol.agreement.line_key`). ``width``: ranks per slice of the heal axis of each
    mesh (a twin's is 1), where the mesh's members make two slices or more."""

    def __init__(
        self, size: int, meshes: int, steps: int, twins: bool = False, width: int = 1
    ) -> None:
        self.now, self.steps = 0.0, steps
        self.store = SimStore(self)
        self.keys = WatchKeys(PREFIX)
        for listed in (self.keys.lost, self.keys.stops, self.keys.asks):
            self.store.append(listed, "")
        cut = size // 2 if meshes == 2 else size
        groups = (
            [tuple(range(cut)), tuple(range(cut, size))] if meshes == 2 else [tuple(range(size))]
        )
        self.collectives: dict[tuple[str, int, str, int], Collective] = {}
        self.arrived: dict[tuple[str, int], set[int]] = {}  # incarnation -> who came to form
        self.decisions: dict[str, tuple[int, ...]] = {}  # decision key -> its members
        self.verdicts: dict[tuple[str, int, int], dict[int, tuple[bool, frozenset[int]]]] = {}
        self.problems: list[str] = []
        self.reader: tuple[Member, str] | None = None  # whose request is carried out now
        self.cut_late = False
        self.seen: set[str] = set()  # what the run went through (hypothesis's statistics)
        self.shut: set[tuple[str, int, int]] = set()  # (mesh, generation, rank): groups shut
        self.closed: set[int] = set()  # ranks whose sockets all closed
        self.sets: dict[str, tuple[int, ...]] = {}  # members_key -> the members, as made
        self.members: list[Member] = []
        for index, group in enumerate(groups):
            first = agreeing.members_key(group)
            wide = width > 1 and len(group) % width == 0 and len(group) >= 2 * width
            if wide:
                self.seen.add(f"a mesh {width} ranks a slice")
            layouts = [
                MeshLayout((len(group) // width, width), ("dp", "tp"), group)
                if wide
                else MeshLayout((len(group),), ("dp",), group)
            ]
            lines = [(f"mesh{index}", first)]  # (name, line): its key, as the watch makes it
            if twins:
                lines.append((f"mesh{index}+", f"{first}#1"))
                layouts.append(MeshLayout((len(group),), ("dp",), group))
            for rank in group:
                made = {
                    name: Line(View(name, group, 0, (agreeing.line_key(group, line), 0)), layout)
                    for (name, line), layout in zip(lines, layouts)
                }
                for _, line in lines:
                    self.sets[agreeing.line_key(group, line)] = group
                member = Member(rank, f"mesh{index}", None, made, lines[0][0])  # type: ignore[arg-type]
                member.record = DeathRecord(
                    self.keys,
                    rank,
                    lambda new, m=member: self._on_deaths(m, new),
                    lambda stops, m=member: self._on_stops(m, stops),
                    tuple(range(size)),
                    on_ask=lambda asks, m=member: m.answers.extend(asks),
                )
                for (_, line), layout in zip(lines, layouts):
                    key = agreeing.line_key(group, line)
                    member.members[key] = rules.Lineup(layout)  # as watch.step notes it
                    member.ledger.committed[key] = 0
                self.members.append(member)
        for member in self.members:
            member.main = self._main(member)

    # ------------------------------------------------------------------ the store's side

    def woken(self, key: str) -> None:
        """A wake key was set: its member's store thread has news."""
        prefix = f"{PREFIX}/wake/"
        if key.startswith(prefix):
            self.members[int(key.removeprefix(prefix))].news = True

    def written(self, key: str) -> None:
        """A decision was written: note whose members it was made for."""
        if key.endswith("/decision") and self.reader is not None:
            made_for = self._reader_members() or self.sets.get(key.split("/")[2])
            if made_for is not None:
                self.decisions[key] = made_for

    def reading(self, key: str) -> None:
        """A decision is read (or proposed): it must have been made for the reader's members."""
        made_for = self.decisions.get(key)
        if made_for is None or self.reader is None:
            return
        members, rank = self._reader_members(), self.reader[0].rank
        if (members is not None and made_for != members) or rank not in made_for:
            self.problems.append(
                f"rank {rank} (members {members}) read the decision {key!r} made for members "
                f"{list(made_for)}"
            )

    def _reader_members(self) -> tuple[int, ...] | None:
        """The members the request carried out now is made among (None: an answer, which
        reads the decisions of every set of members this rank was among)."""
        if self.reader is None:
            return None
        m, thread = self.reader
        return m.members_now if thread == "main" and not m.closing else None

    # ------------------------------------------------------------------ the watch's side

    def _on_deaths(self, member: Member, new: set[int]) -> None:
        for view in member.views():
            if set(new).intersection(view.members):
                self._abort(member, view)

    def _on_stops(self, member: Member, stops: set[tuple[int, str, int]]) -> None:
        member.stops |= stops  # the guard keeps them: a mesh guarded later checks them too
        for view in member.views():
            key, since = view.since
            if rules.stopped(stops, key, since).intersection(view.members):
                self._abort(member, view)

    def _settled(self, member: Member, chain: tuple[tuple[str, int], ...]) -> None:
        """``LivenessWatch._on_fence``: this rank's meshes of those members are aborted."""
        self.seen.add("an answer" + (" that caught up through decisions" if len(chain) > 1 else ""))
        for view in member.views():
            if view.since[0] in {key for key, _ in chain}:
                self._abort(member, view)

    def _store_thread(self, member: Member) -> Generator[Any, Any, None]:
        """One wake-up of ``member``'s store thread: read the lists (the record takes them),
        then answer each new ask, as ``LivenessWatch._answer`` does."""
        member.news = False
        deaths, stops, asks = self.store.multi_get(
            [self.keys.lost, self.keys.stops, self.keys.asks]
        )
        member.record.take(deaths.decode(), stops.decode(), asks.decode())
        yield None  # the read is one request
        while member.answers:
            key, attempt = member.answers.pop(0)
            if agreeing.holds(key, member.rank) is not False:  # as LivenessWatch._on_asks
                yield from self._answer(member, key, attempt)

    def _answer(self, member: Member, key: str, attempt: int) -> Generator[Any, Any, None]:
        """``LivenessWatch._answer``: the library's generator, its ledger requests carried
        out by the library's driver."""
        yield from rules.answer_ask(rank=member.rank, prefix=PREFIX, key=key, attempt=attempt)

    # ------------------------------------------------------------------ a member's loop

    def _main(self, m: Member) -> Generator[Any, Any, None]:
        """The documented loop: ``with watch.step(mesh, axis) as step: ...``, redo until it
        commits (with twins, one attempt on each mesh by turns); a step whose error leaves
        the loop closes the watch as a departure."""
        while any(line.step < self.steps and not line.out for line in m.lines.values()):
            for name, line in m.lines.items():
                if line.step >= self.steps or line.out:
                    continue
                m.current = name
                if (yield from self._attempt(m)):
                    return
        yield from self._close(m, None)
        m.state = "done"

    def _attempt(self, m: Member) -> Generator[Any, Any, bool]:
        """One attempt of ``m``'s step on its current mesh; True where ``m`` left the loop."""
        view, line = m.view, m.line
        if not view.formed:  # the vote's group forms at the block's start, by every member
            view.formed = yield Form()
        can_vote = view.formed and not view.aborted
        if m.slow:
            yield Until(self.now + m.slow)
            m.slow = 0.0
        plan = m.armed.get(m.step)
        raised = rules.NONE
        if plan is not None:
            raised = rules.OTHER if "ValueError" in plan else rules.RUNTIME
            if plan != BUG:
                del m.armed[m.step]
        elif not (yield Collect()):
            raised = rules.RUNTIME  # a collective's error: a peer died or stopped
        key = view.since[0]  # its line's key (line_key), as the watch guarded it
        vote_at = (view.name, view.generation, view.seq.get("vote", 0))
        if line.deferred is not None:  # Step: it committed the last step in doubt
            self.seen.add("a step failed after one committed in doubt")
            verdict = rules.Verdict(False, line.deferred, True, raise_own=raised == rules.OTHER)
            line.deferred = None
        else:
            with m.lock:
                attempt, mine = m.ledger.attempt(key), m.ledger.committed.get(key, 0)
            name = agreeing.agreement_name(key, f"event{attempt}")
            m.members_now = view.members
            m.heard = m.record.heard  # the driver's count of news, before its first request
            steps = rules.verdict(
                rank=m.rank,
                members=list(view.members),
                keys=agreeing.Keys(f"{PREFIX}/agree/{name}"),
                attempt=attempt,
                mine=mine,
                raised=raised,
                can_vote=can_vote,
                limit=LIMIT,
                tag=name,
            )
            try:
                verdict = yield from steps
            except TimeoutError as error:
                m.state, m.error = "failed", error
                self._check_timeout(m, error)
                return True
        self.verdicts.setdefault(vote_at, {})[m.rank] = (verdict.committed, verdict.lost)
        if verdict.committed and raised != rules.NONE:  # its flag failed the vote
            self.problems.append(f"rank {m.rank} committed step {m.step}, which raised there")
        if verdict.agreed:
            self.seen.add("an agreement" + (" that lost a member" if verdict.lost else ""))
            if raised == rules.NONE and not verdict.committed:
                self.seen.add("a member in doubt failed the step")
            if raised == rules.NONE and verdict.committed:
                self.seen.add("a member in doubt committed the step")
        if verdict.error is not None:
            self.seen.add("StepError after a departure")
        if verdict.committed:
            line.log.append(line.step)
            line.step += 1
        if verdict.error is not None:  # StepError, before any re-forming: it leaves
            yield from self._close(m, RuntimeError(verdict.error))
            m.state = "left"
            return True
        if m.rank in verdict.lost:  # LostRankError leaves the loop, and the watch
            yield from self._close(m, RuntimeError("LostRankError"))
            m.state = "lost"
            return True
        if verdict.agreed and not verdict.reforms:  # re-formed after the next step (Step)
            self._abort(m)
            line.deferred = verdict.lost
        if verdict.reforms:  # reform: shrink drops every slice that holds a lost rank
            hit = sorted(set(verdict.lost).intersection(view.members))
            try:
                layout = shrink(line.layout, hit, 0) if hit else line.layout
            except ValueError as every_slice:  # reform raises it: it leaves the loop
                self.seen.add("a heal that lost every slice")
                yield from self._close(m, every_slice)
                m.state = "left"
                return True
            if m.rank not in layout:  # LostRankError: the old mesh is closed; it sits out
                self.seen.add("a member sat out of a re-formed mesh")
                self._leave_view(m)
                line.out = True
                return False
            line.layout = layout
            survivors = tuple(sorted(layout.ranks))
            new_key = agreeing.line_key(survivors, agreeing.line_of(key))
            with m.lock:  # the ledger moved at Agreed (the library's StepDriver)
                since = (new_key, m.ledger.attempt(new_key))
            self._leave_view(m)  # the old mesh is closed: its sockets too
            m.view = View(view.name, survivors, view.generation + 1, since)
            self.sets[new_key] = survivors
            stopped = rules.stopped(m.stops, new_key, since[1]).intersection(survivors)
            if m.record.lost.intersection(survivors) or since in m.ledger.answered or stopped:
                m.view.abort("guarded with a lost rank, or settled without this rank")
        if verdict.raise_own and plan in (LEAVING_VALUE, BUG):
            error = ValueError(plan) if plan == LEAVING_VALUE else RuntimeError(plan)
            yield from self._close(m, error)
            m.state = "left"
            return True
        return False

    def _close(self, m: Member, error: BaseException | None) -> Generator[Any, Any, None]:
        """``LivenessWatch.close``: answer the next agreement on each set of members, then,
        after an error, leave (listed gone, members woken); the sockets close."""
        with m.lock:
            next_attempts = [(key, at) for key, _, at, _ in m.ledger.steps(m.members)]
        m.closing = True
        for key, attempt in next_attempts:
            yield from self._answer(m, key, attempt)
        if error is not None:
            m.record.depart(self.store, departure(error))
        self._sockets_close(m)
        self._hand_over(m)

    def _leave_view(self, m: Member) -> None:
        self.shut.add((m.view.name, m.view.generation, m.rank))
        for at, collective in self.collectives.items():
            same = at[:2] == (m.view.name, m.view.generation)
            if same and m.rank in collective.members and not collective.complete:
                collective.cut = True

    def _sockets_close(self, m: Member) -> None:
        self.closed.add(m.rank)
        for collective in self.collectives.values():
            if m.rank in collective.members and not collective.complete:
                collective.cut = True

    # ------------------------------------------------------------------ faults

    def kill(self, rank: int) -> None:
        """SIGKILL: the member stops at once; its sockets close; its ring watcher (the next
        member alive) declares it after :data:`DETECTION`."""
        m = self.members[rank]
        if m.state != "running":
            return
        m.state = "dead"
        self.seen.add("a kill")
        self._sockets_close(m)
        m.declares.append((rank, CLOSED))
        self._hand_over(m)

    def _hand_over(self, m: Member) -> None:
        """``m``'s sockets closed (killed, or its watch closed): its ring neighbours see it
        (a death is declared; a goodbye is not, but their ring relinks past it and finds
        the deaths it had yet to declare, a refused connect)."""
        declares, m.declares = m.declares, []
        watcher = self._watcher_of(m.rank)
        if watcher is not None and declares:
            watcher.declares += declares

    def _watcher_of(self, rank: int) -> Member | None:
        alive = [m for m in self.members if m.state == "running" and m.rank != rank]
        after = [m for m in alive if m.rank > rank] or alive
        return after[0] if after else None

    # ------------------------------------------------------------------ the scheduler

    def runnable(self) -> list[tuple[Member, str]]:
        """The threads that can carry out their next request now."""
        found = []
        for m in self.members:
            if m.state == "dead":
                continue
            if m.state == "running" and self._ready(m, m.pending):
                found.append((m, "main"))
            if m.state == "running" and (m.store_work or m.news or m.answers or m.declares):
                found.append((m, "store"))
            elif m.store_work is not None:  # a closing watch joins its store thread: it
                found.append((m, "store"))  # finishes what it was doing, then stops
        return found

    def _ready(self, m: Member, request: Any) -> bool:
        if request is None:
            return True
        if isinstance(request, Collect | rules.Vote):
            collective = self._collective(m, request, peek=True)
            return (
                collective is None
                or collective.complete
                or collective.cut
                or m.view.aborted
                or m.rank in collective.cut_late
            )
        if isinstance(request, rules.AwaitAbort):
            return m.view.aborted or self.now >= m.deadline
        if isinstance(request, Form):
            return m.view.aborted or self._all_arrived(m.view)
        if isinstance(request, agreeing.Sleep):
            return m.record.heard != m.heard or self.now >= request.until
        if isinstance(request, Until):
            return self.now >= request.at
        return True

    def timers(self) -> list[float]:
        """When a waiting thread's time comes (the clock jumps to the earliest)."""
        found = []
        for m in self.members:
            if m.state != "running":
                continue
            request = m.pending
            if isinstance(request, rules.AwaitAbort):
                found.append(m.deadline)
            elif isinstance(request, agreeing.Sleep):
                found.append(request.until)
            elif isinstance(request, Until):
                found.append(request.at)
        return [t for t in found if t > self.now]

    def tick(self) -> bool:
        """Move the clock to the next timer; whether there was one."""
        later = self.timers()
        if not later:
            return False
        self.now = min(later)
        return True

    def run(self, choice: int, cut_late: bool) -> bool:
        """Carry out one request of the ``choice``-th runnable thread (the clock moves when
        none can run); ``cut_late``: an abort now cuts completed collectives for those that
        have not read them. Whether anything happened."""
        found = self.runnable()
        if not found:
            return self.tick()
        m, thread = found[choice % len(found)]
        self.cut_late = cut_late
        self.reader = (m, thread)
        try:
            if thread == "main":
                self._step_main(m)
            else:
                self._step_store(m)
        finally:
            self.reader = None
        return True

    def _step_store(self, m: Member) -> None:
        if m.declares:  # its ring saw a peer's socket close: declare (one request each)
            rank, reason = m.declares.pop(0)
            m.record.declare(self.store, rank, reason)
            return
        if m.store_work is None:
            m.store_work, m.store_pending = self._store_thread(m), None
        try:
            request = m.store_work.send(self._answer_of(m, m.store_pending, store=True))
            m.store_pending = request
        except StopIteration:
            m.store_work = None

    def _step_main(self, m: Member) -> None:
        assert m.main is not None
        answer = self._answer_of(m, m.pending, store=False)
        try:
            m.pending = m.main.send(answer)
        except StopIteration:
            m.main, m.pending = None, None
            return
        if isinstance(m.pending, rules.AwaitAbort):
            m.deadline = self.now + m.pending.seconds
        if isinstance(m.pending, Form):
            self.arrived.setdefault((m.view.name, m.view.generation), set()).add(m.rank)
        if isinstance(m.pending, Collect | rules.Vote):
            self._contribute(m, m.pending)

    def _answer_of(self, m: Member, request: Any, *, store: bool) -> Any:
        """Carry out ``request`` for ``m``: the simulation's own, the clock, the waits; the
        rest by the library's drivers."""
        if request is None:
            return None
        if isinstance(request, Collect | rules.Vote):
            return self._collected(m, request)
        if isinstance(request, Until):
            return None
        if isinstance(request, Form):
            return not m.view.aborted and self._all_arrived(m.view)
        if isinstance(request, agreeing.Now):
            return self.now
        if isinstance(request, agreeing.Sleep):
            woken = m.record.heard != m.heard
            m.heard = m.record.heard
            return woken
        if isinstance(request, agreeing.KnownGone):
            return m.record.lost
        if isinstance(request, rules.AwaitAbort):
            return m.view.aborted
        if isinstance(request, rules.AbortMesh):
            self._abort(m)
            return None
        if isinstance(request, rules.Steps | rules.Fence):

            def settled(chain: tuple[tuple[str, int], ...]) -> None:
                if not m.closing:  # a closing watch leaves the caller's meshes alone
                    self._settled(m, chain)

            return ledger_requests(m.ledger, m.lock, m.members, settled)(request)
        step = StepDriver(
            self.store,
            m.record,
            m.ledger,
            m.lock,
            m.view,
            rules.Lineup(m.line.layout),
            key=m.view.since[0],
            vote=lambda flag: None,
            note=lambda: None,
            stepped=m.members,
        )
        return Driver(self.store, m.record, step).do(request)

    # ------------------------------------------------------------------ collectives

    def _collective(self, m: Member, request: Any, *, peek: bool = False) -> Collective | None:
        view, kind = m.view, "vote" if isinstance(request, rules.Vote) else "train"
        at = (view.name, view.generation, kind, view.seq.get(kind, 0) - (1 if peek else 0))
        if at not in self.collectives:
            if peek:
                return None
            self.collectives[at] = Collective(view.members)
        return self.collectives[at]

    def _all_arrived(self, view: View) -> bool:
        """Whether every member of ``view``'s incarnation has come to form its vote group."""
        return set(view.members) <= self.arrived.get((view.name, view.generation), set())

    def _contribute(self, m: Member, request: Any) -> None:
        view = m.view
        collective = self._collective(m, request)
        assert collective is not None
        gone = [
            r
            for r in view.members
            if r in self.closed or (view.name, view.generation, r) in self.shut
        ]
        if gone and not collective.complete:  # a peer's groups are shut: a connect fails
            collective.cut = True
        kind = "vote" if isinstance(request, rules.Vote) else "train"
        view.seq[kind] = view.seq.get(kind, 0) + 1
        assert collective is not None
        if view.aborted and self.cut_late:  # its groups shut already: its peers fail
            if not collective.complete:
                collective.cut = True
            return
        # (An aborted mesh's groups shut as the watch settles them: a contribution made
        # before that still reaches the peers.)
        collective.given[m.rank] = request.flag if isinstance(request, rules.Vote) else 0

    def _collected(self, m: Member, request: Any) -> Any:
        collective = self._collective(m, request, peek=True)
        done = (
            collective is not None
            and collective.complete
            and m.rank in collective.given
            and m.rank not in collective.cut_late
        )
        if isinstance(request, Collect):
            return done
        return max(collective.given.values()) if done and collective else None

    def _abort(self, m: Member, view: View | None = None) -> None:
        """``mesh.abort`` of ``view`` (default: the one ``m`` steps on): its groups shut; a
        collective not complete fails for every member (its sockets close); one complete
        but unread here may be lost too (``cut_late``)."""
        view = m.view if view is None else view
        view.abort("abort")
        self.shut.add((view.name, view.generation, m.rank))
        for at, collective in self.collectives.items():
            if at[:2] != (view.name, view.generation) or m.rank not in collective.members:
                continue
            if not collective.complete:
                collective.cut = True
            elif self.cut_late:
                collective.cut_late.add(m.rank)

    # ------------------------------------------------------------------ checks

    def _check_timeout(self, m: Member, error: TimeoutError) -> None:
        gone = {r.rank for r in self.members if r.state in ("dead", "left", "lost")}
        self.problems.append(
            f"rank {m.rank} timed out at t={self.now:.2f} (gone: {sorted(gone)}): {error}"
        )

    def check(self) -> None:
        """The rules that hold after every event."""
        dead = {m.rank for m in self.members if m.state == "dead"}
        for at, said in self.verdicts.items():  # a member killed after it decided is gone
            alive = {rank: verdict for rank, verdict in said.items() if rank not in dead}
            if len({committed for committed, _ in alive.values()}) > 1:
                self.problems.append(f"vote {at}: members decided differently: {alive}")
            agreed = {lost for committed, lost in alive.values() if lost}
            if len(agreed) > 1:
                self.problems.append(f"vote {at}: members agreed on different losses: {alive}")
        for m in self.members:
            for name, line in m.lines.items():
                if line.log != list(range(len(line.log))):
                    self.problems.append(f"rank {m.rank} committed steps {line.log} on {name}")
        by_mesh: dict[str, list[Member]] = {}
        for m in self.members:
            if m.state == "done":
                if not any(line.out for line in m.lines.values()):  # sat out of none
                    by_mesh.setdefault(m.mesh, []).append(m)
                logged = sum(len(line.log) for line in m.lines.values())
                if m.ledger.total() != logged:  # the watch's count: every mesh's apart
                    self.problems.append(
                        f"rank {m.rank} committed {logged} steps; its watch counts "
                        f"{m.ledger.total()} ({m.ledger.committed})"
                    )
        for mesh, finished in by_mesh.items():
            totals = {m.rank: m.ledger.total() for m in finished}
            if len(set(totals.values())) > 1:
                self.problems.append(f"{mesh}: the finished members' counts differ: {totals}")
