"""The undo half: give back what terminal runs took, and reconcile with a restarted world."""

from __future__ import annotations

import atexit
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from django.db import DatabaseError, connections, transaction

from . import signals
from .background import keeper
from .conf import ledger_settings
from .db import (
    CHUNK,
    InCallersTransaction,
    bounded,
    drop_if_dead,
    dropping_dead,
    in_transaction,
    is_deadlock,
    is_held,
    ledger_db,
    refuse_callers_transaction,
    retrying_deadlocks,
    statements_retried,
    storable,
    storable_json,
)
from .db import retries as db_retries
from .deadline import CallResult, Calls, call_all, call_with_deadline
from .envelopes import Verdict, classify_revert, read_reconcile
from .logcontext import log_context
from .models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from .querysets import GroupClaim, new_token
from .registry import Action
from .registry import default_registry as registry
from .runner import finish_left_runs
from .states import RELEASED_UNCLEAN, CleanupStatus, ResourceStatus

logger = logging.getLogger("events_ledger")

Res = EventRunResource.objects
T = TypeVar("T")

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
    "write_verdicts_in_hand",
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
    #: The step that made these rows is in flight (a call of it may still change the
    #: world): who holds it and since when. Cleanup waits for it.
    waiting_for: dict[str, Any] | None = None
    #: C8: a later phase of the run still holds rows (``behind``): its name, rank, how
    #: many rows, a few of them, and whether their attempts are spent (stuck until a
    #: human retries). This group is given back only after that phase.
    behind: dict[str, Any] | None = None

    @property
    def run_id(self) -> int:
        return self.rows[0].run_id

    @property
    def rank(self) -> int | None:
        """C8: the rank of the phase that made these rows; None: they stand alone."""
        return self.rows[0].phase_rank

    @property
    def by_key(self) -> bool:
        """The step's placeholder is unresolved, so its answer may not be wholly on the
        ledger: the module is asked for everything the key made (``resources=[]``)."""
        return self.lease_ref is None and any(r.kind == STEP_KIND for r in self.rows)

    @property
    def what(self) -> str:
        return self.lease_ref or self.action_id or "unknown"

    @property
    def call(self) -> str:
        if self.waiting_for:
            w = self.waiting_for
            name = f"#{w['seq']}" if w.get("seq") is not None else str(w["step"])
            return (
                f"waits for step {name} ({w['action']}) in flight on "
                f"{w['claimed_by'] or 'an unknown host'} since {w['claimed_at']}"
            )
        if self.lease_ref:
            call = f"restore {self.lease_ref}"
        else:
            refs = [] if self.by_key else [f"{r.kind}:{r.ref}" for r in self.rows]
            call = f"{self.action_id}.revert(key={self.idempotency_key}, resources={refs})"
        if self.behind:
            b = self.behind
            spent = ", their attempts spent" if b["stuck"] else ""
            call += (
                f", after phase {b['phase']!r} is given back "
                f"({b['rows']} row(s) of it unresolved{spent})"
            )
        return call

    def describe(self, limit: int | None = None) -> dict[str, Any]:
        refs = [f"{r.kind}:{r.ref}" for r in self.rows]
        return {
            "call": "restore" if self.lease_ref else "revert",
            "what": self.what,
            "idempotency_key": self.idempotency_key,
            "by_key": self.by_key,
            "resources": refs if limit is None else bounded(refs, limit),
            "problem": self.problem,
            "waiting_for": self.waiting_for,
            "behind": self.behind,
        }


def group_rows(
    rows: Iterable[EventRunResource],
    step_ttl: Any = None,
    steps: dict[Any, tuple[Any, ...]] | None = None,
) -> list[Group]:
    """C2/C3: a lease row is its own group; other rows are grouped by the step that
    made them, which names the action and the idempotency key. A row whose step is
    gone names its action through its own payload (a placeholder always does). With
    ``step_ttl``, a group whose step is in flight says so (``waiting_for``). ``steps``:
    the steps as ``for_giving_back`` answers them, when the caller read them already."""
    rows = list(rows)
    if steps is None:
        # The steps' action and key, once per step rather than once per row.
        step_ids = {r.step_id for r in rows if r.step_id is not None}
        steps = EventRunStep.objects.for_giving_back(step_ids, step_ttl)
    leases: list[Group] = []
    by_step: dict[Any, Group] = {}
    for row in rows:
        step = steps.get(row.step_id) if row.step_id is not None else None
        if row.kind == "override":
            lease = Group(rows=[row], lease_ref=row.ref)
            lease.waiting_for = _waiting_for(row.step_id, step)
            leases.append(lease)
            continue
        key = ("step", row.step_id) if row.step_id is not None else ("row", row.pk)
        group: Group | None = by_step.get(key)
        if group is None:
            payload = row.payload if isinstance(row.payload, dict) else {}
            action_id = step[0] if step else payload.get("action")
            idem = step[1] if step else (row.ref if row.kind == STEP_KIND else None)
            group = by_step[key] = Group(rows=[], action_id=action_id, idempotency_key=idem)
            group.waiting_for = _waiting_for(row.step_id, step)
            if not action_id:
                group.problem = "nothing records which action created this resource"
        group.rows.append(row)
    return leases + list(by_step.values())


def _waiting_for(step_id: Any, step: tuple[Any, ...] | None) -> dict[str, Any] | None:
    if step is None or len(step) < 5 or not step[4]:
        return None
    claimed_at = step[3]
    return {
        "step": step_id,
        # #25: the step as the run page names it (its place in the run, not its id).
        "seq": step[5] if len(step) > 5 else None,
        "action": step[0],
        "claimed_by": step[2],
        "claimed_at": claimed_at.isoformat() if claimed_at else None,
    }


def _groups_for(runs: Sequence[EventRun], human: bool) -> list[Group]:
    """The groups a pass gives back, for every run of its batch: one read of the rows
    and their steps (and, C8, one of the names of the phases earlier ones wait
    behind), then at most ``CLEANUP_GROUPS_PER_RUN`` groups per run that may go now,
    the last phase first, and those that wait behind a later phase after them."""
    max_attempts = ledger_settings.MAX_REVERT_ATTEMPTS
    max_claims = ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT
    step_ttl = ledger_settings.STEP_CLAIM_TTL
    rows, steps = Res.unresolved_rows_of(runs, step_ttl)

    retryable = rows if human else [r for r in rows if not r.is_spent(max_attempts, max_claims)]
    groups = group_rows(retryable, step_ttl, steps)
    if ledger_settings.GIVE_BACK_IN_ORDER:
        _mark_behind(groups, rows, lambda row: row.is_spent(max_attempts, max_claims))
    cap = ledger_settings.CLEANUP_GROUPS_PER_RUN
    taken: dict[int, int] = {}
    out = []
    # The last phase first; rows standing alone with them.
    for group in sorted(groups, key=lambda g: (g.behind is not None, -(g.rank or 0))):
        n = taken.get(group.run_id, 0)
        if n < cap:
            taken[group.run_id] = n + 1
            out.append(group)
    return out


#: How many of the rows an earlier phase waits behind are named.
BEHIND_NAMED = 5


