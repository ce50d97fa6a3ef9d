"""``manage.py ledger_bench``: what recording and giving back cost on this database."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection as default_connection
from django.db.models import Q

from events_ledger import ledger
from events_ledger.cleanup import sweep
from events_ledger.conf import ledger_settings
from events_ledger.management.base import LedgerCommand
from events_ledger.models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from events_ledger.registry import Action, default_registry

# The backends' own attributes (mysql_is_mariadb, pg_version, ...) are not in the stubs.
connection: Any = default_connection
SCOPE = "ledger-bench"
ACTION = "bench.noop"
Res = EventRunResource.objects


class Counter:
    """Counts the statements this connection sends (an execute wrapper)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        self.n += 1
        return execute(sql, params, many, context)


@contextmanager
def measured() -> Iterator[dict[str, float]]:
    counter = Counter()
    out: dict[str, float] = {}
    start = time.perf_counter()
    with connection.execute_wrapper(counter):
        yield out
    out["seconds"] = time.perf_counter() - start
    out["statements"] = counter.n


def _reconcile_scan() -> None:
    for owner in Res.modules_with_live_rows():
        Res.live_for_module(owner)


def _console_run_list() -> None:
    list(EventRun.objects.with_unresolved_count().order_by("-pk")[:100])


#: What must cost the same over a million historical rows as over ten thousand.
SCANS: dict[str, Callable[[], Any]] = {
    "idle_sweep": sweep,
    "reconcile_scan": _reconcile_scan,
    "console_run_list": _console_run_list,
}


