"""Signals an operator's code can forward to Sentry, Slack or a pager (#15).

Each is sent once the state change it reports is committed (``transaction.on_commit``:
at once outside a transaction, at the outer commit inside one, never for a transaction
that rolled back), with the run and the rows concerned. ``resources`` is a QuerySet of
those rows, read when a receiver iterates it, so an unused argument costs no query.
Receivers are called with ``send_robust``: one that raises is logged and never breaks a
step or a sweep.

==========================  ======================================  ============================
signal                      sent when                               arguments
==========================  ======================================  ============================
``cleanup_incomplete``      a run's cleanup became ``incomplete``   run, resources (its
                                                                    unresolved rows), summary
``cleanup_complete``        a run's cleanup became ``complete``     run, resources (its
                                                                    ledger), summary
``lease_drifted``           a lease's restore found another value   run, resources (the
                                                                    drifted rows)
``resources_orphaned``      reconcile orphaned rows                 run, resources, owner
``step_failed``             a step failed for good                  run, step, resources (the
                                                                    step's rows), error
``cleanup_worked``          a cleanup wrote verdicts for a run      run, summary
``late_answer``             a step's answer came after cleanup had  run, step, resources (the
                            given its placeholder back              step's rows), recorded
==========================  ======================================  ============================

``summary`` is the pass's ``CleanupSummary`` for the run, or None when the sweep's
repair of a stale summary made the change.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import DatabaseError, transaction
from django.dispatch import Signal

from .db import drop_if_dead, ledger_db
from .logcontext import log_context
from .models import EventRun, EventRunResource, EventRunStep
from .states import CleanupStatus, ResourceStatus

logger = logging.getLogger("events_ledger")

cleanup_incomplete = Signal()
cleanup_complete = Signal()
lease_drifted = Signal()
resources_orphaned = Signal()
step_failed = Signal()
cleanup_worked = Signal()
late_answer = Signal()

NAMES = {
    id(cleanup_incomplete): "cleanup_incomplete",
    id(cleanup_complete): "cleanup_complete",
    id(lease_drifted): "lease_drifted",
    id(resources_orphaned): "resources_orphaned",
    id(step_failed): "step_failed",
    id(cleanup_worked): "cleanup_worked",
    id(late_answer): "late_answer",
}

Res = EventRunResource.objects


def _send(signal: Signal, sender: type, **kwargs: Any) -> None:
    """Send after the commit of what it reports; a receiver that raises is logged with
    its traceback, and the others are still called."""
    name = NAMES.get(id(signal), "signal")
    run = kwargs.get("run")
    step = kwargs.get("step")

    def deliver() -> None:
        with log_context(
            run_id=getattr(run, "pk", None),
            step_id=getattr(step, "pk", None),
            action=getattr(step, "action_id", None),
            owner=kwargs.get("owner"),
        ):
            for receiver, result in signal.send_robust(sender=sender, **kwargs):
                if isinstance(result, Exception):
                    logger.error(
                        "a receiver of events_ledger.signals.%s (%s) raised %s: %s",
                        name,
                        getattr(receiver, "__qualname__", receiver),
                        type(result).__name__,
                        result,
                        exc_info=(type(result), result, result.__traceback__),
                    )
                    if isinstance(result, DatabaseError):
                        drop_if_dead(result)  # or the host's next write fails on it

    transaction.on_commit(deliver, using=ledger_db(), robust=True)


def _quietly(what: str) -> Any:
    """Signals are bookkeeping about work already done: preparing them must not fail it."""

    def wrap(fn: Any) -> Any:
        def safe(*args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                logger.exception("sending the signals of %s failed", what)
                if isinstance(exc, DatabaseError):
                    # Swallowed here, a dead connection would fail the host's next write.
                    drop_if_dead(exc)

        return safe

    return wrap


@_quietly("a cleanup")
def cleanup_done(runs: Sequence[EventRun], summaries: dict[int, Any], lanes: Iterable[Any]) -> None:
    """After a cleanup's verdict transaction: for each run whose verdicts it wrote (or
    whose attempts a human reset), ``cleanup_worked``, ``lease_drifted`` when a lease
    was found drifted, and ``cleanup_complete`` / ``cleanup_incomplete`` by the summary
    the pass derived. ``lanes`` are the pass's claimed groups with their verdicts."""
    drifted: dict[int, list[int]] = {}
    for lane in lanes:
        if lane.verdict is not None and lane.verdict.outcome == "drifted":
            drifted.setdefault(lane.group.run_id, []).extend(r.pk for r in lane.rows)
    for run in runs:
        summary = summaries.get(run.pk)
        if summary is None or not (
            summary.attempted or summary.failed or summary.reset is not None
        ):
            continue  # nothing was written for it: nothing became anything
        settled = copy.copy(run)  # the caller's instance keeps what it read
        settled.cleanup_status = summary.cleanup_status
        _send(cleanup_worked, EventRun, run=settled, summary=summary)
        # The rows' querysets only for a signal somebody listens to: building them for
        # nobody was a tenth of a sweep pass's Python (#27).
        if summary.drifted and run.pk in drifted and lease_drifted.has_listeners(EventRun):
            rows = Res.filter(pk__in=drifted[run.pk], status=ResourceStatus.DRIFTED)
            _send(lease_drifted, EventRun, run=settled, resources=rows)
        if summary.cleanup_status == CleanupStatus.INCOMPLETE:
            if cleanup_incomplete.has_listeners(EventRun):
                rows = Res.filter(run=run.pk).unresolved()
                _send(cleanup_incomplete, EventRun, run=settled, resources=rows, summary=summary)
        elif summary.cleanup_status == CleanupStatus.COMPLETE:
            if cleanup_complete.has_listeners(EventRun):
                rows = Res.filter(run=run.pk)
                _send(cleanup_complete, EventRun, run=settled, resources=rows, summary=summary)