def _mark_behind(
    groups: list[Group],
    rows: list[EventRunResource],
    spent: Callable[[EventRunResource], bool],
) -> None:
    """C8: mark each group that a later phase of its run still holds (``behind``): the
    run's last phase with an unresolved row, whose rows go first. The claim decides
    again in its own statement; this is what the pass and the console say."""
    # Per run: the highest rank of its unresolved rows, and those rows.
    rank: dict[int, int] = {}
    last: dict[int, list[EventRunResource]] = {}
    for row in rows:
        if row.phase_rank is None:
            continue  # standing alone: holds nothing
        top = rank.get(row.run_id)
        if top is None or row.phase_rank > top:
            rank[row.run_id], last[row.run_id] = row.phase_rank, [row]
        elif row.phase_rank == top:
            last[row.run_id].append(row)
    held = [g for g in groups if g.rank is not None and g.rank < rank[g.run_id]]
    if not held:
        return
    step_ids = {r.step_id for g in held for r in last[g.run_id] if r.step_id is not None}
    phases = dict(EventRunStep.objects.filter(pk__in=step_ids).values_list("pk", "phase"))
    for group in held:
        top_rows = last[group.run_id]
        names = [phases.get(r.step_id) for r in top_rows]
        group.behind = {
            "phase": next((n for n in names if n), None) or f"#{rank[group.run_id]}",
            "rank": rank[group.run_id],
            "rows": len(top_rows),
            "resources": [f"{r.kind}:{r.ref}" for r in top_rows[:BEHIND_NAMED]],
            "stuck": all(spent(r) for r in top_rows),
        }


def plan_run(run: EventRun | int, reset_attempts: bool = False) -> list[Group]:
    """What a cleanup of this run would ask for, without writing anything (dry run)."""
    return _groups_for([_run(run)], human=reset_attempts)


# ── calling the module (C1–C3) ──


def _give_back(group: Group, rows: list[EventRunResource], token: str | None = None) -> Verdict:
    if group.problem:
        return Verdict("terminal", group.problem)
    if group.lease_ref:
        return _restore_lease(rows[0], group, token)
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
    # While the step's placeholder is unresolved its answer may be on the ledger in
    # part only (a refused entry, a failed write, a crash between chunks): the list
    # would then be a subset, and a module that gives back what it is given would leave
    # the rest in the world. The contract's empty list means "everything this key made".
    resources = (
        []
        if group.by_key
        else [
            {"kind": r.kind, "ref": r.ref, "payload": r.payload, "member_key": r.member_key}
            for r in rows
        ]
    )
    return _overdue_or(
        group,
        rows,
        token,
        lambda late: call_with_deadline(
            lambda: revert(
                run_id=rows[0].run_id, resources=resources, idempotency_key=group.idempotency_key
            ),
            action.budget_s,
            f"{action.id}.revert",
            late=late,
        ),
        action.id,
    )


def _overdue_or(
    group: Group,
    rows: list[EventRunResource],
    token: str | None,
    call: Callable[[Callable[[CallResult], None] | None], CallResult],
    what: str,
) -> Verdict:
    """Make the call; one that outlives its budget is ``overdue``: it still runs and may
    still give the rows back, so they are neither failed nor handed back (another pass
    would ask again while it runs). The keeper keeps their claim fresh, held from before
    the call, so a late answer that comes at once cannot let go of it first; the answer
    is written when it comes (``_late_verdict``)."""
    if token is None:
        return classify_revert(call(None), what)
    keeper.hold_revert(token)
    result = call(partial(_late_verdict, group, rows, token, what))
    if result.timed_out:
        return Verdict("overdue", f"{result.message}; it still runs and keeps its rows")
    keeper.release_revert(token)
    return classify_revert(result, what)


def _late_verdict(
    group: Group, rows: list[EventRunResource], token: str, what: str, result: CallResult
) -> None:
    """The answer of an overdue call, in its own thread when it ends: kept in hand like a
    pass's verdicts and written by the keeper, under the claim's token."""
    try:
        lane = _Lane(group, rows, classify_revert(result, what), late=True)
        run_id = group.run_id
        _backlog.keep(
            _InHand({run_id: CleanupSummary(run_id=run_id)}, [lane], token, False, None, [])
        )
    finally:
        keeper.release_revert(token)
    keeper.wake()


def _restore_lease(row: EventRunResource, group: Group, token: str | None) -> Verdict:
    payload = row.payload if isinstance(row.payload, dict) else {}
    if "baseline" not in payload:
        # Reserved, but its baseline was never read onto it, so nothing was applied
        # (a lease applies only after its baseline is on the row): nothing to put back.
        return Verdict("done")
    found = registry.lease_for_ref(row.ref)
    if found is None:
        # Not retryable (nothing changes until an operator reinstalls the module), and
        # not an orphan either: nobody knows whether the value is still applied.
        return Verdict("terminal", f"no module registers the lease {row.ref!r}")
    lease = found.lease
    restore = lease.restore
    if not callable(restore):
        return Verdict("terminal", f"the lease {lease.id} declares no restore()")
    return _overdue_or(
        group,
        [row],
        token,
        lambda late: call_with_deadline(
            lambda: restore(
                payload.get("baseline"),
                expected=payload.get("applied"),
                run_id=row.run_id,
                target=found.target,
            ),
            lease.budget_s,
            f"{lease.id}.restore",
            late=late,
        ),
        row.ref,
    )


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
    #: Rows whose call outlived its budget and still runs: written when it answers.
    overdue: int = 0
    cleanup_status: str = ""
    reset: int | None = None
    errors: list[str] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)
    #: Steps in flight this cleanup waited for (their rows were left for a later pass).
    waiting: list[dict[str, Any]] = field(default_factory=list)
    #: C8: the later phase whose rows earlier phases still wait behind, once the
    #: cleanup ended (``Group.behind``); empty when nothing waits.
    behind: list[dict[str, Any]] = field(default_factory=list)
    #: C8: how many rounds it took, one per phase given back after a later one.
    rounds: int = 0

    def add_round(self, later: CleanupSummary) -> None:
        """Fold in what a later round of the same cleanup did (C8)."""
        for name in ("attempted", "reverted", "drifted", "failed", "fenced", "overdue"):
            setattr(self, name, getattr(self, name) + getattr(later, name))
        self.remaining, self.cleanup_status = later.remaining, later.cleanup_status
        self.errors += later.errors
        self.groups += later.groups
        self.waiting, self.behind = later.waiting, later.behind
        self.rounds += later.rounds

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(run: EventRun | int) -> EventRun:
    # A terminal status is final, so an instance that says so can be trusted; any other
    # may predate the run's last transition and is read afresh.
    if isinstance(run, EventRun) and run.status in EventRun.TERMINAL:
        return run
    return EventRun.objects.get(pk=getattr(run, "pk", run))


class _LogBuffer:
    """The log entries of one pass that do not ride with its verdicts (a collision is
    written when it is found): written with the verdicts' INSERT, or on their own when
    the pass fails half-way, so no state change goes unlogged."""

    def __init__(self) -> None:
        self.entries: list[EventRunLog] = []

    def add(self, run_id: int, kind: str, detail: dict[str, Any]) -> None:
        self.entries.append(EventRunLog(run_id=run_id, kind=kind, detail=storable_json(detail)))

    def flush(self) -> None:
        if self.entries:
            EventRunLog.objects.bulk_create(self.entries)
            self.entries = []


