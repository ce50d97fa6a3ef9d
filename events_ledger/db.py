"""Database facts the ledger depends on: one UTC clock, byte-wise keys, error codes."""

from __future__ import annotations

import hashlib
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import DatabaseError, IntegrityError, connections, models, router, transaction
from django.db.models.sql import UpdateQuery

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
        lambda: execute(sql, params, many, context),
        lambda: not conn.in_atomic_block and not _in_trips(conn),
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


# ── a transaction in few round trips ──

#: A statement with its parameters, as ``cursor.execute`` takes them.
Statement = tuple[str, "tuple[Any, ...] | list[Any]"]

#: Connections (by thread: Django's are per thread) in a transaction ``in_trips`` opened.
_trips = threading.local()


def _in_trips(conn: Any) -> bool:
    return getattr(_trips, "conn", None) is conn


def sends_together(using: str = "default") -> bool:
    """Whether this connection can take several statements in one round trip.

    MySQL and MariaDB through mysqlclient can: its connections accept statements
    separated by semicolons (``multi_statements``, on unless a host's ``OPTIONS`` turn
    it off) and answer each one's result in turn. Not inside a transaction Django opened,
    whose boundaries are Django's to send. A small step's cost is round trips, not work:
    a transaction of four statements that takes seven trips through Django's ``atomic``
    (autocommit off, four statements, commit, autocommit on) takes one this way.
    """
    conn = connections[using]
    options = conn.settings_dict.get("OPTIONS") or {}
    return (
        conn.vendor == "mysql"
        # mysqlclient itself: PyMySQL installed as MySQLdb, or another driver's backend,
        # would take the trip for one statement with a syntax error.
        and getattr(getattr(conn, "Database", None), "__name__", "") == "MySQLdb"
        and bool(options.get("multi_statements", True))
        and not conn.in_atomic_block
        # With autocommit off the caller owns a transaction that START TRANSACTION
        # would commit.
        and conn.get_autocommit()
        and not _in_trips(conn)
    )


def runs_compound(conn: Any) -> bool:
    """Whether the server runs a compound statement outside a stored program
    (``BEGIN NOT ATOMIC``): MariaDB does, MySQL does not."""
    return bool(getattr(conn, "mysql_is_mariadb", False))


@dataclass(frozen=True)
class Answer:
    """One statement's result in a trip: the rows it counts (matched rows for an
    UPDATE, as ``QuerySet.update()`` answers them) and the rows a SELECT read."""

    rowcount: int
    rows: list[tuple[Any, ...]]
    #: The id the statement's INSERT gave its row, when it inserted one.
    last_id: int | None = None


#: The error a compound statement of ``Trips.send_committing_if`` raises when it rolled
#: back (a user-defined error number, in the range MariaDB leaves to applications).
NOT_AS_EXPECTED = 45_901


