"""The console (SPEC S3): runs, their ledger and log, the human retry, reconcile, the endpoint."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from events_ledger.diagnosis import diagnose
from events_ledger.ledger import execute_step
from events_ledger.models import EventRun, EventRunLog, EventRunResource
from project.world.models import Creature
from tests.conftest import age_rows
from tests.factories import LogFactory, ResourceFactory, RunFactory, StepFactory
from tests.helpers import connection, new_run, spawn_step, step_ttl

Res = EventRunResource.objects
world_db = pytest.mark.django_db(transaction=True)
ROLES = ["anonymous", "staff", "permitted", "superuser"]
ALLOWED = {"anonymous": False, "staff": False, "permitted": True, "superuser": True}


def runs_url() -> str:
    return reverse("admin:events_ledger_eventrun_changelist")


def resources_url() -> str:
    return reverse("admin:events_ledger_eventrunresource_changelist")


def run_url(run: EventRun) -> str:
    return reverse("admin:events_ledger_eventrun_change", args=[run.pk])


def row_url(row: EventRunResource) -> str:
    return reverse("admin:events_ledger_eventrunresource_change", args=[row.pk])


def endpoint(pk: int) -> str:
    return reverse("admin:events_ledger_eventrun_cleanup", args=[pk])


def login(role: str, client: Client | None = None) -> Client:
    """anonymous; staff who may view the console; staff with the app's permissions too;
    a superuser."""
    client = client or Client()
    if role == "anonymous":
        return client
    user = User.objects.create_user(
        role, password="pw", is_staff=True, is_superuser=role == "superuser"
    )
    codenames = ["view_eventrun", "view_eventrunresource"]
    if role == "permitted":
        codenames += ["retry_cleanup", "reconcile_resources"]
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="events_ledger", codename__in=codenames)
    )
    client.force_login(user)
    return client


def messages_of(resp) -> list[str]:
    return [str(m) for m in resp.context["messages"]]


def action_choices(resp) -> list[str]:
    form = resp.context["action_form"]  # None when the user may run no action at all
    return [name for name, _ in form.fields["action"].choices] if form else []


def incomplete_run(**kw) -> EventRun:
    """A finished run whose one row has spent its attempts. No module owns the row, so
    a retry runs without the world (and fails again: nothing records its action)."""
    run = RunFactory(status="completed", cleanup_status="incomplete", **kw)
    ResourceFactory(run=run, revert_attempts=3, last_error="the shard refused")
    return run


def two_phase_run(spent: bool = True, later_rows: int = 2) -> tuple[EventRun, EventRunResource]:
    """C8: a finished run of phase "a" then phase "b", no module owning either. Phase b's
    rows (attempts spent unless said) are given back first; a's one row waits behind them."""
    run = RunFactory(status="completed", cleanup_status="incomplete" if spent else "pending")
    a = StepFactory(run=run, phase="a", action_id="test.build")
    b = StepFactory(run=run, phase="b", action_id="test.wall")
    owner = f"test-{run.pk}"  # the same refs live in several runs of a test
    early = ResourceFactory(
        run=run, step=a, phase_rank=a.phase_rank, owner_module=owner, kind="creature", ref="0xa1"
    )
    for i in range(1, later_rows + 1):
        ResourceFactory(
            run=run,
            step=b,
            owner_module=owner,
            phase_rank=b.phase_rank,
            kind="wall",
            ref=f"0xb{i}",
            revert_attempts=3 if spent else 0,
            last_error="the wall holds" if spent else None,
        )
    return run, early


def reconcile(client: Client, row: EventRunResource):
    data = {"action": "reconcile", "index": 0, "_selected_action": [row.pk]}
    return client.post(resources_url(), data, follow=True)


def retry(client: Client, run: EventRun, confirm: bool = True, **extra):
    data = {"action": "retry_cleanup", "_selected_action": [run.pk]}
    data.update({"post": "yes"} if confirm else {"index": 0})
    return client.post(runs_url(), data, follow=confirm, **extra)


# ── what an operator sees ──


@pytest.mark.django_db
@pytest.mark.parametrize("url", [runs_url, resources_url], ids=["runs", "resources"])
def test_changelist_query_count_does_not_grow_with_runs(admin_client, url):  # S3
    def make(n: int) -> None:
        for _ in range(n):
            run = RunFactory(status="completed", cleanup_status="pending")
            ResourceFactory.create_batch(2, run=run)
            ResourceFactory(run=run, status="reverted")

    def queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert admin_client.get(url()).status_code == 200
        return len(ctx.captured_queries)

    make(5)
    five = queries()
    make(45)
    assert EventRun.objects.count() == 50
    assert queries() == five


