"""A replicated job's timeline as a picture: a death, the heal, the restart, the join,
the admission and the catch-up, step by step (standard library only).

    python -m scopedmesh.launch.timeline docs/replicas-timeline.svg

:func:`job_timeline` lays out which replica trains which step, from a
:class:`Schedule` (who dies when, how long its restart takes) and the rules of
:class:`~scopedmesh.fault.replicas.Replicas`: the step a replica dies in fails
everywhere and is redone by the survivors in a new epoch (the heal); the
restarted replica announces itself (the join) and is admitted at the next step
boundary (the admission); it receives the state of a live replica inside the
admission's first step, before that step's all-reduce (the catch-up), and
contributes from the step after. :func:`render_timeline` draws it. Every step
is a ``<g class="step" data-replica=... data-step=... data-kind=...>``, so tests
can read the facts back.

>>> cells = job_timeline(Schedule())
>>> sorted({c.kind for c in cells})
['catch-up', 'failed', 'full', 'reduced']
>>> render_timeline(Schedule()).startswith("<svg")
True
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

__all__ = ["Cell", "Schedule", "job_timeline", "main", "render_timeline"]

KIND_FILLS = {
    "full": "#98df8a",  # a step every replica contributed to
    "reduced": "#ffbb78",  # a step the survivors took without the dead replica
    "failed": "#ff9896",  # a step a death failed everywhere: redone
    "catch-up": "#aec7e8",  # the joiner's first step: it receives the state, adds nothing
}
FONT = "font-family:DejaVu Sans Mono,Menlo,Consolas,monospace"
STEP_W, ROW_H, LEFT, TOP = 46, 34, 92, 64


@dataclass(frozen=True)
class Schedule:
    """Who dies when: ``victim`` dies during step ``death_step`` (counted in attempts,
    from 0); its restart (a new interpreter, ``import torch``, its world) takes
    ``restart_steps`` steps of the survivors; the job runs ``attempts`` attempts."""

    replicas: int = 3
    victim: int = 1
    death_step: int = 3
    restart_steps: int = 2
    attempts: int = 10

    def __post_init__(self) -> None:
        for name in ("replicas", "victim", "death_step", "restart_steps", "attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.replicas < 2 or not 0 <= self.victim < self.replicas:
            raise ValueError(
                f"need replicas >= 2 and victim in 0..replicas-1, got {self.replicas}, {self.victim}"
            )
        if self.restart_steps < 1:  # the survivors heal before any restart can join
            raise ValueError(f"restart_steps must be >= 1, got {self.restart_steps}")
        if self.death_step + self.restart_steps + 3 > self.attempts:
            raise ValueError(f"attempts {self.attempts} end before the job is whole again")


@dataclass(frozen=True)
class Cell:
    """One replica's part in one attempt of a step: ``step`` is the step's number (a
    failed attempt and its redo share it), ``attempt`` its place on the time axis."""

    replica: int
    attempt: int
    step: int
    kind: str  # one of KIND_FILLS
    epoch: int


def job_timeline(schedule: Schedule) -> list[Cell]:
    """The cells of every attempt, by the rules of the module's text."""
    s = schedule
    joined = s.death_step + 1 + s.restart_steps  # the attempt at whose start it is admitted
    cells = []
    step = 0
    for attempt in range(s.attempts):
        epoch = 0 if attempt <= s.death_step else 1 if attempt < joined else 2
        for replica in range(s.replicas):
            if attempt == s.death_step:
                kind = "failed"
            elif attempt < s.death_step or attempt > joined:
                kind = "full"
            elif replica != s.victim:  # the joiner adds nothing to its catch-up step
                kind = "reduced"
            elif attempt == joined:
                kind = "catch-up"
            else:
                continue  # dead, restarting
            cells.append(Cell(replica, attempt, step, kind, epoch))
        if attempt != s.death_step:
            step += 1
    return cells


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = 12) -> str:
    return (
        f'<text x="{x:g}" y="{y:g}" font-size="{size}" text-anchor="{anchor}" '
        f'style="{FONT}">{escape(text)}</text>'
    )