class Trips:
    """The open transaction of ``in_trips``: ``send`` sends statements, the first
    trip opening the transaction, ``commit=True`` closing it in the same trip."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.begun = False
        self.ended = False

    def send(self, statements: list[Statement], *, commit: bool = False) -> list[Answer]:
        """Send ``statements`` in one round trip; answers each one's result, in order."""
        assert not self.ended, "the transaction has ended"
        parts = [sql for sql, _ in statements]
        params = [p for _, values in statements for p in values]
        lead = 0 if self.begun else 1
        if lead:
            parts.insert(0, "START TRANSACTION")
        if commit:
            parts.append("COMMIT")
        self.begun = True
        answers: list[Answer] = []
        conn = self._conn
        with conn.cursor() as cursor:
            # Through Django's cursor, so execute wrappers (the tests' counters) see it.
            cursor.execute(";\n".join(parts), params)
            raw = cursor.cursor
            with conn.wrap_database_errors:
                # A statement that fails ends the trip; its error is raised here (by
                # ``nextset``), after the results of those that went before it.
                while True:
                    rows = list(raw.fetchall()) if raw.description else []
                    count = max(int(raw.rowcount), 0)
                    answers.append(Answer(count, rows, raw.lastrowid or None))
                    if not raw.nextset():
                        break
        if commit:
            self.ended = True
        return answers[lead : lead + len(statements)]

    @property
    def commits_if(self) -> bool:
        """Whether the server runs compound statements (``send_committing_if``,
        ``send_compound``): MariaDB."""
        return runs_compound(self._conn)

    def send_compound(self, block: Statement) -> list[Answer]:
        """Send one compound statement that opens and ends its own transaction; answers
        the result of each SELECT it ran, in order. Only where ``commits_if`` says so.
        A statement that fails ends the block with its transaction still open, for
        ``in_trips`` to roll back."""
        assert self.commits_if and not self.begun
        self.begun = True
        try:
            return self._send_block(block)
        finally:
            self.ended = True

    def _send_block(self, block: Statement) -> list[Answer]:
        """One compound statement in one round trip, prepared on the server once per
        connection (``prepared_block``); answers the result of each SELECT it ran."""
        answers: list[Answer] = []
        conn = self._conn
        with conn.cursor() as cursor:
            _execute_block(conn, cursor, *block)
            raw = cursor.cursor
            with conn.wrap_database_errors:
                while True:
                    if raw.description:
                        answers.append(Answer(max(int(raw.rowcount), 0), list(raw.fetchall())))
                    if not raw.nextset():
                        break
        return answers

    def send_committing_if(self, statements: list[Statement], expected: list[int]) -> bool:
        """Send ``statements`` and, in the same round trip, COMMIT when each counts the
        rows ``expected`` says, else ROLLBACK; answers whether it committed. Only where
        ``commits_if`` says so.

        MariaDB runs a compound statement outside a stored program (``BEGIN NOT
        ATOMIC``), which reads each statement's count (``ROW_COUNT()``, matched rows
        for an UPDATE, as the connection's CLIENT_FOUND_ROWS has it) and decides
        there: the commit that would otherwise wait a round trip for the client to
        read the counts goes with the statements. Rolled back, the block says so by
        raising its own error (``NOT_AS_EXPECTED``), so that a block that committed
        answers nothing to read. A statement that fails ends the block before the
        decision, with the transaction still open, and its error is raised here for
        ``in_trips`` to roll it back as for any trip."""
        assert self.commits_if and statements and len(expected) == len(statements)
        counts = [f"n{i}" for i in range(len(statements))]
        body = [f"DECLARE {', '.join(counts)} BIGINT DEFAULT -1"]
        if not self.begun:
            # Inside the block: one statement less for the trip to answer.
            body.append("START TRANSACTION")
            self.begun = True
        for (sql, _), name in zip(statements, counts, strict=True):
            body += [sql, f"SET {name} = ROW_COUNT()"]
        agreed = " AND ".join(f"{n} = {int(e)}" for n, e in zip(counts, expected, strict=True))
        body.append(
            f"IF {agreed} THEN COMMIT; ELSE ROLLBACK; "
            f"SIGNAL SQLSTATE '45000' SET MYSQL_ERRNO = {NOT_AS_EXPECTED}, "
            "MESSAGE_TEXT = 'events-ledger: rolled back, not as expected'; END IF"
        )
        block: Statement = (
            "BEGIN NOT ATOMIC\n" + ";\n".join(body) + ";\nEND",
            [p for _, values in statements for p in values],
        )
        try:
            self._send_block(block)
        except DatabaseError as exc:
            if _driver_error(exc).args[:1] != (NOT_AS_EXPECTED,):
                raise
            self.ended = True
            return False
        self.ended = True
        return True

    def commit(self) -> None:
        if self.begun and not self.ended:
            self.send([], commit=True)
        self.ended = True

    def rollback(self) -> None:
        if not self.begun or self.ended:
            return
        self.ended = True
        try:
            with self._conn.cursor() as cursor:
                cursor.execute("ROLLBACK")
        except BaseException:
            # The transaction may still be open on the server, where Django would take
            # it for autocommit: the connection goes, and the server rolls back when it
            # closes (a kept connection would carry the transaction on).
            self._conn.close()
            raise


