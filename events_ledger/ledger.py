"""The write half: every change a run makes is on the ledger before it is confirmed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from .conf import ledger_settings
from .db import retrying_deadlocks
from .deadline import call_with_deadline
from .envelopes import describe, is_success
from .models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from .registry import LEASE_ACTION_ID, Action
from .registry import default_registry as registry

logger = logging.getLogger("events_ledger")

MAX_KIND = 64
MAX_REF = 190
MAX_MEMBER_KEY = 190

#: Classes whose resources the ledger must come back for.
LEDGERED = ("ledger", "override")


# ── W1 ──


@dataclass(frozen=True)
class Normalised:
    ok: bool
    row: dict[str, Any] | None = None
    reason: str | None = None


def _refuse(action_id: str, why: str) -> Normalised:
    return Normalised(ok=False, reason=f"{action_id} reported a resource {why}")


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def normalise(entry: Any, action_id: str) -> Normalised:
    """W1: one reported resource → a row, or the reason it is refused.

    Every refusal is the module's mistake, not the world's, so none is retried. Nothing
    is ever cut to fit: a truncated ref names the wrong object.
    """
    if not isinstance(entry, dict):
        return _refuse(action_id, f"that is not a mapping: {describe(entry, 60)}")
    kind, ref = _text(entry.get("kind")), _text(entry.get("ref"))
    if not kind or len(kind) > MAX_KIND:
        return _refuse(action_id, f"with a bad kind {describe(entry.get('kind'), 80)}")
    if kind == STEP_KIND:
        # The app's own: a module that could write one could make its own step look resolved.
        return _refuse(action_id, f"of the reserved kind {kind!r}")
    if not ref or len(ref) > MAX_REF:
        return _refuse(
            action_id, f"with a bad ref {describe(entry.get('ref'), 80)} (1–{MAX_REF} characters)"
        )
    if "\x00" in kind or "\x00" in ref:
        return _refuse(action_id, "with a NUL character in its kind or ref")
    member_key = entry.get("member_key", entry.get("memberKey"))
    member_key = None if member_key is None else str(member_key)
    if member_key is not None and len(member_key) > MAX_MEMBER_KEY:
        return _refuse(action_id, f"with a member_key over {MAX_MEMBER_KEY} characters")
    until = entry.get("until")
    lease_until: datetime | None = None
    if until is not None:
        lease_until = parse_until(until)
        if lease_until is None:
            return _refuse(action_id, f"with a bad until {describe(until, 60)}")
    if kind == "override" and registry.lease_for_ref(ref) is None:
        # The ledger gives an override back through the lease registry; a ref naming
        # no lease is a promise to undo something it has no way to undo.
        return _refuse(action_id, f"naming the lease {ref!r}, which no module registers")
    payload = entry.get("payload")
    try:
        if payload is not None:
            _check_json(payload)
    except (TypeError, ValueError) as exc:
        return _refuse(action_id, f"with a payload that is not JSON ({exc})")
    return Normalised(
        ok=True,
        row={
            "kind": kind,
            "ref": ref,
            "payload": payload,
            "lease_until": lease_until,
            "member_key": member_key,
        },
    )


def parse_until(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        parsed: datetime | None = value
    elif isinstance(value, str):
        try:
            parsed = parse_datetime(value.strip())
        except ValueError:
            return None
    else:
        return None
    if parsed is None:
        return None
    if timezone.is_naive(parsed):
        parsed = timezone.make_aware(parsed, UTC)
    try:
        # The databases store years 1–9999 only; a value outside is not a date for us.
        parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        return None
    return parsed


def _check_json(payload: Any) -> None:
    import json

    from django.core.serializers.json import DjangoJSONEncoder

    json.dumps(payload, cls=DjangoJSONEncoder, allow_nan=False)


# ── W4 ──


def mark_run_dirty(run: Any) -> bool:
    """W4: there is something to give back. ``not_required → pending`` only, so it can
    never walk a run back from ``complete`` or ``incomplete``."""
    return EventRun.objects.set_cleanup_status(run, "pending", only_from=["not_required"])


# ── W2 ──


def reserve_step(run: Any, step: EventRunStep, action: Action) -> int | None:
    """W2: the ``@step`` placeholder of a ``ledger`` action, written before dispatch.

    Keyed by the step's idempotency key, which never changes across retries: finding
    it already there means this step's earlier attempt wrote it, and it is reused.
    """
    if action.reversible != "ledger":
        return None
    run_id = getattr(run, "pk", run)
    answer = EventRunResource.objects.reserve(
        run_id,
        step,
        owner=action.owner,
        kind=STEP_KIND,
        ref=step.idempotency_key,
        payload={"action": action.id, "phase": step.phase, "seq": step.seq},
    )
    if answer.ok:
        # cleanup_status never returns to not_required, so a run read as already dirty
        # (or cleaned) needs no UPDATE; an id alone is always marked.
        if getattr(run, "cleanup_status", "not_required") == "not_required":
            mark_run_dirty(run_id)
        return answer.id
    existing = (
        EventRunResource.objects.find_by_target(action.owner, STEP_KIND, step.idempotency_key)
        .filter(run_id=run_id)
        .values_list("pk", flat=True)
        .first()
    )
    return existing


# ── W3 ──


@dataclass
class RecordResult:
    recorded: int = 0
    rejected: list[str] = field(default_factory=list)


def record_answer(
    run: Any,
    step: EventRunStep,
    action: Action,
    placeholder_id: int | None,
    resources: Any,
) -> RecordResult:
    """W3: record what a module says it made, and resolve the placeholder. Never raises.

    A step that changed the world has changed it; a ledger that raised here would turn
    bookkeeping into a failed step and then into a retried world write. The cost is a
    fixed number of statements whatever the answer's size: one multi-row INSERT of
    confirmed rows that lets the unique key skip what is already held, and, only when
    something was skipped, one SELECT naming other runs' holders.
    """
    out = RecordResult()
    if action.reversible not in LEDGERED:
        return out
    run_id = getattr(run, "pk", run)
    entries = resources if isinstance(resources, list) else []
    if resources is not None and not isinstance(resources, list):
        out.rejected.append(
            f"{action.id} reported resources that are not a list: {describe(resources, 60)}"
        )
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in entries:
        parsed = normalise(entry, action.id)
        if not parsed.ok:
            out.rejected.append(parsed.reason or "")
            logger.warning("run %s step %s: %s", run_id, step.pk, parsed.reason)
            continue
        assert parsed.row is not None
        rows.setdefault((parsed.row["kind"], parsed.row["ref"]), parsed.row)
    try:
        if rows:
            out.recorded = _insert(run_id, step, action.owner, list(rows.values()))
            # Held by this run (this step's earlier attempt, or another of its steps):
            # already recorded, skipped silently. Held by another run: said, by its id.
            # When every target went in, nobody else holds any: no need to ask.
            skipped = rows if out.recorded < len(rows) else {}
            holders = EventRunResource.objects.holders(action.owner, skipped)
            for (kind, ref), holder in sorted(holders.items()):
                if holder.run_id != run_id:
                    out.rejected.append(f"{kind} {ref!r} is already held by run {holder.run_id}")
        if out.recorded and placeholder_id is None:
            # With a placeholder the run was marked dirty when it was written (W2).
            mark_run_dirty(run_id)
    except Exception as exc:  # bookkeeping must not become the step's control flow
        logger.exception("run %s step %s: recording failed", run_id, step.pk)
        out.rejected.append(f"recording failed: {type(exc).__name__}: {exc}")
        # The placeholder stays: rule 1, cleanup reverts the step by its key.
        return out
    # Resolved even when the module reported nothing: "ok, I made nothing" is an answer,
    # and an open placeholder would call revert() for this step on every terminal path.
    if placeholder_id:
        try:
            EventRunResource.objects.resolve_placeholder(placeholder_id)
        except Exception as exc:
            logger.exception("run %s step %s: resolving the placeholder failed", run_id, step.pk)
            out.rejected.append(f"resolving the placeholder failed: {exc}")
    return out


def _insert(run_id: int, step: EventRunStep, owner: str, rows: list[dict[str, Any]]) -> int:
    # The unique key decides: a target already held (by this step's earlier attempt,
    # or by anyone) is skipped by the database, never checked first.
    return retrying_deadlocks(
        lambda: EventRunResource.objects.bulk_record(run_id, step, owner, rows)
    )


# ── W5, W6 ──


@dataclass
class StepResult:
    """What ``execute_step`` did. ``outcome``: done, retry, failed, refused or busy."""

    outcome: str
    recorded: int = 0
    rejected: list[str] = field(default_factory=list)
    error: str | None = None
    holder_run_id: int | None = None


def execute_step(step_or_id: EventRunStep | int) -> StepResult:
    """W5: run one step, with everything it changes on the ledger first.

    Claims the step (two workers never run one step), writes the placeholder, calls
    ``perform`` under the action's deadline with the step's idempotency key, records the
    answer and settles the step. Nothing but ``ok: True`` is success; a lost answer
    (timeout, exception) leaves the placeholder pending for cleanup to revert by key.
    """
    step_id = getattr(step_or_id, "pk", step_or_id)
    token = EventRunStep.objects.claim(step_id)
    if token is None:
        return StepResult("busy", error="another worker holds this step")
    step: EventRunStep = EventRunStep.objects.select_related("run").get(pk=step_id)
    run = step.run
    if run.status in EventRun.TERMINAL:
        return _settle(
            step, token, StepResult("failed", error=f"run {run.pk} is {run.status}; not performed")
        )
    action = registry.action(step.action_id)
    if action is None:
        return _settle(
            step,
            token,
            StepResult("failed", error=f"no module registers the action {step.action_id!r}"),
        )
    if action.id == LEASE_ACTION_ID:
        return _settle(step, token, _take_lease(run, step))
    if not callable(action.perform):
        return _settle(
            step, token, StepResult("failed", error=f"{action.id} declares no perform()")
        )

    perform = action.perform
    placeholder_id = reserve_step(run, step, action)
    call = call_with_deadline(
        lambda: perform(run_id=run.pk, params=step.params, idempotency_key=step.idempotency_key),
        action.budget_ms / 1000,
        action.id,
    )
    if call.timed_out or call.error is not None:
        return _settle(step, token, StepResult("retry", error=call.message))
    answer = call.value
    if not is_success(answer):
        return _settle(step, token, _failure(action.id, answer))
    recorded = record_answer(run, step, action, placeholder_id, answer.get("resources"))
    return _settle(step, token, StepResult("done", recorded.recorded, recorded.rejected))


def _failure(what: str, answer: Any) -> StepResult:
    if not isinstance(answer, dict):
        return StepResult("retry", error=f"{what} answered with no envelope: {describe(answer)}")
    error = answer.get("error")
    message = (
        str(error) if error not in (None, "") else f"{what} did not confirm: {describe(answer)}"
    )
    return StepResult("failed" if answer.get("retry") is False else "retry", error=message)


def _settle(step: EventRunStep, token: str, result: StepResult) -> StepResult:
    status = {"done": "done", "refused": "refused", "failed": "failed"}.get(
        result.outcome, "pending"
    )
    if result.outcome == "retry" and step.attempts >= ledger_settings.MAX_STEP_ATTEMPTS:
        status, result.outcome = "failed", "failed"
    error = result.error
    if error is None and result.rejected:
        error = "; ".join(result.rejected)[:2000]
    if not EventRunStep.objects.settle(step, token, status, error):
        logger.warning(
            "step %s: a newer claim took it over; outcome %s not written", step.pk, result.outcome
        )
    if result.outcome == "done" and not result.rejected:
        # A clean success is on the step row itself; the run's log keeps what an
        # operator must read (retries, failures, refusals, dropped resources).
        return result
    EventRunLog.objects.write(
        step.run_id,
        f"step.{result.outcome}",
        {
            "step": step.pk,
            "action": step.action_id,
            "attempt": step.attempts,
            "recorded": result.recorded,
            "rejected": result.rejected,
            "error": result.error,
        },
    )
    return result


def _take_lease(run: EventRun, step: EventRunStep) -> StepResult:
    """W6: the override row is reserved BEFORE the world is written, so a second run
    asking for a held target is refused and the world is never touched."""
    params = step.params if isinstance(step.params, dict) else {}
    ref = _text(params.get("lease"))
    found = registry.lease_for_ref(ref)
    if found is None:
        return StepResult("failed", error=f"no module registers the lease {ref!r}")
    if len(ref) > MAX_REF:
        return StepResult("failed", error=f"the lease ref is over {MAX_REF} characters")
    lease, target = found.lease, found.target
    read_value, apply_value = lease.read, lease.apply
    if not callable(read_value) or not callable(apply_value):
        return StepResult("failed", error=f"the lease {lease.id} declares no read() or apply()")
    until = params.get("until")
    lease_until = parse_until(until) if until is not None else None
    if until is not None and lease_until is None:
        return StepResult("failed", error=f"the lease's until {describe(until, 60)} is not a date")
    budget = (
        (lease.budget_ms / 1000)
        if lease.budget_ms
        else ledger_settings.DEFAULT_REVERT_BUDGET.total_seconds()
    )
    value = params.get("value")

    held = (
        EventRunResource.objects.filter(
            run=run, step=step, kind="override", ref=ref, status__in=("pending", "confirmed")
        )
        .values_list("pk", "status")
        .first()
    )
    if held is None:
        read = call_with_deadline(lambda: read_value(target=target), budget, f"{lease.id}.read")
        if read.timed_out or read.error is not None:
            return StepResult("retry", error=read.message)
        answer = EventRunResource.objects.reserve(
            run,
            step,
            owner=lease.owner,
            kind="override",
            ref=ref,
            payload={"baseline": read.value, "applied": value},
            lease_until=lease_until,
        )
        if not answer.ok:
            holder = answer.holder
            who = f"run {holder.run_id}" if holder else "another run"
            return StepResult(
                "refused",
                error=f"{ref} is held by {who}",
                holder_run_id=holder.run_id if holder else None,
            )
        row_id, row_status = answer.id, "pending"
        mark_run_dirty(run)
    else:
        # This step's earlier attempt reserved it: keep that row and its baseline (a
        # fresh read now could see the value this run applied).
        row_id, row_status = held
    if row_status == "confirmed":
        return StepResult("done", recorded=0)
    applied = call_with_deadline(
        lambda: apply_value(value, target=target, run_id=run.pk), budget, f"{lease.id}.apply"
    )
    if applied.timed_out or applied.error is not None:
        return StepResult("retry", error=applied.message)
    if not is_success(applied.value):
        return _failure(f"{lease.id}.apply", applied.value)
    EventRunResource.objects.confirm(row_id)
    return StepResult("done", recorded=1)
