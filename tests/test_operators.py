"""Operators see it at a glance and get paged (#15): signals, Prometheus metrics, the health
check and ``ledger_status``, the admin dashboard and timeline, log records with context."""

from __future__ import annotations

import json
import logging
import sys
import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import Permission, User
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from events_ledger import Action, Lease, signals
from events_ledger.cleanup import cleanup_run, reconcile_module, sweep
from events_ledger.ledger import execute_step
from events_ledger.logcontext import FIELDS, LogContextFilter, log_context
from events_ledger.models import EventRun, EventRunResource, EventRunStep
from events_ledger.status import snapshot
from tests.factories import ResourceFactory, RunFactory, StepFactory
from tests.helpers import connection, ledger_action, new_step, wait_until

Res = EventRunResource.objects
TOKEN = "s3cret-token-for-prometheus"
REFUSED = {"ok": False, "retry": False, "error": "the shard refused: region locked"}


def finished_run(
    action: str = "t.make", rows: int = 2, owner: str = "t", status: str = "completed"
) -> EventRun:
    """A run (completed unless said) whose one step made ``rows`` confirmed rows."""
    run = RunFactory(status=status, cleanup_status="pending")
    step = new_step(run, action)
    for _ in range(rows):
        ResourceFactory(run=run, step=step, owner_module=owner)
    return run


class Heard:
    """A receiver that keeps what each signal sent it (strongly referenced)."""

    def __init__(self, *sigs: object) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.sigs = sigs
        for sig in sigs:
            sig.connect(self, weak=False)  # type: ignore[attr-defined]

    def __call__(self, signal, sender, **kwargs):
        name = signals.NAMES[id(signal)]
        # The rows are read now, right after the commit, as a receiver would.
        if "resources" in kwargs:
            kwargs["rows"] = sorted(kwargs["resources"].values_list("pk", flat=True))
        self.calls.append((name, {"sender": sender, **kwargs}))

    def named(self, name: str) -> list[dict]:
        return [kw for n, kw in self.calls if n == name]

    def close(self) -> None:
        for sig in self.sigs:
            sig.disconnect(self)  # type: ignore[attr-defined]


@pytest.fixture
def heard():
    ears = Heard(
        signals.cleanup_incomplete,
        signals.cleanup_complete,
        signals.lease_drifted,
        signals.resources_orphaned,
        signals.step_failed,
        signals.cleanup_worked,
    )
    yield ears
    ears.close()


# ── signals ──


@pytest.mark.django_db
def test_incomplete_and_complete_are_sent_with_the_run_and_its_rows(
    isolated_registry, heard, django_capture_on_commit_callbacks
):  # #15: signals
    ledger_action(isolated_registry, "t.dead", revert=lambda **_: REFUSED)
    ledger_action(isolated_registry, "t.make")
    dead, fine = finished_run("t.dead"), finished_run("t.make")
    with django_capture_on_commit_callbacks(using=connection.alias, execute=True):
        sweep()
    [incomplete] = heard.named("cleanup_incomplete")
    assert incomplete["sender"] is EventRun
    assert incomplete["run"].pk == dead.pk and incomplete["run"].cleanup_status == "incomplete"
    stuck = sorted(Res.filter(run=dead).values_list("pk", flat=True))
    assert incomplete["rows"] == stuck and len(stuck) == 2
    assert incomplete["summary"].cleanup_status == "incomplete"
    [complete] = heard.named("cleanup_complete")
    assert complete["run"].pk == fine.pk and complete["run"].cleanup_status == "complete"
    assert complete["rows"] == sorted(Res.filter(run=fine).values_list("pk", flat=True))
    assert set(Res.filter(run=fine).values_list("status", flat=True)) == {"reverted"}
    worked = {kw["run"].pk: kw["summary"] for kw in heard.named("cleanup_worked")}
    assert (worked[fine.pk].reverted, worked[dead.pk].failed) == (2, 2)


@pytest.mark.django_db(transaction=True)
def test_signals_wait_for_the_commit_and_a_rollback_sends_none(
    isolated_registry, heard
):  # #15: sent after the state change is committed
    from events_ledger import InCallersTransaction

    ledger_action(isolated_registry, "t.make")
    run = finished_run("t.make")
    cleanup_run(run)
    assert [n for n, _ in heard.calls] == ["cleanup_worked", "cleanup_complete"]

    # Inside a host's transaction a cleanup is refused before it claims anything (its
    # claims would be savepoints there), so a rollback has nothing to take back.
    heard.calls.clear()
    other = finished_run("t.make")
    with pytest.raises(InCallersTransaction), transaction.atomic(using=connection.alias):
        cleanup_run(other)
    assert heard.calls == []
    assert Res.filter(run=other, status="confirmed").count() == 2  # nothing was claimed


@pytest.mark.django_db
def test_a_drifted_lease_is_signalled(
    isolated_registry, heard, django_capture_on_commit_callbacks
):  # #15: a lease was found drifted
    isolated_registry.register_lease(
        Lease(
            id="t.rate",
            owner="t",
            read=lambda **_: 1,
            apply=lambda *a, **_: {"ok": True},
            restore=lambda *a, **_: {"drifted": True, "current": 42},
        )
    )
    run = RunFactory(status="cancelled", cleanup_status="pending")
    row = ResourceFactory(
        run=run, kind="override", ref="t.rate#north", payload={"baseline": 1, "applied": 5}
    )
    with django_capture_on_commit_callbacks(using=connection.alias, execute=True):
        summary = cleanup_run(run)
    assert summary.drifted == 1
    [drifted] = heard.named("lease_drifted")
    assert drifted["run"].pk == run.pk and drifted["rows"] == [row.pk]
    assert Res.get(pk=row.pk).status == "drifted"