# ── compound statements prepared on the server ──

#: At most this many compound statements are kept prepared on one connection, each of
#: at most ``PREPARED_TEXT_LIMIT`` characters; others are sent as text. A step's two
#: blocks differ only with the size of its answer, so a few shapes cover small steps,
#: where compiling the block is a large part of a trip; a large answer's trip is
#: dominated by its rows, and its text would hold server memory for little gain.
PREPARED_PER_CONNECTION = 16
PREPARED_TEXT_LIMIT = 16_384
#: The server no longer has a statement this process prepared (ER_UNKNOWN_STMT_HANDLER),
#: or could not prepare it again after its tables changed (ER_NEED_REPREPARE): either way
#: nothing ran, and preparing it anew is the cure.
_PREPARE_AGAIN = (1243, 1615)

_prepared_lock = threading.Lock()
#: Per raw connection (a server session), the names of the blocks prepared on it; None
#: once the server refused a PREPARE (that session sends text from then on).
_prepared_on: weakref.WeakKeyDictionary[Any, set[str] | None] = weakref.WeakKeyDictionary()
#: Every block prepared in this process, by name: its text as the block was built, for
#: ``sent_text`` (the same text gives the same name on every connection).
_prepared_texts: dict[str, str] = {}
_PLACEHOLDER = re.compile(r"%(%|s)")


def _server_text(sql: str, count: int) -> str | None:
    """The block with ``?`` for each ``%s`` (and ``%`` for ``%%``), as PREPARE takes
    it; None when its placeholders are not exactly its ``count`` parameters (a ``?``
    of its own would be taken for one)."""
    if "?" in sql:
        return None
    text, found = _PLACEHOLDER.subn(lambda m: "%" if m.group(1) == "%" else "?", sql)
    return text if text.count("?") == count else None


def _execute_block(conn: Any, cursor: Any, sql: str, params: Any) -> None:
    """Send one compound statement: ``EXECUTE`` of it prepared on this connection's
    server session, prepared first when this session has not seen it.

    MariaDB compiles a compound statement sent as text anew each time, which is about
    0.1 ms of a small step's trip of 0.5; prepared, it is compiled once per session
    and run with new values. What it does is the same statement for statement: the
    values bound are the literals the text would have carried. A session that lost
    the statement (a reconnect the client made itself) gets it prepared again; one
    whose server refuses PREPARE (``max_prepared_stmt_count`` reached) sends text."""
    params = list(params)
    name = _prepared_name(conn, cursor, sql, len(params))
    if name is None:
        cursor.execute(sql, params)
        return
    execute = f"EXECUTE {name}" + (" USING " + ", ".join(["%s"] * len(params)) if params else "")
    try:
        cursor.execute(execute, params)
    except DatabaseError as exc:
        if _driver_error(exc).args[:1] not in [(code,) for code in _PREPARE_AGAIN]:
            raise
        # Nothing ran: the server did not know the name. Prepared again, run once more.
        with _prepared_lock:
            _prepared_on.pop(conn.connection, None)
        if _prepared_name(conn, cursor, sql, len(params)) is None:
            cursor.execute(sql, params)
        else:
            cursor.execute(execute, params)


