"""``scopedmesh plan ... --svg FILE``: the plan as a picture (standard library only).

The picture shows what the text view shows: one grid of ranks per leading
coordinate (rows = the second-to-last axis, columns = the last), summarised the
same way above 64 ranks (the first two grids and the last; three rows, …, one;
three columns, …, two). With ``--nproc-per-node`` each rank's cell is coloured
by its node; with ``--rank`` that rank's cell is framed and each of its groups
is outlined in its axis's colour. A legend names the colours. Every rank cell
is a ``<g class="rank" data-rank=... data-node=... data-in=...>`` so tools and
tests can read the facts back.

>>> from scopedmesh.plan.facts import make_plan
>>> svg = render_svg(make_plan((2, 2, 2), names=("dp", "pp", "tp"), nproc=4, rank=5))
>>> svg.startswith("<svg") and svg.count('class="rank"')
8
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from scopedmesh.layout.mesh_layout import MeshLayout
from scopedmesh.plan.facts import Plan
from scopedmesh.plan.text import ELLIPSIS, group_text, positions

__all__ = ["NODE_COLOURS", "render_svg"]

# Ten light fills for nodes (node k gets NODE_COLOURS[k % 10]), dark text stays readable.
NODE_COLOURS = (
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
    "#d9d9d9",
)
PLAIN = "#e8eef7"  # cells without --nproc-per-node
AXIS_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")
FONT = "font-family:DejaVu Sans Mono,Menlo,Consolas,monospace"
CHAR = 7.6  # width of a character at 12 px
ROW_H = 30
HEAD_H = 18
MAX_WIDTH = 1160  # panels wrap to the next line past this width
GAP = 22
MARGIN = 20


@dataclass(frozen=True)
class _Panel:
    lead: tuple[int, ...] | None  # None: the "… more grids …" placeholder
    width: float
    height: float


def _text(
    x: float, y: float, text: str, *, size: int = 12, anchor: str = "start", **style: str
) -> str:
    extra = "".join(f" {k.replace('_', '-')}={quoteattr(v)}" for k, v in style.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{escape(text)}</text>"
    )


def render_svg(plan: Plan) -> str:
    """The SVG document for ``plan`` (see the module docstring)."""
    layout, labels, ndim = plan.layout, plan.labels, plan.layout.ndim
    lead_shape = layout.shape[:-2]
    cols = positions(layout.shape[-1], plan.full, 16, 3, 2)
    rows: list[int | None] = (
        [None] if ndim == 1 else positions(layout.shape[-2], plan.full, 8, 3, 1)
    )
    count = math.prod(lead_shape)
    shown = positions(count, plan.full, 4, 2, 1)
    digits = max(len(str(layout.size - 1)), len(str(layout.shape[-1] - 1)))
    cw = max(30.0, CHAR * digits + 14)
    corner = labels[-1] if ndim == 1 else f"{labels[-2]} \\ {labels[-1]}"
    row_labels = ["rank"] if ndim == 1 else [ELLIPSIS if r is None else str(r) for r in rows]
    lw = CHAR * max(len(corner), *map(len, row_labels)) + 12
    grid_w = lw + cw * len(cols)
    title_h = 20 if lead_shape else 0
    grid_h = title_h + HEAD_H + ROW_H * len(rows)
    panels: list[_Panel] = []
    for k in shown:
        lead = None if k is None else MeshLayout(lead_shape).unravel(k) if lead_shape else ()
        width = CHAR * 30 if lead is None else grid_w
        panels.append(_Panel(lead, width, grid_h))

    member_of = _member_test(plan)
    heading = _heading(plan)
    body, y = _heading_svg(heading)

    # Panels, in rows that wrap at MAX_WIDTH.
    x, line_h, right = float(MARGIN), 0.0, float(MARGIN)
    for panel in panels:
        if x > MARGIN and x + panel.width > MAX_WIDTH:
            x, y, line_h = float(MARGIN), y + line_h + GAP, 0.0
        if panel.lead is None:
            more = f"{ELLIPSIS} {count - 3} more grids {ELLIPSIS}"
            body.append(
                _text(
                    x + panel.width / 2, y + grid_h / 2, more, size=13, anchor="middle", fill="#666"
                )
            )
        else:
            body += _panel_svg(
                plan, panel.lead, rows, cols, x, y, cw, lw, title_h, corner, row_labels, member_of
            )
        x += panel.width + GAP
        right = max(right, x - GAP)
        line_h = max(line_h, panel.height)
    y += line_h + GAP
    legend, y, legend_w = _legend(plan, y)
    body += legend
    text_w = max([9.8 * len(heading[0]), *(8.2 * len(line) for line in heading[1:])])
    width = max(right, MARGIN + text_w, legend_w) + MARGIN
    height = y + MARGIN
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" style="{FONT}">\n'
        f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n"
    )


def _member_test(plan: Plan) -> Callable[[Sequence[int]], list[int]]:
    """A test for the ``--rank`` groups: the indices of those that hold the rank at a coordinate."""
    rank_coord = plan.rank.coordinate if plan.rank is not None else None
    group_axes = [g.axis.axes for g in plan.rank.groups] if plan.rank is not None else []

    def member_of(coord: Sequence[int]) -> list[int]:
        if rank_coord is None:
            return []
        return [
            i
            for i, axes in enumerate(group_axes)
            if all(c == rc for a, (c, rc) in enumerate(zip(coord, rank_coord)) if a not in axes)
        ]

    return member_of


def _heading(plan: Plan) -> list[str]:
    """The lines above the grids: the mesh and its rank formula, nodes, summarising."""
    layout, labels = plan.layout, plan.labels
    sizes = " x ".join(f"{label}={n}" for label, n in zip(labels, layout.shape))
    terms = [label if s == 1 else f"{s}*{label}" for label, s in zip(labels, plan.strides)]
    heading = [f"mesh {sizes}: {layout.size} ranks, rank = {' + '.join(terms)}"]
    if plan.nproc is not None and plan.nodes is not None:
        heading.append(
            f"{plan.nproc} ranks per node, {plan.nodes} nodes (node = rank // {plan.nproc})"
        )
    if not plan.full:
        heading.append(f"summarised like the text view; --full shows all {layout.size} ranks")
    return heading


def _heading_svg(heading: list[str]) -> tuple[list[str], float]:
    """The heading's text elements and the height below them."""
    y: float = MARGIN + 14
    body = [_text(MARGIN, y, heading[0], size=16, font_weight="bold")]
    for line in heading[1:]:
        y += 20
        body.append(_text(MARGIN, y, line, size=13, fill="#444"))
    return body, y + 18


