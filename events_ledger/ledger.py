"""The write half: every change a run makes is on the ledger before it is confirmed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connections

from . import fastpath, signals
from .background import keeper, process_name
from .conf import ledger_settings
from .db import (
    bounded,
    causal_reads,
    drop_if_dead,
    dropping_dead,
    in_transaction,
    is_held,
    ledger_db,
    refuse_callers_transaction,
    statements_retried,
    storable,
    storable_json,
)
from .deadline import CallResult, call_with_deadline
from .envelopes import (
    MAX_REF,
    Verdict,
    as_text,
    check_json,
    classify_perform,
    describe,
    is_success,
    parse_until,
    read_resources,
)
from .logcontext import bind, log_context
from .models import EventRun, EventRunLog, EventRunResource, EventRunStep
from .registry import LEASE_ACTION_ID, Action
from .registry import default_registry as registry
from .states import LIVE, CleanupStatus, ResourceStatus, StepStatus

logger = logging.getLogger("events_ledger")

#: Classes whose resources the ledger must come back for.
LEDGERED = ("ledger", "override")


# ── W4 ──


def mark_run_dirty(run: Any) -> bool:
    """W4: there is something to give back: ``not_required|complete → pending``.

    ``complete`` is in because a row can be recorded after a run's cleanup ended (the
    late answer of a call that outlived its deadline, a step whose claim went stale and
    came back): the summary said "nothing left" of rows that did not exist yet.
    ``incomplete`` stays: it waits for a human, and the sweep's repair re-derives it
    from the rows when new ones arrive."""
    return EventRun.objects.set_cleanup_status(
        run, CleanupStatus.PENDING, only_from=[CleanupStatus.NOT_REQUIRED, CleanupStatus.COMPLETE]
    )


# ── W2 ──


def reserve_step(run: Any, step: EventRunStep, action: Action) -> int | None:
    """W2: the ``@step`` placeholder of a ``ledger`` action, written before dispatch,
    and the run marked dirty.

    Keyed by the step's idempotency key, which never changes across retries: finding
    it already there means this step's earlier attempt wrote it, and it is reused.
    """
    if action.reversible != "ledger":
        return None
    run_id = getattr(run, "pk", run)
    mark_run_dirty(run_id)
    return _reserve_placeholder(run_id, step, action)


def _reserve_placeholder(run: Any, step: EventRunStep, action: Action) -> int | None:
    if action.reversible != "ledger":
        return None
    return EventRunResource.objects.reserve_placeholder(
        getattr(run, "pk", run),
        step,
        action.owner,
        step.idempotency_key,
        {"action": action.id, "phase": step.phase, "seq": step.seq},
        ordered=not action.independent,
    )


# ── W3 ──

#: How many refusal reasons a step's log entry and warning carry; the rest are counted.
REASONS_SHOWN = 20


@dataclass
class RecordResult:
    recorded: int = 0
    rejected: list[str] = field(default_factory=list)
    #: Every entry of the answer is on the ledger (recorded now, or held already by
    #: this run), so the placeholder could be resolved.
    complete: bool = False
    #: The placeholder was found already given back (the answer came after cleanup).
    late_for_cleanup: bool = False
    #: Rows went in that no placeholder stood for: the run must be marked dirty.
    needs_dirty: bool = False


def record_answer(
    run: Any,
    step: EventRunStep,
    action: Action,
    placeholder_id: int | None,
    resources: Any,
) -> RecordResult:
    """W3: record what a module says it made, and resolve the placeholder. Never raises.

    A step that changed the world has changed it; a ledger that raised here would turn
    bookkeeping into a failed step and then into a retried world write. The cost is one
    transaction with a fixed number of statements whatever the answer's size: one
    multi-row INSERT of confirmed rows that lets the unique key skip what is already
    held, and, only when something was skipped, one SELECT naming the holders.

    The placeholder is resolved only when the whole answer is on the ledger: every
    entry recorded, or held already by this run. A refused entry, a target held by
    another run, a failed write: each keeps it pending, and cleanup then asks the
    module for everything the step's key made, not only the rows recorded here.
    """
    try:
        out = in_transaction(lambda: _record(run, step, action, placeholder_id, resources))
    except Exception as exc:  # bookkeeping must not become the step's control flow
        return _recording_failed(run, step, exc)
    _dirty_after(run, out)
    return out


def _dirty_after(run: Any, out: RecordResult) -> None:
    """Rows recorded where no placeholder stood for them (none, or given back already by
    a cleanup whose claim on the step had gone stale) are new to the run's summary,
    which may say "complete": mark it dirty, after the rows' commit, in a statement of
    its own (inside the transaction it would take the run's row after a shared lock,
    the deadlock ``reserve_step`` avoids). The sweep's repair is the second net (W4)."""
    if not out.needs_dirty:
        return
    try:
        mark_run_dirty(getattr(run, "pk", run))
    except Exception:
        logger.exception("marking run %s dirty failed; the sweep's repair will", run)


