"""A transaction sent in few round trips (``db.in_trips``, issue #12), and the step that
uses it on MySQL/MariaDB: what it answers, that it is all or nothing, that it is retried
from the start and never a statement alone, and that every case it does not take is left
to the general path with the same outcome on the ledger.

The trip tests need MySQL/MariaDB (elsewhere ``sends_together()`` is False, which one test
says); the step tests run on every database, and on MySQL/MariaDB they go through trips
(every one is a ``transaction=True`` test: inside a test's transaction there are none)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, connections
from django.utils.timezone import now

from events_ledger import Action
from events_ledger.db import in_trips, sends_together, sent_text, statements_retried
from events_ledger.ledger import execute_step
from events_ledger.models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from tests.helpers import ledger_action, new_run, new_step

Res = EventRunResource.objects
world = pytest.mark.django_db(transaction=True)
mysql_only = pytest.mark.skipif(
    "connection.vendor != 'mysql'", reason="several statements a trip: MySQL/MariaDB only"
)


def _table() -> str:
    return connection.ops.quote_name(EventRun._meta.db_table)


def _insert_run(name: str) -> tuple[str, list[str]]:
    return (
        f"INSERT INTO {_table()} (name, status, cleanup_status, scope, created_at, "
        "updated_at) VALUES (%s, 'running', 'not_required', '', UTC_TIMESTAMP(6), "
        "UTC_TIMESTAMP(6))",
        [name],
    )


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


@world
def test_only_mysql_sends_several_statements_a_trip():  # W5, #12
    assert sends_together() is (connection.vendor == "mysql")


@world
@mysql_only
def test_a_trip_answers_each_statement_and_commits_with_its_last():  # W5, #12
    sql, params = _insert_run("trip-a")
    count = f"SELECT COUNT(*) FROM {_table()} WHERE name = %s"

    def fn(trips):
        return trips.send([(sql, params), (count, ["trip-a"])], commit=True)

    inserted, counted = in_trips(fn)
    assert inserted.rowcount == 1 and counted.rows == [(1,)]
    assert _seen_elsewhere("trip-a")
    assert not connection.in_atomic_block and connection.get_autocommit()


@world
@mysql_only
def test_a_statement_that_fails_rolls_the_whole_trip_back():  # W5, rule 1, #12
    sql, params = _insert_run("trip-b")

    def fn(trips):
        trips.send([(sql, params), ("SELECT no_such_column FROM " + _table(), [])])

    with pytest.raises(Exception, match="no_such_column"):
        in_trips(fn)
    assert not _seen_elsewhere("trip-b")
    # The connection is usable, and in autocommit again: what it writes next commits.
    EventRun.objects.create(name="trip-b-after")
    assert _seen_elsewhere("trip-b-after") and not _seen_elsewhere("trip-b")


def _refusing_the_first(sent: Callable[[str], bool], refused: list[str]):
    """An execute wrapper: the first query ``sent`` picks is refused as a deadlock victim
    is (rolled back, error 1213), and noted in ``refused``; the rest go through."""

    def wrapper(execute, query, args, many, context):
        if sent(query) and not refused:
            refused.append(query)
            execute("ROLLBACK", None, many, context)  # what the server did to it
            raise OperationalError(1213, "Deadlock found when trying to get lock")
        return execute(query, args, many, context)

    return wrapper


@world
@mysql_only
def test_a_refused_commit_runs_the_whole_transaction_again_never_the_commit_alone():  # W5
    """A deadlock victim or a write Galera's certification refuses at COMMIT has lost the
    whole transaction. Retrying the COMMIT alone would commit an empty transaction and
    answer success, losing what the trip wrote: the transaction is run again instead."""
    sql, params = _insert_run("trip-c")
    refused: list[str] = []
    runs: list[int] = []

    refuse_first_commit = _refusing_the_first(lambda query: query.strip() == "COMMIT", refused)

    def fn(trips):
        runs.append(1)
        trips.send([(sql, params)])  # COMMIT is sent on its own, after

    with statements_retried(), connection.execute_wrapper(refuse_first_commit):
        in_trips(fn)
    assert refused and len(runs) == 2
    assert EventRun.objects.filter(name="trip-c").count() == 1
    assert _seen_elsewhere("trip-c")


@pytest.fixture
def _mariadb(transactional_db):
    # Asked of the server (``mysql_is_mariadb`` reads its version), so once the test
    # may reach it: a skipif condition would be evaluated before, and fail when no
    # test before it had connected.
    if connection.vendor != "mysql" or not connection.mysql_is_mariadb:
        pytest.skip("a compound statement outside a stored program: MariaDB only")


mariadb_only = pytest.mark.usefixtures("_mariadb")


@world
@mariadb_only
def test_mariadb_commits_in_the_same_trip_only_when_every_count_is_as_expected():  # W5, #12
    """The server reads each statement's count and commits or rolls back itself: the
    trip answers whether it committed, and what it rolled back is seen by nobody."""

    def fn(name, expected):
        return lambda trips: trips.send_committing_if([_insert_run(name)], expected)

    assert in_trips(fn("trip-e", [1])) is True
    assert _seen_elsewhere("trip-e")
    assert in_trips(fn("trip-f", [2])) is False  # one row went in, two were expected
    assert not _seen_elsewhere("trip-f")
    assert not connection.in_atomic_block and connection.get_autocommit()
    EventRun.objects.create(name="trip-f-after")  # autocommit again: it commits
    assert _seen_elsewhere("trip-f-after") and not _seen_elsewhere("trip-f")


@world
@mariadb_only
def test_a_statement_that_fails_in_the_compound_statement_commits_nothing():  # W5, rule 1
    sql, params = _insert_run("trip-g")
    broken = ("UPDATE " + _table() + " SET no_such_column = 1", [])

    with pytest.raises(Exception, match="no_such_column"):
        in_trips(lambda trips: trips.send_committing_if([(sql, params), broken], [1, 1]))
    assert not _seen_elsewhere("trip-g")
    EventRun.objects.create(name="trip-g-after")
    assert _seen_elsewhere("trip-g-after") and not _seen_elsewhere("trip-g")


@world
@mariadb_only
def test_a_compound_statement_the_server_refused_is_run_again_whole():  # W5
    """Refused (a deadlock victim, or a write Galera's certification refused at its
    COMMIT), the block's transaction is gone: the whole transaction is run again."""
    refused: list[str] = []
    runs: list[int] = []

    refuse_first_block = _refusing_the_first(
        lambda query: "BEGIN NOT ATOMIC" in sent_text(query), refused
    )

    def fn(trips):
        runs.append(1)
        return trips.send_committing_if([_insert_run("trip-h")], [1])

    with statements_retried(), connection.execute_wrapper(refuse_first_block):
        assert in_trips(fn) is True
    assert refused and len(runs) == 2
    assert EventRun.objects.filter(name="trip-h").count() == 1