@pytest.mark.django_db
def test_orphaned_rows_are_signalled_per_run_with_their_module(
    isolated_registry, heard, django_capture_on_commit_callbacks
):  # #15: resources were orphaned by reconcile
    ledger_action(isolated_registry, "t.make", reconcile=lambda **_: {"ok": True, "in_force": []})
    a = finished_run("t.make", status="running")
    b = finished_run("t.make", status="running")
    with django_capture_on_commit_callbacks(using=connection.alias, execute=True):
        summary = reconcile_module("t", force=True)
    assert summary.orphaned == 4
    sent = {kw["run"].pk: kw for kw in heard.named("resources_orphaned")}
    assert set(sent) == {a.pk, b.pk}
    for run in (a, b):
        assert sent[run.pk]["owner"] == "t"
        assert sent[run.pk]["rows"] == sorted(Res.filter(run=run).values_list("pk", flat=True))


@pytest.mark.django_db(transaction=True)
def test_a_step_failed_for_good_is_signalled_with_its_rows(
    isolated_registry, heard
):  # #15: a step failed for good
    isolated_registry.register_action(
        Action(
            id="t.refuse",
            owner="t",
            reversible="ledger",
            perform=lambda **_: REFUSED,
            revert=lambda **_: {"ok": True},
        )
    )
    run = RunFactory(status="running")
    step = new_step(run, "t.refuse")
    assert execute_step(step).outcome == "failed"
    [failed] = heard.named("step_failed")
    assert failed["sender"] is EventRunStep
    assert (failed["run"].pk, failed["step"].pk) == (run.pk, step.pk)
    assert failed["error"] == REFUSED["error"]
    # Its placeholder stays: cleanup gives back by key what the refused call may have made.
    assert failed["rows"] == list(Res.filter(step=step).values_list("pk", flat=True))
    assert len(failed["rows"]) == 1


@pytest.mark.django_db
def test_a_raising_receiver_is_logged_and_breaks_nothing(
    isolated_registry, heard, caplog, django_capture_on_commit_callbacks
):  # #15: a receiver that raises never breaks a step or a sweep
    def broken(sender, **kwargs):
        raise ValueError("the pager is down")

    signals.cleanup_complete.connect(broken, weak=False)
    try:
        ledger_action(isolated_registry, "t.make")
        run = finished_run("t.make")
        with caplog.at_level(logging.ERROR, "events_ledger"):
            with django_capture_on_commit_callbacks(using=connection.alias, execute=True):
                report = sweep()
    finally:
        signals.cleanup_complete.disconnect(broken)
    assert [s.cleanup_status for s in report.runs] == ["complete"]
    assert [kw["run"].pk for kw in heard.named("cleanup_complete")] == [run.pk]  # others heard
    [record] = [
        r
        for r in caplog.records
        if r.name == "events_ledger" and "the pager is down" in r.getMessage()
    ]
    assert "cleanup_complete" in record.getMessage() and record.exc_info is not None
    assert record.run_id == run.pk  # type: ignore[attr-defined]


# ── metrics ──


def metric_families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(families: dict, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in families[name].samples}


def scrape(client: Client | None = None, **headers) -> dict:
    client = client or Client()
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content
    return metric_families(response.content.decode())


