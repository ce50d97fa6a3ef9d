"""The fault harness: real faults, on real servers, at the k-th request or statement.

Not a test module. Two tools, usable together:

**The proxy** (``proxied_db`` fixture, or the ``proxied()`` context manager): the default
alias is pointed at ``scripts/rig/faultproxy.py``, started in front of the test
database's server, so the network between Django and the server can lose a reply (the
server ran the request, the client never hears: "outcome unknown"), reset a connection
before a request reaches the server, or be slow. Faults are addressed to the k-th
*request* of a connection (every round trip: statements, COMMIT, ROLLBACK, SET
autocommit, which Django sends through the driver and ``execute_wrapper`` never sees)::

    from tests.faults import proxied_db  # noqa: F401  (the fixture)

    @pytest.mark.django_db(transaction=True)
    def test_x(proxied_db):
        work = proxied_db.enumerate(unit_of_work)          # how many requests?
        for k in range(1, work.requests + 1):
            proxied_db.reconnect()
            proxied_db.arm("lose_reply", k)
            with pytest.raises(django.db.Error):
                unit_of_work()
            assert proxied_db.fired()

**Server-side faults** (``server_fault(kind, k)``): the k-th statement that Django's
default connection runs in this thread (through ``cursor.execute``: Django's
``execute_wrapper``) is blocked by another session's locks and then, for real, fails
with a lock wait timeout, is interrupted (``KILL QUERY`` / ``pg_cancel_backend``), times
out (``max_statement_time`` / ``statement_timeout``) or loses its session (``KILL
CONNECTION`` / ``pg_terminate_backend``). Only statements that write (or lock rows) can
be blocked, so only they are faulted; ``fault.fired`` says whether it happened.

``enumerate_work(fn)`` runs a unit of work once, counting its statements (and its
requests, when a proxy is in front), so a test can loop k = 1..N.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from django.apps import apps
from django.db import Error, connections
from django.db.models import Model

#: Generous bound for anything the harness waits for (a failed wait fails loudly).
PATIENCE_S = 60.0
#: How often the watcher looks at the victim session.
POLL_S = 0.005

FAULTPROXY_PATH = Path(__file__).resolve().parent.parent / "scripts" / "rig" / "faultproxy.py"
SERVERS = ("mysql", "postgresql")
PROXY_FAULT_KINDS = ("reset", "lose_reply", "delay_reply")
SERVER_FAULT_KINDS = ("lock_wait", "interrupt", "statement_timeout", "kill_session")

#: The error each server fault makes the victim's statement fail with (MariaDB error
#: numbers, PostgreSQL SQLSTATEs). A killed MariaDB session answers 1927 when the
#: server could still say so, 2013 when the client only saw the socket close.
EXPECTED_CODES: dict[str, dict[str, set[int | str]]] = {
    "mysql": {
        "lock_wait": {1205},
        "interrupt": {1317},
        "statement_timeout": {1969},
        "kill_session": {1927, 2006, 2013},
    },
    "postgresql": {
        "lock_wait": {"55P03"},
        "interrupt": {"57014"},
        "statement_timeout": {"57014"},
        "kill_session": {"57P01"},
    },
}

#: Server addresses of aliases now pointed at a proxy: the harness's own sessions (lock
#: holders, watchers, fresh readers) go straight to the server.
_direct: dict[str, tuple[str, int]] = {}


# ── the proxy ──


def load_faultproxy() -> ModuleType:
    """scripts/rig/faultproxy.py as a module (scripts/ is no package)."""
    name = "events_ledger_rig_faultproxy"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, FAULTPROXY_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look it up
        spec.loader.exec_module(module)
    return module


def require_server(alias: str = "default") -> str:
    """The alias's vendor; skips the test on anything but MariaDB/MySQL and PostgreSQL."""
    vendor = connections[alias].vendor
    if vendor not in SERVERS:
        pytest.skip(f"fault injection needs a database server, not {vendor}")
    return vendor


