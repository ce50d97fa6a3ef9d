"""A run's whole life (SPEC R, "Run transitions are compare-and-set too"): only the
moves of its state machine, named when refused, and a status the database refuses."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction

from events_ledger import InvalidTransition
from events_ledger.db import ledger_db
from events_ledger.models import EventRun
from events_ledger.states import RUN_MOVES, RUN_STATUSES, RUN_TERMINAL
from tests.helpers import new_run

pytestmark = pytest.mark.django_db


def test_a_word_that_is_no_run_status_is_refused_and_nothing_is_written():  # R, #35
    # On a419c07 "complete" (the cleanup word) was stored, and no sweep saw the run again.
    run = new_run(status="running")
    for to, from_ in [("complete", "running"), ("completed", "runing"), ("finished", "running")]:
        with pytest.raises(InvalidTransition, match="no run status"):
            EventRun.objects.transition(run, to, from_=from_)
    run.refresh_from_db()
    assert run.status == "running"


@pytest.mark.parametrize("terminal", RUN_TERMINAL)
def test_a_terminal_status_is_final(terminal):  # R, #35: no way back
    run = new_run(status=terminal)
    for to in RUN_STATUSES:
        if to == terminal:
            continue
        with pytest.raises(InvalidTransition, match=f"{terminal} → {to}"):
            EventRun.objects.transition(run, to, from_=terminal)
    assert EventRun.objects.get(pk=run.pk).status == terminal


def test_every_move_of_the_machine_is_made_once_and_refreshes_the_instance():  # R, #35
    for source, targets in RUN_MOVES.items():
        for to in targets:
            run = new_run(status=source)
            assert EventRun.objects.transition(run, to, from_=source)
            assert run.status == to  # the instance says what the row says
            assert (run.finished_at is not None) == (to in RUN_TERMINAL)
            assert not EventRun.objects.transition(run.pk, to, from_=source)  # lost: moved


def test_the_database_refuses_a_status_that_is_none():  # R, #35: whatever path writes it
    with pytest.raises(IntegrityError), transaction.atomic(using=ledger_db()):
        EventRun.objects.create(name="typo", status="finished")
    run = new_run(status="running")
    with pytest.raises(IntegrityError), transaction.atomic(using=ledger_db()):
        EventRun.objects.filter(pk=run.pk).update(status="complete")
    with pytest.raises(IntegrityError), transaction.atomic(using=ledger_db()):
        EventRun.objects.filter(pk=run.pk).update(cleanup_status="done")
    assert EventRun.objects.get(pk=run.pk).status == "running"


# ── an operator ends a stuck run ──


@pytest.mark.django_db(transaction=True)
def test_end_run_ends_a_stuck_run_with_who_and_why_and_the_sweep_gives_it_back(
    isolated_registry,
):  # R, C5, #35: on a419c07 the only way was ORM code in a shell
    from events_ledger import end_run, sweep
    from events_ledger.ledger import execute_step
    from tests.helpers import ledger_action, new_step

    ledger_action(
        isolated_registry,
        perform=lambda **_: {"ok": True, "resources": [{"kind": "thing", "ref": "a"}]},
    )
    run = new_run(status="running")
    assert execute_step(new_step(run, "t.make")).outcome == "done"
    with pytest.raises(ValueError, match="reason"):
        end_run(run, actor="op", reason="  ")
    with pytest.raises(InvalidTransition):
        end_run(run, "running", actor="op", reason="stuck")
    assert end_run(run, "cancelled", actor="op", reason="its worker died")
    assert run.status == "cancelled"
    entry = run.log.get(kind="run.ended_by_hand")
    assert entry.detail == {"status": "cancelled", "by": "op", "reason": "its worker died"}
    assert not end_run(run, actor="op", reason="again")  # ended already: nothing done
    sweep()
    run.refresh_from_db()
    assert run.cleanup_status == "complete"


def _command(name: str, *args: str) -> tuple[int, str, str]:
    """A ledger command's exit status, output and error, as a cron would see them."""
    from io import StringIO

    from django.core.management import CommandError, call_command

    out, err = StringIO(), StringIO()
    try:
        call_command(name, *args, stdout=out, stderr=err)
        return 0, out.getvalue(), err.getvalue()
    except CommandError as exc:
        return exc.returncode, out.getvalue(), str(exc)


