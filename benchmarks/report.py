"""Raw runs to figures (median, min, max), target verdicts and Markdown tables.

>>> fmt_seconds(0.000_012_5), fmt_seconds(1.5), fmt_bytes(5 * 1024), fmt_count(stat([3, 3]))
('12.5 µs', '1.50 s', '5.0 KiB', '3')
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks.harness import stat

__all__ = ["render", "stat", "summarize", "targets", "update_readme"]

BEGIN, END = "<!-- BEGIN RESULTS -->", "<!-- END RESULTS -->"
LABELS = {i: i for i in ("scopedmesh", "devicemesh", "naive", "dict", "floor")}
LABELS["devicemesh"], PAIR = "DeviceMesh", ("scopedmesh", "devicemesh")
KEEP = {"stmt", "requested_groups"}  # kept as the first run's value, not a stat
Summary = dict[str, list[dict[str, Any]]]


def summarize(raw: Iterable[dict[str, Any]]) -> Summary:
    """Group the runs of each point; every other number becomes a :func:`stat` over them."""
    points: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in (r for r in raw if "error" not in r):
        for impl, run in r["seconds"].items() if r["case"] == "real" else [(r["impl"], r)]:
            point = (r["case"], impl, tuple(r["shape"]))
            points[point].append(run if isinstance(run, dict) else {"seconds": run})
    summary: Summary = {case: [] for case in ("setup", "lookup", "submesh", "real", "coldstart")}
    for (case, impl, shape), runs in points.items():
        e = {"impl": impl, "world": math.prod(shape), "shape": list(shape), "axes": len(shape)}
        for key in dict.fromkeys(k for r in runs for k in r):
            values = [r[key] for r in runs if key in r]
            if key in KEEP:
                e[key] = values[0]
            elif key not in e and key not in ("rep", "torch_threads"):
                e.update({key: stat(values)} if {type(v) for v in values} <= {int, float} else {})
        if case == "setup":
            e["own_seconds"] = stat(r["seconds"] - r["helper_seconds"] for r in runs)
        summary[case].append(e)
    for entries in summary.values():
        entries.sort(key=lambda e: (e["axes"], e["world"], list(LABELS).index(e["impl"])))
    return summary


def _find(entries: Iterable[dict[str, Any]], **where: Any) -> dict[str, Any] | None:
    return next((e for e in entries if all(e.get(k) == v for k, v in where.items())), None)


def _med(entries: Iterable[dict[str, Any]], field: str = "seconds", **where: Any) -> float | None:
    e = _find(entries, **where)
    return e[field]["median"] if e and field in e else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(summary: Summary, config: Any) -> list[dict[str, Any]]:
    """The issues' targets, each with its figure from this run and a verdict."""
    out: list[dict[str, Any]] = []

    def add(case: str, text: str, value: float | None, limit: float, fig: str) -> None:
        most = "≤" in text or "<" in text or "within" in text  # else an "at least" target
        met = None if value is None else (value <= limit if most else value >= limit)
        figure = fig.format(value or 0) if value is not None else "not measured"
        out.append({"case": case, "target": text, "figure": figure, "value": value, "met": met})
        out[-1].update(threshold=limit, diagnostic=text.startswith("(diagnostic"))

    s, worlds = summary["setup"], sorted(config.setup_worlds)
    ref, lo, hi = 2**16 if 2**16 in worlds else worlds[-1], worlds[0], worlds[-1]
    for axes in config.axes:
        sm, dm = {"impl": "scopedmesh", "axes": axes}, {"impl": "devicemesh", "axes": axes}
        ratio = _div(_med(s, **dm, world=ref), _med(s, **sm, world=ref))
        add("a", f"setup ≥ 100x faster than init_device_mesh at {_pow(ref)}, {axes} axes", ratio, 100, "{:,.0f}x")  # fmt: skip
        for field, what, limit in (
            ("own_seconds", "scopedmesh's own setup time (without torch's helper)", 1.5),
            ("seconds", "(diagnostic) scopedmesh's setup time, torch's helper included,", 2),
            ("copy_seconds", "(diagnostic) torch's per-member copy in scopedmesh's setup", 2),
        ):
            growth = _div(_med(s, field, **sm, world=hi), _med(s, field, **sm, world=lo))
            text = f"{what} grows ≤ {limit:g}x from {_pow(lo)} to {_pow(hi)}, {axes} axes"
            add("a", text, growth, limit, "{:.2f}x")
        runs = [e for e in s if e["impl"] == "scopedmesh" and e["axes"] == axes]
        exact = [fmt_count(e["helper_calls"]) == fmt_count(e["groups_registered"]) == str(axes) for e in runs]  # fmt: skip
        calls = "/".join(sorted({fmt_count(e["helper_calls"]) for e in runs}))
        text = f"exactly one new_group call per requested group, {axes} axes"
        add("a", text, float(all(exact)) if runs else None, 1, f"{calls} calls for {axes} groups")
        peak = (_find(s, **sm, world=hi) or {}).get("peak_bytes", {}).get("max")
        text = f"peak Python memory of the mesh at {_pow(hi)} < 256 KiB, {axes} axes"
        add("a", text, peak, 256 * 1024 - 1, fmt_bytes(peak or 0))
    ns, dm_ns = (_med(summary["lookup"], "ns_per_call", impl=i) for i in PAIR)
    add("b", "cached lookup ≤ 250 ns", ns, 250, "{:.0f} ns")
    add("b", "cached lookup ≥ 4x faster than DeviceMesh.get_group", _div(dm_ns, ns), 4, "{:.1f}x")
    ns, dm_ns = (_med(summary["submesh"], "ns_per_call", impl=i) for i in PAIR)
    text = f"sub-mesh ≥ 1000x faster than DeviceMesh slicing at {_pow(config.world)}"
    add("c", text, _div(dm_ns, ns), 1000, "{:,.0f}x")
    sm_s, dm_s, floor = (_med(summary["real"], impl=i) for i in (*PAIR, "floor"))
    world = f"real gloo world of {math.prod(config.real_shape)}"
    add("d", f"{world}: scopedmesh within 1.2x of the floor", _div(sm_s, floor), 1.2, "{:.2f}x")
    add("d", f"{world}: ≥ 2x faster than init_device_mesh", _div(dm_s, sm_s), 2, "{:.2f}x")
    cold = _med(summary["coldstart"], impl="scopedmesh")
    text = f"cold start: import, first mesh and its groups ≤ 5 ms at {_pow(config.world)}"
    add("f", text, cold, 0.005, fmt_seconds(cold or 0))
    return out


