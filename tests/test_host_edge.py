"""The promise at the edge of the host (SPEC "The host's edge"): the ledger's durable
moments are its own, whatever transaction the caller is in."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import Client
from django.urls import reverse

from events_ledger import InCallersTransaction, cleanup_run, run_steps, sweep
from events_ledger.cleanup import reconcile_module
from events_ledger.ledger import execute_step
from events_ledger.models import EventRun, EventRunResource, EventRunStep
from tests.helpers import connection, ledger_action, new_run, new_step, wait_until

Res = EventRunResource.objects
world_db = pytest.mark.django_db(transaction=True)


def _calls(registry: Any) -> list[str]:
    """A `ledger` action that notes each perform and revert it is asked for."""
    calls: list[str] = []

    def perform(**_: Any) -> dict[str, Any]:
        calls.append("perform")
        return {"ok": True, "resources": [{"kind": "thing", "ref": "a"}]}

    def revert(**_: Any) -> dict[str, Any]:
        calls.append("revert")
        return {"ok": True}

    def reconcile(**_: Any) -> dict[str, Any]:
        calls.append("reconcile")
        return {"ok": True, "in_force": ["a"]}

    ledger_action(registry, "t.make", perform=perform, revert=revert, reconcile=reconcile)
    return calls


def _ended_run() -> EventRun:
    run = new_run()
    assert execute_step(new_step(run, "t.make")).outcome == "done"
    EventRun.objects.transition(run, "cancelled", from_="running")
    return run


@world_db
@pytest.mark.parametrize("how", ["atomic", "autocommit off"])
def test_a_step_inside_a_callers_transaction_is_refused_before_its_claim(
    isolated_registry, how
):  # rule 1, W5: no module call before the claim and placeholder are durable
    calls = _calls(isolated_registry)
    run = new_run()
    step = new_step(run, "t.make")
    if how == "atomic":
        with pytest.raises(InCallersTransaction, match="execute_step"), transaction.atomic():
            execute_step(step)
    else:
        transaction.set_autocommit(False)
        try:
            with pytest.raises(InCallersTransaction, match="execute_step"):
                execute_step(step)
        finally:
            transaction.rollback()
            transaction.set_autocommit(True)
    assert calls == []
    step.refresh_from_db()
    assert step.status == "pending" and step.attempts == 0
    assert not Res.filter(run=run).exists()
    # Outside the transaction the same step runs, once.
    assert execute_step(step).outcome == "done" and calls == ["perform"]


@world_db
def test_a_rolled_back_caller_no_longer_loses_what_its_step_made(
    isolated_registry,
):  # rule 1: on a419c07 the module ran, the rollback took the ledger's rows with it
    calls = _calls(isolated_registry)
    run = new_run()
    step = new_step(run, "t.make")
    with pytest.raises(InCallersTransaction), transaction.atomic():
        execute_step(step)
    assert calls == []  # the world was not touched, so there is nothing to lose
    assert not Res.filter(run=run).exists()


@world_db
def test_every_entry_point_that_calls_a_module_refuses_a_callers_transaction(
    isolated_registry,
):  # rule 1, C4, C5, C6, W5
    calls = _calls(isolated_registry)
    run = _ended_run()
    driven = new_run(status="pending")
    new_step(driven, "t.make")
    calls.clear()
    for name, call in [
        ("cleanup_run", lambda: cleanup_run(run, reset_attempts=True, actor="op")),
        ("sweep", lambda: sweep()),
        ("reconcile_module", lambda: reconcile_module("t")),
        ("run_steps", lambda: run_steps(driven)),
    ]:
        with pytest.raises(InCallersTransaction, match=name), transaction.atomic():
            call()
    assert calls == []
    driven.refresh_from_db()
    assert driven.status == "pending"
    assert Res.filter(run=run, status="confirmed").count() == 1
    assert not run.log.filter(kind="cleanup.retry").exists()
    # Outside: each does its work.
    assert cleanup_run(run).reverted == 1 and calls == ["revert"]


@pytest.mark.django_db
def test_a_test_cases_own_transaction_is_not_a_callers(isolated_registry):  # rule 1
    # pytest-django's `db` wraps the test in a transaction it rolls back afterwards,
    # as Django's TestCase does; the refusal follows Django's durable blocks there.
    calls = _calls(isolated_registry)
    assert connection.in_atomic_block
    assert execute_step(new_step(new_run(), "t.make")).outcome == "done"
    assert calls == ["perform"]


# ── the console under ATOMIC_REQUESTS ──


@pytest.fixture
def atomic_requests():
    """The host wraps every request in a transaction, as ATOMIC_REQUESTS does."""
    settings = connection.settings_dict
    before = settings.get("ATOMIC_REQUESTS", False)
    settings["ATOMIC_REQUESTS"] = True
    yield
    settings["ATOMIC_REQUESTS"] = before


def _probing_revert(registry: Any) -> list[tuple[bool, str | None]]:
    """A revert (called in a worker thread) that notes whether the request's connection
    is in a transaction and what another connection sees of the row it gives back."""
    seen: list[tuple[bool, str | None]] = []
    request_conn = connections["default"]  # the request's (the test client's thread)

    def revert(**_: Any) -> dict[str, Any]:
        probe = connections.create_connection("default")
        try:
            with probe.cursor() as cur:
                cur.execute(
                    f"SELECT status FROM {EventRunResource._meta.db_table} WHERE kind = 'thing'"
                )
                row = cur.fetchone()
        finally:
            probe.close()
        seen.append((request_conn.in_atomic_block, row[0] if row else None))
        return {"ok": True}

    ledger_action(
        registry,
        "t.make",
        perform=lambda **_: {"ok": True, "resources": [{"kind": "thing", "ref": "a"}]},
        revert=revert,
    )
    return seen


@world_db
@pytest.mark.parametrize("via", ["action", "endpoint"])
def test_the_consoles_retry_commits_its_claims_before_the_call_under_atomic_requests(
    isolated_registry, admin_client: Client, atomic_requests, via
):  # rule 1, S3, C4: the claim is durable when the module is asked
    seen = _probing_revert(isolated_registry)
    run = new_run()
    assert execute_step(new_step(run, "t.make")).outcome == "done"
    EventRun.objects.transition(run, "cancelled", from_="running")
    if via == "action":
        data = {"action": "retry_cleanup", "_selected_action": [run.pk], "post": "yes"}
        resp = admin_client.post(reverse("admin:events_ledger_eventrun_changelist"), data)
        assert resp.status_code == 302
    else:
        doc = admin_client.post(reverse("admin:events_ledger_eventrun_cleanup", args=[run.pk]))
        assert doc.json()["reverted"] == 1
    # On a419c07 the call came inside the request's transaction, its claim unseen.
    assert seen == [(False, "reverting")]
    run.refresh_from_db()
    assert run.cleanup_status == "complete"
    assert run.log.filter(kind="cleanup.retry").exists()


@world_db
def test_the_reconcile_action_runs_under_atomic_requests(
    isolated_registry, admin_client: Client, atomic_requests
):  # C6, S3
    calls = _calls(isolated_registry)
    run = new_run()
    assert execute_step(new_step(run, "t.make")).outcome == "done"
    row = Res.get(run=run, kind="thing")
    data = {"action": "reconcile", "index": 0, "_selected_action": [row.pk]}
    resp = admin_client.post(
        reverse("admin:events_ledger_eventrunresource_changelist"), data, follow=True
    )
    assert resp.status_code == 200
    assert calls == ["perform", "reconcile"]
    assert EventRunStep.objects.get(run=run).status == "done"


# ── a prune beside a sweep, and the prune's walk ──


@world_db
def test_a_prune_that_removes_a_run_a_pass_holds_neither_fails_nor_pages_the_pass(
    isolated_registry,
):  # C5, #28: on a419c07 the pass failed with KeyError and its runs were worked one by one
    from events_ledger.retention import prune

    _calls(isolated_registry)
    run = _ended_run()
    other = _ended_run()
    met: list[bool] = []

    def meanwhile() -> bool:
        # Between the pass's scan and its work: another sweeper gives the run back and a
        # prune removes it.
        if not met:
            met.append(True)
            assert cleanup_run(run).cleanup_status == "complete"
            EventRun.objects.filter(pk=run.pk).update(
                finished_at=EventRun.objects.get(pk=run.pk).created_at - timedelta(days=2)
            )
            assert prune(older_than=timedelta(days=1)).runs == 1
        return False

    report = sweep(should_stop=meanwhile)
    assert met and not EventRun.objects.filter(pk=run.pk).exists()
    assert report.errors == {}
    assert {s.run_id: s.cleanup_status for s in report.runs} == {
        run.pk: "complete",
        other.pk: "complete",
    }
    assert not other.log.filter(kind="cleanup.error").exists()


@pytest.mark.django_db
def test_a_due_run_behind_a_young_one_in_id_order_is_pruned(
    isolated_registry,
):  # #28: on a419c07 the walk stopped at the first window of young runs
    from django.utils import timezone

    from events_ledger.retention import prune

    young = new_run(status="completed")
    long_ago = timezone.now() - timedelta(days=30)
    due = new_run(status="completed", created_at=long_ago, finished_at=long_ago)
    assert young.pk < due.pk
    report = prune(older_than=timedelta(days=1), batch=1)
    assert report.runs == 1
    assert EventRun.objects.filter(pk=young.pk).exists()
    assert not EventRun.objects.filter(pk=due.pk).exists()


# ── the archive (#28's history, kept whole and private) ──


def _old_runs(count: int) -> list[int]:
    from tests.test_retention import history

    return history(count)


def _prune_command(*args: str) -> tuple[int, str]:
    from tests.test_retention import command

    code, out, err = command("--older-than", "30d", *args)
    return code, out + err


@world_db
def test_a_damaged_early_batch_is_refused_not_cut(tmp_path):  # #28, rule 2: loud, lose nothing
    path = tmp_path / "ledger.jsonl.gz"
    first = _old_runs(6)
    assert _prune_command("--batch", "2", "--archive", str(path))[0] == 0
    data = bytearray(path.read_bytes())
    data[30] ^= 0xFF  # inside the first of three batches
    path.write_bytes(bytes(data))
    (tmp_path / "ledger.jsonl.gz.committed").unlink()  # as an archive made before the mark
    later = _old_runs(2)
    code, said = _prune_command("--archive", str(path))
    # On a419c07 the prune cut the file at the damage: two batches of removed runs lost.
    assert code == 2 and str(path) in said and "damaged" in said
    assert path.read_bytes() == bytes(data)
    assert EventRun.objects.filter(pk__in=later).count() == 2 and first


@world_db
@pytest.mark.parametrize("content", ["jsonl", "gzip-text", "xz"])
def test_a_file_that_is_not_an_archive_is_refused_byte_for_byte(tmp_path, content):  # #28
    import gzip
    import lzma

    path = tmp_path / "export"
    body = b'{"some": "export"}\n{"of": "the host"}\n'
    data = {"jsonl": body, "gzip-text": gzip.compress(b"hello\n"), "xz": lzma.compress(body)}
    path.write_bytes(data[content])
    path.chmod(0o644)
    ids = _old_runs(2)
    code, said = _prune_command("--archive", str(path))
    assert code == 2 and str(path) in said
    assert path.read_bytes() == data[content] and (path.stat().st_mode & 0o777) == 0o644
    assert EventRun.objects.filter(pk__in=ids).count() == 2
    assert not (tmp_path / "export.committed").exists()


@world_db
def test_an_archive_that_cannot_be_written_is_refused_before_anything_goes(tmp_path):  # #28
    ids = _old_runs(2)
    missing = tmp_path / "no-such-dir" / "ledger.jsonl.gz"
    code, said = _prune_command("--archive", str(missing))
    assert code == 2 and str(missing) in said  # on a419c07: exit 1 after the first batch
    link = tmp_path / "link.gz"
    link.symlink_to(tmp_path / "elsewhere.gz")
    code, said = _prune_command("--archive", str(link))
    assert code == 2 and str(link) in said and not (tmp_path / "elsewhere.gz").exists()
    real = tmp_path / "real.gz"
    real.touch()
    (tmp_path / "second-name.gz").hardlink_to(real)
    code, said = _prune_command("--archive", str(real))
    assert code == 2 and "links" in said
    assert EventRun.objects.filter(pk__in=ids).count() == 2


@world_db
def test_the_archive_is_created_and_kept_0600(tmp_path):  # #28: it holds every column
    import stat

    new = tmp_path / "new.jsonl.gz"
    _old_runs(1)
    assert _prune_command("--archive", str(new))[0] == 0
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "new.jsonl.gz.committed").stat().st_mode) == 0o600
    # An archive left world-readable (a copy, a umask) is narrowed once read as ours.
    new.chmod(0o666)
    _old_runs(1)
    assert _prune_command("--archive", str(new))[0] == 0
    assert stat.S_IMODE(new.stat().st_mode) == 0o600


@world_db
def test_the_archive_redacts_through_the_hosts_hook_and_refuses_a_hook_that_loses_runs(
    tmp_path, settings
):  # #28: a secret in a step's params need not sit in the archive
    import gzip
    import json

    def redact(document: dict[str, Any]) -> dict[str, Any]:
        for step in document["steps"]:
            step["params"] = "[redacted]"
        return document

    ids = _old_runs(2)
    EventRunStep.objects.create(run_id=ids[0], action_id="t.make", params={"password": "hunter2"})
    path = tmp_path / "ledger.jsonl.gz"
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "ARCHIVE_REDACT": redact}
    assert _prune_command("--archive", str(path))[0] == 0
    archived = [json.loads(line) for line in gzip.open(path, "rt")]
    assert [d["run"]["id"] for d in archived] == ids and "hunter2" not in str(archived)
    assert archived[0]["steps"][0]["params"] == "[redacted]"
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "ARCHIVE_REDACT": lambda document: None}
    later = _old_runs(1)
    before = path.read_bytes()
    code, said = _prune_command("--archive", str(path))
    assert code == 2 and "ARCHIVE_REDACT" in said
    assert EventRun.objects.filter(pk__in=later).exists() and path.read_bytes() == before
    from events_ledger.checks import check_settings

    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "ARCHIVE_REDACT": "no.such.hook",
    }  # found at start-up
    assert [e.id for e in check_settings() if "ARCHIVE_REDACT" in e.msg] == ["events_ledger.E006"]


@world_db
def test_a_prune_reads_only_what_lies_past_the_committed_offset(tmp_path):  # #28: O(batch)
    from events_ledger.retention import read_archive

    path = tmp_path / "ledger.jsonl.gz"
    first = _old_runs(2)
    assert _prune_command("--archive", str(path))[0] == 0
    committed = int((tmp_path / "ledger.jsonl.gz.committed").read_text())
    assert committed == path.stat().st_size
    # Bytes before the mark are not read again: damage there goes unseen by the next
    # prune (read_archive still finds it), which appends after it.
    data = bytearray(path.read_bytes())
    data[30] ^= 0xFF
    path.write_bytes(bytes(data))
    more = _old_runs(1)
    assert _prune_command("--archive", str(path))[0] == 0
    assert path.read_bytes()[:committed] == bytes(data)
    assert not EventRun.objects.filter(pk__in=first + more).exists()
    with pytest.raises(Exception, match="damaged"):
        list(read_archive(path))


# ── what a message on the broker may ask ──


@world_db
def test_a_task_message_chooses_no_archive_and_no_shorter_cut_off(settings, tmp_path):  # #28
    from events_ledger import jobs

    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "RETENTION": timedelta(days=30),
    }
    with pytest.raises(ValueError, match="ARCHIVE"):
        jobs.prune_once(archive=str(tmp_path / "any-file"))
    assert not (tmp_path / "any-file").exists()
    for wrong in (1, 0, -5, "1", True, 10**30):
        with pytest.raises(ValueError, match="older_than"):
            jobs.prune_once(older_than=wrong)
    for wrong in (0, -1, 10**6, "10"):
        with pytest.raises(ValueError, match="batch"):
            jobs.prune_once(batch=wrong)
    assert jobs.prune_once(older_than=timedelta(days=60).total_seconds())["runs"] == 0
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, **settings.EVENTS_LEDGER, "RETENTION": None}
    assert jobs.prune_once(older_than=1) == {"kept_for_ever": True, "runs": 0}


@world_db
def test_every_task_argument_from_a_broker_is_bounded(settings):  # C5, #14
    from events_ledger import jobs

    for wrong in (0, -1, jobs.MAX_SWEEP_LIMIT + 1, "5", 2.5):
        with pytest.raises(ValueError, match="limit"):
            jobs.sweep_once(limit=wrong)
    with pytest.raises(ValueError, match="scope"):
        jobs.sweep_once(scope=["a"])
    assert jobs.sweep_once(limit=jobs.MAX_SWEEP_LIMIT)["errors"] == {}
    from importlib.util import find_spec

    package = "django.tasks" if find_spec("django.tasks") else "django_tasks"
    if not find_spec(package):
        return
    from events_ledger.tasks import run_task

    settings.TASKS = {"default": {"BACKEND": f"{package}.backends.immediate.ImmediateBackend"}}
    for wrong in (-1, jobs.BUSY_RETRIES + 1):
        with pytest.raises(ValueError, match="busy_retries"):
            run_task.call(new_run().pk, "fail", wrong)


# ── the demo's own command, on a database that is not the demo's ──


@world_db
def test_the_demo_refuses_a_database_that_holds_other_runs_and_leaves_users_alone(
    world,
):  # #25: make demo makes its own database; manage.py demo elsewhere changed nothing else
    from django.contrib.auth.models import User
    from django.core.management import CommandError, call_command

    from project.world.management.commands.demo import Command
    from project.world.models import Creature

    Creature.objects.create(region="north", kind="wolf", serial="keep-me", spawned_by="host")
    new_run(name="someone's real run")
    with pytest.raises(CommandError, match="not the demo's"):
        call_command("demo", stdout=open(os.devnull, "w"))
    assert Creature.objects.filter(serial="keep-me").exists()
    # A user named demo that exists is someone's: not promoted, its password kept.
    user = User.objects.create_user("demo", password="theirs")
    assert Command().demo_user().startswith("(unchanged")
    user.refresh_from_db()
    assert not user.is_superuser and user.check_password("theirs")
    user.delete()
    password = Command().demo_user()
    assert User.objects.get(username="demo").check_password(password)


# ── a late answer after its phase was given back ──


@world_db
def test_a_late_answer_after_its_placeholder_was_given_back_is_said_on_the_run(
    world, isolated_registry
):  # the invariant, C7, C8: on a419c07 it left no trace (late_for_cleanup never read)
    from datetime import UTC, datetime

    from events_ledger import signals
    from events_ledger.background import keeper
    from tests.helpers import Gate, wait_until
    from tests.test_in_flight import gated_spawn, register_spawn, settled

    heard: list[tuple[int, int]] = []

    def receiver(sender: Any, step: Any, recorded: int, **_: Any) -> None:
        heard.append((step.pk, recorded))

    signals.late_answer.connect(receiver, weak=False, dispatch_uid="test-late")
    try:
        gate = Gate()
        register_spawn(isolated_registry, gated_spawn(gate), budget_ms=200)
        run = new_run()
        step = new_step(run, "t.spawn", {"count": 2, "region": "south"})
        assert execute_step(step).outcome == "overdue"
        EventRun.objects.transition(run, "cancelled", from_="running")
        for token in list(keeper.held()):  # a stalled process: nobody stamps its claim
            keeper.release(token)
        EventRunStep.objects.filter(pk=step.pk).update(claimed_at=datetime(2000, 1, 1, tzinfo=UTC))
        sweep()  # gives the step back by key: nothing was made yet
        gate.open()
        wait_until(lambda: settled(step), "the late answer")
        wait_until(lambda: bool(heard), "the late answer's signal")
    finally:
        signals.late_answer.disconnect(dispatch_uid="test-late")
    entry = run.log.get(kind="step.late_after_cleanup")
    assert entry.detail["step"] == step.pk and entry.detail["recorded"] == 2
    assert heard == [(step.pk, 2)]


@world_db
def test_runs_whose_earlier_phases_wait_behind_a_later_step_in_flight_do_not_starve_others(
    world, isolated_registry, settings
):  # C5, C8: on a419c07 such a run counted as ready and took the batch on every pass
    from tests.helpers import Gate, spawn_step, wait_until
    from tests.test_in_flight import gated_spawn, register_spawn, settled

    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_RUN_BATCH": 1}
    gate = Gate()
    register_spawn(isolated_registry, gated_spawn(gate), budget_ms=200)
    waiting = new_run(name="waiting")
    assert execute_step(spawn_step(waiting, "north", 1)).outcome == "done"  # phase "main"
    hung = EventRunStep.objects.create(
        run=waiting, phase="later", seq=0, action_id="t.spawn", params={"count": 1}
    )
    assert execute_step(hung).outcome == "overdue"
    EventRun.objects.transition(waiting, "cancelled", from_="running")
    other = new_run(name="other")
    assert execute_step(spawn_step(other, "south", 1)).outcome == "done"
    EventRun.objects.transition(other, "cancelled", from_="running")
    assert waiting.pk < other.pk
    report = sweep()
    assert [s.run_id for s in report.runs] == [other.pk]
    other.refresh_from_db()
    assert other.cleanup_status == "complete"
    gate.open()
    wait_until(lambda: settled(hung), "the late answer")


# ── a later phase never starts after its run's cleanup began ──


@world_db
def test_a_step_read_before_its_run_was_cancelled_and_swept_is_not_performed(
    isolated_registry, settings, vendor, monkeypatch
):  # the invariant, C8, W5: the general path's claim decides on the run under its lock
    if vendor == "sqlite":
        pytest.skip("SQLite's transaction holds the file: the cancel waits for the claim")
    from events_ledger import ledger
    from tests.helpers import PATIENCE_S, Gate, in_thread

    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "FAST_PATH": False}
    calls = _calls(isolated_registry)
    run = new_run()
    step = new_step(run, "t.make")
    gate = Gate()
    real = ledger.registry

    class Pausing:
        """The registry, whose first look-up (right after the step and its run are read,
        before the claim) waits for the test."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def action(self, action_id: str) -> Any:
            if not gate.entered.is_set():
                gate.pass_through()
            return real.action(action_id)

    monkeypatch.setattr(ledger, "registry", Pausing())
    thread, box = in_thread(lambda: execute_step(step.pk))
    assert gate.entered.wait(PATIENCE_S)
    # Meanwhile: the run is cancelled and swept (nothing of the step is in flight yet).
    assert EventRun.objects.transition(run, "cancelled", from_="running")
    sweep()
    gate.open()
    thread.join(PATIENCE_S)
    assert "error" not in box, box.get("error")
    # On a419c07 the claim went ahead on the status read before the cancel: performed.
    assert calls == [] and box["value"].outcome == "failed"
    assert "cancelled" in box["value"].error
    assert not Res.filter(run=run).exclude(status="reverted").exists()