@pytest.mark.django_db
def test_the_collector_reads_where_the_ledger_stands(settings):  # #15: metrics
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "METRICS_TOKEN": TOKEN,
    }
    stuck = RunFactory(status="completed", cleanup_status="incomplete")
    ResourceFactory(run=stuck, owner_module="world", revert_attempts=3)  # spent
    ResourceFactory(run=stuck, owner_module="world", status="orphaned", claim_count=1)  # poison
    owing = RunFactory(status="running", cleanup_status="pending")
    old = ResourceFactory(run=owing, owner_module="banners")
    Res.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(hours=2))
    ResourceFactory(run=owing, owner_module="banners", status="reverted")  # not unresolved
    StepFactory(run=owing, action_id="banners.post", status="running", claimed_at=timezone.now())
    StepFactory(
        run=owing,
        action_id="banners.post",
        status="running",
        claimed_at=timezone.now() - timedelta(days=1),  # its process died
    )
    families = scrape(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    runs = samples(families, "events_ledger_runs")
    assert runs[(("cleanup_status", "incomplete"), ("finished", "true"))] == 1
    assert runs[(("cleanup_status", "pending"), ("finished", "false"))] == 1
    # #25: finished runs given back are history, not counted (the count would grow).
    assert (("cleanup_status", "complete"), ("finished", "true")) not in runs
    assert (("cleanup_status", "not_required"), ("finished", "true")) not in runs
    assert samples(families, "events_ledger_unresolved_resources") == {
        (("owner", "banners"), ("status", "confirmed")): 1,
        (("owner", "world"), ("status", "confirmed")): 1,
        (("owner", "world"), ("status", "orphaned")): 1,
    }
    ages = samples(families, "events_ledger_oldest_unresolved_resource_age_seconds")
    assert 2 * 3600 - 60 < ages[(("owner", "banners"),)] < 2 * 3600 + 600
    assert samples(families, "events_ledger_poison_resources")[(("owner", "world"),)] == 1
    assert samples(families, "events_ledger_spent_resources")[(("owner", "world"),)] == 1
    assert samples(families, "events_ledger_steps_in_flight") == {(("action", "banners.post"),): 1}
    assert samples(families, "events_ledger_steps_stale_claims") == {
        (("action", "banners.post"),): 1
    }
    assert samples(families, "events_ledger_healthy") == {(): 0}  # a run is incomplete


def _bulk_rows(n: int) -> None:
    run = RunFactory(status="running", cleanup_status="pending")
    owners = ["alpha", "beta", "gamma"]
    Res.bulk_create(
        EventRunResource(
            run=run,
            owner_module=owners[i % 3],
            kind="thing",
            ref=f"r-{n}-{i}",
            status=["confirmed", "reverted", "orphaned", "pending"][i % 4],
            claim_count=i % 2,
        )
        for i in range(n)
    )
    EventRunStep.objects.bulk_create(
        EventRunStep(run=run, action_id=f"t.a{i % 3}", status="running", claimed_at=timezone.now())
        for i in range(min(n, 50))
    )


@pytest.mark.django_db
def test_a_scrape_costs_the_same_queries_for_10_and_1000_rows():  # #15: a fixed number
    from events_ledger.metrics import LedgerCollector

    def cost() -> int:
        with CaptureQueriesContext(connection) as q:
            list(LedgerCollector().collect())
        return len(q)

    _bulk_rows(10)
    ten = cost()
    _bulk_rows(1000)
    assert Res.count() == 1010
    assert cost() == ten == 3  # runs, unresolved rows, steps


@pytest.mark.django_db
def test_registering_the_collector_reads_nothing():  # #15: importable for hosts
    from prometheus_client import CollectorRegistry, generate_latest

    from events_ledger.metrics import LedgerCollector

    registry = CollectorRegistry(auto_describe=True)
    with CaptureQueriesContext(connection) as q:
        registry.register(LedgerCollector())
    assert len(q) == 0
    assert b"events_ledger_healthy 1.0" in generate_latest(registry)


def operator(name: str, staff: bool = True, may_view: bool = True) -> User:
    user = User.objects.create_user(name, is_staff=staff)
    if may_view:
        user.user_permissions.add(Permission.objects.get(codename="view_eventrun"))
    return user


@pytest.mark.django_db
@pytest.mark.parametrize(
    "who,token,status",
    [
        ("anonymous", None, 401),
        ("anonymous", "wrong-token-wrong-token", 401),
        ("anonymous", TOKEN, 200),
        ("user", None, 403),  # logged in, not staff
        ("staff", None, 403),  # #25: staff, without the permission to view runs
        ("viewer", None, 200),  # staff who may view runs, as the dashboard asks
        ("viewer", "wrong-token-wrong-token", 401),  # a wrong token is refused, session or not
    ],
)
def test_metrics_need_the_view_permission_or_the_bearer_token(settings, who, token, status):
    # #15, #25: /metrics protected like the dashboard (view_eventrun), not any staff
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "METRICS_TOKEN": TOKEN,
    }
    client = Client()
    if who != "anonymous":
        client.force_login(operator(who, staff=who != "user", may_view=who == "viewer"))
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    response = client.get("/metrics", **headers)
    assert response.status_code == status
    if status == 401:
        assert response["WWW-Authenticate"].startswith("Bearer")
    assert response["Cache-Control"].startswith("max-age=0")


@pytest.mark.django_db
def test_without_a_token_setting_no_token_is_accepted(settings):  # #15: /metrics protected
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "METRICS_TOKEN": None,
    }
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer anything-at-all").status_code == 401


