"""The fast path (``events_ledger.fastpath``, issues #12 and #24): on MariaDB a small step's
two transactions are one compound statement each. What it answers, that it is all or
nothing, that a block which fails half-way leaves the session outside any transaction,
and that every case it does not take is left to the general path with the same outcome
on the ledger.

The block tests need MariaDB; the step tests run on every database, and on MariaDB they
take the fast path (every one is a ``transaction=True`` test: inside a test's transaction
there is none)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.utils.timezone import now

from events_ledger import Action, fastpath
from events_ledger.ledger import execute_step
from events_ledger.models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from tests.helpers import connection, ledger_action, new_run, new_step

Res = EventRunResource.objects
world = pytest.mark.django_db(transaction=True)


def _table() -> str:
    return connection.ops.quote_name(EventRun._meta.db_table)


def _insert_run(name: str) -> tuple[str, list[str]]:
    now = "UTC_TIMESTAMP(6)" if connection.vendor == "mysql" else "CLOCK_TIMESTAMP()"
    return (
        f"INSERT INTO {_table()} (name, status, cleanup_status, scope, created_at, "
        f"updated_at) VALUES (%s, 'running', 'not_required', '', {now}, {now})",
        [name],
    )


def _committing_if(statements: list, expected: list[int]):
    """The fast path's finishing form on this server: MariaDB's compound statement, or
    PostgreSQL's one statement of CTEs."""
    if connection.vendor == "postgresql":
        return fastpath._one_statement_if(statements, expected)
    return fastpath._committing_if(statements, expected)


def _seen_elsewhere(name: str) -> bool:
    """Whether another connection sees a run of that name: committed, not only written."""
    found: list[bool] = []

    def look() -> None:
        try:
            found.append(EventRun.objects.filter(name=name).exists())
        finally:
            connections.close_all()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join()
    return found[0]


@pytest.fixture
def _fast_server(transactional_db):
    if not _takes_fast_path():
        pytest.skip("the fast path runs on MariaDB and PostgreSQL")


def _takes_fast_path() -> bool:
    mariadb = connection.vendor == "mysql" and connection.mysql_is_mariadb
    return mariadb or connection.vendor == "postgresql"


fast_only = pytest.mark.usefixtures("_fast_server")


@pytest.fixture
def _mariadb(transactional_db):
    # Asked of the server (``mysql_is_mariadb`` reads its version), so once the test
    # may reach it: a skipif condition would be evaluated before, and fail when no
    # test before it had connected.
    if connection.vendor != "mysql" or not connection.mysql_is_mariadb:
        pytest.skip("a compound statement outside a stored program: MariaDB only")


mariadb_only = pytest.mark.usefixtures("_mariadb")


@world
def test_mariadb_and_postgresql_take_the_fast_path():  # W5, #24, #27
    assert fastpath.enabled() is _takes_fast_path()


@world
@fast_only
def test_a_block_commits_only_when_every_count_is_as_expected():  # W5, #12, #27
    """The server reads each statement's count and commits or rolls back itself: what it
    rolled back is seen by nobody, and the session is in autocommit after either."""
    fastpath._send(_committing_if([_insert_run("fast-e")], [1]))
    assert _seen_elsewhere("fast-e")
    with pytest.raises(fastpath.NotAsExpected):
        # One row went in, two were expected.
        fastpath._send(_committing_if([_insert_run("fast-f")], [2]))
    assert not _seen_elsewhere("fast-f")
    assert not connection.in_atomic_block and connection.get_autocommit()
    EventRun.objects.create(name="fast-f-after")  # autocommit again: it commits
    assert _seen_elsewhere("fast-f-after") and not _seen_elsewhere("fast-f")


