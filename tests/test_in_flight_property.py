"""Where the two halves meet, as a property: whatever the interleaving, a run gives back
everything its steps made, and no two calls of one step are in the world together.

A hypothesis state machine over the demo world interleaves steps executing in real
threads (answers on time, held inside ``perform``, late past the deadline, lost,
partly recordable, refused outright), runs turned terminal at any moment, cron passes,
human retries and gates opening (late calls finishing). Nothing is mocked: the calls
run in the deadline's threads against the real database. When everything has
quiesced, every run is ended and swept, and the world must be as it started.

Each step is planned in one of a few phases, drawn in any order (a run's phases rank
in the order it first plans them), or made by an action whose resources stand alone.
Every give-back checks C8 as it enters the world: no later phase of its run holds
anything, however the sweeps, human retries and late answers interleaved.

The short version runs in ``make test``. The long one (a few minutes), on the database
``DATABASE_URL`` names::

    LEDGER_PROPERTY_EXAMPLES=200 LEDGER_PROPERTY_STEPS=40 \\
        .venv/bin/python -m pytest -p no:cacheprovider -q tests/test_in_flight_property.py
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connections
from django.db.models import Count
from hypothesis import HealthCheck, event
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from events_ledger import Action
from events_ledger.cleanup import RunNotTerminal, cleanup_run, sweep
from events_ledger.conf import ledger_settings
from events_ledger.envelopes import MAX_REF
from events_ledger.ledger import execute_step
from events_ledger.models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from project.world import world as w
from project.world.models import Call, Creature
from tests.factories import StepFactory
from tests.helpers import PATIENCE_S, Gate, in_thread, new_run, wait_until

Res = EventRunResource.objects

EXAMPLES = int(os.environ.get("LEDGER_PROPERTY_EXAMPLES", "15"))
STEPS = int(os.environ.get("LEDGER_PROPERTY_STEPS", "15"))

#: ``prompt`` answers at once; ``held`` waits at its gate inside a long budget (a run
#: ends while the call is in the world); ``late`` waits at its gate past a short budget,
#: so ``execute_step`` answers ``overdue`` and the answer is recorded by the call's thread.
TIMINGS = ("prompt", "held", "late")
#: ``ok``; ``lost`` (spawns, then raises); ``partial`` (one entry refused: a ref over
#: 190, so the placeholder stays); ``refused`` (``ok: False, retry: False``, nothing made).
ANSWERS = ("ok", "lost", "partial", "refused")
BUDGET_MS = {"prompt": 30_000, "held": 30_000, "late": 150}
TERMINAL_TO = ("cancelled", "failed", "completed")
#: C8: a step's phase; "main" sorts before "setup", so only the rank can order them.
PHASES = ("setup", "main", "finish")
TIMING = st.sampled_from(TIMINGS)
ANSWER = st.sampled_from(ANSWERS)
PHASE = st.sampled_from(PHASES)
#: C8: made by an ``Action(independent=True)``: its rows stand alone (no rank).
ALONE = st.sampled_from([False, False, True])
COUNT = st.integers(1, 3)
#: A step of the example, by its index (modulo how many there are).
WHICH = st.integers(0, 31)
FINAL_STEP = ("done", "failed", "refused")  # a step in these is never called again
OUR_THREADS = "events-ledger:prop."


def action_id(timing: str, answer: str, alone: bool = False) -> str:
    return f"prop.{timing}.{answer}" + (".alone" if alone else "")


class Harness:
    """What the machine knows of the world's calls, shared with the performs."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.inside: Counter[str] = Counter()
        self.most_inside: Counter[str] = Counter()
        self.gates: dict[str, Gate] = {}
        self.violations: list[str] = []
        #: C8: the rank of every ranked give-back the world received, per run, in order.
        self.given_back: dict[int, list[int]] = {}

    @contextmanager
    def call(self, key: str) -> Iterator[None]:
        """One call of a step is in the world while this is open."""
        with self.lock:
            self.inside[key] += 1
            self.most_inside[key] = max(self.most_inside[key], self.inside[key])
        try:
            yield
        finally:
            with self.lock:
                self.inside[key] -= 1

    def is_inside(self, key: str) -> bool:
        with self.lock:
            return self.inside[key] > 0