def counter(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.django_db
def test_the_process_counts_what_it_did(
    isolated_registry, django_capture_on_commit_callbacks
):  # #15: counters of reverts, failures, fenced verdicts, time per module call
    ledger_action(isolated_registry, "t.make")
    ledger_action(isolated_registry, "t.no", revert=lambda **_: {"ok": False, "error": "no"})
    finished_run("t.make", rows=3)
    finished_run("t.no", rows=2)
    before = {
        "reverted": counter("events_ledger_resources_reverted_total"),
        "failed": counter("events_ledger_revert_failures_total"),
        "calls": counter(
            "events_ledger_module_call_seconds_count", call="t.make.revert", outcome="answered"
        ),
    }
    with django_capture_on_commit_callbacks(using=connection.alias, execute=True):
        sweep()
    assert counter("events_ledger_resources_reverted_total") - before["reverted"] == 3
    assert counter("events_ledger_revert_failures_total") - before["failed"] == 2
    calls = counter(
        "events_ledger_module_call_seconds_count", call="t.make.revert", outcome="answered"
    )
    assert calls - before["calls"] == 1

    # A fenced verdict, as a sweeper taken over mid-call reports it.
    from events_ledger.cleanup import CleanupSummary

    fenced = counter("events_ledger_fenced_verdicts_total")
    run = RunFactory(status="completed")
    summary = CleanupSummary(run_id=run.pk, attempted=1, fenced=1, cleanup_status="pending")
    signals.cleanup_worked.send(sender=EventRun, run=run, summary=summary)
    assert counter("events_ledger_fenced_verdicts_total") - fenced == 1


def test_a_call_past_its_deadline_is_counted_then_timed_when_it_ends():  # #15: time per call
    from events_ledger.deadline import call_with_deadline

    gate = threading.Event()
    what = "t.slow.revert"
    overdue = counter("events_ledger_module_calls_overdue_total", call=what)
    ended = counter("events_ledger_module_call_seconds_count", call=what, outcome="raised")
    call = call_with_deadline(lambda: gate.wait(30) and 1 / 0, 0.05, what, late=lambda _: None)
    assert call.timed_out
    assert counter("events_ledger_module_calls_overdue_total", call=what) - overdue == 1
    gate.set()
    wait_until(
        lambda: (
            counter("events_ledger_module_call_seconds_count", call=what, outcome="raised")
            == ended + 1
        ),
        "the late call to be timed",
    )
    assert counter("events_ledger_module_call_seconds_sum", call=what, outcome="raised") >= 0.05


@pytest.mark.django_db
def test_the_view_serves_the_counters_beside_the_gauges(admin_client):  # #15: metrics view
    families = scrape(admin_client)
    assert "events_ledger_runs" in families and "events_ledger_resources_reverted" in families
    # #25: the ledger's own metrics only: not the web process's versions and figures.
    assert all(name.startswith("events_ledger_") for name in families), sorted(families)
    assert families["events_ledger_module_call_seconds"].type == "histogram"
    openmetrics = admin_client.get("/metrics", HTTP_ACCEPT="application/openmetrics-text")
    assert openmetrics["Content-Type"].startswith("application/openmetrics-text")
    assert openmetrics.content.decode().rstrip().endswith("# EOF")


# ── a million rows: no full scan (EXPLAIN) ──


def fill(model, count: int, start: int = 0, status: str = "reverted") -> None:
    """``count`` rows in one INSERT … SELECT, as the benchmark fills its history."""
    run = RunFactory(status="completed", cleanup_status="complete")
    table = model._meta.db_table
    vendor = connection.vendor
    if model is EventRun:
        # #25: finished runs given back, the history every scrape must not count.
        cols = "name, scope, status, cleanup_status, created_at, updated_at"
        values = "{ref}, 'bench', %s, %s, {now}, {now}"
    elif model is EventRunResource:
        cols = "run_id, owner_module, kind, ref, status, revert_attempts, claim_count, created_at, updated_at"
        values = "%s, 'bench', 'old', {ref}, %s, 0, 0, {now}, {now}"
    else:
        cols = "run_id, phase, seq, action_id, params, idempotency_key, status, attempts, created_at, updated_at"
        values = "%s, 'main', 0, 'bench.old', '{{}}', {ref}, %s, 1, {now}, {now}"
    # A run's row is its own (status, cleanup status); a step's or a resource's names its run.
    lead = "completed" if model is EventRun else run.pk
    with connection.cursor() as cursor:
        if vendor == "mysql":
            sql = values.format(ref="CONCAT('h-', seq)", now="UTC_TIMESTAMP(6)")
            cursor.execute(
                f"INSERT INTO {table} ({cols}) SELECT {sql} FROM seq_{start + 1}_to_{start + count}",
                [lead, status],
            )
        elif vendor == "postgresql":
            sql = values.format(ref="'h-' || n", now="now()")
            cursor.execute(
                f"INSERT INTO {table} ({cols}) SELECT {sql} FROM generate_series(%s, %s) AS n",
                [lead, status, start + 1, start + count],
            )
        else:
            now = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"
            sql = values.format(ref="'h-' || n", now=now)
            cursor.execute(
                f"INSERT INTO {table} ({cols}) WITH RECURSIVE s(n) AS (SELECT %s UNION ALL "
                f"SELECT n + 1 FROM s WHERE n < %s) SELECT {sql} FROM s",
                [start + 1, start + count, lead, status],
            )


def full_scans(queries: list[str], tables: set[str]) -> list[str]:
    """Statements whose plan reads one of ``tables`` whole (or a whole index of it)."""
    found = []
    with connection.cursor() as cursor:
        for sql in queries:
            if connection.vendor == "mysql":
                cursor.execute("EXPLAIN " + sql)
                names = [c[0] for c in cursor.description]
                for row in cursor.fetchall():
                    plan = dict(zip(names, row, strict=True))
                    if plan.get("table") in tables and plan.get("type") in ("ALL", "index"):
                        found.append(f"{plan}: {sql}")
            elif connection.vendor == "postgresql":
                cursor.execute("EXPLAIN " + sql)
                text = "\n".join(r[0] for r in cursor.fetchall())
                if any(f"Seq Scan on {t}" in text for t in tables):
                    found.append(f"{text}\n{sql}")
            else:
                cursor.execute("EXPLAIN QUERY PLAN " + sql)
                for row in cursor.fetchall():
                    detail = str(row[-1])
                    # SEARCH is a seek; SCAN reads a table, or a whole index of it.
                    if detail.startswith("SCAN") and any(t in detail for t in tables):
                        found.append(f"{detail}: {sql}")
    return found


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_no_full_scan_of_the_ledger_at_a_million_rows():  # #15, #25: no full scan (EXPLAIN)
    from events_ledger.metrics import LedgerCollector

    # SQLite fills row by row in its CTE: a tenth is enough to show its plans.
    history = 1_000_000 if connection.vendor != "sqlite" else 100_000
    fill(EventRunResource, history)
    fill(EventRunResource, 300, start=history, status="confirmed")
    fill(EventRunStep, history)
    fill(EventRunStep, 20, start=history, status="running")
    fill(EventRun, history, status="complete")  # #25: the runs' history, never counted
    fill(EventRun, 30, start=history, status="incomplete")
    EventRunStep.objects.filter(status="running").update(claimed_at=timezone.now())
    with connection.cursor() as cursor:
        for model in (EventRunResource, EventRunStep, EventRun):
            table = model._meta.db_table
            cursor.execute(
                f"ANALYZE TABLE {table}" if connection.vendor == "mysql" else f"ANALYZE {table}"
            )
            if connection.vendor == "mysql":
                cursor.fetchall()
    assert Res.count() == history + 300
    with CaptureQueriesContext(connection) as scrape_q:
        list(LedgerCollector().collect())
    with CaptureQueriesContext(connection) as detail_q:
        snapshot(details=True)  # ledger_status, the dashboard
    queries = [q["sql"] for q in scrape_q.captured_queries + detail_q.captured_queries]
    tables = {
        EventRunResource._meta.db_table,
        EventRunStep._meta.db_table,
        EventRun._meta.db_table,  # #25: the runs behind health and metrics too
    }
    found = full_scans(queries, tables)
    assert found == [], "\n".join(found)
    # The check is not blind: a filter on an unindexed column reads the table whole.
    with CaptureQueriesContext(connection) as blind:
        Res.filter(member_key="x").exists()
    assert full_scans([q["sql"] for q in blind.captured_queries], tables)


# ── the health check and ledger_status ──


@pytest.mark.django_db
def test_an_anonymous_health_probe_gets_the_verdict_only(settings):  # #25: health details
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "METRICS_TOKEN": TOKEN,
    }
    stuck = RunFactory(status="completed", cleanup_status="incomplete")
    ResourceFactory(run=stuck, owner_module="secret-module", revert_attempts=3)

    def ledger(client: Client, **headers: str) -> tuple[int, str]:
        response = client.get("/health/ledger/", HTTP_ACCEPT="application/json", **headers)
        return response.status_code, response.json()["LedgerNeedsHumanCheck()"]

    status, text = ledger(Client())
    assert status == 500 and "needs a human" in text
    assert f"run {stuck.pk}" not in text and "secret-module" not in text
    for fmt in ("text/plain", "text/html"):  # every rendering of the view
        body = Client().get("/health/ledger/", HTTP_ACCEPT=fmt).content.decode()
        assert f"(run {stuck.pk})" not in body and "needs a human" in body
    staff = Client()
    staff.force_login(operator("staff", may_view=False))  # staff, not allowed to view runs
    assert f"(run {stuck.pk})" not in ledger(staff)[1]
    viewer = Client()
    viewer.force_login(operator("viewer"))
    assert f"1 run(s) incomplete (run {stuck.pk})" in ledger(viewer)[1]
    assert f"(run {stuck.pk})" in ledger(Client(), HTTP_AUTHORIZATION=f"Bearer {TOKEN}")[1]
    wrong = ledger(Client(), HTTP_AUTHORIZATION="Bearer wrong-token-wrong-token")
    assert wrong[0] == 500 and f"(run {stuck.pk})" not in wrong[1]


