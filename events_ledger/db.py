"""Database facts the ledger depends on: one UTC clock, byte-wise keys, error codes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from django.db import DatabaseError, IntegrityError, connections, models, transaction

T = TypeVar("T")


class UtcNow(models.Func):
    """The database server's clock, in UTC, whatever the session time zone.

    One clock for every stamp and every TTL comparison: several hosts may run the
    sweeper, and MySQL's ``NOW()`` follows the session zone, which Django never sets
    while it stores UTC. Mixing the two makes a fresh claim look stale (or a stale
    one fresh) by the zone's offset.
    """

    template = "CURRENT_TIMESTAMP"
    output_field = models.DateTimeField()

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        return "UTC_TIMESTAMP(6)", []

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        # timestamptz: an instant, independent of the session's TimeZone.
        return "CLOCK_TIMESTAMP()", []

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        # Django keeps SQLite datetimes as naive UTC text; this sorts and compares with it.
        return "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'now')", []


class KeyCharField(models.CharField):
    """A ``CharField`` that compares byte for byte on every backend.

    MySQL/MariaDB's usual default collation (``utf8mb4_unicode_ci``) makes ``Dragon``,
    ``dragon`` and ``dragon `` equal, so two different objects would collide on the
    ledger's unique key and the second would silently never be recorded (rule 1). A
    ``_bin`` collation alone still pads trailing spaces, hence the NO PAD ones.
    SQLite and PostgreSQL already compare deterministically. The collation is chosen
    per connection, not stored in the migration, so the schema is the same for all.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        params = super().db_parameters(connection)
        if connection.vendor == "mysql":
            params["collation"] = (
                "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
            )
        return params


def storable(text: object, limit: int | None = None) -> str:
    """Text every backend can store: no NUL (PostgreSQL refuses it in text and JSON) and
    no lone surrogate (utf8mb4 and PostgreSQL refuse those). A module's error message
    may hold either; refusing to store it would leave a step's outcome unwritten."""
    out = str(text).replace("\x00", "\\x00")
    out = out.encode("utf-8", "replace").decode("utf-8")
    return out if limit is None else out[:limit]


def storable_json(value: Any, depth: int = 0) -> Any:
    """A log detail with every string made storable (see ``storable``)."""
    if isinstance(value, str):
        return storable(value)
    if depth > 20:
        return storable(repr(value))
    if isinstance(value, dict):
        return {storable(k): storable_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable_json(v, depth + 1) for v in value]
    return value


def bounded(items: list[Any], limit: int = 20) -> list[Any]:
    """At most ``limit`` entries of a list for a log entry, and how many were left out:
    20,000 refused entries make one readable entry, not a megabyte."""
    if len(items) <= limit:
        return list(items)
    return [*items[:limit], f"… and {len(items) - limit} more"]


def chunked(items: list[Any], size: int = 2000) -> list[list[Any]]:
    """Id lists cut under every backend's bind-parameter limit (SQLite's 32,766 and
    PostgreSQL's 65,535), so one step's 100,000 rows are claimed and given back."""
    return [items[i : i + size] for i in range(0, len(items), size)] or [[]]


def _driver_error(exc: BaseException) -> BaseException:
    return exc.__cause__ or exc


def is_unique_violation(exc: BaseException) -> bool:
    err = _driver_error(exc)
    code = getattr(err, "args", (None,))[0] if getattr(err, "args", None) else None
    if code == 1062:  # MySQL ER_DUP_ENTRY
        return True
    if getattr(err, "sqlstate", None) == "23505":  # PostgreSQL unique_violation
        return True
    return "UNIQUE constraint failed" in str(err)


def is_deadlock(exc: BaseException) -> bool:
    err = _driver_error(exc)
    code = err.args[0] if getattr(err, "args", None) else None
    if code in (1213, 1205):  # MySQL deadlock, lock wait timeout
        return True
    if getattr(err, "sqlstate", None) in ("40P01", "40001"):
        return True
    # SQLite's deferred transaction that read first and then wants to write fails at
    # once with SQLITE_BUSY when another connection writes: a deadlock by another name
    # (no busy timeout can help), and the cure is the same, restarting the transaction.
    return type(err).__module__.startswith("sqlite3") and "database is locked" in str(err)