def _recording_failed(run: Any, step: EventRunStep, exc: BaseException) -> RecordResult:
    logger.exception("run %s step %s: recording failed", getattr(run, "pk", run), step.pk)
    # Rolled back whole: nothing of the answer is on the ledger, and the placeholder
    # stays pending (rule 1): cleanup gives back everything the step's key made.
    return RecordResult(rejected=[f"recording failed: {type(exc).__name__}: {storable(exc)}"])


@dataclass
class _Answer:
    """An answer's resources as W1 reads them, before anything is written."""

    ledgered: bool
    rows: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)

    def expected(self) -> RecordResult:
        """What ``_write_rows`` answers when every row goes in."""
        if not self.ledgered:
            return RecordResult(complete=True)
        rejected = list(self.rejected)
        return RecordResult(recorded=len(self.rows), rejected=rejected, complete=not rejected)


def _parse(action: Action, resources: Any) -> _Answer:
    if action.reversible not in LEDGERED:
        return _Answer(ledgered=False)
    read = read_resources(resources, action.id)
    return _Answer(ledgered=True, rows=read.rows, rejected=read.rejected)


def _record(
    run: Any,
    step: EventRunStep,
    action: Action,
    placeholder_id: int | None,
    resources: Any,
    resolve: bool = True,
) -> RecordResult:
    """W3's statements, raising on a database error (inside the caller's transaction)."""
    return _write_rows(run, step, action, placeholder_id, _parse(action, resources), resolve)


def _write_rows(
    run: Any,
    step: EventRunStep,
    action: Action,
    placeholder_id: int | None,
    answer: _Answer,
    resolve: bool = True,
) -> RecordResult:
    out = RecordResult(rejected=list(answer.rejected))
    if not answer.ledgered:
        out.complete = True
        return out
    run_id = getattr(run, "pk", run)
    rows = answer.rows
    if out.rejected:
        # One warning per answer, however many entries it refused.
        logger.warning(
            "run %s step %s: %s refused %d reported resource(s), the placeholder stays: %s",
            run_id,
            step.pk,
            action.id,
            len(out.rejected),
            "; ".join(bounded(out.rejected, 3)),
        )
    if rows:
        out.recorded = _insert(run_id, step, action, list(rows.values()))
        # Held by this run (this step's earlier attempt, or another of its steps):
        # already recorded, skipped silently. Held by another run: said, by its id.
        # When every target went in, nobody else holds any: no need to ask.
        if out.recorded < len(rows):
            holders = EventRunResource.objects.holders(action.owner, rows)
            for kind, ref in sorted(rows):
                holder = holders.get((kind, ref))
                if holder is None:
                    # Skipped by the unique key, and its holder let go since: this
                    # run's ledger does not have it.
                    out.rejected.append(f"{kind} {ref!r} was not recorded (its holder let go)")
                elif holder.run_id != run_id:
                    out.rejected.append(f"{kind} {ref!r} is already held by run {holder.run_id}")
    if out.rejected:
        return out
    out.complete = True
    # Resolved even when the module reported nothing: "ok, I made nothing" is an
    # answer, and an open placeholder would call revert() for this step at the end.
    resolved = (
        bool(placeholder_id)
        and resolve
        and EventRunResource.objects.resolve_placeholder(placeholder_id)
    )
    if out.recorded and not resolved:
        out.late_for_cleanup = bool(placeholder_id)
        out.needs_dirty = True
    return out


