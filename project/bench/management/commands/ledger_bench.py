"""``manage.py ledger_bench``: what recording and giving back cost on this database."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from typing import Any

import django
from django.conf import settings
from django.db import connection as default_connection

from events_ledger.conf import ledger_settings
from events_ledger.management.base import LedgerCommand
from events_ledger.models import EventRun
from events_ledger.registry import default_registry
from project.bench import report, shapes
from project.bench.durability import durability
from project.bench.history import idle_sweeps, tidy

# The backends' own attributes (mysql_is_mariadb, pg_version, ...) are not in the stubs.
connection: Any = default_connection


def _shapes(text: str) -> list[tuple[int, int]]:
    """``1x200,10x100`` → [(1, 200), (10, 100)]: resources per step × runs."""
    out = []
    for part in text.split(","):
        resources, _, runs = part.strip().lower().partition("x")
        out.append((int(resources), int(runs)))
    return out


class Command(LedgerCommand):
    help = (
        "Measure recording and giving back on the configured database, the ledger's way "
        "against the original per-row way, the module calls of one sweep pass one after the "
        "other and in parallel, and the idle sweep over many historical rows. Cleans up after "
        "itself; refuses a database that holds runs of its own unless told --i-know."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--shapes",
            # The 1-resource shape the longest: its steps are the quickest, and a ratio
            # taken over a fraction of a second moves most with the shared machine.
            default="1x1000,10x200,50x40",
            help="resources per step × runs, comma-separated (default 1x1000,10x200,50x40)",
        )
        parser.add_argument("--steps", type=int, default=1, help="steps per run (default 1)")
        parser.add_argument(
            "--phased",
            action="store_true",
            help="each step of a run in a phase of its own, given back in reverse (#26)",
        )
        parser.add_argument(
            "--rounds",
            type=int,
            default=4,
            help="rounds each shape's runs are cut into, the two ways taken in turn (default 4)",
        )
        parser.add_argument(
            "--calls-runs",
            type=int,
            default=10,
            help="runs of the module-calls pass (default 10; 0 skips it)",
        )
        parser.add_argument(
            "--calls-groups", type=int, default=10, help="groups (steps) per run there (default 10)"
        )
        parser.add_argument(
            "--revert-ms", type=int, default=50, help="how long its revert sleeps (default 50)"
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=8,
            help="CLEANUP_CONCURRENCY of the parallel pass (the other is 1; default 8)",
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
        foreign = EventRun.objects.exclude(scope=shapes.SCOPE).count()
        if foreign and not opts["i_know"]:
            raise self.bad_input(
                f"This database holds {foreign} real run(s). The benchmark writes and deletes many "
                "rows; run it on a database of its own, or pass --i-know."
            )
        try:
            sizes = _shapes(opts["shapes"])
            history = [int(x) for x in opts["history"].split(",") if x.strip()]
        except ValueError:
            raise self.bad_input(
                "--shapes takes RESOURCESxRUNS pairs and --history whole numbers, "
                "separated by commas"
            ) from None
        numbers = [n for pair in sizes for n in pair] + [
            opts["steps"],
            opts["rounds"],
            opts["calls_groups"],
            opts["concurrency"],
        ]
        if min(numbers) < 1 or opts["calls_runs"] < 0 or opts["revert_ms"] < 0:
            raise self.bad_input("shapes, steps, rounds, groups and concurrency must be at least 1")
        if settings.DEBUG and not opts["json"]:
            self.stderr.write(
                "note: DEBUG is on, so Django logs every query; figures are lower than in production."
            )
        verbose = opts["verbosity"] >= 2
        shapes.delete_runs()
        doc: dict[str, Any] = {
            "machine": self._machine(),
            "durability": durability(),
            # #26: how the ledger gave back: in reverse phase order (the default) or not.
            "order": {
                "give_back_in_order": ledger_settings.GIVE_BACK_IN_ORDER,
                "phased": opts["phased"],
            },
        }
        with default_registry.isolated() as reg:
            shapes.register(reg, opts["revert_ms"])
            try:
                shapes.warm_up()
                doc["shapes"] = []
                for resources, runs in sizes:
                    if verbose:
                        self.stderr.write(f"shape: {resources} resource(s)/step × {runs} runs")
                    shape = shapes.Shape(
                        resources=resources, runs=runs, steps=opts["steps"], phased=opts["phased"]
                    )
                    doc["shapes"].append(shapes.both_ways(shape, opts["rounds"]))
                if opts["calls_runs"]:
                    if verbose:
                        self.stderr.write("module calls: sequential, then parallel")
                    doc["module_calls"] = shapes.module_calls(
                        opts["calls_runs"],
                        opts["calls_groups"],
                        opts["revert_ms"],
                        opts["concurrency"],
                    )
                if history:
                    if verbose:
                        self.stderr.write(f"idle sweep over {history} historical rows")
                    doc["idle_sweep"] = idle_sweeps(history, shapes.SCOPE)
            finally:
                shapes.delete_runs()
                if history:
                    tidy()
        # The machine is shared: how busy it was says how far to trust the absolute figures.
        doc["machine"]["load_at_end"] = os.getloadavg()[0]
        if opts["json"]:
            self.emit_json(doc)
        else:
            self.stdout.write(report.text(doc))

    def _machine(self) -> dict[str, Any]:
        if connection.vendor == "sqlite":
            server, version = "SQLite", connection.Database.sqlite_version
        elif connection.vendor == "postgresql":
            connection.ensure_connection()
            v = connection.pg_version
            server, version = "PostgreSQL", f"{v // 10000}.{v % 10000}"
        else:
            server = "MariaDB" if connection.mysql_is_mariadb else "MySQL"
            version = ".".join(map(str, connection.mysql_version))
        return {
            "database": connection.vendor,
            "server": server,
            "version": str(version),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "django": django.get_version(),
            "platform": platform.platform(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "load_at_start": os.getloadavg()[0],
        }
