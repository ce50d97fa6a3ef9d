"""Database facts the ledger depends on: one UTC clock, byte-wise keys, error codes."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import DatabaseError, IntegrityError, connections, models, transaction
from django.db.models.sql import UpdateQuery

T = TypeVar("T")


def ledger_db(using: str | None = None) -> str:
    """The alias the ledger reads and writes: ``using`` when a caller names one, else
    ``EVENTS_LEDGER["DATABASE"]``. Never the host's router: its reads may go to a replica."""
    if using is not None:
        return using
    from .conf import ledger_settings

    return ledger_settings.DATABASE


class LedgerManager(models.Manager[Any]):
    """Every query of a ledger model goes to the ledger's alias (``ledger_db``), unless
    the caller names another with ``using``/``db_manager``. Also the models' base manager,
    so a related row (``step.run``) and ``refresh_from_db`` are read there too."""

    def get_queryset(self) -> models.QuerySet[Any]:
        queryset = super().get_queryset()
        return queryset if self._db else queryset.using(ledger_db())


class LedgerModel(models.Model):
    """A ledger table: an instance is saved and deleted on the ledger's alias, whatever
    a host's router says for writes (and whatever alias it set on the instance when a
    related row was assigned), unless the caller names one."""

    class Meta:
        abstract = True

    def save(self, *args: Any, using: str | None = None, **kwargs: Any) -> None:
        super().save(*args, using=using or ledger_db(), **kwargs)

    def delete(self, using: str | None = None, keep_parents: bool = False) -> Any:
        return super().delete(
            using=using or self._state.db or ledger_db(), keep_parents=keep_parents
        )


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


#: Ids per statement: under every backend's bind-parameter limit.
CHUNK = 2000


def chunked(items: list[Any], size: int = CHUNK) -> list[list[Any]]:
    """Id lists cut under every backend's bind-parameter limit (SQLite's 32,766 and
    PostgreSQL's 65,535), so one step's 100,000 rows are claimed and given back."""
    return [items[i : i + size] for i in range(0, len(items), size)] or [[]]


class InCallersTransaction(RuntimeError):
    """A call that reaches a module was made inside a transaction the ledger does not own.

    Rule 1 needs a step's claim and placeholder (a revert's claim, a human's reset)
    committed *before* the module is called. Inside a caller's transaction
    (``transaction.atomic()``, ``ATOMIC_REQUESTS``, autocommit off) the ledger's commits
    are savepoints: a rollback after the call leaves the world changed and the ledger
    without a line of it, and no sweep ever gives it back. Refused up front, with
    nothing claimed and no module called."""


def callers_transaction(using: str | None = None) -> bool:
    """Whether a transaction the ledger did not open is in force on ``using``.

    The same test as Django's ``atomic(durable=True)``: a test case's own wrapping
    transaction (``TestCase``, pytest-django's ``db``) is not a caller's, since it is
    there only to be rolled back after the test."""
    using = ledger_db(using)
    conn = connections[using]
    if conn.in_atomic_block:
        return any(not getattr(block, "_from_testcase", False) for block in conn.atomic_blocks)
    return not conn.get_autocommit()


def refuse_callers_transaction(what: str, using: str | None = None) -> None:
    """Raise ``InCallersTransaction`` before ``what`` claims anything or calls a module."""
    using = ledger_db(using)
    if callers_transaction(using):
        raise InCallersTransaction(
            f"{what} calls a module, so its claims must commit before the call; it is "
            "inside a transaction it does not own (transaction.atomic(), ATOMIC_REQUESTS or "
            "autocommit off), where they would only be savepoints. Call it after the "
            "transaction commits (transaction.on_commit), or mark the view "
            "non_atomic_requests."
        )


def _driver_error(exc: BaseException) -> BaseException:
    return exc.__cause__ or exc


def _state(err: BaseException) -> str | None:
    """PostgreSQL's SQLSTATE as either driver has it: psycopg 3's ``sqlstate``, psycopg2's
    ``pgcode`` (read as the first only, a held target was an IntegrityError on psycopg2,
    and no deadlock or lock timeout was ever recognised)."""
    return getattr(err, "sqlstate", None) or getattr(err, "pgcode", None)