def _insert(run_id: int, step: EventRunStep, action: Action, rows: list[dict[str, Any]]) -> int:
    # The unique key decides: a target already held (by this step's earlier attempt,
    # or by anyone) is skipped by the database, never checked first.
    return EventRunResource.objects.bulk_record(
        run_id, step, action.owner, rows, ordered=not action.independent
    )


# ── W5, W6 ──


@dataclass
class StepResult:
    """What ``execute_step`` did. ``outcome``: ``done``, ``retry``, ``failed``,
    ``refused``, ``busy`` (another call of the step holds it, or its claim waited on a
    lock another transaction holds until the server gave up), or ``overdue`` (the call
    outlived its deadline and still runs: the step stays claimed until it ends, and its
    answer is recorded then)."""

    outcome: str
    recorded: int = 0
    rejected: list[str] = field(default_factory=list)
    error: str | None = None
    holder_run_id: int | None = None


def execute_step(step_or_id: EventRunStep | int) -> StepResult:
    """W5: run one step, with everything it changes on the ledger first.

    Claims the step (one call of a step in the world at a time, across processes and
    hosts), writes the placeholder, calls ``perform`` under the action's deadline with
    the step's idempotency key, records the answer and settles the step. Nothing but
    ``ok: True`` is success; a lost answer (exception) leaves the placeholder pending
    for cleanup to revert by key.

    A call that outlives its deadline is not given up on: its thread goes on, the
    step's claim is kept fresh while it lives (so a retry answers ``busy`` and cleanup
    waits), and its answer, when it comes, is recorded and the step settled.

    Raises ``InCallersTransaction`` inside a transaction it does not own, before
    anything is claimed: its claim and placeholder must be durable before the call.
    """
    refuse_callers_transaction("execute_step")  # rule 1: its claim commits before the call
    known: EventRunStep | None = None
    if isinstance(step_or_id, EventRunStep):
        if step_or_id.pk is None:
            raise EventRunStep.DoesNotExist("the step has not been saved")
        known, step_id = step_or_id, int(step_or_id.pk)
    else:
        step_id = int(step_or_id)
    with dropping_dead(), statements_retried(), log_context(step_id=step_id):  # #15
        return _claim_and_execute(step_id, known)


@dataclass
class _Begun:
    """A step claimed, checked and (for a ``ledger`` action) reserved: ready to call."""

    token: str
    step: EventRunStep
    run: EventRun
    action: Action
    placeholder_id: int | None
    #: The claim is the late handler's to let go (the call may still run).
    handed_over: bool = False


def _claim_and_execute(step_id: int, known: EventRunStep | None) -> StepResult:
    # Durable moment 1 (rule 1): the claim and the placeholder with its dirty mark (or
    # the verdict of a step that may not run) commit together, before any module call.
    try:
        begun = _begin_fast(step_id, known) if fastpath.enabled() else None
        if begun is None:
            begun = _begin_read_back(step_id)
    except DatabaseError as exc:
        if not is_held(exc):
            raise
        # The server gave up on a wait (a lock another transaction holds on the run's or
        # the step's row, past the lock wait timeout; an operator's KILL QUERY): nothing
        # of the claim committed. Sent again it would wait again (the caller's thread was
        # blocked five waits long, then got the raw error): busy, to be tried later.
        logger.warning("step %s: its claim waited on a lock and was given up", step_id)
        return StepResult("busy", error=f"its claim waited on a lock and was given up: {exc}")
    if isinstance(begun, StepResult):
        return begun
    keeper.hold(begun.token, step_id)
    handed_over = False
    try:
        result, handed_over = _call(begun)
        return result
    finally:
        if not (handed_over or begun.handed_over):
            keeper.release(begun.token)