def test_the_end_run_command(isolated_registry):  # S1, #35: exit statuses and JSON
    import json

    def command(*args: str) -> tuple[int, str, str]:
        return _command("end_run", *args)

    run = new_run(status="running")
    code, _, err = command("987654", "--reason", "x")
    assert code == 2 and "no run 987654" in err
    code, _, err = command(str(run.pk), "--reason", " ")
    assert code == 2 and "reason" in err
    code, out, _ = command(str(run.pk), "--reason", "driver gone", "--actor", "ops", "--json")
    assert code == 0 and json.loads(out) == {"run": run.pk, "status": "failed", "by": "ops"}
    code, _, err = command(str(run.pk), "--reason", "again")
    assert code == 2 and "ended already (failed)" in err


def test_the_consoles_end_action_needs_its_permission_and_a_reason(isolated_registry):  # S3
    from django.contrib.admin.models import LogEntry
    from django.contrib.auth.models import Permission, User
    from django.test import Client
    from django.urls import reverse

    url = reverse("admin:events_ledger_eventrun_changelist")
    run = new_run(status="running")
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_eventrun"))
    client = Client()
    client.force_login(viewer)
    data = {"action": "end_runs", "_selected_action": [run.pk]}
    form = client.get(url).context["action_form"]  # None: no action is theirs at all
    assert form is None or "end_runs" not in [n for n, _ in form.fields["action"].choices]
    client.post(url, {**data, "post": "yes", "status": "failed", "reason": "x"})
    assert EventRun.objects.get(pk=run.pk).status == "running"
    viewer.user_permissions.add(Permission.objects.get(codename="end_run"))
    page = client.post(url, {**data, "index": 0})
    assert page.status_code == 200 and "Yes, end them" in page.content.decode()
    client.post(url, {**data, "post": "yes", "status": "failed", "reason": ""})
    assert EventRun.objects.get(pk=run.pk).status == "running"  # no reason, no end
    client.post(url, {**data, "post": "yes", "status": "cancelled", "reason": "worker died"})
    assert EventRun.objects.get(pk=run.pk).status == "cancelled"
    assert run.log.get(kind="run.ended_by_hand").detail["by"] == "viewer"
    assert LogEntry.objects.filter(object_id=str(run.pk), change_message__contains="worker died")


def test_a_row_failed_for_good_by_the_poison_limit_is_drawn_stuck():  # rule 2, #25
    # On a419c07 the timeline read only the attempts: a row whose claims were spent (its
    # revert kills or hangs every sweeper) was drawn amber, held, not red, stuck.
    from events_ledger.conf import ledger_settings
    from events_ledger.dashboard import run_timeline
    from tests.factories import ResourceFactory, RunFactory

    run = RunFactory(status="cancelled", cleanup_status="pending")
    row = ResourceFactory(
        run=run,
        kind="creature",
        ref="wolf-1",
        status="confirmed",
        claim_count=ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT,
    )
    held = ResourceFactory(run=run, kind="creature", ref="wolf-2", status="confirmed")
    lanes = {lane.label: lane.status for lane in run_timeline(run, [], [row, held]).lanes}
    assert [s for label, s in lanes.items() if "wolf-1" in label] == ["stuck"]
    assert [s for label, s in lanes.items() if "wolf-2" in label] == ["confirmed"]


def test_why_is_this_stuck_reads_a_claims_age_by_the_databases_clock(monkeypatch, settings):
    # One clock (SPEC): on a419c07 the diagnosis compared the database's stamp with the
    # web host's clock, so a host whose clock ran ahead called a fresh claim stale.
    from datetime import timedelta

    from django.utils import timezone

    from events_ledger.db import UtcNow
    from events_ledger.diagnosis import diagnose
    from events_ledger.models import EventRunResource
    from tests.factories import ResourceFactory, RunFactory

    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "REVERT_CLAIM_TTL": timedelta(minutes=10)}
    run = RunFactory(status="cancelled", cleanup_status="pending")
    row = ResourceFactory(run=run, status="reverting")
    EventRunResource.objects.filter(pk=row.pk).update(updated_at=UtcNow() - timedelta(minutes=5))
    row.refresh_from_db()
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(hours=1))
    assert diagnose(row).claim_stale is False
    EventRunResource.objects.filter(pk=row.pk).update(updated_at=UtcNow() - timedelta(minutes=20))
    row.refresh_from_db()
    assert diagnose(row).claim_stale is True