@world
@fast_only
def test_a_block_that_fails_half_way_leaves_no_transaction_open():  # W5, rule 1, #24
    """MariaDB rolls back only the statement that failed: the block's transaction would
    stay open, Django would take the session for autocommit, and the host's next write
    on it would join that transaction and be lost with the connection (#24, finding 1)."""
    sql, params = _insert_run("fast-g")
    broken = ("UPDATE " + _table() + " SET no_such_column = 1", [])
    with pytest.raises(Exception, match="no_such_column"):
        fastpath._send(_committing_if([(sql, params), broken], [1, 1]))
    assert not _seen_elsewhere("fast-g")
    EventRun.objects.create(name="fast-g-after")  # the host's own write, same connection
    assert _seen_elsewhere("fast-g-after") and not _seen_elsewhere("fast-g")


@world
@fast_only
def test_a_block_that_fails_in_the_claim_block_leaves_no_transaction_open(
    isolated_registry, monkeypatch
):  # W5, rule 1, #24: finding 1 (the claim's block was never rolled back)
    """The claim's block, failing after its claim ran (here its placeholder INSERT names
    a column no deploy made), is rolled back whole: the step is not left running under a
    claim nobody holds, and the host's next write on the connection commits."""
    from events_ledger.querysets import EventRunResourceQuerySet

    _action(isolated_registry, lambda **kw: {"ok": True, "resources": []})
    step = new_step(new_run(), "t.trip")
    real = EventRunResourceQuerySet.placeholder_insert

    def renamed_column(self, *args, **kwargs):
        sql, params = real(self, *args, **kwargs)
        column = connection.ops.quote_name("member_key")
        return sql.replace(column, connection.ops.quote_name("member_key_renamed"), 1), params

    monkeypatch.setattr(EventRunResourceQuerySet, "placeholder_insert", renamed_column)
    assert (
        fastpath.claim(
            step,
            ttl=timedelta(minutes=5),
            by="t",
            max_attempts=3,
            owner="t",
            payload={},
        )
        is None
    )
    EventRun.objects.create(name="fast-claim-after")
    assert _seen_elsewhere("fast-claim-after")
    step.refresh_from_db()
    assert (step.status, step.attempts, step.claim_token) == ("pending", 0, None)
    assert not Res.filter(run=step.run_id).exists()


# ── the step on the fast path, and every case it leaves to the general path ──


def _action(isolated_registry, perform) -> Action:
    return ledger_action(isolated_registry, "t.trip", perform=perform)


def _placeholder(step: EventRunStep) -> EventRunResource:
    return Res.get(run=step.run_id, kind=STEP_KIND, ref=step.idempotency_key)


@world
def test_a_clean_step_records_its_rows_and_resolves_its_placeholder(
    isolated_registry,
):  # W2, W3, W5
    def perform(*, run_id, params, idempotency_key):
        return {
            "ok": True,
            "resources": [{"kind": "thing", "ref": f"{idempotency_key}-{i}"} for i in range(3)],
        }

    _action(isolated_registry, perform)
    run = new_run()
    step = new_step(run, "t.trip")
    result = execute_step(step)
    assert (result.outcome, result.recorded, result.rejected) == ("done", 3, [])
    step.refresh_from_db()
    run.refresh_from_db()
    assert (step.status, step.attempts, step.last_error) == ("done", 1, None)
    assert run.cleanup_status == "pending"
    assert _placeholder(step).status == "reverted"
    assert Res.filter(run=run, kind="thing", status="confirmed").count() == 3


@world
def test_a_step_whose_claim_is_held_answers_busy_and_writes_nothing(isolated_registry):  # W5
    calls: list[str] = []
    _action(isolated_registry, lambda **kw: calls.append(kw["idempotency_key"]) or {"ok": True})
    run = new_run()
    step = new_step(run, "t.trip")
    assert EventRunStep.objects.claim(step, timedelta(minutes=5), by="elsewhere:1") is not None
    result = execute_step(step)
    assert result.outcome == "busy" and calls == []
    assert not Res.filter(run=run, kind=STEP_KIND).exists()
    step.refresh_from_db()
    assert step.attempts == 1  # the other claim's, not this one's


