"""Where the write half meets the undo half: a run that ends while a step is in flight.

Each test is one of the ways the promise broke when the halves were tested alone. The
world is the demo's, the calls run in real threads (the deadline's), the database is
real, and the coordination with a call in flight is by events, never by sleeping.
"""

from __future__ import annotations

import json
import math
import secrets
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connections

from events_ledger import Action, Lease
from events_ledger.cleanup import cleanup_run, sweep
from events_ledger.ledger import execute_step
from events_ledger.models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from project.world import world as w
from project.world.models import Call, Creature, RegionSetting
from tests.helpers import (
    PATIENCE_S,
    Gate,
    connection,
    in_thread,
    new_run,
    new_step,
    revert_ttl,
    wait_until,
)
from tests.processes import CHILD, spawn

Res = EventRunResource.objects
world_db = pytest.mark.django_db(transaction=True)


def gated_spawn(gate: Gate, look_first: bool = False) -> Callable[..., Any]:
    """The world's spawn, held at the gate. ``look_first``: idempotent the usual way,
    looking for the key before the gate and creating after it."""

    def perform(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
        try:
            made = Creature.objects.filter(spawned_by=idempotency_key).exists()
            gate.pass_through()
            if look_first and not made:
                # Looked, found nothing: create, as a module written the usual way does.
                for _ in range(int(params.get("count", 1))):
                    Creature.objects.create(
                        serial=f"0x{secrets.token_hex(4)}",
                        kind="wolf",
                        region="north",
                        spawned_by=idempotency_key,
                    )
            return w.spawn(run_id=run_id, params=params, idempotency_key=idempotency_key)
        finally:
            connections.close_all()

    return perform


def register_spawn(registry: Any, perform: Callable[..., Any], budget_ms: int) -> Action:
    action = Action(
        id="t.spawn",
        owner="world",
        reversible="ledger",
        budget_ms=budget_ms,
        perform=perform,
        revert=w.despawn,
        reconcile=w.still_there,
    )
    registry.register_action(action)
    return action


def settled(step: EventRunStep) -> bool:
    return EventRunStep.objects.filter(pk=step.pk).exclude(status="running").exists()


def assert_world_clean_and_run_complete(run: EventRun) -> None:
    assert Creature.objects.count() == 0, "the world kept what the run made"
    assert not Res.filter(run=run).unresolved().exists()
    run.refresh_from_db()
    assert run.cleanup_status == "complete"


# ── 1. cancelled mid-step ──


@world_db
def test_a_run_cancelled_mid_step_gives_back_what_the_step_made_after(
    world, isolated_registry
):  # the invariant, W5, C4
    gate = Gate()
    register_spawn(isolated_registry, gated_spawn(gate), budget_ms=30_000)
    run = new_run()
    step = new_step(run, "t.spawn", {"count": 2, "region": "north"})
    thread, box = in_thread(lambda: execute_step(step))
    assert gate.entered.wait(PATIENCE_S)

    EventRun.objects.transition(run, "cancelled", from_="running")
    report = sweep()
    # The step is in flight: nothing of it is given back yet, and the run says so.
    assert not Call.objects.exists()
    [summary] = report.runs
    assert summary.cleanup_status == "pending" and summary.attempted == 0
    [waiting] = summary.waiting
    assert waiting["step"] == step.pk and waiting["claimed_by"] and waiting["claimed_at"]

    gate.open()
    thread.join(PATIENCE_S)
    assert box["value"].outcome == "done" and box["value"].recorded == 2
    assert Creature.objects.count() == 2
    sweep()
    assert_world_clean_and_run_complete(run)


# ── 2. a perform that outlives its deadline ──


@world_db
def test_a_perform_past_its_deadline_is_recorded_late_and_given_back(
    world, isolated_registry
):  # the invariant, W5, deadline
    gate = Gate()
    register_spawn(isolated_registry, gated_spawn(gate), budget_ms=200)
    run = new_run()
    step = new_step(run, "t.spawn", {"count": 1, "region": "north"})
    result = execute_step(step)
    assert result.outcome == "overdue" and "goes on" in result.error
    step.refresh_from_db()
    assert step.status == "running"  # held while the call lives

    EventRun.objects.transition(run, "cancelled", from_="running")
    assert sweep().runs[0].cleanup_status == "pending"
    assert not Call.objects.exists()

    gate.open()
    wait_until(lambda: settled(step), "the late answer to settle the step")
    step.refresh_from_db()
    assert step.status == "done"
    assert Res.filter(run=run, kind="creature", status="confirmed").count() == 1
    kinds = list(EventRunLog.objects.filter(run=run).values_list("kind", flat=True))
    assert "step.overdue" in kinds and "step.late.done" in kinds
    sweep()
    assert_world_clean_and_run_complete(run)


@world_db
def test_a_late_answer_after_cleanup_finished_makes_the_run_need_cleanup_again(
    world, isolated_registry, settings
):  # the invariant, W4, repair
    """A process stalled past the claim TTL (its claim looks dead), cleanup gave the
    step back by key, then the call went on and answered: its rows land on a run whose
    summary said complete, and the next pass gives them back."""
    gate = Gate()
    register_spawn(isolated_registry, gated_spawn(gate), budget_ms=200)
    run = new_run()
    step = new_step(run, "t.spawn", {"count": 1, "region": "south"})
    assert execute_step(step).outcome == "overdue"
    EventRun.objects.transition(run, "cancelled", from_="running")
    # The claim as a stalled process leaves it: old, and nobody stamping it.
    from events_ledger.background import keeper

    for token in list(keeper.held()):
        keeper.release(token)
    EventRunStep.objects.filter(pk=step.pk).update(claimed_at=datetime(2000, 1, 1, tzinfo=UTC))
    sweep()
    run.refresh_from_db()
    assert run.cleanup_status == "complete"  # given back by key: nothing was made yet

    gate.open()
    wait_until(lambda: settled(step), "the late answer")
    assert Creature.objects.count() == 1
    # The late rows make it need cleanup again (marked just after their commit).
    wait_until(
        lambda: EventRun.objects.get(pk=run.pk).cleanup_status == "pending", "the dirty mark"
    )
    sweep()
    assert_world_clean_and_run_complete(run)


# ── 3. a retry beside a call still running ──


@world_db
def test_a_retry_beside_a_call_still_running_is_busy(world, isolated_registry):  # one call
    gate = Gate()
    register_spawn(isolated_registry, gated_spawn(gate, look_first=True), budget_ms=200)
    run = new_run()
    step = new_step(run, "t.spawn", {"count": 1, "region": "north"})
    assert execute_step(step).outcome == "overdue"
    # The worker retries at once, as a task queue would after a time-out.
    for _ in range(3):
        assert execute_step(step).outcome == "busy"
    gate.open()
    wait_until(lambda: settled(step), "the first call to end")
    assert gate.most_inside == 1, "two calls of one step were in the world together"
    assert Creature.objects.count() == 1
    step.refresh_from_db()
    assert step.status == "done" and step.attempts == 1


# ── 4. an answer with a refused entry ──


def _answers(serials: list[str]) -> dict[str, Any]:
    good = [{"kind": "creature", "ref": s} for s in serials[:2]]
    third = serials[2]
    return {
        "a tuple": tuple([*good, {"kind": "creature", "ref": third}]),
        "a generator": (e for e in [*good, {"kind": "creature", "ref": third}]),
        "a ref over 190": [*good, {"kind": "creature", "ref": third + "x" * 190}],
        "a missing kind": [*good, {"ref": third}],
        "a NaN payload": [*good, {"kind": "creature", "ref": third, "payload": {"hp": math.nan}}],
        "a NUL in the ref": [*good, {"kind": "creature", "ref": third + "\x00"}],
    }


@world_db
def test_an_answer_as_a_tuple_is_recorded_whole(world, isolated_registry):  # W3
    def perform(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
        answer = w.spawn(run_id=run_id, params={"count": 3}, idempotency_key=idempotency_key)
        return {"ok": True, "resources": tuple(answer["resources"])}

    register_spawn(isolated_registry, perform, budget_ms=10_000)
    run = new_run()
    result = execute_step(new_step(run, "t.spawn"))
    assert (result.outcome, result.recorded, result.rejected) == ("done", 3, [])
    assert Res.get(run=run, kind=STEP_KIND).status == "reverted"
    EventRun.objects.transition(run, "completed", from_="running")
    sweep()
    assert_world_clean_and_run_complete(run)


@world_db
@pytest.mark.parametrize("shape", [k for k in _answers(["a", "b", "c"]) if k != "a tuple"])
def test_an_answer_with_a_refused_entry_keeps_the_placeholder(
    world, isolated_registry, shape
):  # W3, the invariant
    def perform(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
        answer = w.spawn(run_id=run_id, params={"count": 3}, idempotency_key=idempotency_key)
        serials = [r["ref"] for r in answer["resources"]]
        return {"ok": True, "resources": _answers(serials)[shape]}

    register_spawn(isolated_registry, perform, budget_ms=10_000)
    run = new_run()
    step = new_step(run, "t.spawn")
    result = execute_step(step)
    assert result.outcome == "done" and result.rejected
    assert Creature.objects.count() == 3
    placeholder = Res.get(run=run, kind=STEP_KIND)
    assert placeholder.status == "pending"
    # The step's log entry says why the placeholder stays.
    entry = EventRunLog.objects.get(run=run, kind="step.done")
    assert entry.detail["rejected"] and "placeholder stays" in entry.detail["error"]

    EventRun.objects.transition(run, "completed", from_="running")
    sweep()
    [call] = Call.objects.filter(verb="despawn")
    assert call.refs == [] and call.idempotency_key == step.idempotency_key
    assert_world_clean_and_run_complete(run)


# ── 5. an answer recorded only in part ──


@world_db
def test_a_partly_recorded_answer_is_given_back_whole(world, isolated_registry):  # W3, C3
    """The state a crash between two chunks of the INSERT leaves: 300 creatures in the
    world, 175 of them on the ledger, the placeholder pending. Written through the
    ledger's own multi-row INSERT (the real-crash version runs on the servers below)."""
    register_spawn(isolated_registry, w.spawn, budget_ms=10_000)
    run = new_run()
    step = new_step(run, "t.spawn", {"count": 300})
    from events_ledger.ledger import reserve_step

    reserve_step(run, step, isolated_registry.action("t.spawn"))
    answer = w.spawn(run_id=run.pk, params={"count": 300}, idempotency_key=step.idempotency_key)
    Res.bulk_record(run, step, "world", answer["resources"][:175])
    EventRun.objects.transition(run, "failed", from_="running")
    assert Creature.objects.count() == 300
    sweep()
    assert_world_clean_and_run_complete(run)


@world_db
def test_a_worker_killed_between_two_chunks_loses_nothing(world, vendor):  # W3, rule 1, crash
    """A real SIGKILL between the chunks of the answer's INSERT: the test holds an
    uncommitted row on a target of the second chunk, so the worker blocks there with
    the first chunk written, and is killed. The answer is recorded in one transaction,
    so nothing of it stays, and the placeholder gives everything back by key."""
    if vendor == "sqlite":
        pytest.skip("SQLite locks the whole file: the first chunk would block too")
    from django.db import transaction

    run = new_run()
    step = new_step(run, "world.spawn", {"count": 1500, "region": "north"})
    # The world makes its serials from the key; the test spawns first to learn them.
    answer = w.spawn(run_id=run.pk, params={"count": 1500}, idempotency_key=step.idempotency_key)
    # The first of the second chunk of 1,000 (early in its SQL: the server shows a long
    # statement cut short).
    blocker_ref = answer["resources"][1000]["ref"]
    other = new_run(name="blocker")
    child = None
    with transaction.atomic(using=connection.alias):
        Res.create(run=other, owner_module="world", kind="creature", ref=blocker_ref)
        child = spawn(
            CHILD,
            "execute",
            json.dumps({"step_id": step.pk}),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            child.stdin.write("go\n")
            child.stdin.flush()
            probe = connections.create_connection(connection.alias)
            try:
                wait_until(
                    lambda: bool(_blocked_inserts(probe, vendor, blocker_ref)),
                    "the second chunk to block",
                )
            finally:
                probe.close()
            child.kill()
            child.wait(PATIENCE_S)
            # A server finishes a dead client's statement once its lock is free: end the
            # session too, as a host that died with its connection would.
            _end_blocked_inserts(vendor)
        finally:
            if child.poll() is None:
                child.kill()
        transaction.set_rollback(True, using=connection.alias)
    assert Res.filter(run=run, kind="creature").count() == 0  # rolled back whole
    assert Res.get(run=run, kind=STEP_KIND).status == "pending"
    # The worker is dead; its claim is taken for dead after the TTL.
    EventRunStep.objects.filter(pk=step.pk).update(claimed_at=datetime(2000, 1, 1, tzinfo=UTC))
    EventRun.objects.transition(run, "failed", from_="running")
    sweep()
    assert_world_clean_and_run_complete(run)


def _blocked_inserts(probe: Any, vendor: str, ref: str = "") -> list[Any]:
    """Server sessions of a worker whose answer's INSERT waits on a lock (on MySQL: the
    chunk that names ``ref``, which only the second chunk does)."""
    table = Res.model._meta.db_table
    with probe.cursor() as c:
        if vendor == "mysql":
            c.execute(
                "SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE %s",
                [f"INSERT IGNORE INTO `{table}`%{ref}%"],
            )
        else:
            c.execute(
                "SELECT pid FROM pg_stat_activity WHERE query LIKE %s "
                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
                [f'INSERT INTO "{table}"%'],
            )
        return [row[0] for row in c.fetchall()]


def _end_blocked_inserts(vendor: str) -> None:
    probe = connections.create_connection(connection.alias)
    try:
        sessions = _blocked_inserts(probe, vendor)
        with probe.cursor() as c:
            for session in sessions:
                if vendor == "mysql":
                    c.execute("KILL CONNECTION %s", [session])
                else:
                    c.execute("SELECT pg_terminate_backend(%s)", [session])
    finally:
        probe.close()


# ── 6. a lease reserves, then reads ──


@world_db
def test_a_lease_reads_its_baseline_under_its_reservation(world, isolated_registry):  # W6
    gate = Gate()
    read_calls: list[int] = []

    def gated_read(*, target: str | None) -> Any:
        value = w.current_rate(target=target)
        read_calls.append(value)
        gate.pass_through()
        return value

    isolated_registry.register_lease(
        Lease(
            id="t.rate",
            owner="world",
            read=gated_read,
            apply=w.set_rate,
            restore=w.put_back,
            budget_ms=30_000,
        )
    )
    RegionSetting.objects.create(region="north", spawn_rate=1)
    first = new_run(name="first")
    gate.open()
    assert (
        execute_step(new_step(first, "core.lease", {"lease": "t.rate#north", "value": 5})).outcome
        == "done"
    )
    assert w.current_rate(target="north") == 5

    gate.opened.clear()
    gate.entered.clear()
    second = new_run(name="second")
    thread, box = in_thread(
        lambda: execute_step(new_step(second, "core.lease", {"lease": "t.rate#north", "value": 7}))
    )
    # Either the second run's read is inside the world (it read before reserving), or
    # its reserve was refused (the reservation came first): wait for one of the two.
    wait_until(lambda: gate.entered.is_set() or not thread.is_alive(), "the second lease")
    # The first run ends and its restore lands now.
    EventRun.objects.transition(first, "completed", from_="running")
    sweep()
    assert w.current_rate(target="north") == 1
    gate.open()
    thread.join(PATIENCE_S)
    assert box["value"].outcome == "refused", "the second run read while another held it"
    assert read_calls == [1], "a refused reserve read the world"
    # Asked again, now that the target is free: it reads the true baseline.
    assert (
        execute_step(
            new_step(second, "core.lease", {"lease": "t.rate#north", "value": 7}, seq=1)
        ).outcome
        == "done"
    )
    assert Res.get(run=second, kind="override", status="confirmed").payload["baseline"] == 1
    EventRun.objects.transition(second, "completed", from_="running")
    sweep()
    assert w.current_rate(target="north") == 1


@world_db
def test_a_lease_row_without_a_baseline_is_released_without_a_call(world):  # W6, C2
    run = new_run()
    Res.create(
        run=run,
        owner_module="world",
        kind="override",
        ref="world.spawn_rate#north",
        payload={"applied": 5},
    )
    EventRun.objects.transition(run, "cancelled", from_="running")
    sweep()
    assert not Call.objects.filter(verb="restore").exists()
    assert not Res.filter(run=run).unresolved().exists()


# ── bounds ──


@world_db
def test_an_error_text_that_cannot_be_stored_still_settles_the_step(
    world, isolated_registry, settings
):  # bounds: MAX_STEP_ATTEMPTS
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "MAX_STEP_ATTEMPTS": 2}

    def perform(**kw: Any) -> Any:
        raise RuntimeError("lone \ud800 surrogate and a \x00 NUL")

    register_spawn(isolated_registry, perform, budget_ms=5_000)
    run = new_run()
    step = new_step(run, "t.spawn")
    outcomes = [execute_step(step).outcome for _ in range(3)]
    assert outcomes == ["retry", "failed", "busy"]
    step.refresh_from_db()
    assert step.status == "failed" and step.attempts == 2
    assert "surrogate" in step.last_error


@pytest.mark.django_db
def test_a_step_claimed_past_its_attempts_is_failed_without_a_call(
    isolated_registry, settings
):  # bounds: MAX_STEP_ATTEMPTS
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "MAX_STEP_ATTEMPTS": 2}
    calls = []
    register_spawn(isolated_registry, lambda **kw: calls.append(kw) or {"ok": True}, 5_000)
    run = new_run()
    step = new_step(run, "t.spawn")
    # Two earlier claims whose outcome was never written (their workers died).
    EventRunStep.objects.filter(pk=step.pk).update(
        attempts=2, status="running", claimed_at=datetime(2000, 1, 1, tzinfo=UTC)
    )
    result = execute_step(step)
    assert result.outcome == "failed" and "without a written outcome" in result.error
    assert calls == []


@pytest.mark.django_db
def test_twenty_thousand_refused_entries_make_one_bounded_log_entry(
    isolated_registry, caplog
):  # bounds
    answer = {"ok": True, "resources": [{"kind": "", "ref": str(i)} for i in range(20_000)]}
    register_spawn(isolated_registry, lambda **kw: answer, 30_000)
    run = new_run()
    with caplog.at_level("WARNING", logger="events_ledger"):
        result = execute_step(new_step(run, "t.spawn"))
    assert len(result.rejected) == 20_000
    [entry] = EventRunLog.objects.filter(run=run)
    assert len(entry.detail["rejected"]) == 21 and "19980 more" in entry.detail["rejected"][-1]
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


@world_db
def test_reconcile_never_orphans_a_row_under_a_live_revert_claim(isolated_registry):  # C6, R10
    from events_ledger.cleanup import reconcile_module

    claims = []

    def reconcile(*, run_id: int, resources: list[dict[str, Any]]) -> Any:
        # While the module is being asked, a sweeper claims the rows for a revert.
        rows = list(Res.filter(run_id=run_id, kind="thing"))
        claims.append(Res.claim_group(rows, revert_ttl()))
        connections.close_all()
        return {"ok": True, "in_force": []}

    isolated_registry.register_action(
        Action(
            id="t.make",
            owner="t",
            reversible="ledger",
            perform=lambda **kw: {"ok": True, "resources": [{"kind": "thing", "ref": "a"}]},
            revert=lambda **kw: {"ok": True},
            reconcile=reconcile,
        )
    )
    run = new_run()
    assert execute_step(new_step(run, "t.make")).outcome == "done"
    summary = reconcile_module("t", force=True)
    assert summary.would_orphan == 1 and summary.orphaned == 0
    assert not EventRunLog.objects.filter(kind="resource.orphaned").exists()
    [claim] = claims
    # The sweeper's verdict lands: the row was given back, not lost.
    assert Res.mark_reverted(claim.ids, token=claim.token) == 1


@pytest.mark.django_db
def test_a_budget_not_shorter_than_a_claim_ttl_is_a_check_error(isolated_registry, settings):
    from events_ledger.checks import E007, check_registrations

    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "STEP_CLAIM_TTL": 60,
        "REVERT_CLAIM_TTL": 120,
    }
    register_spawn(isolated_registry, lambda **kw: None, budget_ms=90_000)
    errors = [e for e in check_registrations() if e.id == E007]
    assert len(errors) == 1 and "STEP_CLAIM_TTL" in errors[0].msg and "t.spawn" in errors[0].msg


@world_db
def test_an_answer_of_a_hundred_thousand_resources_is_recorded_and_given_back(
    isolated_registry,
):  # bounds: bind-parameter limits
    made = [{"kind": "thing", "ref": f"r{i}"} for i in range(100_000)]
    given_back: list[Any] = []
    isolated_registry.register_action(
        Action(
            id="t.many",
            owner="t",
            reversible="ledger",
            budget_ms=60_000,
            perform=lambda **kw: {"ok": True, "resources": made},
            revert=lambda **kw: given_back.append(kw) or {"ok": True},
        )
    )
    run = new_run()
    result = execute_step(new_step(run, "t.many"))
    assert result.outcome == "done" and result.recorded == 100_000
    EventRun.objects.transition(run, "completed", from_="running")
    summary = cleanup_run(run)
    assert summary.reverted == 100_000 and summary.cleanup_status == "complete"
    assert len(given_back[0]["resources"]) == 100_000


# ── what a review found ──


@world_db
def test_runs_waiting_for_a_step_in_flight_do_not_starve_the_others(
    world, isolated_registry, settings
):  # C5, the invariant
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_RUN_BATCH": 1}
    gate = Gate()
    register_spawn(isolated_registry, gated_spawn(gate), budget_ms=200)
    waiting = new_run(name="waiting")
    step = new_step(waiting, "t.spawn", {"count": 1})
    assert execute_step(step).outcome == "overdue"
    EventRun.objects.transition(waiting, "cancelled", from_="running")
    other = new_run(name="other")
    assert execute_step(new_step(other, "world.spawn", {"count": 1})).outcome == "done"
    EventRun.objects.transition(other, "cancelled", from_="running")
    # The waiting run has the lower id; a batch of one still reaches the other run.
    report = sweep()
    assert [s.run_id for s in report.runs] == [other.pk]
    other.refresh_from_db()
    assert other.cleanup_status == "complete"
    gate.open()
    wait_until(lambda: settled(step), "the late answer")
    sweep()
    assert_world_clean_and_run_complete(waiting)


@pytest.mark.django_db
def test_a_failure_asked_by_key_for_something_unrecorded_stays_loud(isolated_registry):  # rule 2
    from tests.helpers import ledger_action

    ledger_action(isolated_registry, revert=lambda **kw: {"ok": True, "failed": ["ghost"]})
    run = new_run(status="completed")
    step = new_step(run, "t.make")
    Res.create(run=run, step=step, owner_module="t", kind=STEP_KIND, ref=step.idempotency_key)
    summary = cleanup_run(run)
    placeholder = Res.get(run=run, kind=STEP_KIND)
    assert placeholder.status == "confirmed" and "ghost" in placeholder.last_error
    assert summary.failed == 1 and summary.cleanup_status == "pending"


@pytest.mark.django_db
def test_no_call_under_a_placeholder_a_cleanup_is_giving_back(isolated_registry):  # W2, W5
    calls = []
    register_spawn(isolated_registry, lambda **kw: calls.append(kw) or {"ok": True}, 5_000)
    run = new_run()
    step = new_step(run, "t.spawn")
    Res.create(
        run=run,
        step=step,
        owner_module="world",
        kind=STEP_KIND,
        ref=step.idempotency_key,
        status="reverting",
    )
    result = execute_step(step)
    assert result.outcome == "retry" and "being given back" in result.error
    assert calls == []


@world_db
def test_an_interrupted_wait_still_records_the_answer(world, isolated_registry):  # W5
    """A task queue's soft time limit (here a real SIGALRM) interrupts the wait for the
    call: the exception reaches the caller, and the answer is recorded when it comes."""
    import signal

    from events_ledger.background import keeper

    class SoftTimeLimit(Exception):
        pass

    def alarm(signum: int, frame: Any) -> None:
        raise SoftTimeLimit

    gate = Gate()
    register_spawn(isolated_registry, gated_spawn(gate), budget_ms=30_000)
    run = new_run()
    step = new_step(run, "t.spawn", {"count": 1})
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(SoftTimeLimit):
            execute_step(step)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    step.refresh_from_db()
    assert step.status == "running" and step.claim_token in keeper.held()
    gate.open()
    # The late handler lets the claim go after the outcome's commit: wait for both.
    token = step.claim_token
    wait_until(
        lambda: settled(step) and token not in keeper.held(), "the answer after the interruption"
    )
    step.refresh_from_db()
    assert step.status == "done"
    assert Res.filter(run=run, kind="creature", status="confirmed").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_call_whose_claim_was_taken_over_records_but_never_resolves(
    isolated_registry, caplog
):  # one call of a step, rule 1
    """This worker stalled past the claim's TTL and another took the step over while the
    call ran: the answer is still recorded (never dropped), but neither the outcome nor
    the placeholder the newer call runs under is written by it."""

    def perform(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
        try:
            EventRunStep.objects.filter(idempotency_key=idempotency_key).update(claim_token="newer")
        finally:
            connections.close_all()
        return {"ok": True, "resources": [{"kind": "creature", "ref": "made"}]}

    register_spawn(isolated_registry, perform, budget_ms=10_000)
    run = new_run()
    step = new_step(run, "t.spawn")
    with caplog.at_level("WARNING", logger="events_ledger"):
        result = execute_step(step)
    assert (result.outcome, result.recorded) == ("done", 1)
    assert Res.get(run=run, kind="creature").status == "confirmed"
    assert Res.get(run=run, kind=STEP_KIND).status == "pending"
    step.refresh_from_db()
    assert (step.status, step.claim_token) == ("running", "newer")
    assert "a newer claim took it over" in caplog.text
    run.refresh_from_db()
    assert run.cleanup_status == "pending"


@pytest.mark.django_db
def test_an_owner_longer_than_the_ledger_column_is_a_check_error(isolated_registry):  # S5
    from events_ledger.checks import E008, check_registrations

    isolated_registry.register_action(
        Action(id="t.long", owner="o" * 65, reversible="none", perform=lambda **kw: None)
    )
    assert [e.id for e in check_registrations() if e.id == E008] == [E008]
