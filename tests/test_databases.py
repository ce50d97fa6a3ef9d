"""The ledger on the databases hosts deploy: one alias for every read and write of the
ledger, whatever the host's router says (a replica behind ``db_for_read``), and an alias
of its own (``EVENTS_LEDGER["DATABASE"]``; ``make test`` runs the core suite so, with the
host's tables on SQLite and the ledger's on PostgreSQL)."""

from __future__ import annotations

import os
from io import StringIO

import pytest
from django.core.management import call_command

from events_ledger import cleanup_run, execute_step, snapshot
from events_ledger.checks import check_settings
from events_ledger.db import ledger_db
from events_ledger.models import EventRun, EventRunResource, EventRunStep
from events_ledger.routers import LedgerRouter
from project.world.models import Creature
from tests.helpers import new_run, spawn_step, wait_until

world_db = pytest.mark.django_db(transaction=True)


class ReadsElsewhere:
    """A host's router that sends the ledger's reads and writes to an alias that does not
    exist (a replica that lags, another server), and allows every relation, as a
    replica's router does: a query of the ledger's that asked it would fail at once."""

    def _route(self, model: type, **hints: object) -> str | None:
        return "nowhere" if model._meta.app_label == "events_ledger" else None  # type: ignore[attr-defined]

    db_for_read = db_for_write = _route

    def allow_relation(self, obj1: object, obj2: object, **hints: object) -> bool:
        return True


@world_db
def test_the_ledger_never_asks_the_hosts_router(settings, world):  # R, W, C: one alias
    settings.DATABASE_ROUTERS = [f"{__name__}.ReadsElsewhere"]
    run = new_run()
    step = spawn_step(run, count=2)
    assert execute_step(step).outcome == "done"
    assert EventRun.objects.transition(run, "cancelled", from_="running")
    step = EventRunStep.objects.get(pk=step.pk)
    assert step.run.pk == run.pk  # a related row, through the base manager
    run.refresh_from_db()
    summary = cleanup_run(run)
    assert summary.reverted == 2 and Creature.objects.count() == 0
    assert snapshot().healthy
    row = EventRunResource.objects.filter(run=run).first()
    assert row is not None and row.status == "reverted"
    call_command("ledger_status", "--json", stdout=StringIO())
    lone = new_run(status="completed")
    lone.delete()  # a run that owes nothing and has no rows
    assert not EventRun.objects.filter(pk=lone.pk).exists()


def test_an_alias_that_does_not_exist_is_a_check_error(settings):  # S4
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "DATABASE": "ledgr"}
    errors = [e for e in check_settings() if e.id == "events_ledger.E006"]
    assert errors and "'ledgr'" in errors[0].msg and "default" in errors[0].msg


def test_an_alias_of_its_own_without_the_router_is_a_check_warning(settings):  # S4
    settings.DATABASES = {**settings.DATABASES, "ledger2": settings.DATABASES["default"]}
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "DATABASE": "ledger2"}
    settings.DATABASE_ROUTERS = []
    assert "events_ledger.W002" in [e.id for e in check_settings()]
    settings.DATABASE_ROUTERS = ["events_ledger.routers.LedgerRouter"]
    assert "events_ledger.W002" not in [e.id for e in check_settings()]


def test_the_router_migrates_the_ledger_on_its_alias_only(settings):  # the own alias
    settings.DATABASES = {**settings.DATABASES, "ledger2": settings.DATABASES["default"]}
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "DATABASE": "ledger2"}
    router = LedgerRouter()
    assert router.allow_migrate("ledger2", "events_ledger") is True
    assert router.allow_migrate("default", "events_ledger") is False
    assert router.allow_migrate("ledger2", "auth") is False  # the alias is the ledger's
    assert router.allow_migrate("default", "auth") is None  # the host decides
    assert router.db_for_read(EventRun) == ledger_db() == "ledger2"


@pytest.mark.skipif(
    not os.environ.get("DATABASE_REPLICA_URL"), reason="a streaming replica (make test's run)"
)
@pytest.mark.django_db(transaction=True, databases=["default", "replica"])
def test_a_replica_behind_the_hosts_router_lags_and_the_ledger_never_reads_it(world):  # R, C
    from django.db import DatabaseError, router

    assert router.db_for_read(EventRun) == "replica"  # the host's router says so

    def replica_has_the_test_database() -> bool:
        try:
            return EventRun.objects.using("replica").count() >= 0
        except DatabaseError:
            return False  # made on the primary; the standby replays it after its delay

    wait_until(replica_has_the_test_database, "the test database on the replica")
    run = new_run()
    # The replica is real and behind: what was just committed is not on it yet.
    assert not EventRun.objects.using("replica").filter(pk=run.pk).exists()
    # The ledger reads what it has just written: the step it claims, the run it ends.
    step = spawn_step(run, count=2)
    assert execute_step(step).outcome == "done"
    assert EventRun.objects.transition(run, "cancelled", from_="running")
    assert cleanup_run(run).reverted == 2 and Creature.objects.count() == 0
    wait_until(
        lambda: (
            EventRun.objects.using("replica").filter(pk=run.pk, cleanup_status="complete").exists()
        ),
        "the replica to catch up",
    )


@pytest.mark.skipif(not os.environ.get("DATABASE_POOL"), reason="Django's pool (make test's run)")
@world_db
def test_the_pool_lends_the_ledgers_threads_a_connection_and_gets_it_back(settings, world):
    # Django's pool: every thread's connection is taken from it, the deadline's worker
    # threads and the claim keeper's too, and must be given back when they are done,
    # or a pass a minute leaks the pool dry.
    from django.db import connections

    pool = connections[ledger_db()].pool
    assert pool is not None
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "CLEANUP_CONCURRENCY": 4}
    runs = []
    for n in range(4):
        run = new_run(name=f"pooled-{n}")
        for seq in range(2):
            assert execute_step(spawn_step(run, f"r{n}", 1, seq=seq)).outcome == "done"
        assert EventRun.objects.transition(run, "cancelled", from_="running")
        runs.append(run)
    from events_ledger import sweep

    report = sweep()
    assert sum(s.reverted for s in report.runs) == 8 and Creature.objects.count() == 0
    stats = pool.get_stats()
    lent = stats["pool_size"] - stats["pool_available"]
    assert lent <= 1, stats  # this thread's, at most: every worker thread's came back
