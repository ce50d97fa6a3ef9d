"""The bench's figures as text: one database's tables, or all databases side by side.

Plain functions over the command's ``--json`` document, so that ``scripts/bench-all``
can print the side-by-side table from the files without setting Django up:

    python -m project.bench.report text sqlite.json
    python -m project.bench.report markdown sqlite.json mariadb.json postgresql.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

#: How the databases are named in the side-by-side table, in its column order.
DATABASES = {"sqlite": "SQLite", "mysql": "MariaDB", "postgresql": "PostgreSQL"}
WAYS = (("ledger", "ledger"), ("per_row", "per-row"))


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}×"


def _settings(doc: dict[str, Any]) -> str:
    d = doc["durability"]
    pairs = ", ".join(f"{k}={v}" for k, v in d["settings"].items())
    return f"{pairs} (durable commits: {'yes' if d['durable'] else 'no'})"


def _steps(doc: dict[str, Any]) -> str:
    steps = sorted({s["steps_per_run"] for s in doc["shapes"]}) or [1]
    n = "/".join(map(str, steps))
    return f"{n} step{'s' if steps != [1] else ''}"


def _rounds(doc: dict[str, Any]) -> str:
    return "/".join(map(str, sorted({s["rounds"] for s in doc["shapes"]}))) or "0"


def database_name(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    return f"{m.get('server') or DATABASES.get(m['database'], m['database'])} {m['version']}"


def _order(doc: dict[str, Any]) -> str:
    order = doc.get("order", {})
    way = "in reverse phase order" if order.get("give_back_in_order", True) else "in no order"
    return way + (", each step a phase of its own" if order.get("phased") else ", one phase")


def text(doc: dict[str, Any]) -> str:
    """One database's figures, as the command prints them."""
    m = doc["machine"]
    lines = [
        f"database: {database_name(doc)} · {m['cpus']} CPUs · Python {m['python']} · "
        f"Django {m['django']} · {m['platform']} · {m['date']}",
        f"durability: {_settings(doc)}",
        f"giving back: {_order(doc)}",
        f"load average (1 min): {m['load_at_start']:.2f} at the start, "
        f"{m['load_at_end']:.2f} at the end; each shape in {_rounds(doc)} rounds, the two "
        "ways taken in turn (ledger, per-row, per-row, ledger, ...)",
    ]
    for leg, title, per in (
        ("recording", "recording", "step"),
        ("giving_back", "giving back", "run"),
    ):
        lines += [
            "",
            f"{title}, {_steps(doc)} per run"
            + (":" if per == "step" else ", the runs ended (ledger: sweep passes until done):"),
            f"{'resources/step':>14}{'runs':>6}  {'way':<8}{'resources/s':>12}"
            f"{'statements/resource':>21}{f'trips/{per}':>12}{f'commits/{per}':>14}"
            f"{'of which wrote':>16}{'ledger/per-row':>16}",
        ]
        for shape in doc["shapes"]:
            for way, label in WAYS:
                f = shape[way][leg]
                ratio = _x(shape["ratio"][leg]) if way == "ledger" else ""
                lines.append(
                    f"{shape['resources_per_step']:>14}{shape['runs']:>6}  {label:<8}"
                    f"{f['per_s']:>12,.0f}{f['statements_per_resource']:>21.3f}"
                    f"{f.get(f'round_trips_per_{per}', 0.0):>12.2f}"
                    f"{f[f'commits_per_{per}']:>14.2f}{f[f'writing_commits_per_{per}']:>16.2f}"
                    f"{ratio:>16}"
                )
        if leg == "giving_back":
            for shape in doc["shapes"]:
                f = shape["ledger"]["giving_back"]
                lines.append(
                    f"  ledger, {shape['resources_per_step']} resource(s)/step: {f['passes']} "
                    f"pass(es), {f['commits_per_pass']:.1f} commits/pass"
                )
    calls = doc.get("module_calls")
    if calls:
        s, p = calls["sequential"], calls["parallel"]
        lines += [
            "",
            f"module calls: one sweep pass over {calls['runs']} runs × {calls['groups_per_run']} "
            f"groups, each revert sleeping {calls['revert_ms']} ms:",
            f"  CLEANUP_CONCURRENCY={s['concurrency']}: {s['seconds']:.2f} s "
            f"({s['runs_swept']} runs swept, {s['left']} rows left)",
            f"  CLEANUP_CONCURRENCY={p['concurrency']}: {p['seconds']:.2f} s "
            f"({p['runs_swept']} runs swept, {p['left']} rows left)",
            f"  ratio parallel / sequential: {calls['ratio']:.2f}",
        ]
    idle = doc.get("idle_sweep")
    if idle:
        lines += ["", "with nothing to do, over historical (reverted) rows:"]
        names = list(idle["ratio"])
        for size, f in idle["sizes"].items():
            parts = ", ".join(
                f"{name.replace('_', ' ')} {f[f'{name}_ms_median']:.2f} ms" for name in names
            )
            lines.append(f"  {int(size):>10,} rows: {parts} (medians)")
            lines.append(
                f"  {'':>10}       full scans of the resource table: "
                f"{'; '.join(f['full_scans']) or 'none'}"
            )
        lines.append(
            "  ratio largest / smallest: "
            + ", ".join(
                f"{name.replace('_', ' ')} {v:.2f}"
                for name, v in idle["ratio"].items()
                if v is not None
            )
        )
    return "\n".join(lines)


