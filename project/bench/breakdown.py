"""What a step's and a sweep pass's time is made of, call by call (#27): for each call
that reaches the database driver (a statement, a commit, a switch of autocommit), the
median time spent inside the driver (the round trip and the server's work) and the
median time of the process's own Python since the call before (building and compiling
the statement, reading the last answer, the ledger's bookkeeping). Printed, never
asserted.

    DATABASE_URL=... python -m project.bench.breakdown [--repeat 40] [--json out.json]

Run it on loopback and through the rig's proxy (``scripts/bench-all`` does both): the
calls are the same, the driver's share is what a network adds to.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import django


@contextmanager
def _traced() -> Iterator[list[tuple[str, float, float]]]:
    """Every driver call of the block as (what, start, end), in order, this thread's."""
    from django.db import connections
    from django.db.backends.utils import CursorWrapper

    # The backend's own class: MySQL's overrides ``_set_autocommit``.
    wrapper: Any = type(connections["default"])

    calls: list[tuple[str, float, float]] = []
    execute, executemany = CursorWrapper.execute, CursorWrapper.executemany
    commit, set_autocommit = wrapper._commit, wrapper._set_autocommit

    def timed(what: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            calls.append((what, start, time.perf_counter()))

    def traced_execute(self: Any, sql: str, params: Any = None) -> Any:
        return timed(_verb(sql), lambda: execute(self, sql, params))

    def traced_executemany(self: Any, sql: str, params: Any) -> Any:
        return timed(_verb(sql), lambda: executemany(self, sql, params))

    def traced_commit(self: Any) -> Any:
        return timed("COMMIT", lambda: commit(self))

    def traced_autocommit(self: Any, on: bool) -> Any:
        # mysqlclient sends SET autocommit to the server; psycopg only notes it (the
        # BEGIN goes with its next statement).
        return timed(f"autocommit {'on' if on else 'off'}", lambda: set_autocommit(self, on))

    with (
        mock.patch.object(CursorWrapper, "execute", traced_execute),
        mock.patch.object(CursorWrapper, "executemany", traced_executemany),
        mock.patch.object(wrapper, "_commit", traced_commit),
        mock.patch.object(wrapper, "_set_autocommit", traced_autocommit),
    ):
        yield calls


def _verb(sql: str) -> str:
    """A short name for a statement: its verb and table (or the trip's statements)."""
    parts = [p.strip() for p in sql.split(";\n") if p.strip()] if ";\n" in sql else [sql]
    if len(parts) > 1:
        return f"trip of {len(parts)}: " + ", ".join(_verb(p).split(" ", 1)[0] for p in parts)
    # The statement's own FROM, not a subquery's in its select list.
    depth, top = 0, []
    for ch in sql:
        depth += (ch == "(") - (ch == ")")
        top.append(ch if depth == 0 or (depth == 1 and ch == "(") else " ")
    words = "".join(top).replace("`", "").replace('"', "").split()
    if not words or words[0] == "(":  # a UNION of parenthesised SELECTs
        words = sql.replace("`", "").replace('"', "").split()
    verb = words[0].upper() if words else "?"
    upper = [w.upper() for w in words]
    after = {"UPDATE": "UPDATE", "INSERT": "INTO", "SELECT": "FROM", "DELETE": "FROM"}.get(verb)
    table = ""
    if after in upper and upper.index(after) + 1 < len(words):
        table = words[upper.index(after) + 1].replace("events_ledger_", "")
    return f"{verb} {table}".strip()


def _profile(
    name: str, setup: Callable[[], Any], unit: Callable[[Any], Any], repeat: int
) -> dict[str, Any]:
    """``unit`` ``repeat`` times, each on what ``setup`` made; the medians per call."""
    rows: list[list[tuple[str, float, float]]] = []
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(repeat):
        made = setup()
        with _traced() as calls:
            cpu = time.process_time()
            start = time.perf_counter()
            unit(made)
            end = time.perf_counter()
            cpus.append(time.process_time() - cpu)
        walls.append(end - start)
        rows.append(
            [(w, s - start, e - start) for w, s, e in calls] + [("(end)", end - start, end - start)]
        )
    # Runs whose calls differ in kind or number (a retry) are left out of the medians.
    shape = statistics.mode(tuple(w for w, _, _ in r) for r in rows)
    same = [r for r in rows if tuple(w for w, _, _ in r) == shape]
    table = []
    for i, what in enumerate(shape):
        driver = [r[i][2] - r[i][1] for r in same]
        before = [r[i][1] - (r[i - 1][2] if i else 0.0) for r in same]
        table.append(
            {
                "call": what,
                "driver_ms": statistics.median(driver) * 1000,
                "python_before_ms": statistics.median(before) * 1000,
            }
        )
    return {
        "unit": name,
        "repeat": repeat,
        "kept": len(same),
        "wall_ms": statistics.median(walls) * 1000,
        "cpu_ms": statistics.median(cpus) * 1000,
        "driver_ms": sum(c["driver_ms"] for c in table),
        "python_ms": sum(c["python_before_ms"] for c in table),
        "calls": table[:-1],
        "trips": len(table) - 1,
        "after_last_ms": table[-1]["python_before_ms"],
    }


def measure(repeat: int, sizes: list[int]) -> list[dict[str, Any]]:
    from events_ledger.cleanup import sweep
    from events_ledger.conf import ledger_settings
    from events_ledger.ledger import execute_step
    from events_ledger.registry import default_registry

    from . import shapes

    out = []
    batch = ledger_settings.CLEANUP_RUN_BATCH
    with default_registry.isolated() as reg:
        shapes.register(reg, 0)
        shapes.delete_runs()
        try:
            warm = shapes._make_runs(shapes.Shape(resources=1, runs=20), shapes.NOOP, "warm")
            shapes._execute(warm)
            shapes._end(warm)
            while sweep(limit=10, scope=shapes.SCOPE).runs:
                pass
            for n in sizes:

                def one_step(n: int = n) -> Any:
                    shape = shapes.Shape(resources=n, runs=1)
                    return shapes._make_runs(shape, shapes.NOOP, "bd")[0][1][0]

                out.append(
                    _profile(
                        f"a step of {n} resource(s) (execute_step)", one_step, execute_step, repeat
                    )
                )

                def runs(n: int = n) -> Any:
                    shapes.delete_runs()
                    made = shapes._make_runs(
                        shapes.Shape(resources=n, runs=batch), shapes.NOOP, "bd"
                    )
                    shapes._execute(made)
                    shapes._end(made)
                    return made

                def one_pass(made: Any) -> None:
                    report = sweep(limit=batch, scope=shapes.SCOPE)
                    if report.errors or len(report.runs) != len(made):
                        raise RuntimeError(f"a breakdown pass did not give its runs back: {report}")

                out.append(
                    _profile(
                        f"a sweep pass over {batch} runs of {n} resource(s)", runs, one_pass, repeat
                    )
                )
        finally:
            shapes.delete_runs()
    return out


def text(results: list[dict[str, Any]], where: str = "") -> str:
    lines = []
    for r in results:
        lines.append(
            f"{r['unit']}{where}: {r['wall_ms']:.2f} ms (median of {r['kept']}/{r['repeat']}), "
            f"{r['trips']} driver calls {r['driver_ms']:.2f} ms, Python {r['python_ms']:.2f} ms, "
            f"process CPU {r['cpu_ms']:.2f} ms"
        )
        lines.append(f"  {'call':<44} {'Python before':>13} {'driver':>8}")
        for c in r["calls"]:
            lines.append(
                f"  {c['call'][:44]:<44} {c['python_before_ms']:>10.2f} ms {c['driver_ms']:>5.2f} ms"
            )
        lines.append(f"  {'(after the last call)':<44} {r['after_last_ms']:>10.2f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--resources", default="1,10", help="resources per step, e.g. 1,10")
    parser.add_argument("--json", help="write the figures here as well")
    parser.add_argument("--where", default="", help="a label for the output, e.g. ' via proxy'")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    django.setup()
    results = measure(args.repeat, [int(n) for n in args.resources.split(",")])
    print(text(results, args.where))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
