"""Running a run: its steps in phase order (C8: ``phase_rank``), then ``seq``, through
``execute_step``, then its end."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from django.db.models import Exists, OuterRef, Q

from .conf import ledger_settings
from .db import (
    bounded,
    dropping_dead,
    in_transaction,
    refuse_callers_transaction,
    storable,
    storable_json,
)
from .ledger import StepResult, execute_step
from .models import EventRun, EventRunLog, EventRunResource, EventRunStep
from .querysets import new_token
from .states import RUN_TERMINAL, InvalidTransition, ResourceStatus, RunStatus, StepStatus

logger = logging.getLogger("events_ledger")

#: What a step refused (a lease held by another run) means for its run.
#: ``fail``: the run fails (the default: the run was written to hold that value, and
#: going on without it would act on a world it does not own); ``skip``: the step is left
#: refused and the run goes on with the next one; ``stop``: the run stays ``running``
#: and the driver answers, so the host can wait for the holder and run it again.
OnRefused = Literal["fail", "skip", "stop"]
ON_REFUSED: tuple[str, ...] = ("fail", "skip", "stop")


@dataclass(frozen=True)
class StepOutcome:
    step_id: int
    outcome: str
    error: str | None = None


@dataclass(frozen=True)
class RunReport:
    """What ``run_steps`` did to one run.

    ``outcome``: ``completed`` or ``failed`` (the driver moved the run there);
    ``ended`` (the run was or became terminal by someone else, e.g. cancelled:
    ``status`` says which); ``refused`` (``on_refused="stop"``: the run stays
    ``running``); ``busy`` (another call of a step holds it, or a call outlived its
    deadline and still runs: the run stays ``running``; run it again later).
    """

    run_id: int
    outcome: str
    status: str
    steps: tuple[StepOutcome, ...] = field(default_factory=tuple)
    error: str | None = None
    holder_run_id: int | None = None

    @property
    def finished(self) -> bool:
        """Nothing more for a driver to do: the run is terminal."""
        return self.status in RUN_TERMINAL


def run_steps(run: EventRun | int, *, on_refused: OnRefused = "fail") -> RunReport:
    """Execute a run's unsettled steps in phase order (``phase_rank``; C8), then ``seq``,
    one at a time, and end the run: ``completed`` when every step is done, ``failed``
    when one failed for good (or was refused, by default).

    Calls ``execute_step`` and nothing else of the write half, so every rule of a step
    holds (its claim, its placeholder, its attempt bound). A step answered ``retry`` is
    executed again at once: ``execute_step`` counts its attempts and fails it for good
    at ``MAX_STEP_ATTEMPTS``, so the loop ends. Every change of the run's status is one
    conditional UPDATE (``EventRun.objects.transition``): a run cancelled meanwhile
    stays cancelled, and is answered ``ended``. Safe to call twice at once for one run
    (a task delivered twice): the second finds the step claimed and answers ``busy``.
    """
    if on_refused not in ON_REFUSED:
        raise ValueError(f"on_refused must be one of {ON_REFUSED}, not {on_refused!r}")
    refuse_callers_transaction("run_steps")  # before the run is moved to running
    run_id: int = run.pk if isinstance(run, EventRun) else int(run)
    # pending → running; already running (a driver run again) is fine, terminal is not.
    EventRun.objects.transition(run_id, RunStatus.RUNNING, from_=RunStatus.PENDING)
    done: list[StepOutcome] = []
    while True:
        status = _status(run_id)
        if status != RunStatus.RUNNING:
            return RunReport(run_id, "ended", status, tuple(done))
        step = _next_step(run_id, skip_refused=on_refused == "skip")
        if step is None:
            return _end(run_id, RunStatus.COMPLETED, done)
        if step.status == StepStatus.FAILED:  # settled by an earlier driver, or execute_step
            return _end(run_id, RunStatus.FAILED, done, step.last_error)
        if step.status == StepStatus.REFUSED and on_refused != "skip":
            result = StepResult("refused", error=step.last_error)
        else:
            result = execute_step(step.pk)
            done.append(StepOutcome(step.pk, result.outcome, result.error))
        if result.outcome in ("done", "retry"):
            continue  # the next step, or this one again (attempt-bounded by execute_step)
        if result.outcome in ("busy", "overdue"):
            # A call of the step still runs (this driver's own, past its budget, or
            # another's): nobody may come back to end the run (a cron-only project has
            # no task to retry it), so the sweep ends it once every step has settled.
            _left_running(run_id, on_refused)
            return RunReport(run_id, "busy", _status(run_id), tuple(done), result.error)
        if result.outcome == "refused":
            if on_refused == "skip":
                continue
            if on_refused == "stop":
                return RunReport(
                    run_id,
                    "refused",
                    _status(run_id),
                    tuple(done),
                    result.error,
                    result.holder_run_id,
                )
            ended = _end(run_id, RunStatus.FAILED, done, result.error, result.holder_run_id)
            return RunReport(
                run_id, ended.outcome, ended.status, ended.steps, ended.error, result.holder_run_id
            )
        return _end(run_id, RunStatus.FAILED, done, result.error)


#: On a run's log: ``run_steps`` left it ``running`` behind a step whose call still runs.
LEFT_RUNNING = "run.left_running"


def _left_running(run_id: int, on_refused: str) -> None:
    try:
        EventRunLog.objects.write(run_id, LEFT_RUNNING, {"on_refused": on_refused})
    except Exception:  # the answer is ``busy`` all the same; a driver may come back
        logger.exception("run %s: writing that it was left running failed", run_id)


def finish_left_runs(scope: str | None = None, limit: int = 100) -> list[tuple[int, str]]:
    """End the runs ``run_steps`` left ``running`` behind a step in flight, once every
    step has settled, as ``run_steps`` would have: ``failed`` when a step failed (or
    was refused, unless it skipped refused steps), ``completed`` when every step is done.
    Each end is one conditional UPDATE that decides on the steps in the same statement,
    so a step added or claimed meanwhile keeps the run going. A refused step of a driver
    that stops at one is the host's to decide, and is left alone. Answers (run, status)."""
    left = EventRunLog.objects.filter(run_id=OuterRef("pk"), kind=LEFT_RUNNING)
    runs = EventRun.objects.filter(status=RunStatus.RUNNING).filter(Exists(left))
    if scope is not None:
        runs = runs.filter(scope=scope)
    found = list(runs.order_by("pk").values_list("pk", flat=True)[:limit])
    ended: list[tuple[int, str]] = []
    for run_id in found:
        on_refused = (
            EventRunLog.objects.filter(run_id=run_id, kind=LEFT_RUNNING)
            .order_by("-pk")
            .values_list("detail", flat=True)
            .first()
            or {}
        ).get("on_refused", "fail")
        steps = EventRunStep.objects.filter(run_id=OuterRef("pk"))
        settled = ~Q(
            Exists(
                steps.exclude(status__in=[StepStatus.DONE, StepStatus.FAILED, StepStatus.REFUSED])
            )
        )
        refused = Q(Exists(steps.filter(status=StepStatus.REFUSED)))
        failed = Q(Exists(steps.filter(status=StepStatus.FAILED)))
        if on_refused == "fail":
            failed = failed | refused
        for to, when in (
            (RunStatus.FAILED, settled & failed),
            (RunStatus.COMPLETED, settled & ~failed & (~refused if on_refused == "stop" else Q())),
        ):
            if EventRun.objects.transition(run_id, to, from_=RunStatus.RUNNING, only_if=when):
                EventRunLog.objects.write(run_id, f"run.{to.value}", {"by": "sweep"})
                ended.append((run_id, to.value))
                break
    return ended