@pytest.mark.django_db
def test_runs_changelist_shows_the_unresolved_count_filters_and_search(admin_client):  # S3, R4
    stuck = incomplete_run(name="Full moon", scope="north")
    ResourceFactory(run=stuck, status="reverted")
    RunFactory(name="Bat swarm", scope="south", status="failed")
    resp = admin_client.get(runs_url())
    assert f'?run__id__exact={stuck.pk}&amp;resolution=unresolved">1</a>' in resp.content.decode()

    def count(query: str) -> int:
        return admin_client.get(runs_url() + query).context["cl"].result_count

    assert count("?status__exact=failed") == 1
    assert count("?cleanup_status__exact=incomplete") == 1
    assert count("?q=moon") == 1 and count("?q=south") == 1 and count("?q=nothing") == 0


@pytest.mark.django_db
def test_resources_changelist_is_what_is_stuck_right_now(admin_client):  # S3
    run = incomplete_run()
    ResourceFactory(run=run, status="reverted")
    ResourceFactory(owner_module="other", status="orphaned")
    resp = admin_client.get(resources_url() + "?resolution=unresolved")
    assert resp.context["cl"].result_count == 2
    assert run_url(run) in resp.content.decode()  # the run is linked

    def count(query: str) -> int:
        return admin_client.get(resources_url() + query).context["cl"].result_count

    assert count("?owner_module=other") == 1
    assert count("?status__exact=reverted") == 1
    assert count(f"?run__id__exact={run.pk}") == 2


@pytest.mark.django_db
def test_run_page_shows_steps_ledger_and_log_newest_first(admin_client):  # S3, C7
    run = RunFactory(status="completed", cleanup_status="pending")
    step = StepFactory(run=run, action_id="world.spawn")
    claimed = ResourceFactory(run=run, step=step, status="reverting", ref="0xclaimed")
    ResourceFactory(run=run, step=step, status="confirmed", ref="0xidle", last_error="locked")
    now = timezone.now()
    LogFactory(run=run, kind="older.entry", created_at=now - timedelta(minutes=5))
    LogFactory(run=run, kind="newer.entry", created_at=now)
    html = admin_client.get(run_url(run)).content.decode()
    assert step.idempotency_key in html and "world.spawn" in html
    assert "0xclaimed" in html and "0xidle" in html and "locked" in html
    assert html.index("newer.entry") < html.index("older.entry")
    assert row_url(claimed) in html
    assert 'id="el-incomplete"' not in html  # no banner while cleanup is merely pending


@pytest.mark.django_db
def test_incomplete_run_has_a_banner_naming_the_stuck_rows_and_why(admin_client):  # S3, rule 2
    run = RunFactory(status="completed", cleanup_status="incomplete")
    ResourceFactory(
        run=run, ref="0xwolf", revert_attempts=3, last_error="the shard refused: region locked"
    )
    ResourceFactory(
        run=run, ref="0xbat", status="drifted", revert_attempts=3, last_error="now 7, not ours"
    )
    ResourceFactory(run=run, ref="0xgone", status="reverted")
    html = admin_client.get(run_url(run)).content.decode()
    banner = html[html.index('id="el-incomplete"') :]
    banner = banner[: banner.index("</div>")]
    assert "2 resources could not be given back" in banner
    assert "thing:0xwolf" in banner and "the shard refused: region locked" in banner
    assert "thing:0xbat" in banner and "now 7, not ours" in banner
    assert "0xgone" not in banner
    assert "Retry cleanup of run" in banner  # the superuser may retry from here


@pytest.mark.django_db
def test_why_is_this_stuck(admin_client):  # S3, R5, C3
    run = RunFactory(status="failed", cleanup_status="pending")
    step = StepFactory(run=run, action_id="world.spawn")
    row = ResourceFactory(
        run=run,
        step=step,
        owner_module="world",
        kind="creature",
        ref="0xabc",
        status="reverting",
        claim_token="c1a1m",
        revert_attempts=2,
        last_error="the shard refused: region locked",
    )
    age_rows(EventRunResource, [row.pk], seconds=3600)
    html = admin_client.get(row_url(row)).content.decode()
    why = html[html.index('id="el-why"') :]
    assert "Why is this stuck?" in why
    assert "2 of 3 automatic" in why and "the shard refused: region locked" in why
    assert "held by claim <code>c1a1m</code> since" in why and "stale" in why
    # The same call `cleanup_runs --dry-run` prints for the human retry.
    call = f"world.spawn.revert(key={step.idempotency_key}, resources=['creature:0xabc'])"
    assert escape(call) in why

    released = ResourceFactory(run=run, status="reverted")
    html = admin_client.get(row_url(released)).content.decode()
    assert "This row is resolved" in html and "its target is released" in html


