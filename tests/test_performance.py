"""Costs that must not grow with the number of resources (issue: performance), and the
host project's benchmark command (`project.bench`) running end to end. Figures are
printed by `ledger_bench`, never asserted; what it counts is."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.test.utils import CaptureQueriesContext

from events_ledger.cleanup import sweep
from events_ledger.models import EventRun, EventRunLog, EventRunResource, EventRunStep
from tests.factories import ResourceFactory, RunFactory
from tests.helpers import connection


@pytest.mark.django_db
def test_an_idle_sweep_costs_the_same_over_5_and_50_historical_rows():  # C5, flat scans
    def cost(n):
        run = RunFactory(status="completed", cleanup_status="complete")
        for _ in range(n):
            ResourceFactory(run=run, status="reverted")
        with CaptureQueriesContext(connection) as q:
            assert sweep().runs == []
        return len(q)

    assert cost(5) == cost(50)


@pytest.mark.django_db(transaction=True)
def test_ledger_bench_runs_and_cleans_up_after_itself():  # bench
    out = StringIO()
    call_command(
        "ledger_bench",
        "--shapes",
        "1x2,3x2",
        "--calls-runs",
        "2",
        "--calls-groups",
        "2",
        "--revert-ms",
        "1",
        "--history",
        "200,2000",
        "--json",
        stdout=out,
    )
    doc = json.loads(out.getvalue())
    assert doc["durability"]["settings"]  # what a commit meant, read from the database
    assert [(s["resources_per_step"], s["runs"]) for s in doc["shapes"]] == [(1, 2), (3, 2)]
    for shape in doc["shapes"]:
        n, runs = shape["resources_per_step"], shape["runs"]
        assert shape["ledger"]["recording"]["resources"] == n * runs
        # The seeds' protocol, statement for statement, every statement its own commit:
        # 4 + 2n a step, 7 + 2n a run of one step.
        recording, giving_back = shape["per_row"]["recording"], shape["per_row"]["giving_back"]
        assert recording["statements"] == recording["commits"] == (4 + 2 * n) * runs
        assert giving_back["statements"] == giving_back["commits"] == (7 + 2 * n) * runs
        assert shape["ledger"]["giving_back"]["passes"] >= 1
    calls = doc["module_calls"]
    assert (calls["sequential"]["concurrency"], calls["parallel"]["concurrency"]) == (1, 8)
    assert calls["sequential"]["left"] == calls["parallel"]["left"] == 0
    assert set(doc["idle_sweep"]["sizes"]) == {"200", "2000"}
    assert all(isinstance(sql, str) for sql in doc["idle_sweep"]["sizes"]["2000"]["full_scans"])
    assert set(doc["idle_sweep"]["ratio"]) == {"idle_sweep", "reconcile_scan", "console_run_list"}
    assert not EventRun.objects.exists() and not EventRunResource.objects.exists()
    assert not EventRunStep.objects.exists() and not EventRunLog.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_an_idle_sweep_plans_no_read_of_the_whole_resource_table():  # C5
    from project.bench import history

    history.fill("history", 0, 20_000)
    history.analyze()
    # EXPLAIN of every statement of an idle sweep over 20,000 historical rows.
    assert history.full_scans(sweep) == []


@pytest.mark.django_db(transaction=True)
def test_the_bench_counts_a_commit_per_autocommitted_statement_and_per_atomic_block():  # bench
    from django.db import transaction

    from project.bench.meter import measured

    with measured() as counts:
        EventRun.objects.create(name="a")  # autocommitted: its own commit
        EventRun.objects.count()  # a read commits too, writing nothing
        with transaction.atomic():  # one commit for the block, savepoints included
            EventRun.objects.create(name="b")
            with transaction.atomic():
                EventRun.objects.create(name="c")
        try:
            with transaction.atomic():
                EventRun.objects.create(name="d")
                raise RuntimeError
        except RuntimeError:
            pass  # rolled back: no commit
    assert (counts.statements, counts.commits, counts.writing_commits) == (5, 3, 2)


@pytest.mark.django_db(transaction=True)
def test_the_bench_counts_every_round_trip_of_a_transaction():  # bench, #27
    from django.db import connection, transaction

    from project.bench.meter import measured

    EventRun.objects.count()  # the connection's own set-up is not the transaction's
    with measured() as counts:
        with transaction.atomic():
            EventRun.objects.create(name="a")
    # The INSERT and the COMMIT; MariaDB's switches of autocommit (off, on) are sent to
    # the server, PostgreSQL's BEGIN goes before the first statement; SQLite sends its
    # BEGIN as a statement of its own.
    expected = {"mysql": 4, "postgresql": 3, "sqlite": 3}[connection.vendor]
    assert counts.round_trips == expected, counts


@pytest.mark.django_db
def test_ledger_bench_refuses_a_database_with_real_runs():  # bench
    from django.core.management import CommandError

    RunFactory(scope="production")
    with pytest.raises(CommandError, match="real run"):
        call_command("ledger_bench", "--history", "", stdout=StringIO())
    assert EventRun.objects.filter(scope="production").exists()