def is_connection_lost(exc: BaseException) -> bool:
    err = _driver_error(exc)
    code = err.args[0] if getattr(err, "args", None) else None
    return code in (2006, 2013)


def _deadlock_retried(fn: Callable[[], T], retryable: Callable[[], bool], tries: int = 5) -> T:
    """The one retry loop: ``fn`` again while the database picks it as a deadlock victim
    and ``retryable()`` says the rolled-back work is ``fn``'s own to redo."""
    for attempt in range(tries):
        try:
            return fn()
        except (DatabaseError, IntegrityError) as exc:
            if not retryable() or not is_deadlock(exc) or attempt == tries - 1:
                raise
            time.sleep(0.005 * (attempt + 1))
    raise AssertionError("unreachable")


def retrying_deadlocks(
    fn: Callable[[], T], *, using: str = "default", tries: int = 5, savepoint: bool = True
) -> T:
    """Run ``fn`` (statements that are each safe on their own), retrying it when the
    database picks it as a deadlock victim.

    A MariaDB deadlock rolls back the caller's whole transaction, which no savepoint
    survives; so inside an outer transaction the error is re-raised for the owner of
    that transaction to handle, and only a call that owns its transaction retries.
    ``savepoint=False`` says ``fn`` cannot be refused (no unique key it may hit), so
    inside a transaction it needs no savepoint (two round trips saved).
    """
    outer = connections[using].in_atomic_block

    def run() -> T:
        if not outer or not savepoint:
            # Autocommit: each statement is its own transaction and a failed one
            # poisons nothing, so no BEGIN/COMMIT round trips are spent.
            return fn()
        # Inside the caller's transaction: a savepoint, so a refused INSERT
        # (IntegrityError) leaves the caller's transaction usable.
        with transaction.atomic(using=using):
            return fn()

    return _deadlock_retried(run, lambda: not outer, tries)


_retrying = threading.local()


def _retry_statement(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    # Outside a transaction the statement was its own transaction, and a deadlock
    # victim (or a write Galera's certification refused: the same error, 1213) was
    # rolled back whole: running it again is the retry at the transaction boundary.
    # Inside one, the transaction's owner must retry it.
    conn = context["connection"]
    return _deadlock_retried(
        lambda: execute(sql, params, many, context), lambda: not conn.in_atomic_block
    )


@contextmanager
def statements_retried(using: str = "default") -> Iterator[None]:
    """Every autocommitted statement the ledger runs in this block is retried when the
    database picks it as a deadlock victim. One place for the rule, so no statement of
    a step or a sweep can end a worker with an unretried 1213; statements inside an
    atomic block are left to its owner. Module calls run in their own threads, on
    their own connections, and are never retried by this."""
    conn = connections[using]
    if getattr(_retrying, "conn", None) is conn:
        yield  # already installed on this thread's connection
        return
    _retrying.conn = conn
    try:
        with conn.execute_wrapper(_retry_statement):
            yield
    finally:
        _retrying.conn = None


def in_transaction(fn: Callable[[], T], *, using: str = "default", tries: int = 5) -> T:
    """Run ``fn`` as one transaction: what must be durable at the same moment costs one
    commit (one log flush on a durable server) instead of one per statement.

    A deadlock victim (or a write Galera's certification refused at COMMIT) has had its
    whole transaction rolled back: it is run again from the start, which is the retry at
    the transaction boundary. Inside a caller's transaction it is a savepoint, and the
    caller's transaction, which the deadlock rolled back, is the caller's to retry.
    Never put a module call inside ``fn``: a transaction must stay short.
    """
    outer = connections[using].in_atomic_block

    def run() -> T:
        with transaction.atomic(using=using):
            return fn()

    return _deadlock_retried(run, lambda: not outer, tries)
