"""Counting what a measured block sends: statements, and commits (the unit of cost)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

#: Transaction control the ORM sends as SQL (SQLite's BEGIN, savepoints everywhere) and
#: session settings (MySQL's isolation level on a new connection): round trips, but
#: neither a statement of the protocol nor a commit of its own.
_CONTROL = ("BEGIN", "SAVEPOINT", "RELEASE", "ROLLBACK", "SET ")


@dataclass
class Counts:
    seconds: float = 0.0
    #: SELECT, INSERT, UPDATE, DELETE: what the protocol asks of the database.
    statements: int = 0
    #: Durable moments: each one a log flush on a durable server, when it wrote.
    commits: int = 0
    #: Commits that wrote something (a read-only commit flushes nothing).
    writing_commits: int = 0
    #: BEGIN, SAVEPOINT, RELEASE SAVEPOINT, ROLLBACK TO SAVEPOINT, SET sent as SQL; and
    #: START TRANSACTION, COMMIT and ROLLBACK sent in a trip of several statements.
    control: int = 0
    #: Calls of the driver that reach the server: each ``execute`` (however many
    #: statements it carries), each ``commit`` of a transaction, and the transaction's
    #: own start where the driver sends it: mysqlclient's switch of autocommit (``SET
    #: autocommit``, off and on again) and psycopg's ``BEGIN`` (sent before the
    #: transaction's first statement). #27: counting ``execute`` alone hid 3 round trips
    #: of every MariaDB transaction and 2 of PostgreSQL's.
    round_trips: int = 0

    def __iadd__(self, other: Counts) -> Counts:
        self.seconds += other.seconds
        self.statements += other.statements
        self.commits += other.commits
        self.writing_commits += other.writing_commits
        self.control += other.control
        self.round_trips += other.round_trips
        return self


class Meter:
    """Counts statements and commits on every connection of the process, in every thread.

    How a commit is counted: a statement run in autocommit mode (no ``atomic`` block
    open, autocommit on) is its own transaction, so one commit; an ``atomic`` block
    costs one commit when its outermost level commits, which Django does through
    ``DatabaseWrapper.commit()``, so every call of it is one commit. A transaction
    rolled back is none. Both are patched on the classes rather than hooked with
    ``connection.execute_wrapper()``, because a wrapper sees one thread's connection
    only: module calls, the claim keeper and a sweep that calls modules in parallel
    run in other threads, on connections of their own, and what they send counts too.
    """

    def __init__(self) -> None:
        self.counts = Counts()
        self._lock = threading.Lock()
        #: Connections whose open transaction has written (by id of the wrapper).
        self._dirty: set[int] = set()
        #: Connections in a transaction opened by a trip's START TRANSACTION.
        self._manual: set[int] = set()

    def statement(self, db: Any, sql: str) -> None:
        with self._lock:
            self.counts.round_trips += 1
            # MariaDB's compound statement (``fastpath``) is read one statement at a
            # time: its START TRANSACTION opens a transaction Django does not know of,
            # its COMMIT (or IF ... THEN COMMIT) is that transaction's one commit, and
            # the declaration, the counts read and END are its own bookkeeping (the
            # bench's steps take the branch that commits).
            for part in sql.split(";\n") if ";\n" in sql else [sql]:
                verb = part.lstrip()[:17].upper()
                if verb.startswith(("DECLARE", "END")):
                    verb = "SET "
                elif verb.startswith("IF ") and "THEN COMMIT" in part:
                    verb = "COMMIT"
                self._one(db, verb)

    def _one(self, db: Any, verb: str) -> None:
        key = id(db)
        if verb.startswith("START TRANSACTION"):
            self.counts.control += 1
            self._manual.add(key)
            return
        if key in self._manual and verb.startswith(("COMMIT", "ROLLBACK")):
            self.counts.control += 1
            self._manual.discard(key)
            if verb.startswith("COMMIT"):
                self.counts.commits += 1
                self.counts.writing_commits += key in self._dirty
            self._dirty.discard(key)
            return
        if verb.startswith(_CONTROL):
            self.counts.control += 1
            return
        writes = not verb.startswith(("SELECT", "EXPLAIN", "PRAGMA", "SHOW", "WITH"))
        self.counts.statements += 1
        if key not in self._manual and not db.in_atomic_block and db.get_autocommit():
            self.counts.commits += 1
            self.counts.writing_commits += writes
        elif writes:
            self._dirty.add(key)

    def switch(self, db: Any, autocommit: bool) -> None:
        """Autocommit switched: a round trip where the driver tells the server."""
        sent = db.vendor == "mysql" or (db.vendor == "postgresql" and not autocommit)
        if sent:
            with self._lock:
                self.counts.round_trips += 1
                self.counts.control += 1

    def commit(self, db: Any) -> None:
        with self._lock:
            self.counts.round_trips += 1
            self.counts.commits += 1
            if id(db) in self._dirty:
                self.counts.writing_commits += 1
                self._dirty.discard(id(db))

    def rollback(self, db: Any) -> None:
        with self._lock:
            self._dirty.discard(id(db))


@contextmanager
def measured() -> Iterator[Counts]:
    """Count and time the block; the figures are in the yielded ``Counts`` after it."""
    meter = Meter()
    execute, executemany = CursorWrapper.execute, CursorWrapper.executemany
    commit, rollback = BaseDatabaseWrapper.commit, BaseDatabaseWrapper.rollback
    set_autocommit = BaseDatabaseWrapper.set_autocommit

    def counted_execute(self: CursorWrapper, sql: str, params: Any = None) -> Any:
        meter.statement(self.db, sql)
        return execute(self, sql, params)

    def counted_executemany(self: CursorWrapper, sql: str, param_list: Any) -> Any:
        meter.statement(self.db, sql)
        return executemany(self, sql, param_list)

    def counted_commit(self: BaseDatabaseWrapper) -> None:
        commit(self)
        meter.commit(self)  # after it: a commit that raised committed nothing

    def counted_rollback(self: BaseDatabaseWrapper) -> None:
        meter.rollback(self)
        rollback(self)

    def counted_set_autocommit(
        self: BaseDatabaseWrapper, autocommit: bool, *args: Any, **kwargs: Any
    ) -> None:
        set_autocommit(self, autocommit, *args, **kwargs)
        meter.switch(self, autocommit)

    with (
        mock.patch.object(CursorWrapper, "execute", counted_execute),
        mock.patch.object(CursorWrapper, "executemany", counted_executemany),
        mock.patch.object(BaseDatabaseWrapper, "commit", counted_commit),
        mock.patch.object(BaseDatabaseWrapper, "rollback", counted_rollback),
        mock.patch.object(BaseDatabaseWrapper, "set_autocommit", counted_set_autocommit),
    ):
        start = time.perf_counter()
        try:
            yield meter.counts
        finally:
            meter.counts.seconds = time.perf_counter() - start