def _pair(shape: dict[str, Any], leg: str, key: str, fmt: str) -> str:
    ledger, row = shape["ledger"][leg][key], shape["per_row"][leg][key]
    return f"{ledger:{fmt}} vs {row:{fmt}}"


def markdown(docs: list[dict[str, Any]]) -> str:
    """Every database side by side, one column each, as a Markdown table."""
    order = list(DATABASES)
    docs = sorted(docs, key=lambda d: order.index(d["machine"]["database"]))
    head = "| shape | figure (ledger vs per-row) | " + " | ".join(database_name(d) for d in docs)
    lines = [head + " |", "|---|---|" + "---|" * len(docs)]

    def row(shape_label: str, figure: str, cells: list[str]) -> None:
        lines.append(f"| {shape_label} | {figure} | " + " | ".join(cells) + " |")

    by_shape: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for doc in docs:
        for shape in doc["shapes"]:
            key = (shape["resources_per_step"], shape["steps_per_run"])
            by_shape.setdefault(key, []).append(shape)
    for (resources, steps), shapes in by_shape.items():
        if len(shapes) != len(docs):
            continue  # a shape not every database ran
        label = (
            f"{steps} step{'s' if steps > 1 else ''} per run, {resources} "
            f"resource{'s' if resources > 1 else ''} per step"
        )
        for leg, title, per in (
            ("recording", "recording", "step"),
            ("giving_back", "giving back", "run"),
        ):
            row(
                label,
                f"{title}, resources/s",
                [f"{_pair(s, leg, 'per_s', ',.0f')} ({_x(s['ratio'][leg])})" for s in shapes],
            )
            row(
                label,
                f"{title}, statements/resource",
                [_pair(s, leg, "statements_per_resource", ".2f") for s in shapes],
            )
            row(
                label,
                f"{title}, round trips/{per}",
                [_pair(s, leg, f"round_trips_per_{per}", ".2f") for s in shapes],
            )
            row(
                label,
                f"{title}, commits/{per}",
                [_pair(s, leg, f"commits_per_{per}", ".2f") for s in shapes],
            )
    calls = [d.get("module_calls") for d in docs]
    if all(calls):
        first = calls[0]
        assert first is not None
        row(
            f"{first['revert_ms']} ms module, {first['runs']} runs × "
            f"{first['groups_per_run']} groups",
            "one pass, concurrency "
            f"{first['parallel']['concurrency']} vs {first['sequential']['concurrency']}",
            [
                f"{c['parallel']['seconds']:.2f} s vs {c['sequential']['seconds']:.2f} s "
                f"({c['ratio']:.2f})"
                for c in calls
                if c is not None
            ],
        )
    row("", "durability", [_settings(d) for d in docs])
    row(
        "",
        "run",
        [
            f"{d['machine']['date']}, Django {d['machine']['django']}, load "
            f"{d['machine']['load_at_start']:.1f}→{d['machine']['load_at_end']:.1f}"
            for d in docs
        ],
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("text", "markdown"):
        print(__doc__, file=sys.stderr)
        return 2
    docs = []
    for path in argv[1:]:
        with open(path) as f:
            docs.append(json.load(f))
    if argv[0] == "text":
        print("\n\n".join(text(d) for d in docs))
    else:
        print(markdown(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