@world_db
def test_a_fast_claim_beside_a_cancel_in_progress_waits_for_it_and_is_refused(
    isolated_registry, vendor
):  # the invariant, C8, W5: the fast path's claim reads the run under its lock
    if vendor == "sqlite":
        pytest.skip("the fast path runs on MariaDB and PostgreSQL")
    from events_ledger import fastpath
    from tests.helpers import PATIENCE_S, in_thread, wait_until

    connection.ensure_connection()
    if connection.Database.__name__ == "psycopg2":
        pytest.skip("the fast path is psycopg 3's; psycopg2 takes the general path")
    assert fastpath.enabled()
    calls = _calls(isolated_registry)
    run = new_run()
    step = new_step(run, "t.make")
    table = EventRun._meta.db_table
    cancel = connections.create_connection("default")
    probe = connections.create_connection("default")
    try:
        cancel.set_autocommit(False)
        with cancel.cursor() as c:  # the host's cancel, not committed yet
            c.execute(f"UPDATE {table} SET status = 'cancelled' WHERE id = %s", [run.pk])
        thread, box = in_thread(lambda: execute_step(step))  # one statement: not read first

        def blocked() -> bool:
            with probe.cursor() as c:
                if vendor == "mysql":
                    c.execute(  # a statement of the block, waiting on the run's row
                        "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                        "WHERE COMMAND = 'Query' AND ID <> CONNECTION_ID() "
                        f"AND INFO LIKE '%%{table}%%'"
                    )
                else:
                    c.execute(
                        "SELECT COUNT(*) FROM pg_stat_activity WHERE query LIKE 'WITH marked%%' "
                        "AND wait_event_type = 'Lock'"
                    )
                return bool(c.fetchone()[0])

        wait_until(lambda: blocked() or not thread.is_alive(), "the claim to wait on the run")
        cancel.commit()
        thread.join(PATIENCE_S)
    finally:
        cancel.close()
        probe.close()
    assert "error" not in box, box.get("error")
    # On a419c07 PostgreSQL's claim read the run from its snapshot: running, performed.
    assert calls == [] and box["value"].outcome == "failed"
    assert EventRun.objects.get(pk=run.pk).status == "cancelled"