def is_unique_violation(exc: BaseException) -> bool:
    err = _driver_error(exc)
    code = getattr(err, "args", (None,))[0] if getattr(err, "args", None) else None
    if code == 1062:  # MySQL ER_DUP_ENTRY
        return True
    if _state(err) == "23505":  # PostgreSQL unique_violation
        return True
    return "UNIQUE constraint failed" in str(err)


def is_deadlock(exc: BaseException) -> bool:
    """A deadlock victim or a serialization failure: the other party goes on, so the
    work rolled back is redone at once. Not a lock wait that timed out (``is_held``)."""
    err = _driver_error(exc)
    code = err.args[0] if getattr(err, "args", None) else None
    if code == 1213:  # MySQL deadlock (and Galera's certification failure)
        return True
    # PostgreSQL's deadlock and serialization failure.
    if _state(err) in ("40P01", "40001"):
        return True
    # SQLite's deferred transaction that read first and then wants to write fails at
    # once with SQLITE_BUSY when another connection writes: a deadlock by another name
    # (no busy timeout can help), and the cure is the same, restarting the transaction.
    return type(err).__module__.startswith("sqlite3") and "database is locked" in str(err)


def is_held(exc: BaseException) -> bool:
    """The server gave up on a statement that waited (a lock wait timeout: MySQL's 1205,
    PostgreSQL's ``lock_timeout``) or was interrupted (``KILL QUERY``, a statement time
    limit: MariaDB's 1317 and 1969, MySQL's 3024, PostgreSQL's ``query_canceled``).
    Whoever holds the lock still holds it: the same statement sent again waits again,
    so it is never retried at once."""
    err = _driver_error(exc)
    code = err.args[0] if getattr(err, "args", None) else None
    if code in (1205, 1317, 1969, 3024):
        return True
    return _state(err) in ("55P03", "57014")


def is_connection_lost(exc: BaseException) -> bool:
    """The server or the network ended the session: MySQL's "gone away" and "lost
    connection" (2006, 2013, 2055), PostgreSQL's connection errors (class 08) and a
    backend terminated (57P01-57P03)."""
    err = _driver_error(exc)
    code = err.args[0] if getattr(err, "args", None) else None
    if code in (2006, 2013, 2055):
        return True
    state = _state(err) or ""
    return state.startswith("08") or state in ("57P01", "57P02", "57P03")


#: Conflicts retried in this process, by what was run again (``statement``,
#: ``transaction``, ``verdicts``): a figure for the chaos suite and an operator's log,
#: never a decision.
retries: Counter[str] = Counter()


def _deadlock_retried(
    fn: Callable[[], T], retryable: Callable[[], bool], tries: int = 5, what: str = "statement"
) -> T:
    """The one retry loop: ``fn`` again while the database picks it as a deadlock victim
    and ``retryable()`` says the rolled-back work is ``fn``'s own to redo."""
    for attempt in range(tries):
        try:
            return fn()
        except (DatabaseError, IntegrityError) as exc:
            if not retryable() or not is_deadlock(exc) or attempt == tries - 1:
                raise
            retries[what] += 1
            time.sleep(0.005 * (attempt + 1))
    raise AssertionError("unreachable")


def retrying_deadlocks(
    fn: Callable[[], T], *, using: str | None = None, tries: int = 5, savepoint: bool = True
) -> T:
    """Run ``fn`` (statements that are each safe on their own), retrying it when the
    database picks it as a deadlock victim.

    A MariaDB deadlock rolls back the caller's whole transaction, which no savepoint
    survives; so inside an outer transaction the error is re-raised for the owner of
    that transaction to handle, and only a call that owns its transaction retries.
    ``savepoint=False`` says ``fn`` cannot be refused (no unique key it may hit), so
    inside a transaction it needs no savepoint (two round trips saved).
    """
    using = ledger_db(using)
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
        lambda: execute(sql, params, many, context),
        lambda: not conn.in_atomic_block and not _is_unretried(conn),
    )


@contextmanager
def statements_retried(using: str | None = None) -> Iterator[None]:
    """Every autocommitted statement the ledger runs in this block is retried when the
    database picks it as a deadlock victim. One place for the rule, so no statement of
    a step or a sweep can end a worker with an unretried 1213; statements inside an
    atomic block are left to its owner. Module calls run in their own threads, on
    their own connections, and are never retried by this."""
    using = ledger_db(using)
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


