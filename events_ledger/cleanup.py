"""The undo half: give back what terminal runs took, and reconcile with a restarted world."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from django.db import DatabaseError, connection

from .conf import ledger_settings
from .db import is_connection_lost
from .deadline import call_with_deadline
from .envelopes import Verdict, classify_revert, describe
from .models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from .registry import default_registry as registry

logger = logging.getLogger("events_ledger")

Res = EventRunResource.objects

__all__ = [
    "CleanupSummary",
    "Group",
    "RunNotTerminal",
    "SweepReport",
    "ReconcileSummary",
    "classify_revert",
    "cleanup_run",
    "plan_run",
    "reconcile_all",
    "reconcile_module",
    "sweep",
]


class RunNotTerminal(Exception):
    """Cleanup was asked of a run still in flight, whose ledger is still growing."""


# ── grouping (C2, C3) ──


@dataclass
class Group:
    """Rows given back by one call: a lease row alone, or the rows one step made."""

    rows: list[EventRunResource]
    action_id: str | None = None
    lease_ref: str | None = None
    idempotency_key: str | None = None
    problem: str | None = None

    @property
    def what(self) -> str:
        return self.lease_ref or self.action_id or "unknown"

    @property
    def call(self) -> str:
        if self.lease_ref:
            return f"restore {self.lease_ref}"
        refs = [f"{r.kind}:{r.ref}" for r in self.rows if r.kind != STEP_KIND]
        return f"{self.action_id}.revert(key={self.idempotency_key}, resources={refs})"

    def describe(self) -> dict[str, Any]:
        return {
            "call": "restore" if self.lease_ref else "revert",
            "what": self.what,
            "idempotency_key": self.idempotency_key,
            "resources": [f"{r.kind}:{r.ref}" for r in self.rows],
            "problem": self.problem,
        }


def group_rows(rows: Iterable[EventRunResource]) -> list[Group]:
    """C2/C3: a lease row is its own group; other rows are grouped by the step that
    made them, which names the action and the idempotency key. A row whose step is
    gone names its action through its own payload (a placeholder always does)."""
    rows = list(rows)
    # The steps' action and key, once per step rather than once per row.
    steps = (
        dict(
            (pk, (action_id, key))
            for pk, action_id, key in EventRunStep.objects.filter(
                pk__in={r.step_id for r in rows if r.step_id is not None and r.kind != "override"}
            ).values_list("pk", "action_id", "idempotency_key")
        )
        if any(r.step_id is not None and r.kind != "override" for r in rows)
        else {}
    )
    leases: list[Group] = []
    by_step: dict[Any, Group] = {}
    for row in rows:
        if row.kind == "override":
            leases.append(Group(rows=[row], lease_ref=row.ref))
            continue
        key = ("step", row.step_id) if row.step_id is not None else ("row", row.pk)
        group = by_step.get(key)
        if group is None:
            step = steps.get(row.step_id) if row.step_id is not None else None
            payload = row.payload if isinstance(row.payload, dict) else {}
            action_id = step[0] if step else payload.get("action")
            idem = step[1] if step else (row.ref if row.kind == STEP_KIND else None)
            group = by_step[key] = Group(rows=[], action_id=action_id, idempotency_key=idem)
            if not action_id:
                group.problem = "nothing records which action created this resource"
        group.rows.append(row)
    return leases + list(by_step.values())


def _groups_for(run: EventRun, human: bool) -> list[Group]:
    rows = Res.unresolved_for_run(
        run,
        max_attempts=None if human else ledger_settings.MAX_REVERT_ATTEMPTS,
        max_claims=None if human else ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT,
    )
    return group_rows(rows)[: ledger_settings.CLEANUP_GROUPS_PER_RUN]


def plan_run(run: EventRun | int, reset_attempts: bool = False) -> list[Group]:
    """What a cleanup of this run would ask for, without writing anything (dry run)."""
    run = _run(run)
    return _groups_for(run, human=reset_attempts)


# ── calling the module (C1–C3) ──


def _give_back(group: Group, rows: list[EventRunResource]) -> Verdict:
    if group.problem:
        return Verdict("terminal", group.problem)
    if group.lease_ref:
        return _restore_lease(rows[0])
    action = registry.action(group.action_id)
    if action is None:
        return Verdict(
            "terminal",
            f"no module registers the action {group.action_id!r}, "
            "so its resources cannot be given back",
        )
    revert = action.revert
    if not callable(revert):
        return Verdict("terminal", f"{action.id} declares no revert()")
    resources = [
        {"kind": r.kind, "ref": r.ref, "payload": r.payload, "member_key": r.member_key}
        for r in rows
        if r.kind != STEP_KIND
    ]
    budget = (action.budget_ms or 0) / 1000 or ledger_settings.DEFAULT_REVERT_BUDGET.total_seconds()
    call = call_with_deadline(
        lambda: revert(
            run_id=rows[0].run_id, resources=resources, idempotency_key=group.idempotency_key
        ),
        budget,
        f"{action.id}.revert",
    )
    return classify_revert(call, action.id)


def _restore_lease(row: EventRunResource) -> Verdict:
    found = registry.lease_for_ref(row.ref)
    if found is None:
        # Not retryable (nothing changes until an operator reinstalls the module), and
        # not an orphan either: nobody knows whether the value is still applied.
        return Verdict("terminal", f"no module registers the lease {row.ref!r}")
    payload = row.payload if isinstance(row.payload, dict) else {}
    lease = found.lease
    restore = lease.restore
    if not callable(restore):
        return Verdict("terminal", f"the lease {lease.id} declares no restore()")
    budget = (lease.budget_ms or 0) / 1000 or ledger_settings.DEFAULT_REVERT_BUDGET.total_seconds()
    call = call_with_deadline(
        lambda: restore(
            payload.get("baseline"),
            expected=payload.get("applied"),
            run_id=row.run_id,
            target=found.target,
        ),
        budget,
        f"{lease.id}.restore",
    )
    return classify_revert(call, row.ref)


# ── C4 ──


@dataclass
class CleanupSummary:
    run_id: int
    attempted: int = 0
    reverted: int = 0
    drifted: int = 0
    failed: int = 0
    remaining: int = 0
    fenced: int = 0
    cleanup_status: str = ""
    reset: int | None = None
    errors: list[str] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(run: EventRun | int) -> EventRun:
    # A terminal status is final, so an instance that says so can be trusted; any other
    # may predate the run's last transition and is read afresh.
    if isinstance(run, EventRun) and run.status in EventRun.TERMINAL:
        return run
    return EventRun.objects.get(pk=getattr(run, "pk", run))


class _LogBuffer:
    """A run's log entries of one cleanup, written in one INSERT (and written even when
    the cleanup fails half-way, so no state change goes unlogged)."""

    def __init__(self, run: EventRun) -> None:
        self.run = run
        self.entries: list[EventRunLog] = []

    def add(self, kind: str, detail: dict[str, Any]) -> None:
        self.entries.append(EventRunLog(run_id=self.run.pk, kind=kind, detail=detail))

    def flush(self) -> None:
        if self.entries:
            EventRunLog.objects.bulk_create(self.entries)
            self.entries = []


def cleanup_run(
    run: EventRun | int, reset_attempts: bool = False, actor: str | None = None
) -> CleanupSummary:
    """C4: work one terminal run's ledger once.

    ``reset_attempts`` is the human's flag (never the sweep's): it zeroes the
    counters first and logs who did it. Each group's rows are claimed (R5) in one
    statement, given back by one call, and their verdict written by the claim's
    holder only. ``cleanup_status`` is then derived from the rows left, in the
    statement that writes it.
    """
    run = _run(run)
    if run.status not in EventRun.TERMINAL:
        raise RunNotTerminal(f"run {run.pk} is {run.status}: only a finished run is cleaned up")
    log = _LogBuffer(run)
    try:
        return _cleanup(run, reset_attempts, actor, log)
    finally:
        log.flush()


def _cleanup(
    run: EventRun, reset_attempts: bool, actor: str | None, log: _LogBuffer
) -> CleanupSummary:
    summary = CleanupSummary(run_id=run.pk)
    if reset_attempts:
        summary.reset = Res.reset_attempts(run)
        EventRun.objects.set_cleanup_status(run, "pending")
        log.add("cleanup.retry", {"resources": summary.reset, "by": actor})

    max_claims = ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT
    for group in _groups_for(run, human=reset_attempts):
        claim = Res.claim_group(
            group.rows,
            released=any(r.status in ("orphaned", "drifted") for r in group.rows),
        )
        for pk in claim.collided:
            holder = Res.note_collision(pk)
            summary.failed += 1
            log.add(
                "cleanup.collision",
                {"resource": pk, "held_by_run": holder.run_id if holder else None},
            )
        if not claim.rows:
            continue
        rows = claim.rows
        poisoned = [r for r in rows if r.claim_count >= max_claims]
        if poisoned:
            # Claimed this often with no verdict: its revert kills or hangs every
            # sweeper that tries it. Fail it for good rather than loop for ever.
            error = (
                f"claimed {max_claims} times without a verdict: giving it back kills or "
                "hangs the sweeper, so it was left for a human"
            )
            written = Res.fail_revert(
                [r.pk for r in poisoned], error, token=claim.token, spent_claims=True
            )
            summary.attempted += len(poisoned)
            summary.failed += written
            _log_verdict(log, group, poisoned, Verdict("terminal", error))
            rows = [r for r in rows if r.claim_count < max_claims]
            if not rows:
                continue
        summary.attempted += len(rows)
        verdict = _give_back(group, rows)
        _apply(log, group, rows, verdict, claim.token, summary)

    summary.cleanup_status, summary.remaining = EventRun.objects.settle_cleanup(
        run, ledger_settings.MAX_REVERT_ATTEMPTS, max_claims
    )
    if summary.attempted or reset_attempts:
        log.add(
            "cleanup.swept",
            {
                "attempted": summary.attempted,
                "reverted": summary.reverted,
                "drifted": summary.drifted,
                "failed": summary.failed,
                "remaining": summary.remaining,
                "fenced": summary.fenced,
                "cleanup_status": summary.cleanup_status,
                "by": actor,
            },
        )
    return summary


def _apply(
    log: _LogBuffer,
    group: Group,
    rows: list[EventRunResource],
    verdict: Verdict,
    token: str,
    summary: CleanupSummary,
) -> None:
    """Write one verdict over the rows it covers: at most two statements, fenced by the
    claim's token so a sweeper whose stale claim was taken over writes nothing."""
    ids = [r.pk for r in rows]
    if verdict.outcome == "done":
        failed_refs = set(verdict.failed)
        bad = [r.pk for r in rows if r.ref in failed_refs]
        good = [pk for pk in ids if pk not in bad]
        written = Res.mark_reverted(good, token=token) if good else 0
        summary.reverted += written
        if bad:
            written_bad = Res.fail_revert(
                bad, f"{group.what} answered ok but could not give this back", token=token
            )
            summary.failed += written_bad
            written += written_bad
    elif verdict.outcome == "drifted":
        written = Res.fail_revert(ids, verdict.error, "drifted", token=token)
        summary.drifted += written
    else:
        written = Res.fail_revert(
            ids, verdict.error, token=token, spend_all=verdict.outcome == "terminal"
        )
        summary.failed += written
        if verdict.error:
            summary.errors.append(verdict.error)
    if written < len(ids):
        summary.fenced += len(ids) - written
        log.add(
            "cleanup.fenced",
            {
                "what": group.what,
                "resources": len(ids) - written,
                "reason": "another sweeper took the claim over; this verdict was not written",
                "verdict": verdict.outcome,
            },
        )
    _log_verdict(log, group, rows, verdict)
    summary.groups.append({**group.describe(), "outcome": verdict.outcome, "error": verdict.error})