def server_address(alias: str = "default") -> tuple[str, int]:
    """Where the alias's server listens over TCP (not the proxy in front of it)."""
    if alias in _direct:
        return _direct[alias]
    vendor = require_server(alias)
    settings = connections[alias].settings_dict
    host = settings.get("HOST") or ""
    if not host or host.startswith("/"):
        pytest.skip("fault injection needs a TCP connection to the server, not a unix socket")
    port = int(settings.get("PORT") or (3306 if vendor == "mysql" else 5432))
    return ("127.0.0.1" if host == "localhost" else host), port


def session_of(conn: Any) -> int:
    """The server's id of a Django connection's session, from the driver (no round
    trip): MariaDB's connection id (``CONNECTION_ID()``), PostgreSQL's backend pid."""
    conn.ensure_connection()
    raw = conn.connection
    if conn.vendor == "mysql":
        return int(raw.thread_id())
    info = getattr(raw, "info", None)
    return int(info.backend_pid if info is not None else raw.get_backend_pid())


def pooled(conn: Any) -> bool:
    """Behind a pooler in transaction mode (the alias says so as Django asks it to), a
    PostgreSQL session serves this connection for one transaction at a time."""
    return conn.vendor == "postgresql" and bool(
        conn.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")
    )


def server_kinds(conn: Any) -> tuple[str, ...]:
    """The server faults a connection can be given. Behind a transaction pooler a
    session-level timeout (``SET lock_timeout``) lands on whichever session is free, not
    on the victim's next statement: those two kinds are proven on the direct runs."""
    if pooled(conn):
        return ("interrupt", "kill_session")
    return SERVER_FAULT_KINDS


_victims = itertools.count(1)


def victim_of(conn: Any) -> int | str:
    """How the watcher finds the victim's session: its id, or, behind a transaction
    pooler, the application_name the pooler sets on whichever session serves it."""
    if not pooled(conn):
        return session_of(conn)
    name = f"ledger-victim-{os.getpid()}-{next(_victims)}"
    conn.ensure_connection()
    _run(conn.connection, "SELECT set_config('application_name', %s, false)", [name])
    return name


def close_quietly(conn: Any) -> None:
    """Close a Django connection that may be dead already (a reset, a killed session)."""
    try:
        conn.close()
    except Error:
        pass  # Django forgets the connection anyway


class ProxiedDb:
    """The default alias behind a fault proxy. Every method addresses the current
    thread's connection of the alias (Django's connections are per thread)."""

    def __init__(self, proxy: Any, alias: str = "default") -> None:
        self.proxy = proxy
        self.alias = alias
        self._armed: list[int] = []

    @property
    def connection(self) -> Any:
        return connections[self.alias]

    def session_id(self) -> int:
        return session_of(self.connection)

    def reconnect(self) -> int:
        """Close this thread's connection (a fault left it dead) and open a new one
        through the proxy; answers its session id."""
        close_quietly(self.connection)
        return self.session_id()

    def arm(self, kind: str, k: int = 1, ms: float = 0.0) -> dict[str, Any]:
        """Fault the k-th request from now (k ≥ 1) of this thread's connection. A
        connection a fault already broke is replaced first."""
        assert kind in PROXY_FAULT_KINDS, kind
        session = self.session_id()
        if not self._open(session):
            session = self.reconnect()
        fault: dict[str, Any] = self.proxy.arm(session, kind, k, ms)
        self._armed.append(int(fault["id"]))
        return fault

    def _open(self, session: int) -> bool:
        return any(s["session"] == session and s["open"] for s in self.proxy.sessions())

    def count(self) -> int:
        """Requests this thread's connection sent so far."""
        return int(self.proxy.count(self.session_id()))

    def fired(self) -> list[dict[str, Any]]:
        """The faults armed through this object that actually happened."""
        return [f for f in self.proxy.fired() if f["id"] in self._armed]

    def faults(self) -> list[dict[str, Any]]:
        return [f for f in self.proxy.faults() if f["id"] in self._armed]

    def delay(self, ms: float) -> None:
        """Every connection through the proxy is ``ms`` late each way from now on."""
        self.proxy.delay(ms)

    def enumerate(self, fn: Callable[[], Any]) -> Work:
        return enumerate_work(fn, proxied=self)


