"""The ledger's SQL: every change of state is one conditional UPDATE or one INSERT.

Nothing here reads a row and then writes it: the database decides who wins, and each
method answers whether its caller did. Querysets import nothing of the app but its
vocabulary of states and database helpers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, connections, models
from django.db.models import (
    BooleanField,
    Case,
    Count,
    Exists,
    ExpressionWrapper,
    F,
    Max,
    OuterRef,
    Q,
    Value,
    When,
)
from django.db.models.expressions import DatabaseDefault, RawSQL
from django.db.models.functions import Greatest
from django.utils import timezone

from .db import (
    LedgerManager,
    Prepared,
    Statement,
    UtcNow,
    chunked,
    is_unique_violation,
    retrying_deadlocks,
    storable,
)
from .states import (
    HELD,
    LIVE,
    RELEASED_UNCLEAN,
    RESOLVABLE,
    RUN_TERMINAL,
    STEP_KIND,
    UNRESOLVED,
    CleanupStatus,
    ResourceStatus,
    RunStatus,
    StepStatus,
    check_run_move,
)

if TYPE_CHECKING:
    from .models import EventRun, EventRunLog, EventRunResource

ERROR_LIMIT = 500
#: A stamp older than any TTL: a claim stamped with it is stale at once.
LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)
DEFAULT_REVERT_ERROR = "the revert did not succeed and gave no reason"
#: The resource index whose ranges hold only unresolved and live rows (see models.py).
STATUS_INDEX = "evres_status_owner_idx"
_UNSET: Any = object()


def _pk(obj: Any) -> Any:
    return getattr(obj, "pk", obj)


def _manager(model: Any, relation: str) -> Any:
    """The default manager of the model at the other end of ``relation``. A queryset
    reaches its siblings through the schema, never by importing ``models`` (which
    imports this module for its managers)."""
    return model._meta.get_field(relation).related_model._default_manager


def _pks(objs: Any) -> list[Any]:
    if isinstance(objs, (str, bytes)) or not isinstance(objs, Iterable):
        objs = [objs]
    return sorted({_pk(o) for o in objs})


def known_rank(step: Any) -> int | None:
    """C8: the step's phase rank when its instance was read with it (a rank never
    changes once the step exists), without reading it now; else None."""
    rank = getattr(step, "__dict__", {}).get("phase_rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def new_token() -> str:
    return uuid.uuid4().hex


def cut_error(error: object, default: str = DEFAULT_REVERT_ERROR) -> str:
    text = "" if error is None else storable(error)
    return (text or default)[:ERROR_LIMIT]


def _runs_of(rows: models.QuerySet) -> Any:
    """The ids of the runs of ``rows`` (filtered on an unresolved ``status``), as a
    subquery read through the row status index: released rows are outside its range,
    so this costs what is unresolved, not the history.

    SQLite, once ANALYZE has seen a history of released rows, judges that index
    unselective and reads a whole index instead (190 ms a pass at 1,000,000 rows,
    against 0.6 ms), so there it is told which index to use. So is MariaDB: with
    statistics a moment old (its background recalculation after a large delete) it
    took a semi-join reading the whole run index of the rows (LooseScan) instead."""
    run_ids = rows.order_by().values("run_id")
    conn = connections[rows.db]
    if conn.vendor not in ("sqlite", "mysql"):
        return run_ids
    sql, params = run_ids.query.sql_with_params()
    table = conn.ops.quote_name(rows.model._meta.db_table)
    index = conn.ops.quote_name(STATUS_INDEX)
    hint = f"INDEXED BY {index}" if conn.vendor == "sqlite" else f"FORCE INDEX ({index})"
    hinted = sql.replace(f"FROM {table}", f"FROM {table} {hint}", 1)
    assert hinted != sql, sql
    return RawSQL(hinted, params)


# ── runs ──────────────────────────────────────────────────────────────────────


def _set_cleanup_status(
    base: Any, only_from: tuple[str, ...] | None, *, run: int, status: str
) -> tuple[Any, dict[str, Any]]:
    qs = base.filter(pk=run).exclude(cleanup_status=status)
    if only_from is not None:
        qs = qs.filter(cleanup_status__in=list(only_from))
    return qs, {"cleanup_status": status, "updated_at": UtcNow()}


_SET_CLEANUP_STATUS = Prepared(_set_cleanup_status, run=int, status=str)
_LIVE_RUN = Prepared(
    lambda base, *, run: (
        base.filter(pk=run).exclude(status__in=RUN_TERMINAL).order_by().values_list("pk")
    ),
    run=int,
)
_MARK_DIRTY_IF_LIVE = Prepared(
    lambda base, *, run: (
        base.filter(
            pk=run, cleanup_status__in=[CleanupStatus.NOT_REQUIRED, CleanupStatus.COMPLETE]
        ).exclude(status__in=RUN_TERMINAL),
        {"cleanup_status": CleanupStatus.PENDING, "updated_at": UtcNow()},
    ),
    run=int,
)


def _settle_runs(
    base: Any, max_attempts: int, max_claims: int, ordered: bool, *, runs: list[int]
) -> tuple[Any, dict[str, Any]]:
    derived = base._derived_cleanup_status(max_attempts, max_claims, ordered)
    return base.filter(pk__in=runs), {"cleanup_status": derived, "updated_at": UtcNow()}


# A pass's settling, compiled once per batch size: the derived summary is the largest
# expression the pass builds (#27: a pass's Python, not its statements, was its cost).
_SETTLE_RUNS = Prepared(_settle_runs, runs=list)
_SUMMARIES = Prepared(
    lambda base, *, runs: (
        base.filter(pk__in=runs)
        .with_unresolved_count()
        .values_list("pk", "cleanup_status", "unresolved_count")
    ),
    runs=list,
)


def _disagreeing(base: Any, max_attempts: int, max_claims: int, ordered: bool, **scope: str) -> Any:
    """Terminal runs whose summary their rows contradict (``pending``/``incomplete``
    the derived summary disagrees with), and those whose rows were recorded after
    their cleanup ended (``complete``/``not_required`` over unresolved rows): one
    statement, a round trip on every pass (#27)."""
    derived = base._derived_cleanup_status(max_attempts, max_claims, ordered)
    contradicted = (
        base.terminal()
        .filter(cleanup_status__in=(CleanupStatus.PENDING, CleanupStatus.INCOMPLETE), **scope)
        .alias(derived=derived)
        .exclude(cleanup_status=F("derived"))
        .values_list("pk")
    )
    unresolved = _manager(base.model, "resources").filter(status__in=UNRESOLVED)
    forgotten = (
        base.terminal()
        .filter(
            cleanup_status__in=(CleanupStatus.COMPLETE, CleanupStatus.NOT_REQUIRED),
            pk__in=_runs_of(unresolved),
            **scope,
        )
        .values_list("pk")
    )
    return contradicted.union(forgotten)


_DISAGREEING = Prepared(_disagreeing)
_DISAGREEING_IN_SCOPE = Prepared(_disagreeing, scope=str)


class EventRunQuerySet(models.QuerySet):
    def terminal(self) -> EventRunQuerySet:
        return self.filter(status__in=RUN_TERMINAL)

    def in_scope(self, scope: str | None) -> EventRunQuerySet:
        """The runs of ``scope``; every run when it is None."""
        return self if scope is None else self.filter(scope=scope)

    def transition(
        self, run: Any, to: str, from_: Iterable[str] | str, *, only_if: Q | None = None
    ) -> bool:
        """Move a run's status ``from_ → to``. Exactly one concurrent caller wins; answers
        whether this one did (False: the run was in none of ``from_``, or is gone).

        Only the moves of the state machine (``states.RUN_MOVES``): a word that is no
        run status, or a move it does not make (a terminal status is final), raises
        ``InvalidTransition`` before anything is written. Given an instance, it is
        refreshed from the row the move wrote. ``only_if``: a further condition on the
        run's row, decided in the same statement."""
        sources = (from_,) if isinstance(from_, str) else tuple(from_)
        check_run_move(str(to), tuple(map(str, sources)))
        values: dict[str, Any] = {"status": to, "updated_at": UtcNow()}
        if to == RunStatus.RUNNING:
            values["started_at"] = UtcNow()
        if to in RUN_TERMINAL:
            values["finished_at"] = UtcNow()
        # `status` changes in every matched row, so matched == changed even on MySQL.
        qs = self.filter(pk=_pk(run), status__in=sources).exclude(status=to)
        if only_if is not None:
            qs = qs.filter(only_if)
        won = qs.update(**values) == 1
        if won and isinstance(run, self.model):
            run.refresh_from_db(
                using=self.db, fields=["status", "updated_at", "started_at", "finished_at"]
            )
        return won

    def set_cleanup_status(
        self, run: Any, status: str, only_from: Iterable[str] | None = None
    ) -> bool:
        """Set ``cleanup_status``, from the given statuses only when named."""
        only = None if only_from is None else tuple(only_from)
        return _SET_CLEANUP_STATUS.update(self, only, run=_pk(run), status=status) == 1

    def mark_dirty_statement(self, run: Any) -> Statement:
        """The run's first ledgered step's mark (``not_required``/``complete`` →
        ``pending``) as a statement, for ``fastpath``: only while the run has not
        ended, as ``ledger`` marks it only then."""
        return _MARK_DIRTY_IF_LIVE.statement(self, run=_pk(run))

    def live_statement(self, run: Any) -> Statement:
        """A SELECT of the run's id, only while it has not ended, under a shared lock of
        the run's row: a step's claim decides on the run under its lock, so a cancel in
        progress is waited for and read as it committed (PostgreSQL re-reads a row it
        waited to lock), and a cancel that comes later waits for the claim to commit,
        when a sweep sees the step in flight. Read from the statement's snapshot alone,
        a run cancelled and swept meanwhile had its step performed after cleanup."""
        sql, params = _LIVE_RUN.statement(self, run=_pk(run))
        share = "LOCK IN SHARE MODE" if connections[self.db].vendor == "mysql" else "FOR SHARE"
        return f"{sql} {share}", params

    def _derived_cleanup_status(self, max_attempts: int, max_claims: int, ordered: bool) -> Case:
        rows = _manager(self.model, "resources").filter(run=OuterRef("pk"))
        # C8: a row behind a later phase whose rows are spent will never get its turn,
        # so it does not keep the run pending: the run is incomplete (rule 2).
        progressing = rows.progressing(max_attempts, max_claims, ordered)
        return Case(
            When(~Exists(rows.unresolved()), then=Value(CleanupStatus.COMPLETE)),
            When(Exists(progressing), then=Value(CleanupStatus.PENDING)),
            default=Value(CleanupStatus.INCOMPLETE),
        )

    def status_locked(self, run: Any) -> str | None:
        """Inside the caller's transaction: lock the run's row and answer its status now
        (None: no such run, or nothing to lock). A step's claim decides on the run under
        this lock, so a run cancelled meanwhile is seen cancelled (PostgreSQL re-reads
        the row after waiting), and a cancel that comes after waits for the claim to
        commit, when a sweep sees the step in flight. SQLite has one writer at a time,
        and a transaction whose read went stale cannot write (it is retried whole), so
        what the caller's transaction read is current already."""
        features = connections[self.db].features
        if not features.has_select_for_update:
            return None
        qs = self.filter(pk=_pk(run)).select_for_update(
            no_key=features.has_select_for_no_key_update
        )
        found = list(qs.values_list("status", flat=True))
        return found[0] if found else None

    def lock(self, runs: Iterable[Any]) -> list[Any]:
        """Lock the runs' rows for the caller's transaction, in id order (so two callers
        never wait on each other's locks in a cycle). A summary derived after this sees
        every verdict committed before it; one derived in a statement that waited for
        the lock would read rows as they were when the statement began."""

        ids = _pks(runs)
        features = connections[self.db].features
        if not ids or not features.has_select_for_update:
            return ids  # SQLite: the transaction holds the whole file already
        # PostgreSQL's FOR NO KEY UPDATE does not block a foreign key check (a step's
        # rows being recorded under the run meanwhile); the others have one kind.
        no_key = features.has_select_for_no_key_update
        return list(
            self.filter(pk__in=ids)
            .order_by("pk")
            .select_for_update(no_key=no_key)
            .values_list("pk", flat=True)
        )

    def settle_cleanups(
        self, runs: Iterable[Any], max_attempts: int, max_claims: int, ordered: bool = True
    ) -> dict[int, tuple[str, int]]:
        """``settle_cleanup`` for many runs: one UPDATE derives every summary from its
        rows, one SELECT answers each run's summary and unresolved count."""
        ids = _pks(runs)
        if not ids:
            return {}
        fixed = (max_attempts, max_claims, ordered)
        for part in chunked(ids):
            retrying_deadlocks(
                partial(_SETTLE_RUNS.update, self, *fixed, runs=part),
                using=self.db,
                savepoint=False,
            )
        return {
            pk: (status, count)
            for part in chunked(ids)
            for pk, status, count in _SUMMARIES.rows(self, runs=part)
        }

    def settle_cleanup(
        self, run: Any, max_attempts: int, max_claims: int, ordered: bool = True
    ) -> tuple[str, int]:
        """Derive ``cleanup_status`` from the run's rows in the one statement that writes
        it: none unresolved → complete; some still retryable → pending; else incomplete.

        Two sweepers finishing one run cannot leave a stale summary: whichever writes
        last writes what the rows say at that moment, not what it saw earlier.
        """
        return self.settle_cleanups([run], max_attempts, max_claims, ordered)[_pk(run)]

    def repair_cleanup_summaries(
        self, max_attempts: int, max_claims: int, ordered: bool = True, *, scope: str | None = None
    ) -> list[tuple[int, str]]:
        """Re-derive the summary of terminal runs whose summary disagrees with their rows;
        answers each repaired run with the summary it now has.

        Two ways to disagree: a sweeper died between its last verdict and its summary
        write, or two raced (``pending``/``incomplete`` that the rows contradict); or
        rows were recorded after the run's cleanup ended (a late answer, a step whose
        claim went stale and came back), so ``complete``/``not_required`` sits over
        unresolved rows that no scan would otherwise look at again.

        A SELECT of the candidates, then one UPDATE by id that derives the summary from
        the rows in the statement: MySQL refuses an UPDATE whose WHERE reads the table
        it updates (error 1093), and the derived value is still decided by the UPDATE.
        With ``scope``, only runs of that scope.
        """
        fixed = (max_attempts, max_claims, ordered)
        if scope is None:
            disagreeing = partial(_DISAGREEING.rows, self, *fixed)
        else:
            disagreeing = partial(_DISAGREEING_IN_SCOPE.rows, self, *fixed, scope=scope)
        ids = sorted({pk for (pk,) in retrying_deadlocks(disagreeing, using=self.db)})
        if not ids:
            return []
        derived = self._derived_cleanup_status(max_attempts, max_claims, ordered)
        retrying_deadlocks(
            lambda: (
                self.filter(pk__in=ids)
                .terminal()
                .update(cleanup_status=derived, updated_at=UtcNow())
            ),
            using=self.db,
        )
        return list(self.filter(pk__in=ids).order_by("pk").values_list("pk", "cleanup_status"))

    def with_unresolved_count(self) -> EventRunQuerySet:
        """Annotate each run with its unresolved row count, in the same query."""
        counts = (
            _manager(self.model, "resources")
            .filter(run=OuterRef("pk"), status__in=UNRESOLVED)
            .order_by()
            .values("run")
            .annotate(n=Count("pk"))
            .values("n")
        )
        return self.annotate(
            unresolved_count=models.functions.Coalesce(
                models.Subquery(counts, output_field=models.IntegerField()), 0
            )
        )

    # ── R11 ──

    def needing_cleanup(
        self,
        limit: int,
        max_attempts: int,
        max_claims: int | None = None,
        step_ttl: timedelta | None = None,
        ordered: bool = True,
        *,
        scope: str | None = None,
        claim_ttl: timedelta | None = None,
    ) -> list[EventRun]:
        """Terminal runs with a row the sweep will still try, by id (of ``scope`` only,
        when given).

        ``not_required`` is in the list because a run whose only row is a lease may
        never have been marked dirty; the attempt bound is there so a run whose rows
        are spent is not picked up on every pass for ever.

        With ``claim_ttl``, a row another sweeper claimed less than that long ago is
        its work, not this scan's: eight sweepers started together all took the same
        first runs of the backlog and split them, so each pass gave back a run or two
        and more sweepers gave back less (#27). A claim gone stale is taken again.
        """
        fixed = (limit, max_attempts, max_claims, step_ttl, ordered, claim_ttl)
        if scope is None:
            found = _NEEDING_CLEANUP.rows(self, *fixed)
        else:
            found = _NEEDING_CLEANUP_IN_SCOPE.rows(self, *fixed, scope=scope)
        names = [f.attname for f in self.model._meta.concrete_fields]
        return [self.model.from_db(self.db, names, row) for row in found]


def _needing_cleanup(
    base: Any,
    limit: int,
    max_attempts: int,
    max_claims: int | None,
    step_ttl: timedelta | None,
    ordered: bool,
    claim_ttl: timedelta | None,
    **scope: str,
) -> Any:
    owing = _manager(base.model, "resources").progressing(max_attempts, max_claims, ordered)
    if claim_ttl is not None:
        owing = owing.exclude(status=ResourceStatus.REVERTING, updated_at__gte=UtcNow() - claim_ttl)
    runs = base.terminal().filter(
        cleanup_status__in=(CleanupStatus.PENDING, CleanupStatus.NOT_REQUIRED),
        pk__in=_runs_of(owing),
        **scope,
    )
    columns = [f.attname for f in base.model._meta.concrete_fields]
    if step_ttl is None:
        return runs.order_by("pk").values_list(*columns)[:limit]
    # Runs with something to give back now come first; a run whose only retryable
    # rows wait for a step in flight fills what is left of the batch (it is worked
    # to report what it waits for). Taking it first on every pass would starve the
    # runs behind it once a batch's worth of steps hang.
    steps = _manager(base.model, "steps")
    ready = owing.exclude(Exists(steps.in_flight(step_ttl).filter(pk=OuterRef("step_id"))))
    if ordered:
        # C8: a row behind a later phase's step in flight cannot be claimed either; read
        # as ready, a batch's worth of such runs (hung calls) filled every pass, which
        # gave nothing back, and the runs behind them were never swept.
        later = steps.in_flight(step_ttl).filter(
            run=OuterRef("run_id"), phase_rank__gt=OuterRef("phase_rank")
        )
        ready = ready.exclude(Exists(later))
    # An IN of the ready rows' runs, not a correlated EXISTS per run: MariaDB planned
    # that as a read of every step.
    first = ExpressionWrapper(Q(pk__in=_runs_of(ready)), output_field=BooleanField())
    ordered_runs = runs.alias(ready=first).order_by(F("ready").desc(), "pk")
    return ordered_runs.values_list(*columns)[:limit]


# The sweep's scan, compiled once: #27, a pass's Python was its cost.
_NEEDING_CLEANUP = Prepared(_needing_cleanup)
_NEEDING_CLEANUP_IN_SCOPE = Prepared(_needing_cleanup, scope=str)


# ── steps ─────────────────────────────────────────────────────────────────────


def _claim(
    base: Any, ttl: timedelta, *, step: int, token: str, by: str, attempts: int | None = None
) -> tuple[Any, dict[str, Any]]:
    qs = base.filter(pk=step).filter(
        Q(status=StepStatus.PENDING) | Q(status=StepStatus.RUNNING, claimed_at__lt=UtcNow() - ttl)
    )
    if attempts is not None:
        qs = qs.filter(attempts=attempts)
    # claim_token and claimed_at change on every claim: matched == changed.
    return qs, {
        "status": StepStatus.RUNNING,
        "claim_token": token,
        "claimed_at": UtcNow(),
        "claimed_by": by,
        "attempts": F("attempts") + 1,
        "updated_at": UtcNow(),
    }


_CLAIM = Prepared(_claim, step=int, token=str, by=str)
_CLAIM_AT = Prepared(_claim, step=int, token=str, by=str, attempts=int)


def _is(variable: str) -> RawSQL:
    """A condition on a variable of ``EventRunStepQuerySet._claim_block``'s compound
    statement, as a filter."""
    return RawSQL(f"{variable} = 1", [], output_field=BooleanField())


def _claim_unread(
    base: Any,
    ttl: timedelta,
    max_attempts: int,
    live: str,
    *,
    step: int,
    token: str,
    by: str,
    action: str,
) -> tuple[Any, dict[str, Any]]:
    """``_claim`` of a step not read first: also only while it is still of ``action``,
    under ``max_attempts``, and its run has not ended, which ``live`` says: an SQL
    expression equal to 1 while it has not, read under the run's lock (a compound
    statement's variable, or a count of ``live_statement``'s rows)."""
    qs, values = _claim(base, ttl, step=step, token=token, by=by)
    return qs.filter(action_id=action, attempts__lt=max_attempts).filter(_is(live)), values


_CLAIM_UNREAD = Prepared(_claim_unread, step=int, token=str, by=str, action=str)
_CLAIMED_IN_BLOCK = Prepared(
    lambda base, *, step: (
        base.filter(pk=step)
        .filter(_is("claimed"))
        .order_by()
        .annotate(
            inserted_rows=RawSQL("inserted_rows", [], output_field=models.IntegerField()),
            inserted_id=RawSQL("inserted_id", [], output_field=models.IntegerField()),
        )
        .values_list("attempts", "params", "inserted_rows", "inserted_id")
    ),
    step=int,
)
_ATTEMPTS = Prepared(
    lambda base, *, step: base.filter(pk=step).order_by().values_list("attempts"), step=int
)
_SETTLE = Prepared(
    lambda base, *, step, token, status, error: (
        base.filter(pk=step, claim_token=token, status=StepStatus.RUNNING),
        {"status": status, "updated_at": UtcNow(), "last_error": error},
    ),
    step=int,
    token=str,
    status=str,
    error=str,
)


#: What executing a step reads of the step and of its run. The other columns stay
#: deferred, as ``only()`` leaves them (read on access): a datetime column costs a
#: conversion, and nothing of the write half reads one.
STEP_COLUMNS = (
    "id",
    "run_id",
    "phase",
    "phase_rank",
    "seq",
    "action_id",
    "params",
    "idempotency_key",
    "status",
    "attempts",
    "claim_token",
)
RUN_COLUMNS = ("id", "status", "cleanup_status")

_STEP_WITH_RUN = Prepared(
    lambda base, *, step: (
        base.filter(pk=step)
        .order_by()
        .values_list(*STEP_COLUMNS, *(f"run__{name}" for name in RUN_COLUMNS))
    ),
    step=int,
)


_CLAIMED = Prepared(
    lambda base, *, step, token: (
        base.filter(pk=step, claim_token=token).order_by().values_list("attempts", "params")
    ),
    step=int,
    token=str,
)
_STATUS_UNDER = Prepared(
    lambda base, *, step, token: (
        base.filter(pk=step, claim_token=token).order_by().values_list("status")
    ),
    step=int,
    token=str,
)


def in_flight_q(ttl: timedelta, via: str = "") -> Q:
    """A step in flight (``via``: the path to it, e.g. ``"step__"`` from its rows)."""
    return Q(**{f"{via}status": StepStatus.RUNNING, f"{via}claimed_at__gte": UtcNow() - ttl})


class EventRunStepQuerySet(models.QuerySet):
    def with_run(self, step: Any) -> Any:
        """The step with its run cached on it, as ``select_related("run").only(...)``
        reads them (``STEP_COLUMNS``, ``RUN_COLUMNS``), in one statement; None when
        there is no such step."""
        rows = _STEP_WITH_RUN.rows(self, step=_pk(step))
        return self._with_run(rows[0]) if rows else None

    def _with_run(self, row: Sequence[Any]) -> Any:
        field = self.model._meta.get_field("run")
        found = self.model.from_db(self.db, STEP_COLUMNS, row[: len(STEP_COLUMNS)])
        run = field.related_model.from_db(
            self.db, RUN_COLUMNS, row[len(STEP_COLUMNS) : len(STEP_COLUMNS) + len(RUN_COLUMNS)]
        )
        field.set_cached_value(found, run)
        return found

    def bulk_create(self, objs: Iterable[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """C8: steps made in bulk take their phase's rank as ``save`` gives it (their
        phase's in the run, else one past the run's last, in the order given), with one
        read for the whole batch; a rank given explicitly is kept."""
        objs = list(objs)
        unranked = [o for o in objs if isinstance(o.phase_rank, DatabaseDefault)]
        if unranked:
            ranks: dict[tuple[Any, str], int] = {}
            last: dict[Any, int] = {}
            found = (
                self.filter(run__in={o.run_id for o in unranked})
                .order_by()
                .values_list("run_id", "phase")
                .annotate(rank=Max("phase_rank"))
            )
            for run_id, phase, rank in found:
                ranks[(run_id, phase)] = rank
                last[run_id] = max(last.get(run_id, -1), rank)
            for o in unranked:
                key = (o.run_id, o.phase)
                if key not in ranks:
                    ranks[key] = last[o.run_id] = last.get(o.run_id, -1) + 1
                o.phase_rank = ranks[key]
        return super().bulk_create(objs, *args, **kwargs)

    def rank_for(self, run: Any, phase: str) -> int:
        """C8: the rank a new step of ``phase`` takes in ``run``: its phase's, when the
        run has steps of it already, else one past the run's last phase."""
        found = self.filter(run=_pk(run)).aggregate(
            mine=Max("phase_rank", filter=Q(phase=phase)), last=Max("phase_rank")
        )
        if found["mine"] is not None:
            return int(found["mine"])
        return 0 if found["last"] is None else int(found["last"]) + 1

    def new_claim_token(self) -> str:
        """A fresh claim token: made before the claim is sent, so that a claim whose
        answer was lost can be read back by it (``under_claim``)."""
        return new_token()

    def claim_unread_statement(
        self,
        step: Any,
        ttl: timedelta,
        by: str | None,
        max_attempts: int,
        token: str,
        *,
        live: str,
    ) -> Statement:
        """The claim of a step not read first, for ``fastpath``'s one statement: won only
        while the step is claimable, still of its action, under ``max_attempts``, and its
        run has not ended (``live``, read under the run's lock, equals 1)."""
        return _CLAIM_UNREAD.statement(
            self, ttl, max_attempts, live, step=_pk(step), token=token, by=by, action=step.action_id
        )

    def claimed_in_block_statement(self, step: Any) -> Statement:
        """The SELECT that ends ``fastpath``'s claim block: the step's attempts and
        parameters with the placeholder INSERT's count and id, only when it claimed."""
        return _CLAIMED_IN_BLOCK.statement(self, step=_pk(step))

    def claimed_converted(self, rows: Any) -> list[tuple[int, Any]]:
        """Rows of (attempts, params) a statement read under a claim, converted as the
        ORM reads them (``params`` is JSON)."""
        return [(int(a), p) for a, p in _CLAIMED.converted(self, rows)]

    def claimed_in_block(self, rows: Any) -> tuple[int, Any, int, int | None]:
        """What ``claimed_in_block_statement`` read, converted as the ORM reads it."""
        [(attempts, params, inserted, new_id)] = _CLAIMED_IN_BLOCK.converted(self, rows)
        return int(attempts), params, int(inserted), new_id

    def claimed_step(self, step: Any, token: str, attempts: int, params: Any) -> Any:
        """The step as a claim under ``token`` left it, from ``step``'s columns that never
        change and what was read back under the claim; its run cached as its id alone."""
        found = self.model.from_db(
            self.db,
            STEP_COLUMNS,
            [
                step.pk,
                step.run_id,
                step.phase,
                # C8: as the caller's instance holds it (None: not loaded; the row's
                # INSERT then reads it from the step's row).
                known_rank(step),
                step.seq,
                step.action_id,
                params,
                step.idempotency_key,
                StepStatus.RUNNING,
                attempts,
                token,
            ],
        )
        field = self.model._meta.get_field("run")
        field.set_cached_value(found, field.related_model.from_db(self.db, ["id"], [step.run_id]))
        return found

    def under_claim(self, step: Any, token: str) -> tuple[int, Any] | None:
        """The step's attempts and parameters while ``token`` is its claim, else None:
        how a claim whose answer was lost is read back (it committed, or nothing did)."""
        rows = _CLAIMED.rows(self, step=_pk(step), token=token)
        return (int(rows[0][0]), rows[0][1]) if rows else None

    def hand_back(self, step: Any, token: str) -> bool:
        """Give back a claim whose answer was lost before any call was made under it:
        ``running → pending`` while ``token`` is still its claim, and the attempt it
        counted taken back (nothing was tried). Answers whether it did."""
        return (
            self.filter(pk=_pk(step), claim_token=token, status=StepStatus.RUNNING).update(
                status=StepStatus.PENDING,
                attempts=Greatest(F("attempts") - 1, Value(0)),
                updated_at=UtcNow(),
            )
            == 1
        )

    def status_under(self, step: Any, token: str) -> str | None:
        """The step's status while ``token`` is its claim (a settled outcome keeps the
        token), else None: how an outcome whose answer was lost is read back."""
        rows = _STATUS_UNDER.rows(self, step=_pk(step), token=token)
        return rows[0][0] if rows else None

    def claim(
        self,
        step: Any,
        ttl: timedelta,
        by: str | None = None,
        *,
        attempts: int | None = None,
        token: str | None = None,
    ) -> str | None:
        """Claim a step to execute it: ``pending → running``, or a ``running`` step whose
        claim is older than the TTL (its worker died: a live worker keeps its claim
        fresh for as long as a call of the step runs, see ``background``). Answers the
        claim's token, or None when another worker holds it. Exactly one concurrent
        caller wins; every claim counts an attempt, so a step that kills its worker
        cannot loop for ever.

        With ``attempts`` (the count the caller read), the claim is also a compare-and-set
        on the count: won, it wrote ``attempts + 1``, which the caller then knows without
        reading it back; lost, either another worker holds the step or the count moved
        since the caller read it (another claim came and went), which the caller tells
        apart by reading the count again.
        """
        token = token or new_token()
        if attempts is None:
            won = _CLAIM.update(self, ttl, step=_pk(step), token=token, by=by)
        else:
            won = _CLAIM_AT.update(self, ttl, step=_pk(step), token=token, by=by, attempts=attempts)
        return token if won == 1 else None

    def attempts_of(self, step: Any) -> int:
        rows = _ATTEMPTS.rows(self, step=_pk(step))
        if not rows:
            raise self.model.DoesNotExist(f"there is no step {_pk(step)}")
        return int(rows[0][0])

    def refresh_claims(self, tokens: Sequence[str]) -> int:
        """Re-stamp the claims of calls that still run, so nobody takes them for dead."""
        if not tokens:
            return 0
        return self.filter(claim_token__in=list(tokens), status=StepStatus.RUNNING).update(
            claimed_at=UtcNow()
        )

    def in_flight(self, ttl: timedelta) -> EventRunStepQuerySet:
        """Steps a call of which may still change the world: claimed, claim fresh."""
        return self.filter(in_flight_q(ttl))

    def for_giving_back(self, steps: Iterable[Any], ttl: timedelta | None) -> dict[Any, tuple]:
        """What giving back the steps' rows needs of each step, by id: its action and
        key and, with ``ttl``, who holds it, since when, whether it is in flight, and
        its place in the run. One statement, compiled once per size (#27)."""
        ids = sorted(_pks(steps))
        return {
            found[0]: found[1:]
            for part in (chunked(ids) if ids else [])
            for found in _STEPS_FOR_GIVING_BACK.rows(self, ttl, steps=part)
        }

    def settle(self, step: Any, token: str, status: str, error: str | None = None) -> bool:
        """Write a step's outcome, only while the caller's claim is still the current one.

        Inside a transaction the UPDATE also locks the step's row: answered True, no newer
        claim can take the step before the caller commits."""
        text = None if error is None else storable(error, 2000)
        return _SETTLE.update(self, step=_pk(step), token=token, status=status, error=text) == 1

    def settle_statement(
        self, step: Any, token: str, status: str, error: str | None = None
    ) -> Statement:
        """``settle`` as a statement, for ``fastpath`` (won when it counts one row)."""
        text = None if error is None else storable(error, 2000)
        return _SETTLE.statement(self, step=_pk(step), token=token, status=status, error=text)

    def reword(self, step: Any, token: str, status: str, error: str | None) -> bool:
        """Correct the error text of the outcome ``settle`` wrote under the caller's claim
        in the caller's transaction (the step's row is locked since)."""
        text = None if error is None else storable(error, 2000)
        return (
            self.filter(pk=_pk(step), claim_token=token, status=status).update(
                last_error=text, updated_at=UtcNow()
            )
            == 1
        )


#: What giving back a row needs of its step, then whether it is in flight and its place in the run.
_STEP_FOR_GIVING_BACK = ("action_id", "idempotency_key", "claimed_by", "claimed_at")


def _steps_for_giving_back(base: Any, ttl: timedelta | None, *, steps: list[int]) -> Any:
    qs = base.filter(pk__in=steps)
    if ttl is None:
        return qs.values_list("pk", "action_id", "idempotency_key")
    live = base.model._default_manager.in_flight(ttl).filter(pk=OuterRef("pk"))
    return qs.annotate(live=Exists(live)).values_list("pk", *_STEP_FOR_GIVING_BACK, "live", "seq")


_STEPS_FOR_GIVING_BACK = Prepared(_steps_for_giving_back, steps=list)


# ── the ledger ────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Holder:
    """Who holds a target: the run and the row's status."""

    run_id: int
    status: str


@dataclass(frozen=True)
class Reservation:
    """``reserve()``'s answer: ok with the new row's id, or refused with a code."""

    ok: bool
    id: int | None = None
    code: str | None = None
    holder: Holder | None = None


@dataclass(frozen=True)
class GroupClaim:
    """The rows one claim won (all stamped with ``token``), and released rows that
    could not be claimed because another run now holds their target."""

    token: str
    rows: list[EventRunResource] = field(default_factory=list)
    collided: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [r.pk for r in self.rows]


#: The columns ``_inserts`` writes, in its order.
_INSERTED_COLUMNS = (
    "run_id",
    "step_id",
    "owner_module",
    "kind",
    "ref",
    "payload",
    "lease_until",
    "member_key",
    "phase_rank",
    "status",
    "revert_attempts",
    "claim_count",
    "created_at",
    "updated_at",
)

#: ``EventRunResourceQuerySet._insert_names``, by database alias and vendor.
_INSERT_NAMES: dict[tuple[str, str], tuple[str, str]] = {}

_LIVE_PLACEHOLDER = Prepared(
    lambda base, *, owner, key, run: (
        base.filter(owner_module=owner, kind=STEP_KIND, ref=key, run=run, status__in=LIVE)
        .order_by("-pk")
        .values_list("pk")[:1]
    ),
    owner=str,
    key=str,
    run=int,
)
_RESOLVE_PLACEHOLDER = Prepared(
    lambda base, *, row: (
        base.filter(pk=row, kind=STEP_KIND, status__in=LIVE),
        {"status": ResourceStatus.REVERTED, "last_error": None, "updated_at": UtcNow()},
    ),
    row=int,
)


def _claim_values(token: str) -> dict[str, Any]:
    return {
        "status": ResourceStatus.REVERTING,
        "claim_token": token,
        "claim_count": F("claim_count") + 1,
        "updated_at": UtcNow(),
    }


def _claim_rows(
    base: Any,
    ttl: timedelta,
    step_ttl: timedelta | None,
    ordered: bool,
    *,
    rows: list[int],
    token: str,
    runs: Sequence[int] = (),
    ranks: Sequence[int] = (),
) -> tuple[Any, dict[str, Any]]:
    """R5: the claim of live (or stale-claimed) rows, each row its own compare-and-set;
    with ``step_ttl`` not while their step is in flight; ``ordered``, C8."""
    qs = base
    if step_ttl is not None:
        steps = _manager(base.model, "step").in_flight(step_ttl)
        qs = qs.exclude(Exists(steps.filter(pk=OuterRef("step_id"))))
    qs = qs.filter(pk__in=rows)
    if ordered:
        qs = qs.filter(base._in_last_phase(runs, ranks, step_ttl))
    return qs.filter(Q(status__in=LIVE) | base._stale_claim(ttl)), _claim_values(token)


_CLAIM_ROWS = Prepared(_claim_rows, rows=list, token=str)
_CLAIM_ROWS_IN_ORDER = Prepared(_claim_rows, rows=list, token=str, runs=list, ranks=list)


def _unresolved_of_runs(base: Any, ttl: timedelta, *, runs: list[int]) -> Any:
    """The unresolved rows of the runs and, joined, what giving each back needs of its
    step (its action and key, who holds it, whether it is in flight, its place in the
    run): one read where a pass made two."""
    # From the joined step's own columns: a subquery per row cost MariaDB more than the
    # read it saved.
    live = ExpressionWrapper(in_flight_q(ttl, via="step__"), output_field=BooleanField())
    return (
        base.filter(run__in=runs)
        .unresolved()
        .order_by("run_id", "pk")
        .annotate(step_live=live)
        .values_list(
            *[f.attname for f in base.model._meta.concrete_fields],
            *[f"step__{name}" for name in _STEP_FOR_GIVING_BACK],
            "step_live",
            "step__seq",
        )
    )


_UNRESOLVED_OF_RUNS = Prepared(_unresolved_of_runs, runs=list)
_MARK_REVERTED = Prepared(
    lambda base, *, rows, token: (
        base.filter(pk__in=rows, status=ResourceStatus.REVERTING, claim_token=token),
        {
            "status": ResourceStatus.REVERTED,
            "last_error": None,
            "claim_count": 0,
            "updated_at": UtcNow(),
        },
    ),
    rows=list,
    token=str,
)


class EventRunResourceQuerySet(models.QuerySet):
    # ── filters ──

    def held(self) -> EventRunResourceQuerySet:
        return self.filter(status__in=HELD)

    def unresolved(self) -> EventRunResourceQuerySet:
        return self.filter(status__in=UNRESOLVED)

    def retryable(
        self, max_attempts: int, max_claims: int | None = None
    ) -> EventRunResourceQuerySet:
        """Unresolved rows the automatic sweep will still try (rule 2's bound)."""
        qs = self.unresolved().filter(revert_attempts__lt=max_attempts)
        if max_claims is not None:
            qs = qs.filter(claim_count__lt=max_claims)
        return qs

    def progressing(
        self, max_attempts: int, max_claims: int | None, ordered: bool
    ) -> EventRunResourceQuerySet:
        """Retryable rows that can still get their turn (C8, ``ordered``): none of their
        run's later phases holds a row the sweep has given up on. A row standing alone
        (no rank) always can."""
        qs = self.retryable(max_attempts, max_claims)
        if not ordered:
            return qs
        spent = Q(revert_attempts__gte=max_attempts)
        if max_claims is not None:
            spent |= Q(claim_count__gte=max_claims)
        stuck = self.model._default_manager.filter(
            spent,
            run=OuterRef("run_id"),
            phase_rank__gt=OuterRef("phase_rank"),
            status__in=UNRESOLVED,
        )
        return qs.exclude(Exists(stuck))

    def _in_last_phase(
        self, runs: Sequence[int], ranks: Sequence[int], step_ttl: timedelta | None
    ) -> Any:
        """C8, inside a claim of rows of the (run, rank) pairs ``runs``/``ranks``: a row
        goes only while no row of a later phase of its run is unresolved and, with
        ``step_ttl``, no step of a later phase is in flight (a call of it may still make
        something). A row standing alone (no rank) neither waits nor holds.

        Asked once per statement for the pairs the claim is about, each pair's values
        sent as the statement's own (the drivers write them in, so each pair's question
        is a range of the (run, status, rank) index, empty in the common case). Asked
        per row (a correlated subquery) it was quadratic in a run's rows: PostgreSQL
        hashed the run's rows and compared each row with all of them, and MariaDB,
        inside the claim's transaction, walked the entries its own earlier chunks had
        just changed (minutes, and seconds, for a 100,000-row answer). A row whose pair
        was not asked about does not go. MySQL refuses an UPDATE whose subquery reads
        its own table (error 1093) unless it reads a materialised derived table;
        MariaDB takes the same form."""
        conn = connections[self.db]
        quote = conn.ops.quote_name
        table = quote(self.model._meta.db_table)
        run, rank, status = quote("run_id"), quote("phase_rank"), quote("status")
        params: list[Any] = []
        if not runs:
            sql = f"{table}.{rank} IS NULL"
        else:
            # Typed, so a server that binds parameters itself knows the columns' type.
            num = "CAST(%s AS SIGNED)" if conn.vendor == "mysql" else "CAST(%s AS INTEGER)"
            asked = " UNION ALL ".join([f"SELECT {num} AS r, {num} AS k"] * len(runs))
            marks = ", ".join(["%s"] * len(UNRESOLVED))
            one_row = " FROM DUAL" if conn.vendor == "mysql" else ""
            blocked = " UNION ALL ".join(
                [
                    f"SELECT {num} AS r, {num} AS k{one_row} WHERE EXISTS (SELECT 1 FROM "
                    f"{table} later WHERE later.{run} = %s AND later.{status} IN ({marks}) "
                    f"AND later.{rank} > %s)"
                ]
                * len(runs)
            )
            if conn.vendor == "mysql":
                blocked = f"SELECT * FROM ({blocked}) AS blocked"
            mine = f"({table}.{run}, {table}.{rank})"
            sql = (
                f"({table}.{rank} IS NULL OR ({mine} IN (SELECT r, k FROM ({asked}) pairs) "
                f"AND {mine} NOT IN ({blocked})))"
            )
            params += [v for pair in zip(runs, ranks, strict=True) for v in pair]
            statuses = [str(s) for s in UNRESOLVED]
            for r, k in zip(runs, ranks, strict=True):
                params += [r, k, r, *statuses, k]
        goes: Any = ExpressionWrapper(RawSQL(sql, params), output_field=BooleanField())
        if step_ttl is not None:
            steps = _manager(self.model, "step").in_flight(step_ttl)
            later = steps.filter(run=OuterRef("run_id"), phase_rank__gt=OuterRef("phase_rank"))
            goes = goes & ~Exists(later)
        return goes

    def _stale_claim(self, ttl: timedelta) -> Q:
        return Q(status=ResourceStatus.REVERTING, updated_at__lt=UtcNow() - ttl)

    def resolve_by_hand(self, pks: Sequence[Any], token: str, note: str, ttl: timedelta) -> int:
        """An operator's resolution, one conditional UPDATE: rows of ended runs that are
        unresolved and not being given back (a ``reverting`` row only under a stale
        claim) become ``resolved``, stamped with ``token`` so the caller reads back which
        ones this call resolved. The target is released with them (R0)."""
        return sum(
            # The run's status as a subquery, not a join: MySQL would read the rows
            # first and update them by id, deciding on what it had read.
            self.filter(pk__in=part)
            .filter(
                Exists(
                    _manager(self.model, "run").filter(
                        pk=OuterRef("run_id"), status__in=RUN_TERMINAL
                    )
                )
            )
            .filter(Q(status__in=RESOLVABLE) | self._stale_claim(ttl))
            .update(
                status=ResourceStatus.RESOLVED,
                claim_token=token,
                last_error=note,
                updated_at=UtcNow(),
            )
            for part in chunked(_pks(pks))
        )

    def claim_is_stale(self, row: Any, ttl: timedelta) -> bool:
        """Whether the row is ``reverting`` under a claim older than ``ttl``, by the
        database's clock, the one that stamped it (a web host's clock may differ)."""
        return self.filter(self._stale_claim(ttl), pk=_pk(row)).exists()

    # ── R1 ──

    def reserve(
        self,
        run: Any,
        step: Any = None,
        *,
        owner: str,
        kind: str,
        ref: str,
        payload: Any = None,
        lease_until: datetime | None = None,
        member_key: str | None = None,
        ordered: bool = True,
    ) -> Reservation:
        """Insert a ``pending`` row for a target. The unique key is the check: on a held
        target the insert loses and the answer is ``code="held"`` naming the holder,
        looked up only after losing. Runs in a savepoint, so a refusal never breaks the
        caller's transaction; a deadlock is retried when no outer transaction is open.
        """

        def insert() -> int:
            row = self.create(
                run_id=_pk(run),
                step_id=_pk(step),
                owner_module=owner,
                kind=kind,
                ref=ref,
                payload=payload,
                lease_until=lease_until,
                member_key=member_key,
                phase_rank=self._rank_of(step) if ordered else None,
                status=ResourceStatus.PENDING,
            )
            return row.pk

        for _ in range(3):
            try:
                return Reservation(ok=True, id=retrying_deadlocks(insert, using=self.db))
            except IntegrityError as exc:
                if not is_unique_violation(exc):
                    raise
            holder = self.held_by(owner, kind, ref)
            if holder is not None:
                return Reservation(ok=False, code="held", holder=holder)
            # The holder let go between our insert and the look-up: try again.
        return Reservation(ok=False, code="held", holder=None)

    def _rank_of(self, step: Any) -> Any:
        """C8: the step's phase rank (read by the INSERT itself when its instance lacks
        it); NULL without a step."""
        if step is None:
            return None
        rank = known_rank(step)
        if rank is not None:
            return rank
        steps = _manager(self.model, "step")
        return models.Subquery(steps.filter(pk=_pk(step)).values("phase_rank")[:1])

    def bulk_record(
        self,
        run: Any,
        step: Any,
        owner: str,
        rows: Sequence[Mapping[str, Any]],
        ordered: bool = True,
    ) -> int:
        """Insert many ``confirmed`` rows in one statement (per few hundred rows), letting
        the unique key skip every target that is already held, by anyone. Answers how
        many rows went in.

        For what a module's answer reports: rule 1 was kept by the step's placeholder,
        which stood for these rows while the call was in flight, so they are written
        confirmed at once instead of inserted pending and confirmed by a second statement.

        Hand-written rather than ``bulk_create()``: compiling fifty model instances costs
        more than the round trip itself. MySQL's ``INSERT IGNORE`` would also turn other
        errors (a too-long value) into warnings, which is safe only because
        ``envelopes.normalise`` has refused every such value before this is called.
        """
        return self._insert_ignoring_held(
            run, step, owner, rows, ResourceStatus.CONFIRMED, ordered
        )[0]

    def reserve_placeholder(
        self,
        run: Any,
        step: Any,
        owner: str,
        key: str,
        payload: Mapping[str, Any],
        ordered: bool = True,
    ) -> int | None:
        """R1 for a step's own ``@step`` row, in one statement and no savepoint (so it can
        share the step's first transaction): a ``pending`` row keyed by the step's
        idempotency key, or the one this step's earlier attempt wrote. Answers its id."""
        inserted, new_id = self._insert_ignoring_held(
            run,
            step,
            owner,
            [{"kind": STEP_KIND, "ref": key, "payload": payload}],
            ResourceStatus.PENDING,
            ordered,
        )
        if inserted:
            return new_id
        # This step's earlier attempt wrote it, and it is still live. One that a sweeper
        # is giving back (reverting) is not reused: the caller must not perform under it.
        return self.live_placeholder(run, owner, key)

    def live_placeholder(self, run: Any, owner: str, key: str) -> int | None:
        """The id of the step's live ``@step`` row (``pending`` or ``confirmed``): not
        one that a sweeper is giving back."""
        found = _LIVE_PLACEHOLDER.rows(self, owner=owner, key=key, run=_pk(run))
        return found[0][0] if found else None

    def _insert_ignoring_held(
        self,
        run: Any,
        step: Any,
        owner: str,
        rows: Sequence[Mapping[str, Any]],
        status: str,
        ordered: bool,
    ) -> tuple[int, int | None]:
        """One multi-row INSERT (per chunk) that the unique key may skip row by row.
        Answers how many rows went in, and the id of the last one when one row was asked
        for."""
        if not rows:
            return 0, None
        conn = connections[self.db]
        one = len(rows) == 1
        inserted, last_id = 0, None
        with conn.cursor() as cursor:
            inserts = self._inserts(conn, run, step, owner, rows, status, ordered=ordered)
            for sql, params, returning in inserts:
                cursor.execute(sql, params)
                if returning:
                    found = cursor.fetchone()
                    last_id = found[0] if found else None
                    inserted += 1 if found else 0
                    continue
                # Rows inserted; the ones the unique key skipped count 0 on every backend.
                count = max(cursor.rowcount, 0)
                inserted += count
                if one and count:
                    last_id = cursor.lastrowid
        return inserted, last_id

    def _insert_names(self, conn: Any) -> tuple[str, str]:
        """The quoted names an INSERT of ``_inserts`` uses on ``conn``: its table and its
        columns. Quoted once per database: a step sends two INSERTs,
        and quoting fourteen names each time showed in its profile."""
        key = (conn.alias, conn.vendor)
        found = _INSERT_NAMES.get(key)
        if found is None:
            quote = conn.ops.quote_name
            found = _INSERT_NAMES[key] = (
                quote(self.model._meta.db_table),
                ", ".join(quote(c) for c in _INSERTED_COLUMNS),
            )
        return found

    def _inserts(
        self,
        conn: Any,
        run: Any,
        step: Any,
        owner: str,
        rows: Sequence[Mapping[str, Any]],
        status: str,
        *,
        ordered: bool = True,
        only_if: str | None = None,
    ) -> list[tuple[str, list[Any], bool]]:
        """The INSERT statements of ``_insert_ignoring_held``: (sql, params, whether it
        answers the new id with RETURNING), one per chunk of rows.

        ``ordered``: the rows take their step's phase rank (C8); False, or no step:
        they stand alone (NULL).
        ``only_if`` (one row, for ``fastpath``): on MariaDB the row goes in only when that
        condition on a compound statement's variables holds; on PostgreSQL it names a CTE
        of the statement, and the row goes in once for each of its rows."""
        ops = conn.ops
        table, names = self._insert_names(conn)
        now = ops.adapt_datetimefield_value(timezone.now())
        # The status is a fixed word of the app's own; everything else is bound.
        run_id, step_id = int(_pk(run)), (None if step is None else int(_pk(step)))
        assert status in (ResourceStatus.PENDING, ResourceStatus.CONFIRMED)
        values = []
        for row in rows:
            payload = row.get("payload")
            lease_until = row.get("lease_until")
            values.append(
                (
                    run_id,
                    step_id,
                    owner,
                    row["kind"],
                    row["ref"],
                    None if payload is None else json.dumps(payload, cls=DjangoJSONEncoder),
                    None if lease_until is None else ops.adapt_datetimefield_value(lease_until),
                    row.get("member_key"),
                    now,
                )
            )
        one = len(values) == 1
        returning = ""
        if conn.vendor == "mysql":
            head, tail = "INSERT IGNORE INTO", ""
        elif conn.vendor == "sqlite":
            head, tail = "INSERT OR IGNORE INTO", ""
            returning = " RETURNING id" if one else ""
        else:
            head, tail = "INSERT INTO", " ON CONFLICT DO NOTHING"
            returning = " RETURNING id" if one else ""
        # C8: the step's rank, as its instance was read (a whole number of the
        # database's own), else read from its row by the INSERT (a subquery per row:
        # twice the cost of a large answer, so only when the instance lacks it); NULL,
        # standing alone.
        rank_sql = "NULL"
        if ordered and step_id is not None:
            rank = known_rank(step)
            if rank is not None:
                rank_sql = str(int(rank))
            else:
                steps = self.model._meta.get_field("step").related_model._meta.db_table
                rank_sql = (
                    f"(SELECT {ops.quote_name('phase_rank')} FROM {ops.quote_name(steps)} "
                    f"WHERE {ops.quote_name('id')} = {step_id})"
                )
        row_sql = f"%s, %s, %s, %s, %s, %s, %s, %s, {rank_sql}, '{status}', 0, 0, %s, %s"
        if only_if is not None and conn.vendor == "postgresql":
            # PostgreSQL: ``only_if`` names a CTE of the statement; one row goes in for
            # each of its rows (the claim's: none when the claim was lost).
            assert one
            return [
                (
                    f"{head} {table} ({names}) SELECT {row_sql} FROM {only_if}{tail} RETURNING id",
                    [*values[0], values[0][-1]],
                    True,
                )
            ]
        if only_if is not None:
            assert one and conn.vendor == "mysql"
            return [
                (
                    f"{head} {table} ({names}) SELECT {row_sql} FROM DUAL WHERE {only_if}",
                    [*values[0], values[0][-1]],
                    False,
                )
            ]
        chunk = max(1, 999 // 10) if conn.vendor == "sqlite" else 1000
        return [
            (
                f"{head} {table} ({names}) VALUES "
                f"{', '.join([f'({row_sql})'] * len(values[start : start + chunk]))}"
                f"{tail}{returning}",
                [v for row in values[start : start + chunk] for v in (*row, row[-1])],
                bool(returning),
            )
            for start in range(0, len(values), chunk)
        ]

    # ── statements for ``fastpath``'s compound statements ──

    def placeholder_insert(
        self,
        step: Any,
        owner: str,
        payload: Mapping[str, Any],
        *,
        ordered: bool = True,
        only_if: str | None = None,
    ) -> Statement:
        """The INSERT of a step's ``@step`` row as a statement sent with the step's
        claim, in its one trip: going in only under the claim (see ``_inserts``)."""
        [(sql, params, _)] = self._inserts(
            connections[self.db],
            step.run_id,
            step,
            owner,
            [{"kind": STEP_KIND, "ref": step.idempotency_key, "payload": payload}],
            ResourceStatus.PENDING,
            ordered=ordered,
            only_if=only_if,
        )
        return sql, params

    def record_statement(
        self,
        run: Any,
        step: Any,
        owner: str,
        rows: Sequence[Mapping[str, Any]],
        ordered: bool = True,
    ) -> Statement | None:
        """``bulk_record`` as one statement, or None when the rows take several."""
        inserts = self._inserts(
            connections[self.db], run, step, owner, rows, ResourceStatus.CONFIRMED, ordered=ordered
        )
        if len(inserts) != 1:
            return None
        [(sql, params, _)] = inserts
        return sql, params

    def resolve_statement(self, pk: Any) -> Statement:
        """``resolve_placeholder`` as a statement."""
        return _RESOLVE_PLACEHOLDER.statement(self, row=_pk(pk))

    def held_by(self, owner: str, kind: str, ref: str) -> Holder | None:
        found = (
            self.filter(owner_module=owner, kind=kind, ref=ref, status__in=HELD)
            .values_list("run_id", "status")
            .first()
        )
        return Holder(run_id=found[0], status=found[1]) if found else None

    def holders(
        self, owner: str, targets: Iterable[tuple[str, str]]
    ) -> dict[tuple[str, str], Holder]:
        """The holders of many ``(kind, ref)`` targets of one module, in one query."""
        targets = set(targets)
        if not targets:
            return {}
        kinds = sorted({k for k, _ in targets})
        out: dict[tuple[str, str], Holder] = {}
        for refs in chunked(sorted({r for _, r in targets})):
            found = self.filter(
                owner_module=owner, kind__in=kinds, ref__in=refs, status__in=HELD
            ).values_list("kind", "ref", "run_id", "status")
            out.update(
                {(k, r): Holder(run_id, s) for k, r, run_id, s in found if (k, r) in targets}
            )
        return out

    # ── R2, R3 ──

    def confirm(
        self,
        pk: Any,
        *,
        payload: Any = _UNSET,
        lease_until: Any = _UNSET,
        member_key: Any = _UNSET,
    ) -> bool:
        """``pending → confirmed`` only, setting only the fields given. A late answer can
        never un-revert a row."""
        values: dict[str, Any] = {"status": ResourceStatus.CONFIRMED, "updated_at": UtcNow()}
        if payload is not _UNSET:
            values["payload"] = payload
        if lease_until is not _UNSET:
            values["lease_until"] = lease_until
        if member_key is not _UNSET:
            values["member_key"] = member_key
        return self.filter(pk=_pk(pk), status=ResourceStatus.PENDING).update(**values) == 1

    def set_payload(self, pk: Any, payload: Any, *, only_status: str) -> bool:
        """Write a row's payload while it is still in ``only_status`` (a lease's baseline,
        read under its reservation)."""
        return (
            self.filter(pk=_pk(pk), status=only_status).update(payload=payload, updated_at=UtcNow())
            == 1
        )

    def resolve_placeholder(self, pk: Any) -> bool:
        """An answered step's ``@step`` row: ``pending|confirmed → reverted``, which frees
        its idempotency key."""
        return _RESOLVE_PLACEHOLDER.update(self, row=_pk(pk)) == 1

    # ── R4 reads ──

    def find_by_target(self, owner: str, kind: str, ref: str) -> EventRunResourceQuerySet:
        """Every row ever written for a target, live or not, newest first."""
        return self.filter(owner_module=owner, kind=kind, ref=ref).order_by("-pk")

    def for_run(self, run: Any) -> EventRunResourceQuerySet:
        return self.filter(run=_pk(run)).order_by("pk")

    def unresolved_for_run(
        self, run: Any, max_attempts: int | None = None, max_claims: int | None = None
    ) -> EventRunResourceQuerySet:
        qs = self.for_run(run).unresolved()
        if max_attempts is not None:
            qs = qs.retryable(max_attempts, max_claims)
        return qs

    def unresolved_for_runs(
        self, runs: Iterable[Any], max_attempts: int | None = None, max_claims: int | None = None
    ) -> EventRunResourceQuerySet:
        """The rows a pass gives back, for every run of its batch in one statement."""
        qs = self.filter(run__in=_pks(runs)).unresolved().order_by("run_id", "pk")
        if max_attempts is not None:
            qs = qs.retryable(max_attempts, max_claims)
        return qs

    def unresolved_rows_of(
        self, runs: Iterable[Any], step_ttl: timedelta
    ) -> tuple[list[EventRunResource], dict[Any, tuple]]:
        """``unresolved_for_runs`` read with their steps, its statement compiled once per
        batch size (#27: a sweep pass reads it every time). Answers the rows, and by step
        id what ``EventRunStepQuerySet.for_giving_back`` answers of each step."""
        ids = _pks(runs)
        names = [f.attname for f in self.model._meta.concrete_fields]
        width = len(names)
        rows: list[EventRunResource] = []
        steps: dict[Any, tuple] = {}
        for part in chunked(ids) if ids else []:
            for found in _UNRESOLVED_OF_RUNS.rows(self, step_ttl, runs=part):
                row = self.model.from_db(self.db, names, found[:width])
                rows.append(row)
                if row.step_id is not None:
                    steps[row.step_id] = found[width:]
        return rows, steps

    def unresolved_count(self, run: Any) -> int:
        return self.filter(run=_pk(run)).unresolved().count()

    def unresolved_counts(self, run_ids: Iterable[Any]) -> dict[int, int]:
        """Unresolved counts for many runs, keyed by run id, in ONE query. Runs with
        none are absent from the mapping."""
        ids = _pks(run_ids)
        if not ids:
            return {}
        rows = (
            self.filter(run__in=ids, status__in=UNRESOLVED)
            .order_by()
            .values("run")
            .annotate(n=Count("pk"))
            .values_list("run", "n")
        )
        return dict(rows)

    # ── R5 claims ──

    def claim_revert(self, pk: Any, ttl: timedelta) -> str | None:
        """Claim one row for a revert; answers the claim's token, or None if lost.

        Compare-and-set: ``pending|confirmed|orphaned|drifted → reverting``, or a
        ``reverting`` row whose claim is older than ``ttl`` (``REVERT_CLAIM_TTL``: its
        process died). Exactly one of many concurrent claimers wins. The claim re-stamps
        ``updated_at`` and writes a new token: MySQL counts *matched* rows, and a
        stale row that did not change would match for a second claimer too.
        Reclaiming does not count a revert attempt (a crash is not a failure).
        """
        claim = self.claim_group([pk], ttl=ttl)
        return claim.token if claim.rows else None

    def claim_group(
        self,
        pks: Iterable[Any],
        ttl: timedelta,
        *,
        released: bool = True,
        step_ttl: timedelta | None = None,
        ordered: bool = False,
        token: str | None = None,
    ) -> GroupClaim:
        """Claim many rows in a bounded number of statements, one token for all of them.

        Each row is claimed by its own compare-and-set inside one UPDATE, so each row
        still has exactly one winner; which rows this caller won is read back by token.
        A released row whose target another run now holds cannot go live again: the
        whole UPDATE fails, so those rows are retried one by one and reported as
        ``collided`` instead of raising. ``released=False`` says the caller saw none of
        the rows released (orphaned, drifted) and saves that statement; a row released
        since is then simply not claimed this time.

        With ``step_ttl``, a row whose step is in flight (claimed, claim younger than
        ``step_ttl``) is not claimed, in the same statement: a call of that step may
        still make something, and giving back by key now would miss it.

        ``ordered`` (C8): a row is not claimed while a row of a later phase of its run
        is unresolved (or, with ``step_ttl``, a step of a later phase is in flight),
        decided in the same statement, so concurrent sweepers keep the order too.
        """
        ids = _pks(pks)
        # The caller's token when it gives one: minted before the claim is sent, it is
        # known after a lost answer, and what the claim committed can be read back.
        token = token or new_token()
        if not ids:
            return GroupClaim(token=token)
        # Rows the caller already read are reused, with the claim's fresh fields: reading
        # back only ids and counters is far cheaper than building the rows again.
        known = {
            o.pk: o
            for o in (pks if isinstance(pks, (list, tuple)) else [])
            if isinstance(o, self.model)
        }
        values = _claim_values(token)
        base = self.all()
        if step_ttl is not None:
            steps = self.model._meta.get_field("step").related_model._default_manager
            base = base.exclude(Exists(steps.in_flight(step_ttl).filter(pk=OuterRef("step_id"))))
        if ordered and any(pk not in known for pk in ids):
            # The rows' runs and ranks, read once: what the claim asks about (C8).
            known.update(self.filter(pk__in=[pk for pk in ids if pk not in known]).in_bulk())
        collided: list[int] = []
        # Held rows are live already, so turning them `reverting` can never collide and
        # needs no savepoint inside the caller's transaction.
        for part in chunked(ids):
            rows = base.filter(pk__in=part)
            pairs: dict[str, list[int]] = {"runs": [], "ranks": []}
            if ordered:
                ranked = sorted(
                    {
                        (int(known[pk].run_id), int(known[pk].phase_rank))
                        for pk in part
                        if pk in known and known[pk].phase_rank is not None
                    }
                )
                pairs = {"runs": [r for r, _ in ranked], "ranks": [k for _, k in ranked]}
            # #27: the pass's claim compiled once per size, not built anew each pass.
            claim = _CLAIM_ROWS_IN_ORDER if pairs["runs"] else _CLAIM_ROWS
            retrying_deadlocks(
                partial(
                    claim.update,
                    self,
                    ttl,
                    step_ttl,
                    ordered,
                    rows=part,
                    token=token,
                    **(pairs if pairs["runs"] else {}),
                ),
                using=self.db,
                savepoint=False,
            )
            if not released:
                continue
            if ordered:
                rows = rows.filter(self._in_last_phase(pairs["runs"], pairs["ranks"], step_ttl))
            try:
                unclean = rows.filter(status__in=RELEASED_UNCLEAN)
                retrying_deadlocks(partial(unclean.update, **values), using=self.db)
            except IntegrityError as exc:
                if not is_unique_violation(exc):
                    raise
                for pk in part:
                    one = rows.filter(pk=pk, status__in=RELEASED_UNCLEAN)
                    try:
                        retrying_deadlocks(partial(one.update, **values), using=self.db)
                    except IntegrityError as row_exc:
                        if not is_unique_violation(row_exc):
                            raise
                        collided.append(pk)
        return GroupClaim(token=token, rows=self._won(token, known), collided=collided)

    def expire_claims(self, tokens: Sequence[str], *, uncount: bool = False) -> int:
        """Make the caller's own claims stale at once (its process knows their verdicts
        were never written), so the next claimer need not wait out the TTL. Only rows
        still under those claims move; a claim taken over since is someone else's.
        ``uncount``: no module was called under them, so the claims are not counted
        toward the poison limit (once only, as ``unclaim``)."""
        rows = self.filter(claim_token__in=list(tokens), status=ResourceStatus.REVERTING)
        if not uncount:
            return rows.update(updated_at=LONG_AGO)
        return rows.exclude(updated_at=LONG_AGO).update(
            updated_at=LONG_AGO, claim_count=Greatest(F("claim_count") - 1, Value(0))
        )

    def refresh_claims(self, tokens: Sequence[str]) -> int:
        """Re-stamp the rows still under the caller's claims, whose calls still run or
        whose verdicts it holds and will write: nobody may take them for a dead
        process's and call their module again."""
        # Not a row handed back already (stale at ``LONG_AGO``): re-stamped, it would be
        # claimed again by a hand that no longer calls it, and its count taken back twice.
        return (
            self.filter(claim_token__in=list(tokens), status=ResourceStatus.REVERTING)
            .exclude(updated_at=LONG_AGO)
            .update(updated_at=UtcNow())
        )

    def verdicts_written(self, by_status: Mapping[str, Sequence[Any]], token: str) -> set[int]:
        """Of rows claimed under ``token``, the ones whose verdict this claim wrote: each
        still carries the token (a takeover replaces it) and the status its verdict gave
        it (``by_status``: status -> rows), so a row a reconcile orphaned after its claim
        went stale is not taken for one this claim gave back. Only read when a verdict
        statement matched fewer rows than it was given."""
        return {
            pk
            for status, pks in by_status.items()
            for part in chunked(_pks(pks))
            for pk in self.filter(pk__in=part, claim_token=token, status=status).values_list(
                "pk", flat=True
            )
        }

    def unclaim(self, pks: Any, token: str) -> int:
        """Hand back rows claimed under ``token`` that were never given to a module (the
        pass was asked to stop first): stale at once, and the claim not counted, since
        no call was made that could have killed or hung the sweeper. Once only: a row
        handed back already (stale at ``LONG_AGO``) is not counted back twice when a
        write whose answer was lost is run again."""
        return sum(
            self.filter(pk__in=part, claim_token=token, status=ResourceStatus.REVERTING)
            .exclude(updated_at=LONG_AGO)
            .update(updated_at=LONG_AGO, claim_count=Greatest(F("claim_count") - 1, Value(0)))
            for part in chunked(_pks(pks))
        )

    def _won(self, token: str, known: dict[Any, EventRunResource]) -> list[EventRunResource]:
        won = list(
            self.filter(claim_token=token, status=ResourceStatus.REVERTING)
            .order_by("pk")
            .values_list("pk", "claim_count", "updated_at")
        )
        missing = [pk for pk, _, _ in won if pk not in known]
        for part in chunked(missing) if missing else []:
            known = {**known, **{o.pk: o for o in self.filter(pk__in=part)}}
        rows = []
        for pk, claim_count, updated_at in won:
            row = known[pk]
            row.status, row.claim_token, row.claim_count, row.updated_at = (
                ResourceStatus.REVERTING,
                token,
                claim_count,
                updated_at,
            )
            rows.append(row)
        return rows

    def note_collision(self, pk: Any, max_attempts: int | None = None) -> Holder | None:
        """A released row could not be claimed because another run holds its target:
        spend an attempt with an error naming that run, so the row ends within the
        attempt bound instead of being picked up on every pass."""
        row = self.filter(pk=_pk(pk)).values("owner_module", "kind", "ref").first()
        if row is None:
            return None
        holder = self.held_by(row["owner_module"], row["kind"], row["ref"])
        who = f"run {holder.run_id}" if holder else "another run"
        self.filter(pk=_pk(pk), status__in=RELEASED_UNCLEAN).update(
            revert_attempts=F("revert_attempts") + 1,
            last_error=cut_error(
                f"{row['kind']} {row['ref']!r} is held by {who} now; "
                "giving it back would take it from that run"
            ),
            updated_at=UtcNow(),
        )
        return holder

    # ── R6, R7 verdicts ──

    def _claimed(self, pks: Any, token: str | None) -> list[EventRunResourceQuerySet]:
        out = []
        for part in chunked(_pks(pks)):
            qs = self.filter(pk__in=part, status=ResourceStatus.REVERTING)
            out.append(qs if token is None else qs.filter(claim_token=token))
        return out

    def mark_reverted(self, pks: Any, token: str | None = None) -> int:
        """The revert worked: ``reverting → reverted`` (terminal; releases the target,
        clears the error). With ``token``, only while that claim is the current one."""
        if token is not None:
            # #27: a pass writes this every time; compiled once per size.
            return sum(
                _MARK_REVERTED.update(self, rows=part, token=token)
                for part in chunked(_pks(pks))
                if part
            )
        return sum(
            qs.update(
                status=ResourceStatus.REVERTED, last_error=None, claim_count=0, updated_at=UtcNow()
            )
            for qs in self._claimed(pks, token)
        )

    def fail_revert(
        self,
        pks: Any,
        error: object,
        restore_to: str = ResourceStatus.CONFIRMED,
        token: str | None = None,
        *,
        spent_claims: bool = False,
        spend_to: int | None = None,
    ) -> int:
        """The revert did not work: back to ``restore_to`` with the error (cut to 500).

        ``revert_attempts`` is incremented here and nowhere else, and no sweep resets
        it: a reclaim that reset it made the attempt bound unreachable. With
        ``spent_claims`` the claim counter is kept, marking a poison row as spent; with
        ``spend_to`` (an answer that says retrying is pointless; the caller passes the
        attempt bound) the attempt counter jumps to it, so the run is reported
        ``incomplete`` now, not after that many identical failures.
        """
        if restore_to not in (
            ResourceStatus.CONFIRMED,
            ResourceStatus.DRIFTED,
            ResourceStatus.ORPHANED,
        ):
            raise ValueError(
                f"restore_to must be confirmed, drifted or orphaned, not {restore_to!r}"
            )
        values: dict[str, Any] = {
            "status": restore_to,
            "revert_attempts": (
                F("revert_attempts") + 1
                if spend_to is None
                else Greatest(F("revert_attempts") + 1, Value(spend_to))
            ),
            "last_error": cut_error(error),
            "updated_at": UtcNow(),
        }
        if not spent_claims:
            values["claim_count"] = 0
        return sum(qs.update(**values) for qs in self._claimed(pks, token))

    def reset_attempts(self, run: Any) -> int:
        """The human's licence, never automation's: zero the counters of a run's
        unresolved rows. Answers how many rows. A ``reverting`` row keeps its stamp,
        which dates its claim."""
        return (
            self.filter(run=_pk(run))
            .unresolved()
            .update(
                revert_attempts=0,
                claim_count=0,
                updated_at=Case(
                    When(status=ResourceStatus.REVERTING, then=F("updated_at")), default=UtcNow()
                ),
            )
        )

    # ── R9, R10 reconcile ──

    def live_for_module(self, owner: str, limit: int = 500) -> list[EventRunResource]:
        return list(self.filter(owner_module=owner, status__in=LIVE).order_by("pk")[:limit])

    def modules_with_live_rows(self) -> list[str]:
        # Read in the (status, owner_module) index's own order: a bare DISTINCT led
        # SQLite to walk the whole unique key instead, once most rows were released.
        pairs = (
            self.filter(status__in=LIVE)
            .order_by("status", "owner_module")
            .values_list("status", "owner_module")
            .distinct()
        )
        return sorted({owner for _, owner in pairs})

    def mark_orphaned(self, pks: Any, detail: object = None, *, ttl: timedelta) -> int:
        """Nobody gave it back, it is just gone: ``pending|confirmed → orphaned``, or a
        ``reverting`` row whose claim is stale (its sweeper died). Only reconcile says
        this; a revert that finds nothing is a success. A row under a live revert claim
        is never orphaned: its sweeper's verdict would then be fenced out and a row that
        was given back would read as lost."""
        return sum(
            self.filter(pk__in=part)
            .filter(Q(status__in=LIVE) | self._stale_claim(ttl))
            .update(
                status=ResourceStatus.ORPHANED,
                last_error=None if detail is None else cut_error(detail),
                updated_at=UtcNow(),
            )
            for part in chunked(_pks(pks))
        )


class EventRunLogManager(LedgerManager):
    def write(self, run: Any, kind: str, detail: Mapping[str, Any] | None = None) -> EventRunLog:
        """Append one entry to a run's log (C7)."""
        return self.create(run_id=_pk(run), kind=kind, detail=dict(detail or {}))