def _status(run_id: int) -> str:
    status = EventRun.objects.filter(pk=run_id).values_list("status", flat=True).first()
    if status is None:
        raise EventRun.DoesNotExist(f"there is no run {run_id}")
    return status


def _next_step(run_id: int, *, skip_refused: bool) -> EventRunStep | None:
    """The first step of the run, in order, that is not done (nor refused, when refused
    steps are skipped)."""
    skipped = [StepStatus.DONE, StepStatus.REFUSED] if skip_refused else [StepStatus.DONE]
    return (
        EventRunStep.objects.filter(run_id=run_id)
        .exclude(status__in=skipped)
        .order_by("phase_rank", "phase", "seq", "id")
        .only("pk", "status", "last_error")
        .first()
    )


def _end(
    run_id: int,
    to: RunStatus,
    done: list[StepOutcome],
    error: str | None = None,
    holder_run_id: int | None = None,
) -> RunReport:
    # One conditional UPDATE: running → to. Lost when someone else ended it first
    # (cancelled while its last step ran): their status stands.
    if EventRun.objects.transition(run_id, to, from_=RunStatus.RUNNING):
        if to == RunStatus.FAILED:
            logger.warning("run %s failed: %s", run_id, error)
        # The run's page says who ended it and why (C7's habit, for the write half's end).
        detail = {"by": "run_steps", "error": error, "holder_run_id": holder_run_id}
        try:
            EventRunLog.objects.write(
                run_id, f"run.{to.value}", storable_json({k: v for k, v in detail.items() if v})
            )
        except Exception:  # the run has ended; its log line must not make that an error
            logger.exception("run %s: writing its log entry failed", run_id)
        return RunReport(run_id, to.value, to.value, tuple(done), error)
    return RunReport(run_id, "ended", _status(run_id), tuple(done), error)


