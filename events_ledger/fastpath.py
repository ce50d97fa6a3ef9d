"""The fast path: each of a small step's two transactions in one round trip.

An optimisation of ``ledger``'s general path, which stays the truth. A step's first
transaction (the run's dirty mark, the claim, the placeholder, the step read back) and
its second (the outcome, the rows, the placeholder resolved) each take seven round trips
through ``atomic``; sent as one statement each is one. On MariaDB that statement is a
compound statement (``BEGIN NOT ATOMIC … END``) whose every branch the server decides on
the counts of the statement before; on PostgreSQL (#27) it is one statement of
data-modifying CTEs, which autocommit makes one transaction. A block commits only in the
common case: anything else rolls back whole and the general path does the work again,
from what the database says, as if this had not been tried.

The fence, after the fault review of #24:

- a block that fails half-way is rolled back by the client at once (MariaDB rolls back
  only the failed statement: the session would stay inside a transaction Django does
  not know of, and the host's next write on it would be lost), and the connection is
  closed when even that cannot be sent;
- a block whose answer was lost may have committed: what it did is read back (the
  step's claim token and status) and never sent again blindly;
- a block is never retried statement by statement (``db.unretried``): after a lock
  wait, a retried block's ``START TRANSACTION`` would commit the half that ran.

Off with ``EVENTS_LEDGER["FAST_PATH"] = False``. Only MariaDB through mysqlclient and
PostgreSQL through psycopg 3 take it: MySQL has no compound statement outside a stored
program (and no MySQL server runs in the tests to prove another form), and SQLite is
one file on the same machine, where a round trip costs next to nothing. Nothing is prepared on the server: a prepared block is session state,
which poolers pin and ``CONN_MAX_AGE=0`` prepares again on every connection.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, connections

from .conf import ledger_settings
from .db import (
    Answer,
    Statement,
    causal_reads,
    driver_code,
    drop_if_dead,
    is_held,
    ledger_db,
    sqlstate,
    unretried,
)
from .models import EventRun, EventRunResource, EventRunStep
from .states import StepStatus

logger = logging.getLogger("events_ledger")

#: The error a finishing block raises when it rolled itself back (a user-defined error
#: number, in the range MariaDB leaves to applications).
NOT_AS_EXPECTED = 45_901
#: PostgreSQL's finishing statement fails on purpose (a division by zero, SQLSTATE
#: 22012) when its counts are not the common case's: the whole statement is rolled back.
NOT_AS_EXPECTED_STATE = "22012"


class NotAsExpected(Exception):
    """The block's counts were not those of the common case: it rolled itself back."""


def enabled(using: str | None = None) -> bool:
    """Whether a step's transactions take the fast path on this connection now."""
    if not ledger_settings.FAST_PATH:
        return False
    conn = connections[ledger_db(using)]
    return (
        _speaks(conn)
        # A transaction Django opened, or a caller's autocommit off: its boundaries are
        # the caller's (a block's START TRANSACTION would commit the caller's work, and
        # PostgreSQL's one statement would become part of the caller's transaction).
        and not conn.in_atomic_block
        and conn.get_autocommit()
    )


def _speaks(conn: Any) -> bool:
    """MariaDB through mysqlclient itself (its result sets are read one by one), or
    PostgreSQL through psycopg 3. Not psycopg2: its ``nextset()`` raises after the
    statement has committed, so every step would fall back on its read-back; it takes
    the general path, tested on it."""
    if conn.vendor == "postgresql":
        return getattr(getattr(conn, "Database", None), "__name__", "") == "psycopg"
    return (
        conn.vendor == "mysql"
        and getattr(getattr(conn, "Database", None), "__name__", "") == "MySQLdb"
        and bool(getattr(conn, "mysql_is_mariadb", False))
    )


def _send(block: Statement, using: str | None = None) -> list[Answer]:
    """Send one compound statement; answers the result of each SELECT it ran.

    A block that raises has ended its transaction before this returns: rolled back by
    the server (``NotAsExpected``), by a ROLLBACK sent here, or with the connection,
    closed when the ROLLBACK could not be sent (the server rolls back at the close)."""
    conn = connections[ledger_db(using)]
    sql, params = block
    try:
        with unretried(conn), conn.cursor() as cursor:
            cursor.execute(sql, list(params))
            raw = cursor.cursor
            answers: list[Answer] = []
            with conn.wrap_database_errors:
                # A statement that fails ends the block; its error is raised here (by
                # ``nextset``), after the results of those that went before it.
                while True:
                    if raw.description:
                        answers.append(Answer(max(int(raw.rowcount), 0), list(raw.fetchall())))
                    if not raw.nextset():
                        break
            return answers
    except DatabaseError as exc:
        if driver_code(exc) == NOT_AS_EXPECTED or sqlstate(exc) == NOT_AS_EXPECTED_STATE:
            # Rolled back whole: MariaDB's block sent ROLLBACK itself, and PostgreSQL's
            # one statement is its own transaction in autocommit.
            if conn.vendor == "postgresql":
                _end_transaction(conn, exc)  # the session says so too, for psycopg
            raise NotAsExpected from exc
        _end_transaction(conn, exc)
        raise
    except BaseException as exc:
        _end_transaction(conn, exc)
        raise