def fmt_seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def fmt_ns(ns: float) -> str:
    return fmt_seconds(ns * 1e-9) if ns >= 10_000 else f"{ns:.0f} ns"


def fmt_bytes(b: float) -> str:
    return f"{b / 1024**2:.1f} MiB" if b >= 1024**2 else f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b:.0f} B"  # fmt: skip


def fmt_count(s: dict[str, float]) -> str:
    return f"{s['min']:,.0f}" + ("" if s["min"] == s["max"] else f"/{s['max']:,.0f}")


def _pow(n: int) -> str:
    k = n.bit_length() - 1
    return f"2^{k}" if n == 1 << k else str(n)


def _x(a: float | None, b: float | None, digits: int = 0) -> str:
    ratio = _div(a, b)
    return "—" if ratio is None else f"{ratio:,.{digits}f}x"


# (b), (c), (d), (f): case, title, figure, ratios to (approach, digits), more (header, key, format)
# fmt: off
TABLES: tuple[tuple[str, str, str, dict[str, int], list[tuple[str, str, Callable[[Any], str]]]], ...] = (
    ("lookup", "(b) cached lookup of the `tp` group at world {p}", "ns_per_call", {"scopedmesh": 1},
     [("statement", "stmt", "`{}`".format)]),
    ("submesh", "(c) sub-mesh over (`pp`, `tp`) at world {p}", "ns_per_call", {"scopedmesh": 1},
     [("with close()", "scope_ns_per_call", fmt_ns), ("`mesh[...]`", "slice_ns_per_call", fmt_ns),
      ("first call", "first_seconds", fmt_seconds)]),
    ("real", "(d) real processes: gloo world of {w}, shape {s}", "seconds",
     {"scopedmesh": 2, "floor": 2}, [("per all_reduce", "collective_seconds", fmt_seconds)]),
    ("coldstart", "(f) cold start at world {p}", "seconds", {"floor": 1},
     [(head, f"{key}_seconds", fmt_seconds) for head, key in (("import", "import"),
      ("construction", "construct"), ("group 1", "group1"), ("group 2", "group2"),
      ("group 3", "group3"))]),
)
# fmt: on


def _cells(e: dict[str, Any], field: str, fmt: Callable[[float], str]) -> list[str]:
    """The approach, then the median and range of ``e[field]``."""
    f = e[field]
    return [LABELS[e["impl"]], fmt(f["median"]), f"{fmt(f['min'])} .. {fmt(f['max'])}"]