def render_timeline(schedule: Schedule) -> str:
    """The timeline of ``schedule`` as an SVG document."""
    s = schedule
    cells = job_timeline(s)
    joined = s.death_step + 1 + s.restart_steps
    width = LEFT + STEP_W * s.attempts + 240
    height = TOP + ROW_H * s.replicas + 150
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        _text(12, 22, f"{s.replicas} replicas; replica {s.victim} is SIGKILLed during step "
              f"{s.death_step}, restarts, rejoins", size=14),
    ]  # fmt: skip
    for attempt in range(s.attempts):
        x = LEFT + attempt * STEP_W
        steps = {c.step for c in cells if c.attempt == attempt}
        out.append(_text(x + STEP_W / 2, TOP - 10, f"{steps.pop()}", "middle"))
    out.append(_text(LEFT - 8, TOP - 10, "step", "end"))
    for replica in range(s.replicas):
        out.append(_text(LEFT - 8, TOP + replica * ROW_H + 21, f"replica {replica}", "end"))
    for c in cells:
        x, y = LEFT + c.attempt * STEP_W + 2, TOP + c.replica * ROW_H + 4
        out.append(
            f'<g class="step" data-replica="{c.replica}" data-step="{c.step}" '
            f'data-attempt="{c.attempt}" data-kind={quoteattr(c.kind)} data-epoch="{c.epoch}">'
            f'<rect x="{x}" y="{y}" width="{STEP_W - 4}" height="{ROW_H - 8}" rx="3" '
            f'fill="{KIND_FILLS[c.kind]}" stroke="#555"/></g>'
        )
    rows_end = TOP + s.replicas * ROW_H
    victim_y = TOP + s.victim * ROW_H + ROW_H / 2
    dead_x = LEFT + (s.death_step + 0.5) * STEP_W
    back_x = LEFT + joined * STEP_W
    out.append(
        f'<line x1="{dead_x:g}" y1="{victim_y:g}" x2="{back_x - 4:g}" y2="{victim_y:g}" '
        'stroke="#888" stroke-dasharray="4 3"/>'
    )
    out.append(_text((dead_x + back_x) / 2, victim_y - 4, "restarting", "middle", 11))
    marks: list[tuple[float, str]] = [
        (dead_x, "1 SIGKILL: the step fails everywhere"),
        (LEFT + (s.death_step + 1) * STEP_W, "2 heal: the survivors redo it in epoch 1"),
        (back_x - STEP_W / 2, "3 join: the restarted replica announces itself"),
        (back_x, "4 admission at the step boundary: epoch 2"),
        (back_x + STEP_W / 2, "5 catch-up: a live replica's state, inside the step"),
        (back_x + STEP_W, "6 every replica contributes again"),
    ]
    for i, (mark_x, label) in enumerate(marks):
        label_y = rows_end + 18 + i * 17
        out.append(
            f'<line x1="{mark_x:g}" y1="{TOP - 4}" x2="{mark_x:g}" y2="{label_y - 4:g}" '
            'stroke="#1f77b4" stroke-width="1" stroke-dasharray="2 2"/>'
        )
        out.append(_text(mark_x + 4, label_y, label, size=11))
    legend_x = LEFT + s.attempts * STEP_W + 20
    for i, (kind, fill) in enumerate(KIND_FILLS.items()):
        y = TOP + i * 22
        out.append(
            f'<rect x="{legend_x}" y="{y}" width="16" height="14" fill="{fill}" stroke="#555"/>'
        )
        out.append(_text(legend_x + 22, y + 12, _LEGEND[kind], size=11))
    out.append("</svg>")
    return "\n".join(out) + "\n"


_LEGEND = {
    "full": "every replica contributes",
    "reduced": "the survivors alone",
    "failed": "failed everywhere, redone",
    "catch-up": "joiner: receives the state",
}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m scopedmesh.launch.timeline [FILE]``: write the default timeline to FILE
    (stdout without one); exit status 0, or 2 when FILE cannot be written."""
    args = list(sys.argv[1:] if argv is None else argv)
    picture = render_timeline(Schedule())
    if not args:
        sys.stdout.write(picture)
        return 0
    try:
        with open(args[0], "w", encoding="utf-8") as file:
            file.write(picture)
    except OSError as error:
        print(f"scopedmesh.launch.timeline: error: {args[0]}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # not when pytest --doctest-modules imports this file
    raise SystemExit(main())
