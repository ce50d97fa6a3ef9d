"""The fault harness itself (tests/faults.py, scripts/rig/faultproxy.py), on the real
servers: each fault happens for real, and does what its name says."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import Error, transaction

from events_ledger.models import EventRun
from tests import faults
from tests.faults import (
    EXPECTED_CODES,
    FAULTPROXY_PATH,
    ProxiedDb,
    classify,
    direct_query,
    enumerate_work,
    error_code,
    load_faultproxy,
    require_server,
    server_fault,
)
from tests.helpers import connection

fp = load_faultproxy()
#: The fixture, for the tests below that ask for it by name.
proxied_db = faults.proxied_db
#: Each of these tests starts the proxy, a process of its own.
on_servers = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
RUNS = EventRun._meta.db_table


def runs_named(name: str) -> int:
    """Runs of that name the server has, read through a new connection of its own."""
    return int(direct_query(f"SELECT COUNT(*) FROM {RUNS} WHERE name = %s", [name])[0][0])


def new_run(name: str) -> EventRun:
    return EventRun.objects.create(name=name, status="running")


def lost_connection(exc: BaseException) -> bool:
    """The client's view of a reset: MariaDB 2013 (lost during query) or 2006 (gone
    away); psycopg says the server closed the connection, with no SQLSTATE."""
    return error_code(exc) in (2013, 2006, None) and "connection" in str(exc).lower()


# ── the proxy's faults ──


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_session_id_is_the_servers_and_the_proxy_knows_it(proxied_db: ProxiedDb) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CONNECTION_ID()" if connection.vendor == "mysql" else "SELECT pg_backend_pid()"
        )
        (server_id,) = cursor.fetchone()
    assert proxied_db.session_id() == server_id
    assert server_id in [s["session"] for s in proxied_db.proxy.sessions()]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_lost_reply_leaves_the_autocommitted_insert_done(proxied_db: ProxiedDb) -> None:
    proxied_db.arm("lose_reply", 1)
    with pytest.raises(Error) as caught:
        new_run("reply-lost")
    assert lost_connection(caught.value), caught.value
    assert [f["kind"] for f in proxied_db.fired()] == ["lose_reply"]
    assert runs_named("reply-lost") == 1  # the server ran it; the client never heard


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_reset_before_the_insert_means_the_server_never_ran_it(proxied_db: ProxiedDb) -> None:
    proxied_db.arm("reset", 1)
    with pytest.raises(Error) as caught:
        new_run("reset-first")
    assert lost_connection(caught.value), caught.value
    assert [f["kind"] for f in proxied_db.fired()] == ["reset"]
    assert runs_named("reset-first") == 0
    # The next request of a new connection goes through as usual.
    proxied_db.reconnect()
    new_run("after-reset")
    assert runs_named("after-reset") == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_commit_whose_reply_is_lost_committed(proxied_db: ProxiedDb) -> None:
    with pytest.raises(Error) as caught:
        with transaction.atomic():
            new_run("commit-lost")
            new_run("commit-lost")
            # Django's next request is the COMMIT, sent by the driver (no execute wrapper
            # sees it): the proxy, counting requests, does.
            proxied_db.arm("lose_reply", 1)
    assert lost_connection(caught.value), caught.value
    assert len(proxied_db.fired()) == 1
    assert runs_named("commit-lost") == 2


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_requests_are_counted_with_the_transactions_own(proxied_db: ProxiedDb) -> None:
    statements = 3

    def unit() -> None:
        with transaction.atomic():
            for i in range(statements):
                new_run(f"counted-{i}")

    work = proxied_db.enumerate(unit)
    assert work.error is None
    assert len(work.statements) == statements
    # MariaDB: SET autocommit=0, the statements, COMMIT, SET autocommit=1.
    # PostgreSQL: BEGIN (psycopg opens the transaction), the statements, COMMIT.
    around = {"mysql": 3, "postgresql": 2}[connection.vendor]
    assert work.requests == statements + around
    # Autocommitted, each statement is one request.
    before = proxied_db.count()
    new_run("alone")
    assert proxied_db.count() == before + 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_each_request_of_a_unit_of_work_reset_in_turn(proxied_db: ProxiedDb) -> None:
    """The loop a fault suite runs: enumerate, then fault k = 1..N. A transaction cut
    anywhere is all or nothing; one reset at its last request (MariaDB's SET
    autocommit=1, after the COMMIT) is all."""

    def unit(name: str) -> None:
        with transaction.atomic():
            new_run(name)
            new_run(name)

    work = proxied_db.enumerate(lambda: unit("enumerated"))
    assert work.requests is not None
    for k in range(1, work.requests + 1):
        name = f"cut-{k}"
        proxied_db.reconnect()
        proxied_db.arm("reset", k)
        with pytest.raises(Error):
            unit(name)
        assert len(proxied_db.fired()) == k
        assert runs_named(name) in (0, 2), k
    assert runs_named(f"cut-{work.requests}") == (2 if connection.vendor == "mysql" else 0)


# ── the proxy's delay ──


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_delayed_reply_arrives_late_and_whole(proxied_db: ProxiedDb) -> None:
    proxied_db.arm("delay_reply", 1, ms=200)
    start = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 42")
        assert cursor.fetchone() == (42,)
    assert time.perf_counter() - start >= 0.199
    assert [f["kind"] for f in proxied_db.fired()] == ["delay_reply"]


def _median_round_trip_s(samples: int = 7) -> float:
    times = []
    with connection.cursor() as cursor:
        for _ in range(samples):
            start = time.perf_counter()
            cursor.execute("SELECT 1")
            cursor.fetchall()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_delay_adds_its_round_trip(proxied_db: ProxiedDb) -> None:
    base = _median_round_trip_s()
    proxied_db.delay(20)
    slowed = _median_round_trip_s()
    measured = proxied_db.proxy.rtt(10)
    print(
        f"\nSELECT 1: {base * 1000:.2f} ms direct through the proxy, {slowed * 1000:.2f} ms "
        f"with 20 ms each way; the proxy's own RTT: {measured}"
    )
    # Each way waits at least the delay, whatever the machine's load.
    assert slowed - base >= 0.039
    assert measured["added_ms"] >= 39


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except ConnectionError:
                pass  # a stopped proxy resets the connections it still has

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[:2]
    server.close()


@pytest.mark.slow
def test_the_delay_does_not_serialise_connections(echo_server: tuple[str, int]) -> None:
    with fp.FaultProxy(echo_server, "raw", delay_ms=100) as proxy:
        clients = [socket.create_connection((proxy.host, proxy.port)) for _ in range(4)]
        start = time.perf_counter()
        for client in clients:
            client.sendall(b"x")
        for client in clients:
            assert client.recv(1) == b"x"
        elapsed = time.perf_counter() - start
        for client in clients:
            client.close()
    print(f"\n4 connections, 100 ms each way: {elapsed * 1000:.0f} ms in all")
    # One round trip is 200 ms; queued one behind the other they would take 800.
    assert 0.199 <= elapsed < 0.6


@pytest.mark.slow
@pytest.mark.parametrize("where", ["--to=10.0.0.1:5432", "--listen=0.0.0.0:0", "--to=db:5432"])
def test_the_proxy_refuses_anything_but_loopback(where: str) -> None:
    args = ["--listen=127.0.0.1:0", "--to=127.0.0.1:5432", "--protocol=raw", where]
    done = subprocess.run(
        [sys.executable, str(FAULTPROXY_PATH), *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert "loopback" in done.stderr


def _requests_seen(stream: bytes, cuts: list[int]) -> int:
    """Feed a client's stream to the MySQL scanner cut at ``cuts``, as the proxy does
    (an unconsumed partial header waits for the next chunk); answers the requests."""
    link: Any = fp.Link(proxy=None, number=1, peer=None)
    link.authed = True
    scanner = fp.MySQLClientScanner(link)
    scanner.first = False  # past the handshake response
    seen, pending = 0, b""
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        buf = pending + stream[a:b]
        used, events = scanner.feed(buf)
        seen += sum(e.name == "request" for e in events)
        pending = buf[used:]
    assert pending == b""
    return seen


def test_a_command_longer_than_one_packet_is_counted_once() -> None:
    """A MySQL statement of more than 16 MB spans several packets (sequence ids 0, 1,
    ...; a full one continues in the next): one request, wherever the chunks end."""
    full = 0xFFFFFF
    big = full.to_bytes(3, "little") + b"\x00" + b"\x03" + b"x" * (full - 1)
    tail = (5).to_bytes(3, "little") + b"\x01" + b"tail!"  # its continuation, seq 1
    ping = (1).to_bytes(3, "little") + b"\x00" + b"\x0e"  # then a COM_PING
    stream = big + tail + ping
    edge = len(big)
    for cuts in ([], [2], [65536, edge - 1, edge + 2], [edge + 3, edge + len(tail) + 1]):
        assert _requests_seen(stream, cuts) == 2, cuts


def test_statements_are_classified_by_what_they_do() -> None:
    assert classify(1, "INSERT INTO t VALUES (1)").writes
    assert classify(1, "START TRANSACTION;\nUPDATE t SET a = 1;\nCOMMIT").writes
    assert classify(1, "BEGIN NOT ATOMIC DELETE FROM t; END").writes
    assert not classify(1, "SELECT 'update', updated_at FROM t").faultable
    locking = classify(1, "SELECT id FROM t WHERE a = %s FOR UPDATE")
    assert locking.locks and not locking.writes and locking.faultable


# ── server-side faults ──


def _sessions_alive(ids: list[int]) -> list[int]:
    if not ids:
        return []
    marks = ", ".join(["%s"] * len(ids))
    if connection.vendor == "mysql":
        sql = f"SELECT ID FROM information_schema.PROCESSLIST WHERE ID IN ({marks})"
    else:
        sql = f"SELECT pid FROM pg_stat_activity WHERE pid IN ({marks})"
    return [row[0] for row in direct_query(sql, ids)]


def _timeouts() -> tuple[Any, ...]:
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(
                "SELECT @@SESSION.innodb_lock_wait_timeout, @@SESSION.lock_wait_timeout, "
                "@@SESSION.max_statement_time"
            )
            return tuple(cursor.fetchone())
        cursor.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
        )
        return tuple(cursor.fetchone())


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["lock_wait", "interrupt", "statement_timeout", "kill_session"])
def test_a_server_fault_fails_the_statement_for_real(kind: str) -> None:
    vendor = require_server()
    new_run("before")  # the connection is open, its timeouts are the server's
    timeouts = _timeouts()
    with server_fault(kind, 1) as fault:
        with pytest.raises(Error) as caught:
            new_run(f"faulted-{kind}")
    print(f"\n{vendor} {kind}: {error_code(caught.value)} {caught.value}")
    assert fault.fired, fault
    assert error_code(caught.value) in EXPECTED_CODES[vendor][kind]
    assert fault.code == error_code(caught.value)
    if kind in ("interrupt", "kill_session"):
        assert fault.blocked
    assert runs_named(f"faulted-{kind}") == 0
    # The holder is gone with its locks: a write passes at once, timeouts are back.
    assert fault.holder_sessions and _sessions_alive(fault.holder_sessions) == []
    if kind == "kill_session":
        connection.close()
    else:
        assert _timeouts() == timeouts
    new_run(f"after-{kind}")
    assert runs_named(f"after-{kind}") == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_server_fault_inside_a_transaction() -> None:
    """The victim's transaction already wrote the table: the holder cannot lock it
    whole, and holds its rows instead; the update of a row committed before waits."""
    require_server()
    earlier = new_run("earlier")
    with server_fault("interrupt", 2) as fault:
        with pytest.raises(Error) as caught:
            with transaction.atomic():
                new_run("in-transaction")
                EventRun.objects.filter(pk=earlier.pk).update(name="renamed")
    assert fault.fired and fault.blocked, fault
    assert error_code(caught.value) in EXPECTED_CODES[connection.vendor]["interrupt"]
    assert runs_named("in-transaction") == 0
    assert runs_named("earlier") == 1
    assert _sessions_alive(fault.holder_sessions) == []


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_reads_are_not_faulted() -> None:
    require_server()
    new_run("read-me")
    with server_fault("interrupt", 1) as fault:
        assert EventRun.objects.filter(name="read-me").count() == 1
    assert not fault.fired
    assert fault.statement is not None and not fault.statement.faultable


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_fault_in_the_middle_of_a_multi_statement_trip() -> None:
    """MariaDB answers a trip's first result (START TRANSACTION) at once and runs the
    rest after: the INSERT behind it waits, is interrupted, and the error comes with
    the next result; the transaction the trip opened stays open until ROLLBACK."""
    if require_server() != "mysql":
        pytest.skip("multi-statement trips are MariaDB's")
    trip = (
        "START TRANSACTION;\n"
        f"INSERT INTO {RUNS} (name, scope, status, cleanup_status, created_at, updated_at) "
        "VALUES ('in-trip', '', 'running', 'not_required', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6));\n"
        "COMMIT"
    )
    with server_fault("interrupt", 1) as fault:
        with connection.cursor() as cursor:
            with pytest.raises(Exception) as caught:
                cursor.execute(trip)
                while cursor.cursor.nextset():
                    pass
            cursor.execute("ROLLBACK")
    assert fault.fired and fault.blocked, fault
    assert error_code(caught.value) == 1317
    assert runs_named("in-trip") == 0
    assert _sessions_alive(fault.holder_sessions) == []


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_enumerated_statements_say_which_can_be_faulted() -> None:
    require_server()
    existing = new_run("existing")

    def unit() -> None:
        EventRun.objects.filter(pk=existing.pk).count()
        EventRun.objects.filter(pk=existing.pk).update(name="touched")

    work = enumerate_work(unit)
    assert work.faultable == [2]
    for k in range(1, len(work.statements) + 1):
        with server_fault("lock_wait", k) as fault:
            try:
                unit()
            except Error as exc:
                assert error_code(exc) in EXPECTED_CODES[connection.vendor]["lock_wait"]
        assert fault.fired == (k in work.faultable), (k, fault)