def in_transaction(fn: Callable[[], T], *, using: str | None = None, tries: int = 5) -> T:
    """Run ``fn`` as one transaction: what must be durable at the same moment costs one
    commit (one log flush on a durable server) instead of one per statement.

    A deadlock victim (or a write Galera's certification refused at COMMIT) has had its
    whole transaction rolled back: it is run again from the start, which is the retry at
    the transaction boundary. Inside a caller's transaction it is a savepoint, and the
    caller's transaction, which the deadlock rolled back, is the caller's to retry.
    Never put a module call inside ``fn``: a transaction must stay short.
    """
    using = ledger_db(using)
    outer = connections[using].in_atomic_block

    def run() -> T:
        with transaction.atomic(using=using):
            return fn()

    return _deadlock_retried(run, lambda: not outer, tries, "transaction")


# ── a statement's fate ──

#: A statement with its parameters, as ``cursor.execute`` takes them.
Statement = tuple[str, "tuple[Any, ...] | list[Any]"]


@dataclass(frozen=True)
class Answer:
    """One result of a statement sent with others: the rows it counts (matched rows for
    an UPDATE, as ``QuerySet.update()`` answers them) and the rows a SELECT read."""

    rowcount: int
    rows: list[tuple[Any, ...]]


def driver_code(exc: BaseException) -> Any:
    """The driver's error number (MySQL's first argument), or None."""
    err = _driver_error(exc)
    args = getattr(err, "args", None)
    return args[0] if args else None


def sqlstate(exc: BaseException) -> str | None:
    """PostgreSQL's SQLSTATE of the error, or None."""
    return _state(_driver_error(exc))


def drop_if_dead(exc: BaseException, using: str | None = None) -> bool:
    """Close the connection when ``exc`` says it is dead (or it no longer answers), so
    the next statement reconnects instead of failing on it for ever ("gone away" on
    every later call of the thread). Answers whether it was closed.

    Inside a transaction the caller owns, only a connection the error itself says is
    lost is closed: an ordinary error there (PostgreSQL refuses every statement of an
    aborted transaction, ``SELECT 1`` included) is the caller's to roll back, and
    closing would end the caller's transaction behind its back."""
    using = ledger_db(using)
    conn = connections[using]
    lost = is_connection_lost(exc)
    if not lost and conn.in_atomic_block:
        return False
    if lost or not _alive(conn):
        try:
            conn.close()
        except Exception:  # closing a dead connection may raise; it is closed all the same
            conn.connection = None
        return True
    return False


def _alive(conn: Any) -> bool:
    """Whether the connection still talks to its server, asked without a statement where
    the driver knows (psycopg keeps the state of its socket)."""
    raw = getattr(conn, "connection", None)
    if raw is None:
        return False
    if conn.vendor == "postgresql":
        return not (getattr(raw, "closed", False) or getattr(raw, "broken", False))
    try:
        return bool(conn.is_usable())
    except Exception:
        return False


@contextmanager
def dropping_dead(using: str | None = None) -> Iterator[None]:
    """A database error that ends the block with a connection the server or the network
    ended drops that connection, so the caller's next statement on this thread
    reconnects instead of failing with "gone away" for ever."""
    using = ledger_db(using)
    try:
        yield
    except DatabaseError as exc:
        drop_if_dead(exc, using)
        raise


@contextmanager
def causal_reads(using: str | None = None) -> Iterator[None]:
    """Reads inside see every transaction committed anywhere in the cluster before them.

    On a Galera node another node's commit may not be applied yet when a read arrives:
    a read-back of a write whose answer was lost (committed on this node, certified
    everywhere) could miss it and take it for undone. ``wsrep_sync_wait`` makes the
    node catch up first; a plain MariaDB has the variable and ignores it, and MySQL
    refuses it, which changes nothing here. Only for the rare read-back paths."""
    using = ledger_db(using)
    conn = connections[using]
    if conn.vendor != "mysql" or conn.in_atomic_block:
        yield
        return
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "SET @events_ledger_sync = @@SESSION.wsrep_sync_wait, SESSION wsrep_sync_wait = 1"
            )
    except DatabaseError:
        yield
        return
    try:
        yield
    finally:
        try:
            with conn.cursor() as cursor:
                cursor.execute("SET SESSION wsrep_sync_wait = @events_ledger_sync")
        except DatabaseError as exc:
            drop_if_dead(exc, using)