@world
def test_a_placeholder_being_given_back_is_not_performed_under(isolated_registry):  # W2, R5
    calls: list[str] = []
    _action(isolated_registry, lambda **kw: calls.append(kw["idempotency_key"]) or {"ok": True})
    run = new_run()
    step = new_step(run, "t.trip")
    Res.create(
        run=run,
        step=step,
        owner_module="t",
        kind=STEP_KIND,
        ref=step.idempotency_key,
        status="reverting",
    )
    result = execute_step(step)
    assert result.outcome == "retry" and "being given back" in result.error
    assert calls == []
    step.refresh_from_db()
    assert step.status == "pending"


@world
def test_a_target_held_by_another_run_keeps_the_placeholder_and_says_who(
    isolated_registry,
):  # W3
    _action(
        isolated_registry,
        lambda **kw: {
            "ok": True,
            "resources": [{"kind": "thing", "ref": "mine"}, {"kind": "thing", "ref": "taken"}],
        },
    )
    other = new_run("other")
    Res.create(run=other, owner_module="t", kind="thing", ref="taken", status="confirmed")
    run = new_run()
    step = new_step(run, "t.trip")
    result = execute_step(step)
    assert result.outcome == "done" and result.recorded == 1
    assert any(f"held by run {other.pk}" in r for r in result.rejected)
    step.refresh_from_db()
    assert step.status == "done" and f"held by run {other.pk}" in step.last_error
    assert _placeholder(step).status == "pending"  # cleanup gives back all the key made
    assert Res.filter(run=run, kind="thing", ref="mine", status="confirmed").exists()
    assert EventRunLog.objects.filter(run=run, kind="step.done").exists()


@world
def test_a_claim_taken_over_during_the_call_keeps_the_rows_and_the_placeholder(
    isolated_registry,
):  # W3, W5, in flight
    def perform(*, run_id, params, idempotency_key):
        # This process stalled past the TTL: another worker's claim took the step.
        EventRunStep.objects.filter(idempotency_key=idempotency_key).update(
            claim_token="someone-else"
        )
        return {"ok": True, "resources": [{"kind": "thing", "ref": "made"}]}

    _action(isolated_registry, perform)
    run = new_run()
    step = new_step(run, "t.trip")
    result = execute_step(step)
    assert result.outcome == "done"
    step.refresh_from_db()
    assert step.status == "running" and step.claim_token == "someone-else"  # not written
    assert Res.filter(run=run, kind="thing", ref="made", status="confirmed").exists()
    assert _placeholder(step).status == "pending"  # the newer call runs under it
    run.refresh_from_db()
    assert run.cleanup_status == "pending"


@world
def test_an_answer_of_more_rows_than_one_insert_takes_is_recorded_whole(
    isolated_registry,
):  # W3, bulk
    n = 2_500

    def perform(*, run_id, params, idempotency_key):
        return {"ok": True, "resources": [{"kind": "thing", "ref": f"r{i}"} for i in range(n)]}

    _action(isolated_registry, perform)
    run = new_run()
    step = new_step(run, "t.trip")
    result = execute_step(step)
    assert (result.outcome, result.recorded) == ("done", n)
    assert Res.filter(run=run, kind="thing", status="confirmed").count() == n
    assert _placeholder(step).status == "reverted"


@world
def test_a_step_of_an_ended_run_is_failed_without_a_call(isolated_registry):  # W5
    calls: list[str] = []
    _action(isolated_registry, lambda **kw: calls.append(kw["idempotency_key"]) or {"ok": True})
    run = new_run(status="cancelled")
    step = new_step(run, "t.trip")
    result = execute_step(step)
    assert result.outcome == "failed" and "cancelled" in result.error and calls == []
    assert not Res.filter(run=run, kind=STEP_KIND).exists()