def _end_transaction(conn: Any, exc: BaseException) -> None:
    if drop_if_dead(exc, conn.alias):
        return  # closed: the server rolls back what the session had open
    try:
        with unretried(conn), conn.cursor() as cursor:
            cursor.execute("ROLLBACK")
    except BaseException:
        logger.warning("a failed block could not be rolled back; closing its connection")
        try:
            conn.close()
        except Exception:  # the error to raise is the block's, not the close's
            conn.connection = None


# ── a step's first transaction ──


@dataclass(frozen=True)
class Claimed:
    """A claim the fast path won: the step as the claim left it, and the placeholder's
    id (None: not inserted under this claim, so this step's earlier attempt wrote it)."""

    step: Any
    token: str
    placeholder_id: int | None


def claim(
    step: Any,
    *,
    ttl: timedelta,
    by: str,
    max_attempts: int,
    owner: str,
    payload: Mapping[str, Any],
    ordered: bool = True,
) -> Claimed | None:
    """The claim of a step not read first, in one compound statement that commits at its
    end: the run's dirty mark (matching tells the run has not ended; else its status is
    read), the claim only then (and only while the step is claimable, still of its
    action, under ``max_attempts``), the placeholder only when the claim was won, and
    one SELECT of the step's attempts and parameters with the INSERT's count and id.

    Answers None when the claim is not this call's: lost, or not committed, for the
    general path to decide. A block that failed is read back by its token: only a
    claim the database holds is answered as won."""
    steps = EventRunStep.objects
    token = steps.new_claim_token()
    if connections[ledger_db()].vendor == "postgresql":
        return _claim_in_one_statement(step, token, ttl, by, max_attempts, owner, payload, ordered)
    runs = EventRun.objects.all()
    live_sql, live_params = runs.live_statement(step.run_id)
    parts: list[Statement] = [
        (
            "BEGIN NOT ATOMIC\n"
            "DECLARE marked, live, claimed, inserted_rows, inserted_id BIGINT DEFAULT 0",
            [],
        ),
        ("START TRANSACTION", []),
        runs.mark_dirty_statement(step.run_id),
        ("SET marked = ROW_COUNT()", []),
        (f"SET live = IF(marked = 1, 1, EXISTS({live_sql}))", list(live_params)),
        steps.claim_unread_statement(step, ttl, by, max_attempts, token, live="live"),
        ("SET claimed = ROW_COUNT()", []),
        EventRunResource.objects.placeholder_insert(
            step, owner, payload, ordered=ordered, only_if="claimed = 1"
        ),
        ("SET inserted_rows = ROW_COUNT(), inserted_id = LAST_INSERT_ID()", []),
        steps.claimed_in_block_statement(step),
        ("COMMIT", []),
        ("END", []),
    ]
    block = (";\n".join(sql for sql, _ in parts), [p for _, ps in parts for p in ps])
    try:
        [read] = _send(block)
    except Exception as exc:
        logger.warning("step %s: its claim's block failed; reading back", step.pk, exc_info=True)
        return _claim_read_back(step, token, exc)
    if not read.rows:
        return None
    attempts, params, inserted, new_id = steps.claimed_in_block(read.rows)
    placeholder = int(new_id) if inserted == 1 and new_id else None
    return Claimed(steps.claimed_step(step, token, attempts, params), token, placeholder)


def _claim_in_one_statement(
    step: Any,
    token: str,
    ttl: timedelta,
    by: str,
    max_attempts: int,
    owner: str,
    payload: Mapping[str, Any],
    ordered: bool,
) -> Claimed | None:
    """``claim`` on PostgreSQL: one statement, so one transaction in autocommit. The
    run's mark and the claim are CTEs (each runs to completion, read or not); the claim
    reads the run under its lock (``live``); the placeholder goes in once for each row the claim
    returned (none when it was lost), skipping a target already held; the statement
    answers the step's attempts and parameters with the placeholder's new id."""
    steps = EventRunStep.objects
    runs = EventRun.objects.all()
    mark_sql, mark_params = runs.mark_dirty_statement(step.run_id)
    live_sql, live_params = runs.live_statement(step.run_id)
    # The claim decides on the run under the run's lock (``live``, FOR SHARE): its own
    # test of the run's status read the statement's snapshot, which a cancel committed
    # after it began does not change.
    claim_sql, claim_params = steps.claim_unread_statement(
        step, ttl, by, max_attempts, token, live="(SELECT COUNT(*) FROM live)"
    )
    insert_sql, insert_params = EventRunResource.objects.placeholder_insert(
        step, owner, payload, ordered=ordered, only_if="claimed"
    )
    statement = (
        f"WITH marked AS ({mark_sql} RETURNING 1), "
        f"live AS ({live_sql}), "
        f"claimed AS ({claim_sql} RETURNING attempts, params), "
        f"inserted AS ({insert_sql}) "
        "SELECT claimed.attempts, claimed.params, (SELECT id FROM inserted) FROM claimed",
        [*mark_params, *live_params, *claim_params, *insert_params],
    )
    try:
        [read] = _send(statement)
    except Exception as exc:
        logger.warning(
            "step %s: its claim's statement failed; reading back", step.pk, exc_info=True
        )
        return _claim_read_back(step, token, exc)
    if not read.rows:
        return None
    [(attempts, params, new_id)] = read.rows
    [(attempts, params)] = steps.claimed_converted([(attempts, params)])
    placeholder = int(new_id) if new_id else None
    return Claimed(steps.claimed_step(step, token, attempts, params), token, placeholder)