def _prepared_name(conn: Any, cursor: Any, sql: str, count: int) -> str | None:
    """The name ``sql`` is prepared under on this connection's session, preparing it
    there first (a round trip of set-up, once per session and block); None when it is
    to be sent as text."""
    if len(sql) > PREPARED_TEXT_LIMIT:
        return None
    raw = conn.connection
    name = "events_ledger_" + hashlib.sha1(sql.encode()).hexdigest()[:24]
    with _prepared_lock:
        names = _prepared_on.setdefault(raw, set())
        if names is None or (name not in names and len(names) >= PREPARED_PER_CONNECTION):
            return None
        if name in names:
            return name
    text = _server_text(sql, count)
    if text is None:
        return None
    try:
        cursor.execute(f"PREPARE {name} FROM %s", [text])
    except DatabaseError as exc:
        if is_connection_lost(exc):
            raise
        with _prepared_lock:
            _prepared_on[raw] = None
        return None
    with _prepared_lock:
        names = _prepared_on.get(raw)
        if names is not None:
            names.add(name)
        if len(_prepared_texts) < 1024:
            _prepared_texts[name] = sql
    return name


def sent_text(sql: str) -> str:
    """The statements a trip's SQL carries, for a counter that reads them: an
    ``EXECUTE`` of a block prepared by this process answers the block's own text."""
    if sql.startswith("EXECUTE events_ledger_"):
        name = sql.split(None, 2)[1]
        return _prepared_texts.get(name, sql)
    return sql


def in_trips(fn: Callable[[Trips], T], *, using: str = "default", tries: int = 5) -> T:
    """Run ``fn`` as one transaction whose statements it sends a trip at a time
    (``Trips.send``); committed when ``fn`` returns unless it committed already, rolled
    back when it raises. Only where ``sends_together()`` says so.

    A deadlock victim (or a write Galera's certification refused at ``COMMIT``) is run
    again from the start, as ``in_transaction`` does. No statement inside is retried on
    its own (the execute wrapper of ``statements_retried`` stands aside): after a
    deadlock the transaction's earlier statements are gone too, and a ``COMMIT`` sent
    again would commit an empty transaction and answer success.

    Django does not know of this transaction: ``fn`` must send every statement through
    ``trips`` or plain cursors, never open ``atomic`` or register ``on_commit``.
    """
    conn = connections[using]
    assert sends_together(using), "in_trips needs a MySQL connection outside a transaction"

    def attempt() -> T:
        trips = Trips(conn)
        _trips.conn = conn
        try:
            out = fn(trips)
            trips.commit()
            return out
        except BaseException:
            trips.rollback()
            raise
        finally:
            _trips.conn = None

    return _deadlock_retried(attempt, lambda: True, tries)


# ── statements compiled once ──


@dataclass(frozen=True)
class _Compiled:
    sql: str
    params: tuple[Any, ...]
    #: (position in params, slot name, type) for every value the caller passes; the type
    #: is the one the ORM bound (psycopg's ``Int4`` for a PositiveIntegerField, say).
    slots: tuple[tuple[int, str, Callable[[Any], Any]], ...]
    #: A SELECT's converters, as the ORM applies them: (column, converters, expression).
    converters: tuple[tuple[int, tuple[Callable[..., Any], ...], Any], ...]


def _stand_in(kind: type, name: str, index: int, variant: int) -> Any:
    if kind is int:
        # Inside every integer column's range: Django 5 answers a lookup out of range
        # without asking the database, which would compile to a different statement.
        return 2_000_000_000 + 1000 * variant + index
    return f"\x1fslot {name} {variant}\x1f"


