"""Running a run (#14): ``run_steps`` executes a run's steps in order through
``execute_step`` and ends the run with one conditional UPDATE."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from events_ledger import Action, RunReport, run_steps
from events_ledger.models import EventRun, EventRunLog, EventRunStep
from project.world.models import Creature, RegionSetting
from tests.factories import StepFactory
from tests.helpers import PATIENCE_S, lease_step, new_run, new_step, spawn_step

pytestmark = pytest.mark.django_db(transaction=True)


def _recording(registry, calls: list[str], answers: dict[str, list[object]] | None = None):
    """Register ``t.do``: each call appends its step's ``name`` and answers the next of
    that name's answers (``{"ok": True}`` once they run out; an exception is raised)."""
    answers = answers or {}

    def perform(*, run_id, params, idempotency_key):
        name = params["name"]
        calls.append(name)
        queue = answers.get(name) or []
        answer = queue.pop(0) if queue else {"ok": True}
        if isinstance(answer, BaseException):
            raise answer
        return answer

    registry.register_action(Action(id="t.do", owner="t", reversible="none", perform=perform))


def _steps(run: EventRun, *order: tuple[str, int, str]) -> None:
    for phase, seq, name in order:
        StepFactory(run=run, action_id="t.do", params={"name": name}, seq=seq, phase=phase)


def _status(run: EventRun) -> str:
    return EventRun.objects.values_list("status", flat=True).get(pk=run.pk)


def test_steps_run_in_phase_and_seq_order_and_the_run_completes(isolated_registry):  # W5, C8
    calls: list[str] = []
    _recording(isolated_registry, calls)
    run = new_run(status="pending")
    # Seqs out of order on purpose: the driver orders, not the insertion. Phases run in
    # the order they were first planned (their rank), never by their names as text.
    _steps(run, ("setup", 1, "s1"), ("setup", 0, "s0"), ("main", 0, "m0"), ("teardown", 0, "t0"))
    _steps(run, ("main", 1, "m1"))
    ranks = dict(EventRunStep.objects.filter(run=run).values_list("phase", "phase_rank"))
    assert ranks == {"setup": 0, "main": 1, "teardown": 2}
    report = run_steps(run)
    assert isinstance(report, RunReport)
    assert calls == ["s0", "s1", "m0", "m1", "t0"]
    assert (report.outcome, report.status, report.finished) == ("completed", "completed", True)
    assert _status(run) == "completed"
    assert set(EventRunStep.objects.filter(run=run).values_list("status", flat=True)) == {"done"}


def test_steps_made_in_bulk_rank_their_phases_as_one_by_one(isolated_registry):  # C8
    calls: list[str] = []
    _recording(isolated_registry, calls)
    run = new_run(status="pending")
    _steps(run, ("warmup", 0, "w0"))
    EventRunStep.objects.bulk_create(
        EventRunStep(run=run, phase=phase, seq=seq, action_id="t.do", params={"name": name})
        for phase, seq, name in [
            ("setup", 0, "s0"),
            ("main", 0, "m0"),
            ("setup", 1, "s1"),
            ("teardown", 0, "t0"),
            ("warmup", 1, "w1"),
        ]
    )
    ranks = dict(EventRunStep.objects.filter(run=run).values_list("phase", "phase_rank"))
    assert ranks == {"warmup": 0, "setup": 1, "main": 2, "teardown": 3}
    run_steps(run)
    assert calls == ["w0", "w1", "s0", "s1", "m0", "t0"]


def test_a_step_failed_for_good_fails_the_run_and_nothing_after_it_runs(isolated_registry):  # W5
    calls: list[str] = []
    _recording(isolated_registry, calls, {"two": [{"ok": False, "retry": False, "error": "no"}]})
    run = new_run()
    _steps(run, ("main", 1, "one"), ("main", 2, "two"), ("main", 3, "three"))
    report = run_steps(run)
    assert calls == ["one", "two"]
    assert (report.outcome, report.status) == ("failed", "failed")
    assert report.error == "no"
    assert _status(run) == "failed"


def test_a_retried_step_is_tried_again_within_the_attempt_bound(isolated_registry, settings):  # W5
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "MAX_STEP_ATTEMPTS": 3,
    }
    calls: list[str] = []
    _recording(isolated_registry, calls, {"flaky": [RuntimeError("lost"), {"ok": False}]})
    run = new_run()
    _steps(run, ("main", 1, "flaky"))
    assert run_steps(run).outcome == "completed"
    assert calls == ["flaky"] * 3

    calls.clear()
    isolated_registry.actions.pop("t.do")
    _recording(isolated_registry, calls, {"broken": [RuntimeError("lost")] * 10})
    run = new_run()
    _steps(run, ("main", 1, "broken"))
    report = run_steps(run)
    # The bound is execute_step's: the driver's loop ends because the ledger's does.
    assert calls == ["broken"] * 3
    assert (report.outcome, _status(run)) == ("failed", "failed")