# ── the step through trips, and every case it leaves to the general path ──


@pytest.fixture(params=["compound", "statements"])
def trip_form(request, monkeypatch):
    """On MariaDB a step's trips are compound statements; MySQL, which has none outside
    a stored program, is sent the same transactions as statements one after the other.
    The step tests run both forms on MariaDB, so MySQL's is proven on a real server."""
    if request.param == "statements":
        if connection.vendor != "mysql" or not connection.mysql_is_mariadb:
            pytest.skip("the statements' form is told apart from the compound one on MariaDB")
        monkeypatch.setattr("events_ledger.querysets.runs_compound", lambda conn: False)
        monkeypatch.setattr("events_ledger.db.runs_compound", lambda conn: False)
    return request.param


both_forms = pytest.mark.usefixtures("trip_form")


def _action(isolated_registry, perform) -> Action:
    return ledger_action(isolated_registry, "t.trip", perform=perform)


def _placeholder(step: EventRunStep) -> EventRunResource:
    return Res.get(run=step.run_id, kind=STEP_KIND, ref=step.idempotency_key)


@world
@both_forms
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
@both_forms
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
@both_forms
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
@both_forms
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
@both_forms
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
@both_forms
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
@both_forms
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
@both_forms
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
@both_forms
def test_a_step_passed_as_read_before_its_attempts_ran_out_is_not_performed(
    isolated_registry, settings
):  # W5, bounds: MAX_STEP_ATTEMPTS
    settings.EVENTS_LEDGER = {"MAX_STEP_ATTEMPTS": 2}
    calls = _counting(isolated_registry)
    step = new_step(new_run(), "t.trip")
    EventRunStep.objects.filter(pk=step.pk).update(attempts=2)  # two workers died meanwhile
    assert step.attempts == 0
    result = execute_step(step)
    assert result.outcome == "failed" and "without a written outcome" in result.error
    assert calls == []


@world
@both_forms
def test_a_step_passed_as_read_before_its_params_changed_is_performed_with_the_stored_ones(
    isolated_registry,
):  # W5
    calls = _counting(isolated_registry)
    step = new_step(new_run(), "t.trip", {"n": 1})
    EventRunStep.objects.filter(pk=step.pk).update(params={"n": 2})
    assert execute_step(step).outcome == "done"
    assert calls == [{"n": 2}]


@world
@both_forms
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
@both_forms
def test_a_step_not_saved_is_refused_clearly(isolated_registry):  # W5: bad input, a clear answer
    _counting(isolated_registry)
    with pytest.raises(EventRunStep.DoesNotExist):
        execute_step(EventRunStep(run=new_run(), action_id="t.trip"))