def _panel_svg(
    plan: Plan,
    lead: tuple[int, ...],
    rows: list[int | None],
    cols: list[int | None],
    x0: float,
    y0: float,
    cw: float,
    lw: float,
    title_h: float,
    corner: str,
    row_labels: list[str],
    member_of: Callable[[Sequence[int]], list[int]],
) -> list[str]:
    layout, labels = plan.layout, plan.labels
    out: list[str] = []
    if lead:
        title = ", ".join(f"{label}={c}" for label, c in zip(labels, lead))
        out.append(_text(x0, y0 + 14, title, size=13, font_weight="bold"))
    top = y0 + title_h
    out.append(_text(x0 + lw - 8, top + 13, corner, anchor="end", fill="#555"))
    for j, c in enumerate(cols):
        cx = x0 + lw + cw * j + cw / 2
        out.append(
            _text(cx, top + 13, ELLIPSIS if c is None else str(c), anchor="middle", fill="#555")
        )
    gy = top + HEAD_H
    # Outlines of the --rank groups: one rectangle per group over its visible members.
    boxes: dict[int, list[tuple[int, int]]] = {}
    for i, r in enumerate(rows):
        out.append(
            _text(
                x0 + lw - 8,
                gy + ROW_H * i + ROW_H / 2 + 4,
                row_labels[i],
                anchor="end",
                fill="#555",
            )
        )
        for j, c in enumerate(cols):
            cx, cy = x0 + lw + cw * j, gy + ROW_H * i
            if c is None or (r is None and layout.ndim > 1):
                out.append(
                    _text(cx + cw / 2, cy + ROW_H / 2 + 4, ELLIPSIS, anchor="middle", fill="#888")
                )
                continue
            coord = (*lead, c) if r is None else (*lead, r, c)
            inside = member_of(coord)
            for g in inside:
                boxes.setdefault(g, []).append((i, j))
            out.append(_rank_cell(plan, coord, inside, cx, cy, cw))
    out += _group_outlines(plan, boxes, x0 + lw, gy, cw)
    return out