@contextmanager
def proxied(alias: str = "default", *, delay_ms: float = 0.0) -> Iterator[ProxiedDb]:
    """Point ``alias`` at a fault proxy in front of its server for the block.

    Django shares one settings dict per alias between threads, so every connection of
    the alias opened in the block, in any thread, goes through the proxy. This thread's
    connection is closed on the way in and out, so its next query reconnects; a
    connection another thread keeps open across the block is that thread's to close."""
    conn = connections[alias]
    host, port = server_address(alias)
    protocol = "mysql" if conn.vendor == "mysql" else "postgresql"
    settings = conn.settings_dict
    saved = (settings.get("HOST"), settings.get("PORT"))
    with load_faultproxy().FaultProxy((host, port), protocol, delay_ms=delay_ms) as proxy:
        close_quietly(conn)
        _direct[alias] = (host, port)
        settings["HOST"], settings["PORT"] = proxy.host, proxy.port
        try:
            yield ProxiedDb(proxy, alias)
        finally:
            settings["HOST"], settings["PORT"] = saved
            _direct.pop(alias, None)
            close_quietly(conn)


@pytest.fixture
def proxied_db(transactional_db: None) -> Iterator[ProxiedDb]:
    """The default alias behind a fault proxy (MariaDB/PostgreSQL; skips on SQLite).
    Import it into a test module: ``from tests.faults import proxied_db``. Needs
    committed data (``transactional_db``): the server runs what the proxy lets through."""
    require_server()
    with proxied() as db:
        yield db


# ── straight to the server ──


def _connect_params(alias: str) -> tuple[Any, dict[str, Any]]:
    """The driver module and its connect() arguments for a new session of ``alias``,
    straight to the server (never through a proxy)."""
    conn = connections[alias]
    params = dict(conn.get_connection_params())
    params["host"], params["port"] = server_address(alias)
    return conn.Database, params


def raw_connect(database: Any, params: dict[str, Any], *, autocommit: bool) -> Any:
    raw = database.connect(**params)
    if callable(getattr(raw, "autocommit", None)):
        raw.autocommit(autocommit)  # MySQLdb
    else:
        raw.autocommit = autocommit  # psycopg
    return raw


@contextmanager
def direct_connection(alias: str = "default", *, autocommit: bool = True) -> Iterator[Any]:
    """A driver connection of its own to the alias's server, bypassing any proxy: to
    read what the server really has, whatever happened to Django's connection."""
    database, params = _connect_params(alias)
    raw = raw_connect(database, params, autocommit=autocommit)
    try:
        yield raw
    finally:
        raw.close()


def direct_query(sql: str, params: Iterable[Any] = (), alias: str = "default") -> list[Any]:
    """Rows of one query through a fresh direct connection (``%s`` placeholders)."""
    with direct_connection(alias) as raw:
        cursor = raw.cursor()
        cursor.execute(sql, list(params))
        rows = list(cursor.fetchall()) if cursor.description else []
        cursor.close()
        return rows


def error_code(exc: BaseException | None) -> int | str | None:
    """The server's error of an exception Django raised: a SQLSTATE (psycopg 3's
    ``sqlstate``, psycopg2's ``pgcode``) or a
    MariaDB error number (MySQLdb), looked up along the chain of causes."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        state = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)  # psycopg2's
        if state:
            return str(state)
        args = getattr(exc, "args", ())
        if args and isinstance(args[0], int):
            return int(args[0])
        exc = exc.__cause__ or exc.__context__
    return None


# ── statements ──

_QUOTED = re.compile(r"'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.)*\"|`[^`]*`|--[^\n]*|/\*.*?\*/", re.S)
_LOCKING_READ = re.compile(
    r"\bFOR\s+(?:NO\s+KEY\s+)?(?:UPDATE|SHARE)\b|\bLOCK\s+IN\s+SHARE\s+MODE\b", re.I
)
_WRITE = re.compile(r"\b(?:INSERT|UPDATE|DELETE|REPLACE|MERGE)\b", re.I)


@dataclass(frozen=True)
class Statement:
    """One ``cursor.execute`` of the connection: its position (from 1) and text."""

    index: int
    sql: str
    writes: bool
    locks: bool  # a locking read (FOR UPDATE / FOR SHARE)

    @property
    def faultable(self) -> bool:
        """Whether a server fault can hit it: another session's locks block it."""
        return self.writes or self.locks


