"""Giving back in reverse order (#26, rule C8): what a later phase built on is taken down
first. The demo world's arena refuses to go while creatures stand in it, as a world with
dependencies does; the spawn rate raised over them is restored before they go."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test.utils import CaptureQueriesContext

from events_ledger import Action, cleanup_run, sweep
from events_ledger.cleanup import plan_run
from events_ledger.ledger import execute_step
from events_ledger.models import STEP_KIND, EventRun, EventRunResource, EventRunStep
from project.world.models import Arena, Call, Creature, RegionSetting
from tests.factories import StepFactory
from tests.helpers import connection, new_run, phased_run

pytestmark = pytest.mark.django_db(transaction=True)
Res = EventRunResource.objects
MAX_ATTEMPTS = 3


def step(run: EventRun, phase: str, action_id: str, params: dict[str, Any]) -> EventRunStep:
    return StepFactory(run=run, phase=phase, action_id=action_id, params=params)


def arena_run(arena: str = "pit", *, name: str = "event") -> EventRun:
    return phased_run(arena, name=name)


def given_back() -> list[str]:
    """What the world was asked to give back, in the order it was asked."""
    verbs = {"restore": "rate", "despawn": "creatures", "arena.down": "arena"}
    return [
        verbs.get(verb, verb)
        for verb in Call.objects.order_by("pk").values_list("verb", flat=True)
        if verb in (*verbs, "arena.refused")
    ]


def ranks(run: EventRun) -> dict[str, int | None]:
    rows = Res.filter(run=run).exclude(kind=STEP_KIND)
    return {kind: rank for kind, rank in rows.values_list("kind", "phase_rank")}


# ── the order ──


def test_three_phases_are_given_back_last_phase_first(world):  # C8
    run = arena_run()
    # Each row carries its phase's rank, copied from its step in the INSERT itself.
    assert ranks(run) == {"arena": 0, "creature": 1, "override": 2}
    summary = cleanup_run(run)
    assert given_back() == ["rate", "creatures", "arena"]
    # One cleanup, one round per phase: nothing waits for a later pass.
    assert summary.rounds == 3 and summary.cleanup_status == "complete", summary
    assert not Arena.objects.exists() and not Creature.objects.exists()
    assert RegionSetting.objects.get(region="pit").spawn_rate == 1


def test_a_sweep_gives_back_many_runs_in_order_in_one_pass(world):  # C8, C5
    runs = [arena_run(f"pit{i}", name=f"event{i}") for i in range(3)]
    report = sweep()
    assert [s.rounds for s in report.runs] == [3, 3, 3]
    assert all(s.cleanup_status == "complete" for s in report.runs)
    assert "arena.refused" not in given_back()
    # Per run: its rate, then its creatures, then its arena.
    for i, run in enumerate(runs):
        keys = dict(EventRunStep.objects.filter(run=run).values_list("phase", "idempotency_key"))
        order = list(
            Call.objects.filter(idempotency_key__in=[*keys.values(), f"pit{i}"])
            .order_by("pk")
            .values_list("verb", flat=True)
        )
        assert order == ["restore", "despawn", "arena.down"], (run.pk, order)


def test_the_claim_itself_refuses_an_earlier_phase_while_a_later_one_holds(world):  # C8
    run = arena_run()
    arena_rows = list(Res.filter(run=run, kind="arena"))
    # Even a caller that skips the plan cannot take the arena first: the claim's own
    # statement refuses it while the creatures (and the rate) are unresolved.
    claim = Res.claim_group(arena_rows, ttl=timedelta(minutes=5), ordered=True)
    assert claim.rows == []
    assert Res.filter(run=run, kind="arena", status="confirmed").count() == 1
    # Unordered (GIVE_BACK_IN_ORDER off), the same claim is won.
    claim = Res.claim_group(arena_rows, ttl=timedelta(minutes=5))
    assert [r.pk for r in claim.rows] == [r.pk for r in arena_rows]


# ── a stuck later phase ──


def test_a_stuck_later_phase_holds_the_earlier_ones_and_is_named(world, settings):  # C8, rule 2
    run = arena_run()
    world.switch_on("rate.restore_fail")  # the settings service refuses, every time
    reports = [sweep() for _ in range(MAX_ATTEMPTS + 1)]
    # The pass that spent the last attempt says so: what waits behind is stuck now.
    last = reports[MAX_ATTEMPTS - 1].runs[0]
    assert last.cleanup_status == "incomplete" and last.behind[0]["stuck"] is True, last
    run.refresh_from_db()
    # The rate's attempts are spent: nothing can progress by itself, so the run is
    # incomplete, though the creatures and the arena were never tried.
    assert run.cleanup_status == "incomplete"
    assert given_back() == ["rate"] * MAX_ATTEMPTS
    assert Creature.objects.count() == 3 and Arena.objects.count() == 1
    # The sweep no longer picks it up.
    assert sweep().runs == []
    # The plan names the phase and rows the earlier ones wait behind.
    plan = plan_run(run)
    held = [g for g in plan if g.behind]
    assert {g.what for g in held} == {"world.spawn", "world.build_arena"}
    for group in held:
        assert group.behind["phase"] == "rate" and group.behind["stuck"] is True
        assert "after phase 'rate' is given back" in group.call
        assert group.describe()["behind"]["resources"] == ["override:world.spawn_rate#pit"]
    # The human retry gives back the stuck phase, then the earlier ones, in order.
    world.switch_off("rate.restore_fail")
    summary = cleanup_run(run, reset_attempts=True, actor="ops")
    assert summary.cleanup_status == "complete" and summary.rounds == 3
    assert given_back() == ["rate"] * (MAX_ATTEMPTS + 1) + ["creatures", "arena"]


def test_a_failed_later_phase_is_retried_before_anything_earlier_goes(world):  # C8, rule 2
    run = arena_run()
    world.switch_on("despawn.fail", 1)  # the creatures' first give-back fails once
    first = sweep().runs[0]
    assert first.cleanup_status == "pending" and first.behind[0]["phase"] == "creatures"
    assert given_back() == ["rate", "creatures"]
    sweep()
    assert given_back() == ["rate", "creatures", "creatures", "arena"]
    run.refresh_from_db()
    assert run.cleanup_status == "complete"


# ── the ways out ──


def test_an_independent_action_is_not_held(world, isolated_registry):  # C8
    calls: list[str] = []
    isolated_registry.register_action(
        Action(
            id="t.banner",
            owner="t",
            reversible="ledger",
            independent=True,
            perform=lambda **_: {"ok": True, "resources": [{"kind": "banner", "ref": "b1"}]},
            revert=lambda **_: calls.append("banner") or {"ok": True},
        )
    )
    run = new_run()
    step(run, "arena", "t.banner", {})
    step(run, "rate", "core.lease", {"lease": "world.spawn_rate#pit", "value": 9})
    for s in EventRunStep.objects.filter(run=run):
        assert execute_step(s.pk).outcome == "done"
    EventRun.objects.transition(run, "cancelled", from_="running")
    assert Res.get(run=run, kind="banner").phase_rank is None  # stands alone
    world.switch_on("rate.restore_fail")
    for _ in range(MAX_ATTEMPTS):
        sweep()
    # The rate is stuck; the banner, of an earlier phase, was given back all the same.
    assert calls == ["banner"]
    assert Res.get(run=run, kind="banner").status == "reverted"
    run.refresh_from_db()
    assert run.cleanup_status == "incomplete"


def test_the_order_can_be_turned_off_for_a_project(world, settings):  # C8
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "GIVE_BACK_IN_ORDER": False}
    run = arena_run()
    world.switch_on("rate.restore_fail")
    summary = cleanup_run(run)
    # Every group at once, in one round: the arena's refusal is the world's, loud.
    assert summary.rounds == 1
    assert set(given_back()) >= {"rate", "creatures"}
    assert not [g for g in plan_run(run) if g.behind]


# ── its cost ──


def _statements(runs: int) -> int:
    for i in range(runs):
        arena_run(f"pit{i}", name=f"event{i}")
    with CaptureQueriesContext(connection) as seen:
        report = sweep()
    assert len(report.runs) == runs and all(s.rounds == 3 for s in report.runs)
    return len(seen)


def test_a_sweep_costs_the_same_statements_for_one_run_and_five(world):  # C8
    one = _statements(1)
    Call.objects.all().delete()
    five = _statements(5)
    # A constant per round (one round per phase), whatever the number of runs and groups.
    assert one == five, (one, five)


def test_the_claims_form_for_mysql_keeps_the_order_too(world):  # C8
    """MySQL refuses an UPDATE reading its own table in a subquery (error 1093) unless
    through a materialised derived table; the MySQL family sends that form. No MySQL
    runs here; MariaDB, which speaks the same SQL, runs it."""
    if connection.vendor != "mysql":
        pytest.skip("the derived-table form is the MySQL family's")
    run = arena_run()
    arena_rows = list(Res.filter(run=run, kind="arena"))
    with CaptureQueriesContext(connection) as seen:
        assert Res.claim_group(arena_rows, ttl=timedelta(minutes=5), ordered=True).rows == []
    claims = [q["sql"] for q in seen if q["sql"].startswith("UPDATE")]
    assert claims and all(") AS blocked" in sql for sql in claims), claims
    assert cleanup_run(run).rounds == 3
    assert given_back() == ["rate", "creatures", "arena"]


# ── the operator resolves a row by hand ──


def test_a_drifted_later_phase_resolved_by_hand_lets_the_earlier_ones_go_back(
    world,
):  # C8, rule 2, #35: "keep the other value", without a call
    from events_ledger import resolve_by_hand, snapshot
    from events_ledger.models import EventRunLog

    run = arena_run()
    RegionSetting.objects.filter(region="pit").update(spawn_rate=42)  # a game master's value
    for _ in range(MAX_ATTEMPTS):
        sweep()
    run.refresh_from_db()
    rate = Res.get(run=run, kind="override")
    assert (run.cleanup_status, rate.status) == ("incomplete", "drifted")
    assert snapshot().incomplete_runs == 1
    asked = len(given_back())
    # Not a row of a run still going, not one being given back, not without a reason.
    with pytest.raises(ValueError, match="reason"):
        resolve_by_hand([rate], actor="ops:ana", reason="  ")
    going = new_run(name="going")
    held = Res.create(
        run=going, owner_module="world", kind="creature", ref="going-1", status="confirmed"
    )
    assert resolve_by_hand([rate, held], actor="ops:ana", reason="the GM keeps 42") == [rate.pk]
    rate.refresh_from_db()
    held.refresh_from_db()
    assert rate.status == "resolved" and "ops:ana" in rate.last_error and held.status == "confirmed"
    assert EventRunLog.objects.get(run=run, kind="resource.resolved_by_hand").detail == {
        "resources": ["override:world.spawn_rate#pit"],
        "by": "ops:ana",
        "reason": "the GM keeps 42",
    }
    run.refresh_from_db()
    assert run.cleanup_status == "pending" and snapshot().incomplete_runs == 0
    # No module was asked; the earlier phases go back at the next sweep, in order.
    assert len(given_back()) == asked
    while sweep().runs:
        pass
    run.refresh_from_db()
    assert run.cleanup_status == "complete"
    assert given_back()[asked:] == ["creatures", "arena"]
    assert RegionSetting.objects.get(region="pit").spawn_rate == 42
    assert not Creature.objects.exists() and not Arena.objects.exists()
    assert resolve_by_hand([rate], actor="ops:ana", reason="again") == []  # once