@pytest.mark.django_db
def test_the_consoles_css_is_one_static_file_on_every_page(admin_client):  # S3, #13
    run = RunFactory(status="completed", cleanup_status="incomplete")
    row = ResourceFactory(run=run)
    link = 'href="/static/events_ledger/admin/console.css"'
    pages = [runs_url(), resources_url(), run_url(run), row_url(row)]
    pages.append(reverse("admin:app_list", args=["events_ledger"]))
    for url in pages:
        html = admin_client.get(url).content.decode()
        assert html.count(link) == 1, url
        assert ".el-pill {" not in html, url  # no inline copy of the stylesheet
    retry = admin_client.post(
        runs_url(), {"action": "retry_cleanup", "_selected_action": [run.pk]}
    ).content.decode()
    assert "Retry cleanup" in retry and retry.count(link) == 1


@pytest.mark.django_db
def test_the_console_and_the_dry_run_name_the_same_call(admin_client):  # S3, S1
    run = RunFactory(status="failed", cleanup_status="pending")
    step = StepFactory(run=run, action_id="world.spawn")
    row = ResourceFactory(run=run, step=step, owner_module="world", kind="creature", ref="0xd1")
    out = StringIO()
    call_command("cleanup_runs", "--dry-run", "--run", str(run.pk), "--reset-attempts", stdout=out)
    call = diagnose(row).call
    assert call == f"world.spawn.revert(key={step.idempotency_key}, resources=['creature:0xd1'])"
    assert f"  - {call}" in out.getvalue().splitlines()
    why = admin_client.get(row_url(row)).content.decode()
    assert escape(call) in why[why.index('id="el-why"') :]


@pytest.mark.django_db
def test_why_is_this_stuck_names_the_step_in_flight(admin_client):  # S3, the invariant
    from events_ledger.models import STEP_KIND, EventRunStep

    run = RunFactory(status="cancelled", cleanup_status="pending")
    step = StepFactory(run=run, action_id="world.spawn")
    EventRunStep.objects.claim(step, step_ttl(), by="worker-7:4242")
    row = ResourceFactory(
        run=run,
        step=step,
        owner_module="world",
        kind=STEP_KIND,
        ref=step.idempotency_key,
        status="pending",
    )
    why = admin_client.get(row_url(row)).content.decode()
    why = why[why.index('id="el-why"') :]
    # #25: named as the run's page names it (#seq), not by its database id.
    assert f"step #{step.seq} (world.spawn) is in flight on worker-7:4242" in why
    assert "cleanup waits until the call ends" in why
    assert ".revert(" not in why  # no call is made while it waits


@pytest.mark.django_db
def test_why_is_this_stuck_names_the_later_phase_it_waits_behind(admin_client):  # S3, C8
    run, early = two_phase_run()
    note = diagnose(early).note
    assert note.startswith("It waits behind phase 'b' of its run, given back first")
    assert "2 rows of it are unresolved (wall:0xb1, wall:0xb2)" in note
    assert "their attempts are spent" in note
    assert "give back phase 'b' first, then call:" in note
    why = admin_client.get(row_url(early)).content.decode()
    why = why[why.index('id="el-why"') :]
    assert escape(note) in why
    assert escape("after phase 'b' is given back (2 row(s) of it unresolved") in why

    # C8: a later phase still owed, not stuck: it waits, and a sweep will get to it.
    pending, row = two_phase_run(spent=False, later_rows=1)
    note = diagnose(row).note
    assert "phase 'b'" in note and "1 row of it is still unresolved (wall:0xb1)" in note
    assert "spent" not in note


@pytest.mark.django_db
def test_a_runs_page_names_the_phase_its_earlier_ones_wait_behind(admin_client):  # S3, C8
    run, early = two_phase_run()
    html = admin_client.get(run_url(run)).content.decode()
    banner = html[html.index('id="el-incomplete"') :]
    banner = banner[: banner.index("</div>")]
    behind = banner[banner.index('id="el-behind"') :]
    behind = " ".join(behind[: behind.index("</p>")].split())
    assert "Given back first: phase &#x27;b&#x27;." not in behind  # the quotes are the text's
    assert "Given back first: phase 'b'." in behind
    assert "1 row of an earlier phase (a) waits behind phase 'b'" in behind
    assert "which still holds 2 unresolved rows (<code>wall:0xb1, wall:0xb2</code>)" in behind
    assert "whose attempts are spent" in behind
    # The row that waits is marked so in the list, the rows it waits for keep their error.
    item = banner[banner.index(f"eventrunresource/{early.pk}/change/") :]
    assert "waits behind phase 'b'" in item[: item.index("</li>")]
    assert banner.count("the wall holds") == 2

    # Cleanup pending, nothing stuck: no banner, the phase named all the same.
    pending, _ = two_phase_run(spent=False)
    html = admin_client.get(run_url(pending)).content.decode()
    assert 'id="el-incomplete"' not in html and 'id="el-behind"' in html
    assert "whose attempts are spent" not in html

    # A run of one phase has nothing waiting behind another.
    assert 'id="el-behind"' not in admin_client.get(run_url(incomplete_run())).content.decode()


