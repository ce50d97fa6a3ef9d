"""The idle sweep over history: what must cost the same over a million rows as over ten thousand."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from typing import Any

from django.db import connection as default_connection
from django.test.utils import CaptureQueriesContext

from events_ledger.cleanup import sweep
from events_ledger.models import EventRun, EventRunLog, EventRunResource, EventRunStep

from .meter import measured

# The backends' own attributes (mysql_is_mariadb, ...) are not in the stubs.
connection: Any = default_connection
Res = EventRunResource.objects
#: Each scan is timed this many times; the median is reported.
REPEATS = 15


def _reconcile_scan() -> None:
    for owner in Res.modules_with_live_rows():
        Res.live_for_module(owner)


def _console_run_list() -> None:
    list(EventRun.objects.with_unresolved_count().order_by("-pk")[:100])


def _scans(scope: str) -> dict[str, Callable[[], Any]]:
    """What is timed over the history. The idle sweep is the bench's own (``scope``): on a
    database that holds real runs too (``--i-know``) it must not work them."""
    return {
        "idle_sweep": lambda: sweep(scope=scope),
        "reconcile_scan": _reconcile_scan,
        "console_run_list": _console_run_list,
    }


#: Historical rows per run: a history is many runs, each with its resources. (All in one
#: run, the row index on (run, status) looks unselective to a planner that has read the
#: table's statistics, and the plans measured are not the ones production gets.)
ROWS_PER_RUN = 100


def idle_sweeps(sizes: list[int], scope: str) -> dict[str, Any]:
    """Time each scan over ``sizes`` historical (reverted) rows, in runs of ``scope``."""
    out: dict[str, Any] = {"sizes": {}}
    filled = 0
    for size in sorted(sizes):
        with measured() as filling:
            fill(scope, filled, size - filled)
        filled = size
        analyze()
        figures: dict[str, Any] = {"fill_seconds": filling.seconds, "full_scans": []}
        for name, scan in _scans(scope).items():
            timings = []
            for _ in range(REPEATS):
                with measured() as one:
                    scan()
                timings.append(one.seconds)
            figures[f"{name}_ms_median"] = statistics.median(timings) * 1000
            figures[f"{name}_statements"] = one.statements
            figures["full_scans"] += [f"{name}: {sql}" for sql in full_scans(scan)]
        out["sizes"][str(size)] = figures
    first, last = list(out["sizes"].values())[0], list(out["sizes"].values())[-1]
    out["ratio"] = {
        name: (last[f"{name}_ms_median"] / first[f"{name}_ms_median"])
        if first[f"{name}_ms_median"]
        else None
        for name in _scans(scope)
    }
    return out


def fill(scope: str, start: int, count: int) -> None:
    """``count`` historical (reverted) rows, ``ROWS_PER_RUN`` to a finished run of
    ``scope``: the runs in one bulk INSERT, the rows in one statement."""
    if count <= 0:
        return
    runs = EventRun.objects.bulk_create(
        [
            EventRun(
                name=f"history {start + i}",
                scope=scope,
                status="completed",
                cleanup_status="complete",
            )
            for i in range(max(1, count // ROWS_PER_RUN))
        ]
    )
    ids = sorted(run.pk for run in runs) if all(run.pk for run in runs) else []
    if not ids:  # a backend that does not answer the ids of a bulk INSERT
        ids = sorted(
            EventRun.objects.filter(scope=scope)
            .order_by("-pk")
            .values_list("pk", flat=True)[: len(runs)]
        )
    first, n_runs = ids[0], len(ids)
    if ids[-1] - first + 1 != n_runs:
        raise RuntimeError("the history's runs did not get consecutive ids")
    table = EventRunResource._meta.db_table
    cols = "run_id, owner_module, kind, ref, status, revert_attempts, claim_count, created_at, updated_at"
    vendor = connection.vendor
    with connection.cursor() as cursor:
        if vendor == "mysql" and connection.mysql_is_mariadb:
            cursor.execute(
                f"INSERT INTO {table} ({cols}) SELECT %s + seq %% %s, 'bench', 'old', CONCAT('h-', seq), "
                f"'reverted', 0, 0, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM seq_{start + 1}_to_{start + count}",
                [first, n_runs],
            )
        elif vendor == "mysql":
            cursor.execute("SET SESSION cte_max_recursion_depth = %s", [count + 10])
            cursor.execute(
                f"INSERT INTO {table} ({cols}) WITH RECURSIVE s(n) AS (SELECT %s UNION ALL SELECT n + 1 FROM s "
                f"WHERE n < %s) SELECT %s + n %% %s, 'bench', 'old', CONCAT('h-', n), 'reverted', 0, 0, "
                f"UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM s",
                [start + 1, start + count, first, n_runs],
            )
        elif vendor == "postgresql":
            cursor.execute(
                f"INSERT INTO {table} ({cols}) SELECT %s + n %% %s, 'bench', 'old', 'h-' || n, 'reverted', "
                f"0, 0, now(), now() FROM generate_series(%s, %s) AS n",
                [first, n_runs, start + 1, start + count],
            )
        else:
            cursor.execute(
                f"INSERT INTO {table} ({cols}) WITH RECURSIVE s(n) AS (SELECT %s UNION ALL SELECT n + 1 FROM s "
                f"WHERE n < %s) SELECT %s + n %% %s, 'bench', 'old', 'h-' || n, 'reverted', 0, 0, "
                f"STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now'), STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now') FROM s",
                [start + 1, start + count, first, n_runs],
            )


def analyze() -> None:
    # Every table a scan joins: statistics a test before left on one of them (a million
    # runs and steps, since deleted) would steer the plan elsewhere.
    with connection.cursor() as cursor:
        for model in (EventRunResource, EventRun, EventRunStep):
            table = model._meta.db_table
            cursor.execute(
                f"ANALYZE TABLE {table}" if connection.vendor == "mysql" else f"ANALYZE {table}"
            )
            if connection.vendor == "mysql":
                cursor.fetchall()


def tidy() -> None:
    """After the history's rows are deleted: the tables as a maintained database keeps
    them (autovacuum, InnoDB's purge and statistics). Left with a million dead rows and
    statistics of a million live ones, PostgreSQL planned the next measurement's scan as
    a read of the whole table (12 ms a pass instead of 2), which measured the bench's own
    churn, not the ledger."""
    with connection.cursor() as cursor:
        for model in (EventRunResource, EventRun, EventRunStep, EventRunLog):
            table = connection.ops.quote_name(model._meta.db_table)
            if connection.vendor == "postgresql":
                cursor.execute(f"VACUUM (ANALYZE) {table}")
            elif connection.vendor == "mysql":
                cursor.execute(f"ANALYZE TABLE {table}")
                cursor.fetchall()
            else:
                cursor.execute(f"ANALYZE {table}")


def _names(sql: str, table: str) -> set[str]:
    """The resource table's name and every alias the statement gives it (Django's
    subqueries say ``"events_ledger_eventrunresource" U0``); plans name the alias."""
    aliases = re.findall(rf'[`"]?{table}[`"]?\s+(?:AS\s+)?[`"]?(\w+)[`"]?', sql, re.IGNORECASE)
    keywords = {"where", "on", "inner", "left", "join", "group", "order", "limit", "set"}
    return {table} | {a for a in aliases if a.lower() not in keywords}


def full_scans(scan: Callable[[], Any]) -> list[str]:
    """EXPLAIN each statement of a scan; name those that read the whole resource table,
    or the whole of one of its indexes (as slow, for a table of a million rows)."""
    with CaptureQueriesContext(connection) as captured:
        scan()
    table = EventRunResource._meta.db_table
    found = []
    with connection.cursor() as cursor:
        for query in captured.captured_queries:
            sql = query["sql"]
            if not sql.lstrip().upper().startswith(("SELECT", "UPDATE")):
                continue
            names = _names(sql, table)
            if connection.vendor == "mysql":
                cursor.execute("EXPLAIN " + sql)
                columns = [c[0] for c in cursor.description]
                for row in cursor.fetchall():
                    plan = dict(zip(columns, row, strict=True))
                    # Subqueries reuse aliases (U0 may be the step table in one and the
                    # resource table in another): a plan row whose candidate indexes are
                    # another table's is that table's.
                    keys = str(plan.get("possible_keys") or "").split(",")
                    other = any(k.startswith(("evstep_", "evrun_", "evlog_")) for k in keys)
                    # ALL reads every row; index reads every entry of an index.
                    if (
                        plan.get("table") in names
                        and not other
                        and plan.get("type") in ("ALL", "index")
                    ):
                        found.append(sql[:120])
            elif connection.vendor == "postgresql":
                cursor.execute("EXPLAIN " + sql)
                text = "\n".join(r[0] for r in cursor.fetchall())
                if f"Seq Scan on {table}" in text:
                    found.append(sql[:120])
            else:
                cursor.execute("EXPLAIN QUERY PLAN " + sql)
                for row in cursor.fetchall():
                    # SQLite says SEARCH for a seek; SCAN reads a whole table, or a
                    # whole index of it ("USING [COVERING] INDEX"), which is as bad.
                    words = str(row[-1]).split()
                    if words[:1] == ["SCAN"] and len(words) > 1 and words[1] in names:
                        found.append(sql[:120])
    return found