#: Connections (by thread: Django's are per thread) sending something that must never
#: be retried statement by statement (``unretried``).
_unretried = threading.local()


def _is_unretried(conn: Any) -> bool:
    return getattr(_unretried, "conn", None) is conn


@contextmanager
def unretried(conn: Any) -> Iterator[None]:
    """What is sent on ``conn`` inside is not retried by ``statements_retried``: a
    compound statement that opens its own transaction and failed half-way is the
    sender's to roll back (a retried one would first commit the half that ran)."""
    before = getattr(_unretried, "conn", None)
    _unretried.conn = conn
    try:
        yield
    finally:
        _unretried.conn = before


# ── statements compiled once ──


@dataclass(frozen=True)
class _Compiled:
    sql: str
    params: tuple[Any, ...]
    #: (position in params, slot name and, for a list slot, the element's index, type)
    #: for every value the caller passes; the type is the one the ORM bound (psycopg's
    #: ``Int4`` for a PositiveIntegerField, say).
    slots: tuple[tuple[int, tuple[str, int | None], Callable[[Any], Any]], ...]
    #: A SELECT's converters, as the ORM applies them: (column, converters, expression).
    converters: tuple[tuple[int, tuple[Callable[..., Any], ...], Any], ...]


#: A list slot (of whole numbers: ids) up to this long is kept compiled per length.
LIST_SLOT_KEPT = 256
#: A longer one, up to this, is padded to the next power of two (its last id repeated)
#: and kept per power: a pass over ten runs of fifty rows claims 500 ids and writes
#: their verdicts, and compiling those two statements afresh cost it more Python than
#: anything else it did (#26). Longer still, compiled for its call only, as the ORM would.
LIST_SLOT_PADDED = 4096


def _stand_in(kind: type, name: str, index: int, variant: int, element: int | None = None) -> Any:
    if kind is list:
        # Apart from the scalar ones below, and inside a 32-bit column's range too.
        assert element is not None and element < 100_000, element
        return 2_010_000_000 + 50_000_000 * variant + 100_000 * index + element
    if kind is int:
        # Inside every integer column's range: Django 5 answers a lookup out of range
        # without asking the database, which would compile to a different statement.
        return 2_000_000_000 + 1000 * variant + index
    return f"\x1fslot {name} {variant}\x1f"


def _slot_of(
    names: dict[tuple[type, Any], tuple[tuple[str, int | None], int]], param: Any
) -> tuple[tuple[str, int | None], int] | None:
    for kind in (int, str):
        if isinstance(param, kind) and not isinstance(param, bool):
            return names.get((kind, kind(param)))
    return None