def _log_verdict(
    log: _LogBuffer, group: Group, rows: list[EventRunResource], verdict: Verdict
) -> None:
    kind = {"done": "cleanup.reverted", "drifted": "cleanup.drifted"}.get(
        verdict.outcome, "cleanup.failed"
    )
    detail: dict[str, Any] = {
        "what": group.what,
        "outcome": verdict.outcome,
        "resources": [f"{r.kind}:{r.ref}" for r in rows],
    }
    if verdict.error:
        detail["error"] = verdict.error
    if verdict.failed:
        detail["failed"] = verdict.failed
    log.add(kind, detail)


# ── C5 ──


@dataclass
class SweepReport:
    runs: list[CleanupSummary] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    repaired: int = 0

    @property
    def incomplete(self) -> list[int]:
        return [s.run_id for s in self.runs if s.cleanup_status == "incomplete"]


def sweep(limit: int | None = None, should_stop: Callable[[], bool] | None = None) -> SweepReport:
    """C5, the cron's leg: terminal runs only (a run in flight still grows its
    ledger), at most ``CLEANUP_RUN_BATCH`` of them; one run's failure is logged and
    does not stop the others. Summaries that disagree with their rows are repaired."""
    report = SweepReport()
    max_attempts = ledger_settings.MAX_REVERT_ATTEMPTS
    max_claims = ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT
    report.repaired = EventRun.objects.repair_cleanup_summaries(max_attempts, max_claims)
    runs = Res.runs_needing_cleanup(
        limit or ledger_settings.CLEANUP_RUN_BATCH, max_attempts, max_claims
    )
    for run in runs:
        if should_stop is not None and should_stop():
            break  # asked to stop: the run in hand is finished, the rest wait
        if run.status not in EventRun.TERMINAL:
            continue
        try:
            report.runs.append(cleanup_run(run))
        except Exception as exc:
            logger.exception("cleanup of run %s failed", run.pk)
            report.errors[run.pk] = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, DatabaseError) and (is_connection_lost(exc) or not _usable()):
                # The server went away ("gone away", a lost or killed connection): the
                # next run gets a new connection. A verdict whose answer was lost is
                # fenced by its claim, so the row is simply reclaimed after the TTL.
                connection.close()
                continue
            try:
                EventRunLog.objects.write(run, "cleanup.error", {"error": report.errors[run.pk]})
            except DatabaseError:
                connection.close()
    return report