def test_the_dry_run_lists_the_batch_the_pass_would_take(settings, isolated_registry):  # S1
    # On a419c07 the dry run scanned without the pass's bounds: it listed a run whose
    # rows another sweeper is working (a fresh claim), which the pass passes over.
    import json
    from io import StringIO

    from django.core.management import call_command

    from events_ledger.cleanup import scan
    from tests.factories import ResourceFactory, RunFactory
    from tests.helpers import ledger_action

    ledger_action(isolated_registry)
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_RUN_BATCH": 1}
    worked = RunFactory(status="cancelled", cleanup_status="pending")
    ResourceFactory(run=worked, owner_module="t", status="reverting")  # claimed just now
    owing = RunFactory(status="cancelled", cleanup_status="pending")
    ResourceFactory(run=owing, owner_module="t", status="confirmed")
    assert [r.pk for r in scan()] == [owing.pk]
    out = StringIO()
    call_command("cleanup_runs", "--dry-run", "--json", stdout=out)
    assert list(json.loads(out.getvalue())["runs"]) == [str(owing.pk)]


def test_cleanup_pending_counts_the_sweeps_backlog_not_runs_still_going(admin_client):  # #15
    # On a419c07 one running run that had recorded something read "in flight 1 · cleanup
    # pending 1": a backlog that was not there.
    from io import StringIO

    from django.core.management import CommandError, call_command
    from django.urls import reverse

    from events_ledger.status import snapshot
    from tests.factories import ResourceFactory, RunFactory

    going = RunFactory(status="running", cleanup_status="pending")
    ResourceFactory(run=going, status="confirmed")
    status = snapshot()
    assert (status.runs_in_flight, status.cleanup_pending) == (1, 0)
    out = StringIO()
    try:
        call_command("ledger_status", stdout=out)
    except CommandError:
        pass
    assert "runs: in flight 1 · cleanup pending 0" in out.getvalue()
    ended = RunFactory(status="cancelled", cleanup_status="pending")
    ResourceFactory(run=ended, status="confirmed")
    assert snapshot().cleanup_pending == 1
    page = admin_client.get(reverse("admin:app_list", args=["events_ledger"]))
    html = page.content.decode()
    link = "cleanup_status__exact=pending&amp;status__in=completed,cancelled,failed,missed"
    assert link in html
    listing = admin_client.get(
        reverse("admin:events_ledger_eventrun_changelist")
        + "?cleanup_status__exact=pending&status__in=completed,cancelled,failed,missed"
    )
    assert [r.pk for r in listing.context["cl"].result_list] == [ended.pk]


def test_the_dashboard_links_each_run_that_needs_a_human(admin_client):  # #15, S3
    # On a419c07 "Needs a human" named them as text ("(run 7)"), without a name or a link.
    from django.urls import reverse

    from tests.factories import RunFactory

    stuck = RunFactory(status="failed", cleanup_status="incomplete", name="Full moon")
    html = admin_client.get(reverse("admin:app_list", args=["events_ledger"])).content.decode()
    block = html[html.index('id="el-needs-a-human"') :]
    url = reverse("admin:events_ledger_eventrun_change", args=[stuck.pk])
    assert f'<a href="{url}">run {stuck.pk} Full moon</a>' in block


def test_the_dry_run_refuses_what_the_command_refuses_and_says_why_it_plans_nothing():  # S1
    # On a419c07: a running run's dry run listed a plan the command then refused (exit
    # 2); an incomplete run's said "nothing would be given back" without why.
    from io import StringIO

    from django.core.management import CommandError, call_command

    from tests.factories import ResourceFactory, RunFactory

    going = RunFactory(status="running", cleanup_status="pending")
    ResourceFactory(run=going, status="confirmed")
    for args in (["--dry-run"], []):
        with pytest.raises(CommandError, match="is running") as refused:
            call_command("cleanup_runs", "--run", str(going.pk), *args, stdout=StringIO())
        assert refused.value.returncode == 2 and "end_run" in str(refused.value)
    stuck = RunFactory(status="failed", cleanup_status="incomplete")
    ResourceFactory(run=stuck, status="confirmed", revert_attempts=3)
    out = StringIO()
    call_command("cleanup_runs", "--run", str(stuck.pk), "--dry-run", stdout=out)
    assert "is incomplete" in out.getvalue() and "--reset-attempts --dry-run" in out.getvalue()