@pytest.mark.django_db
def test_a_runs_page_names_the_phase_in_the_same_queries_however_many_rows(
    admin_client,
):  # S3, C8: the plan of the page's one run, never a query per row or group
    def queries(run: EventRun) -> int:
        with CaptureQueriesContext(connection) as ctx:
            html = admin_client.get(run_url(run)).content.decode()
        assert 'id="el-behind"' in html
        return len(ctx.captured_queries)

    small, _ = two_phase_run(later_rows=1)
    large, _ = two_phase_run(later_rows=30)
    steps = [StepFactory(run=large, phase="a", action_id=f"test.build{i}") for i in range(10)]
    for step in steps:
        ResourceFactory(run=large, step=step, phase_rank=step.phase_rank)
    assert queries(large) == queries(small)


@pytest.mark.django_db
def test_the_retry_names_the_phase_given_back_first(admin_client):  # S3, C8
    run, _ = two_phase_run()
    confirm = retry(admin_client, run, confirm=False).content.decode()
    assert escape("after phase 'b' is given back (2 row(s) of it unresolved, their attempts") in (
        confirm
    )
    assert "waits behind phase 'b': wall:0xb1, wall:0xb2" in confirm
    # No module gives phase b back: it fails again, and phase a still waits behind it.
    done = retry(admin_client, run)
    [said] = [m for m in messages_of(done) if m.startswith(f"run {run.pk} ")]
    assert "cleanup incomplete" in said
    assert "earlier phases wait behind phase 'b' (2 rows of it unresolved)" in said


@pytest.mark.django_db
def test_payloads_errors_and_log_details_render_as_text(admin_client):  # S3
    evil = "<script>alert('x')</script>"
    run = RunFactory(name=evil, status="completed", cleanup_status="incomplete")
    StepFactory(run=run, last_error=evil, params={"p": evil})
    row = ResourceFactory(
        run=run, ref="0xevil", payload={"note": evil}, last_error=evil, revert_attempts=3
    )
    EventRunLog.objects.write(run, "cleanup.failed", {"error": evil})
    pages = [
        admin_client.get(run_url(run)),
        admin_client.get(row_url(row)),
        admin_client.get(resources_url()),
        admin_client.get(runs_url()),
        retry(admin_client, run, confirm=False),
    ]
    for resp in pages:
        html = resp.content.decode()
        assert resp.status_code == 200
        assert "<script>alert(" not in html, resp.request["PATH_INFO"]
        assert "&lt;script&gt;alert(" in html


@pytest.mark.django_db
def test_log_details_read_as_key_value_lines(admin_client):  # S3, #25: not raw JSON
    run = RunFactory(status="completed", cleanup_status="complete")
    detail = {
        "by": "alice <ops>",
        "summary": {"reverted": 2, "failed": 0, "errors": []},
        "refs": ["wolf-1", "wolf-2"],
        "calls": [{"call": "world.spawn.revert", "ok": True}],
        "force": False,
        "holder": None,
    }
    EventRunLog.objects.write(run, "cleanup.retry", detail)
    html = admin_client.get(run_url(run)).content.decode()
    log = html[html.index('id="el-log"') :]
    expected = "\n".join(
        [
            "by: alice &lt;ops&gt;",
            "calls:",
            "  - call: world.spawn.revert",
            "    ok: yes",
            "force: no",
            "holder: –",
            "refs: wolf-1, wolf-2",
            "summary:",
            "  errors: –",
            "  failed: 0",
            "  reverted: 2",
        ]
    )
    assert f'<pre class="el-detail">{expected}</pre>' in log
    assert "{&quot;" not in log and '{"' not in log  # no JSON left