def _begin_read_back(step_id: int) -> _Begun | StepResult:
    """``_begin`` in its transaction. Its COMMIT's answer may be lost after the server
    committed: what it committed is then read back by the claim's token. A claim that
    stands, with no call made under it, is handed back at once, its attempt not counted
    (the next try reuses its placeholder), instead of holding the step until
    ``STEP_CLAIM_TTL``; an outcome it had written (a step that may not run) is answered."""
    tokens: list[str] = []
    try:
        return in_transaction(lambda: _begin(step_id, tokens))
    except Exception as exc:
        if not tokens or not drop_if_dead(exc):
            raise
        token = tokens[-1]
        with causal_reads():
            status = EventRunStep.objects.status_under(step_id, token)
        if status is None:
            raise  # nothing of it committed: the caller's error to handle
        if status == StepStatus.RUNNING:
            EventRunStep.objects.hand_back(step_id, token)
            return StepResult(
                "retry", error="the answer to its claim was lost; handed back, not performed"
            )
        outcomes: dict[str, str] = {
            StepStatus.FAILED: "failed",
            StepStatus.REFUSED: "refused",
            StepStatus.DONE: "done",
        }
        outcome = outcomes.get(status, "retry")
        return StepResult(outcome, error="its outcome was written; the answer to it was lost")


def _begin(step_id: int, tokens: list[str]) -> _Begun | StepResult:
    step = EventRunStep.objects.with_run(step_id)
    if step is None:
        raise EventRunStep.DoesNotExist(f"there is no step {step_id}")
    run = step.run
    action = registry.action(step.action_id)
    bind(run_id=run.pk, action=step.action_id, owner=action.owner if action else None)  # #15
    # The claim decides on the run as it is now, under its lock: decided on the status
    # read above, a run cancelled and swept in between had its step performed on a
    # torn-down world, given back after the earlier phases (#7 of the host's edge).
    run.status = EventRun.objects.status_locked(run.pk) or run.status
    if (
        action is not None
        and action.reversible in LEDGERED
        and run.cleanup_status in (CleanupStatus.NOT_REQUIRED, CleanupStatus.COMPLETE)
        and run.status not in EventRun.TERMINAL
    ):
        # The run's row first, before the claim: on MariaDB, updating the step's status
        # reads the run's row under a shared lock (the foreign key's index holds the
        # status), and a write to the run after that deadlocks with a host's own UPDATE
        # of the run, such as cancelling it, which would be the one to fail.
        mark_run_dirty(run.pk)
    token = EventRunStep.objects.new_claim_token()
    tokens.append(token)  # for ``_begin_read_back``: the claim may commit unanswered
    if not _claim(step, token):
        return StepResult("busy", error="another call of this step holds its claim")
    step.status, step.claim_token = StepStatus.RUNNING, token  # as the claim just wrote them
    max_attempts = ledger_settings.MAX_STEP_ATTEMPTS
    if step.attempts > max_attempts:
        # Claimed again after attempts whose outcome never got written (a worker died
        # each time): the bound holds all the same.
        error = f"tried {step.attempts - 1} times without a written outcome; not performed again"
        return _settle(step, token, StepResult("failed", error=error))
    if run.status in EventRun.TERMINAL:
        error = f"run {run.pk} is {run.status}; not performed"
        return _settle(step, token, StepResult("failed", error=error))
    if action is None:
        error = f"no module registers the action {step.action_id!r}"
        return _settle(step, token, StepResult("failed", error=error))
    if action.id != LEASE_ACTION_ID and not callable(action.perform):
        error = f"{action.id} declares no perform()"
        return _settle(step, token, StepResult("failed", error=error))
    placeholder_id = (
        None if action.id == LEASE_ACTION_ID else _reserve_placeholder(run, step, action)
    )
    if placeholder_id is None and action.reversible == "ledger":
        # The key's placeholder is held but not live: a sweeper is giving it back by
        # key right now (the run ended as this worker read it). No call under it.
        error = "its placeholder is being given back by a cleanup; not performed"
        return _settle(step, token, StepResult("retry", error=error))
    return _Begun(token, step, run, action, placeholder_id)


