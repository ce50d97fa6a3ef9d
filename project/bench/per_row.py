"""The seeds' original protocol, statement for statement, on the ledger's own tables.

The yardstick the ledger is measured against: the Node.js design wrote one row at a
time, each statement autocommitted (its own commit), as plain queries through its
driver (mysql2). Modelled here the same way: the same statements as plain SQL through a
cursor, never batched and never inside ``transaction.atomic``, so that every statement is
a commit as it was there and costs what the statement costs, not what building an ORM
query costs (#27: one ORM call per statement made the yardstick about twice as slow as
the protocol it models).

Write half, per step (4 + 2n): placeholder INSERT, mark the run dirty, per resource an
INSERT (pending) and an UPDATE (confirm), mark dirty again, resolve the placeholder.
Undo half, per run (7 + 2n, for a run of one step): read the run's unresolved rows; per
group read its step, per row a claim UPDATE, the call, per row a verdict UPDATE, one
log INSERT; then count what is left, read the retryable rows, set the run's
cleanup_status, write the summary log. (Their sweep's scan for runs, one statement per
pass of ten runs, is left out: the runs are known here.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from django.db import connection
from django.utils import timezone

from events_ledger.conf import ledger_settings
from events_ledger.models import (
    STEP_KIND,
    UNRESOLVED,
    EventRun,
    EventRunLog,
    EventRunResource,
    EventRunStep,
)

#: What a claim may take: anything unresolved but a claim still fresh (R5).
CLAIMABLE = ("pending", "confirmed", "orphaned", "drifted")


def _table(model: Any) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def _now() -> str:
    """The server's UTC clock, as the ledger stamps it (``db.UtcNow``)."""
    return {
        "mysql": "UTC_TIMESTAMP(6)",
        "postgresql": "CLOCK_TIMESTAMP()",
    }.get(connection.vendor, "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now')")


def _in(values: Sequence[Any]) -> str:
    return ", ".join(["%s"] * len(values))


def _run(sql: str, params: Sequence[Any] = ()) -> int:
    """One statement, autocommitted; answers the rows it counts."""
    with connection.cursor() as cursor:
        cursor.execute(sql, list(params))
        return int(cursor.rowcount)