# A step passed as an instance is not read before its claim (#12): nothing the instance
# says is trusted but what never changes. These run on every database; on MariaDB they
# prove the trip's claim, on the others the general path's read.


def _counting(isolated_registry) -> list[dict]:
    calls: list[dict] = []
    _action(isolated_registry, lambda **kw: calls.append(kw["params"]) or {"ok": True})
    return calls


@world
def test_a_step_passed_as_read_before_its_run_ended_is_not_performed(isolated_registry):  # W5
    calls = _counting(isolated_registry)
    run = new_run()
    step = new_step(run, "t.trip")  # the caller's instance, read while the run ran
    EventRun.objects.filter(pk=run.pk).update(status="cancelled")
    result = execute_step(step)
    assert result.outcome == "failed" and "cancelled" in result.error and calls == []
    assert not Res.filter(run=run, kind=STEP_KIND).exists()
    run.refresh_from_db()
    assert run.cleanup_status == "not_required"  # nothing to give back: not marked


@world
def test_a_step_passed_as_read_before_its_attempts_ran_out_is_not_performed(
    isolated_registry, settings
):  # W5, bounds: MAX_STEP_ATTEMPTS
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "MAX_STEP_ATTEMPTS": 2}
    calls = _counting(isolated_registry)
    step = new_step(new_run(), "t.trip")
    EventRunStep.objects.filter(pk=step.pk).update(attempts=2)  # two workers died meanwhile
    assert step.attempts == 0
    result = execute_step(step)
    assert result.outcome == "failed" and "without a written outcome" in result.error
    assert calls == []


@world
def test_a_step_passed_as_read_before_its_params_changed_is_performed_with_the_stored_ones(
    isolated_registry,
):  # W5
    calls = _counting(isolated_registry)
    step = new_step(new_run(), "t.trip", {"n": 1})
    EventRunStep.objects.filter(pk=step.pk).update(params={"n": 2})
    assert execute_step(step).outcome == "done"
    assert calls == [{"n": 2}]


@world
def test_a_step_retried_after_its_worker_died_reuses_its_placeholder(isolated_registry):
    # W2, W5: the earlier attempt's claim went stale with its placeholder live
    calls = _counting(isolated_registry)
    run = new_run()
    step = new_step(run, "t.trip")
    EventRunStep.objects.filter(pk=step.pk).update(
        status="running", attempts=1, claim_token="dead", claimed_at=now() - timedelta(days=1)
    )
    earlier = Res.create(
        run=run, step=step, owner_module="t", kind=STEP_KIND, ref=step.idempotency_key
    )
    result = execute_step(step)
    assert result.outcome == "done" and len(calls) == 1
    placeholders = Res.filter(run=run, kind=STEP_KIND)
    assert [p.pk for p in placeholders] == [earlier.pk]
    assert placeholders.get().status == "reverted"
    step.refresh_from_db()
    assert (step.status, step.attempts) == ("done", 2)


@world
def test_a_step_not_saved_is_refused_clearly(isolated_registry):  # W5: bad input, a clear answer
    _counting(isolated_registry)
    with pytest.raises(EventRunStep.DoesNotExist):
        execute_step(EventRunStep(run=new_run(), action_id="t.trip"))


@world
@fast_only
def test_a_claim_block_the_server_refuses_leaves_the_step_to_the_general_path(
    isolated_registry, monkeypatch
):  # W5, #24: finding 3 (the claim's block had no fallback: execute_step raised)
    from events_ledger.querysets import EventRunResourceQuerySet

    _action(isolated_registry, lambda **kw: {"ok": True, "resources": [{"kind": "k", "ref": "r"}]})
    run = new_run()
    step = new_step(run, "t.trip")
    real = EventRunResourceQuerySet.placeholder_insert

    def refused(self, *args, **kwargs):
        sql, params = real(self, *args, **kwargs)
        column = connection.ops.quote_name("member_key")
        return sql.replace(column, connection.ops.quote_name("member_key_renamed"), 1), params

    monkeypatch.setattr(EventRunResourceQuerySet, "placeholder_insert", refused)
    result = execute_step(step)
    assert (result.outcome, result.recorded) == ("done", 1), result
    step.refresh_from_db()
    assert (step.status, step.attempts) == ("done", 1)  # one claim, by the general path
    assert Res.filter(run=run, kind="k", status="confirmed").count() == 1
    EventRun.objects.create(name="fast-refused-after")
    assert _seen_elsewhere("fast-refused-after")