# ── a claim the server gave up on is not sent into the same wait ──


@world_db
@pytest.mark.parametrize("path", ["fast", "general"])
def test_a_claim_that_waited_past_the_lock_timeout_answers_busy_without_waiting_again(
    isolated_registry, settings, vendor, path
):  # W5: on a419c07 it was retried five waits long, then raised the driver's 1205
    if vendor == "sqlite":
        pytest.skip("SQLite's busy timeout is the file's, not a row's")
    from events_ledger import db
    from tests.helpers import PATIENCE_S, in_thread

    if path == "general":
        settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "FAST_PATH": False}
    calls = _calls(isolated_registry)
    run = new_run()
    step = new_step(run, "t.make")
    host = connections.create_connection("default")
    before = dict(db.retries)
    try:
        host.set_autocommit(False)
        with host.cursor() as c:  # a host's transaction holding the run's row
            c.execute(f"UPDATE {EventRun._meta.db_table} SET name = name WHERE id = %s", [run.pk])

        def execute() -> Any:
            with connection.cursor() as c:  # a short wait, so the test is short
                if vendor == "mysql":
                    c.execute("SET SESSION innodb_lock_wait_timeout = 1")
                else:
                    c.execute("SET lock_timeout = '1s'")
            return execute_step(step.pk)

        thread, box = in_thread(execute)
        thread.join(PATIENCE_S)
    finally:
        host.rollback()
        host.close()
    assert "error" not in box, box.get("error")
    result = box["value"]
    assert result.outcome == "busy" and "lock" in result.error
    assert calls == [] and dict(db.retries) == before  # no wait was entered twice
    step.refresh_from_db()
    assert step.status == "pending" and step.attempts == 0
    # The lock gone, the same step runs.
    assert execute_step(step).outcome == "done" and calls == ["perform"]