@pytest.mark.django_db
def test_one_date_format_on_the_run_page_its_timeline_and_the_dashboard(
    admin_client, settings
):  # S3, #25: Y-m-d H:i:s in the current time zone, never the admin's DATETIME_FORMAT
    from datetime import UTC, datetime

    from django.utils.formats import date_format

    settings.TIME_ZONE = "Europe/Berlin"  # the console says local time, not "UTC"
    t0 = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    s = timedelta(seconds=1)
    run = RunFactory(
        status="completed",
        cleanup_status="pending",
        created_at=t0,
        started_at=t0 + s,
        finished_at=t0 + 3 * s,
        updated_at=t0 + 4 * s,
    )
    step = StepFactory(run=run, status="done", created_at=t0 + s, updated_at=t0 + 2 * s)
    row = ResourceFactory(
        run=run, step=step, status="reverting", created_at=t0 + s, updated_at=t0 + 2 * s
    )
    log = LogFactory(run=run, kind="run.completed")
    EventRunLog.objects.filter(pk=log.pk).update(created_at=t0 + 3 * s)
    pages = {
        "run": admin_client.get(run_url(run)).content.decode(),
        "row": admin_client.get(row_url(row)).content.decode(),
        "dashboard": admin_client.get(
            reverse("admin:app_list", args=["events_ledger"])
        ).content.decode(),
    }
    for when in (t0, t0 + s, t0 + 3 * s, t0 + 4 * s):
        local = timezone.localtime(when)
        assert local.hour == when.hour + 1  # Berlin, not UTC
        # The run's own fields, its log entry (t0+3s) and its timeline's titles.
        assert date_format(local, "Y-m-d H:i:s") in pages["run"], when
        for page in pages.values():
            assert date_format(local, "DATETIME_FORMAT") not in page
    timeline = pages["run"][pages["run"].index('id="el-timeline"') :]
    assert "2026-03-04 06:06:08 → 2026-03-04 06:06:09" in timeline  # the step's title
    assert "since 2026-03-04 06:06:09" in pages["row"] and " UTC" not in pages["row"]
    assert 'title="recorded 2026-03-04 06:06:08"' in pages["dashboard"]  # the oldest row


@pytest.mark.django_db
def test_statuses_are_worded_alike_everywhere(admin_client):  # S3, #25
    RunFactory(status="completed", cleanup_status="not_required")
    pending = RunFactory(status="completed", cleanup_status="pending")
    StepFactory(run=pending, status="done")
    ResourceFactory(run=pending, owner_module="world")
    runs = admin_client.get(runs_url()).content.decode()
    # The list filter (the model's choices) and the pills: one capital, words apart.
    for label in ("Not required", "Pending", "Complete", "Incomplete", "Completed"):
        assert f">{label}<" in runs, label
    assert '<span class="el-pill el-s-not_required">Not required</span>' in runs
    assert '<span class="el-pill el-s-pending">Pending</span>' in runs
    page = admin_client.get(run_url(pending)).content.decode()
    assert '<span class="el-pill el-s-done">Done</span>' in page  # the step
    assert '<span class="el-pill el-s-confirmed">Confirmed</span>' in page  # its row
    dashboard = admin_client.get(reverse("admin:app_list", args=["events_ledger"]))
    assert '<span class="el-pill el-s-confirmed">Confirmed</span>' in dashboard.content.decode()
    for html in (runs, page, dashboard.content.decode()):
        assert ">not required<" not in html and ">pending<" not in html


@pytest.mark.django_db
def test_ledger_rows_are_never_added_changed_or_deleted(admin_client):  # S3
    run = incomplete_run()
    row = run.resources.get()
    before = list(Res.order_by("pk").values_list("pk", "status", "revert_attempts", "ref"))
    add = reverse("admin:events_ledger_eventrunresource_add")
    delete = reverse("admin:events_ledger_eventrunresource_delete", args=[row.pk])
    assert admin_client.get(add).status_code == 403
    assert admin_client.post(row_url(row), {"status": "reverted", "ref": "x"}).status_code == 403
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    assert "delete_selected" not in action_choices(admin_client.get(resources_url()))
    # Runs: read-only, and a run the ledger remembers cannot be deleted.
    assert admin_client.get(reverse("admin:events_ledger_eventrun_add")).status_code == 403
    assert admin_client.post(run_url(run), {"name": "renamed"}).status_code == 403
    run_delete = reverse("admin:events_ledger_eventrun_delete", args=[run.pk])
    refused = admin_client.post(run_delete, {"post": "yes"})
    assert refused.status_code == 200 and "Cannot delete" in refused.content.decode()
    empty = RunFactory(status="completed")
    empty_delete = reverse("admin:events_ledger_eventrun_delete", args=[empty.pk])
    assert admin_client.get(empty_delete).status_code == 200
    assert list(Res.order_by("pk").values_list("pk", "status", "revert_attempts", "ref")) == before
    assert EventRun.objects.filter(pk=run.pk, name=run.name).exists()


