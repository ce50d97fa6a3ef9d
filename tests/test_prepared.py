"""Statements compiled once (``db.Prepared``): what the ORM would run and answer, on
whichever database the suite runs."""

from __future__ import annotations

import threading
from datetime import datetime

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from events_ledger.db import Prepared, UtcNow
from events_ledger.models import EventRun, EventRunStep
from tests.factories import RunFactory, StepFactory
from tests.helpers import connection

Steps = EventRunStep.objects

CLOCK = {"mysql": "UTC_TIMESTAMP(6)", "postgresql": "CLOCK_TIMESTAMP()", "sqlite": "STRFTIME("}
COLUMNS = ("params", "created_at", "claimed_at", "attempts", "claim_token", "claimed_by")


def read() -> Prepared:
    return Prepared(
        lambda base, *, step: base.filter(pk=step).order_by().values_list(*COLUMNS), step=int
    )


def touch() -> Prepared:
    return Prepared(
        lambda base, *, step, token, by: (
            base.filter(pk=step, claim_token=token, status="running"),
            {"claimed_by": by, "updated_at": UtcNow()},
        ),
        step=int,
        token=str,
        by=str,
    )


def claimed_step(**kw) -> EventRunStep:
    step = StepFactory(params={"a": [1, "b", None], "n": 2.5, "s": "ü 😀"}, status="running", **kw)
    Steps.filter(pk=step.pk).update(claim_token="t", claimed_by="w:1", claimed_at=UtcNow())
    return step


@pytest.mark.django_db
def test_a_prepared_select_answers_the_orms_values():  # statements compiled once
    step = claimed_step()
    rows = read().rows(Steps.all(), step=step.pk)
    assert rows == list(Steps.filter(pk=step.pk).values_list(*COLUMNS))
    params, created_at, claimed_at = rows[0][:3]
    # JSON decoded and datetimes aware, as the ORM gives them on every backend.
    assert params == {"a": [1, "b", None], "n": 2.5, "s": "ü 😀"}
    assert isinstance(claimed_at, datetime) and claimed_at.tzinfo is not None
    assert created_at == step.created_at
    assert read().rows(Steps.all(), step=step.pk + 1000) == []


@pytest.mark.django_db
def test_a_prepared_update_counts_matched_rows_as_update_does():  # matched rows
    step = claimed_step()
    same = Steps.filter(pk=step.pk, claim_token="t", status="running")
    # Nothing changes but updated_at's clock; the counts are the driver's, as update()'s.
    assert touch().update(Steps.all(), step=step.pk, token="t", by="w:1") == 1
    assert same.update(claimed_by="w:1", updated_at=UtcNow()) == 1
    assert touch().update(Steps.all(), step=step.pk, token="other", by="w:2") == 0
    assert Steps.filter(pk=step.pk, claim_token="other").update(claimed_by="w:2") == 0
    assert Steps.get(pk=step.pk).claimed_by == "w:1"


@pytest.mark.django_db
def test_a_matched_row_that_does_not_change_counts_as_update_counts_it():  # matched rows
    run = RunFactory()
    set_status = Prepared(
        lambda base, *, run, status: (base.filter(pk=run), {"status": status}),
        run=int,
        status=str,
    )
    # On MySQL the ORM counts matched rows (CLIENT.FOUND_ROWS); so does the statement.
    assert set_status.update(EventRun.objects.all(), run=run.pk, status=run.status) == (
        EventRun.objects.filter(pk=run.pk).update(status=run.status)
    )


@pytest.mark.django_db
def test_a_prepared_statement_runs_the_orms_sql_with_the_clock_in_it(vendor):  # one clock
    step = claimed_step()
    statement = touch()
    with CaptureQueriesContext(connection) as ours:
        statement.update(Steps.all(), step=step.pk, token="t", by="w:9")
    with CaptureQueriesContext(connection) as orms:
        Steps.filter(pk=step.pk, claim_token="t", status="running").update(
            claimed_by="w:9", updated_at=UtcNow()
        )
    assert [q["sql"] for q in ours] == [q["sql"] for q in orms]
    # The server's UTC clock, never a datetime made in Python.
    assert CLOCK[vendor] in ours[0]["sql"]


@pytest.mark.django_db
def test_a_slot_set_to_none_writes_null():  # statements compiled once
    step = claimed_step()
    assert touch().update(Steps.all(), step=step.pk, token="t", by=None) == 1
    assert Steps.get(pk=step.pk).claimed_by is None