# ── verdicts in hand when a process ends gracefully ──


def _refusing_verdict_writes(monkeypatch: Any, allowed: Any) -> None:
    """Verdict writes refused (a lock held past every retry) until ``allowed()``."""
    from django.db import OperationalError

    from events_ledger import cleanup

    write = cleanup._write_verdicts

    def refusing(*args: Any, **kwargs: Any) -> Any:
        if not allowed():
            raise OperationalError(1205, "Lock wait timeout exceeded")
        return write(*args, **kwargs)

    monkeypatch.setattr(cleanup, "VERDICT_WRITE_BUDGET_S", 0.0)
    monkeypatch.setattr(cleanup, "_write_verdicts", refusing)


@world_db
@pytest.mark.slow
def test_a_sweeper_that_exits_on_its_own_writes_the_verdicts_it_holds(world):  # C4, rule 1
    # On a419c07 nothing wrote them at exit: the rows waited out REVERT_CLAIM_TTL and the
    # module was asked a second time.
    from project.world.models import Call, Creature
    from tests.helpers import finished_run
    from tests.processes import finish, start

    run = finished_run(2)
    child = start("sweep_then_exit", {})
    answer = finish(child)
    assert child.returncode == 0 and answer == {"errors": 1, "in_hand": 1}
    assert set(Res.filter(run=run, kind="creature").values_list("status", flat=True)) == {
        "reverted"
    }
    assert Creature.objects.count() == 0
    assert Call.objects.filter(verb="despawn").count() == 1  # asked once