def test_a_scrape_costs_the_queries_the_docs_say(django_assert_max_num_queries):  # #15, #28
    # monitoring.md said three (the snapshot's); the history's size adds up to six.
    from prometheus_client.exposition import generate_latest

    from events_ledger.metrics import exposition_registry
    from tests.factories import ResourceFactory, RunFactory

    ResourceFactory(run=RunFactory(status="failed", cleanup_status="incomplete"))
    registry = exposition_registry()
    with django_assert_max_num_queries(9):
        assert b"events_ledger_healthy 0.0" in generate_latest(registry)


@pytest.mark.django_db(transaction=True)
def test_a_sweep_task_says_when_a_run_needs_a_human():  # C5, #14: green is not all clear
    from events_ledger import jobs
    from tests.factories import ResourceFactory, RunFactory

    assert jobs.sweep_once()["needs_a_human"] is False
    stuck = RunFactory(status="failed", cleanup_status="pending")
    ResourceFactory(run=stuck, status="confirmed", revert_attempts=3)  # spent, summary stale
    answer = jobs.sweep_once()
    assert answer["incomplete"] == [stuck.pk] and answer["needs_a_human"] is True


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("answer", ["done", "failed"])
def test_a_run_left_running_behind_a_late_step_is_ended_by_the_sweep(
    isolated_registry, answer
):  # R, C5, #35: a cron-only project has nobody to come back and end it
    import threading

    from events_ledger import run_steps, sweep
    from tests.helpers import ledger_action, new_step, wait_until

    gate = threading.Event()

    def perform(*, idempotency_key: str, **_: object) -> dict[str, object]:
        gate.wait(30)
        if answer == "failed":
            return {"ok": False, "retry": False, "error": "the world said no"}
        return {"ok": True, "resources": [{"kind": "thing", "ref": idempotency_key}]}

    ledger_action(isolated_registry, "t.slow", perform=perform, budget_ms=200)
    run = new_run(status="pending")
    step = new_step(run, "t.slow")
    report = run_steps(run)
    assert report.outcome == "busy" and report.status == "running"
    assert not sweep().finished_runs  # the call still runs: the run goes on
    gate.set()
    wait_until(lambda: type(step).objects.get(pk=step.pk).status == answer, "the late answer")
    swept = sweep()
    to = "completed" if answer == "done" else "failed"
    assert swept.finished_runs == [(run.pk, to)]
    run.refresh_from_db()
    assert run.status == to and run.cleanup_status in ("complete", "not_required")
    assert run.log.filter(kind=f"run.{to}", detail__by="sweep").exists()
    assert not sweep().finished_runs  # once