@pytest.mark.django_db
def test_the_health_check_through_django_health_checks_view(settings):  # #15: health check
    client = Client()
    client.force_login(operator("ops"))  # #25: details for staff who may view runs

    def health() -> tuple[int, dict]:
        response = client.get("/health/ledger/", HTTP_ACCEPT="application/json")
        return response.status_code, response.json()

    ResourceFactory(run=RunFactory(status="running"))  # young, owed later: healthy
    assert health() == (200, {"LedgerNeedsHumanCheck()": "OK"})

    stuck = RunFactory(status="completed", cleanup_status="incomplete")
    status, body = health()
    assert status == 500
    assert f"1 run(s) incomplete (run {stuck.pk})" in body["LedgerNeedsHumanCheck()"]

    EventRun.objects.filter(pk=stuck.pk).update(cleanup_status="complete")
    assert health()[0] == 200
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "HEALTH_MAX_UNRESOLVED_AGE": 60,
    }
    Res.update(created_at=timezone.now() - timedelta(minutes=5))
    status, body = health()
    assert status == 500
    assert (
        "older than HEALTH_MAX_UNRESOLVED_AGE (1m 0s); module(s): test"
        in body["LedgerNeedsHumanCheck()"]
    )


@pytest.mark.django_db
def test_a_run_that_needs_a_human_never_takes_a_node_out_of_rotation():  # #15, #25
    # On a419c07 /health/ answered 500 for any incomplete run: every web node out of a
    # load balancer's rotation. Its anonymous probe cost one query of the ledger.
    from django.test.utils import CaptureQueriesContext

    RunFactory(status="completed", cleanup_status="incomplete")
    with CaptureQueriesContext(connection) as read:
        response = Client().get("/health/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    assert response.json() == {"Database(alias='default')": "OK", "LedgerHealthCheck()": "OK"}
    ledger = [q for q in read.captured_queries if "events_ledger" in q["sql"]]
    assert len(ledger) == 1
    # The alert's endpoint says so; a flood of anonymous probes reuses one verdict.
    assert Client().get("/health/ledger/").status_code == 500
    with CaptureQueriesContext(connection) as again:
        assert Client().get("/health/ledger/").status_code == 500
    assert not [q for q in again.captured_queries if "events_ledger" in q["sql"]]


@pytest.mark.django_db
def test_ledger_status_prints_one_screen_and_exits_1_when_unhealthy():  # #15: ledger_status
    out = StringIO()
    call_command("ledger_status", stdout=out)
    assert out.getvalue().startswith("events ledger: healthy")

    run = RunFactory(status="completed", cleanup_status="incomplete")
    ResourceFactory(run=run, owner_module="world", revert_attempts=3, last_error="refused")
    out = StringIO()
    with pytest.raises(CommandError, match="the ledger is unhealthy") as exit_:
        call_command("ledger_status", "--verbosity", "2", stdout=out)
    assert exit_.value.returncode == 1
    text = out.getvalue()
    assert text.startswith("events ledger: UNHEALTHY")
    assert f"1 run(s) incomplete (run {run.pk})" in text
    assert "world  confirmed 1; oldest" in text and "left for a human 1" in text
    assert ": refused" in text  # verbosity 2 shows the errors

    out = StringIO()
    with pytest.raises(CommandError):
        call_command("ledger_status", "--json", stdout=out)
    doc = json.loads(out.getvalue())
    assert doc["healthy"] is False and doc["runs"]["incomplete"] == [run.pk]
    assert doc["unresolved"]["modules"]["world"]["spent"] == 1

    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError):
        call_command("ledger_status", "--verbosity", "0", stdout=out, stderr=err)
    assert out.getvalue() == err.getvalue() == ""