HARNESS = Harness()


def _give_backs(key: str) -> int:
    return Call.objects.filter(verb="despawn", idempotency_key=key).count()


def _out_of_order(run_id: int, key: str) -> str | None:
    """C8, read as a give-back of a ranked step enters the world: nothing of a later
    phase of its run is unresolved (rows standing alone aside), and no ranked step of a
    later phase is in flight. The claim decided this before the call, and the run has
    ended since before then, so nothing can have started between the two."""
    rank = EventRunStep.objects.filter(idempotency_key=key).values_list("phase_rank", flat=True)[0]
    with HARNESS.lock:
        HARNESS.given_back.setdefault(run_id, []).append(rank)
    later_rows = list(
        Res.unresolved()
        .filter(run_id=run_id, phase_rank__gt=rank)
        .values_list("pk", "kind", "ref", "phase_rank", "status")
    )
    later_steps = list(
        EventRunStep.objects.in_flight(ledger_settings.STEP_CLAIM_TTL)
        .filter(run_id=run_id, phase_rank__gt=rank)
        .exclude(action_id__endswith=".alone")
        .values_list("pk", "phase", "phase_rank")
    )
    if not later_rows and not later_steps:
        return None
    return (
        f"run {run_id}: step {key} of rank {rank} given back while later phases hold "
        f"rows {later_rows} and steps in flight {later_steps}"
    )


def make_revert(alone: bool) -> Callable[..., Any]:
    def revert(*, run_id: int, resources: list[dict[str, Any]], idempotency_key: str) -> Any:
        if not alone:
            found = _out_of_order(run_id, idempotency_key)
            if found:
                with HARNESS.lock:
                    HARNESS.violations.append(found)
        return w.despawn(run_id=run_id, resources=resources, idempotency_key=idempotency_key)

    return revert


