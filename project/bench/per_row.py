"""The seeds' original protocol, statement for statement, on the ledger's own tables.

The yardstick the ledger is measured against: the Node.js design wrote one row at a
time, each statement autocommitted (its own commit), in plain queries. Modelled here
with one plain ORM call per statement of theirs, never batched and never inside
``transaction.atomic``, so that every statement is a commit as it was there.

Write half, per step (4 + 2n): placeholder INSERT, mark the run dirty, per resource an
INSERT (pending) and an UPDATE (confirm), mark dirty again, resolve the placeholder.
Undo half, per run (7 + 2n, for a run of one step): read the run's unresolved rows; per
group read its step, per row a claim UPDATE, the call, per row a verdict UPDATE, one
log INSERT; then count what is left, read the retryable rows, set the run's
cleanup_status, write the summary log. (Their sweep's scan for runs, one statement per
pass of ten runs, is left out: the runs are known here.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db.models import F, Q

from events_ledger.conf import ledger_settings
from events_ledger.db import UtcNow
from events_ledger.models import (
    STEP_KIND,
    UNRESOLVED,
    EventRun,
    EventRunLog,
    EventRunResource,
    EventRunStep,
)

Res = EventRunResource.objects
#: What a claim may take: anything unresolved but a claim still fresh (R5).
CLAIMABLE = ("pending", "confirmed", "orphaned", "drifted")


def _mark_dirty(run: EventRun) -> None:
    # Guarded: never walks a run back from complete/incomplete to pending.
    EventRun.objects.filter(pk=run.pk, cleanup_status="not_required").update(
        cleanup_status="pending"
    )


def record_step(
    run: EventRun, step: EventRunStep, owner: str, perform: Callable[..., dict[str, Any]]
) -> int:
    """The write half for one step; answers how many resources it recorded."""
    placeholder = Res.create(
        run=run,
        step=step,
        owner_module=owner,
        kind=STEP_KIND,
        ref=step.idempotency_key,
        payload={"action": step.action_id, "phase": step.phase, "seq": step.seq},
        status="pending",
    )
    _mark_dirty(run)
    answer = perform(run_id=run.pk, params=step.params, idempotency_key=step.idempotency_key)
    recorded = 0
    for entry in answer.get("resources", []):
        row = Res.create(
            run=run,
            step=step,
            owner_module=owner,
            kind=entry["kind"],
            ref=entry["ref"],
            payload=entry.get("payload"),
            status="pending",
        )
        recorded += Res.filter(pk=row.pk, status="pending").update(status="confirmed")
    if recorded:
        _mark_dirty(run)
    Res.filter(pk=placeholder.pk, kind=STEP_KIND, status__in=("pending", "confirmed")).update(
        status="reverted", last_error=None
    )
    return recorded


def give_back_run(run: EventRun, revert: Callable[..., dict[str, Any]]) -> int:
    """The undo half for one terminal run; answers how many rows it gave back."""
    max_attempts = ledger_settings.MAX_REVERT_ATTEMPTS
    ttl = ledger_settings.REVERT_CLAIM_TTL
    rows = list(
        Res.filter(run=run, status__in=UNRESOLVED, revert_attempts__lt=max_attempts).order_by("pk")
    )
    groups: dict[Any, list[EventRunResource]] = {}
    for row in rows:
        groups.setdefault(row.step_id if row.step_id is not None else f"row:{row.pk}", []).append(
            row
        )
    attempted = reverted = 0
    for group in groups.values():
        step_id = group[0].step_id
        step = EventRunStep.objects.get(pk=step_id) if step_id is not None else None
        claimed = [
            row
            for row in group
            if Res.filter(
                Q(pk=row.pk)
                & (Q(status__in=CLAIMABLE) | Q(status="reverting", updated_at__lt=UtcNow() - ttl))
            ).update(status="reverting", updated_at=UtcNow())
        ]
        if not claimed:
            continue
        attempted += len(claimed)
        answer = revert(
            run_id=run.pk,
            resources=[
                {"kind": r.kind, "ref": r.ref, "payload": r.payload}
                for r in claimed
                if r.kind != STEP_KIND
            ],
            idempotency_key=step.idempotency_key if step else group[0].ref,
        )
        done = answer.get("ok") is True
        for row in claimed:
            if done:
                Res.filter(pk=row.pk).update(status="reverted", last_error=None)
                reverted += 1
            else:
                # The seeds' failRevert: back to confirmed, one attempt more (rule 2).
                Res.filter(pk=row.pk).update(
                    status="confirmed",
                    revert_attempts=F("revert_attempts") + 1,
                    last_error=str(answer)[:500],
                )
        EventRunLog.objects.create(
            run=run,
            kind="cleanup.reverted" if done else "cleanup.failed",
            detail={
                "what": step.action_id if step else None,
                "resources": [f"{r.kind}:{r.ref}" for r in claimed],
            },
        )
    remaining = Res.filter(run=run, status__in=UNRESOLVED).count()
    retryable = list(Res.filter(run=run, status__in=UNRESOLVED, revert_attempts__lt=max_attempts))
    status = "complete" if remaining == 0 else ("pending" if retryable else "incomplete")
    EventRun.objects.filter(pk=run.pk).update(cleanup_status=status)
    if attempted:
        EventRunLog.objects.create(
            run=run,
            kind="cleanup.swept",
            detail={"attempted": attempted, "reverted": reverted, "remaining": remaining},
        )
    return reverted