@world
@mariadb_only
def test_a_step_prepares_nothing_on_the_server(isolated_registry):  # W5, #24: finding 5
    """A prepared statement is session state: drawn from the server-wide
    ``max_prepared_stmt_count``, pinned by poolers, prepared again on every new
    connection under ``CONN_MAX_AGE=0``. The fast path sends its blocks as text."""
    _action(isolated_registry, lambda **kw: {"ok": True, "resources": [{"kind": "k", "ref": "r"}]})
    sent: list[str] = []

    def wrapper(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    run = new_run()
    with connection.execute_wrapper(wrapper):
        for seq in range(3):
            assert execute_step(new_step(run, "t.trip", seq=seq)).outcome == "done"
    assert sum("BEGIN NOT ATOMIC" in sql for sql in sent) == 6  # two blocks a step
    assert not [sql for sql in sent if sql.lstrip().upper().startswith(("PREPARE", "EXECUTE"))]
    with connection.cursor() as cursor:
        cursor.execute("SHOW SESSION STATUS LIKE 'Prepared_stmt_count'")
        rows = cursor.fetchall()
    assert not rows or int(rows[0][1]) == 0


@world
@mariadb_only
def test_the_bench_reads_a_block_statement_by_statement():  # bench, #12
    from project.bench.meter import measured

    EventRun.objects.exists()  # connected: a new connection's session settings are trips too
    with measured() as counts:
        fastpath._send(fastpath._committing_if([_insert_run("fast-d")], [1]))
    assert (counts.statements, counts.round_trips) == (1, 1)
    assert (counts.commits, counts.writing_commits) == (1, 1)


@world
@fast_only
def test_a_host_that_turns_the_fast_path_off_gets_the_general_path(
    settings, isolated_registry
):  # #24, S4
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "FAST_PATH": False}
    assert not fastpath.enabled()
    _action(isolated_registry, lambda **kw: {"ok": True, "resources": []})
    sent: list[str] = []

    def wrapper(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        assert execute_step(new_step(new_run(), "t.trip")).outcome == "done"
    assert sent and not any("BEGIN NOT ATOMIC" in sql or "WITH marked" in sql for sql in sent)
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "FAST_PATH": "yes"}
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="FAST_PATH"):
        fastpath.enabled()


@world
def test_a_step_inside_a_callers_own_transaction_commits_nothing_of_it(
    isolated_registry,
):  # #12, W5, rule 1: with autocommit off the transaction is the caller's
    from django.db import transaction

    from events_ledger import InCallersTransaction

    calls: list[str] = []
    _action(
        isolated_registry,
        lambda **kw: (
            calls.append("perform") or {"ok": True, "resources": [{"kind": "thing", "ref": "x"}]}
        ),
    )
    run = new_run()
    step = new_step(run, "t.trip")
    transaction.set_autocommit(False)
    try:
        EventRun.objects.create(name="callers-work")
        # Refused before its claim (which would be the caller's to roll back while the
        # world kept what the call made), and the caller's work not committed by it.
        with pytest.raises(InCallersTransaction):
            execute_step(step)
        assert calls == []
        assert not _seen_elsewhere("callers-work")
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)
    assert not EventRun.objects.filter(name="callers-work").exists()
    step.refresh_from_db()
    assert step.status == "pending" and step.attempts == 0
    assert not Res.filter(run=run).exists()


