"""The ledger table and its SQL (SPEC R0–R11), on whichever database the suite runs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction

from events_ledger.models import STEP_KIND, EventRun, EventRunLog, EventRunResource
from events_ledger.querysets import Holder
from tests.conftest import age_rows
from tests.factories import ResourceFactory, RunFactory, StepFactory
from tests.helpers import connection, revert_ttl

pytestmark = pytest.mark.django_db

Res = EventRunResource.objects


def reserve(run, ref="a", kind="thing", owner="test", **kw):
    return Res.reserve(run, kw.pop("step", None), owner=owner, kind=kind, ref=ref, **kw)


# ── R0 ──


def test_live_marker_is_one_while_held_and_null_once_released():  # R0
    row = ResourceFactory(status="pending")
    for status, marker in [
        ("pending", 1),
        ("confirmed", 1),
        ("reverting", 1),
        ("reverted", None),
        ("orphaned", None),
        ("drifted", None),
    ]:
        Res.filter(pk=row.pk).update(status=status)
        assert Res.values_list("live_marker", flat=True).get(pk=row.pk) == marker, status


def test_database_refuses_a_second_held_row_for_one_target():  # R0
    ResourceFactory(ref="x", status="confirmed")
    with pytest.raises(IntegrityError), transaction.atomic():
        ResourceFactory(ref="x", status="pending")


def test_any_number_of_released_rows_per_target():  # R0
    for status in ("reverted", "reverted", "orphaned", "drifted"):
        ResourceFactory(ref="x", status=status)
    ResourceFactory(ref="x", status="confirmed")
    assert Res.filter(ref="x").count() == 5


def test_key_compares_byte_for_byte_whatever_the_server_collation():  # R0, collation fact
    run = RunFactory()
    refs = ["Dragon", "dragon", "dragon ", "DRAGON", "drágon", "😀", "😁", "🐉", "ß", "ss"]
    answers = [reserve(run, ref=r) for r in refs]
    assert all(a.ok for a in answers), answers
    assert sorted(Res.filter(kind="thing").values_list("ref", flat=True)) == sorted(refs)
    assert list(Res.find_by_target("test", "thing", "dragon ").values_list("ref", flat=True)) == [
        "dragon "
    ]


def test_unique_constraint_lives_in_the_schema():  # R0
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(
            cursor, EventRunResource._meta.db_table
        )
    assert constraints["uq_evres_target"]["unique"]
    assert constraints["uq_evres_target"]["columns"] == [
        "owner_module",
        "kind",
        "ref",
        "live_marker",
    ]


# ── R1 ──


def test_reserve_inserts_a_pending_row_and_answers_its_id():  # R1
    run = RunFactory()
    step = StepFactory(run=run)
    answer = reserve(run, step=step, payload={"n": 1}, member_key="m")
    assert answer.ok and answer.code is None
    row = Res.get(pk=answer.id)
    assert (row.status, row.step_id, row.payload, row.member_key) == (
        "pending",
        step.pk,
        {"n": 1},
        "m",
    )


def test_reserve_of_a_held_target_is_refused_naming_the_holder():  # R1
    first, second = RunFactory(), RunFactory()
    assert reserve(first, ref="t").ok
    answer = reserve(second, ref="t")
    assert not answer.ok
    assert answer.code == "held"
    assert answer.holder == Holder(run_id=first.pk, status="pending")
    assert Res.filter(ref="t").count() == 1


def test_refusal_does_not_break_the_callers_transaction():  # R1
    first, second = RunFactory(), RunFactory()
    with transaction.atomic():
        assert reserve(first, ref="t").ok
        assert not reserve(second, ref="t").ok
        # The transaction is still usable, and keeps what it did before the refusal.
        assert reserve(second, ref="u").ok
        assert Res.filter(run=first).count() == 1
    assert Res.filter(run=second).count() == 1


def test_reserve_of_a_released_target_succeeds():  # R1, R0
    ResourceFactory(ref="t", status="reverted")
    assert reserve(RunFactory(), ref="t").ok


# ── R2 ──


def test_confirm_moves_pending_to_confirmed_setting_only_given_fields():  # R2
    run = RunFactory()
    row_id = reserve(run, payload={"a": 1}, member_key="k").id
    assert Res.confirm(row_id, payload={"b": 2})
    row = Res.get(pk=row_id)
    assert (row.status, row.payload, row.member_key, row.lease_until) == (
        "confirmed",
        {"b": 2},
        "k",
        None,
    )


def test_confirm_never_unreverts_a_row():  # R2
    row = ResourceFactory(status="reverted")
    for status in ("reverted", "confirmed", "reverting", "orphaned", "drifted"):
        Res.filter(pk=row.pk).update(status=status, payload=None)
        assert not Res.confirm(row.pk, payload={"late": True})
        assert Res.get(pk=row.pk).status == status
        assert Res.get(pk=row.pk).payload is None


# ── R3 ──


def test_resolve_placeholder_frees_the_idempotency_key():  # R3
    run = RunFactory()
    ph = reserve(run, kind=STEP_KIND, ref="key-1").id
    Res.filter(pk=ph).update(last_error="boom")
    assert Res.resolve_placeholder(ph)
    row = Res.get(pk=ph)
    assert (row.status, row.last_error) == ("reverted", None)
    assert reserve(run, kind=STEP_KIND, ref="key-1").ok


def test_resolve_placeholder_touches_only_live_step_rows():  # R3
    thing = ResourceFactory(status="confirmed")
    assert not Res.resolve_placeholder(thing.pk)
    ph = ResourceFactory(kind=STEP_KIND, status="orphaned")
    assert not Res.resolve_placeholder(ph.pk)
    assert Res.get(pk=ph.pk).status == "orphaned"


# ── R4 ──


def test_reads():  # R4
    run, other = RunFactory(), RunFactory()
    old = ResourceFactory(run=run, ref="t", status="reverted")
    new = ResourceFactory(run=run, ref="t", status="confirmed")
    drifted = ResourceFactory(run=run, status="drifted", revert_attempts=3)
    ResourceFactory(run=run, status="reverted")
    ResourceFactory(run=other, status="orphaned")
    assert list(Res.find_by_target("test", "thing", "t")) == [new, old]
    assert [r.pk for r in Res.for_run(run)] == sorted(r.pk for r in Res.filter(run=run))
    assert list(Res.unresolved_for_run(run)) == [new, drifted]
    assert list(Res.unresolved_for_run(run, max_attempts=3)) == [new]
    assert Res.unresolved_count(run) == 2
    quiet = RunFactory()
    with _queries() as q:
        counts = Res.unresolved_counts([run.pk, other.pk, quiet.pk])
    assert counts == {run.pk: 2, other.pk: 1}
    assert len(q) == 1


# ── R5 ──


def test_claim_is_a_compare_and_set_with_one_winner():  # R5
    row = ResourceFactory(status="confirmed")
    token = Res.claim_revert(row.pk, revert_ttl())
    assert token
    assert Res.claim_revert(row.pk, revert_ttl()) is None
    row.refresh_from_db()
    assert (row.status, row.claim_token, row.claim_count) == ("reverting", token, 1)


@pytest.mark.parametrize("status", ["pending", "confirmed", "orphaned", "drifted"])
def test_claim_takes_every_unresolved_status(status):  # R5
    row = ResourceFactory(status=status)
    assert Res.claim_revert(row.pk, revert_ttl())


@pytest.mark.parametrize("status", ["reverted"])
def test_claim_never_takes_a_reverted_row(status):  # R5
    row = ResourceFactory(status=status)
    assert Res.claim_revert(row.pk, revert_ttl()) is None


def test_stale_claim_is_reclaimed_without_spending_an_attempt():  # R5
    row = ResourceFactory(status="confirmed", revert_attempts=1)
    first = Res.claim_revert(row.pk, revert_ttl())
    ttl = timedelta(hours=1)
    # Fresh, by the database's UTC clock: not reclaimable. The MariaDB rig runs its
    # server at +05:00, so a clock mixed with the session zone fails one of these.
    assert Res.claim_revert(row.pk, ttl=ttl) is None
    age_rows(EventRunResource, [row.pk], seconds=2 * 3600)
    second = Res.claim_revert(row.pk, ttl=ttl)
    assert second and second != first
    # Re-stamped: a second claimer of the same stale row now loses.
    assert Res.claim_revert(row.pk, ttl=ttl) is None
    row.refresh_from_db()
    assert (row.revert_attempts, row.claim_count, row.claim_token) == (1, 2, second)


def test_claim_ttl_comes_from_settings(settings):  # R5, S4
    row = ResourceFactory(status="confirmed")
    Res.claim_revert(row.pk, revert_ttl())
    age_rows(EventRunResource, [row.pk], seconds=90)
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "REVERT_CLAIM_TTL": timedelta(minutes=2)}
    assert Res.claim_revert(row.pk, revert_ttl()) is None
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "REVERT_CLAIM_TTL": timedelta(minutes=1)}
    assert Res.claim_revert(row.pk, revert_ttl())


def test_claim_of_a_released_row_whose_target_is_held_again_is_no_claim():  # R5, collision
    mine, theirs = RunFactory(), RunFactory()
    released = ResourceFactory(run=mine, ref="t", status="orphaned")
    ResourceFactory(run=theirs, ref="t", status="confirmed")
    assert Res.claim_revert(released.pk, revert_ttl()) is None  # no IntegrityError escapes
    fresh = ResourceFactory(run=mine, status="confirmed")
    claim = Res.claim_group([released.pk, fresh.pk], revert_ttl())
    assert claim.ids == [fresh.pk]
    assert claim.collided == [released.pk]
    assert Res.get(pk=released.pk).status == "orphaned"
    holder = Res.note_collision(released.pk)
    released.refresh_from_db()
    assert holder.run_id == theirs.pk
    assert released.revert_attempts == 1
    assert f"run {theirs.pk}" in released.last_error


def test_group_claim_costs_the_same_statements_for_5_and_50_rows():  # R5, groups O(1)
    def cost(n):
        run = RunFactory()
        rows = [ResourceFactory(run=run) for _ in range(n)]
        with _queries() as q:
            claim = Res.claim_group([r.pk for r in rows], revert_ttl())
        assert len(claim.rows) == n
        return len(q)

    assert cost(5) == cost(50)


def test_stale_claimant_cannot_overwrite_the_new_claimants_verdict():  # R5, fenced verdicts
    row = ResourceFactory(status="confirmed")
    old = Res.claim_revert(row.pk, revert_ttl())
    age_rows(EventRunResource, [row.pk], seconds=3600)
    new = Res.claim_revert(row.pk, ttl=timedelta(minutes=1))
    assert Res.fail_revert(row.pk, "late", token=old) == 0
    assert Res.mark_reverted(row.pk, token=old) == 0
    assert Res.get(pk=row.pk).status == "reverting"
    assert Res.mark_reverted(row.pk, token=new) == 1


# ── R6, R7 ──


def test_mark_reverted_is_terminal_clears_the_error_and_releases_the_target():  # R6
    run = RunFactory()
    row = ResourceFactory(run=run, ref="t", status="confirmed", last_error="x")
    token = Res.claim_revert(row.pk, revert_ttl())
    assert Res.mark_reverted(row.pk, token=token) == 1
    row.refresh_from_db()
    assert (row.status, row.last_error, row.live_marker) == ("reverted", None, None)
    assert Res.claim_revert(row.pk, revert_ttl()) is None
    assert reserve(RunFactory(), ref="t").ok


@pytest.mark.parametrize("restore_to", ["confirmed", "drifted", "orphaned"])
def test_fail_revert_counts_an_attempt_and_keeps_the_error(restore_to):  # R7
    row = ResourceFactory(status="confirmed")
    token = Res.claim_revert(row.pk, revert_ttl())
    assert Res.fail_revert(row.pk, "x" * 900, restore_to, token=token) == 1
    row.refresh_from_db()
    assert (row.status, row.revert_attempts, row.last_error) == (restore_to, 1, "x" * 500)


def test_fail_revert_with_no_error_says_so():  # R7
    row = ResourceFactory(status="confirmed")
    Res.fail_revert(row.pk, "", token=Res.claim_revert(row.pk, revert_ttl()))
    assert Res.get(pk=row.pk).last_error


def test_revert_attempts_change_only_in_fail_revert():  # R7, R5
    row = ResourceFactory(status="confirmed")
    for _ in range(3):
        Res.claim_revert(row.pk, revert_ttl())
        age_rows(EventRunResource, [row.pk], seconds=3600)
    assert Res.get(pk=row.pk).revert_attempts == 0
    Res.claim_revert(row.pk, revert_ttl())
    Res.mark_reverted(row.pk)
    assert Res.get(pk=row.pk).revert_attempts == 0


def test_fail_revert_refuses_an_unknown_destination():  # R7
    with pytest.raises(ValueError):
        Res.fail_revert(1, "x", "reverted")


# ── R8 ──


def test_reset_attempts_zeroes_unresolved_rows_only():  # R8
    run = RunFactory()
    a = ResourceFactory(run=run, status="confirmed", revert_attempts=3, claim_count=2)
    b = ResourceFactory(run=run, status="drifted", revert_attempts=2)
    c = ResourceFactory(run=run, status="reverted", revert_attempts=1)
    other = ResourceFactory(status="confirmed", revert_attempts=3)
    assert Res.reset_attempts(run) == 2
    assert [Res.get(pk=x.pk).revert_attempts for x in (a, b, c, other)] == [0, 0, 1, 3]
    assert Res.get(pk=a.pk).claim_count == 0


def test_reset_attempts_keeps_a_claims_stamp():  # R8, R5
    row = ResourceFactory(status="confirmed", revert_attempts=1)
    Res.claim_revert(row.pk, revert_ttl())
    age_rows(EventRunResource, [row.pk], seconds=3600)
    stamp = Res.get(pk=row.pk).updated_at
    Res.reset_attempts(row.run)
    assert Res.get(pk=row.pk).updated_at == stamp


# ── R9, R10 ──


def test_live_for_module_and_modules_with_live_rows():  # R9
    rows = [
        ResourceFactory(owner_module="m1", status=s)
        for s in ("pending", "confirmed", "reverting", "reverted")
    ]
    ResourceFactory(owner_module="m2", status="confirmed")
    ResourceFactory(owner_module="m3", status="orphaned")
    assert Res.live_for_module("m1") == rows[:2]
    assert Res.live_for_module("m1", limit=1) == rows[:1]
    assert Res.modules_with_live_rows() == ["m1", "m2"]


@pytest.mark.parametrize(
    "status,moves",
    [
        ("pending", True),
        ("confirmed", True),
        ("reverting", False),  # a live revert claim: its sweeper's verdict must land
        ("reverted", False),
        ("drifted", False),
    ],
)
def test_mark_orphaned_only_from_live_or_a_dead_claim(status, moves):  # R10
    row = ResourceFactory(status=status)
    assert Res.mark_orphaned(row.pk, "gone", ttl=revert_ttl()) == int(moves)
    row.refresh_from_db()
    assert row.status == ("orphaned" if moves else status)
    assert (row.last_error == "gone") == moves


def test_mark_orphaned_takes_a_reverting_row_whose_claim_is_stale():  # R10, R5
    row = ResourceFactory(status="reverting")
    age_rows(EventRunResource, [row.pk], 120)
    assert Res.mark_orphaned(row.pk, "gone", ttl=timedelta(seconds=60)) == 1
    row.refresh_from_db()
    assert row.status == "orphaned"


# ── R11 ──


def test_cleanup_scan():  # R11
    def run_with(status, cleanup, row_status="confirmed", attempts=0):
        run = RunFactory(status=status, cleanup_status=cleanup)
        ResourceFactory(run=run, status=row_status, revert_attempts=attempts)
        ResourceFactory(run=run, status=row_status, revert_attempts=attempts)  # distinct
        return run

    picked = [
        run_with("completed", "pending"),
        run_with("cancelled", "not_required"),  # a lease-only run never marked dirty
        run_with("failed", "pending", "drifted"),
        run_with("missed", "pending", "reverting"),
    ]
    run_with("running", "pending")  # not terminal
    run_with("completed", "incomplete")
    run_with("completed", "complete")
    run_with("completed", "pending", "reverted")
    run_with("completed", "pending", attempts=3)  # spent
    found = EventRun.objects.needing_cleanup(limit=10, max_attempts=3)
    assert found == picked
    assert EventRun.objects.needing_cleanup(limit=2, max_attempts=3) == picked[:2]


# ── run transitions, log ──


def test_run_transition_is_a_compare_and_set():  # R (run transitions)
    run = RunFactory(status="pending")
    assert EventRun.objects.transition(run, "running", from_="pending")
    assert not EventRun.objects.transition(run, "running", from_="pending")
    assert EventRun.objects.transition(run, "cancelled", from_=["pending", "running"])
    run.refresh_from_db()
    assert run.status == "cancelled" and run.started_at and run.finished_at


def test_set_cleanup_status_only_from():  # R (run transitions), W4
    run = RunFactory(cleanup_status="complete")
    assert not EventRun.objects.set_cleanup_status(run, "pending", only_from=["not_required"])
    assert EventRun.objects.set_cleanup_status(run, "pending")
    assert not EventRun.objects.set_cleanup_status(run, "pending")


def test_settle_derives_the_summary_from_the_rows():  # R, summaries race too
    run = RunFactory(status="completed", cleanup_status="pending")
    settle = lambda: EventRun.objects.settle_cleanup(run, max_attempts=3, max_claims=5)[0]  # noqa: E731
    assert settle() == "complete"
    row = ResourceFactory(run=run, status="confirmed", revert_attempts=2)
    assert settle() == "pending"
    Res.filter(pk=row.pk).update(revert_attempts=3)
    assert settle() == "incomplete"
    Res.filter(pk=row.pk).update(revert_attempts=0, claim_count=5)
    assert settle() == "incomplete"


def test_repair_fixes_summaries_that_disagree_with_rows():  # R, summaries race too
    stale_pending = RunFactory(status="completed", cleanup_status="pending")
    stale_incomplete = RunFactory(status="completed", cleanup_status="incomplete")
    spent = RunFactory(status="completed", cleanup_status="pending")
    ResourceFactory(run=spent, status="confirmed", revert_attempts=3)
    fine = RunFactory(status="completed", cleanup_status="pending")
    ResourceFactory(run=fine, status="confirmed")
    # Rows recorded after the run's cleanup ended (a late answer): the summary forgot them.
    late = RunFactory(status="cancelled", cleanup_status="complete")
    ResourceFactory(run=late, status="confirmed")
    never_dirty = RunFactory(status="failed", cleanup_status="not_required")
    ResourceFactory(run=never_dirty, status="pending")
    clean = RunFactory(status="completed", cleanup_status="complete")
    ResourceFactory(run=clean, status="reverted")
    nothing = RunFactory(status="completed", cleanup_status="not_required")
    running = RunFactory(status="running", cleanup_status="complete")
    ResourceFactory(run=running, status="confirmed")
    repaired = EventRun.objects.repair_cleanup_summaries(3, 5)
    assert repaired == sorted(
        [
            (stale_pending.pk, "complete"),
            (stale_incomplete.pk, "complete"),
            (spent.pk, "incomplete"),
            (late.pk, "pending"),
            (never_dirty.pk, "pending"),
        ]
    )
    got = {r.pk: r.cleanup_status for r in EventRun.objects.all()}
    assert got[fine.pk] == "pending"
    assert got[clean.pk] == "complete" and got[nothing.pk] == "not_required"
    assert got[running.pk] == "complete"  # a run in flight is not the sweep's


def test_repair_never_updates_the_table_it_selects_from():  # MySQL 1093
    # MySQL refuses UPDATE run … WHERE id IN (SELECT … FROM run …); MariaDB accepts it,
    # so only the statements themselves can show the form is portable.
    run = RunFactory(status="completed", cleanup_status="pending")
    with _queries() as ctx:
        EventRun.objects.repair_cleanup_summaries(3, 5)
    table = EventRun._meta.db_table
    updates = [
        q["sql"] for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE")
    ]
    assert updates, "the stale summary was repaired by an UPDATE"
    for sql in updates:
        where = sql.upper().split(" WHERE ", 1)[1]
        assert f"FROM {connection.ops.quote_name(table).upper()}" not in where, sql
    run.refresh_from_db()
    assert run.cleanup_status == "complete"


def test_log_write():  # C7
    run = RunFactory()
    entry = EventRunLog.objects.write(run, "cleanup.swept", {"n": 1})
    assert (entry.run_id, entry.kind, entry.detail) == (run.pk, "cleanup.swept", {"n": 1})


def test_a_run_with_ledger_rows_cannot_be_deleted():  # rule 1: never lose track
    from django.db.models import ProtectedError

    row = ResourceFactory()
    with pytest.raises(ProtectedError):
        row.run.delete()


def test_a_row_survives_its_steps_deletion():  # R (step nullable)
    step = StepFactory()
    row = ResourceFactory(run=step.run, step=step)
    step.delete()
    row.refresh_from_db()
    assert row.step_id is None


def _queries():
    from django.test.utils import CaptureQueriesContext

    return CaptureQueriesContext(connection)