@pytest.mark.django_db
def test_prepared_statements_pass_through_execute_wrappers():  # deadlocks retried
    step = claimed_step()
    seen = []

    def wrapper(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    statement, select = touch(), read()
    with connection.execute_wrapper(wrapper):
        statement.update(Steps.all(), step=step.pk, token="t", by="x")
        select.rows(Steps.all(), step=step.pk)
    assert [s.split()[0] for s in seen] == ["UPDATE", "SELECT"]


@pytest.mark.django_db
def test_a_callers_own_filters_hold_and_are_not_kept():  # statements compiled once
    step = claimed_step()
    other = RunFactory()
    select = read()
    assert select.rows(Steps.filter(run=other), step=step.pk) == []
    assert select.rows(Steps.filter(run=step.run), step=step.pk) != []
    assert select._cache == {}
    assert touch().update(Steps.filter(run=other), step=step.pk, token="t", by="x") == 0


def test_a_statement_whose_sql_depends_on_a_slot_is_refused(db):  # statements compiled once
    # A build passes its slots to the ORM and never looks at them: this one does.
    odd = Prepared(lambda base, *, step: base.filter(pk=step, seq__in=range(step % 7)), step=int)
    with pytest.raises(ValueError, match="depends on its slots"):
        odd.rows(Steps.all(), step=1)
    unused = Prepared(lambda base, *, step: base.values_list("pk"), step=int)
    with pytest.raises(ValueError, match="does not use the slots"):
        unused.rows(Steps.all(), step=1)
    # Django would first SELECT the ids of an UPDATE over a join: they would be frozen in.
    joined = Prepared(
        lambda base, *, status: (base.filter(run__status=status), {"attempts": 0}), status=str
    )
    with pytest.raises(ValueError, match="one table"):
        joined.update(Steps.all(), status="running")


@pytest.mark.django_db(transaction=True)
def test_threads_share_one_compiled_statement_per_database():  # steps run in many threads
    steps = [claimed_step() for _ in range(8)]
    select = read()
    start = threading.Barrier(len(steps))
    answers: dict[int, object] = {}

    def work(step: EventRunStep) -> None:
        try:
            start.wait()
            answers[step.pk] = select.rows(Steps.all(), step=step.pk)[0][4]
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(s,)) for s in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == {s.pk: "t" for s in steps}
    assert list(select._cache) == [("default", connection.vendor, (), ())]


@pytest.mark.django_db
def test_a_step_is_read_with_its_run_as_the_orm_reads_them():  # W5, statements compiled once
    from events_ledger.querysets import RUN_COLUMNS, STEP_COLUMNS

    step = claimed_step()
    with CaptureQueriesContext(connection) as q:
        found = Steps.with_run(step.pk)
        run = found.run
    assert len(q) == 1
    orms = Steps.select_related("run").get(pk=step.pk)
    assert [getattr(found, c) for c in STEP_COLUMNS] == [getattr(orms, c) for c in STEP_COLUMNS]
    assert [getattr(run, c) for c in RUN_COLUMNS] == [getattr(orms.run, c) for c in RUN_COLUMNS]
    assert not found._state.adding and found._state.db == "default"
    # The columns a step's execution does not read are loaded on access, as only()'s are.
    assert (found.claimed_by, run.name) == (orms.claimed_by, orms.run.name)
    assert Steps.with_run(step.pk + 1000) is None


def by_ids() -> Prepared:
    return Prepared(
        lambda base, *, steps, token: (
            base.filter(pk__in=steps, claim_token=token).order_by("pk").values_list("pk", "seq")
        ),
        steps=list,
        token=str,
    )


@pytest.mark.django_db
def test_a_list_slot_takes_each_call_its_own_ids_and_is_compiled_once_per_length():  # #27
    steps = [claimed_step() for _ in range(4)]
    ids = [s.pk for s in steps]
    statement = by_ids()
    for pick in (ids[:2], ids[2:], [ids[3], ids[0]], ids[1:], [ids[1], ids[1]]):
        expected = list(
            Steps.filter(pk__in=pick, claim_token="t").order_by("pk").values_list("pk", "seq")
        )
        assert statement.rows(Steps.all(), steps=pick, token="t") == expected
    assert statement.rows(Steps.all(), steps=ids[:2], token="other") == []
    # Lengths 2 and 3, on this database: a statement per length, not per call.
    assert len(statement._cache) == 2


@pytest.mark.django_db
def test_an_empty_or_long_list_slot_is_answered_as_the_orm_would(settings):  # #27
    steps = [claimed_step() for _ in range(3)]
    statement = by_ids()
    with pytest.raises(ValueError, match="empty"):
        statement.rows(Steps.all(), steps=[], token="t")
    import events_ledger.db as db_module

    long = [s.pk for s in steps] + list(range(10**8, 10**8 + db_module.LIST_SLOT_PADDED))
    rows = statement.rows(Steps.all(), steps=long, token="t")
    assert rows == list(
        Steps.filter(pk__in=[s.pk for s in steps]).order_by("pk").values_list("pk", "seq")
    )
    assert statement._cache == {}  # compiled for that call only


@pytest.mark.django_db
def test_a_longer_list_slot_is_padded_to_a_power_of_two_and_kept(settings):  # #26
    # A pass over ten runs of fifty rows claims 500 ids: compiled afresh each pass, that
    # statement was the largest Python cost of the pass. Padded with its last id (an IN
    # means the same with an id twice), it is kept once per power of two.
    import events_ledger.db as db_module

    steps = [claimed_step() for _ in range(3)]
    statement = by_ids()
    expected = list(
        Steps.filter(pk__in=[s.pk for s in steps]).order_by("pk").values_list("pk", "seq")
    )
    for extra in (db_module.LIST_SLOT_KEPT, db_module.LIST_SLOT_KEPT + 100):
        # 259 and 359 ids, both padded to 512: the padding repeats an id that matches
        # nothing, then one that matches a step (answered once all the same).
        long = [s.pk for s in steps] + list(range(10**8, 10**8 + extra))
        assert statement.rows(Steps.all(), steps=long, token="t") == expected
        assert statement.rows(Steps.all(), steps=long[3:] + long[:3], token="t") == expected
    assert len(statement._cache) == 1
    (key,) = statement._cache
    assert 512 in key[-1]