def make_perform(timing: str, answer: str) -> Callable[..., Any]:
    def perform(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
        key = idempotency_key
        try:
            with HARNESS.call(key):
                # The invariant: nothing of a step is given back while a call of it is
                # in the world (cleanup would give back by key before the object exists).
                before = _give_backs(key)
                try:
                    if timing != "prompt":
                        HARNESS.gates[key].pass_through()
                    if answer == "refused":
                        return {"ok": False, "retry": False, "error": "the shard says no"}
                    made = w.spawn(run_id=run_id, params=params, idempotency_key=key)
                    if answer == "lost":
                        raise w.AnswerLost("connection reset before the answer arrived")
                    if answer == "partial":
                        resources = list(made["resources"])
                        last = resources[-1]
                        resources[-1] = {**last, "ref": last["ref"] + "x" * MAX_REF}
                        return {"ok": True, "resources": resources}
                    return made
                finally:
                    if _give_backs(key) != before:
                        HARNESS.violations.append(f"step {key} was given back during a call")
        finally:
            connections.close_all()

    return perform


@dataclass(frozen=True)
class StepRef:
    pk: int
    run_pk: int
    key: str
    timing: str
    answer: str
    phase: str
    alone: bool

    def __repr__(self) -> str:
        alone = ", alone" if self.alone else ""
        return (
            f"StepRef(pk={self.pk}, run={self.run_pk}, {self.timing}.{self.answer}, "
            f"{self.phase}{alone})"
        )


class InFlightMachine(RuleBasedStateMachine):
    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        # Each example starts from a clean world and an empty ledger. Resources name
        # their run with PROTECT, so they go first.
        HARNESS.reset()
        EventRunLog.objects.all().delete()
        Res.all().delete()
        EventRunStep.objects.all().delete()
        EventRun.objects.all().delete()
        w.switch_off()
        Creature.objects.all().delete()
        Call.objects.all().delete()
        self.terminal: set[int] = set()
        self.all_runs: list[int] = []
        self.all_steps: list[StepRef] = []
        self.threads: list[tuple[threading.Thread, dict[str, Any], StepRef]] = []
        self.seq = 0
        #: C8: each run's phases in the order it first planned them (their ranks).
        self.phases: dict[int, list[str]] = {}

    # ── the world's calls ──

    def _execute(self, step: StepRef) -> dict[str, Any]:
        """``execute_step`` in a real thread; waits only as far as the timing needs:
        a late call until its deadline passed, a held one until it is in the world."""
        thread, box = in_thread(lambda: execute_step(step.pk))
        self.threads.append((thread, box, step))
        if step.timing == "late":
            thread.join(PATIENCE_S)
            assert not thread.is_alive(), "execute_step did not come back at its deadline"
        elif step.timing == "held":
            wait_until(
                lambda: HARNESS.is_inside(step.key) or not thread.is_alive(),
                "the held call to enter the world or end",
            )
        return box

    @initialize(target=runs, timing=TIMING, answer=ANSWER, count=COUNT, phase=PHASE, alone=ALONE)
    def first_run_with_a_step(
        self, timing: str, answer: str, count: int, phase: str, alone: bool
    ) -> int:
        run = self._new_run("running")
        self._start_step(run, timing, answer, count, phase, alone)
        return run

    def _new_run(self, status: str) -> int:
        run = new_run(name="prop", status=status)
        self.all_runs.append(run.pk)
        return run.pk

    @rule(target=runs, status=st.sampled_from(["pending", "running"]))
    def new_run(self, status: str) -> int:
        return self._new_run(status)

    @rule(run=runs, timing=TIMING, answer=ANSWER, count=COUNT, phase=PHASE, alone=ALONE)
    def start_step(  # W5, C8
        self, run: int, timing: str, answer: str, count: int, phase: str, alone: bool
    ) -> None:
        self._start_step(run, timing, answer, count, phase, alone)

    def _start_step(
        self, run: int, timing: str, answer: str, count: int, phase: str, alone: bool
    ) -> None:
        self.seq += 1
        step = StepFactory(
            run=EventRun.objects.get(pk=run),
            phase=phase,
            action_id=action_id(timing, answer, alone),
            params={"count": count, "region": "north"},
            seq=self.seq,
        )
        # C8: phases rank in the order the run first plans them.
        planned = self.phases.setdefault(run, [])
        if phase not in planned:
            planned.append(phase)
        step.refresh_from_db(fields=["phase_rank"])
        assert step.phase_rank == planned.index(phase), (step.phase_rank, planned)
        ref = StepRef(step.pk, run, step.idempotency_key, timing, answer, phase, alone)
        HARNESS.gates[ref.key] = Gate()
        self.all_steps.append(ref)
        box = self._execute(ref)
        if timing == "held" and run not in self.terminal:
            assert HARNESS.is_inside(ref.key), f"the held call never entered: {box}"
        if timing == "late":
            outcome = box["value"].outcome
            if run in self.terminal:
                assert outcome == "failed", "a step of an ended run was performed"
            else:
                # Past its deadline: the call goes on, the step stays claimed.
                assert outcome == "overdue", box["value"]
                assert EventRunStep.objects.get(pk=step.pk).status == "running"

    def _step(self, which: int) -> StepRef:
        return self.all_steps[which % len(self.all_steps)]

    @rule(which=WHICH)
    def retry_step(self, which: int) -> None:  # one call of a step at a time
        step = self._step(which)
        gate = HARNESS.gates[step.key]
        # Only a gated call is surely still inside when the retry claims: a prompt one
        # may end at any moment, and a retry after it is a retry, not a second call.
        stuck_inside = (
            step.timing != "prompt" and HARNESS.is_inside(step.key) and not gate.opened.is_set()
        )
        box = self._execute(step)
        if stuck_inside:
            # A call is held in the world: this one must not join it.
            thread = self.threads[-1][0]
            thread.join(PATIENCE_S)
            assert not thread.is_alive()
            assert box["value"].outcome == "busy", box["value"]

    @rule(which=WHICH)
    def open_gate(self, which: int) -> None:
        HARNESS.gates[self._step(which).key].open()

    @rule(run=runs, to=st.sampled_from(TERMINAL_TO))
    def end_run(self, run: int, to: str) -> None:
        ended = EventRun.objects.transition(run, to, from_=["pending", "running"])
        assert ended == (run not in self.terminal)
        self.terminal.add(run)

    @rule()
    def cron_pass(self) -> None:  # C5
        report = sweep()
        assert not report.errors and report.repair_error is None, report

    @rule(run=runs)
    def human_retry(self, run: int) -> None:  # C4
        if run not in self.terminal:
            with pytest.raises(RunNotTerminal):
                cleanup_run(run, reset_attempts=True, actor="prop")
            return
        summary = cleanup_run(run, reset_attempts=True, actor="prop")
        assert not summary.errors, summary

    # ── always true, between any two rules ──

    @invariant()
    def at_most_one_held_row_per_target(self) -> None:  # R0
        doubled = (
            Res.held()
            .order_by()
            .values("owner_module", "kind", "ref")
            .annotate(n=Count("pk"))
            .filter(n__gt=1)
        )
        assert not doubled.exists(), list(doubled)

    @invariant()
    def one_call_of_a_step_in_the_world_at_a_time(self) -> None:
        with HARNESS.lock:
            assert max(HARNESS.most_inside.values(), default=0) <= 1, HARNESS.most_inside
            assert not HARNESS.violations, HARNESS.violations

    @invariant()
    def a_row_takes_its_steps_phase_rank(self) -> None:  # C8
        """Copied when the row is recorded; NULL when its action's rows stand alone."""
        wrong = [
            (pk, rank, step_rank)
            for pk, rank, step_rank, action in Res.values_list(
                "pk", "phase_rank", "step__phase_rank", "step__action_id"
            )
            if rank != (None if action is None or action.endswith(".alone") else step_rank)
        ]
        assert not wrong, f"rows whose rank is not their step's: {wrong}\n{self._dump()}"

    @invariant()
    def no_row_is_left_reverting_between_passes(self) -> None:  # R5, C4
        assert not Res.filter(status="reverting").exists()

    @invariant()
    def a_run_in_flight_is_never_summarised(self) -> None:  # C4, W4
        summarised = EventRun.objects.exclude(status__in=EventRun.TERMINAL).filter(
            cleanup_status__in=("complete", "incomplete")
        )
        assert not summarised.exists(), list(summarised.values("pk", "status", "cleanup_status"))

    @invariant()
    def whatever_a_finished_step_made_is_on_the_ledger(self) -> None:  # rule 1, W3
        """A step that can never be called again (done, failed) has its creatures on
        the ledger until they are given back: each one's row is unresolved, or the
        step's placeholder is (the module is then asked for everything its key made).
        Read in this order, nothing a thread does in between can make it false."""
        finished = dict(
            EventRunStep.objects.filter(status__in=FINAL_STEP).values_list("idempotency_key", "pk")
        )
        open_rows = set(Res.unresolved().values_list("step_id", "kind", "ref"))
        open_placeholders = {step for step, kind, _ in open_rows if kind == STEP_KIND}
        lost = [
            (serial, key)
            for serial, key in Creature.objects.values_list("serial", "spawned_by")
            if key in finished
            and finished[key] not in open_placeholders
            and (finished[key], "creature", serial) not in open_rows
        ]
        assert not lost, f"creatures in the world that the ledger forgot: {lost}"

    # ── the end: quiesce, end everything, sweep, and compare with the start ──

    def teardown(self) -> None:  # the invariant
        for gate in HARNESS.gates.values():
            gate.open()
        for thread, _box, _step in self.threads:
            thread.join(PATIENCE_S)
            assert not thread.is_alive(), "an execute_step thread never came back"
        wait_until(
            lambda: not EventRunStep.objects.filter(status="running").exists(),
            "every call in flight to end and settle its step",
        )
        # A late answer's thread writes its log line after settling the step: let it end
        # before this example's rows are judged (and the next example deletes them).
        wait_until(
            lambda: (
                not any(
                    t.name.startswith(OUR_THREADS)
                    and not t.name.endswith((".revert", ".reconcile"))
                    for t in threading.enumerate()
                )
            ),
            "the late answers' threads to end",
        )
        errors = [(step, box["error"]) for _, box, step in self.threads if "error" in box]
        assert not errors, f"execute_step raised: {errors}"

        for run in self.all_runs:
            EventRun.objects.transition(run, "cancelled", from_=["pending", "running"])
        self._sweep_until_quiet()
        self._human_retry_for_timeouts()

        remaining = list(Creature.objects.values_list("serial", "spawned_by"))
        assert not remaining, f"the world kept what the runs made: {remaining}\n{self._dump()}"
        unresolved = list(
            Res.unresolved().values_list("pk", "run_id", "kind", "ref", "status", "last_error")
        )
        assert not unresolved, f"unresolved rows: {unresolved}\n{self._dump()}"
        with_rows = set(Res.values_list("run_id", flat=True))
        for pk, status in EventRun.objects.values_list("pk", "cleanup_status"):
            # Nothing unresolved: complete, or not_required when nothing was ever recorded
            # (a human retry of such a run derives complete, which is also true).
            agrees = ("complete",) if pk in with_rows else ("complete", "not_required")
            assert status in agrees, f"run {pk} says {status}, its rows say {agrees}"
        assert max(HARNESS.most_inside.values(), default=0) <= 1, HARNESS.most_inside
        assert not HARNESS.violations, f"{HARNESS.violations}\n{self._dump()}"
        # How much of C8 the example exercised: runs given back over several phases.
        phases = max((len(set(ranks)) for ranks in HARNESS.given_back.values()), default=0)
        event(f"C8: the most phases one run gave back: {phases}")

    def _sweep_until_quiet(self) -> int:
        for passes in range(1, 6):
            report = sweep()
            assert not report.errors and report.repair_error is None, report
            if not report.runs and not report.repaired_runs:
                return passes
        return passes

    def _human_retry_for_timeouts(self) -> None:
        """A revert shares its action's budget: under load the late action's 150 ms can
        run out while giving back, and three of those leave a row for a human. That, and
        only that, is retried here the human's way; any other spent row is a finding.
        C8: a later phase spent so holds the earlier ones, which get their first try only
        after the retry (and may run out in turn): a few rounds of it, then the verdict."""
        for _ in range(len(PHASES) + 1):
            spent = Res.unresolved().filter(
                revert_attempts__gte=ledger_settings.MAX_REVERT_ATTEMPTS
            )
            if not spent.exists():
                return
            errors = set(spent.values_list("last_error", flat=True))
            assert all(e and "did not answer within" in e for e in errors), (
                f"rows spent their attempts: {errors}\n{self._dump()}"
            )
            for run in set(spent.values_list("run_id", flat=True)):
                cleanup_run(run, reset_attempts=True, actor="prop")
            self._sweep_until_quiet()

    def _dump(self) -> str:
        runs = list(EventRun.objects.values_list("pk", "status", "cleanup_status"))
        steps = list(
            EventRunStep.objects.values_list(
                "pk", "run_id", "action_id", "phase", "phase_rank", "status", "attempts"
            )
        )
        rows = list(
            Res.values_list("pk", "run_id", "step_id", "phase_rank", "kind", "ref", "status")
        )
        calls = list(Call.objects.values_list("verb", "idempotency_key", "refs"))
        return f"runs={runs}\nsteps={steps}\nrows={rows}\ncalls={calls}"


@pytest.mark.django_db(transaction=True)
def test_the_invariant_holds_whatever_the_interleaving(
    isolated_registry: Any,
) -> None:  # the invariant, W5, C4
    for timing in TIMINGS:
        for answer in ANSWERS:
            for alone in (False, True):
                isolated_registry.register_action(
                    Action(
                        id=action_id(timing, answer, alone),
                        owner="world",
                        reversible="ledger",
                        budget_ms=BUDGET_MS[timing],
                        perform=make_perform(timing, answer),
                        revert=make_revert(alone),
                        reconcile=w.still_there,
                        independent=alone,
                    )
                )
    run_state_machine_as_test(
        InFlightMachine,
        settings=hsettings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