# ── optional packages ──


@pytest.mark.django_db
def test_without_the_extras_the_features_say_how_to_get_them(monkeypatch, settings):
    # #15: prometheus_client and django-health-check are optional extras.
    from events_ledger import checks, metrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImproperlyConfigured, match=r"django-events-ledger\[metrics\]"):
        metrics.LedgerCollector()
    monkeypatch.setattr(metrics, "counters_available", lambda: False)
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "METRICS_TOKEN": TOKEN,
    }
    assert [e.id for e in checks.check_settings()] == ["events_ledger.E009"]

    monkeypatch.setitem(sys.modules, "health_check.base", None)
    monkeypatch.delitem(sys.modules, "events_ledger.health", raising=False)
    with pytest.raises(ImproperlyConfigured, match=r"django-events-ledger\[health\]"):
        __import__("events_ledger.health")


@pytest.mark.parametrize(
    "key,value",
    [
        ("METRICS_TOKEN", "short"),
        ("METRICS_TOKEN", 1234567890123456789),
        ("METRICS_TOKEN", "a" * 16),
        ("METRICS_TOKEN", b"0123456789abcdefghij"),
        ("HEALTH_MAX_UNRESOLVED_AGE", 0),
        ("HEALTH_MAX_UNRESOLVED_AGE", "1 day"),
    ],
)
def test_the_new_settings_are_checked(settings, key, value):  # #15, S4
    from events_ledger.checks import check_settings

    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, key: value}
    [error] = check_settings()
    assert error.id == "events_ledger.E006" and key in error.msg
    # A token is never printed back, whatever its type.
    assert all(secret not in error.msg for secret in ("short", "1234567890", "aaaa", "0123456"))


def test_a_wrong_token_setting_refuses_bearers_without_a_500(settings):  # #15, S4
    from django.test import Client

    for wrong in (1234567890123456789, "a" * 16):
        settings.EVENTS_LEDGER = {
            **settings.EVENTS_LEDGER,
            **settings.EVENTS_LEDGER,
            "METRICS_TOKEN": wrong,
        }
        resp = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {wrong}")
        assert resp.status_code == 401  # on a419c07 the int was a 500, "a" * 16 let in


# ── log records with context ──


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records():
    handler = Records()
    logger = logging.getLogger("events_ledger")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.mark.django_db(transaction=True)
def test_a_steps_records_carry_its_run_step_action_and_owner(
    isolated_registry, records
):  # #15: log records with context
    def perform(**_):
        # The module's own record, in the call's thread: the step's context went with it.
        logging.getLogger("events_ledger").info("inside perform")
        return {"ok": True, "resources": [{"kind": "thing", "ref": "a"}, "not a mapping"]}

    isolated_registry.register_action(
        Action(id="t.half", owner="t", reversible="ledger", perform=perform, revert=lambda **_: {})
    )
    run = RunFactory(status="running")
    step = new_step(run, "t.half")
    execute_step(step)
    expected = {"run_id": run.pk, "step_id": step.pk, "action": "t.half", "owner": "t"}
    inside = [r for r in records if r.getMessage() == "inside perform"]
    refused = [r for r in records if "refused 1 reported resource" in r.getMessage()]
    assert inside and refused
    for record in inside + refused:
        assert {f: getattr(record, f) for f in FIELDS} == expected
    # A format string (or a JSON handler) names them like any other field.
    line = logging.Formatter("run=%(run_id)s step=%(step_id)s %(action)s/%(owner)s").format(
        refused[0]
    )
    assert line == f"run={run.pk} step={step.pk} t.half/t"


@pytest.mark.django_db
def test_the_sweeps_and_reconciles_records_carry_context_every_record_every_field(
    isolated_registry, records, monkeypatch
):  # #15: log records with context
    import events_ledger.cleanup as cleanup

    ledger_action(isolated_registry, "t.make", reconcile=lambda **_: "garbage")
    run = finished_run("t.make", rows=1)
    step_id = Res.get(run=run).step_id
    monkeypatch.setattr(cleanup, "_give_back", lambda group, rows: 1 / 0)
    sweep()
    other = finished_run("t.make", rows=1, status="running")
    reconcile_module("t")
    assert records and all(hasattr(r, f) for r in records for f in FIELDS)  # never missing
    [gave] = [r for r in records if r.getMessage().startswith("giving back t.make failed")]
    assert (gave.run_id, gave.step_id, gave.action, gave.owner) == (run.pk, step_id, "t.make", "t")
    unanswered = [r for r in records if "reconcile of t.make unanswered" in r.getMessage()]
    assert {(r.owner, r.action) for r in unanswered} == {("t", "t.make")}
    assert {r.run_id for r in unanswered} == {run.pk, other.pk}


def test_the_context_is_scoped_and_an_explicit_extra_wins():  # #15: log records with context
    record = logging.LogRecord("events_ledger", logging.INFO, __file__, 1, "x", (), None)
    with log_context(run_id=1, owner="w"):
        with log_context(step_id=2):
            LogContextFilter().filter(record)
        assert (record.run_id, record.step_id, record.owner, record.action) == (1, 2, "w", None)
        outer = logging.LogRecord("events_ledger", logging.INFO, __file__, 1, "x", (), None)
        LogContextFilter().filter(outer)
        assert outer.step_id is None
    explicit = logging.LogRecord("events_ledger", logging.INFO, __file__, 1, "x", (), None)
    explicit.run_id = 9
    with log_context(run_id=1):
        LogContextFilter().filter(explicit)
    assert explicit.run_id == 9
    with pytest.raises(TypeError, match="unknown log context fields"):
        with log_context(module="x"):
            pass