def _slot_of(names: dict[tuple[type, Any], tuple[str, int]], param: Any) -> tuple[str, int] | None:
    for kind in (int, str):
        if isinstance(param, kind) and not isinstance(param, bool):
            return names.get((kind, kind(param)))
    return None


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
    compare with NULL, never true; the ORM writes IS NULL there).
    """

    def __init__(self, build: Callable[..., Any], **slots: type) -> None:
        assert all(kind in (int, str) for kind in slots.values()), slots
        self._build = build
        self._slots = slots
        self._cache: dict[tuple[Any, ...], _Compiled] = {}
        self._lock = threading.Lock()

    def rows(
        self, queryset: models.QuerySet[Any], *fixed: Any, **values: Any
    ) -> list[tuple[Any, ...]]:
        """Run the SELECT on ``queryset``'s database; answers its rows, converted."""
        using = queryset.db
        conn = connections[using]
        compiled = self._compiled(queryset, conn, fixed)
        with conn.cursor() as cursor:
            cursor.execute(compiled.sql, self._params(compiled, values))
            rows = cursor.fetchall()
        return self._converted(compiled, conn, rows)

    def converted(
        self, queryset: models.QuerySet[Any], rows: Any, *fixed: Any
    ) -> list[tuple[Any, ...]]:
        """The rows a SELECT sent as ``statement()`` read, converted as ``rows()`` does."""
        conn = connections[queryset.db]
        return self._converted(self._compiled(queryset, conn, fixed), conn, rows)

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
        # The database QuerySet.update() would write to.
        using = getattr(queryset, "_db", None) or router.db_for_write(
            queryset.model, **getattr(queryset, "_hints", {})
        )
        conn = connections[using]
        compiled = self._compiled(queryset, conn, fixed)
        with transaction.mark_for_rollback_on_error(using=using), conn.cursor() as cursor:
            cursor.execute(compiled.sql, self._params(compiled, values))
            return int(cursor.rowcount)

    def statement(self, queryset: models.QuerySet[Any], *fixed: Any, **values: Any) -> Statement:
        """The statement with these values, unsent: for ``Trips.send``. Its answer there
        is what ``update()`` or ``rows()`` would answer, less the SELECT's converters."""
        conn = connections[queryset.db]
        compiled = self._compiled(queryset, conn, fixed)
        return compiled.sql, self._params(compiled, values)

    def _params(self, compiled: _Compiled, values: dict[str, Any]) -> tuple[Any, ...]:
        params = list(compiled.params)
        for pos, name, kind in compiled.slots:
            value = values[name]
            params[pos] = None if value is None else kind(value)
        return tuple(params)

    def _compiled(
        self, queryset: models.QuerySet[Any], conn: Any, fixed: tuple[Any, ...]
    ) -> _Compiled:
        if queryset.query.where:
            # A caller's own filters are no part of the statement: compiled for this
            # call only, as the ORM would.
            return self._compile(queryset, conn, fixed)
        key = (conn.alias, conn.vendor, fixed)
        found = self._cache.get(key)
        if found is None:
            with self._lock:
                found = self._cache.get(key)
                if found is None:
                    found = self._cache[key] = self._compile(
                        queryset.model._default_manager.all(), conn, fixed
                    )
        return found

    def _compile(self, base: models.QuerySet[Any], conn: Any, fixed: tuple[Any, ...]) -> _Compiled:
        (sql, params, converters), (other_sql, other_params, _) = (
            self._sql(base, conn, fixed, variant) for variant in (0, 1)
        )
        if sql != other_sql or len(params) != len(other_params):
            raise ValueError(f"the SQL of {self._build} depends on its slots' values")
        names = {
            (kind, _stand_in(kind, name, i, variant)): (name, variant)
            for i, (name, kind) in enumerate(self._slots.items())
            for variant in (0, 1)
        }
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
        missing = set(self._slots) - {name for _, name, _ in slots}
        if missing:
            raise ValueError(f"{self._build} does not use the slots {sorted(missing)}")
        return _Compiled(sql, params, tuple(slots), converters)

    def _sql(
        self, base: models.QuerySet[Any], conn: Any, fixed: tuple[Any, ...], variant: int
    ) -> tuple[str, tuple[Any, ...], tuple[Any, ...]]:
        stand_ins = {
            name: _stand_in(kind, name, i, variant)
            for i, (name, kind) in enumerate(self._slots.items())
        }
        built = self._build(base, *fixed, **stand_ins)
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