@world
@mysql_only
def test_the_bench_reads_a_trip_statement_by_statement():  # bench, #12
    from project.bench.meter import measured

    sql, params = _insert_run("trip-d")
    count = f"SELECT COUNT(*) FROM {_table()} WHERE name = %s"
    EventRun.objects.exists()  # connected: a new connection's session settings are trips too
    with measured() as counts:
        in_trips(lambda trips: trips.send([(sql, params), (count, ["trip-d"])]))  # COMMIT after
        in_trips(lambda trips: trips.send([(count, ["trip-d"])], commit=True))  # reads only
    assert (counts.statements, counts.round_trips) == (3, 3)
    assert (counts.commits, counts.writing_commits) == (2, 1)


@world
@mysql_only
def test_a_host_that_turns_several_statements_off_gets_the_general_path():  # #12, S4
    options = connection.settings_dict.setdefault("OPTIONS", {})
    before = dict(options)
    try:
        for off in (False, 0):
            options["multi_statements"] = off
            assert not sends_together()
    finally:
        options.clear()
        options.update(before)
    assert sends_together()


@world
def test_a_step_inside_a_callers_own_transaction_commits_nothing_of_it(
    isolated_registry,
):  # #12, W5: with autocommit off the transaction is the caller's
    from django.db import transaction

    _action(
        isolated_registry, lambda **kw: {"ok": True, "resources": [{"kind": "thing", "ref": "x"}]}
    )
    run = new_run()
    step = new_step(run, "t.trip")
    transaction.set_autocommit(False)
    try:
        EventRun.objects.create(name="callers-work")
        assert execute_step(step).outcome == "done"
        assert not _seen_elsewhere("callers-work")
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)
    assert not EventRun.objects.filter(name="callers-work").exists()
    step.refresh_from_db()
    assert step.status == "pending"  # the caller rolled the step back with its own work
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


# ── MariaDB: a step's compound statements prepared once per connection ──


def _making(n: int):
    def perform(*, run_id, params, idempotency_key):
        count = int(params.get("n", n))
        return {
            "ok": True,
            "resources": [{"kind": "thing", "ref": f"{idempotency_key}-{i}"} for i in range(count)],
        }

    return perform


def _sent_while(fn: Callable[[], object]) -> tuple[list[str], object]:
    """The queries the connection sent while ``fn`` ran (as the driver was asked), and
    what ``fn`` answered."""
    sent: list[str] = []

    def wrapper(execute, query, args, many, context):
        sent.append(query)
        return execute(query, args, many, context)

    with connection.execute_wrapper(wrapper):
        out = fn()
    return sent, out


def _prepares(sent: list[str]) -> list[str]:
    return [query.split()[1] for query in sent if query.startswith("PREPARE ")]


def _steps_done(run, n: int, *, first_seq: int = 0, resources: int = 1) -> list[EventRunStep]:
    steps = [new_step(run, "t.trip", {"n": resources}, seq=first_seq + i) for i in range(n)]
    for step in steps:
        result = execute_step(step)
        assert (result.outcome, result.recorded) == ("done", resources), result
    return steps


def _recorded_whole(run, steps: list[EventRunStep], resources: int = 1) -> None:
    for step in steps:
        assert _placeholder(step).status == "reverted"
        assert Res.filter(step=step, kind="thing", status="confirmed").count() == resources


@world
@mariadb_only
def test_a_steps_blocks_are_prepared_once_per_connection_and_run_by_name(
    isolated_registry,
):  # W5, rule 1, #12
    """MariaDB compiles a compound statement sent as text every time; prepared, once per
    server session. Each of a step's two blocks is prepared the first time a session
    sends it, then only executed by name with new values; a new session prepares again."""
    _action(isolated_registry, _making(1))
    run = new_run()
    connection.close()  # a session of its own: nothing prepared on it yet
    sent, steps = _sent_while(lambda: _steps_done(run, 3))
    prepared = _prepares(sent)
    assert len(prepared) == len(set(prepared)) == 2  # the claim's block, the answer's
    executed = [query.split()[1] for query in sent if query.startswith("EXECUTE ")]
    assert sorted(executed) == sorted(prepared * 3)
    assert not any("BEGIN NOT ATOMIC" in query for query in sent)  # no block sent as text
    _recorded_whole(run, steps)

    connection.close()
    sent, more = _sent_while(lambda: _steps_done(run, 1, first_seq=3))
    assert sorted(_prepares(sent)) == sorted(prepared)  # the same names, on the new session
    _recorded_whole(run, more)


