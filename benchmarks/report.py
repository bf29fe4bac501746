"""Turn raw worker results into figures (median, min, max), target verdicts and tables.

>>> stat([3.0, 1.0, 2.0])
{'median': 2.0, 'min': 1.0, 'max': 3.0, 'n': 3}
>>> fmt_seconds(0.000_012_5), fmt_seconds(1.5), fmt_bytes(5 * 1024)
('12.5 µs', '1.50 s', '5.0 KiB')
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.run import Config

__all__ = ["render", "stat", "summarize", "targets", "update_readme"]

Stat = dict[str, float]
BEGIN, END = "<!-- BEGIN RESULTS -->", "<!-- END RESULTS -->"
LABELS = {"scopedmesh": "scopedmesh", "devicemesh": "DeviceMesh", "naive": "naive", "dict": "dict"}


def stat(values: Iterable[float]) -> Stat:
    """Median, min, max and count of ``values``."""
    data = list(values)
    return {"median": statistics.median(data), "min": min(data), "max": max(data), "n": len(data)}


def _ok(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if "error" not in r]


def summarize(raw: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Group the runs of each point and reduce every figure to a :func:`stat`."""
    points: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in _ok(raw):
        points[(r["case"], r["impl"], tuple(r["shape"]))].append(r)
    summary: dict[str, list[dict[str, Any]]] = {
        "setup": [],
        "lookup": [],
        "submesh": [],
        "real": [],
    }
    for (case, impl, shape), runs in points.items():
        head = {"impl": impl, "world": math.prod(shape), "shape": list(shape), "axes": len(shape)}
        if case == "setup":
            traced = [r for r in runs if "peak_bytes" in r]
            summary["setup"].append(
                {
                    **head,
                    "seconds": stat(r["seconds"] for r in runs),
                    "helper_seconds": stat(r["helper_seconds"] for r in runs),
                    "own_seconds": stat(r["seconds"] - r["helper_seconds"] for r in runs),
                    "helper_calls": sorted({r["helper_calls"] for r in runs}),
                    "groups_registered": sorted({r["groups_registered"] for r in runs}),
                    "requested_groups": runs[0]["requested_groups"],
                    "all_groups": runs[0]["all_groups"],
                    "peak_bytes": stat(r["peak_bytes"] for r in traced) if traced else None,
                    "retained_bytes": stat(r["retained_bytes"] for r in traced) if traced else None,
                    "warnings": sorted({w for r in runs for w in r.get("warnings", [])}),
                }
            )
        elif case in ("lookup", "submesh"):
            entry = {**head, "ns_per_call": stat(r["ns_per_call"] for r in runs)}
            if case == "submesh":
                entry["scope_ns_per_call"] = stat(r["scope_ns_per_call"] for r in runs)
                entry["slice_ns_per_call"] = stat(r["slice_ns_per_call"] for r in runs)
                entry["first_seconds"] = stat(r["first_seconds"] for r in runs)
            else:
                entry["stmt"] = runs[0]["stmt"]
            summary[case].append(entry)
        else:
            for name in runs[0]["seconds"]:
                summary["real"].append(
                    {**head, "impl": name, "seconds": stat(r["seconds"][name] for r in runs)}
                )
    for entries in summary.values():
        entries.sort(key=lambda e: (e["axes"], e["world"], list(LABELS).index(e["impl"])))
    return summary


def _find(entries: Iterable[dict[str, Any]], **where: Any) -> dict[str, Any] | None:
    for e in entries:
        if all(e.get(k) == v for k, v in where.items()):
            return e
    return None


def _target(
    case: str,
    text: str,
    value: float | None,
    threshold: float,
    *,
    at_most: bool,
    figure: str,
    diagnostic: bool = False,
) -> dict[str, Any]:
    met = None if value is None else (value <= threshold if at_most else value >= threshold)
    return {
        "case": case,
        "target": text,
        "figure": figure if value is not None else "not measured",
        "value": value,
        "threshold": threshold,
        "met": met,
        "diagnostic": diagnostic,
    }