# ── the actions and the endpoint, by who asks ──


@pytest.mark.django_db
def test_staff_need_view_permission_for_the_changelists():  # S3
    client = Client()
    client.force_login(User.objects.create_user("bare", password="pw", is_staff=True))
    assert client.get(runs_url()).status_code == 403
    assert client.get(resources_url()).status_code == 403
    assert client.post(endpoint(incomplete_run().pk)).status_code == 403


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_retry_cleanup_action_needs_the_permission(role):  # S3, C4
    client = login(role)
    run = incomplete_run()
    listing = client.get(runs_url())
    if role == "anonymous":
        assert listing.status_code == 302 and "/login/" in listing["Location"]
    else:
        assert ("retry_cleanup" in action_choices(listing)) is ALLOWED[role]
    resp = retry(client, run)
    retried = EventRunLog.objects.filter(run=run, kind="cleanup.retry")
    if ALLOWED[role]:
        assert retried.get().detail["by"] == role  # the actor is the logged-in user
        assert any(f"run {run.pk} " in m and "cleanup incomplete" in m for m in messages_of(resp))
    else:
        assert not retried.exists()
        assert Res.get(run=run).revert_attempts == 3  # nobody reset rule 2's counter
        if role == "anonymous":
            assert resp.redirect_chain[-1][0].startswith(reverse("admin:login"))


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_reconcile_action_needs_the_permission(role):  # S3, C6
    client = login(role)
    row = ResourceFactory(run=RunFactory(), owner_module="test")
    listing = client.get(resources_url())
    if role != "anonymous":
        assert ("reconcile" in action_choices(listing)) is ALLOWED[role]
    resp = reconcile(client, row)
    said = [m for m in messages_of(resp) if m.startswith("test: asked")] if resp.context else []
    if ALLOWED[role]:
        # No module answers for "test": unanswered, and the ledger is left alone.
        assert said == ["test: asked 0, in force 0, orphaned 0, unanswered 1"]
    else:
        assert said == []
    assert Res.get(pk=row.pk).status == "confirmed"


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
def test_cleanup_endpoint_needs_staff_and_the_permission(role):  # S3
    client = login(role)
    run = incomplete_run()
    resp = client.post(endpoint(run.pk))
    if role == "anonymous":
        # Decided: the admin's own answer, a redirect to its login page.
        assert resp.status_code == 302 and resp["Location"].startswith(reverse("admin:login"))
    elif role == "staff":
        assert resp.status_code == 403 and resp.json()["ok"] is False
        assert "retry_cleanup" in resp.json()["error"]
    else:
        assert resp.status_code == 200
        doc = resp.json()
        assert doc["ok"] is True and doc["run_id"] == run.pk and doc["reset"] == 1
        assert doc["cleanup_status"] == "incomplete" and doc["remaining"] == 1
    assert EventRunLog.objects.filter(run=run, kind="cleanup.retry").exists() is ALLOWED[role]


@pytest.mark.django_db
def test_cleanup_endpoint_answers_json_errors(admin_client):  # S3
    run = incomplete_run()
    got = admin_client.get(endpoint(run.pk))
    assert got.status_code == 405 and got["Allow"] == "POST" and got.json()["ok"] is False
    missing = admin_client.post(endpoint(987654))
    assert missing.status_code == 404 and missing.json() == {"ok": False, "error": "no run 987654"}
    running = RunFactory(status="running")
    busy = admin_client.post(endpoint(running.pk))
    assert busy.status_code == 409 and "running" in busy.json()["error"]
    assert not EventRunLog.objects.filter(kind="cleanup.retry").exists()


@pytest.mark.django_db
def test_endpoint_and_actions_are_csrf_protected(admin_user):  # S3
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    run = incomplete_run()
    assert client.post(endpoint(run.pk)).status_code == 403
    assert retry(client, run).status_code == 403
    assert not EventRunLog.objects.filter(kind="cleanup.retry").exists()
    client.get(runs_url())  # sets the CSRF cookie
    token = client.cookies["csrftoken"].value
    resp = client.post(endpoint(run.pk), HTTP_X_CSRFTOKEN=token)
    assert resp.status_code == 200 and resp.json()["ok"] is True


# ── end to end on the demo world ──


