"""The undo half (SPEC C1–C7): giving back, on every terminal path, what a run took."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest
from django.test.utils import CaptureQueriesContext

from events_ledger import Action
from events_ledger.cleanup import (
    RunNotTerminal,
    cleanup_run,
    plan_run,
    reconcile_all,
    reconcile_module,
    sweep,
)
from events_ledger.deadline import CallResult
from events_ledger.envelopes import classify_revert
from events_ledger.ledger import execute_step
from events_ledger.models import STEP_KIND, EventRun, EventRunLog, EventRunResource
from project.world.models import Call, Creature, RegionSetting
from tests.conftest import age_rows
from tests.factories import ResourceFactory, RunFactory
from tests.helpers import (
    connection,
    lease_step,
    ledger_action,
    new_run,
    new_step,
    short_budget_world_spawn,
    spawn_step,
    wait_until,
)
from tests.processes import CHILD, race, spawn

Res = EventRunResource.objects
world_db = pytest.mark.django_db(transaction=True)


# ── C1 ──


@pytest.mark.parametrize(
    "raw,outcome",
    [
        (CallResult(timed_out=True, what="x", budget_s=1), "retry"),
        (CallResult(error=RuntimeError("boom"), what="x"), "retry"),
        (None, "retry"),
        ("ok", "retry"),
        ([{"ok": True}], "retry"),
        ({"ok": 1}, "retry"),
        ({"ok": "true"}, "retry"),
        ({}, "retry"),
        ({"ok": False}, "retry"),
        ({"ok": False, "retry": False, "error": "gone for good"}, "terminal"),
        ({"ok": True}, "done"),
        ({"drifted": True, "current": 7}, "drifted"),
    ],
)
def test_classify_revert_reads_no_failure_as_success(raw, outcome):  # C1
    verdict = classify_revert(raw, "world.spawn")
    assert verdict.outcome == outcome
    if outcome != "done":
        assert verdict.error


def test_classify_revert_details():  # C1
    assert classify_revert({"ok": True, "failed": ["a", 2]}, "x").failed == ["a", "2"]
    assert "no envelope" in classify_revert("<html>", "x").error
    assert "7" in classify_revert({"drifted": True, "current": 7}, "x").error
    assert classify_revert({"ok": False, "error": "locked"}, "x").error == "locked"


# ── end to end on the world, per terminal path ──


def _spawned_run(world, status="completed", regions=("north", "south"), lease=True):
    RegionSetting.objects.get_or_create(region="north", defaults={"spawn_rate": 1})
    run = new_run()
    for i, region in enumerate(regions):
        assert execute_step(spawn_step(run, region, count=2, seq=i)).outcome == "done"
    if lease:
        assert execute_step(lease_step(run, "north", 5, seq=9)).outcome == "done"
    EventRun.objects.transition(run, status, from_="running")
    run.refresh_from_db()
    return run


@world_db
@pytest.mark.parametrize("status", ["completed", "cancelled", "failed", "missed"])
def test_every_terminal_path_restores_the_world(world, status):  # C4, C5
    before = world.snapshot()
    run = _spawned_run(world, status)
    assert (
        Creature.objects.count() == 4 and RegionSetting.objects.get(region="north").spawn_rate == 5
    )
    report = sweep()
    assert [s.run_id for s in report.runs] == [run.pk]
    summary = report.runs[0]
    assert (summary.attempted, summary.reverted, summary.failed, summary.remaining) == (5, 5, 0, 0)
    assert summary.cleanup_status == "complete"
    after = world.snapshot()
    assert after["creatures"] == [] and after["rates"] == {"north": 1} and before["creatures"] == []
    # One revert call per step group, one restore for the lease.
    assert Counter(Call.objects.values_list("verb", flat=True)) == {"despawn": 2, "restore": 1}
    assert EventRunLog.objects.filter(run=run, kind="cleanup.reverted").count() == 3
    assert EventRunLog.objects.filter(run=run, kind="cleanup.swept").count() == 1


@world_db
def test_a_running_run_is_never_swept(world):  # C5
    run = new_run()
    execute_step(spawn_step(run))
    assert sweep().runs == []
    with pytest.raises(RunNotTerminal):
        cleanup_run(run)
    assert Creature.objects.count() == 3


@world_db
def test_a_lost_spawn_is_reverted_by_its_idempotency_key(world):  # C3, rule 1
    world.switch_on("spawn.lose_answer")
    run = new_run()
    step = spawn_step(run, count=2)
    assert execute_step(step).outcome == "retry"
    EventRun.objects.transition(run, "cancelled", from_="running")
    summary = cleanup_run(run)
    assert (summary.reverted, summary.cleanup_status) == (1, "complete")
    call = Call.objects.get()
    assert (call.idempotency_key, call.refs) == (step.idempotency_key, [])
    assert Creature.objects.count() == 0


@world_db
def test_placeholder_rows_are_not_in_the_revert_list(world, isolated_registry):  # C3
    seen = []
    ledger_action(isolated_registry, revert=lambda **kw: seen.append(kw) or {"ok": True})
    run = RunFactory(status="completed", cleanup_status="pending")
    from tests.helpers import new_step as ns

    step = ns(run, "t.make")
    ResourceFactory(
        run=run,
        step=step,
        owner_module="t",
        kind=STEP_KIND,
        ref=step.idempotency_key,
        status="pending",
    )
    ResourceFactory(run=run, step=step, owner_module="t", kind="thing", ref="a")
    ResourceFactory(run=run, step=step, owner_module="t", kind="thing", ref="b")
    assert cleanup_run(run).reverted == 3
    assert len(seen) == 1
    # The placeholder is unresolved, so the recorded rows may be a part of what the step
    # made: the module is asked for everything its key made, by the empty list.
    assert seen[0]["resources"] == []
    assert seen[0]["idempotency_key"] == step.idempotency_key


@pytest.mark.django_db
def test_a_wholly_recorded_step_is_reverted_by_its_list(isolated_registry):  # C3
    seen = []
    ledger_action(isolated_registry, revert=lambda **kw: seen.append(kw) or {"ok": True})
    run = RunFactory(status="completed", cleanup_status="pending")
    from tests.helpers import new_step as ns

    step = ns(run, "t.make")
    ResourceFactory(
        run=run,
        step=step,
        owner_module="t",
        kind=STEP_KIND,
        ref=step.idempotency_key,
        status="reverted",
    )
    ResourceFactory(run=run, step=step, owner_module="t", kind="thing", ref="a")
    ResourceFactory(run=run, step=step, owner_module="t", kind="thing", ref="b")
    assert cleanup_run(run).reverted == 2
    assert [r["ref"] for r in seen[0]["resources"]] == ["a", "b"]
    assert all(r["kind"] != STEP_KIND for r in seen[0]["resources"])


@pytest.mark.django_db
def test_a_row_whose_step_is_gone_names_its_action_through_its_payload(isolated_registry):  # C3
    seen = []
    ledger_action(isolated_registry, revert=lambda **kw: seen.append(kw) or {"ok": True})
    run = RunFactory(status="completed")
    ResourceFactory(
        run=run, owner_module="t", kind=STEP_KIND, ref="key-9", payload={"action": "t.make"}
    )
    orphan = ResourceFactory(run=run, owner_module="t", kind="thing", ref="a", payload={"hp": 1})
    summary = cleanup_run(run)
    assert summary.reverted == 1 and seen[0]["idempotency_key"] == "key-9"
    orphan.refresh_from_db()
    assert orphan.status == "confirmed" and "nothing records which action" in orphan.last_error


@pytest.mark.django_db
@pytest.mark.parametrize(
    "action,message",
    [
        (None, "no module registers the action"),
        (
            Action(id="t.make", owner="t", reversible="ledger", perform=lambda **kw: None),
            "declares no revert",
        ),
    ],
)
def test_unknown_action_or_no_revert_is_terminal(
    isolated_registry, action, message, settings
):  # C3
    if action:
        isolated_registry.register_action(action)
    run = RunFactory(status="completed")
    row = ResourceFactory(
        run=run, owner_module="t", kind=STEP_KIND, ref="k", payload={"action": "t.make"}
    )
    summary = cleanup_run(run)
    row.refresh_from_db()
    assert message in row.last_error
    # Terminal: spent at once, so the run says incomplete now rather than after 3 passes.
    assert row.revert_attempts == 3 and summary.cleanup_status == "incomplete"


@pytest.mark.django_db
def test_a_lease_no_module_registers_is_terminal_with_that_reason():  # C2
    run = RunFactory(status="completed")
    row = ResourceFactory(
        run=run,
        owner_module="gone",
        kind="override",
        ref="gone.rate#x",
        payload={"baseline": 1, "applied": 2},
    )
    assert cleanup_run(run).cleanup_status == "incomplete"
    row.refresh_from_db()
    assert "no module registers the lease" in row.last_error and row.status == "confirmed"


@world_db
def test_a_drifted_lease_is_left_alone_and_reported(world):  # C1, C2, C4
    RegionSetting.objects.create(region="north", spawn_rate=1)
    run = new_run()
    execute_step(lease_step(run, "north", 5))
    RegionSetting.objects.filter(region="north").update(spawn_rate=42)  # somebody else
    EventRun.objects.transition(run, "completed", from_="running")
    summary = cleanup_run(run)
    assert (summary.drifted, summary.reverted) == (1, 0)
    row = Res.get(run=run)
    assert row.status == "drifted" and "42" in row.last_error
    assert RegionSetting.objects.get(region="north").spawn_rate == 42
    assert EventRunLog.objects.filter(run=run, kind="cleanup.drifted").exists()


@world_db
def test_ok_with_a_failed_list_reverts_the_rest(world, isolated_registry):  # C4
    ledger_action(isolated_registry, revert=lambda **kw: {"ok": True, "failed": ["b"]})
    run = RunFactory(status="completed")
    step = new_step(run, "t.make")
    a = ResourceFactory(run=run, step=step, owner_module="t", ref="a")
    b = ResourceFactory(run=run, step=step, owner_module="t", ref="b")
    summary = cleanup_run(run)
    assert (summary.reverted, summary.failed, summary.cleanup_status) == (1, 1, "pending")
    assert Res.get(pk=a.pk).status == "reverted"
    b.refresh_from_db()
    assert (b.status, b.revert_attempts) == (
        "confirmed",
        1,
    ) and "could not give this back" in b.last_error


@world_db
@pytest.mark.parametrize("fault", ["despawn.raise", "despawn.garbage", "despawn.fail"])
def test_a_revert_that_keeps_failing_is_tried_max_times_then_incomplete(
    world, isolated_registry, fault
):  # rule 2, C4, C5
    short_budget_world_spawn(isolated_registry)
    run = _spawned_run(world, lease=False)
    world.switch_on(fault)
    passes = 0
    while sweep().runs:
        passes += 1
        assert passes <= 5
    assert passes == 3
    run.refresh_from_db()
    assert run.cleanup_status == "incomplete"
    rows = Res.filter(run=run).exclude(kind=STEP_KIND)
    assert {(r.status, r.revert_attempts) for r in rows} == {("confirmed", 3)}
    assert all(r.last_error for r in rows)
    assert Creature.objects.count() == 4
    # Rule 2: only a human resets it. The fault is mended, then the human retry.
    world.switch_off()
    summary = cleanup_run(run, reset_attempts=True, actor="alice")
    assert (summary.cleanup_status, summary.reset) == ("complete", 4)
    assert Creature.objects.count() == 0
    assert EventRunLog.objects.get(run=run, kind="cleanup.retry").detail == {
        "resources": 4,
        "by": "alice",
    }


@world_db
def test_a_revert_that_outlives_its_budget_keeps_its_rows_until_it_answers(
    world, isolated_registry
):  # C4, R5: one call per key at a time; an answer is written when it comes
    short_budget_world_spawn(isolated_registry)
    run = _spawned_run(world, lease=False)
    world.switch_on("despawn.wait")  # the world answers after the budget (0.3 s)
    [summary] = sweep().runs
    assert (summary.overdue, summary.failed, summary.attempted) == (4, 0, 0)
    assert summary.cleanup_status == "pending"
    rows = Res.filter(run=run).exclude(kind=STEP_KIND)
    # Neither failed nor handed back while the calls run (a failed attempt was counted
    # and the next pass asked again, beside the first call: two give-backs of one key).
    assert {(r.status, r.revert_attempts, r.claim_count) for r in rows} == {("reverting", 0, 1)}
    asked = Call.objects.filter(verb="despawn").count()
    assert asked == 2
    assert not sweep().runs and cleanup_run(run).attempted == 0
    assert Call.objects.filter(verb="despawn").count() == asked
    assert EventRunLog.objects.filter(run=run, kind="cleanup.overdue").count() == 2
    world.switch_off()  # the calls answer now, after their pass ended
    wait_until(
        lambda: EventRun.objects.get(pk=run.pk).cleanup_status == "complete",
        "the late answers written and the run settled",
    )
    assert Creature.objects.count() == 0
    assert {(r.status, r.revert_attempts) for r in rows.all()} == {("reverted", 0)}
    late = EventRunLog.objects.filter(run=run, kind="cleanup.reverted")
    assert [entry.detail.get("late") for entry in late] == [True, True]
    assert Call.objects.filter(verb="despawn").count() == asked


@world_db
def test_reconcile_after_a_restart_orphans_the_missing(world):  # C6
    run = new_run()
    execute_step(spawn_step(run, "north", 3))
    kept = Creature.objects.first()
    Creature.objects.exclude(pk=kept.pk).delete()  # a partial restart: two are gone
    summary = reconcile_module("world", max_fraction=1.0)
    assert (summary.asked, summary.in_force, summary.orphaned, summary.unanswered) == (3, 1, 2, 0)
    statuses = Counter(Res.filter(run=run, kind="creature").values_list("status", flat=True))
    assert statuses == {"orphaned": 2, "confirmed": 1}
    assert EventRunLog.objects.get(run=run, kind="resource.orphaned").detail["module"] == "world"


@world_db
def test_reconcile_holds_back_when_the_world_says_everything_is_gone(world):  # C6, safety bound
    run = new_run()
    execute_step(spawn_step(run, "north", 3))
    world.restart()
    summary = reconcile_module("world")
    assert summary.held_back and summary.orphaned == 0 and summary.would_orphan == 3
    assert "more than 50%" in summary.reason
    assert set(Res.filter(run=run, kind="creature").values_list("status", flat=True)) == {
        "confirmed"
    }
    forced = reconcile_module("world", force=True)
    assert forced.orphaned == 3


@world_db
@pytest.mark.parametrize("fault", ["reconcile.hang", "reconcile.garbage"])
def test_an_unanswering_module_leaves_the_ledger_alone(world, isolated_registry, fault):  # C6
    short_budget_world_spawn(isolated_registry)
    run = new_run()
    execute_step(spawn_step(run, "north", 2))
    world.restart()
    world.switch_on(fault)
    summary = reconcile_all(force=True)["world"]
    assert (summary.unanswered, summary.orphaned) == (2, 0)
    assert set(Res.filter(run=run, kind="creature").values_list("status", flat=True)) == {
        "confirmed"
    }


@pytest.mark.django_db
def test_a_module_without_reconcile_is_unanswered(isolated_registry):  # C6
    ledger_action(isolated_registry)
    run = RunFactory()
    step = new_step(run, "t.make")
    ResourceFactory(run=run, step=step, owner_module="t")
    assert reconcile_module("t", force=True).unanswered == 1


# ── additions beyond the original design ──


@world_db
def test_a_stale_claimants_verdict_is_fenced_and_logged(
    isolated_registry, settings
):  # C4, fenced verdicts
    from datetime import timedelta

    def revert(**kw):
        # While this sweeper is "stalled" in the module, its claim goes stale and another
        # sweeper takes the rows over.
        ids = list(Res.filter(run=run, status="reverting").values_list("pk", flat=True))
        age_rows(EventRunResource, ids, seconds=3600)
        assert Res.claim_group(ids, ttl=timedelta(minutes=1)).rows
        return {"ok": True}

    ledger_action(isolated_registry, revert=revert)
    run = RunFactory(status="completed")
    step = new_step(run, "t.make")
    rows = [ResourceFactory(run=run, step=step, owner_module="t") for _ in range(3)]
    summary = cleanup_run(run)
    assert (summary.reverted, summary.fenced) == (0, 3)
    assert {Res.get(pk=r.pk).status for r in rows} == {"reverting"}
    assert EventRunLog.objects.get(run=run, kind="cleanup.fenced").detail["resources"] == 3


@pytest.mark.django_db
def test_a_poison_row_is_failed_after_max_claims_without_a_verdict(
    isolated_registry,
):  # C4, poison row
    calls = []
    ledger_action(isolated_registry, revert=lambda **kw: calls.append(1) or {"ok": True})
    run = RunFactory(status="completed", cleanup_status="pending")
    step = new_step(run, "t.make")
    # Four sweepers died holding it.
    row = ResourceFactory(run=run, step=step, owner_module="t", status="reverting", claim_count=4)
    age_rows(EventRunResource, [row.pk], seconds=3600)
    summary = cleanup_run(run)
    row.refresh_from_db()
    assert calls == []
    assert (row.status, row.claim_count, row.revert_attempts) == ("confirmed", 5, 1)
    assert "without a verdict" in row.last_error
    assert summary.cleanup_status == "incomplete"
    assert sweep().runs == []  # spent: not picked up again
    # The human reset gives it another chance.
    assert cleanup_run(run, reset_attempts=True, actor="bob").cleanup_status == "complete"
    assert calls == [1]


@pytest.mark.django_db
def test_a_collision_is_an_answer_within_the_attempt_bound(isolated_registry):  # C4, collisions
    ledger_action(isolated_registry)
    mine, theirs = RunFactory(status="completed", cleanup_status="pending"), RunFactory()
    step = new_step(mine, "t.make")
    ResourceFactory(run=mine, step=step, owner_module="t", ref="t1", status="orphaned")
    ResourceFactory(run=theirs, owner_module="t", ref="t1", status="confirmed")
    other = RunFactory(status="completed", cleanup_status="pending")
    ResourceFactory(run=other, step=new_step(other, "t.make"), owner_module="t", ref="fine")
    passes = 0
    while sweep().runs:
        passes += 1
        assert passes <= 5
    row = Res.get(run=mine)
    assert (row.status, row.revert_attempts) == ("orphaned", 3)
    assert f"run {theirs.pk}" in row.last_error
    mine.refresh_from_db()
    other.refresh_from_db()
    assert (mine.cleanup_status, other.cleanup_status) == ("incomplete", "complete")


@pytest.mark.django_db
def test_one_runs_failure_does_not_stop_the_sweep(isolated_registry, monkeypatch):  # C5
    import events_ledger.cleanup as cleanup

    ledger_action(isolated_registry)
    runs = [RunFactory(status="completed", cleanup_status="pending") for _ in range(3)]
    for run in runs:
        ResourceFactory(run=run, step=new_step(run, "t.make"), owner_module="t")
    real = cleanup._work_runs

    def flaky(batch, **kw):
        # A run that breaks whatever pass it is in (a bug, a row the code cannot read).
        if runs[1].pk in [run.pk for run in batch]:
            raise RuntimeError("boom")
        return real(batch, **kw)

    monkeypatch.setattr(cleanup, "_work_runs", flaky)
    report = sweep()
    # The batch failed as one; its runs were then worked one by one.
    assert [s.run_id for s in report.runs] == [runs[0].pk, runs[2].pk]
    assert "boom" in report.errors[runs[1].pk]
    assert EventRunLog.objects.filter(run=runs[1], kind="cleanup.error").exists()
    assert not Res.filter(run__in=[runs[0], runs[2]]).unresolved().exists()


@pytest.mark.django_db
def test_sweep_takes_at_most_the_batch(isolated_registry, settings):  # C5, S4
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_RUN_BATCH": 2}
    ledger_action(isolated_registry)
    for _ in range(3):
        run = RunFactory(status="completed", cleanup_status="pending")
        ResourceFactory(run=run, step=new_step(run, "t.make"), owner_module="t")
    assert len(sweep().runs) == 2
    assert len(sweep().runs) == 1


@pytest.mark.django_db
def test_groups_per_run_are_bounded(isolated_registry, settings):  # C4, S4
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_GROUPS_PER_RUN": 2}
    ledger_action(isolated_registry)
    run = RunFactory(status="completed", cleanup_status="pending")
    for i in range(3):
        ResourceFactory(run=run, step=new_step(run, "t.make", seq=i), owner_module="t")
    first = cleanup_run(run)
    assert (first.reverted, first.cleanup_status) == (2, "pending")
    assert cleanup_run(run).cleanup_status == "complete"


@pytest.mark.django_db
def test_giving_back_a_group_costs_the_same_statements_for_5_and_50_rows(
    isolated_registry,
):  # C4, groups O(1)
    ledger_action(isolated_registry)

    def cost(n):
        run = RunFactory(status="completed", cleanup_status="pending")
        step = new_step(run, "t.make")
        for _ in range(n):
            ResourceFactory(run=run, step=step, owner_module="t")
        with CaptureQueriesContext(connection) as q:
            assert cleanup_run(run).reverted == n
        return len(q)

    assert cost(5) == cost(50)


@pytest.mark.django_db
def test_plan_lists_what_would_be_given_back_and_writes_nothing(
    isolated_registry,
):  # S1 dry run, C3
    ledger_action(isolated_registry)
    run = RunFactory(status="completed", cleanup_status="pending")
    step = new_step(run, "t.make")
    ResourceFactory(run=run, step=step, owner_module="t", ref="a")
    ResourceFactory(run=run, owner_module="world", kind="override", ref="world.spawn_rate#n")
    plan = plan_run(run)
    assert [g.describe()["call"] for g in plan] == ["restore", "revert"]
    assert plan[1].idempotency_key == step.idempotency_key and plan[1].action_id == "t.make"
    assert set(Res.values_list("status", flat=True)) == {"confirmed"}


# ── real processes ──


@world_db
@pytest.mark.slow
def test_a_sweeper_killed_mid_revert_is_finished_by_a_later_sweep(world):  # R5, C4, crash
    run = _spawned_run(world, lease=False, regions=("north",))
    world.switch_on("despawn.hang")
    import json
    import subprocess

    child = spawn(
        CHILD,
        "cleanup",
        json.dumps({"run_id": run.pk}),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 60
        while not Call.objects.filter(verb="despawn").exists():  # it is inside revert()
            assert time.monotonic() < deadline, "the sweeper never reached the revert"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    rows = list(Res.filter(run=run, kind="creature"))
    assert {(r.status, r.revert_attempts, r.claim_count) for r in rows} == {("reverting", 0, 1)}
    world.switch_off()
    # Within the TTL the claim is respected ...
    assert cleanup_run(run).attempted == 0
    # ... and after it, a later sweep reclaims and finishes, without spending an attempt.
    age_rows(EventRunResource, [r.pk for r in rows], seconds=3600)
    report = sweep()
    assert report.runs[0].reverted == 2
    assert {(r.status, r.revert_attempts) for r in Res.filter(run=run, kind="creature")} == {
        ("reverted", 0)
    }
    assert Creature.objects.count() == 0


@world_db
@pytest.mark.slow
def test_four_sweepers_over_fifty_runs_revert_everything_exactly_once(world, vendor):  # C5, R5
    if vendor == "sqlite":
        pytest.skip("four writers on one SQLite file serialise; the race is proven on servers")
    runs = []
    for i in range(50):
        run = new_run(name=f"r{i}")
        assert execute_step(spawn_step(run, "north", 2)).outcome == "done"
        EventRun.objects.transition(run, "completed", from_="running")
        runs.append(run)
    serials = set(Creature.objects.values_list("serial", flat=True))
    assert len(serials) == 100
    race("sweep", [{} for _ in range(4)], timeout=300)
    calls = Counter(
        ref
        for refs in Call.objects.filter(verb="despawn").values_list("refs", flat=True)
        for ref in refs
    )
    assert set(calls) == serials and set(calls.values()) == {1}
    assert not Res.filter(run__in=runs).unresolved().exists()
    assert set(
        EventRun.objects.filter(pk__in=[r.pk for r in runs]).values_list(
            "cleanup_status", flat=True
        )
    ) == {"complete"}
    assert len(set(Call.objects.values_list("pid", flat=True))) > 1  # they really raced


@world_db
def test_a_sweep_survives_its_connection_dying_mid_run(
    isolated_registry, vendor
):  # C5, connections die
    if vendor == "sqlite":
        pytest.skip("an embedded database has no server to lose")
    from django.db import connections

    with connection.cursor() as c:
        c.execute("SELECT CONNECTION_ID()" if vendor == "mysql" else "SELECT pg_backend_pid()")
        sweeper_session = c.fetchone()[0]

    def revert_and_kill_the_sweepers_connection(**kw):
        # The module answers, but the server drops the sweeper's session before the verdict.
        with connections[connection.alias].cursor() as c:
            if vendor == "mysql":
                c.execute("KILL CONNECTION %s", [sweeper_session])
            else:
                c.execute("SELECT pg_terminate_backend(%s)", [sweeper_session])
        return {"ok": True}

    ledger_action(isolated_registry, "t.kill", revert=revert_and_kill_the_sweepers_connection)
    ledger_action(isolated_registry)
    doomed = RunFactory(status="completed", cleanup_status="pending")
    ResourceFactory(run=doomed, step=new_step(doomed, "t.kill"), owner_module="t")
    fine = RunFactory(status="completed", cleanup_status="pending")
    ResourceFactory(run=fine, step=new_step(fine, "t.make"), owner_module="t")
    report = sweep()
    # The pass writes its verdicts on a new connection: the answers are not lost, and
    # nothing waits for the claim's TTL.
    assert report.errors == {}
    assert {s.run_id: s.cleanup_status for s in report.runs} == {
        doomed.pk: "complete",
        fine.pk: "complete",
    }
    assert set(Res.filter(run__in=[doomed, fine]).values_list("status", flat=True)) == {"reverted"}


@pytest.mark.django_db(transaction=True)
def test_a_pass_whose_server_stays_away_reports_every_run_and_loses_no_claim(
    isolated_registry, vendor, monkeypatch
):  # C5, connections die
    if vendor == "sqlite":
        pytest.skip("an embedded database has no server to lose")
    from django.db import OperationalError

    import events_ledger.cleanup as cleanup

    calls: list[int] = []
    ledger_action(
        isolated_registry, revert=lambda run_id, **kw: calls.append(run_id) or {"ok": True}
    )
    runs = [RunFactory(status="completed", cleanup_status="pending") for _ in range(2)]
    for run in runs:
        ResourceFactory(run=run, step=new_step(run, "t.make"), owner_module="t")

    def gone(*args, **kwargs):
        raise OperationalError(2013, "Lost connection to server during query")

    monkeypatch.setattr(cleanup, "_write_verdicts", gone)
    report = sweep()
    assert sorted(report.errors) == sorted(r.pk for r in runs)
    assert set(Res.filter(run__in=runs).values_list("status", flat=True)) == {"reverting"}
    assert sorted(calls) == sorted(r.pk for r in runs)
    monkeypatch.undo()
    # #24: the next pass of this process writes the verdicts it holds (no TTL to wait),
    # and never asks the module again for what it has answered.
    sweep()
    statuses = EventRun.objects.filter(pk__in=[r.pk for r in runs])
    assert set(statuses.values_list("cleanup_status", flat=True)) == {"complete"}
    assert sorted(calls) == sorted(r.pk for r in runs)


@world_db
@pytest.mark.slow
def test_eight_sweepers_over_two_hundred_runs_never_die_of_a_deadlock(world, vendor):  # C5
    """Every statement of a pass is retried where no transaction is open, or costs one
    run: the summary statements (repair at the start of a pass, settle after a run)
    deadlocked two of eight sweepers on MariaDB before they were retried."""
    if vendor == "sqlite":
        pytest.skip("eight writers on one SQLite file serialise; the race is proven on servers")
    runs = []
    for i in range(200):
        run = new_run(name=f"r{i}")
        assert execute_step(spawn_step(run, "north", 1)).outcome == "done"
        EventRun.objects.transition(run, "cancelled", from_="running")
        runs.append(run)
    results = race("sweep", [{} for _ in range(8)], timeout=600)
    assert all("crash" not in r for r in results)
    assert Creature.objects.count() == 0
    assert not Res.filter(run__in=runs).unresolved().exists()
    statuses = set(
        EventRun.objects.filter(pk__in=[r.pk for r in runs]).values_list(
            "cleanup_status", flat=True
        )
    )
    assert statuses == {"complete"}


@world_db
def test_a_verdict_held_up_by_another_sessions_locks_is_written_later_not_asked_again(
    isolated_registry, vendor, monkeypatch
):  # C4, C5, #24: finding 6 (verdicts in hand were handed back, and reverted twice)
    """Another session holds the run's ledger rows (a backup, a long report) past every
    retry of the pass's verdict write. The module's answer is in hand and fenced by the
    claim's token: it is kept, the claim kept fresh, and written by the next pass once
    the rows are free; the module is never asked a second time."""
    if vendor == "sqlite":
        pytest.skip("one writer at a time: SQLite has no row locks to hold")
    import events_ledger.cleanup as cleanup

    monkeypatch.setattr(cleanup, "VERDICT_WRITE_TRIES", 2)
    holder = connection.get_new_connection(connection.get_connection_params())
    table = EventRunResource._meta.db_table
    calls: list[int] = []

    def revert(run_id, **kw):
        # While the module answers, another session takes the run's rows and keeps them.
        calls.append(run_id)
        with holder.cursor() as cursor:
            if vendor == "mysql":
                cursor.execute("START TRANSACTION")
            cursor.execute(f"SELECT id FROM {table} WHERE run_id = %s FOR UPDATE", [run_id])
        return {"ok": True}

    ledger_action(isolated_registry, revert=revert)
    run = RunFactory(status="completed", cleanup_status="pending")
    ResourceFactory(run=run, step=new_step(run, "t.make"), owner_module="t")
    with connection.cursor() as cursor:  # the sweeper's lock waits end in a second
        if vendor == "mysql":
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        else:
            cursor.execute("SET lock_timeout = '1s'")
    try:
        report = sweep()
        assert run.pk in report.errors and calls == [run.pk]
        assert len(cleanup._backlog) == 1
        assert set(Res.filter(run=run).values_list("status", flat=True)) == {"reverting"}
    finally:
        holder.rollback()  # the other session lets go
        holder.close()
    sweep()  # writes the verdict it holds, first thing
    assert calls == [run.pk]  # asked once
    assert len(cleanup._backlog) == 0
    assert set(Res.filter(run=run).values_list("status", flat=True)) == {"reverted"}
    run.refresh_from_db()
    assert run.cleanup_status == "complete"


@world_db
def test_verdicts_in_hand_keep_their_claims_fresh_and_are_written_by_the_process(
    isolated_registry, vendor, monkeypatch, settings
):  # R5, C4, #24 review: kept only until the TTL, the module was asked again
    """A pass whose verdict write fails keeps the verdicts. Long after
    ``REVERT_CLAIM_TTL`` no other sweeper may take their rows (their claims are kept
    fresh), and the process writes them itself once the database takes them, with no
    further pass of its own."""
    from django.db import OperationalError

    import events_ledger.cleanup as cleanup
    from tests.helpers import wait_until

    def run_settled(run) -> bool:
        run.refresh_from_db()
        return run.cleanup_status == "complete"

    if vendor == "sqlite":
        pytest.skip("the keeper's own connection needs a server database")
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "REVERT_CLAIM_TTL": 0.4}
    calls: list[int] = []
    ledger_action(
        isolated_registry, revert=lambda run_id, **kw: calls.append(run_id) or {"ok": True}
    )
    run = RunFactory(status="completed", cleanup_status="pending")
    ResourceFactory(run=run, step=new_step(run, "t.make"), owner_module="t")
    refused = {"on": True}
    write = cleanup._write_verdicts

    def refusing(*args, **kwargs):
        if refused["on"]:
            raise OperationalError(1205, "Lock wait timeout exceeded")
        return write(*args, **kwargs)

    monkeypatch.setattr(cleanup, "VERDICT_WRITE_BUDGET_S", 0.0)
    monkeypatch.setattr(cleanup, "_write_verdicts", refusing)
    assert run.pk in sweep().errors and calls == [run.pk]
    started = time.monotonic()
    # Three TTLs go by; every pass of another sweeper finds the rows claimed, fresh.
    while time.monotonic() - started < 1.2:
        other = sweep()
        assert not other.runs or all(s.attempted == 0 for s in other.runs), other
        time.sleep(0.05)
    assert calls == [run.pk]
    refused["on"] = False
    wait_until(
        lambda: set(Res.filter(run=run).values_list("status", flat=True)) == {"reverted"},
        "the process to write the verdicts it holds",
    )
    assert calls == [run.pk]
    wait_until(lambda: run_settled(run), "the summary settled by the process")
    assert calls == [run.pk]