def _usable() -> bool:
    try:
        return connection.connection is not None and connection.is_usable()
    except Exception:
        return False


# ── C6 ──


@dataclass
class ReconcileSummary:
    owner: str
    asked: int = 0
    in_force: int = 0
    orphaned: int = 0
    unanswered: int = 0
    would_orphan: int = 0
    held_back: bool = False
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def reconcile_module(
    owner: str, *, force: bool = False, max_fraction: float | None = None
) -> ReconcileSummary:
    """C6: ask a module which of its live rows are still in force.

    Rows no longer in force become ``orphaned`` (never ``reverted``: nobody put them
    back). No ``reconcile``, an error, a timeout or any other shape is "unanswered"
    and leaves the ledger alone: "I don't know" never means "gone". When the answers
    would orphan more than ``RECONCILE_MAX_ORPHAN_FRACTION`` of the rows asked about,
    nothing is orphaned unless ``force``: a half-started world that answers "I have
    nothing" must not wipe the ledger.
    """
    summary = ReconcileSummary(owner=owner)
    rows = [r for r in Res.live_for_module(owner) if r.kind != STEP_KIND]
    missing: list[tuple[EventRunResource, str]] = []
    for group in group_rows(rows):
        if group.lease_ref:
            summary.unanswered += len(group.rows)  # a lease is restored, never reconciled
            continue
        action = registry.action(group.action_id)
        if action is None or not callable(action.reconcile):
            summary.unanswered += len(group.rows)
            continue
        resources = [{"kind": r.kind, "ref": r.ref, "payload": r.payload} for r in group.rows]
        call = call_with_deadline(
            partial(action.reconcile, run_id=group.rows[0].run_id, resources=resources),
            (action.budget_ms or 0) / 1000 or ledger_settings.DEFAULT_REVERT_BUDGET.total_seconds(),
            f"{action.id}.reconcile",
        )
        answer = call.value
        if (
            call.timed_out
            or call.error is not None
            or not isinstance(answer, dict)
            or answer.get("ok") is not True
            or not isinstance(answer.get("in_force"), list)
        ):
            summary.unanswered += len(group.rows)
            logger.warning(
                "reconcile of %s unanswered: %s", action.id, call.message or describe(answer)
            )
            continue
        summary.asked += len(group.rows)
        in_force = {str(ref) for ref in answer["in_force"]}
        for row in group.rows:
            if row.ref in in_force:
                summary.in_force += 1
            else:
                missing.append((row, action.id))
    summary.would_orphan = len(missing)
    fraction = (
        ledger_settings.RECONCILE_MAX_ORPHAN_FRACTION if max_fraction is None else max_fraction
    )
    if missing and not force and summary.asked and len(missing) > fraction * summary.asked:
        summary.held_back = True
        summary.reason = (
            f"the answers would orphan {len(missing)} of {summary.asked} live rows, more than "
            f"{fraction:.0%}; nothing was orphaned (a world that is half up answers like that). "
            "Check the world, then reconcile with force."
        )
        return summary
    if missing:
        summary.orphaned = Res.mark_orphaned(
            [r.pk for r, _ in missing], "the module reports this is no longer in force"
        )
        by_run: dict[int, list[str]] = {}
        for row, _action_id in missing:
            by_run.setdefault(row.run_id, []).append(f"{row.kind}:{row.ref}")
        EventRunLog.objects.bulk_create(
            [
                EventRunLog(
                    run_id=run_id,
                    kind="resource.orphaned",
                    detail={"module": owner, "resources": refs},
                )
                for run_id, refs in by_run.items()
            ]
        )
    return summary


def reconcile_all(*, force: bool = False) -> dict[str, ReconcileSummary]:
    """Ask every module that owns a live row."""
    out: dict[str, ReconcileSummary] = {}
    for owner in Res.modules_with_live_rows():
        try:
            out[owner] = reconcile_module(owner, force=force)
        except Exception as exc:
            logger.exception("reconcile of %s failed", owner)
            out[owner] = ReconcileSummary(owner=owner, reason=f"{type(exc).__name__}: {exc}")
    return out


def reconcile(owner: str, *, force: bool = False) -> ReconcileSummary:
    """What a host app calls when it sees its world restart."""
    return reconcile_module(owner, force=force)