def _rank_cell(
    plan: Plan, coord: Sequence[int], inside: list[int], cx: float, cy: float, cw: float
) -> str:
    """One rank's cell: a ``<g class="rank">`` with its facts as data attributes."""
    rank = plan.layout.ravel(coord)
    node = None if plan.nproc is None else rank // plan.nproc
    fill = PLAIN if node is None else NODE_COLOURS[node % len(NODE_COLOURS)]
    axes_in = " ".join(plan.rank.groups[g].axis.label for g in inside) if plan.rank else ""
    me = plan.rank is not None and rank == plan.rank.rank
    tip = f"rank {rank} {tuple(coord)}" + ("" if node is None else f" node {node}")
    attrs = f'class="rank" data-rank="{rank}"'
    if node is not None:
        attrs += f' data-node="{node}"'
    if plan.rank is not None:
        attrs += f" data-in={quoteattr(axes_in)}"
    stroke = 'stroke="black" stroke-width="2.5"' if me else 'stroke="white" stroke-width="1"'
    return (
        f"<g {attrs}><title>{escape(tip)}</title>"
        f'<rect x="{cx:.1f}" y="{cy:.1f}" width="{cw:.1f}" height="{ROW_H}" fill="{fill}" {stroke}/>'
        + _text(
            cx + cw / 2,
            cy + ROW_H / 2 + 4,
            str(rank),
            anchor="middle",
            font_weight="bold" if me else "normal",
        )
        + "</g>"
    )


def _group_outlines(
    plan: Plan, boxes: dict[int, list[tuple[int, int]]], gx: float, gy: float, cw: float
) -> list[str]:
    """One rectangle per ``--rank`` group over its visible cells (row, column)."""
    out = []
    for g, cells in sorted(boxes.items()):
        inset = 1.5 + 2.5 * g
        i0, i1 = min(i for i, _ in cells), max(i for i, _ in cells)
        j0, j1 = min(j for _, j in cells), max(j for _, j in cells)
        colour = AXIS_COLOURS[g % len(AXIS_COLOURS)]
        label = plan.rank.groups[g].axis.label if plan.rank else ""
        out.append(
            f'<rect class="group" data-axes={quoteattr(label)} '
            f'x="{gx + cw * j0 + inset:.1f}" y="{gy + ROW_H * i0 + inset:.1f}" '
            f'width="{cw * (j1 - j0 + 1) - 2 * inset:.1f}" height="{ROW_H * (i1 - i0 + 1) - 2 * inset:.1f}" '
            f'fill="none" stroke="{colour}" stroke-width="2" rx="3"/>'
        )
    return out


def _legend(plan: Plan, y: float) -> tuple[list[str], float, float]:
    out: list[str] = []
    right = 0.0
    if plan.nproc is not None and plan.nodes is not None:
        many = plan.nodes > len(NODE_COLOURS)
        head = "node colours (node mod 10):" if many else "nodes:"
        out.append(_text(MARGIN, y + 12, head, size=13, font_weight="bold"))
        x = MARGIN + CHAR * (len(head) + 2)
        for k in range(min(plan.nodes, len(NODE_COLOURS))):
            label = f"{k}, {k + 10}, {k + 20}{ELLIPSIS}" if many else f"node {k}"
            out.append(
                f'<rect class="swatch" data-node="{k}" x="{x:.1f}" y="{y:.1f}" width="16" height="16" '
                f'fill="{NODE_COLOURS[k]}" stroke="#999"/>'
            )
            out.append(_text(x + 22, y + 12, label))
            x += 22 + CHAR * len(label) + 14
            right = max(right, x)
            if x > MAX_WIDTH - 120 and k + 1 < min(plan.nodes, len(NODE_COLOURS)):
                x, y = MARGIN + CHAR * (len(head) + 2), y + 22
        y += 28
    if plan.rank is not None:
        rp = plan.rank
        where = "" if rp.node is None else f", node {rp.node}"
        out.append(
            _text(
                MARGIN,
                y + 12,
                f"rank {rp.rank}: coordinate {rp.coordinate}{where}",
                size=13,
                font_weight="bold",
            )
        )
        y += 22
        for g, group in enumerate(rp.groups):
            colour = AXIS_COLOURS[g % len(AXIS_COLOURS)]
            text = f"{group.axis.label} group {group_text(plan.layout, group.axis.axes, rp.coordinate, full=False)}"
            text += f", position {group.position} of {group.axis.size}"
            if group.nodes is not None:
                text += (
                    f", inside node {rp.node}"
                    if group.nodes == 1
                    else f", spans {group.nodes} nodes"
                )
            out.append(
                f'<rect x="{MARGIN}" y="{y:.1f}" width="26" height="14" fill="none" '
                f'stroke="{colour}" stroke-width="2" rx="3"/>'
            )
            out.append(_text(MARGIN + 36, y + 12, text))
            right = max(right, MARGIN + 36 + CHAR * len(text))
            y += 20
        y += 6
    for warning in plan.warnings:
        out.append(_text(MARGIN, y + 12, warning, fill="#b00"))
        right = max(right, MARGIN + CHAR * len(warning))
        y += 20
    return out, y, right