def _claim_read_back(step: Any, token: str, exc: Exception) -> Claimed | None:
    """What a claim's block that failed left: its transaction committed (our token is on
    the step; its placeholder went in with it) or nothing of it did. Nothing of it, and
    the server gave up on a wait (a lock wait timeout, an interrupt): the error is the
    caller's, not the general path's to send into the same wait again."""
    with causal_reads():
        found = EventRunStep.objects.under_claim(step, token)
    if found is None:
        if is_held(exc):
            raise exc
        return None
    attempts, params = found
    logger.warning("step %s: its claim's block had committed", step.pk)
    return Claimed(EventRunStep.objects.claimed_step(step, token, attempts, params), token, None)


# ── a step's second transaction ──


def finish(
    step: Any,
    token: str,
    run: Any,
    owner: str,
    rows: Sequence[Mapping[str, Any]],
    placeholder_id: int,
    ordered: bool = True,
) -> bool:
    """The outcome of a clean answer (``done``, fenced by the claim), its rows and the
    placeholder's resolution in one compound statement, committed only when each did
    what it does when every row goes in; answers whether it committed. False: nothing
    of it is on the ledger, and the general path writes the answer and words what
    happened. A block that failed is read back: committed if the step is ``done``
    under this claim (the outcome, the rows and the placeholder committed together)."""
    statements = [EventRunStep.objects.settle_statement(step, token, StepStatus.DONE)]
    if rows:
        insert = EventRunResource.objects.record_statement(run, step, owner, rows, ordered)
        if insert is None:
            return False  # more rows than one INSERT takes
        statements.append(insert)
    statements.append(EventRunResource.objects.resolve_statement(placeholder_id))
    expected = [1, len(rows), 1] if rows else [1, 1]
    postgresql = connections[ledger_db()].vendor == "postgresql"
    committing = _one_statement_if if postgresql else _committing_if
    try:
        _send(committing(statements, expected))
    except NotAsExpected:
        return False
    except Exception:
        logger.warning("step %s: its outcome's block failed; reading back", step.pk, exc_info=True)
        with causal_reads():
            return EventRunStep.objects.status_under(step, token) == StepStatus.DONE
    return True


def _committing_if(statements: list[Statement], expected: list[int]) -> Statement:
    """``statements`` as one compound statement that commits when each counts the rows
    ``expected`` says (``ROW_COUNT()``: matched rows for an UPDATE, as the connection's
    CLIENT_FOUND_ROWS has it), and otherwise rolls back and raises ``NOT_AS_EXPECTED``,
    so that a block that committed answers nothing to read."""
    counts = [f"n{i}" for i in range(len(statements))]
    body = [f"DECLARE {', '.join(counts)} BIGINT DEFAULT -1", "START TRANSACTION"]
    for (sql, _), name in zip(statements, counts, strict=True):
        body += [sql, f"SET {name} = ROW_COUNT()"]
    agreed = " AND ".join(f"{n} = {int(e)}" for n, e in zip(counts, expected, strict=True))
    body.append(
        f"IF {agreed} THEN COMMIT; ELSE ROLLBACK; "
        f"SIGNAL SQLSTATE '45000' SET MYSQL_ERRNO = {NOT_AS_EXPECTED}, "
        "MESSAGE_TEXT = 'events-ledger: rolled back, not as expected'; END IF"
    )
    return (
        "BEGIN NOT ATOMIC\n" + ";\n".join(body) + ";\nEND",
        [p for _, values in statements for p in values],
    )


def _one_statement_if(statements: list[Statement], expected: list[int]) -> Statement:
    """``statements`` (UPDATEs and INSERTs) as one PostgreSQL statement of CTEs that
    fails, and so is rolled back whole, unless each counts the rows ``expected`` says:
    a division by zero (``NOT_AS_EXPECTED_STATE``) where the counts differ."""
    parts: list[str] = []
    checks: list[str] = []
    params: list[Any] = []
    for i, ((sql, values), count) in enumerate(zip(statements, expected, strict=True)):
        returning = sql if " RETURNING " in sql else f"{sql} RETURNING 1"
        parts.append(f"s{i} AS ({returning})")
        checks.append(f"(SELECT COUNT(*) FROM s{i}) = {int(count)}")
        params.extend(values)
    return (
        f"WITH {', '.join(parts)} SELECT 1 / (CASE WHEN {' AND '.join(checks)} THEN 1 ELSE 0 END)",
        params,
    )