def spent_run(world, status: str = "completed") -> EventRun:
    """A finished run whose spawn could not be given back: attempts spent, incomplete."""
    run = new_run("Bat swarm")
    assert execute_step(spawn_step(run, "south", 2)).outcome == "done"
    EventRun.objects.transition(run, status, from_="running")
    Res.unresolved_for_run(run).update(
        revert_attempts=3, last_error="the shard refused: region locked"
    )
    EventRun.objects.filter(pk=run.pk).update(cleanup_status="incomplete")
    return run


@world_db
def test_retry_flow_restores_the_world(world, admin_client, admin_user):  # S3, C4, rule 2
    run = spent_run(world)
    step = run.steps.get()
    assert Creature.objects.count() == 2
    assert 'id="el-incomplete"' in admin_client.get(run_url(run)).content.decode()

    confirm = retry(admin_client, run, confirm=False)
    html = confirm.content.decode()
    assert confirm.status_code == 200 and "Yes, retry cleanup" in html
    assert escape(f"world.spawn.revert(key={step.idempotency_key}, resources=[") in html
    assert Creature.objects.count() == 2
    assert set(Res.unresolved_for_run(run).values_list("revert_attempts", flat=True)) == {3}

    done = retry(admin_client, run)
    assert any(
        f"run {run.pk} Bat swarm: reverted 2" in m and "cleanup complete" in m
        for m in messages_of(done)
    )
    run.refresh_from_db()
    assert run.cleanup_status == "complete" and Res.unresolved_count(run) == 0
    assert Creature.objects.count() == 0
    retried = EventRunLog.objects.get(run=run, kind="cleanup.retry")
    assert retried.detail["by"] == admin_user.username
    assert 'id="el-incomplete"' not in admin_client.get(run_url(run)).content.decode()


@world_db
def test_retry_refuses_a_run_still_in_flight(world, admin_client):  # S3, C5
    run = new_run("Still going")
    execute_step(spawn_step(run, "north", 1))
    confirm = retry(admin_client, run, confirm=False).content.decode()
    assert "Refused: the run is still running" in confirm
    resp = retry(admin_client, run)
    assert any(m.startswith(f"Refused: run {run.pk} is running") for m in messages_of(resp))
    assert Creature.objects.count() == 1
    assert not EventRunLog.objects.filter(kind="cleanup.retry").exists()


@world_db
def test_cleanup_endpoint_restores_the_world(world, admin_client):  # S3, C4
    run = spent_run(world, status="cancelled")
    doc = admin_client.post(endpoint(run.pk)).json()
    assert doc["ok"] is True and doc["reverted"] == 2 and doc["cleanup_status"] == "complete"
    assert Creature.objects.count() == 0


@world_db
def test_reconcile_action_reports_a_held_back_answer(world, admin_client):  # S3, C6
    run = new_run()
    execute_step(spawn_step(run, "north", 4))
    world.restart()
    row = Res.filter(run=run, kind="creature").first()
    resp = reconcile(admin_client, row)
    said = messages_of(resp)
    assert any(
        m.startswith("world: asked 4, in force 0, orphaned 0")
        and "Held back" in m
        and "more than 50%" in m
        for m in said
    )
    # No force from the console: the ledger is left alone.
    assert set(Res.filter(kind="creature").values_list("status", flat=True)) == {"confirmed"}


# ── #25: the security review ──