def _noop_perform(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> dict[str, Any]:
    n = int(params.get("n", 50))
    return {
        "ok": True,
        "resources": [{"kind": "thing", "ref": f"{idempotency_key}-{i}"} for i in range(n)],
    }


def _noop_revert(**kwargs: Any) -> dict[str, Any]:
    return {"ok": True}


class Command(LedgerCommand):
    help = (
        "Measure recording and giving back on the configured database, against the original "
        "per-row way, and the idle sweep over many historical rows. Cleans up after itself."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--runs", type=int, default=10, help="runs per measurement (default 10)"
        )
        parser.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
        parser.add_argument(
            "--per-step", type=int, default=50, help="resources each step answers (default 50)"
        )
        parser.add_argument(
            "--history",
            default="10000,1000000",
            help="historical row counts for the idle sweep (default 10000,1000000; '' skips)",
        )
        parser.add_argument(
            "--i-know",
            action="store_true",
            help="run even though the database holds runs that are not the benchmark's",
        )
        self.add_json_argument(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        foreign = EventRun.objects.exclude(scope=SCOPE).count()
        if foreign and not opts["i_know"]:
            raise self.bad_input(
                f"This database holds {foreign} real run(s). The benchmark writes and deletes many "
                "rows; run it on a database of its own, or pass --i-know."
            )
        for name in ("runs", "steps", "per_step"):
            if opts[name] < 1:
                raise self.bad_input(f"--{name.replace('_', '-')} must be at least 1")
        try:
            history = [int(x) for x in opts["history"].split(",") if x.strip()]
        except ValueError:
            raise self.bad_input("--history takes whole numbers separated by commas") from None
        self.as_json = opts["json"]
        self.verbosity = opts["verbosity"]
        from django.conf import settings

        if settings.DEBUG and not self.as_json:
            self.stderr.write(
                "note: DEBUG is on, so Django logs every query; figures are lower than in production."
            )
        self._cleanup()
        results: dict[str, Any] = {"machine": self._machine()}
        with default_registry.isolated() as reg:
            reg.actions.pop(ACTION, None)
            reg.register_action(
                Action(
                    id=ACTION,
                    owner="bench",
                    reversible="ledger",
                    budget_ms=30_000,
                    perform=_noop_perform,
                    revert=_noop_revert,
                )
            )
            try:
                shape = (opts["runs"], opts["steps"], opts["per_step"])
                results["shape"] = dict(
                    zip(("runs", "steps_per_run", "resources_per_step"), shape, strict=True)
                )
                results["ledger"] = self._bulk_way(*shape)
                results["per_row"] = self._per_row_way(*shape)
                results["ratio"] = {
                    "recording": results["ledger"]["recording"]["per_s"]
                    / results["per_row"]["recording"]["per_s"],
                    "giving_back": results["ledger"]["giving_back"]["per_s"]
                    / results["per_row"]["giving_back"]["per_s"],
                }
                if history:
                    results["idle_sweep"] = self._idle_sweeps(history)
            finally:
                self._cleanup()
        if self.as_json:
            self.emit_json(results)
        else:
            self._print(results)

    # ── the ledger's way ──

    def _make_runs(
        self, runs: int, steps: int, per_step: int, tag: str
    ) -> list[tuple[EventRun, list[EventRunStep]]]:
        made = []
        for r in range(runs):
            run = EventRun.objects.create(name=f"bench {tag} {r}", scope=SCOPE, status="running")
            made.append(
                (
                    run,
                    EventRunStep.objects.bulk_create(
                        [
                            EventRunStep(run=run, seq=i, action_id=ACTION, params={"n": per_step})
                            for i in range(steps)
                        ]
                    ),
                )
            )
        return made

    def _bulk_way(self, runs: int, steps: int, per_step: int) -> dict[str, Any]:
        made = self._make_runs(runs, steps, per_step, "ledger")
        total = runs * steps * per_step
        with measured() as rec:
            for _, run_steps in made:
                for step in run_steps:
                    result = ledger.execute_step(step)
                    if result.outcome != "done":
                        raise RuntimeError(f"bench step did not finish: {result}")
        for run, _ in made:
            EventRun.objects.transition(run, "completed", from_="running")
        with measured() as back:
            while sweep(limit=ledger_settings.CLEANUP_RUN_BATCH).runs:
                pass
        left = Res.filter(run__scope=SCOPE).unresolved().count()
        if left:
            raise RuntimeError(f"{left} rows were not given back")
        return {"recording": _figures(rec, total), "giving_back": _figures(back, total)}

    # ── the original design's per-row way, on the same table ──

    def _per_row_way(self, runs: int, steps: int, per_step: int) -> dict[str, Any]:
        made = self._make_runs(runs, steps, per_step, "per-row")
        total = runs * steps * per_step
        with measured() as rec:
            for run, run_steps in made:
                for step in run_steps:
                    answer = _noop_perform(
                        run_id=run.pk, params=step.params, idempotency_key=step.idempotency_key
                    )
                    for entry in answer["resources"]:
                        # Two statements a resource: insert pending, then confirm.
                        reserved = Res.reserve(
                            run, step, owner="bench", kind=entry["kind"], ref=entry["ref"]
                        )
                        if reserved.ok and reserved.id is not None:
                            Res.filter(pk=reserved.id, status="pending").update(status="confirmed")
        for run, _ in made:
            EventRun.objects.transition(run, "completed", from_="running")
        with measured() as back:
            for run, _ in made:
                rows = list(Res.unresolved_for_run(run).select_related("step"))
                by_step: dict[Any, list[EventRunResource]] = {}
                for row in rows:
                    by_step.setdefault(row.step_id, []).append(row)
                for group in by_step.values():
                    # Two statements a resource: claim it, then write its verdict.
                    claimed = [
                        row
                        for row in group
                        if Res.filter(Q(pk=row.pk) & Q(status__in=("pending", "confirmed"))).update(
                            status="reverting"
                        )
                        == 1
                    ]
                    _noop_revert(resources=claimed)
                    for row in claimed:
                        Res.filter(pk=row.pk, status="reverting").update(status="reverted")
                EventRun.objects.set_cleanup_status(run, "complete")
        return {"recording": _figures(rec, total), "giving_back": _figures(back, total)}

    # ── idle sweep over history ──

    def _idle_sweeps(self, sizes: list[int]) -> dict[str, Any]:
        holder = EventRun.objects.create(
            name="bench history", scope=SCOPE, status="completed", cleanup_status="complete"
        )
        out: dict[str, Any] = {"sizes": {}}
        filled = 0
        for size in sorted(sizes):
            with measured() as fill:
                self._fill(holder.pk, filled, size - filled)
            filled = size
            self._analyze()
            figures: dict[str, Any] = {"fill_seconds": fill["seconds"], "full_scans": []}
            for name, scan in SCANS.items():
                timings = []
                for _ in range(15):
                    with measured() as one:
                        scan()
                    timings.append(one["seconds"])
                figures[f"{name}_ms_median"] = statistics.median(timings) * 1000
                figures[f"{name}_statements"] = one["statements"]
                figures["full_scans"] += [f"{name}: {sql}" for sql in self._full_scans(scan)]
            out["sizes"][str(size)] = figures
        first, last = list(out["sizes"].values())[0], list(out["sizes"].values())[-1]
        out["ratio"] = {
            name: (last[f"{name}_ms_median"] / first[f"{name}_ms_median"])
            if first[f"{name}_ms_median"]
            else None
            for name in SCANS
        }
        return out

    def _fill(self, run_id: int, start: int, count: int) -> None:
        """Historical (reverted) rows, in one statement."""
        if count <= 0:
            return
        table = EventRunResource._meta.db_table
        cols = "run_id, owner_module, kind, ref, status, revert_attempts, claim_count, created_at, updated_at"
        vendor = connection.vendor
        with connection.cursor() as cursor:
            if vendor == "mysql" and connection.mysql_is_mariadb:
                cursor.execute(
                    f"INSERT INTO {table} ({cols}) SELECT %s, 'bench', 'old', CONCAT('h-', seq), 'reverted', 0, 0, "
                    f"UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM seq_{start + 1}_to_{start + count}",
                    [run_id],
                )
            elif vendor == "mysql":
                cursor.execute("SET SESSION cte_max_recursion_depth = %s", [count + 10])
                cursor.execute(
                    f"INSERT INTO {table} ({cols}) WITH RECURSIVE s(n) AS (SELECT %s UNION ALL SELECT n + 1 FROM s "
                    f"WHERE n < %s) SELECT %s, 'bench', 'old', CONCAT('h-', n), 'reverted', 0, 0, UTC_TIMESTAMP(6), "
                    f"UTC_TIMESTAMP(6) FROM s",
                    [start + 1, start + count, run_id],
                )
            elif vendor == "postgresql":
                cursor.execute(
                    f"INSERT INTO {table} ({cols}) SELECT %s, 'bench', 'old', 'h-' || n, 'reverted', 0, 0, now(), now() "
                    f"FROM generate_series(%s, %s) AS n",
                    [run_id, start + 1, start + count],
                )
            else:
                cursor.execute(
                    f"INSERT INTO {table} ({cols}) WITH RECURSIVE s(n) AS (SELECT %s UNION ALL SELECT n + 1 FROM s "
                    f"WHERE n < %s) SELECT %s, 'bench', 'old', 'h-' || n, 'reverted', 0, 0, "
                    f"STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now'), STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now') FROM s",
                    [start + 1, start + count, run_id],
                )

    def _analyze(self) -> None:
        with connection.cursor() as cursor:
            for model in (EventRunResource, EventRun):
                table = model._meta.db_table
                cursor.execute(
                    f"ANALYZE TABLE {table}" if connection.vendor == "mysql" else f"ANALYZE {table}"
                )
                if connection.vendor == "mysql":
                    cursor.fetchall()

    def _full_scans(self, scan: Callable[[], Any]) -> list[str]:
        """EXPLAIN each statement of a scan; name those that read the whole resource table."""
        from django.test.utils import CaptureQueriesContext

        with CaptureQueriesContext(connection) as captured:
            scan()
        table = EventRunResource._meta.db_table
        found = []
        with connection.cursor() as cursor:
            for query in captured.captured_queries:
                sql = query["sql"]
                if not sql.lstrip().upper().startswith(("SELECT", "UPDATE")):
                    continue
                if connection.vendor == "mysql":
                    cursor.execute("EXPLAIN " + sql)
                    names = [c[0] for c in cursor.description]
                    for row in cursor.fetchall():
                        plan = dict(zip(names, row, strict=True))
                        if plan.get("table") == table and plan.get("type") == "ALL":
                            found.append(sql[:120])
                elif connection.vendor == "postgresql":
                    cursor.execute("EXPLAIN " + sql)
                    text = "\n".join(r[0] for r in cursor.fetchall())
                    if f"Seq Scan on {table}" in text:
                        found.append(sql[:120])
                else:
                    cursor.execute("EXPLAIN QUERY PLAN " + sql)
                    for row in cursor.fetchall():
                        detail = str(row[-1])
                        # SQLite says SEARCH for a seek; SCAN reads a whole table, or a
                        # whole index of it ("USING [COVERING] INDEX"), which is as bad.
                        if detail.startswith("SCAN") and table in detail:
                            found.append(sql[:120])
        return found

    # ── housekeeping ──

    def _cleanup(self) -> None:
        runs = EventRun.objects.filter(scope=SCOPE)
        Res.filter(run__in=runs).delete()
        EventRunLog.objects.filter(run__in=runs).delete()
        EventRunStep.objects.filter(run__in=runs).delete()
        runs.delete()

    def _machine(self) -> dict[str, Any]:
        import os

        with connection.cursor() as cursor:
            version = (
                connection.Database.sqlite_version
                if connection.vendor == "sqlite"
                else (
                    connection.pg_version
                    if connection.vendor == "postgresql"
                    else ".".join(map(str, connection.mysql_version))
                    + (" MariaDB" if connection.mysql_is_mariadb else "")
                )
            )
            del cursor
        return {
            "database": connection.vendor,
            "version": str(version),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        }

    def _print(self, r: dict[str, Any]) -> None:
        m, s = r["machine"], r["shape"]
        w = self.stdout.write
        w(
            f"database: {m['database']} {m['version']} · {m['cpus']} CPUs · Python {m['python']} · {m['platform']}"
        )
        w(
            f"shape: {s['runs']} runs × {s['steps_per_run']} steps × {s['resources_per_step']} resources"
        )
        w("")
        w(f"{'':28}{'resources/s':>14}{'statements/resource':>22}")
        for way, label in (("ledger", "ledger"), ("per_row", "per-row (original)")):
            for leg in ("recording", "giving_back"):
                f = r[way][leg]
                w(
                    f"{label + ' ' + leg.replace('_', ' '):28}{f['per_s']:>14,.0f}{f['statements_per_resource']:>22.3f}"
                )
        w("")
        w(
            f"ratio ledger / per-row: recording {r['ratio']['recording']:.1f}×, "
            f"giving back {r['ratio']['giving_back']:.1f}×"
        )
        if "idle_sweep" in r:
            w("")
            w("with nothing to do, over historical (reverted) rows:")
            for size, f in r["idle_sweep"]["sizes"].items():
                parts = ", ".join(
                    f"{name.replace('_', ' ')} {f[f'{name}_ms_median']:.2f} ms" for name in SCANS
                )
                w(f"  {int(size):>10,} rows: {parts} (medians)")
                w(
                    f"  {'':>10}       full scans of the resource table: {'; '.join(f['full_scans']) or 'none'}"
                )
            ratios = r["idle_sweep"]["ratio"]
            w(
                "  ratio largest / smallest: "
                + ", ".join(
                    f"{name.replace('_', ' ')} {v:.2f}"
                    for name, v in ratios.items()
                    if v is not None
                )
            )


def _figures(m: dict[str, float], total: int) -> dict[str, float]:
    return {
        "resources": total,
        "seconds": m["seconds"],
        "per_s": total / m["seconds"] if m["seconds"] else 0.0,
        "statements": m["statements"],
        "statements_per_resource": m["statements"] / total,
    }


__all__ = ["Command", "STEP_KIND"]