# ── the dashboard and the timeline (server side; the browser test draws them) ──


def viewer(is_staff: bool = True, perms: tuple[str, ...] = ("view_eventrun",)) -> Client:
    user = User.objects.create_user("viewer", is_staff=is_staff)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="events_ledger", codename__in=perms)
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_the_app_index_shows_the_dashboard_at_a_glance(admin_client):  # #15: dashboard
    stuck = RunFactory(status="completed", cleanup_status="incomplete")
    row = ResourceFactory(run=stuck, owner_module="world", last_error="refused <b>")
    ResourceFactory.create_batch(3, run=stuck, owner_module="banners", status="orphaned")
    ResourceFactory(run=stuck, owner_module="<script>x</script>")
    step = StepFactory(
        run=RunFactory(), action_id="world.spawn", status="running", claimed_at=timezone.now()
    )
    page = admin_client.get(reverse("admin:app_list", args=["events_ledger"]))
    html = page.content.decode()
    assert page.status_code == 200 and 'id="el-dashboard"' in html
    assert "Needs a human" in html and f"(run {stuck.pk})" in html
    assert '<span class="el-tile-n">1</span>' in html  # one incomplete run
    assert 'data-owner="banners" data-total="3"' in html
    assert 'data-status="orphaned" data-count="3"' in html
    assert "<script>x</script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html
    assert f"eventrunresource/{row.pk}/change/" in html and "refused &lt;b&gt;" in html
    # #25: the step named as the run page names it, by its place in the run.
    assert f"<td>#{step.seq}</td><td><code>world.spawn</code></td>" in html


@pytest.mark.django_db
def test_the_dashboard_costs_the_same_queries_for_few_and_many_rows(admin_client):
    # #15: a fixed number of queries, as the console's lists (S3)
    url = reverse("admin:app_list", args=["events_ledger"])

    def queries() -> int:
        with CaptureQueriesContext(connection) as q:
            assert admin_client.get(url).status_code == 200
        return len(q)

    _bulk_rows(10)
    few = queries()
    _bulk_rows(500)
    assert queries() == few


def two_phase_run() -> tuple[EventRun, EventRunResource]:
    """C8: a finished run of phase "a" then phase "b"; b's two rows have spent their
    attempts (the run is incomplete), a's one row waits behind them."""
    run = RunFactory(status="completed", cleanup_status="incomplete")
    a = StepFactory(run=run, phase="a", action_id="t.build")
    b = StepFactory(run=run, phase="b", action_id="t.wall")
    early = ResourceFactory(run=run, step=a, phase_rank=a.phase_rank)
    ResourceFactory.create_batch(2, run=run, step=b, phase_rank=b.phase_rank, revert_attempts=3)
    return run, early


@pytest.mark.django_db
def test_the_dashboard_names_the_phase_an_incomplete_run_waits_behind(admin_client):  # #15, C8
    run, early = two_phase_run()
    html = admin_client.get(reverse("admin:app_list", args=["events_ledger"])).content.decode()
    health = html[html.index('id="el-health"') : html.index('id="el-runs-by-cleanup"')]
    behind = health[health.index('id="el-behind"') :]
    behind = " ".join(behind[: behind.index("</ul>")].split())
    assert f'eventrun/{run.pk}/change/">run {run.pk}</a>' in behind
    assert "1 row waits behind phase 'b' (2 rows of it unresolved, their attempts spent)" in behind
    # The oldest row is the one that waits: said beside its status.
    oldest = html[html.index('id="el-oldest"') : html.index('id="el-in-flight"')]
    first = oldest[oldest.index(f"eventrunresource/{early.pk}/change/") :]
    assert "waits behind phase 'b'" in first[: first.index("</tr>")]
    assert oldest.count("waits behind phase") == 1  # phase b's own rows wait for nothing


@pytest.mark.django_db
def test_the_dashboard_names_the_phases_in_the_same_queries_for_one_and_many_runs(
    admin_client,
):  # #15, C8: one query for every run it names, never one per run
    url = reverse("admin:app_list", args=["events_ledger"])

    def queries(runs: int) -> int:
        with CaptureQueriesContext(connection) as q:
            html = admin_client.get(url).content.decode()
        behind = html[html.index('id="el-behind"') : html.index('id="el-runs-by-cleanup"')]
        assert behind.count("<li>") == runs
        return len(q)

    two_phase_run()
    one = queries(1)
    for _ in range(11):
        two_phase_run()
    assert queries(10) == one  # the first DETAIL_LIMIT incomplete runs are named


@pytest.mark.django_db
def test_the_dashboard_is_for_those_who_may_see_the_runs():  # #15, S3 permissions
    url = reverse("admin:app_list", args=["events_ledger"])
    page = viewer(perms=("view_eventrunresource",)).get(url)
    assert page.status_code == 200 and 'id="el-dashboard"' not in page.content.decode()