def classify(index: int, sql: str) -> Statement:
    """A statement writes when it (or a statement of its multi-statement trip or
    compound block) is an INSERT/UPDATE/DELETE/REPLACE; quoted text does not count."""
    text = _QUOTED.sub(" ", sql)
    locks = bool(_LOCKING_READ.search(text))
    writes = bool(_WRITE.search(_LOCKING_READ.sub(" ", text)))
    return Statement(index, sql, writes, locks)


@dataclass
class Work:
    """What one run of a unit of work sent."""

    result: Any = None
    error: BaseException | None = None
    statements: list[Statement] = field(default_factory=list)
    #: Requests the connection sent (a proxy in front only); None when the unit of
    #: work changed sessions (a reconnect) or no proxy counted.
    requests: int | None = None

    @property
    def faultable(self) -> list[int]:
        """Positions of the statements a server fault can hit."""
        return [s.index for s in self.statements if s.faultable]


def enumerate_work(
    fn: Callable[[], Any], *, proxied: ProxiedDb | None = None, alias: str = "default"
) -> Work:
    """Run ``fn`` once, recording every statement of this thread's connection (and the
    proxy's request count, when given). An exception of ``fn`` is kept, not raised."""
    conn = connections[alias]
    work = Work()

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        work.statements.append(classify(len(work.statements) + 1, sql))
        return execute(sql, params, many, context)

    conn.ensure_connection()  # its set-up statements are not the unit's
    session = start = None
    if proxied is not None:
        session = proxied.session_id()
        start = proxied.proxy.count(session)
    with conn.execute_wrapper(record):
        try:
            work.result = fn()
        except Exception as exc:
            work.error = exc
    if proxied is not None and conn.connection is not None and session_of(conn) == session:
        work.requests = proxied.proxy.count(session) - start
    return work


# ── server-side faults ──


@dataclass
class ServerFault:
    """A server fault armed for the k-th statement; what happened once the block ends."""

    kind: str
    k: int
    vendor: str
    statements: list[Statement] = field(default_factory=list)
    #: The k-th statement, once it ran.
    statement: Statement | None = None
    fired: bool = False
    #: What the k-th statement raised (None when it succeeded, or when its error
    #: surfaced after ``cursor.execute`` returned: a later result of a multi-statement
    #: trip, which ``fired`` still reports from the server's side).
    error: BaseException | None = None
    code: int | str | None = None
    #: The victim was seen waiting for the lock holder.
    blocked: bool = False
    #: The holder's session(s), gone once the block ends.
    holder_sessions: list[int] = field(default_factory=list)
    detail: str = ""


@contextmanager
def server_fault(
    kind: str,
    k: int,
    *,
    alias: str = "default",
    models: Iterable[type[Model]] | None = None,
    patience_s: float = PATIENCE_S,
) -> Iterator[ServerFault]:
    """Fault the k-th statement (from 1) this thread's connection of ``alias`` runs in
    the block, when it writes: another session holds ``models``' tables (all of the
    ledger's by default) while it runs, and ``kind`` happens to it for real:

    - ``lock_wait``: it waits out its own 1-second lock timeout (MariaDB 1205,
      PostgreSQL 55P03);
    - ``interrupt``: once seen waiting, it is cancelled from another session
      (``KILL QUERY ID``: 1317; ``pg_cancel_backend``: 57014);
    - ``statement_timeout``: its own 1-second statement timeout fires
      (``max_statement_time``: 1969; ``statement_timeout``: 57014);
    - ``kill_session``: once seen waiting, its session is killed (``KILL CONNECTION``;
      ``pg_terminate_backend``: 57P01), and Django's connection is dead.

    The statement's error propagates to the code under test, as a real one would. The
    locks are released as soon as the statement ended, and the victim's timeouts put
    back (a killed session needs nothing back)."""
    assert kind in SERVER_FAULT_KINDS, kind
    assert k >= 1, "k counts statements from 1"
    vendor = require_server(alias)
    # Connected first: a connection opened inside the block would count the backend's
    # own set-up statements (MySQL's SET SESSION TRANSACTION ISOLATION LEVEL) as 1, 2...
    connections[alias].ensure_connection()
    fault = ServerFault(kind, k, vendor)
    wrapper = _FaultWrapper(fault, alias, _tables(alias, models), patience_s)
    with connections[alias].execute_wrapper(wrapper):
        try:
            yield fault
        finally:
            wrapper.settle()