@world_db
def test_cleanup_runs_loop_stopped_by_sigterm_writes_the_verdicts_it_holds(
    world, monkeypatch
):  # S1, C4: on a419c07 the loop returned and the verdicts went with the process
    import signal
    import threading

    from django.core.management import CommandError, call_command

    from events_ledger import cleanup
    from tests.helpers import finished_run, wait_until

    stopped = threading.Event()
    main = threading.main_thread()
    # Only the command's own last write may land: the process's writer thread stays
    # refused, as a lock would keep refusing it until the process is gone.
    _refusing_verdict_writes(
        monkeypatch, lambda: stopped.is_set() and threading.current_thread() is main
    )
    run = finished_run(2)
    trouble: list[BaseException] = []

    def operator() -> None:
        try:
            wait_until(lambda: len(cleanup._backlog) == 1, "a verdict in hand")
        except BaseException as exc:
            trouble.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            stopped.set()

    threading.Thread(target=operator, daemon=True).start()
    out, err = open(os.devnull, "w"), open(os.devnull, "w")
    code = 0
    try:
        call_command("cleanup_runs", "--loop", "0.1", stdout=out, stderr=err)
    except CommandError as exc:
        code = exc.returncode
    assert not trouble, trouble
    assert len(cleanup._backlog) == 0
    assert set(Res.filter(run=run, kind="creature").values_list("status", flat=True)) == {
        "reverted"
    }
    assert code == 1  # a pass could not write its verdicts at once: said, not hidden