def user_with(*codenames: str) -> Client:
    user = User.objects.create_user("-".join(codenames) or "bare", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_the_endpoint_needs_view_too_and_tells_nobody_which_runs_exist():  # S3, #25
    run = incomplete_run()
    retry_only = user_with("retry_cleanup")  # may retry, may not view runs
    answers = {retry_only.post(endpoint(pk)).status_code for pk in (run.pk, 987654)}
    assert answers == {403}  # the same answer for a run that exists and one that does not
    assert "view_eventrun" in retry_only.post(endpoint(run.pk)).json()["error"]
    viewer = user_with("view_eventrun")
    assert {viewer.post(endpoint(pk)).status_code for pk in (run.pk, 987654)} == {403}
    assert not EventRunLog.objects.filter(run=run, kind="cleanup.retry").exists()
    both = user_with("view_eventrun", "retry_cleanup")
    assert both.post(endpoint(run.pk)).status_code == 200


@pytest.mark.django_db
def test_a_run_is_deleted_only_once_it_has_ended_and_owes_nothing(admin_client):  # S3, #25
    from django.contrib.admin.models import DELETION, LogEntry

    running = RunFactory(status="running")  # nothing recorded yet
    StepFactory(run=running)
    owing = RunFactory(status="completed", cleanup_status="pending")
    given_back = RunFactory(status="completed", cleanup_status="complete")
    ResourceFactory(run=given_back, status="reverted")  # the record of what it did
    done = RunFactory(status="cancelled", cleanup_status="not_required")
    StepFactory(run=done)
    LogFactory(run=done)
    reasons = {
        running.pk: "it is still running",
        owing.pk: "its cleanup is pending",
        given_back.pk: "the ledger still records what it changed",
    }
    for run in (running, owing, given_back):
        # #35: the console's own "Cannot delete" page, with the reason (on a419c07 a bare
        # 403, and "Delete selected" told a superuser it had no permission).
        delete = reverse("admin:events_ledger_eventrun_delete", args=[run.pk])
        for page in (admin_client.get(delete), admin_client.post(delete, {"post": "yes"})):
            text = page.content.decode()
            assert page.status_code == 200 and "Cannot delete" in text, text
            assert reasons[run.pk] in text and "permission" not in text.lower()
        selected = {"action": "delete_selected", "_selected_action": [run.pk], "post": "yes"}
        resp = admin_client.post(runs_url(), selected, follow=True)
        text = resp.content.decode()
        assert EventRun.objects.filter(pk=run.pk).exists()
        assert "Cannot delete" in text and reasons[run.pk] in text
        assert "have permission" not in text
    confirm = admin_client.post(
        runs_url(), {"action": "delete_selected", "_selected_action": [done.pk]}
    )
    text = confirm.content.decode()
    assert "event run steps: 1" in text.lower() and "event run log: 1" in text.lower()
    admin_client.post(
        runs_url(), {"action": "delete_selected", "_selected_action": [done.pk], "post": "yes"}
    )
    assert not EventRun.objects.filter(pk=done.pk).exists()
    # The deletion is in the admin's history, with the run's name.
    assert LogEntry.objects.filter(action_flag=DELETION, object_repr=str(done)).exists()


@world_db
def test_console_actions_are_in_the_admins_history(world, admin_client):  # S3, #25: LogEntry
    from django.contrib.admin.models import CHANGE, LogEntry

    run = new_run()
    execute_step(spawn_step(run, "north", 1))
    EventRun.objects.transition(run, "completed", from_="running")
    retry(admin_client, run)
    entry = LogEntry.objects.get(object_id=str(run.pk), action_flag=CHANGE)
    assert "Retried cleanup (attempts reset)" in entry.get_change_message()
    assert "→ cleanup complete" in entry.get_change_message()
    run2 = new_run()
    execute_step(spawn_step(run2, "south", 1))
    row = Res.filter(run=run2).exclude(kind="@step").get()
    reconcile(admin_client, row)
    logged = LogEntry.objects.get(object_id=str(row.pk), action_flag=CHANGE)
    assert logged.get_change_message().startswith("Reconciled module world: asked 1")
    history = admin_client.get(reverse("admin:events_ledger_eventrun_history", args=[run.pk]))
    assert "Retried cleanup" in history.content.decode()


def test_a_reconcile_from_the_queue_is_never_forced():  # C6, #25
    from events_ledger import jobs

    with pytest.raises(ValueError, match="never forced from a task queue"):
        jobs.reconcile_once("world", force=True)


def test_the_example_project_is_not_in_debug_and_has_no_public_key(tmp_path):  # #25
    import os
    import subprocess
    import sys

    from tests.processes import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY")}
    env.update(DJANGO_SETTINGS_MODULE="project.settings", DATABASE_URL=f"sqlite:///{tmp_path}/x")
    read = "import django; django.setup(); from django.conf import settings as s; print(s.DEBUG, s.SECRET_KEY)"
    keys = set()
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", read], cwd=ROOT, env=env, capture_output=True, text=True
        )
        debug, key = out.stdout.split()
        assert debug == "False" and "example" not in key
        keys.add(key)
    assert len(keys) == 2  # made for each process: nothing public to forge with


@pytest.mark.django_db
def test_the_rows_are_shown_only_to_users_who_may_view_resources():  # S3, #25
    # A user who may view runs but not resources read the rows' refs and errors on the
    # run page and the dashboard (a419c07); now the counts, and where to get the rows.
    run = incomplete_run()
    secret = "the-token-in-a-ref"
    Res.filter(run=run).update(ref=secret, last_error=f"refused {secret}")
    pages = [run_url(run), reverse("admin:app_list", args=["events_ledger"])]
    runs_only = user_with("view_eventrun")
    for page in pages:
        html = runs_only.get(page).content.decode()
        assert secret not in html and "shown to users who may view resources" in html
    both = user_with("view_eventrun", "view_eventrunresource")
    for page in pages:
        assert secret in both.get(page).content.decode()