@world
def test_an_answer_that_cannot_be_read_is_settled_not_raised(isolated_registry):  # #12, W3
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    _action(
        isolated_registry,
        lambda **kw: {"ok": True, "resources": [{"kind": "thing", "ref": "x", "payload": deep}]},
    )
    run = new_run()
    step = new_step(run, "t.trip")
    result = execute_step(step)  # never raises (W3)
    assert result.outcome == "done" and result.rejected
    step.refresh_from_db()
    assert step.status != "running"  # settled, not left for the claim to go stale
    assert _placeholder(step).status == "pending"  # cleanup gives back all the key made


def _in_forked_child(held: Any, child: Callable[[], bool]) -> None:
    """Fork while ``held`` (a lock) is held, as by another thread at the fork, and assert
    that ``child`` answers True in the child within a generous bound."""
    import os
    import time

    with held:
        pid = os.fork()
        if pid == 0:  # the child
            ok = False
            try:
                ok = child()
            finally:
                os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on a lock its parent held at the fork")


# Python 3.12 warns that forking a process with threads may deadlock the child: that is the
# case under test.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("where", ["keeper", "compiling", "unfinished", "backlog", "metrics"])
def test_a_forked_child_takes_every_lock_its_parent_held(where):  # W5, #24: finding 4
    """Celery's prefork forks a process at any moment: every module-level lock of the
    app is made anew in the child (one held by another thread at the fork would stay
    held there for ever: ``keeper.hold()`` hung)."""
    import events_ledger.cleanup as cleanup
    import events_ledger.db as db
    import events_ledger.metrics as metrics
    from events_ledger.background import keeper

    locks = {
        "keeper": (lambda: keeper._lock, lambda: keeper.hold("t", 1) or keeper.release("t")),
        "compiling": (lambda: db._compiling.lock, lambda: db._compiling.lock.acquire(timeout=5)),
        "unfinished": (lambda: cleanup._unfinished._lock, lambda: cleanup._unfinished.add("t")),
        "backlog": (lambda: cleanup._backlog._lock, lambda: len(cleanup._backlog) == 0),
        "metrics": (
            lambda: metrics._install_lock,
            lambda: metrics._install_lock.acquire(timeout=5),
        ),
    }
    lock, child = locks[where]

    def answers() -> bool:
        out = child()
        return out is None or bool(out)

    _in_forked_child(lock(), answers)


# Python 3.12 warns that forking a process with threads may deadlock the child: that is the
# case under test.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_makes_calls_though_the_parent_held_the_pool():  # W5, deadline
    """Celery's prefork forks a process that has made calls, at any moment: a lock another
    thread held at the fork would stay held in the child for ever."""
    import os
    import time

    from events_ledger.deadline import call_with_deadline, workers

    call_with_deadline(lambda: 1, 5, "warm")  # the parent has a kept thread
    with workers._lock:  # held, as by another thread, at the fork
        pid = os.fork()
        if pid == 0:  # the child
            ok = False
            try:
                ok = call_with_deadline(lambda: 42, 5, "child").value == 42
            finally:
                os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's call never came back")


@world
def test_an_ordinary_error_inside_a_callers_transaction_leaves_its_connection_open():
    # #24 review: on PostgreSQL ``SELECT 1`` fails in an aborted transaction, which read
    # as a dead connection: the ledger closed it, and the caller's transaction with it.
    from django.db import DatabaseError, transaction

    from events_ledger.db import dropping_dead

    with transaction.atomic():
        EventRun.objects.create(name="callers-own")
        with pytest.raises(DatabaseError), transaction.atomic(), dropping_dead():
            with connection.cursor() as cursor:
                cursor.execute("SELECT no_such_column FROM " + _table())
        EventRun.objects.create(name="callers-own-after")
    assert _seen_elsewhere("callers-own") and _seen_elsewhere("callers-own-after")