@world_db
def test_cleanup_runs_run_with_verdicts_in_hand_writes_them_not_a_traceback(
    world, monkeypatch
):  # S1, C4: on a419c07 VerdictsInHand escaped as a traceback
    from django.core.management import CommandError, call_command

    from events_ledger import cleanup
    from tests.helpers import finished_run

    tries = {"n": 0}

    def allowed() -> bool:
        tries["n"] += 1
        return tries["n"] > 1  # the pass's own write refused, the command's next one lands

    _refusing_verdict_writes(monkeypatch, allowed)
    run = finished_run(2)
    out, err = open(os.devnull, "w"), open(os.devnull, "w")
    try:
        call_command("cleanup_runs", "--run", str(run.pk), stdout=out, stderr=err)
        code = 0
    except CommandError as exc:
        code = exc.returncode
    assert code == 0 and len(cleanup._backlog) == 0
    run.refresh_from_db()
    assert run.cleanup_status == "complete"


@world_db
def test_the_last_verdict_try_drops_a_dead_connection(world, monkeypatch):  # C4, #24
    # On a419c07 the last try raised before it looked: the thread's next statement then
    # failed on the dead connection.
    from django.db import OperationalError

    from events_ledger import cleanup
    from tests.helpers import finished_run

    def lost(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError(2013, "Lost connection to server during query")

    monkeypatch.setattr(cleanup, "VERDICT_WRITE_TRIES", 1)
    monkeypatch.setattr(cleanup, "_write_verdicts", lost)
    finished_run(1)
    connection.ensure_connection()
    before = connection.connection
    with pytest.raises(OperationalError):
        cleanup._persistently(lambda: cleanup._write_verdicts())
    assert connection.connection is None and before is not None


# ── a pass interrupted, or longer than its claims (the host's edge, 2 and 3) ──


class TimeLimit(Exception):  # noqa: N818
    """As Celery's SoftTimeLimitExceeded: a plain Exception raised in the task's thread."""


@world_db
@pytest.mark.parametrize("width", [1, 4])
def test_a_pass_interrupted_while_its_calls_run_asks_each_key_once_and_writes_the_answer(
    isolated_registry, settings, width
):  # C4, R5: one call per key at a time; an answer in hand is written
    import signal
    import threading

    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_CONCURRENCY": width}
    gate, inside = threading.Event(), threading.Event()
    asked: list[str] = []

    def revert(*, idempotency_key: str, **_: Any) -> dict[str, Any]:
        asked.append(idempotency_key)
        inside.set()
        assert gate.wait(30)
        return {"ok": True}

    def perform(*, idempotency_key: str, **_: Any) -> dict[str, Any]:
        return {"ok": True, "resources": [{"kind": "thing", "ref": idempotency_key}]}

    ledger_action(isolated_registry, "t.make", perform=perform, revert=revert)
    runs = []
    for _ in range(3):
        run = new_run()
        assert execute_step(new_step(run, "t.make")).outcome == "done"
        EventRun.objects.transition(run, "cancelled", from_="running")
        runs.append(run)

    def alarm(*_: Any) -> None:
        if not inside.is_set():  # not yet inside the module: ask again a little later
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        raise TimeLimit("soft time limit exceeded")

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(TimeLimit) as interrupted:
            sweep()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert any("interrupted while module calls ran" in n for n in interrupted.value.__notes__)
    running = list(asked)
    assert len(running) == width if width < 3 else len(running) == 3
    # While the calls run: nothing is failed, nothing handed back, nobody asks again.
    assert not Res.filter(revert_attempts__gt=0).exists()
    assert not sweep().runs and all(cleanup_run(run).attempted == 0 for run in runs)
    assert asked == running
    gate.set()
    # Written when the calls end, by this process's keeper: no pass needed.
    wait_until(
        lambda: Res.filter(kind="thing", status="reverted").count() == len(running),
        "the interrupted pass's answers written",
    )
    while sweep().runs:  # what was never started is given back by the next passes
        pass
    assert sorted(asked) == sorted({r.steps.get().idempotency_key for r in runs})
    assert set(Res.values_list("status", "revert_attempts")) == {("reverted", 0)}
    assert {r.cleanup_status for r in EventRun.objects.all()} == {"complete"}


@world_db
@pytest.mark.slow
def test_a_pass_longer_than_its_claims_ttl_keeps_them_from_a_second_sweeper(
    world, settings
):  # C4, R5: the keeper re-stamps a running pass's claims
    import time

    from project.world.models import Call
    from tests.helpers import spawn_step
    from tests.processes import finish, start

    ttl = {"REVERT_CLAIM_TTL": 1, "STEP_CLAIM_TTL": 60, "CLEANUP_CONCURRENCY": 1}
    settings.EVENTS_LEDGER = ttl
    run = new_run()
    for seq, region in enumerate(("north", "south")):
        assert execute_step(spawn_step(run, region, count=1, seq=seq)).outcome == "done"
    EventRun.objects.transition(run, "cancelled", from_="running")
    world.switch_on("despawn.wait")
    child = start("sweep", {"rounds": 3}, settings=ttl)
    try:
        wait_until(lambda: Call.objects.filter(verb="despawn").exists(), "the child's revert")
        began = time.monotonic()
        # Twice the TTL: a claim nobody re-stamped would be anybody's now.
        wait_until(lambda: time.monotonic() - began > 2.0, "twice the claim's TTL")
        claimed = Res.filter(run=run, status="reverting")
        assert claimed.exists()
        assert not sweep().runs  # the second sweeper takes nothing
        assert Call.objects.filter(verb="despawn").count() == 1
    finally:
        world.switch_off()
        answer = finish(child)
    assert answer["worked"] >= 1
    keys = list(Call.objects.filter(verb="despawn").values_list("idempotency_key", flat=True))
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 2
    assert not Res.filter(run=run).exclude(status="reverted").exists()


@world_db
def test_a_lost_reply_to_the_summaries_commit_still_reports_and_signals_the_pass(
    isolated_registry, monkeypatch
):  # C4: an outcome not known is read back, never lost
    from django.db import OperationalError

    import events_ledger.cleanup as cleanup
    from events_ledger import signals

    calls = _calls(isolated_registry)
    run = _ended_run()
    real_settle, real_in_transaction = cleanup._settle_and_log, cleanup.in_transaction
    state = {"settling": False, "lost": 0}

    def settle(*args: Any, **kwargs: Any) -> Any:
        state["settling"] = True
        return real_settle(*args, **kwargs)

    def in_transaction(fn: Any, *args: Any, **kwargs: Any) -> Any:
        state["settling"] = False
        result = real_in_transaction(fn, *args, **kwargs)
        if state["settling"] and not state["lost"]:
            state["lost"] += 1  # committed; its answer never came back
            raise OperationalError(2013, "Lost connection to server during query")
        return result

    monkeypatch.setattr(cleanup, "_settle_and_log", settle)
    monkeypatch.setattr(cleanup, "in_transaction", in_transaction)
    completed: list[int] = []

    def on_complete(sender: Any, run: Any, **kwargs: Any) -> None:
        completed.append(run.pk)

    signals.cleanup_complete.connect(on_complete, dispatch_uid="test-lost-commit")
    try:
        summary = cleanup_run(run)
    finally:
        signals.cleanup_complete.disconnect(dispatch_uid="test-lost-commit")
    assert state["lost"] == 1 and calls == ["perform", "revert"]
    assert (summary.reverted, summary.cleanup_status) == (1, "complete")
    assert completed == [run.pk]


@world_db
def test_an_interrupt_while_the_verdicts_are_written_keeps_them_in_hand(
    isolated_registry, monkeypatch
):  # C4, rule 1: a BaseException during the write dropped the module's answers
    import events_ledger.cleanup as cleanup

    calls = _calls(isolated_registry)
    run = _ended_run()
    real = cleanup._write_verdicts
    raised: list[int] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if not raised:
            raised.append(1)
            raise KeyboardInterrupt  # Ctrl-C, or a host's BaseException, mid-write
        return real(*args, **kwargs)

    monkeypatch.setattr(cleanup, "_write_verdicts", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cleanup_run(run)
    assert len(cleanup._backlog) == 1  # on a419c07: 0, the answer gone with the interrupt
    assert Res.get(run=run, kind="thing").status == "reverting"
    sweep()  # written first, not asked again
    assert calls == ["perform", "revert"] and len(cleanup._backlog) == 0
    assert Res.get(run=run, kind="thing").status == "reverted"


@world_db
def test_the_keeper_never_restamps_a_row_a_pass_handed_back(isolated_registry):  # C4, R5
    # A row handed back (stale at LONG_AGO, its claim count given back) re-stamped by the
    # keeper was claimed again by a hand that no longer calls it, and its count was
    # given back a second time by the next write.
    from datetime import timedelta

    from django.utils import timezone

    from events_ledger.background import keeper
    from events_ledger.querysets import LONG_AGO
    from tests.factories import ResourceFactory, RunFactory

    run = RunFactory(status="cancelled", cleanup_status="pending")
    handed = ResourceFactory(run=run, ref="a", status="reverting", claim_token="t" * 32)
    held = ResourceFactory(run=run, ref="b", status="reverting", claim_token="t" * 32)
    Res.filter(pk=handed.pk).update(updated_at=LONG_AGO)
    Res.filter(pk=held.pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    keeper.hold_revert("t" * 32)
    try:
        keeper.beat()
    finally:
        keeper.release_revert("t" * 32)
    assert Res.get(pk=handed.pk).updated_at == LONG_AGO
    assert Res.get(pk=held.pk).updated_at > timezone.now() - timedelta(minutes=1)