def _begin_fast(step_id: int, known: EventRunStep | None) -> _Begun | StepResult | None:
    """``_begin`` for the common case, on the fast path: a ``ledger`` action that may
    run, on a run that has not ended, claimed in one round trip (``fastpath.claim``).
    With the step ``known`` (the caller passed it) that is the step's only trip before
    its call.

    Nothing the caller's instance says is trusted but what never changes (the run, the
    action, the key, phase and seq): whether the step may be claimed, its attempt bound
    and whether its run has ended are decided on the server, and what the call needs is
    read back under the claim. Answers None for ``_begin`` to decide whatever else:
    another case, or a claim this one did not win (nothing of it is written but the
    dirty mark, which ``_begin`` would write the same)."""
    step = known if known is not None else EventRunStep.objects.with_run(step_id)
    if step is None:
        return None  # ``_begin`` says so
    action = registry.action(step.action_id)
    if (
        action is None
        or action.reversible != "ledger"
        or action.id == LEASE_ACTION_ID
        or not callable(action.perform)
    ):
        return None
    max_attempts = ledger_settings.MAX_STEP_ATTEMPTS
    if known is None and (step.run.status in EventRun.TERMINAL or step.attempts >= max_attempts):
        return None  # read just now: no claim to try
    bind(run_id=step.run_id, action=step.action_id, owner=action.owner)  # #15
    won = fastpath.claim(
        step,
        ttl=ledger_settings.STEP_CLAIM_TTL,
        by=process_name(),
        max_attempts=max_attempts,
        owner=action.owner,
        payload={"action": action.id, "phase": step.phase, "seq": step.seq},
        ordered=not action.independent,
    )
    if won is None:
        return None
    step, placeholder_id = won.step, won.placeholder_id
    if placeholder_id is None:
        # Not inserted under the claim: this step's earlier attempt wrote it. The
        # claim is this call's now (committed), so it is read once, as ``_begin`` does.
        placeholder_id = EventRunResource.objects.live_placeholder(
            step.run_id, action.owner, step.idempotency_key
        )
    if placeholder_id is None:
        error = "its placeholder is being given back by a cleanup; not performed"
        return _settle(step, won.token, StepResult("retry", error=error))
    return _Begun(won.token, step, step.run, action, placeholder_id)


def _claim(step: EventRunStep, token: str) -> bool:
    """Claim the step under ``token``, knowing the attempt count the claim wrote without
    reading it back: the claim is a compare-and-set on the count read with the step.
    Another worker may have claimed (and settled) the step between that read and this
    claim; its claim moved the count, so this one loses, reads the count again and
    tries once more.

    A lost claim whose count did not move is a step another call holds: the count only
    grows (every claim adds one, nothing else writes it), so the same count read after
    the claim means no claim came between the first read and the claim, which lost on
    the step's status alone, as the plain claim would have. Answers whether it won.
    """
    seen = step.attempts
    for _ in range(3):
        if EventRunStep.objects.claim(
            step.pk, ledger_settings.STEP_CLAIM_TTL, by=process_name(), attempts=seen, token=token
        ):
            step.attempts = seen + 1
            return True
        try:
            now = EventRunStep.objects.attempts_of(step.pk)
        except EventRunStep.DoesNotExist:
            return False
        if now == seen:
            return False
        seen = now
    return False  # claimed by others three times over meanwhile: busy all the same


def _call(b: _Begun) -> tuple[StepResult, bool]:
    """Call the module; answers the result, and whether the claim was handed to a call
    still running."""
    if b.action.id == LEASE_ACTION_ID:
        return _take_lease(b.run, b.step, b.token)
    perform = b.action.perform
    assert perform is not None
    step, run = b.step, b.run

    def late(call: CallResult) -> None:
        try:
            with statements_retried():
                _finish(b, call, late=True)
        finally:
            keeper.release(b.token)

    try:
        call = call_with_deadline(
            lambda: perform(
                run_id=run.pk, params=step.params, idempotency_key=step.idempotency_key
            ),
            b.action.budget_s,
            b.action.id,
            late=late,
        )
    except BaseException:
        b.handed_over = True  # interrupted while waiting: ``late`` records and lets go
        raise
    if call.timed_out:
        error = (
            f"{call.message}; the call goes on, and the step stays claimed until it ends "
            "(its answer is recorded then)"
        )
        _log_step(step, StepResult("overdue", error=error))
        return StepResult("overdue", error=error), True
    return _finish(b, call), False


