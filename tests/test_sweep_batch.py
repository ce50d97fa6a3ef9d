"""A sweep pass works its batch of runs together (#12): a constant number of statements
whatever the number of runs and groups, module calls in parallel up to
``CLEANUP_CONCURRENCY``, and every rule of the one-run cleanup kept."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from events_ledger.cleanup import cleanup_run, sweep
from events_ledger.models import EventRun, EventRunLog, EventRunResource
from tests.factories import ResourceFactory, RunFactory
from tests.helpers import connection, ledger_action, new_step

Res = EventRunResource.objects


def _runs(n: int, groups: int = 1, rows: int = 1, action: str = "t.make") -> list[EventRun]:
    runs = []
    for _ in range(n):
        run = RunFactory(status="completed", cleanup_status="pending")
        for g in range(groups):
            step = new_step(run, action, seq=g)
            for _ in range(rows):
                ResourceFactory(run=run, step=step, owner_module="t")
        runs.append(run)
    return runs


def _pass_cost(n_runs: int, groups: int) -> tuple[int, list[str]]:
    _runs(n_runs, groups)
    with CaptureQueriesContext(connection) as q:
        report = sweep()
    assert len(report.runs) == n_runs
    assert {s.cleanup_status for s in report.runs} == {"complete"}
    return len(q), [x["sql"] for x in q.captured_queries]


@pytest.mark.django_db
def test_a_pass_costs_the_same_statements_for_1_and_10_runs(isolated_registry, settings):
    # C5, #12: one scan, one read of the rows with their steps, one claim, one
    # write per kind of verdict, one settle for every summary, one log INSERT.
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_RUN_BATCH": 10}
    ledger_action(isolated_registry)
    one, _ = _pass_cost(1, 1)
    ten, sqls = _pass_cost(10, 3)
    assert one == ten, sqls
    inserts = [s for s in sqls if s.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1  # every log entry of the pass, in one statement


@pytest.mark.django_db
def test_a_pass_over_one_run_is_this_many_statements(isolated_registry):  # C5, #12
    ledger_action(isolated_registry)
    _, sqls = _pass_cost(1, 1)
    # runs left running behind a late step (1 read), repair (1 read, #27: the two
    # kinds of disagreement in one UNION), scan, rows
    # with their steps (#26: one read), claim + read-back, lock the runs, verdict,
    # settle + read-back, log.
    # The test's own transaction makes savepoints of what runs in autocommit in
    # production; they are not the pass's statements.
    statements = [s for s in sqls if not s.upper().startswith(("SAVEPOINT", "RELEASE"))]
    # SQLite needs no lock on the runs: its transaction holds the whole file.
    assert len(statements) == (11 if connection.features.has_select_for_update else 10), sqls


@pytest.mark.django_db(transaction=True)
def test_a_pass_calls_its_modules_in_parallel(isolated_registry, settings):  # #12
    """Eight reverts meet at a barrier: only calls made at the same time can pass it."""
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "CLEANUP_CONCURRENCY": 8,
        "CLEANUP_RUN_BATCH": 4,
    }
    barrier = threading.Barrier(8, timeout=30)
    met: list[int] = []

    def revert(**_):
        met.append(barrier.wait())
        return {"ok": True}

    ledger_action(isolated_registry, revert=revert)
    _runs(4, groups=2)
    report = sweep()
    assert sorted(met) == list(range(8))  # nobody broke the barrier
    assert [s.reverted for s in report.runs] == [2, 2, 2, 2]
    assert not Res.unresolved().exists()


@pytest.mark.django_db(transaction=True)
def test_concurrency_bounds_the_calls_in_flight(isolated_registry, settings):  # #12, S4
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "CLEANUP_CONCURRENCY": 3,
        "CLEANUP_RUN_BATCH": 10,
    }
    lock = threading.Lock()
    now = [0]
    most = [0]
    three_in = threading.Event()

    def revert(**_):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            if now[0] == 3:
                three_in.set()
        three_in.wait(30)  # hold until the bound is reached, so the bound is tested
        with lock:
            now[0] -= 1
        return {"ok": True}

    ledger_action(isolated_registry, revert=revert)
    _runs(5, groups=2)
    report = sweep()
    assert most[0] == 3
    assert sum(s.reverted for s in report.runs) == 10


@pytest.mark.django_db(transaction=True)
def test_a_stopped_pass_hands_back_what_it_did_not_call(isolated_registry, settings):
    # C5, R5: asked to stop, the calls in hand finish; the rest are not called, and
    # their rows are claimable at once, their claim not counted against them.
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_CONCURRENCY": 1}
    calls: list[str] = []
    stop = threading.Event()

    def revert(**kw):
        calls.append(kw["idempotency_key"])
        stop.set()
        return {"ok": True}

    ledger_action(isolated_registry, revert=revert)
    runs = _runs(3)
    report = sweep(should_stop=stop.is_set)
    assert len(calls) == 1
    assert sum(s.reverted for s in report.runs) == 1
    left = Res.filter(run__in=runs).exclude(status="reverted")
    assert left.count() == 2
    assert set(left.values_list("claim_count", flat=True)) == {0}
    # Claimable at once: the next pass gives them back without waiting for any TTL.
    after = sweep()
    assert sum(s.reverted for s in after.runs) == 2
    assert len(calls) == 3


@pytest.mark.django_db
def test_verdicts_of_every_kind_across_runs_in_one_pass(isolated_registry):  # C1, C4, #12
    answers = {"t.ok": {"ok": True}, "t.no": {"ok": False, "error": "no"}, "t.gone": None}
    for action_id, answer in answers.items():
        ledger_action(isolated_registry, action_id, revert=lambda _a=answer, **_: _a)
    ledger_action(
        isolated_registry,
        "t.drift",
        revert=lambda **_: {"drifted": True, "current": 3},
    )
    ledger_action(
        isolated_registry,
        "t.dead",
        revert=lambda **_: {"ok": False, "retry": False, "error": "gone for good"},
    )
    runs = {a: _runs(1, action=a)[0] for a in ("t.ok", "t.no", "t.gone", "t.drift", "t.dead")}
    report = {s.run_id: s for s in sweep().runs}
    by_action = {a: report[run.pk] for a, run in runs.items()}
    assert (by_action["t.ok"].reverted, by_action["t.ok"].cleanup_status) == (1, "complete")
    assert (by_action["t.no"].failed, by_action["t.no"].cleanup_status) == (1, "pending")
    assert by_action["t.no"].errors == ["no"]
    assert by_action["t.gone"].failed == 1 and "no envelope" in by_action["t.gone"].errors[0]
    # Drifted is released unclean, retried within the attempt bound like a failure.
    assert (by_action["t.drift"].drifted, by_action["t.drift"].cleanup_status) == (1, "pending")
    assert by_action["t.dead"].cleanup_status == "incomplete"
    statuses = {a: Res.get(run=run).status for a, run in runs.items()}
    assert statuses == {
        "t.ok": "reverted",
        "t.no": "confirmed",
        "t.gone": "confirmed",
        "t.drift": "drifted",
        "t.dead": "confirmed",
    }
    kinds = {
        a: set(EventRunLog.objects.filter(run=run).values_list("kind", flat=True))
        for a, run in runs.items()
    }
    assert kinds["t.ok"] == {"cleanup.reverted", "cleanup.swept"}
    assert kinds["t.drift"] == {"cleanup.drifted", "cleanup.swept"}
    assert (
        kinds["t.no"] == kinds["t.gone"] == kinds["t.dead"] == {"cleanup.failed", "cleanup.swept"}
    )


@pytest.mark.django_db(transaction=True)
def test_a_claim_taken_over_mid_pass_fences_only_its_rows(isolated_registry):  # R5, #12
    runs: list[EventRun] = []

    def revert(**kw):
        # While this pass calls, another sweeper takes run 0's row over (as after a
        # stall past the TTL): its verdict must not be written, the others' must.
        Res.filter(run=runs[0]).update(claim_token="someone-else")
        return {"ok": True}

    ledger_action(isolated_registry, revert=revert)
    runs += _runs(3)
    report = {s.run_id: s for s in sweep().runs}
    assert (report[runs[0].pk].fenced, report[runs[0].pk].reverted) == (1, 0)
    assert [report[r.pk].reverted for r in runs[1:]] == [1, 1]
    assert Res.get(run=runs[0]).status == "reverting"
    assert EventRunLog.objects.filter(run=runs[0], kind="cleanup.fenced").exists()
    assert not EventRunLog.objects.filter(run=runs[1], kind="cleanup.fenced").exists()


@pytest.mark.django_db
def test_a_raising_give_back_is_its_groups_verdict_not_the_passes(
    isolated_registry, monkeypatch
):  # C5, #12
    import events_ledger.cleanup as cleanup

    ledger_action(isolated_registry)
    runs = _runs(3)
    real = cleanup._give_back

    def flaky(group, rows, token=None):
        if group.run_id == runs[1].pk:
            raise RuntimeError("the registry broke")
        return real(group, rows, token)

    monkeypatch.setattr(cleanup, "_give_back", flaky)
    report = {s.run_id: s for s in sweep().runs}
    assert report[runs[1].pk].failed == 1
    assert "the registry broke" in report[runs[1].pk].errors[0]
    assert [report[r.pk].reverted for r in (runs[0], runs[2])] == [1, 1]


@pytest.mark.django_db
def test_one_run_cleanup_is_a_batch_of_one(isolated_registry):  # C4
    ledger_action(isolated_registry)
    run = _runs(1, groups=2, rows=3)[0]
    summary = cleanup_run(run)
    assert (summary.attempted, summary.reverted, summary.cleanup_status) == (6, 6, "complete")
    assert len(summary.groups) == 2


@pytest.mark.django_db(transaction=True)
def test_reconcile_asks_in_parallel_too(isolated_registry, settings):  # C6, #12
    from events_ledger.cleanup import reconcile_module

    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_CONCURRENCY": 4}
    barrier = threading.Barrier(4, timeout=30)

    def reconcile(*, run_id, resources):
        barrier.wait()
        return {"ok": True, "in_force": [r["ref"] for r in resources]}

    ledger_action(isolated_registry, reconcile=reconcile)
    _runs(2, groups=2)
    summary = reconcile_module("t")
    assert (summary.asked, summary.in_force, summary.errors) == (4, 4, [])


@pytest.mark.django_db
def test_a_scoped_sweep_works_and_repairs_only_its_scope(isolated_registry):  # C5, #13
    # The bench sweeps with its scope on a database that may hold real runs: nothing
    # outside the scope may be claimed, given back, repaired or logged.
    ledger_action(isolated_registry)
    mine = _runs(2)
    theirs = _runs(2)
    EventRun.objects.filter(pk__in=[r.pk for r in mine]).update(scope="bench")
    EventRun.objects.filter(pk__in=[r.pk for r in theirs]).update(scope="host")
    # A summary its rows contradict, out of scope: a scoped sweep leaves it as it is.
    stale = RunFactory(status="completed", cleanup_status="incomplete", scope="host")
    report = sweep(scope="bench")
    assert sorted(s.run_id for s in report.runs) == sorted(r.pk for r in mine)
    assert report.repaired_runs == []
    assert not Res.filter(run__in=mine).exclude(status="reverted").exists()
    assert Res.filter(run__in=theirs, status="confirmed").count() == 2
    assert not EventRunLog.objects.filter(run__in=[*theirs, stale]).exists()
    assert EventRun.objects.get(pk=stale.pk).cleanup_status == "incomplete"
    # Unscoped, the cron's sweep takes the rest.
    report = sweep()
    assert {s.run_id for s in report.runs} == {r.pk for r in theirs}
    assert (stale.pk, "complete") in report.repaired_runs


@pytest.mark.django_db
def test_a_pass_leaves_runs_another_sweeper_holds_claimed_to_it(isolated_registry, settings):
    # C5, R5, #27: sweepers started together took the same first runs and split them, so
    # more sweepers gave back less. A fresh claim is another sweeper's work; the scan
    # passes over it and takes the next runs. A claim gone stale is taken again.
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_RUN_BATCH": 2}
    ledger_action(isolated_registry)
    held, *free = _runs(4)
    claim = Res.claim_group(list(Res.filter(run=held)), ttl=timedelta(minutes=5))
    assert claim.rows  # another sweeper's claim, fresh
    report = sweep()
    assert sorted(s.run_id for s in report.runs) == [run.pk for run in free[:2]]
    assert Res.get(run=held).claim_token == claim.token  # untouched
    assert sorted(s.run_id for s in sweep().runs) == [free[2].pk]
    assert not sweep().runs  # the held run waits for its claim's owner
    Res.filter(run=held).update(updated_at=timezone.now() - timedelta(hours=1))  # stale
    assert [s.run_id for s in sweep().runs] == [held.pk]
    assert Res.get(run=held).status == "reverted"


@pytest.mark.django_db
def test_a_sweeper_with_a_backlog_repairs_at_most_every_so_often(isolated_registry, settings):
    # C5, SPEC "summaries race too", #26: the repair reads every run that owes
    # something, so under a backlog it cost a pass as much as the work. A process
    # repairs on its first pass, on every pass after a scan with room, and while its
    # scans come back full at most every CLEANUP_REPAIR_EVERY; the summary still ends
    # repaired.
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "CLEANUP_RUN_BATCH": 2,
        "CLEANUP_REPAIR_EVERY": 3600,
    }
    ledger_action(isolated_registry)
    _runs(5)  # a backlog: two passes with full scans, then one with room

    def stale() -> EventRun:
        # Its rows are all given back, its summary says otherwise: only the repair sees.
        return RunFactory(status="completed", cleanup_status="incomplete")

    first = stale()
    report = sweep()
    assert (first.pk, "complete") in report.repaired_runs  # the process's first pass
    assert len(report.runs) == 2 and not report.repair_skipped
    second = stale()
    report = sweep()  # the last scan was full: no repair within the hour
    assert report.repair_skipped and report.repaired_runs == []
    assert len(report.runs) == 2
    assert EventRun.objects.get(pk=second.pk).cleanup_status == "incomplete"
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "CLEANUP_RUN_BATCH": 2,
        "CLEANUP_REPAIR_EVERY": 0.001,
    }
    report = sweep()  # the interval has passed
    assert (second.pk, "complete") in report.repaired_runs
    assert len(report.runs) == 1  # the scan has room now
    third = stale()
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "CLEANUP_RUN_BATCH": 2,
        "CLEANUP_REPAIR_EVERY": 3600,
    }
    report = sweep()  # no backlog: every pass repairs, as before
    assert (third.pk, "complete") in report.repaired_runs
    assert report.runs == [] and not report.repair_skipped