def cleanup_run(
    run: EventRun | int, reset_attempts: bool = False, actor: str | None = None
) -> CleanupSummary:
    """C4: work one terminal run's ledger once.

    ``reset_attempts`` is the human's flag (never the sweep's): it zeroes the
    counters first and logs who did it. Each group's rows are claimed (R5), given
    back by one call, and their verdict written by the claim's holder only.
    ``cleanup_status`` is then derived from the rows left, in the statement that
    writes it. A pass of the sweep does the same for its whole batch at once.
    """
    # Its claims and the human's reset must be durable before a module is called.
    refuse_callers_transaction("cleanup_run")
    # The run's read too: a lost answer there left the caller's thread failing "gone
    # away" on every later statement (the fault suite's human retry, #26).
    with dropping_dead():
        run = _run(run)
        if run.status not in EventRun.TERMINAL:
            raise RunNotTerminal(f"run {run.pk} is {run.status}: only a finished run is cleaned up")
        with statements_retried(), log_context(run_id=run.pk):  # #15
            reset = None
            if reset_attempts:
                reset = retrying_deadlocks(lambda: _reset_attempts(run, actor))
            return _work_runs([run], human=reset_attempts, actor=actor, reset=reset)[0]


def _reset_attempts(run: EventRun, actor: str | None) -> int:
    """The human's licence and its record land together: a pass killed after the reset
    cannot lose who reset how many rows. The run's row is written first, as a sweep's
    settling and a step's claim take it (run, then its rows): taken the other way round,
    a retry pressed while a sweep settled the run deadlocked and failed (MariaDB 1213,
    found by the in-flight state machine). Redone whole when picked as the victim."""
    with transaction.atomic(using=ledger_db()):
        EventRun.objects.set_cleanup_status(run, CleanupStatus.PENDING)
        reset = Res.reset_attempts(run)
        EventRunLog.objects.write(run, "cleanup.retry", {"resources": reset, "by": actor})
    return reset


@dataclass
class _Lane:
    """One claimed group on its way through a pass: the rows one call gives back, and
    the verdict that call came back with (None: never called, the pass was stopped)."""

    group: Group
    rows: list[EventRunResource]
    verdict: Verdict | None = None
    #: Claimed too often without a verdict: failed without a call.
    poisoned: bool = False
    #: The answer of a call that outlived its budget, written after its pass.
    late: bool = False