def _finish(b: _Begun, call: CallResult, *, late: bool = False) -> StepResult:
    """Durable moment 2: the answer's rows, the placeholder's resolution, the step's
    outcome and its log line commit together. When that transaction fails, nothing of
    the answer is on the ledger, the placeholder stays, and the outcome is written alone.

    A transaction whose COMMIT's answer was lost may have committed: the step says
    (its outcome is written under this claim in the same transaction), and a committed
    answer is never written again: its rows may have been given back since, and
    written twice they would be given back twice."""
    if not late and fastpath.enabled():
        done = _finish_fast(b, call)
        if done is not None:
            return done
    recorded: list[RecordResult] = []
    results: list[StepResult] = []

    def settle() -> StepResult:
        result = _settle_answer(b, call, recorded, late=late)
        results.append(result)
        return result

    try:
        result = in_transaction(settle)
    except Exception as exc:
        if results and drop_if_dead(exc) and _settled_under(b):
            logger.warning("step %s: its outcome had committed, its answer was lost", b.step.pk)
            result = results[-1]
        else:
            failure = _recording_failed(b.run, b.step, exc)

            def unrecorded(*args: Any) -> RecordResult:
                return failure

            return _settle(b.step, b.token, _outcome(b, call, unrecorded), late=late)
    if recorded:
        _dirty_after(b.run, recorded[-1])
    return result


def _settled_under(b: _Begun) -> bool:
    """Whether the step's outcome is written under this call's claim."""
    with causal_reads():
        status = EventRunStep.objects.status_under(b.step, b.token)
    return status is not None and status != StepStatus.RUNNING


def _finish_fast(b: _Begun, call: CallResult) -> StepResult | None:
    """``_finish`` for the common case, on the fast path: a ``ledger`` action answered
    ``ok`` with every entry readable, in one INSERT, written in one round trip
    (``fastpath.finish``). Anything else (the claim taken over, a target held, an
    error) is rolled back whole and answered None: ``_settle_answer`` then does it all
    again and words what happened, as if this had not been tried."""
    if call.error is not None or not is_success(call.value) or b.placeholder_id is None:
        return None
    try:
        answer = _parse(b.action, call.value.get("resources"))
        if not answer.ledgered or answer.rejected:
            return None
        rows = list(answer.rows.values())
        done = fastpath.finish(
            b.step,
            b.token,
            b.run,
            b.action.owner,
            rows,
            b.placeholder_id,
            not b.action.independent,
        )
    except Exception:
        # Neither written nor read back (the server is away): the general path tries,
        # and, failing too, the outcome alone, as it does for its own failures.
        logger.warning("step %s: recording on the fast path failed", b.step.pk, exc_info=True)
        return None
    return StepResult("done", recorded=len(rows)) if done else None


def _settle_answer(
    b: _Begun, call: CallResult, recorded: list[RecordResult], *, late: bool
) -> StepResult:
    """Durable moment 2's statements, inside its transaction."""
    if call.error is not None or not is_success(call.value):
        return _settle(b.step, b.token, _unanswered(b, call), late=late)
    answer = _parse(b.action, call.value.get("resources"))
    # The outcome first, as it reads when every row goes in. Its UPDATE is fenced by the
    # claim and locks the step's row, so it answers whether this call's claim is still
    # the current one, and no newer claim can take the step before the commit. A call
    # whose claim was taken over (its process stalled past the TTL) still has its rows
    # recorded (an answer is never dropped), but must not resolve the placeholder the
    # newer call runs under. Only the INSERT can tell that a row did not go in (its
    # target held by another run): the error text is then corrected under the lock.
    expected = _done(answer.expected())
    written = _write_outcome(b.step, b.token, expected)
    if not written and _settled_under(b):
        # This call's outcome is on the step already: an earlier transaction of it
        # committed and its answer was lost. Its rows are written (and may have been
        # given back since): writing them again would give them back twice.
        logger.warning("step %s: its answer was recorded already; not again", b.step.pk)
        return expected
    out = _write_rows(b.run, b.step, b.action, b.placeholder_id, answer, resolve=written)
    recorded.append(out)
    if out.late_for_cleanup:
        # Its placeholder was given back by key before this answer came: what it made
        # is recorded (and goes back in the next pass), but possibly after an earlier
        # phase went (C8 broken after the fact). Said on the run, and signalled.
        EventRunLog.objects.write(
            b.run.pk,
            "step.late_after_cleanup",
            storable_json(
                {
                    "step": b.step.pk,
                    "action": b.action.id,
                    "phase": b.step.phase,
                    "recorded": out.recorded,
                }
            ),
        )
        signals.answered_after_cleanup(b.step, out.recorded)
    result = _done(out)
    status, _, error = _verdict(b.step, result)
    expected_status, _, expected_error = _verdict(b.step, expected)
    if written and (status, error) != (expected_status, expected_error):
        EventRunStep.objects.reword(b.step, b.token, status, error)
    return _logged(b.step, result, written, late=late)