def _tables(alias: str, models: Iterable[type[Model]] | None) -> list[tuple[str, list[str]]]:
    """(table, primary key columns) of the models whose tables the holder locks."""
    chosen = list(models or apps.get_app_config("events_ledger").get_models())
    found = []
    for model in chosen:
        meta = model._meta
        found.append((meta.db_table, [meta.pk.column]))
    return found


class _FaultWrapper:
    """The execute wrapper: counts statements, and at the k-th one, if it writes,
    runs it under a lock holder."""

    def __init__(
        self,
        fault: ServerFault,
        alias: str,
        tables: list[tuple[str, list[str]]],
        patience_s: float,
    ) -> None:
        self.fault = fault
        self.alias = alias
        self.tables = tables
        self.patience_s = patience_s
        self.pending: _Holder | None = None  # a fault still settling (multi-result trip)
        self.restore: Callable[[], None] | None = None

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        # A statement after the faulted one: the faulted request has ended on the
        # server (a client sends its next statement only after reading every result).
        self.settle()
        fault = self.fault
        statement = classify(len(fault.statements) + 1, sql)
        fault.statements.append(statement)
        if statement.index != fault.k:
            return execute(sql, params, many, context)
        fault.statement = statement
        if not statement.faultable:
            fault.detail = f"statement {fault.k} neither writes nor locks rows: not faulted"
            return execute(sql, params, many, context)
        return self._faulted(execute, sql, params, many, context)

    def _faulted(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        conn = context["connection"]
        fault = self.fault
        holder = _Holder(fault.kind, fault.vendor, victim_of(conn), self.tables, self.alias)
        holder.patience_s = self.patience_s
        holder.start()
        if not holder.ready.wait(self.patience_s) or holder.error is not None:
            fault.detail = f"the lock holder could not start: {holder.error!r}"
            holder.finish.set()
            return execute(sql, params, many, context)
        fault.holder_sessions = holder.sessions
        self.restore = _victim_timeouts(conn, fault.kind)
        self.pending = holder
        try:
            result = execute(sql, params, many, context)
        except BaseException as exc:
            fault.error, fault.code = exc, error_code(exc)
            self.settle()
            raise
        holder.returned.set()
        # PostgreSQL answers a request whole; on MariaDB a multi-statement trip (or a
        # compound block's SELECTs) returns its first result while the rest still runs:
        # the holder keeps its locks until the server says the request ended.
        if fault.vendor == "postgresql" or holder.done.wait(0.2):
            self.settle()
        return result

    def settle(self) -> None:
        """Wait for the fault's end: locks released, the victim's timeouts back,
        ``fired`` decided."""
        holder, self.pending = self.pending, None
        if holder is None:
            return
        holder.finish.set()
        assert holder.done.wait(self.patience_s), "the lock holder did not let go in time"
        fault = self.fault
        fault.blocked = holder.blocked
        if holder.error is not None:
            fault.detail += f" watcher failed: {holder.error!r}"
        expected = EXPECTED_CODES[fault.vendor][fault.kind]
        if fault.kind in ("interrupt", "kill_session"):
            fault.fired = holder.acted
        else:
            fault.fired = fault.code in expected or (holder.blocked and holder.ended_blocked)
        if holder.partial:
            fault.detail += f" rows only (the victim's transaction holds {holder.partial})"
        restore, self.restore = self.restore, None
        if restore is not None and fault.kind != "kill_session":
            try:
                restore()
            except Exception:
                # The session is unusable (killed, or results not read): a new one
                # starts with the server's defaults.
                close_quietly(connections[self.alias])


def _victim_timeouts(conn: Any, kind: str) -> Callable[[], None] | None:
    """Set the victim session's own 1-second timeout for ``kind``; answers how to put
    it back (None when nothing was changed)."""
    if conn.vendor == "mysql":
        names = {
            # A row lock wait and a metadata lock wait: both answer 1205.
            "lock_wait": ["innodb_lock_wait_timeout", "lock_wait_timeout"],
            "statement_timeout": ["max_statement_time"],
        }.get(kind, [])
    else:
        names = {"lock_wait": ["lock_timeout"], "statement_timeout": ["statement_timeout"]}.get(
            kind, []
        )
    if not names:
        return None
    raw = conn.connection
    cursor = raw.cursor()
    try:
        if conn.vendor == "mysql":
            cursor.execute("SELECT " + ", ".join(f"@@SESSION.{n}" for n in names))
            old = list(cursor.fetchone())
            cursor.execute("SET SESSION " + ", ".join(f"{n} = 1" for n in names))
            return lambda: _run(raw, "SET SESSION " + ", ".join(f"{n} = %s" for n in names), old)
        if raw.info.transaction_status != 0 or not raw.autocommit:
            # Inside a transaction: SET LOCAL ends with it, even rolled back (a failed
            # transaction could not take a SET to put it back).
            cursor.execute(f"SET LOCAL {names[0]} = '1s'")
            return None
        cursor.execute(f"SHOW {names[0]}")
        old = [cursor.fetchone()[0]]
        cursor.execute(f"SET {names[0]} = '1s'")
        return lambda: _run(raw, f"SELECT set_config('{names[0]}', %s, false)", old)
    finally:
        cursor.close()


def _run(raw: Any, sql: str, params: list[Any]) -> None:
    cursor = raw.cursor()
    try:
        cursor.execute(sql, params)
        if cursor.description:
            cursor.fetchall()
    finally:
        cursor.close()


class _Holder(threading.Thread):
    """Another session that holds the tables while the victim's statement runs, and a
    watcher session that sees it wait and, for the kill kinds, kills it.

    MariaDB: ``LOCK TABLES ... READ`` (reads pass, every write waits for a metadata
    lock, even one that matches no row); a table the victim's open transaction has
    touched cannot be locked so, and gets row locks instead (``SELECT ... FOR UPDATE
    SKIP LOCKED`` in REPEATABLE READ: gap locks make INSERTs wait too).
    PostgreSQL: ``LOCK TABLE ... IN EXCLUSIVE MODE`` (plain SELECTs pass); a table the
    victim's transaction wrote gets row locks instead (INSERTs into it then pass)."""

    def __init__(
        self,
        kind: str,
        vendor: str,
        victim: int | str,
        tables: list[tuple[str, list[str]]],
        alias: str,
    ) -> None:
        super().__init__(daemon=True, name=f"fault-holder-{kind}")
        self.kind = kind
        self.vendor = vendor
        self.victim = victim
        self.tables = tables
        self.database, self.params = _connect_params(alias)
        self.quote = connections[alias].ops.quote_name
        self.patience_s = PATIENCE_S
        self.ready = threading.Event()  # the locks are held
        self.returned = threading.Event()  # the victim's cursor.execute returned
        self.finish = threading.Event()  # release now
        self.done = threading.Event()  # released
        self.error: BaseException | None = None
        self.sessions: list[int] = []
        self.partial: list[str] = []  # tables held by rows only
        self.blocked = False
        self.ended_blocked = False  # the victim stopped waiting while the locks were held
        self.acted = False
        self.baseline = 0

    def run(self) -> None:
        opened: list[Any] = []
        try:
            watcher = raw_connect(self.database, self.params, autocommit=True)
            opened.append(watcher)
            opened += self._hold()
            self.baseline = self._row_lock_waits(watcher)
            self.ready.set()
            self._watch(watcher)
        except BaseException as exc:
            self.error = exc
        finally:
            self.ready.set()
            for raw in reversed(opened):
                try:
                    raw.close()  # the server releases a closed session's locks
                except Exception:
                    pass
            self.done.set()

    # holding

    def _hold(self) -> list[Any]:
        names = [table for table, _ in self.tables]
        if self.vendor == "mysql":
            tables_session = raw_connect(self.database, self.params, autocommit=True)
            held = self._lock_tables_mysql(tables_session, names)
            sessions = [tables_session]
        else:
            tables_session = raw_connect(self.database, self.params, autocommit=False)
            held = self._lock_tables_postgresql(tables_session, names)
            sessions = [tables_session]
        self.sessions.append(self._session_id(tables_session))
        self.partial = [name for name in names if name not in held]
        if self.partial:
            if self.vendor == "mysql":
                rows_session = raw_connect(self.database, self.params, autocommit=False)
                sessions.append(rows_session)
                self.sessions.append(self._session_id(rows_session))
            else:
                rows_session = tables_session  # one transaction holds both
            self._lock_rows(rows_session, [t for t in self.tables if t[0] in self.partial])
        return sessions

    def _session_id(self, raw: Any) -> int:
        if self.vendor == "mysql":
            return int(raw.thread_id())
        return int(raw.info.backend_pid)

    def _lock_tables_mysql(self, raw: Any, names: list[str]) -> list[str]:
        """The tables one ``LOCK TABLES ... READ NOWAIT`` can hold: all of them, or
        those the victim's transaction has not touched (its metadata locks last until
        it ends)."""

        def lock(chosen: list[str]) -> bool:
            try:
                _run(
                    raw,
                    "LOCK TABLES " + ", ".join(f"{self.quote(n)} READ" for n in chosen) + " NOWAIT",
                    [],
                )
                return True
            except self.database.OperationalError:
                return False

        if lock(names):
            return names
        free = [name for name in names if lock([name])]
        if not free or not lock(free):
            _run(raw, "UNLOCK TABLES", [])
            return []
        return free

    def _lock_tables_postgresql(self, raw: Any, names: list[str]) -> list[str]:
        held = []
        for name in names:
            _run(raw, "SAVEPOINT fault_hold", [])
            try:
                _run(raw, f"LOCK TABLE {self.quote(name)} IN EXCLUSIVE MODE NOWAIT", [])
            except self.database.errors.LockNotAvailable:
                _run(raw, "ROLLBACK TO SAVEPOINT fault_hold", [])
                continue
            _run(raw, "RELEASE SAVEPOINT fault_hold", [])
            held.append(name)
        return held

    def _lock_rows(self, raw: Any, tables: list[tuple[str, list[str]]]) -> None:
        """Every row the victim has not locked itself, through every index, so that
        writes to them wait (and, on MariaDB, INSERTs too: the scans' gap locks)."""
        # SKIP LOCKED never waits for a row; the bound is for anything unforeseen, so a
        # holder cannot hang the test (it fails, and the fault is reported not fired).
        if self.vendor == "mysql":
            _run(raw, "SET SESSION innodb_lock_wait_timeout = 5", [])
            _run(raw, "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ", [])
            _run(raw, "START TRANSACTION", [])
        else:
            _run(raw, "SET LOCAL lock_timeout = '5s'", [])
        for table, pk in tables:
            indexes = {"PRIMARY": pk}
            if self.vendor == "mysql":
                indexes.update(self._indexes_mysql(raw, table))
            for index, columns in indexes.items():
                cols = ", ".join(self.quote(c) for c in columns)
                hint = f" FORCE INDEX ({self.quote(index)})" if self.vendor == "mysql" else ""
                _run(
                    raw,
                    f"SELECT {cols} FROM {self.quote(table)}{hint} ORDER BY {cols} "
                    "FOR UPDATE SKIP LOCKED",
                    [],
                )

    def _indexes_mysql(self, raw: Any, table: str) -> dict[str, list[str]]:
        cursor = raw.cursor()
        cursor.execute(f"SHOW INDEX FROM {self.quote(table)}")
        names = [d[0] for d in cursor.description]
        indexes: dict[str, list[str]] = {}
        for row in cursor.fetchall():
            entry = dict(zip(names, row, strict=True))
            if entry["Key_name"] != "PRIMARY":
                indexes.setdefault(entry["Key_name"], []).append(entry["Column_name"])
        cursor.close()
        return indexes

    # watching

    def _watch(self, watcher: Any) -> None:
        """Until told to finish: note when the victim waits for the locks, kill it then
        for the kill kinds, and stop when its request ended (multi-statement trips on
        MariaDB go on after their first result)."""
        deadline = time.monotonic() + self.patience_s
        while not self.finish.is_set() and time.monotonic() < deadline:
            # Whether the victim's execute had returned is taken before its session is
            # read: taken after, a read showing the session idle *before* it sent its
            # trip, paired with the first result's return that came meanwhile, ended the
            # watch before the trip's INSERT ran (its fault never fired).
            returned = self.returned.is_set()
            state = self._victim_state(watcher)
            if state.blocked:
                self.blocked = True
                if self.kind in ("interrupt", "kill_session") and not self.acted:
                    self._kill(watcher, state)
            elif self.blocked and state.ended:
                self.ended_blocked = True
            if state.ended and returned or state.gone:
                return
            time.sleep(POLL_S)

    def _victim_state(self, watcher: Any) -> _VictimState:
        cursor = watcher.cursor()
        try:
            if self.vendor == "mysql":
                # The wait is counted before the statement is named: read the other way
                # round, a multi-statement trip's START TRANSACTION could be named, its
                # INSERT then counted waiting, and KILL QUERY ID would hit the ended
                # statement while the INSERT went on (a fault that never fired). A wait
                # counted first is still the one running when the session is read: the
                # holder keeps its locks until told to finish.
                waits = self._row_lock_waits(watcher) if self.partial else 0
                cursor.execute(
                    "SELECT COMMAND, STATE, INFO, QUERY_ID FROM information_schema.PROCESSLIST "
                    "WHERE ID = %s",
                    [self.victim],
                )
                row = cursor.fetchone()
                if row is None or row[0] == "Killed":
                    return _VictimState(gone=True, ended=True)
                command, state, info, query_id = row
                if command != "Query":
                    return _VictimState(ended=True)
                if state == "Waiting for table metadata lock":
                    return _VictimState(blocked=True, query_id=int(query_id))
                # Row locks: the server names no state for the wait; a write running
                # while the server counts one more row lock wait than before is it.
                writes = info is not None and classify(0, str(info)).faultable
                blocked = bool(self.partial) and writes and waits > self.baseline
                return _VictimState(blocked=blocked, query_id=int(query_id))
            if isinstance(self.victim, str):
                # Behind a pooler: the session serving the victim's transaction now.
                cursor.execute(
                    "SELECT pid, wait_event_type FROM pg_stat_activity "
                    "WHERE application_name = %s AND state = 'active'",
                    [self.victim],
                )
                row = cursor.fetchone()
                if row is None:
                    return _VictimState(ended=True)
                return _VictimState(blocked=row[1] == "Lock", pid=int(row[0]))
            cursor.execute(
                "SELECT state, wait_event_type FROM pg_stat_activity WHERE pid = %s",
                [self.victim],
            )
            row = cursor.fetchone()
            if row is None:
                return _VictimState(gone=True, ended=True)
            state, wait = row
            if state != "active":
                return _VictimState(ended=True)
            return _VictimState(blocked=wait == "Lock", pid=int(self.victim))
        finally:
            cursor.close()

    def _row_lock_waits(self, watcher: Any) -> int:
        if self.vendor != "mysql":
            return 0
        cursor = watcher.cursor()
        cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_row_lock_current_waits'")
        row = cursor.fetchone()
        cursor.close()
        return int(row[1]) if row else 0

    def _kill(self, watcher: Any, state: _VictimState) -> None:
        if self.vendor == "mysql":
            # KILL QUERY ID hits that statement only, never one the session runs later.
            sql = (
                f"KILL QUERY ID {state.query_id}"
                if self.kind == "interrupt"
                else f"KILL CONNECTION {self.victim}"
            )
            try:
                _run(watcher, sql, [])
            except self.database.OperationalError as exc:
                self.error = exc
                return
            self.acted = True
            return
        function = "pg_cancel_backend" if self.kind == "interrupt" else "pg_terminate_backend"
        cursor = watcher.cursor()
        cursor.execute(f"SELECT {function}(%s)", [state.pid])
        self.acted = bool(cursor.fetchone()[0])
        cursor.close()


@dataclass(frozen=True)
class _VictimState:
    blocked: bool = False
    ended: bool = False  # not running a statement
    gone: bool = False  # the session no longer exists
    query_id: int = 0
    pid: int = 0  # PostgreSQL: the session running the victim's statement