def _held_lease(world) -> tuple[EventRun, EventRun]:
    holder = new_run(name="holder")
    assert run_steps_one(lease_step(holder, "north", 7)) == "done"
    asker = new_run(name="asker")
    lease_step(asker, "north", 9, seq=1)
    new_step(asker, "world.spawn", {"region": "south", "count": 1}, seq=2)
    return holder, asker


def run_steps_one(step: EventRunStep) -> str:
    from events_ledger import execute_step

    return execute_step(step).outcome


def test_a_refused_lease_fails_the_run_by_default_naming_the_holder(world):  # W6
    holder, asker = _held_lease(world)
    report = run_steps(asker)
    assert (report.outcome, report.status) == ("failed", "failed")
    assert report.holder_run_id == holder.pk
    (entry,) = EventRunLog.objects.filter(run=asker, kind="run.failed")
    assert entry.detail["holder_run_id"] == holder.pk and "held by" in entry.detail["error"]
    assert Creature.objects.count() == 0  # the step after the refusal never ran
    assert RegionSetting.objects.get(region="north").spawn_rate == 7  # W6: never written


def test_a_refused_lease_can_stop_the_run_or_be_skipped(world):  # W6
    holder, asker = _held_lease(world)
    stopped = run_steps(asker, on_refused="stop")
    assert (stopped.outcome, stopped.status, stopped.finished) == ("refused", "running", False)
    assert stopped.holder_run_id == holder.pk
    assert Creature.objects.count() == 0
    skipped = run_steps(asker, on_refused="skip")
    assert (skipped.outcome, skipped.status) == ("completed", "completed")
    assert Creature.objects.count() == 1
    with pytest.raises(ValueError):
        run_steps(asker, on_refused="ignore")  # type: ignore[arg-type]


def test_a_run_cancelled_while_its_step_runs_stays_cancelled(isolated_registry):  # R11, W5
    inside, release = threading.Event(), threading.Event()
    run = new_run()

    def perform(*, run_id, params, idempotency_key):
        if params["name"] == "first":
            inside.set()
            assert release.wait(PATIENCE_S)
        return {"ok": True}

    isolated_registry.register_action(
        Action(id="t.do", owner="t", reversible="none", perform=perform, budget_ms=60_000)
    )
    _steps(run, ("main", 1, "first"), ("main", 2, "second"))
    reports: list[RunReport] = []
    driver = threading.Thread(target=lambda: reports.append(run_steps(run.pk)))
    driver.start()
    assert inside.wait(PATIENCE_S)
    assert EventRun.objects.transition(run, "cancelled", from_="running")
    release.set()
    driver.join(PATIENCE_S)
    (report,) = reports
    # The driver's UPDATE to completed lost to the cancel; the second step never ran.
    assert (report.outcome, report.status) == ("ended", "cancelled")
    assert _status(run) == "cancelled"
    second = EventRunStep.objects.get(run=run, seq=2)
    assert second.status == "pending" and second.attempts == 0


def test_a_step_held_by_another_call_answers_busy_and_the_run_stays_running(
    isolated_registry,
):  # W5
    calls: list[str] = []
    _recording(isolated_registry, calls)
    run = new_run()
    _steps(run, ("main", 1, "held"))
    step = EventRunStep.objects.get(run=run)
    assert EventRunStep.objects.claim(step, timedelta(minutes=15), by="elsewhere:1") is not None
    report = run_steps(run)
    assert (report.outcome, report.status, report.finished) == ("busy", "running", False)
    assert calls == []


def test_a_terminal_run_is_left_alone(isolated_registry):  # W5
    calls: list[str] = []
    _recording(isolated_registry, calls)
    run = new_run(status="cancelled")
    _steps(run, ("main", 1, "never"))
    report = run_steps(run)
    assert (report.outcome, report.status) == ("ended", "cancelled")
    assert calls == []


def test_a_completed_run_gives_back_what_its_steps_made(world):  # C5
    from events_ledger import sweep

    run = new_run(status="pending")
    spawn_step(run, "east", 2, seq=1)
    assert run_steps(run).outcome == "completed"
    assert Creature.objects.count() == 2
    sweep()
    assert Creature.objects.count() == 0
    assert EventRun.objects.get(pk=run.pk).cleanup_status == "complete"