#: The longest reason an operator's end of a run keeps on its log.
MAX_REASON = 500


def end_run(
    run: EventRun | int, status: str = RunStatus.FAILED, *, actor: str, reason: str
) -> bool:
    """An operator ends a run that will not end by itself (its worker died, its driver
    never came back, a call outlived every budget): ``pending|running → status`` (a
    terminal status) in one conditional UPDATE, with who and why on the run's log in the
    same transaction, so the next sweep gives its ledger back (and waits for a step still
    in flight). Answers whether this call ended it: False when it had ended already.

    Raises ``InvalidTransition`` for a status that is not terminal, and ``ValueError``
    without a reason: an end by hand is read later by someone who was not there."""
    if status not in RUN_TERMINAL:
        raise InvalidTransition(
            f"{status!r} does not end a run (a run ends {', '.join(RUN_TERMINAL)})"
        )
    reason = _reason(reason, "ending a run by hand")

    def end() -> bool:
        ended = EventRun.objects.transition(
            run, status, from_=(RunStatus.PENDING, RunStatus.RUNNING)
        )
        if ended:
            EventRunLog.objects.write(
                getattr(run, "pk", run),
                "run.ended_by_hand",
                storable_json({"status": status, "by": actor, "reason": reason}),
            )
        return ended

    # A deadlock victim is run again whole; a connection lost on the way is dropped,
    # so the caller's next statement (the console's, the command's) gets a new one.
    with dropping_dead():
        return in_transaction(end)


def _reason(reason: str, what: str) -> str:
    reason = storable(reason).strip()[:MAX_REASON]
    if not reason:
        raise ValueError(f"{what} needs a reason")
    return reason


#: The log entry of a row an operator resolved by hand.
RESOLVED_BY_HAND = "resource.resolved_by_hand"


def resolve_by_hand(
    rows: Iterable[EventRunResource | int], *, actor: str, reason: str
) -> list[int]:
    """An operator resolves ledger rows without calling their module: the other value
    stays ("keep it"), or the object is gone ("I checked"). Rows of ended runs that are
    unresolved and not being given back become ``resolved`` in one conditional UPDATE
    (a ``reverting`` row only once its claim is stale), with who and why on each run's
    log and in the row's error, in one transaction; each run's summary is then derived
    again, so earlier phases that waited behind a resolved row go back at the next sweep
    (C8). Answers the rows this call resolved (empty: none could be).

    Raises ``ValueError`` without a reason."""
    reason = _reason(reason, "resolving a row by hand")
    ids = [row.pk if isinstance(row, EventRunResource) else int(row) for row in rows]
    token = new_token()
    note = storable(f"resolved by hand by {actor}: {reason}")[:500]
    with dropping_dead():  # as end_run
        return in_transaction(partial(_resolve, ids, token, note, actor, reason))


def _resolve(ids: list[int], token: str, note: str, actor: str, reason: str) -> list[int]:
    """``resolve_by_hand``'s one transaction: the rows, each run's log line and summary."""
    count = EventRunResource.objects.resolve_by_hand(
        ids, token, note, ledger_settings.REVERT_CLAIM_TTL
    )
    if not count:
        return []
    by_run: dict[int, list[str]] = {}
    resolved = []
    for pk, run_id, kind, ref in EventRunResource.objects.filter(
        claim_token=token, status=ResourceStatus.RESOLVED
    ).values_list("pk", "run_id", "kind", "ref"):
        by_run.setdefault(run_id, []).append(f"{kind}:{ref}")
        resolved.append(pk)
    for run_id, refs in sorted(by_run.items()):
        EventRunLog.objects.write(
            run_id,
            RESOLVED_BY_HAND,
            storable_json({"resources": bounded(refs), "by": actor, "reason": reason}),
        )
    EventRun.objects.settle_cleanups(
        sorted(by_run),
        ledger_settings.MAX_REVERT_ATTEMPTS,
        ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT,
        ledger_settings.GIVE_BACK_IN_ORDER,
    )
    return sorted(resolved)