def targets(summary: dict[str, list[dict[str, Any]]], config: Config) -> list[dict[str, Any]]:
    """The issue's targets, each with its figure from this run and a verdict."""
    out: list[dict[str, Any]] = []
    setup = summary["setup"]
    worlds = sorted(config.setup_worlds)
    ref = 2**16 if 2**16 in worlds else worlds[-1]
    lo, hi = worlds[0], worlds[-1]
    for axes in config.axes:
        sm = _find(setup, impl="scopedmesh", axes=axes, world=ref)
        dm = _find(setup, impl="devicemesh", axes=axes, world=ref)
        ratio = dm["seconds"]["median"] / sm["seconds"]["median"] if sm and dm else None
        out.append(
            _target(
                "a",
                f"setup ≥ 100x faster than init_device_mesh at {_pow(ref)}, {axes} axes",
                ratio,
                100,
                at_most=False,
                figure=f"{ratio or 0:,.0f}x",
            )
        )
        first = _find(setup, impl="scopedmesh", axes=axes, world=lo)
        last = _find(setup, impl="scopedmesh", axes=axes, world=hi)
        growth = last["seconds"]["median"] / first["seconds"]["median"] if first and last else None
        out.append(
            _target(
                "a",
                f"scopedmesh setup grows ≤ 2x from {_pow(lo)} to {_pow(hi)}, {axes} axes",
                growth,
                2,
                at_most=True,
                figure=f"{growth or 0:.2f}x",
            )
        )
        own = (
            last["own_seconds"]["median"] / first["own_seconds"]["median"]
            if first and last
            else None
        )
        out.append(
            _target(
                "a",
                f"(diagnostic, not a target) the same, without the time inside torch's "
                f"`_new_process_group_helper`, {axes} axes",
                own,
                2,
                at_most=True,
                figure=f"{own or 0:.2f}x",
                diagnostic=True,
            )
        )
        runs = [e for e in setup if e["impl"] == "scopedmesh" and e["axes"] == axes]
        exact = all(
            e["helper_calls"] == [e["requested_groups"]] == e["groups_registered"] for e in runs
        )
        calls = sorted({c for e in runs for c in e["helper_calls"]})
        out.append(
            _target(
                "a",
                f"exactly one new_group call per requested group, {axes} axes",
                float(exact) if runs else None,
                1,
                at_most=False,
                figure=f"{_values(calls)} calls for {axes} groups, at every world",
            )
        )
        peak = last["peak_bytes"]["max"] if last and last["peak_bytes"] else None
        out.append(
            _target(
                "a",
                f"peak Python memory of the mesh at {_pow(hi)} < 256 KiB, {axes} axes",
                peak,
                256 * 1024 - 1,
                at_most=True,
                figure=fmt_bytes(peak or 0),
            )
        )
    lookup = summary["lookup"]
    sm, dm = _find(lookup, impl="scopedmesh"), _find(lookup, impl="devicemesh")
    ns = sm["ns_per_call"]["median"] if sm else None
    out.append(
        _target("b", "cached lookup ≤ 250 ns", ns, 250, at_most=True, figure=f"{ns or 0:.0f} ns")
    )
    ratio = dm["ns_per_call"]["median"] / sm["ns_per_call"]["median"] if sm and dm else None
    out.append(
        _target(
            "b",
            "cached lookup ≥ 4x faster than DeviceMesh.get_group",
            ratio,
            4,
            at_most=False,
            figure=f"{ratio or 0:.1f}x",
        )
    )
    sub = summary["submesh"]
    sm, dm = _find(sub, impl="scopedmesh"), _find(sub, impl="devicemesh")
    ratio = dm["ns_per_call"]["median"] / sm["ns_per_call"]["median"] if sm and dm else None
    out.append(
        _target(
            "c",
            f"sub-mesh ≥ 1000x faster than DeviceMesh slicing at {_pow(config.submesh_world)}",
            ratio,
            1000,
            at_most=False,
            figure=f"{ratio or 0:,.0f}x",
        )
    )
    real = summary["real"]
    sm, dm = _find(real, impl="scopedmesh"), _find(real, impl="devicemesh")
    ratio = sm["seconds"]["median"] / dm["seconds"]["median"] if sm and dm else None
    world = math.prod(config.real_shape)
    out.append(
        _target(
            "d",
            f"real gloo world of {world}: no slower than init_device_mesh",
            ratio,
            1,
            at_most=True,
            figure=f"{ratio or 0:.2f}x DeviceMesh's time",
        )
    )
    return out