def _outcome(b: _Begun, call: CallResult, record: Callable[..., RecordResult]) -> StepResult:
    if call.error is not None or not is_success(call.value):
        return _unanswered(b, call)
    return _done(record(b.run, b.step, b.action, b.placeholder_id, call.value.get("resources")))


def _unanswered(b: _Begun, call: CallResult) -> StepResult:
    return _failure(classify_perform(call, b.action.id))


def _done(recorded: RecordResult) -> StepResult:
    result = StepResult("done", recorded.recorded, recorded.rejected)
    if not recorded.complete:
        result.error = (
            "the answer is not wholly on the ledger, so the step's placeholder stays and "
            "cleanup gives back everything its key made: "
            + "; ".join(bounded(recorded.rejected, 3))
        )
    return result


def _failure(verdict: Verdict) -> StepResult:
    """A perform or apply that did not succeed, as the step's result."""
    return StepResult("failed" if verdict.outcome == "terminal" else "retry", error=verdict.error)


def _settle(
    step: EventRunStep, token: str, result: StepResult, *, late: bool = False
) -> StepResult:
    written = _write_outcome(step, token, result)
    return _logged(step, result, written, late=late)


def _verdict(step: EventRunStep, result: StepResult) -> tuple[str, str, str | None]:
    """The step's status, the outcome and the error text a result is written as."""
    outcome = result.outcome
    status = {
        "done": StepStatus.DONE,
        "refused": StepStatus.REFUSED,
        "failed": StepStatus.FAILED,
    }.get(outcome, StepStatus.PENDING)
    if outcome == "retry" and step.attempts >= ledger_settings.MAX_STEP_ATTEMPTS:
        status, outcome = StepStatus.FAILED, "failed"
    error = result.error
    if error is None and result.rejected:
        error = "; ".join(bounded(result.rejected, REASONS_SHOWN))
    return status, outcome, error


def _write_outcome(step: EventRunStep, token: str, result: StepResult) -> bool:
    """The step's outcome under the caller's claim; answers whether the claim held."""
    status, result.outcome, error = _verdict(step, result)
    try:
        written = EventRunStep.objects.settle(step, token, status, error)
    except Exception as exc:
        if connections[ledger_db()].in_atomic_block:
            raise  # the transaction's owner writes the outcome alone (see _finish)
        # The outcome must land, or the step stays `running` and the attempt bound is
        # reached only through stale claims: write it again without the module's text,
        # on a new connection if this one died (fenced by the claim: an UPDATE whose
        # answer was lost after it committed matches nothing the second time).
        drop_if_dead(exc)
        logger.exception("step %s: writing its outcome failed; writing it plainly", step.pk)
        written = EventRunStep.objects.settle(
            step, token, status, f"{result.outcome} (the error text could not be stored)"
        )
    if written and status == StepStatus.FAILED:
        signals.step_failed_for_good(step, error)  # #15: sent at the outcome's commit
    return written


def _logged(
    step: EventRunStep, result: StepResult, written: bool, *, late: bool = False
) -> StepResult:
    if not written:
        logger.warning(
            "step %s: a newer claim took it over; outcome %s not written", step.pk, result.outcome
        )
    if result.outcome == "done" and not result.rejected and not late:
        # A clean success is on the step row itself; the run's log keeps what an
        # operator must read (retries, failures, refusals, dropped resources).
        return result
    _log_step(step, result, late=late)
    return result