@_quietly("a summary repair")
def summaries_repaired(repaired: Sequence[tuple[int, str]]) -> None:
    """After the sweep's repair re-derived summaries: the runs it made complete or
    incomplete (one query for the runs, only when somebody listens)."""
    changed = [
        (pk, status)
        for pk, status in repaired
        if status in (CleanupStatus.COMPLETE, CleanupStatus.INCOMPLETE)
    ]
    if not changed or not (
        cleanup_complete.has_listeners(EventRun) or cleanup_incomplete.has_listeners(EventRun)
    ):
        return
    runs = EventRun.objects.in_bulk([pk for pk, _ in changed])
    for pk, status in changed:
        run = runs.get(pk)
        if run is None:
            continue
        if status == CleanupStatus.INCOMPLETE:
            rows = Res.filter(run=pk).unresolved()
            _send(cleanup_incomplete, EventRun, run=run, resources=rows, summary=None)
        else:
            _send(cleanup_complete, EventRun, run=run, resources=Res.filter(run=pk), summary=None)


@_quietly("a reconcile")
def orphaned(owner: str, rows: Sequence[EventRunResource]) -> None:
    """After reconcile marked rows orphaned: one ``resources_orphaned`` per run."""
    by_run: dict[int, list[int]] = {}
    for row in rows:
        by_run.setdefault(row.run_id, []).append(row.pk)
    if not by_run or not resources_orphaned.has_listeners(EventRun):
        return
    runs = EventRun.objects.in_bulk(list(by_run))
    for run_id, pks in sorted(by_run.items()):
        run = runs.get(run_id)
        if run is not None:
            rows_qs = Res.filter(pk__in=pks)
            _send(resources_orphaned, EventRun, run=run, resources=rows_qs, owner=owner)


@_quietly("a failed step")
def step_failed_for_good(step: EventRunStep, error: str | None) -> None:
    """After a step's ``failed`` outcome is written (at its transaction's commit)."""
    if not step_failed.has_listeners(EventRunStep):
        return
    # The step was read with its run (select_related): no query for it here.
    run = step.run if EventRunStep.run.is_cached(step) else EventRun.objects.get(pk=step.run_id)
    rows = Res.filter(step=step.pk)
    _send(step_failed, EventRunStep, run=run, step=step, resources=rows, error=error)


@_quietly("a late answer")
def answered_after_cleanup(step: EventRunStep, recorded: int) -> None:
    """After a late answer's rows are written (at its transaction's commit): its step's
    placeholder had been given back by key, so the order of giving back (C8) was broken
    after the fact, and its rows wait for the next pass."""
    if not late_answer.has_listeners(EventRunStep):
        return
    run = step.run if EventRunStep.run.is_cached(step) else EventRun.objects.get(pk=step.run_id)
    rows = Res.filter(step=step.pk)
    _send(late_answer, EventRunStep, run=run, step=step, resources=rows, recorded=recorded)