def _rows(sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(sql, list(params))
        return list(cursor.fetchall())


def _insert_row(
    run_id: int, step_id: int | None, owner: str, kind: str, ref: str, payload: Any
) -> int:
    """The seeds' reserve: one INSERT of a pending row; answers its id."""
    columns = (
        "run_id, step_id, owner_module, kind, ref, payload, status, revert_attempts, "
        "claim_count, created_at, updated_at"
    )
    sql = (
        f"INSERT INTO {_table(EventRunResource)} ({columns}) VALUES "
        f"(%s, %s, %s, %s, %s, %s, 'pending', 0, 0, {_now()}, {_now()})"
    )
    params = [run_id, step_id, owner, kind, ref, None if payload is None else json.dumps(payload)]
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(sql, params)
            return int(cursor.lastrowid)
        cursor.execute(sql + " RETURNING id", params)
        return int(cursor.fetchone()[0])


def _log(run_id: int, kind: str, detail: dict[str, Any]) -> None:
    _run(
        f"INSERT INTO {_table(EventRunLog)} (run_id, kind, detail, created_at) "
        f"VALUES (%s, %s, %s, {_now()})",
        [run_id, kind, json.dumps(detail)],
    )


def _mark_dirty(run_id: int) -> None:
    # Guarded: never walks a run back from complete/incomplete to pending.
    _run(
        f"UPDATE {_table(EventRun)} SET cleanup_status = 'pending' "
        "WHERE id = %s AND cleanup_status = 'not_required'",
        [run_id],
    )


def record_step(
    run: EventRun, step: EventRunStep, owner: str, perform: Callable[..., dict[str, Any]]
) -> int:
    """The write half for one step; answers how many resources it recorded."""
    rows = _table(EventRunResource)
    placeholder = _insert_row(
        run.pk,
        step.pk,
        owner,
        STEP_KIND,
        step.idempotency_key,
        {"action": step.action_id, "phase": step.phase, "seq": step.seq},
    )
    _mark_dirty(run.pk)
    answer = perform(run_id=run.pk, params=step.params, idempotency_key=step.idempotency_key)
    recorded = 0
    for entry in answer.get("resources", []):
        row = _insert_row(run.pk, step.pk, owner, entry["kind"], entry["ref"], entry.get("payload"))
        recorded += _run(
            f"UPDATE {rows} SET status = 'confirmed', updated_at = {_now()} "
            "WHERE id = %s AND status = 'pending'",
            [row],
        )
    if recorded:
        _mark_dirty(run.pk)
    _run(
        f"UPDATE {rows} SET status = 'reverted', last_error = NULL, updated_at = {_now()} "
        "WHERE id = %s AND kind = %s AND status IN ('pending', 'confirmed')",
        [placeholder, STEP_KIND],
    )
    return recorded


def give_back_run(run: EventRun, revert: Callable[..., dict[str, Any]]) -> int:
    """The undo half for one terminal run; answers how many rows it gave back."""
    max_attempts = ledger_settings.MAX_REVERT_ATTEMPTS
    ttl: timedelta = ledger_settings.REVERT_CLAIM_TTL
    rows_table = _table(EventRunResource)
    unresolved = list(UNRESOLVED)
    rows = _rows(
        f"SELECT id, step_id, kind, ref, payload FROM {rows_table} "
        f"WHERE run_id = %s AND status IN ({_in(unresolved)}) AND revert_attempts < %s "
        "ORDER BY id",
        [run.pk, *unresolved, max_attempts],
    )
    groups: dict[Any, list[tuple[Any, ...]]] = {}
    for row in rows:
        groups.setdefault(row[1] if row[1] is not None else f"row:{row[0]}", []).append(row)
    stale = connection.ops.adapt_datetimefield_value(timezone.now() - ttl)
    attempted = reverted = 0
    for group in groups.values():
        step_id = group[0][1]
        step = (
            _rows(
                f"SELECT action_id, idempotency_key FROM {_table(EventRunStep)} WHERE id = %s",
                [step_id],
            )
            if step_id is not None
            else []
        )
        claimed = [
            row
            for row in group
            if _run(
                f"UPDATE {rows_table} SET status = 'reverting', updated_at = {_now()} "
                f"WHERE id = %s AND (status IN ({_in(CLAIMABLE)}) "
                "OR (status = 'reverting' AND updated_at < %s))",
                [row[0], *CLAIMABLE, stale],
            )
        ]
        if not claimed:
            continue
        attempted += len(claimed)
        answer = revert(
            run_id=run.pk,
            resources=[
                {"kind": kind, "ref": ref, "payload": payload}
                for _, _, kind, ref, payload in claimed
                if kind != STEP_KIND
            ],
            idempotency_key=step[0][1] if step else group[0][3],
        )
        done = answer.get("ok") is True
        for row in claimed:
            if done:
                _run(
                    f"UPDATE {rows_table} SET status = 'reverted', last_error = NULL, "
                    f"updated_at = {_now()} WHERE id = %s",
                    [row[0]],
                )
                reverted += 1
            else:
                # The seeds' failRevert: back to confirmed, one attempt more (rule 2).
                _run(
                    f"UPDATE {rows_table} SET status = 'confirmed', "
                    "revert_attempts = revert_attempts + 1, last_error = %s, "
                    f"updated_at = {_now()} WHERE id = %s",
                    [str(answer)[:500], row[0]],
                )
        _log(
            run.pk,
            "cleanup.reverted" if done else "cleanup.failed",
            {
                "what": step[0][0] if step else None,
                "resources": [f"{kind}:{ref}" for _, _, kind, ref, _ in claimed],
            },
        )
    [(remaining,)] = _rows(
        f"SELECT COUNT(*) FROM {rows_table} WHERE run_id = %s AND status IN ({_in(unresolved)})",
        [run.pk, *unresolved],
    )
    retryable = _rows(
        f"SELECT id FROM {rows_table} WHERE run_id = %s AND status IN ({_in(unresolved)}) "
        "AND revert_attempts < %s",
        [run.pk, *unresolved, max_attempts],
    )
    status = "complete" if remaining == 0 else ("pending" if retryable else "incomplete")
    _run(f"UPDATE {_table(EventRun)} SET cleanup_status = %s WHERE id = %s", [status, run.pk])
    if attempted:
        _log(
            run.pk,
            "cleanup.swept",
            {"attempted": attempted, "reverted": reverted, "remaining": remaining},
        )
    return reverted