def _log_step(step: EventRunStep, result: StepResult, *, late: bool = False) -> None:
    try:
        EventRunLog.objects.write(
            step.run_id,
            f"step.late.{result.outcome}" if late else f"step.{result.outcome}",
            storable_json(
                {
                    "step": step.pk,
                    "action": step.action_id,
                    "attempt": step.attempts,
                    "recorded": result.recorded,
                    "rejected": bounded(result.rejected, REASONS_SHOWN),
                    "error": result.error,
                }
            ),
        )
    except Exception:  # the step's outcome is written; its log line must not undo that
        if connections[ledger_db()].in_atomic_block:
            raise  # a swallowed error would leave the transaction broken, not committed
        logger.exception("step %s: writing its log entry failed", step.pk)


def _take_lease(run: EventRun, step: EventRunStep, token: str) -> tuple[StepResult, bool]:
    result = _lease(run, step, token)
    if result.outcome == "overdue":
        _log_step(step, result)
        return result, True
    return _settle(step, token, result), False


def _lease(run: EventRun, step: EventRunStep, token: str) -> StepResult:
    """W6: reserve, then read, then write. The override row is reserved BEFORE anything
    else, so a second run asking for a held target is refused and the world is neither
    read nor written; the baseline is read under that reservation (read before it, it
    could be another run's value that is about to be restored) and is on the row before
    the value is applied."""
    params = step.params if isinstance(step.params, dict) else {}
    ref = as_text(params.get("lease"))
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
    budget = lease.budget_s
    value = params.get("value")

    held = (
        EventRunResource.objects.filter(
            run=run, step=step, kind="override", ref=ref, status__in=LIVE
        )
        .values_list("pk", "status", "payload")
        .first()
    )
    if held is None:
        answer = EventRunResource.objects.reserve(
            run,
            step,
            owner=lease.owner,
            kind="override",
            ref=ref,
            # No baseline yet: a row without one was never applied (see cleanup).
            payload={"applied": value},
            lease_until=lease_until,
            ordered=not lease.independent,
        )
        if not answer.ok:
            holder = answer.holder
            who = f"run {holder.run_id}" if holder else "another run"
            return StepResult(
                "refused",
                error=f"{ref} is held by {who}",
                holder_run_id=holder.run_id if holder else None,
            )
        assert answer.id is not None
        row_id, row_status, payload = answer.id, ResourceStatus.PENDING, {"applied": value}
        mark_run_dirty(run)
    else:
        row_id, row_status, payload = held
        payload = payload if isinstance(payload, dict) else {}
    if row_status == ResourceStatus.CONFIRMED:
        return StepResult("done", recorded=0)
    if "baseline" not in payload:
        read = call_with_deadline(lambda: read_value(target=target), budget, f"{lease.id}.read")
        if read.timed_out or read.error is not None:
            return StepResult("retry", error=read.message)
        try:
            check_json(read.value)
        except (TypeError, ValueError) as exc:
            return StepResult(
                "failed", error=f"{lease.id}.read answered a value that is not JSON ({exc})"
            )
        if not EventRunResource.objects.set_payload(
            row_id, {**payload, "baseline": read.value}, only_status=ResourceStatus.PENDING
        ):
            return StepResult("retry", error=f"the reservation of {ref} was released meanwhile")
    # else: this step's earlier attempt read it; a fresh read now could see the value
    # this run applied.

    def applied_outcome(call: CallResult) -> StepResult:
        if call.error is not None or not is_success(call.value):
            return _failure(classify_perform(call, f"{lease.id}.apply"))
        if not EventRunResource.objects.confirm(row_id):
            # A cleanup took the reservation while the apply ran (this process stalled
            # past the claim TTL): the value is applied, and no live row stands for it.
            return StepResult(
                "failed",
                error=f"{ref} was applied after its reservation was given back; "
                "the applied value may need a human",
            )
        return StepResult("done", recorded=1)

    def late(call: CallResult) -> None:
        try:
            with statements_retried():
                _settle(step, token, applied_outcome(call), late=True)
        finally:
            keeper.release(token)

    applied = call_with_deadline(
        lambda: apply_value(value, target=target, run_id=run.pk),
        budget,
        f"{lease.id}.apply",
        late=late,
    )
    if applied.timed_out:
        # An apply may still land: the step stays claimed (no second apply beside it,
        # no restore before it) until the call ends.
        return StepResult(
            "overdue",
            error=f"{applied.message}; the call goes on, and the step stays claimed until it ends",
        )
    return applied_outcome(applied)