class _CompileLock:
    """The one lock around compiling a ``Prepared`` statement, made anew in a forked
    child (a lock another thread held at the fork would stay held there for ever)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def reset_after_fork(self) -> None:
        self.lock = threading.Lock()


_compiling = _CompileLock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_compiling.reset_after_fork)


class Prepared:
    """A statement the ORM builds once per database, run afterwards through a raw cursor
    with new values.

    Building and compiling a queryset costs about half a millisecond of CPU, several
    times the round trip of a statement this small, and a step runs a handful of them.
    The ORM still writes the SQL (quoting, ``UtcNow()``, each backend's dialect), once
    per database alias and vendor: ``build`` is called twice with two sets of stand-in
    values for the named ``slots``, and the parameters that differ are the slots'
    positions; everything else is the statement's own. Statements still go through
    Django's cursor, so ``execute_wrapper`` (the deadlock retry, the tests' counters)
    sees each of them. ``update()`` answers the driver's row count as
    ``QuerySet.update()`` does (matched rows on MySQL, whose backend sets FOUND_ROWS);
    ``rows()`` passes each row through the converters the ORM applies (JSON,
    datetimes), so the values are the ORM's.

    ``build(base, *fixed, **slots)`` answers a queryset (a SELECT of its columns, e.g.
    from ``values_list``) or ``(queryset, values)`` (an UPDATE that sets ``values``).
    ``base`` is the model's default queryset; ``fixed`` are values the SQL itself
    depends on (a TTL, a list of statuses), each distinct tuple compiled once; a slot's
    value is only handed to the ORM, never looked at by ``build``. A slot
    takes an ``int`` or a ``str``, or None where the statement SETs it (a WHERE would
    compare with NULL, never true; the ORM writes IS NULL there). A ``list`` slot takes
    a non-empty list of whole numbers that means the same with an element twice (an
    ``__in`` of ids; lists of one length paired element by element): the statement is
    compiled once per length up to ``LIST_SLOT_KEPT``, and once per power of two up to
    ``LIST_SLOT_PADDED``, the list padded with its last element.
    """

    def __init__(self, build: Callable[..., Any], **slots: type) -> None:
        assert all(kind in (int, str, list) for kind in slots.values()), slots
        self._build = build
        self._slots = slots
        self._cache: dict[tuple[Any, ...], _Compiled] = {}

    def rows(
        self, queryset: models.QuerySet[Any], *fixed: Any, **values: Any
    ) -> list[tuple[Any, ...]]:
        """Run the SELECT on ``queryset``'s database; answers its rows, converted."""
        using = queryset.db
        conn = connections[using]
        values = self._padded(values)
        compiled = self._compiled(queryset, conn, fixed, values)
        with conn.cursor() as cursor:
            cursor.execute(compiled.sql, self._params(compiled, values))
            rows = cursor.fetchall()
        return self._converted(compiled, conn, rows)

    def converted(
        self, queryset: models.QuerySet[Any], rows: Any, *fixed: Any
    ) -> list[tuple[Any, ...]]:
        """The rows a SELECT sent as ``statement()`` read, converted as ``rows()`` does."""
        conn = connections[queryset.db]
        # The converters are the columns' alone: any stand-ins compile the same.
        lists = sum(1 for kind in self._slots.values() if kind is list)
        stand_ins = self._stand_ins((1,) * lists, 0)
        base = queryset.model._default_manager.all()
        return self._converted(self._compiled(base, conn, fixed, stand_ins), conn, rows)

    def _converted(self, compiled: _Compiled, conn: Any, rows: Any) -> list[tuple[Any, ...]]:
        if not compiled.converters:
            return [tuple(row) for row in rows]
        # The backend's converters are those of the connection that compiled the
        # statement; they read nothing of it but the alias's settings (its time zone).
        out = []
        for row in rows:
            cells = list(row)
            for pos, converters, expression in compiled.converters:
                value = cells[pos]
                for convert in converters:
                    value = convert(value, expression, conn)
                cells[pos] = value
            out.append(tuple(cells))
        return out

    def update(self, queryset: models.QuerySet[Any], *fixed: Any, **values: Any) -> int:
        """Run the UPDATE on ``queryset``'s database; answers the rows it counts."""
        using = getattr(queryset, "_db", None) or ledger_db()
        conn = connections[using]
        values = self._padded(values)
        compiled = self._compiled(queryset, conn, fixed, values)
        with transaction.mark_for_rollback_on_error(using=using), conn.cursor() as cursor:
            cursor.execute(compiled.sql, self._params(compiled, values))
            return int(cursor.rowcount)

    def statement(self, queryset: models.QuerySet[Any], *fixed: Any, **values: Any) -> Statement:
        """The statement with these values, unsent: for ``Trips.send``. Its answer there
        is what ``update()`` or ``rows()`` would answer, less the SELECT's converters."""
        conn = connections[queryset.db]
        values = self._padded(values)
        compiled = self._compiled(queryset, conn, fixed, values)
        return compiled.sql, self._params(compiled, values)

    def _padded(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with each list longer than ``LIST_SLOT_KEPT`` (and not longer than
        ``LIST_SLOT_PADDED``) padded to the next power of two with its last element."""
        out = values
        for name, kind in self._slots.items():
            if kind is not list:
                continue
            items = values[name]
            if LIST_SLOT_KEPT < len(items) <= LIST_SLOT_PADDED:
                size = 1 << (len(items) - 1).bit_length()
                if out is values:
                    out = dict(values)
                out[name] = [*items, *[items[-1]] * (size - len(items))]
        return out

    def _params(self, compiled: _Compiled, values: dict[str, Any]) -> tuple[Any, ...]:
        params = list(compiled.params)
        for pos, (name, element), kind in compiled.slots:
            value = values[name] if element is None else values[name][element]
            params[pos] = None if value is None else kind(value)
        return tuple(params)

    def _compiled(
        self,
        queryset: models.QuerySet[Any],
        conn: Any,
        fixed: tuple[Any, ...],
        values: dict[str, Any],
    ) -> _Compiled:
        lengths = tuple(len(values[name]) for name, kind in self._slots.items() if kind is list)
        if not all(lengths):
            raise ValueError(f"{self._build}: a list slot is empty (the ORM would send nothing)")
        if queryset.query.where or any(n > LIST_SLOT_PADDED for n in lengths):
            # A caller's own filters are no part of the statement, and a long list is
            # kept nowhere: compiled for this call only, as the ORM would.
            return self._once(queryset, conn, fixed, values)
        key = (conn.alias, conn.vendor, fixed, lengths)
        found = self._cache.get(key)
        if found is None:
            with _compiling.lock:
                found = self._cache.get(key)
                if found is None:
                    found = self._cache[key] = self._compile(
                        queryset.model._default_manager.all(), conn, fixed, lengths
                    )
        return found

    def _once(
        self,
        queryset: models.QuerySet[Any],
        conn: Any,
        fixed: tuple[Any, ...],
        values: dict[str, Any],
    ) -> _Compiled:
        """The statement with the caller's own values, compiled for this call only."""
        sql, params, converters = self._sql(queryset, conn, fixed, values)
        return _Compiled(sql, params, (), converters)

    def _stand_ins(self, lengths: tuple[int, ...], variant: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        sizes = iter(lengths)
        for i, (name, kind) in enumerate(self._slots.items()):
            if kind is list:
                out[name] = [_stand_in(list, name, i, variant, j) for j in range(next(sizes))]
            else:
                out[name] = _stand_in(kind, name, i, variant)
        return out

    def _compile(
        self,
        base: models.QuerySet[Any],
        conn: Any,
        fixed: tuple[Any, ...],
        lengths: tuple[int, ...],
    ) -> _Compiled:
        (sql, params, converters), (other_sql, other_params, _) = (
            self._sql(base, conn, fixed, self._stand_ins(lengths, variant)) for variant in (0, 1)
        )
        if sql != other_sql or len(params) != len(other_params):
            raise ValueError(f"the SQL of {self._build} depends on its slots' values")
        names: dict[tuple[type, Any], tuple[tuple[str, int | None], int]] = {}
        for variant in (0, 1):
            for name, value in self._stand_ins(lengths, variant).items():
                if isinstance(value, list):
                    for j, element in enumerate(value):
                        names[(int, element)] = ((name, j), variant)
                else:
                    names[(type(value), value)] = ((name, None), variant)
        slots = []
        for pos, (one, other) in enumerate(zip(params, other_params, strict=True)):
            if type(one) is type(other) and one == other:
                continue  # the statement's own value
            first, second = _slot_of(names, one), _slot_of(names, other)
            if (
                first is None
                or second is None
                or first[0] != second[0]
                or (first[1], second[1]) != (0, 1)
                or type(one) is not type(other)
            ):
                raise ValueError(f"parameter {pos} of {self._build} is no slot's: {one!r}")
            slots.append((pos, first[0], type(one)))
        missing = set(self._slots) - {name for _, (name, _), _ in slots}
        if missing:
            raise ValueError(f"{self._build} does not use the slots {sorted(missing)}")
        return _Compiled(sql, params, tuple(slots), converters)

    def _sql(
        self, base: models.QuerySet[Any], conn: Any, fixed: tuple[Any, ...], values: dict[str, Any]
    ) -> tuple[str, tuple[Any, ...], tuple[Any, ...]]:
        built = self._build(base, *fixed, **values)
        if isinstance(built, tuple):
            queryset, values = built
            # As QuerySet.update() builds it.
            query = queryset.query.chain(UpdateQuery)
            query.add_update_values(values)
            query.clear_select_clause()
            query.get_initial_alias()
            if query.related_updates or query.count_active_tables() != 1:
                # Django would first run a SELECT of the ids: they would be frozen here.
                raise ValueError("only an UPDATE of one table's own columns is prepared")
            sql, params = query.get_compiler(connection=conn).as_sql()
            return sql, tuple(params), ()
        compiler = built.query.get_compiler(connection=conn)
        sql, params = compiler.as_sql()
        columns = [col for col, _, _ in compiler.select[: compiler.col_count]]
        converters = tuple(
            (pos, tuple(convs), expression)
            for pos, (convs, expression) in compiler.get_converters(columns).items()
        )
        return sql, tuple(params), converters
