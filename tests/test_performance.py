"""Costs that must not grow with the number of resources (issue: performance), and the
benchmark command running end to end. Figures are printed by `ledger_bench`, never asserted."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from events_ledger.cleanup import sweep
from events_ledger.models import EventRun, EventRunResource
from tests.factories import ResourceFactory, RunFactory


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
        "--runs",
        "2",
        "--steps",
        "2",
        "--per-step",
        "5",
        "--history",
        "200,20000",
        "--json",
        stdout=out,
    )
    doc = json.loads(out.getvalue())
    assert doc["ledger"]["recording"]["resources"] == 20
    assert doc["per_row"]["recording"]["statements_per_resource"] == 2.0
    assert set(doc["idle_sweep"]["sizes"]) == {"200", "20000"}
    # EXPLAIN of every statement of an idle sweep over 20,000 historical rows.
    assert doc["idle_sweep"]["sizes"]["20000"]["full_scans"] == []
    assert set(doc["idle_sweep"]["ratio"]) == {"idle_sweep", "reconcile_scan", "console_run_list"}
    assert not EventRun.objects.exists() and not EventRunResource.objects.exists()


@pytest.mark.django_db
def test_ledger_bench_refuses_a_database_with_real_runs():  # bench
    from django.core.management import CommandError

    RunFactory(scope="production")
    with pytest.raises(CommandError, match="real run"):
        call_command("ledger_bench", "--history", "", stdout=StringIO())