@world
@mariadb_only
def test_a_block_the_session_lost_is_prepared_again_and_run_once(isolated_registry):  # W5, #12
    """A session that no longer has a statement (deallocated behind the app's back, as a
    reconnect the driver made itself would leave it) answers that it does not know it,
    having run nothing: the block is prepared again and run once, and the step is whole."""
    _action(isolated_registry, _making(1))
    run = new_run()
    sent, first = _sent_while(lambda: _steps_done(run, 1))
    with connection.cursor() as cursor:
        for name in _prepares(sent) or []:
            cursor.execute(f"DEALLOCATE PREPARE {name}")
    assert _prepares(sent), "the first step prepared its blocks"
    sent, second = _sent_while(lambda: _steps_done(run, 1, first_seq=1))
    assert sorted(_prepares(sent)) == sorted(set(_prepares(sent)))
    assert len(_prepares(sent)) == 2
    _recorded_whole(run, first + second)
    # Each block ran once: one claim counted, one set of rows, one resolve.
    [step] = second
    step.refresh_from_db()
    assert (step.status, step.attempts) == ("done", 1)


@world
@mariadb_only
def test_at_most_so_many_blocks_stay_prepared_on_a_connection(
    isolated_registry, monkeypatch
):  # W5, #12
    """A step's second block differs with the size of its answer: past the bound, a new
    shape is sent as text (the bound is the server's memory per session), with the same
    outcome on the ledger."""
    monkeypatch.setattr("events_ledger.db.PREPARED_PER_CONNECTION", 2)
    _action(isolated_registry, _making(1))
    run = new_run()
    connection.close()
    sent, small = _sent_while(lambda: _steps_done(run, 1, resources=1))
    assert len(_prepares(sent)) == 2
    sent, larger = _sent_while(lambda: _steps_done(run, 1, first_seq=1, resources=3))
    assert _prepares(sent) == []
    assert sum("BEGIN NOT ATOMIC" in query for query in sent) == 1  # the new shape, as text
    assert sum(query.startswith("EXECUTE ") for query in sent) == 1  # the claim's block
    _recorded_whole(run, small)
    _recorded_whole(run, larger, resources=3)


@world
@mariadb_only
def test_a_block_with_its_own_question_mark_or_percent_sign_means_what_it_says():  # W5, #12
    """PREPARE takes ``?`` for a value: a block whose text holds one of its own is sent
    as text; a ``%%`` (a percent sign, in the driver's format) is a ``%`` in either form."""
    marked = (
        f"INSERT INTO {_table()} (name, status, cleanup_status, scope, created_at, "
        "updated_at) VALUES (CONCAT(%s, '?'), 'running', 'not_required', '', "
        "UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
        ["trip-q"],
    )
    percent = (marked[0].replace("'?'", "'%%'"), ["trip-p"])
    sent, committed = _sent_while(
        lambda: [in_trips(lambda t, s=s: t.send_committing_if([s], [1])) for s in (marked, percent)]
    )
    assert committed == [True, True]
    assert sum("BEGIN NOT ATOMIC" in query for query in sent) == 1  # the one with its own ?
    names = EventRun.objects.filter(name__in=["trip-q?", "trip-p%"]).values_list("name", flat=True)
    assert sorted(names) == ["trip-p%", "trip-q?"]


@world
@mariadb_only
@pytest.mark.skipif(
    "not os.environ.get('RIG_MARIADB_SOCKET')",
    reason="needs the rig's server, whose root a test may reach through its socket",
)
def test_a_server_that_refuses_to_prepare_is_sent_the_blocks_as_text(isolated_registry):  # W5
    """A server at its ``max_prepared_stmt_count`` refuses PREPARE: that session sends
    its blocks as text from then on, and every step is recorded whole."""
    import MySQLdb

    root = MySQLdb.connect(unix_socket=os.environ["RIG_MARIADB_SOCKET"], user="root")
    try:
        with root.cursor() as cursor:
            cursor.execute("SELECT @@GLOBAL.max_prepared_stmt_count")
            [(before,)] = cursor.fetchall()
            cursor.execute("SET GLOBAL max_prepared_stmt_count = 0")
        try:
            _action(isolated_registry, _making(1))
            run = new_run()
            connection.close()
            sent, steps = _sent_while(lambda: _steps_done(run, 2))
        finally:
            with root.cursor() as cursor:
                cursor.execute(f"SET GLOBAL max_prepared_stmt_count = {int(before)}")
    finally:
        root.close()
    assert len(_prepares(sent)) == 1  # tried once, refused: not again on this session
    assert not any(query.startswith("EXECUTE ") for query in sent)
    assert sum("BEGIN NOT ATOMIC" in query for query in sent) == 4
    _recorded_whole(run, steps)