def test_rows_are_resolved_by_hand_from_the_console_and_the_command(isolated_registry):  # S1, S3
    import json

    from django.contrib.admin.models import LogEntry
    from django.contrib.auth.models import Permission, User
    from django.test import Client
    from django.urls import reverse

    from tests.factories import ResourceFactory, RunFactory

    run = RunFactory(status="cancelled", cleanup_status="incomplete")
    drifted = ResourceFactory(run=run, kind="override", ref="rate#a", status="drifted")
    gone = ResourceFactory(run=run, kind="creature", ref="wolf-9", status="confirmed")
    url = reverse("admin:events_ledger_eventrunresource_changelist")
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_eventrunresource"))
    client = Client()
    client.force_login(viewer)
    data = {"action": "resolve_rows_by_hand", "_selected_action": [drifted.pk]}
    client.post(url, {**data, "post": "yes", "reason": "keep it"})
    assert type(drifted).objects.get(pk=drifted.pk).status == "drifted"  # no permission
    viewer.user_permissions.add(Permission.objects.get(codename="resolve_by_hand"))
    page = client.post(url, {**data, "index": 0})
    assert page.status_code == 200 and "Yes, resolve them" in page.content.decode()
    client.post(url, {**data, "post": "yes", "reason": ""})
    assert type(drifted).objects.get(pk=drifted.pk).status == "drifted"  # no reason
    client.post(url, {**data, "post": "yes", "reason": "the GM keeps it"})
    assert type(drifted).objects.get(pk=drifted.pk).status == "resolved"
    assert run.log.get(kind="resource.resolved_by_hand").detail["by"] == "viewer"
    assert LogEntry.objects.filter(object_id=str(drifted.pk), change_message__contains="GM")

    def command(*args: str) -> tuple[int, str, str]:
        return _command("resolve_rows", *args)

    code, _, err = command("987654", "--reason", "x")
    assert code == 2 and "no ledger row 987654" in err
    code, out, _ = command(str(gone.pk), "--reason", "checked: gone", "--actor", "ops", "--json")
    assert code == 0 and json.loads(out) == {"resolved": [gone.pk], "by": "ops", "left": {}}
    code, _, err = command(str(gone.pk), "--reason", "again")
    assert code == 2 and f"{gone.pk} (resolved)" in err
    run.refresh_from_db()
    assert run.cleanup_status == "complete"


def test_a_run_whose_row_was_resolved_by_hand_is_pruned_whole():  # retention, #35
    from events_ledger.models import EventRunResource
    from events_ledger.retention import prune
    from tests.test_retention import history

    [run_id] = history(1)
    EventRunResource.objects.filter(run_id=run_id).update(status="resolved")
    report = prune(older_than=timedelta(days=30))
    assert report.runs == 1 and not EventRun.objects.filter(pk=run_id).exists()


@pytest.mark.django_db(transaction=True)
def test_rows_waiting_behind_a_failed_later_phase_are_drawn_and_counted_as_waiting(
    world, admin_client
):  # C8, #35: 7 "could not be given back" where 2 failed, and all drawn red
    import re

    from django.urls import reverse

    from events_ledger import sweep
    from tests.helpers import phased_run

    run = phased_run("pit")
    world.switch_on("rate.restore_fail")
    for _ in range(3):
        sweep()
    run.refresh_from_db()
    assert run.cleanup_status == "incomplete"
    page = admin_client.get(reverse("admin:events_ledger_eventrun_change", args=[run.pk]))
    html = page.content.decode()
    heading = re.search(r'id="el-incomplete">\s*<h2>(.*?)</h2>', html, re.S)[1]
    assert " ".join(heading.split()) == (
        "Cleanup is incomplete: 1 resource could not be given back; 4 more wait behind them"
    )
    drawn = re.findall(r'data-status="([a-z_]+)">\s*<text[^>]*>([^<]*)</text>', html)
    by_kind: dict[str, set[str]] = {}
    for status, label in drawn:
        by_kind.setdefault(label.split(":")[0].strip(), set()).add(status)
    assert by_kind.get("override") == {"stuck"}, drawn
    assert by_kind.get("creature") == {"behind"} and by_kind.get("arena") == {"behind"}, drawn
    assert "waits behind a later phase" in html and "the run began / ended" in html


@pytest.mark.django_db(transaction=True)
def test_the_run_page_says_what_each_step_was_asked_and_which_phase_it_is(
    world, admin_client
):  # S3, #35: no params, no lease values, "#0 · action" three times
    from django.urls import reverse

    from tests.helpers import phased_run

    run = phased_run("pit")
    html = admin_client.get(
        reverse("admin:events_ledger_eventrun_change", args=[run.pk])
    ).content.decode()
    assert (
        "{&quot;count&quot;: 3, &quot;kind&quot;: &quot;wolf&quot;, &quot;region&quot;: &quot;pit&quot;}"
        in html
    )
    assert "found 1, applied 9" in html  # the lease's baseline and the value it applied
    import re

    labels = re.findall(r'el-lane-step" data-status="[a-z_]+">\s*<text[^>]*>([^<]*)</text>', html)
    assert [label.split(" #")[0] for label in labels] == ["arena", "creatures", "rate"], labels