# ------------------------------------------------------------------ format


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_ns(ns: float) -> str:
    return fmt_seconds(ns * 1e-9) if ns >= 10_000 else f"{ns:.0f} ns"


def fmt_bytes(b: float) -> str:
    if b >= 1024**2:
        return f"{b / 1024**2:.1f} MiB"
    if b >= 1024:
        return f"{b / 1024:.1f} KiB"
    return f"{b:.0f} B"


def _pow(n: int) -> str:
    k = n.bit_length() - 1
    return f"2^{k}" if n == 1 << k else str(n)


def _spread(s: Stat, fmt: Any) -> str:
    return f"{fmt(s['min'])} .. {fmt(s['max'])}"


def _values(values: Sequence[int]) -> str:
    return "/".join(f"{v:,}" for v in values)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render(results: dict[str, Any]) -> str:
    """The tables (Markdown) for the terminal and the README."""
    meta, summary = results["meta"], results["summary"]
    m = meta["machine"]
    lines = [
        f"Command: `{meta['command'].strip()}` — started {meta['started']}, "
        f"took {meta['runtime_seconds']:.0f} s.",
        f"Machine: {m['cpu']}, nproc {m['nproc']}, Python {m['python']}, torch {m['torch']}, "
        f"{m['platform']}; load average {meta['load_average_before'][0]:.1f} before, "
        f"{meta['load_average_after'][0]:.1f} after.",
        "",
    ]
    setup = summary["setup"]
    main_worlds = set(meta["config"]["setup_worlds"])
    if setup:
        lines += [
            "### (a) setup: construct the mesh and get this rank's group along every axis",
            "",
            "`fake` backend, rank = world/2. new_group calls = calls of torch's "
            "`_new_process_group_helper`; *in torch's helper* = the time spent inside those "
            "calls; groups registered = growth of `pg_map`.",
            "",
        ]
        rows = []
        for e in setup:
            if e["world"] not in main_worlds:
                continue
            sm = _find(setup, impl="scopedmesh", axes=e["axes"], world=e["world"])
            vs = f"{e['seconds']['median'] / sm['seconds']['median']:,.0f}x" if sm else "—"
            peak = e["peak_bytes"]
            rows.append(
                [
                    "x".join(map(str, e["shape"])),
                    _pow(e["world"]),
                    LABELS[e["impl"]],
                    fmt_seconds(e["seconds"]["median"]),
                    _spread(e["seconds"], fmt_seconds),
                    vs,
                    fmt_seconds(e["helper_seconds"]["median"]),
                    _values(e["helper_calls"]),
                    _values(e["groups_registered"]),
                    fmt_bytes(peak["median"]) + ("" if peak["n"] > 1 else " (1 run)")
                    if peak
                    else "—",
                    str(e["seconds"]["n"]),
                ]
            )
        lines += _table(
            [
                "shape",
                "world",
                "approach",
                "time (median)",
                "min .. max",
                "÷ scopedmesh",
                "in torch's helper",
                "new_group calls",
                "groups registered",
                "peak memory",
                "runs",
            ],
            rows,
        )
        lines += ["", "### (e) scaling: setup time as the world doubles (3 axes)", ""]
        rows = []
        base = _find(setup, impl="scopedmesh", axes=3, world=min(e["world"] for e in setup))
        for world in sorted({e["world"] for e in setup if e["axes"] == 3}):
            sm = _find(setup, impl="scopedmesh", axes=3, world=world)
            dm = _find(setup, impl="devicemesh", axes=3, world=world)
            rows.append(
                [
                    _pow(world),
                    fmt_seconds(sm["seconds"]["median"]) if sm else "—",
                    fmt_seconds(sm["own_seconds"]["median"]) if sm else "—",
                    fmt_seconds(dm["seconds"]["median"]) if dm else "stopped",
                    f"{dm['seconds']['median'] / sm['seconds']['median']:,.0f}x"
                    if sm and dm
                    else "—",
                    f"{sm['seconds']['median'] / base['seconds']['median']:.2f}x"
                    if sm and base
                    else "—",
                    f"{sm['own_seconds']['median'] / base['own_seconds']['median']:.2f}x"
                    if sm and base
                    else "—",
                    f"{sm['seconds']['n'] if sm else 0}/{dm['seconds']['n'] if dm else 0}",
                ]
            )
        lines += _table(
            [
                "world",
                "scopedmesh",
                "scopedmesh without torch's helper",
                "DeviceMesh",
                "DeviceMesh ÷ scopedmesh",
                "scopedmesh ÷ smallest world",
                "same, without torch's helper",
                "runs",
            ],
            rows,
        )
        for s in results["stopped"]:
            lines.append(
                f"\n{LABELS[s['impl']]} ({s['axes']} axes) stopped at {_pow(s['world'])}: "
                f"{s['reason']}."
            )
        if not results["stopped"]:
            lines += [
                "",
                f"No series stopped: every run finished within the {meta['config']['budget']:g} s budget.",
            ]
    for case, title, unit in (
        ("lookup", "(b) cached lookup of the `tp` group", "per call"),
        ("submesh", "(c) sub-mesh over (`pp`, `tp`)", "per call"),
    ):
        entries = summary[case]
        if not entries:
            continue
        lines += ["", f"### {title} at world {_pow(entries[0]['world'])}", ""]
        sm = _find(entries, impl="scopedmesh")
        rows = []
        for e in entries:
            vs = f"{e['ns_per_call']['median'] / sm['ns_per_call']['median']:,.1f}x" if sm else "—"
            row = [
                LABELS[e["impl"]],
                fmt_ns(e["ns_per_call"]["median"]),
                _spread(e["ns_per_call"], fmt_ns),
                vs,
            ]
            if case == "lookup":
                row.append(f"`{e['stmt']}`")
            else:
                row += [
                    fmt_ns(e["scope_ns_per_call"]["median"]),
                    fmt_ns(e["slice_ns_per_call"]["median"]),
                    fmt_seconds(e["first_seconds"]["median"]),
                ]
            rows.append([*row, str(e["ns_per_call"]["n"])])
        header = ["approach", f"time {unit} (median)", "min .. max", "÷ scopedmesh"]
        header += (
            ["statement"] if case == "lookup" else ["with close()", "`mesh[...]`", "first call"]
        )
        lines += _table([*header, "runs"], rows)
        if case == "submesh":
            lines += [
                "",
                "Per call: scopedmesh's `mesh.submesh('pp', 'tp')` (left open) vs DeviceMesh's "
                "`mesh['pp', 'tp']`. *with close()* is a whole scope for scopedmesh, "
                "`mesh.submesh('pp', 'tp').close()`; *`mesh[...]`* is slicing, which for "
                "scopedmesh returns the open sub-mesh it made before. *first call* is each "
                "one's first sub-mesh.",
            ]
    real = summary["real"]
    if real:
        lines += [
            "",
            f"### (d) real processes: gloo world of {real[0]['world']} over loopback, "
            f"shape {'x'.join(map(str, real[0]['shape']))}",
            "",
            "Time from a barrier until a first all_reduce has completed on every "
            "single-axis group, max over ranks. The approaches share each world, one after "
            "another, in an order rotated run by run.",
            "",
        ]
        sm = _find(real, impl="scopedmesh")
        rows = [
            [
                LABELS[e["impl"]],
                fmt_seconds(e["seconds"]["median"]),
                _spread(e["seconds"], fmt_seconds),
                f"{e['seconds']['median'] / sm['seconds']['median']:.2f}x" if sm else "—",
                str(e["seconds"]["n"]),
            ]
            for e in real
        ]
        lines += _table(["approach", "time (median)", "min .. max", "÷ scopedmesh", "runs"], rows)
    lines += ["", "### Targets", ""]
    verdict = {True: "met", False: "**missed**", None: "not measured"}
    lines += _table(
        ["case", "target", "figure", "verdict"],
        [
            [t["case"], t["target"], t["figure"], "—" if t["diagnostic"] else verdict[t["met"]]]
            for t in results["targets"]
        ],
    )
    if results["errors"]:
        lines += ["", f"{len(results['errors'])} run(s) failed; see `errors` in the JSON."]
    return "\n".join(lines)


def update_readme(path: Path, text: str) -> None:
    """Replace the text between the README's result markers with ``text``."""
    readme = path.read_text()
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"{path} lacks the markers {BEGIN} and {END}")
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", readme))