def _work_runs(
    runs: Sequence[EventRun],
    *,
    human: bool = False,
    actor: str | None = None,
    reset: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[CleanupSummary]:
    """C4 over a batch of runs, round after round (C8): each round gives back what may
    go now, the last phase of each run with an unresolved row; a run whose earlier
    phases waited behind it and whose round gave something back goes round again. A
    round's statements do not grow with the number of runs or groups, so a cleanup
    costs a constant number of statements per phase."""
    summaries: dict[int, CleanupSummary] = {}
    todo = list(runs)
    while todo:
        done = _work_round(todo, human=human, actor=actor, reset=reset, should_stop=should_stop)
        for summary in done:
            if summary.run_id in summaries:
                summaries[summary.run_id].add_round(summary)
            else:
                summaries[summary.run_id] = summary
        for summary in done:
            if summary.cleanup_status == CleanupStatus.INCOMPLETE:
                # Read before this round's verdicts: a phase whose last attempts this
                # round spent holds the earlier ones now for good.
                for behind in summary.behind:
                    behind["stuck"] = True
        # What waited behind a phase this round gave back may go now; a phase that gave
        # nothing back (failed, drifted, its rows claimed elsewhere) still holds.
        again = {s.run_id for s in done if s.behind and s.reverted}
        todo = [run for run in todo if run.pk in again]
        if should_stop is not None and should_stop():
            break
        reset = None  # the human's reset is logged once, by the first round
    return [summaries[run.pk] for run in runs]


def _work_round(
    runs: Sequence[EventRun],
    *,
    human: bool,
    actor: str | None,
    reset: int | None,
    should_stop: Callable[[], bool] | None,
) -> list[CleanupSummary]:
    """One round of C4 over a batch of runs, in a number of statements that does not
    grow with the number of runs or groups: one read of the rows with their steps, one
    claim transaction, the module calls in parallel
    (``CLEANUP_CONCURRENCY`` at a time, each under its own deadline, none inside a
    transaction), then one transaction that writes every verdict (a statement per kind
    of verdict, fenced by the claim's token) and one that settles every summary and
    inserts every log entry."""
    summaries = {run.pk: CleanupSummary(run_id=run.pk, reset=reset, rounds=1) for run in runs}
    log = _LogBuffer()
    claimable: list[Group] = []
    for group in _groups_for(runs, human):
        if group.waiting_for:
            # A call of the step may still make something: give nothing of it back yet,
            # or the give-back by key runs before the object exists. The run stays
            # pending and a later pass comes back.
            summaries[group.run_id].waiting.append(group.waiting_for)
        elif group.behind:
            # C8: a later phase of the run still holds rows; this group goes after it.
            behind = summaries[group.run_id].behind
            if group.behind not in behind:
                behind.append(group.behind)
        else:
            claimable.append(group)
    # The claim's token is known before the claim is sent: a claim whose answer was lost
    # after it committed is then this process's to hand back at its next pass, instead
    # of holding its rows for REVERT_CLAIM_TTL and counting toward the poison limit.
    token: str | None = new_token() if claimable else None
    if token is None:  # nothing to claim: the summaries are settled all the same
        settled = _write_in_hand(_InHand(summaries, [], None, human, actor, log.entries))
        signals.cleanup_done(runs, settled, [])
        return [settled[run.pk] for run in runs]
    calls: Calls | None = None
    # The keeper keeps the claim fresh from before it is sent until its verdicts are
    # written or kept: a pass may take longer than REVERT_CLAIM_TTL, and a healthy
    # sweeper must not take its rows for a dead one's while their calls still run.
    keeper.hold_revert(token)
    try:
        try:
            lanes = _claim(claimable, summaries, log, token)
            called = [lane for lane in lanes if not lane.poisoned]
            calls = Calls(
                [partial(_given_back, lane.group, lane.rows, token) for lane in called],
                ledger_settings.CLEANUP_CONCURRENCY,
                should_stop=should_stop,
            )
            for lane, verdict in zip(called, calls.wait(), strict=True):
                lane.verdict = verdict
        except BaseException as exc:
            if calls is not None:
                # The host interrupted the pass while its calls ran (a task's soft time
                # limit, an alarm, a signal): none starts any more, the running ones go
                # on under their claim, and their verdicts are written when they end.
                # Handed back or failed now, their rows would be asked again while the
                # first call is still inside the module.
                calls.stop()
                _backlog.keep(
                    _InHand(summaries, lanes, token, human, actor, log.entries, calls, called)
                )
                calls.when_done(keeper.wake)
                exc.add_note(INTERRUPTED)
                raise
            # No module was called: the next pass of this process hands the claim back,
            # not counted toward the poison limit.
            _unfinished.add(token, called=False)
            try:
                log.flush()
            except DatabaseError as db_exc:
                drop_if_dead(db_exc)
            raise
        # From here the module's answers are in hand: written, whatever it takes, never
        # handed back (a handed-back claim makes the next pass call the module again).
        settled = _write_in_hand(_InHand(summaries, lanes, token, human, actor, log.entries))
    finally:
        keeper.release_revert(token)
    # ── #15: the signals of what the verdict transaction committed ──
    signals.cleanup_done(runs, settled, lanes)
    return [settled[run.pk] for run in runs]


#: Noted on the host's exception when it interrupted a pass whose calls still run.
INTERRUPTED = (
    "events-ledger: the pass was interrupted while module calls ran; they go on, and "
    "their verdicts are written when they end"
)


class VerdictsInHand(Exception):
    """A pass's verdicts could not be written yet (the rows are locked past every retry,
    the database is away): they stay in this process's hands, their claims kept fresh,
    and its next pass writes them before anything else."""


@dataclass(eq=False)
class _InHand:
    """A pass's verdicts on their way to the ledger, with what they settle and log."""

    summaries: dict[int, CleanupSummary]
    lanes: list[_Lane]
    token: str | None
    human: bool
    actor: str | None
    log: list[EventRunLog]
    #: The calls of a pass interrupted while they ran, and their lanes: the verdicts are
    #: theirs once every started call has ended (a call never started answers None).
    calls: Calls | None = None
    called: list[_Lane] = field(default_factory=list)

    def ready(self) -> bool:
        if self.calls is None:
            return True
        if not self.calls.done.is_set():
            return False
        for lane, verdict in zip(self.called, self.calls.answers, strict=True):
            lane.verdict = verdict
        self.calls = None
        return True


class _Backlog:
    """Verdicts this process holds and has not written yet, for as long as it lives: the
    write failed (the rows locked past every retry, the database away), or the pass was
    interrupted while its calls ran, or a call answered after its budget. The keeper
    (``background``) keeps their claims fresh, so no other sweeper takes them for a dead
    process's and asks the module again, and writes them at its beats, as does this
    process's next sweep. Only a dead process's claims wait for the TTL."""

    def __init__(self) -> None:
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        # A forked child holds no module answers of its parent's (the parent writes
        # them); a lock held at the fork would stay held for ever.
        self._lock = threading.Lock()
        self._hands: list[_InHand] = []

    def keep(self, hand: _InHand) -> None:
        with self._lock:
            self._hands.append(hand)
        if hand.token is not None:
            keeper.hold_revert(hand.token)

    def take(self) -> list[_InHand]:
        """The hands ready to be written (each let go by ``written`` after its write)."""
        with self._lock:
            ready = [hand for hand in self._hands if hand.ready()]
            self._hands = [hand for hand in self._hands if all(hand is not r for r in ready)]
        return ready

    def written(self, hand: _InHand) -> None:
        if hand.token is not None:
            keeper.release_revert(hand.token)

    def pending(self) -> list[Calls]:
        with self._lock:
            return [hand.calls for hand in self._hands if hand.calls is not None]

    def __len__(self) -> int:
        with self._lock:
            return len(self._hands)

    def drop_all(self) -> None:
        """Forget every verdict in hand and every claim kept (a test's teardown)."""
        with self._lock:
            self._hands = []
        keeper.forget_all()


_backlog = _Backlog()


def _write_ready_in_hand() -> None:
    """The keeper's chore: write what is ready, in the keeper's thread."""
    if len(_backlog):
        write_verdicts_in_hand()


keeper.chores.append(_write_ready_in_hand)

#: How often one pass tries to write its verdicts before keeping them for later (each
#: try its own transaction; a conflict or a lock wait waits a little longer), and for
#: how long at most: the pass, and a request that worked one run, must not hang on it.
VERDICT_WRITE_TRIES = 8
VERDICT_WRITE_BUDGET_S = 10.0


def _write_in_hand(hand: _InHand) -> dict[int, CleanupSummary]:
    """Write a pass's verdicts, then settle its runs' summaries. A write that cannot be
    made now keeps the verdicts in this process (``_backlog``, which keeps their claims
    fresh), and raises ``VerdictsInHand``."""
    token = hand.token
    try:
        worked, entries = _persistently(
            lambda: _write_verdicts(hand.summaries, hand.lanes, token),
            atomic=not _one_verdict_statement(hand.lanes),
        )
    except Exception as exc:
        logger.warning(
            "the verdicts of %d group(s) could not be written yet; kept for the next pass",
            len(hand.lanes),
            exc_info=True,
        )
        _backlog.keep(hand)
        raise VerdictsInHand(f"{type(exc).__name__}: {exc}") from exc
    except BaseException:
        # Interrupted while writing (a soft time limit, an alarm, Ctrl-C): the answers
        # stay in hand, fenced by their claim, for the keeper or the next pass to write.
        _backlog.keep(hand)
        raise
    log = [*hand.log, *entries]
    try:
        return _reconnecting(lambda: _settle_and_log(worked, log, hand.human, hand.actor))
    except BaseException:
        # The verdicts are written; the summaries are the sweep's repair's to derive.
        # What the pass did is logged all the same.
        try:
            EventRunLog.objects.bulk_create(_unsaved(log))
        except DatabaseError as exc:
            drop_if_dead(exc)
        raise


def _unsaved(entries: list[EventRunLog]) -> list[EventRunLog]:
    """Log entries as new rows: an INSERT whose COMMIT's answer was lost gave them their
    ids, and inserting those again failed on the primary key (the caller was told
    ``reverted 0`` and no signal was sent, though every verdict was written)."""
    return [
        EventRunLog(run_id=e.run_id, kind=e.kind, detail=e.detail, created_at=e.created_at)
        for e in entries
    ]


def write_verdicts_in_hand() -> int:
    """Write what earlier passes of this process could not: answers how many passes'
    verdicts are still in hand after trying (0: all written)."""
    for hand in _backlog.take():
        try:
            settled = _write_in_hand(hand)
        except VerdictsInHand:
            continue  # kept again
        except Exception:
            logger.exception("settling the summaries of verdicts written late failed")
            continue
        finally:
            _backlog.written(hand)
        signals.cleanup_done(
            list(EventRun.objects.filter(pk__in=list(settled))), settled, hand.lanes
        )
        logger.info("wrote the verdicts of %d group(s) an earlier pass held", len(hand.lanes))
    return len(_backlog)


def _write_in_hand_at_exit() -> None:
    """A process that ends on its own (a task worker's ``max_tasks_per_child``, a web
    worker's ``max_requests``, ``sys.exit``) writes the modules' answers it still holds
    first, within the verdicts' budget: gone with it, their rows would wait out
    ``REVERT_CLAIM_TTL`` and be given back a second time. A SIGKILL still loses them to
    the TTL; a process's own SIGTERM handler should end it through ``sys.exit``."""
    if not len(_backlog):
        return
    # Calls a stopped pass left running are awaited a little: their answers are in
    # the world already, or about to be.
    waited_until = time.monotonic() + VERDICT_WRITE_BUDGET_S
    for calls in _backlog.pending():
        calls.done.wait(max(0.0, waited_until - time.monotonic()))
    try:
        held = write_verdicts_in_hand()
    except Exception:
        logger.exception("writing the verdicts in hand at exit failed")
        return
    if held:
        logger.error("%d pass(es)' verdicts in hand could not be written before exit", held)


atexit.register(_write_in_hand_at_exit)


def _one_verdict_statement(lanes: list[_Lane]) -> bool:
    """Whether a pass's verdicts are one statement: every group given back whole (one
    ``UPDATE`` of their rows to ``reverted``, fenced by the token), in one chunk."""
    rows = 0
    for lane in lanes:
        verdict = lane.verdict
        if verdict is None or lane.poisoned or verdict.outcome != "done" or verdict.failed:
            return False
        rows += len(lane.rows)
    return 0 < rows <= CHUNK


def _persistently(fn: Callable[[], T], *, atomic: bool = True) -> T:
    """Run ``fn`` as one transaction until it commits, within ``VERDICT_WRITE_TRIES``: a
    conflict (a deadlock, a lock wait timeout, Galera's certification) waits with
    exponential backoff and jitter, so sweepers that collided do not collide again in
    step; a lost connection is replaced; at most ``VERDICT_WRITE_BUDGET_S`` of tries. ``fn`` must be fenced (a verdict is written
    under its claim's token), so a COMMIT whose answer was lost is safe to run again:
    the second finds its verdicts written and reads them back (``verdicts_written``).
    ``atomic=False`` says ``fn`` writes in one statement, atomic by itself: it is sent
    without a transaction around it (#27: three round trips fewer on MariaDB)."""
    if connections[ledger_db()].in_atomic_block:
        # Inside a caller's transaction a conflict rolled the caller's work back too: it
        # is the caller's to retry (SPEC: deadlocks), not this loop's.
        return in_transaction(fn, tries=1)
    started = time.monotonic()
    for attempt in range(VERDICT_WRITE_TRIES):
        try:
            return in_transaction(fn, tries=1) if atomic else fn()
        except DatabaseError as exc:
            spent = time.monotonic() - started > VERDICT_WRITE_BUDGET_S
            last = attempt == VERDICT_WRITE_TRIES - 1 or spent
            # A dead connection is dropped first, on the last try too (left open, the
            # thread's next statement failed "gone away"). A lock wait that timed out is
            # retried here too, after a pause and within the budget: a verdict in hand
            # must be written (it is fenced by its claim).
            dropped = drop_if_dead(exc)
            if last or not (is_deadlock(exc) or is_held(exc) or dropped):
                raise
            db_retries["verdicts"] += 1
            time.sleep(min(2.0, 0.01 * 2**attempt) * random.uniform(0.5, 1.5))
    raise AssertionError("unreachable")


def _reconnecting(fn: Callable[[], T]) -> T:
    """Run ``fn`` as one transaction, once more on a new connection if the server
    dropped this one. The verdicts are in hand and fenced by the claim's token, so
    writing them again is safe; otherwise the module's answers would be lost and every
    call of the pass made again after the TTL. (Had the first COMMIT landed and only
    its answer been lost, the second finds the verdicts written and logs them twice.)"""
    try:
        return in_transaction(fn)
    except DatabaseError as exc:
        if not drop_if_dead(exc):
            raise
        logger.warning("the connection was lost before the summaries were written; once more")
        return in_transaction(fn)


POISONED = (
    "claimed {max_claims} times without a verdict: giving it back kills or hangs the "
    "sweeper, so it was left for a human"
)


def _claim(
    groups: list[Group], summaries: dict[int, CleanupSummary], log: _LogBuffer, token: str | None
) -> list[_Lane]:
    """Claim every group's rows in one transaction, under the caller's ``token``; answers
    the lanes to call. Rows claimed this often with no verdict (their revert kills or
    hangs every sweeper that tries it) are failed for good instead of looping for ever."""
    if not groups or token is None:
        return []
    rows = [row for group in groups for row in group.rows]
    released = any(r.status in RELEASED_UNCLEAN for r in rows)

    def claim_them() -> GroupClaim:
        return Res.claim_group(
            rows,
            ledger_settings.REVERT_CLAIM_TTL,
            token=token,
            released=released,
            step_ttl=ledger_settings.STEP_CLAIM_TTL,
            ordered=ledger_settings.GIVE_BACK_IN_ORDER,
        )

    # The common claim is one UPDATE, atomic by itself, and a read of what it won by
    # its token: a transaction around them added three round trips on MariaDB (two on
    # PostgreSQL) and made nothing more certain (#27). Claims of released rows (a
    # savepoint per collision) and claims of several chunks stay one transaction.
    one_statement = not released and len(rows) <= CHUNK
    claim = claim_them() if one_statement else in_transaction(claim_them)
    run_of = {row.pk: row.run_id for row in rows}
    for pk in claim.collided:
        holder = Res.note_collision(pk)
        summaries[run_of[pk]].failed += 1
        log.add(
            run_of[pk],
            "cleanup.collision",
            {"resource": pk, "held_by_run": holder.run_id if holder else None},
        )
    won = {row.pk for row in claim.rows}
    max_claims = ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT
    poison = Verdict("terminal", POISONED.format(max_claims=max_claims))
    lanes = []
    for group in groups:
        mine = [row for row in group.rows if row.pk in won]
        poisoned = [row for row in mine if row.claim_count >= max_claims]
        if poisoned:
            lanes.append(_Lane(group, poisoned, poison, poisoned=True))
        rest = [row for row in mine if row.claim_count < max_claims]
        if rest:
            lanes.append(_Lane(group, rest))
    return lanes


def _given_back(group: Group, rows: list[EventRunResource], token: str | None = None) -> Verdict:
    # One lane's failure is its verdict, never the pass's: the other lanes' calls have
    # been made, and their answers must be written.
    step_id = rows[0].step_id if group.lease_ref is None else None
    with log_context(  # #15: log context
        run_id=group.run_id, step_id=step_id, action=group.what, owner=rows[0].owner_module
    ):
        try:
            return _give_back(group, rows, token)
        except Exception as exc:
            logger.exception("giving back %s failed", group.what)
            return Verdict("retry", storable(f"giving back failed: {type(exc).__name__}: {exc}"))


@dataclass
class _Writes:
    """Every verdict of a pass as a few statements: one per kind of verdict."""

    reverted: list[int] = field(default_factory=list)
    #: (error, restore_to, spend_all, spent_claims) → rows.
    failed: dict[tuple[str | None, str, bool, bool], list[int]] = field(default_factory=dict)
    unstarted: list[int] = field(default_factory=list)

    def fail(
        self,
        pks: list[int],
        error: str | None,
        restore_to: str = ResourceStatus.CONFIRMED,
        *,
        spend_all: bool = False,
        spent_claims: bool = False,
    ) -> None:
        if pks:
            self.failed.setdefault((error, restore_to, spend_all, spent_claims), []).extend(pks)

    def run(self, token: str) -> set[int] | None:
        """Write them; answers the rows whose verdict was written, or None for all."""
        asked = len(self.reverted) + sum(map(len, self.failed.values()))
        written = Res.mark_reverted(self.reverted, token=token) if self.reverted else 0
        for (error, restore_to, spend_all, spent_claims), pks in self.failed.items():
            written += Res.fail_revert(
                pks,
                error,
                restore_to,
                token=token,
                spend_to=ledger_settings.MAX_REVERT_ATTEMPTS if spend_all else None,
                spent_claims=spent_claims,
            )
        if self.unstarted:
            Res.unclaim(self.unstarted, token)
        if written == asked:
            return None
        by_status: dict[str, list[int]] = {ResourceStatus.REVERTED: list(self.reverted)}
        for (_, restore_to, _, _), pks in self.failed.items():
            by_status.setdefault(restore_to, []).extend(pks)
        return Res.verdicts_written(by_status, token)


def _split(lane: _Lane) -> tuple[list[int], list[int], str | None]:
    """A ``done`` verdict over a lane's rows: the rows given back, the rows the module
    said it could not give back, and that error."""
    group, rows, verdict = lane.group, lane.rows, lane.verdict
    assert verdict is not None
    failed_refs = set(verdict.failed)
    bad = [r.pk for r in rows if r.ref in failed_refs]
    error = f"{group.what} answered ok but could not give this back"
    unknown = sorted(failed_refs - {r.ref for r in rows})
    if group.by_key and unknown:
        # Asked by key, the module names things the ledger never recorded: the
        # placeholder is all that stands for them, so it keeps the failure (rule 2).
        bad += [r.pk for r in rows if r.kind == STEP_KIND and r.pk not in bad]
        error = f"{group.what} answered ok but could not give back {bounded(unknown, 5)}"
    return [r.pk for r in rows if r.pk not in bad], bad, error


def _write_verdicts(
    base: dict[int, CleanupSummary], lanes: list[_Lane], token: str | None
) -> tuple[dict[int, CleanupSummary], list[EventRunLog]]:
    """The pass's second durable moment, one transaction: every verdict written under
    the claim's token, a statement per kind of verdict. Answers the summaries so far and
    the log entries that say what was written; builds them afresh, since a deadlock runs
    it again from the start."""
    summaries = {
        pk: replace(s, errors=list(s.errors), groups=list(s.groups), waiting=list(s.waiting))
        for pk, s in base.items()
    }
    writes = _Writes()
    splits: dict[int, tuple[list[int], list[int], str | None]] = {}
    for i, lane in enumerate(lanes):
        ids = [r.pk for r in lane.rows]
        verdict = lane.verdict
        if verdict is None:
            writes.unstarted += ids
        elif verdict.outcome == "overdue":
            pass  # still running under its claim: its answer is written when it comes
        elif lane.poisoned:
            writes.fail(ids, verdict.error, spent_claims=True)
        elif verdict.outcome == "done":
            splits[i] = good, bad, bad_error = _split(lane)
            writes.reverted += good
            writes.fail(bad, bad_error)
        elif verdict.outcome == "drifted":
            writes.fail(ids, verdict.error, ResourceStatus.DRIFTED)
        else:
            writes.fail(ids, verdict.error, spend_all=verdict.outcome == "terminal")
    written = writes.run(token) if token is not None else None
    log: list[EventRunLog] = []

    def add(run_id: int, kind: str, detail: dict[str, Any]) -> None:
        log.append(EventRunLog(run_id=run_id, kind=kind, detail=storable_json(detail)))

    for i, lane in enumerate(lanes):
        verdict = lane.verdict
        if verdict is None:
            continue
        summary = summaries[lane.group.run_id]
        ids = [r.pk for r in lane.rows]
        if verdict.outcome == "overdue":
            summary.overdue += len(ids)
            add(summary.run_id, *_verdict_entry(lane))
            continue
        done = ids if written is None else [pk for pk in ids if pk in written]
        summary.attempted += len(ids)
        if i in splits:
            given = set(splits[i][0])
            summary.reverted += sum(1 for pk in done if pk in given)
            summary.failed += sum(1 for pk in done if pk not in given)
        elif verdict.outcome == "drifted":
            summary.drifted += len(done)
        else:
            summary.failed += len(done)
            if verdict.error and not lane.poisoned:
                summary.errors.append(verdict.error)
        if len(done) < len(ids):
            summary.fenced += len(ids) - len(done)
            add(
                summary.run_id,
                "cleanup.fenced",
                {
                    "what": lane.group.what,
                    "resources": len(ids) - len(done),
                    "reason": "another sweeper took the claim over; this verdict was not written",
                    "verdict": verdict.outcome,
                },
            )
        add(summary.run_id, *_verdict_entry(lane))
        if not lane.poisoned:
            summary.groups.append(
                {
                    **lane.group.describe(limit=50),
                    "outcome": verdict.outcome,
                    "error": verdict.error,
                }
            )
    return summaries, log


def _settle_and_log(
    summaries: dict[int, CleanupSummary],
    entries: list[EventRunLog],
    human: bool,
    actor: str | None,
) -> dict[int, CleanupSummary]:
    """One transaction: the runs locked (so each summary derived here sees every
    verdict committed before it, not the rows as they were when a statement that waited
    for the lock began), every summary settled from its rows, every log entry of the
    pass inserted."""
    EventRun.objects.lock(summaries)
    settled = EventRun.objects.settle_cleanups(
        summaries,
        ledger_settings.MAX_REVERT_ATTEMPTS,
        ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT,
        ledger_settings.GIVE_BACK_IN_ORDER,
    )
    # A run missing here was removed by a prune since the pass read it: a prune takes
    # only a run that owes nothing, so there is nothing of it to settle, and a log entry
    # for it would fail on its foreign key (the pass failed with KeyError, was worked
    # again run by run, and paged a human: "a prune beside a sweep", #11 of the host's edge).
    log = _unsaved([entry for entry in entries if entry.run_id in settled])

    def add(run_id: int, kind: str, detail: dict[str, Any]) -> None:
        log.append(EventRunLog(run_id=run_id, kind=kind, detail=storable_json(detail)))

    for summary in summaries.values():
        if summary.run_id not in settled:
            summary.cleanup_status, summary.remaining = CleanupStatus.COMPLETE, 0
            continue
        summary.cleanup_status, summary.remaining = settled[summary.run_id]
        if summary.attempted or (human and summary.reset is not None):
            add(
                summary.run_id,
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
    if log:
        EventRunLog.objects.bulk_create(log)
    return summaries


def _verdict_entry(lane: _Lane) -> tuple[str, dict[str, Any]]:
    group, rows, verdict = lane.group, lane.rows, lane.verdict
    assert verdict is not None
    kind = {
        "done": "cleanup.reverted",
        "drifted": "cleanup.drifted",
        "overdue": "cleanup.overdue",
    }.get(verdict.outcome, "cleanup.failed")
    detail: dict[str, Any] = {
        "what": group.what,
        "outcome": verdict.outcome,
        "resources": bounded([f"{r.kind}:{r.ref}" for r in rows]),
    }
    if group.by_key:
        detail["by_key"] = group.idempotency_key
    if verdict.error:
        detail["error"] = verdict.error
    if verdict.failed:
        detail["failed"] = bounded(verdict.failed)
    if lane.late:
        detail["late"] = True  # the answer of a call that had outlived its budget
    return kind, detail


class _UnfinishedClaims:
    """Claims this process took whose verdict was never written: the database went away
    between the claim and the verdict. Their rows would wait out ``REVERT_CLAIM_TTL``;
    the next pass of this process hands them back at once instead (only while the claim
    is still its own), so a sweeper that survives a database restart finishes within a
    pass or two after it. A claim of a process that died still waits for the TTL."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: token -> whether a module was called under it (its claim then counts).
        self._tokens: dict[str, bool] = {}

    def add(self, token: str, *, called: bool = True) -> None:
        with self._lock:
            self._tokens[token] = self._tokens.get(token, False) or called

    def hand_back(self) -> int:
        with self._lock:
            tokens = dict(self._tokens)
        if not tokens:
            return 0
        called = sorted(t for t, c in tokens.items() if c)
        uncalled = sorted(t for t, c in tokens.items() if not c)
        # A claim no module was called under did not count toward the poison limit.
        handed = (Res.expire_claims(called) if called else 0) + (
            Res.expire_claims(uncalled, uncount=True) if uncalled else 0
        )
        with self._lock:
            for token in tokens:
                self._tokens.pop(token, None)
        return handed

    def reset_after_fork(self) -> None:
        # A lock held by another thread at the fork would never be let go in the child.
        self._lock = threading.Lock()
        self._tokens = {}


_unfinished = _UnfinishedClaims()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unfinished.reset_after_fork)
    os.register_at_fork(after_in_child=_backlog.reset_after_fork)


# ── C5 ──


class _RepairPace:
    """When a pass of this process repairs summaries (SPEC: summaries race too). The
    repair reads every terminal run that owes something, so under a backlog of ten
    thousand runs it cost a pass as much as the work (#26, #27). A pass repairs when
    this process has not yet for the scope, when its last scan for the scope came back
    with room (no backlog: the read is small, and a quiet sweeper repairs every pass,
    as before), and otherwise at least every ``CLEANUP_REPAIR_EVERY``. A summary a
    crash left stale waits that long at most under a backlog; no row waits on it but
    one recorded after its run's cleanup ended, which only the repair finds."""

    def __init__(self) -> None:
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        #: scope → (when it last repaired, whether its last scan came back full).
        self._seen: dict[str | None, tuple[float, bool]] = {}

    def due(self, scope: str | None) -> bool:
        with self._lock:
            seen = self._seen.get(scope)
        if seen is None or not seen[1]:
            return True
        every = ledger_settings.CLEANUP_REPAIR_EVERY.total_seconds()
        return time.monotonic() - seen[0] >= every

    def repaired(self, scope: str | None) -> None:
        with self._lock:
            self._seen[scope] = (time.monotonic(), self._seen.get(scope, (0.0, False))[1])

    def scanned(self, scope: str | None, full: bool) -> None:
        with self._lock:
            # Never repaired yet (a failed repair): due at once while the scan has room.
            self._seen[scope] = (self._seen.get(scope, (float("-inf"), False))[0], full)


_repair_pace = _RepairPace()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_repair_pace.reset_after_fork)


@dataclass
class SweepReport:
    runs: list[CleanupSummary] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    #: Runs whose summary the repair re-derived, with the summary each has now.
    repaired_runs: list[tuple[int, str]] = field(default_factory=list)
    #: The repair itself failed (logged; the pass went on without it).
    repair_error: str | None = None
    #: The pass did not repair: this process has a backlog and repaired within
    #: ``CLEANUP_REPAIR_EVERY`` (see ``_RepairPace``).
    repair_skipped: bool = False
    #: Passes' verdicts this process still holds after this pass (0: all written): a
    #: sweeper that stops now leaves their claims to the TTL.
    in_hand: int = 0
    #: Runs ``run_steps`` had left running behind a step in flight, ended by this pass
    #: once every step settled: (run, the status it ended with).
    finished_runs: list[tuple[int, str]] = field(default_factory=list)

    @property
    def repaired(self) -> int:
        return len(self.repaired_runs)

    @property
    def incomplete(self) -> list[int]:
        """Runs this pass left ``incomplete``, by any path (a cleanup or the repair)."""
        ids = {s.run_id for s in self.runs if s.cleanup_status == CleanupStatus.INCOMPLETE}
        ids |= {pk for pk, status in self.repaired_runs if status == CleanupStatus.INCOMPLETE}
        return sorted(ids)


def sweep(
    limit: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    *,
    scope: str | None = None,
) -> SweepReport:
    """C5, the cron's leg: terminal runs only (a run in flight still grows its
    ledger), at most ``CLEANUP_RUN_BATCH`` of them; one run's failure is logged and
    does not stop the others. Summaries that disagree with their rows are repaired.

    With ``scope``, only runs of that scope are repaired, scanned and worked: a cron
    per team, or the benchmark, which must never touch a run it did not make. (What a
    pass of this process left claimed when it was interrupted is handed back first,
    whatever its scope: those claims are this process's own.)

    Every statement either is retried where no transaction is open (a deadlock) or
    costs the one run it was for; only a failed scan, when nothing can be worked at
    all, raises.
    """
    refuse_callers_transaction("sweep")
    with dropping_dead(), statements_retried():
        report = _sweep(scope, limit, should_stop)
    report.in_hand = len(_backlog)
    return report


def scan(limit: int | None = None, *, scope: str | None = None) -> list[EventRun]:
    """The runs a sweep pass takes, in the order it takes them (C5): terminal runs that
    owe something, those with something to give back now first, none another sweeper is
    working. One scan for the pass and for ``cleanup_runs --dry-run``, so the dry run
    lists the batch the pass would take (it scanned without the pass's bounds, and
    listed another)."""
    batch = limit or ledger_settings.CLEANUP_RUN_BATCH
    return retrying_deadlocks(
        lambda: EventRun.objects.needing_cleanup(
            batch,
            ledger_settings.MAX_REVERT_ATTEMPTS,
            ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT,
            step_ttl=ledger_settings.STEP_CLAIM_TTL,
            ordered=ledger_settings.GIVE_BACK_IN_ORDER,
            scope=scope,
            claim_ttl=ledger_settings.REVERT_CLAIM_TTL,
        )
    )


def _sweep(
    scope: str | None, limit: int | None, should_stop: Callable[[], bool] | None
) -> SweepReport:
    report = SweepReport()
    candidates = EventRun.objects.all()
    max_attempts = ledger_settings.MAX_REVERT_ATTEMPTS
    max_claims = ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT
    _finish_earlier_passes()
    if _repair_pace.due(scope):
        # At the repair's pace too (a read per pass where nothing is owed): the runs
        # ``run_steps`` left running behind a late step, ended once it settled.
        try:
            report.finished_runs = finish_left_runs(scope)
        except DatabaseError as exc:
            logger.exception("ending the runs left running failed; the pass goes on")
            drop_if_dead(exc)
        try:
            report.repaired_runs = candidates.repair_cleanup_summaries(
                max_attempts, max_claims, ledger_settings.GIVE_BACK_IN_ORDER, scope=scope
            )
            _repair_pace.repaired(scope)
            signals.summaries_repaired(report.repaired_runs)  # #15: after the repair's commit
        except DatabaseError as exc:
            logger.exception("repairing cleanup summaries failed; the pass goes on without it")
            report.repair_error = f"{type(exc).__name__}: {exc}"
            drop_if_dead(exc)
    else:
        report.repair_skipped = True
    batch = limit or ledger_settings.CLEANUP_RUN_BATCH
    runs = scan(batch, scope=scope)
    _repair_pace.scanned(scope, full=len(runs) >= batch)
    runs = [run for run in runs if run.status in EventRun.TERMINAL]
    if not runs or (should_stop is not None and should_stop()):
        return report
    try:
        report.runs = _work_runs(runs, should_stop=should_stop)
    except VerdictsInHand as exc:
        # The module's answers are in hand, and their claims this process's: the next
        # pass writes them. Worked one by one now, the runs would find them claimed.
        for run in runs:
            report.errors[run.pk] = _error_text(exc)
        return report
    except Exception as exc:
        if INTERRUPTED in getattr(exc, "__notes__", ()):
            raise  # the host's, not one run's failure: the pass ends here
        logger.exception("the pass over runs %s failed", [run.pk for run in runs])
        if isinstance(exc, DatabaseError) and drop_if_dead(exc):
            # The server went away ("gone away", a lost or killed connection): the
            # next pass gets a new connection. A verdict whose answer was lost is
            # fenced by its claim, so the rows are simply reclaimed.
            for run in runs:
                report.errors[run.pk] = _error_text(exc)
            return report
        # One run's failure must not cost the others (C5): the batch's claims are
        # handed back, and its runs are worked one by one.
        _hand_back_unfinished()
        _one_by_one(runs, report, should_stop)
    return report


def _one_by_one(
    runs: list[EventRun], report: SweepReport, should_stop: Callable[[], bool] | None
) -> None:
    for run in runs:
        if should_stop is not None and should_stop():
            break  # asked to stop: the runs not begun wait for the next pass
        try:
            report.runs.append(cleanup_run(run))
        except Exception as exc:
            logger.exception("cleanup of run %s failed", run.pk, extra={"run_id": run.pk})  # #15
            report.errors[run.pk] = _error_text(exc)
            if isinstance(exc, DatabaseError) and drop_if_dead(exc):
                continue
            try:
                EventRunLog.objects.write(run, "cleanup.error", {"error": report.errors[run.pk]})
            except DatabaseError as log_exc:
                drop_if_dead(log_exc)


def _error_text(exc: BaseException) -> str:
    return storable(f"{type(exc).__name__}: {exc}")


def _finish_earlier_passes() -> None:
    """What earlier passes of this process left: verdicts in hand are written first, then
    claims that never reached a module are handed back. Not inside a caller's
    transaction: written there, they would be lost with it if it rolled back."""
    if connections[ledger_db()].in_atomic_block:
        return
    try:
        held = write_verdicts_in_hand()
        if held:
            logger.warning("the verdicts of %d earlier pass(es) are still in hand", held)
    except Exception:
        logger.exception("writing the verdicts of earlier passes failed")
    _hand_back_unfinished()


def _hand_back_unfinished() -> None:
    try:
        handed = _unfinished.hand_back()
        if handed:
            logger.warning("handed back %d claim(s) a failed pass had left behind", handed)
    except DatabaseError as exc:
        logger.warning("could not hand back the claims of a failed pass yet", exc_info=True)
        drop_if_dead(exc)


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
    #: Reconcile calls that failed (raised, timed out, answered no envelope), and a
    #: failure of the reconcile itself: each makes ``reconcile_resources`` exit 1.
    errors: list[str] = field(default_factory=list)

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
    refuse_callers_transaction("reconcile_module")
    with dropping_dead(), statements_retried(), log_context(owner=owner):  # #15
        return _reconcile(owner, force, max_fraction)


def _reconcile(owner: str, force: bool, max_fraction: float | None) -> ReconcileSummary:
    summary = ReconcileSummary(owner=owner)
    rows = [r for r in Res.live_for_module(owner) if r.kind != STEP_KIND]
    missing: list[tuple[EventRunResource, str]] = []
    asking: list[tuple[Group, Action]] = []
    for group in group_rows(rows):
        action = None if group.lease_ref else registry.action(group.action_id)
        if action is None or not callable(action.reconcile):
            # A lease is restored, never reconciled; no reconcile is "I don't know".
            summary.unanswered += len(group.rows)
        else:
            asking.append((group, action))
    # The module's calls in parallel, each under its own deadline (CLEANUP_CONCURRENCY).
    calls = call_all(
        [partial(_ask_reconcile, group, action) for group, action in asking],
        ledger_settings.CLEANUP_CONCURRENCY,
    )
    for (group, action), call in zip(asking, calls, strict=True):
        assert call is not None
        answer = read_reconcile(call, f"{action.id}.reconcile")
        if answer.in_force is None:
            summary.unanswered += len(group.rows)
            error = storable(answer.error or "")
            summary.errors.append(error)
            context = {
                "run_id": group.run_id,
                "step_id": group.rows[0].step_id,
                "action": action.id,
            }
            logger.warning("reconcile of %s unanswered: %s", action.id, error, extra=context)  # #15
            continue
        summary.asked += len(group.rows)
        for row in group.rows:
            if row.ref in answer.in_force:
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
        orphaned = _persistently(partial(_orphan, owner, missing))
        summary.orphaned = len(orphaned)
        signals.orphaned(owner, [row for row, _ in missing if row.pk in orphaned])  # #15
    return summary


def _orphan(owner: str, missing: list[tuple[EventRunResource, str]]) -> set[int]:
    """C6's one transaction: the rows no longer in force orphaned and each run's log entry
    saying so, committed together (a state change is never without its entry, C7).
    Answers the rows it moved. Fenced (only live rows move, R10), so a COMMIT whose
    answer was lost is run again safely: the second finds them orphaned and reads
    them back (their log entry may then be written twice)."""
    pks = [r.pk for r, _ in missing]
    moved = Res.mark_orphaned(
        pks, "the module reports this is no longer in force", ttl=ledger_settings.REVERT_CLAIM_TTL
    )
    # A row claimed by a sweeper since it was read is left alone (R10): only the rows
    # in ``orphaned`` now are logged as orphaned.
    orphaned = (
        set(Res.filter(pk__in=pks, status=ResourceStatus.ORPHANED).values_list("pk", flat=True))
        if moved < len(missing)
        else set(pks)
    )
    by_run: dict[int, list[str]] = {}
    for row, _action_id in missing:
        if row.pk in orphaned:
            by_run.setdefault(row.run_id, []).append(f"{row.kind}:{row.ref}")
    EventRunLog.objects.bulk_create(
        [
            EventRunLog(
                run_id=run_id,
                kind="resource.orphaned",
                detail={"module": owner, "resources": bounded(refs, 200)},
            )
            for run_id, refs in by_run.items()
        ]
    )
    return orphaned


def _ask_reconcile(group: Group, action: Action) -> CallResult:
    assert action.reconcile is not None
    resources = [{"kind": r.kind, "ref": r.ref, "payload": r.payload} for r in group.rows]
    return call_with_deadline(
        partial(action.reconcile, run_id=group.rows[0].run_id, resources=resources),
        action.budget_s,
        f"{action.id}.reconcile",
    )


def reconcile_all(
    *, force: bool = False, owners: Sequence[str] | None = None
) -> dict[str, ReconcileSummary]:
    """Ask every module that owns a live row (or those of ``owners``); a module whose
    reconcile fails is a summary with the error, and the others are still asked."""
    out: dict[str, ReconcileSummary] = {}
    for owner in Res.modules_with_live_rows() if owners is None else owners:
        try:
            out[owner] = reconcile_module(owner, force=force)
        except InCallersTransaction:
            raise  # the caller's transaction, not the module: nothing was asked
        except Exception as exc:
            logger.exception("reconcile of %s failed", owner)
            error = storable(f"{type(exc).__name__}: {exc}")
            out[owner] = ReconcileSummary(owner=owner, reason=error, errors=[error])
    return out


def reconcile(owner: str, *, force: bool = False) -> ReconcileSummary:
    """What a host app calls when it sees its world restart."""
    return reconcile_module(owner, force=force)