def _section(title: str, header: str, rows: list[list[str]]) -> list[str]:
    cols = header.split("|")
    lines = ["", f"### {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] if rows else []


def render(results: dict[str, Any]) -> str:
    """The tables (Markdown) for the terminal and the README, which explains the columns."""
    meta, summary, m = results["meta"], results["summary"], results["meta"]["machine"]
    lines = [
        f"Command: `{meta['command'].strip()}` — started {meta['started']}, "
        f"took {meta['runtime_seconds']:.0f} s.",
        f"Machine: {m['cpu']}, nproc {m['nproc']}, Python {m['python']}, torch {m['torch']}, "
        f"{m['platform']}; load average {meta['load_average_before'][0]:.1f} before, "
        f"{meta['load_average_after'][0]:.1f} after{meta['note']}.",
    ]
    s, sm, rows = summary["setup"], {"impl": "scopedmesh"}, []
    for e in (e for e in s if e["world"] in meta["config"]["setup_worlds"]):
        ratio = _x(e["seconds"]["median"], _med(s, **sm, axes=e["axes"], world=e["world"]))
        peak = e.get("peak_bytes")
        memory = fmt_bytes(peak["median"]) + " (1 run)" * (peak["n"] == 1) if peak else "—"
        rows.append(["x".join(map(str, e["shape"])), _pow(e["world"]), *_cells(e, "seconds", fmt_seconds), ratio])  # fmt: skip
        rows[-1] += [fmt_seconds(e["helper_seconds"]["median"]), fmt_count(e["helper_calls"])]
        rows[-1] += [fmt_count(e["groups_registered"]), memory, str(e["seconds"]["n"])]
    head = "shape|world|approach|time (median)|min .. max|÷ scopedmesh|in torch's helper"
    head += "|new_group calls|groups registered|peak memory|runs"
    lines += _section("(a) setup: construct the mesh and get this rank's group along every axis", head, rows)  # fmt: skip
    rows, worlds = [], sorted({e["world"] for e in s if e["axes"] == 3})
    for world in worlds:
        e, base = (_find(s, **sm, axes=3, world=w) for w in (world, worlds[0]))
        dm = _med(s, impl="devicemesh", axes=3, world=world)
        keys = ("seconds", "own_seconds", "helper_seconds", "copy_seconds")
        if e and base:
            rows.append([_pow(world), *(fmt_seconds(e[k]["median"]) for k in keys)])
            rows[-1] += [_x(e[k]["median"], base[k]["median"], 2) for k in keys[1::-1] + keys[3:]]
            rows[-1] += [fmt_seconds(dm) if dm else "stopped", _x(dm, e["seconds"]["median"])]
            rows[-1] += [str(e["seconds"]["n"])]
    head = "world|scopedmesh|own time|in torch's helper|per-member copy|own ÷ smallest world"
    head += "|total ÷ smallest world|copy ÷ smallest world|DeviceMesh|DeviceMesh ÷ scopedmesh|runs"
    lines += _section("(e) scaling: setup time as the world doubles (3 axes)", head, rows)
    for x in results["stopped"]:
        lines += ["", f"{LABELS[x['impl']]} ({x['axes']} axes) stopped at {_pow(x['world'])}: {x['reason']}."]  # fmt: skip
    if s and not results["stopped"]:
        budget = meta["config"]["budget"]
        lines += ["", f"No series stopped: every run finished within the {budget:g} s budget."]
    for case, title, field, ratios, more in TABLES:
        entries, fmt, rows = summary[case], fmt_ns if field == "ns_per_call" else fmt_seconds, []
        for e in entries:
            rows.append(_cells(e, field, fmt))
            rows[-1] += [_x(e[field]["median"], _med(entries, field, impl=i), d) for i, d in ratios.items()]  # fmt: skip
            rows[-1] += [f(e[k]["median"] if isinstance(e[k], dict) else e[k]) for _, k, f in more]
            rows[-1] += [str(e[field]["n"])]
        head = ["approach", f"time{' per call' * (fmt is fmt_ns)} (median)", "min .. max"]
        head += [f"÷ {LABELS[i]}" for i in ratios] + [h for h, _, _ in more] + ["runs"]
        if entries:
            e = entries[0]
            where = title.format(p=_pow(e["world"]), w=e["world"], s="x".join(map(str, e["shape"])))
            lines += _section(where, "|".join(head), rows)
    verdict = {True: "met", False: "**missed**", None: "not measured"}
    rows = [[t["case"], t["target"], t["figure"], "—" if t["diagnostic"] else verdict[t["met"]]] for t in results["targets"]]  # fmt: skip
    lines += _section("Targets", "case|target|figure|verdict", rows)
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