@pytest.mark.django_db
def test_the_dashboard_is_one_click_from_the_admin_index():  # #25, S3 permissions
    dashboard = reverse("admin:events_ledger_dashboard_changelist")
    app_index = reverse("admin:app_list", args=["events_ledger"])
    link = f'<a href="{dashboard}">Dashboard</a>'
    # Who may view runs finds a "Dashboard" row under "Events ledger" on the index and in
    # the sidebar of every admin page; it leads to the events ledger's page.
    allowed = viewer()
    index = allowed.get(reverse("admin:index"))
    assert index.status_code == 200 and link in index.content.decode()
    assert link in allowed.get(reverse("admin:events_ledger_eventrun_changelist")).content.decode()
    followed = allowed.get(dashboard, follow=True)
    assert followed.redirect_chain == [(app_index, 302)]
    assert 'id="el-dashboard"' in followed.content.decode()
    # Who may see the ledger's rows but not its runs: no row, and the URL refuses them.
    User.objects.filter(username="viewer").delete()
    other = viewer(perms=("view_eventrunresource",))
    index = other.get(reverse("admin:index"))
    html = index.content.decode()
    assert index.status_code == 200 and "Event run resources" in html
    assert dashboard not in html
    assert other.get(dashboard).status_code == 403
    # Nothing of it in the database: no content type, no permission, not the app's model.
    from django.apps import apps
    from django.contrib.contenttypes.models import ContentType

    assert not ContentType.objects.filter(app_label="events_ledger", model="dashboard").exists()
    assert "dashboard" not in {m._meta.model_name for m in apps.get_models()}


@pytest.mark.django_db
def test_a_runs_page_draws_its_steps_and_its_resources_lives(admin_client):  # #15: timeline
    run = RunFactory(status="completed", cleanup_status="pending")
    step = new_step(run, "world.spawn")
    EventRunStep.objects.filter(pk=step.pk).update(status="done")
    given = ResourceFactory(run=run, step=step, kind="creature", ref="wolf-1", status="reverted")
    held = ResourceFactory(run=run, step=step, kind="creature", ref="wolf-2")
    page = admin_client.get(reverse("admin:events_ledger_eventrun_change", args=[run.pk]))
    html = page.content.decode()
    timeline = page.context["timeline"]
    assert [(lane.kind, lane.status, lane.open) for lane in timeline.lanes] == [
        ("step", "done", False),
        ("resource", "reverted", False),
        ("resource", "confirmed", True),
    ]
    assert 'id="el-timeline"' in html and "creature:wolf-1" in html and "creature:wolf-2" in html
    assert all(timeline.left <= lane.x <= timeline.width for lane in timeline.lanes)
    assert given.pk and held.pk


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_sweepers_counters_reach_the_view_in_multiprocess_mode(world, tmp_path, monkeypatch):
    # #15: counters of what a process did, served by another (the cron's, by the web's)
    import subprocess

    from events_ledger.metrics import render
    from tests.helpers import finished_run as spawned_and_cancelled
    from tests.processes import ROOT, child_env

    spawned_and_cancelled(3)
    env = {**child_env(), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "manage.py", "cleanup_runs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "reverted 3" in done.stdout, done.stdout + done.stderr
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    body, _ = render("text/plain")
    families = metric_families(body.decode())
    assert samples(families, "events_ledger_resources_reverted")[()] == 3
    calls = samples(families, "events_ledger_module_call_seconds")
    assert calls[(("call", "world.spawn.revert"), ("le", "+Inf"), ("outcome", "answered"))] == 1
    assert "events_ledger_runs" in families  # the database's gauges beside them


@pytest.mark.django_db
def test_a_one_second_run_s_timeline_is_readable():  # #25: the run timeline
    from events_ledger.dashboard import run_timeline
    from events_ledger.models import STEP_KIND

    start = timezone.now().replace(microsecond=300_000) - timedelta(hours=3)
    run = RunFactory(
        status="cancelled",
        cleanup_status="incomplete",
        created_at=start,
        started_at=start,
        finished_at=start + timedelta(seconds=1),
    )
    ran = StepFactory(
        run=run,
        seq=1,
        status="done",
        created_at=start,
        updated_at=start + timedelta(milliseconds=400),
    )
    never = StepFactory(run=run, seq=2, status="pending", created_at=start, updated_at=start)
    ResourceFactory(
        run=run,
        step=ran,
        kind=STEP_KIND,
        ref=ran.idempotency_key,
        status="reverted",
        created_at=start,
        updated_at=start + timedelta(milliseconds=300),
    )
    ResourceFactory(
        run=run,
        step=ran,
        kind="creature",
        ref="wolf-1",
        revert_attempts=3,
        created_at=start + timedelta(milliseconds=200),
        updated_at=start + timedelta(milliseconds=900),
    )
    rows = list(EventRunResource.objects.for_run(run))
    t = run_timeline(run, [ran, never], rows, now=start + timedelta(hours=3))
    labels = [lane.label for lane in t.lanes]
    assert labels == ["#1 · test.make", "#2 · test.make", "creature:wolf-1"]  # no @step row
    never_lane, row_lane = t.lanes[1], t.lanes[2]
    assert never_lane.status == "cancelled" and not never_lane.open  # never ran: not "open"
    assert "never ran (the run was cancelled)" in never_lane.title
    assert row_lane.status == "stuck"  # red, not the amber of a row simply held
    # The axis is the run's second, not three hours to now: at most 6 intervals, on round
    # tenths of a second (#25: a second fills the axis, not half of it).
    xs = [x for x, _ in t.ticks]
    assert 3 <= len(t.ticks) <= 7 and xs[0] == t.left and xs[-1] == t.width - t.right
    tenths = [round(float(label.rsplit(":", 1)[1]) * 10) for _, label in t.ticks]
    steps = {(b - a) % 600 for a, b in zip(tenths, tenths[1:], strict=False)}
    assert len(steps) == 1 and steps <= {1, 2, 5} and tenths[0] % min(steps) == 0
    assert row_lane.width > 300  # the held row spans the run's second, readable
    # The step that never ran: grey from its creation to the run's end, where it was cut.
    assert never_lane.x + never_lane.width == t.marks[-1][0]
