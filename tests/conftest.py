from __future__ import annotations

import json
import os
from typing import Any

import pytest


@pytest.fixture
def vendor() -> str:
    from tests.helpers import connection

    return connection.vendor


def age_rows(model, pks, seconds: float) -> None:
    """Set rows' updated_at back by `seconds` against the database's own UTC clock."""
    from datetime import timedelta

    from events_ledger.db import UtcNow

    model.objects.filter(pk__in=list(pks)).update(updated_at=UtcNow() - timedelta(seconds=seconds))


@pytest.fixture
def isolated_registry():
    """Register test actions freely; the registry is put back afterwards."""
    from events_ledger import registry

    with registry.isolated() as reg:
        yield reg


@pytest.fixture
def world():
    """The demo world, clean, with its faults off. Its verbs run in worker threads
    with their own connections, so tests using it need committed data
    (``django_db(transaction=True)``)."""
    from project.world import world as w

    w.switch_off()
    yield w
    w.switch_off()


@pytest.fixture
def figure(request, vendor):
    """Record a scenario's figure and whether its invariant held, for ``make chaos``."""
    recorded: dict[str, Any] = {}

    def record(value: str, holds: bool, **detail: Any) -> None:
        recorded.update(figure=value, invariant=holds, detail=detail)

    yield record
    path = os.environ.get("LEDGER_CHAOS_REPORT")
    if path and recorded:
        line = {
            "scenario": request.node.name,
            "database": vendor,
            "size": os.environ.get("LEDGER_CHAOS", "short"),
            **recorded,
        }
        with open(path, "a") as out:
            out.write(json.dumps(line, default=str) + "\n")


@pytest.fixture(autouse=True)
def _no_verdicts_in_hand_between_tests():
    """#24: the undo half's process-wide state (verdicts in hand, claims to hand back,
    when it last repaired) starts empty in every test, whatever an earlier test left."""
    from events_ledger import cleanup

    cleanup._backlog.drop_all()
    cleanup._unfinished.reset_after_fork()
    try:  # the anonymous "needs a human" verdict a probe may reuse
        from events_ledger import health

        health._verdicts.clear()
    except Exception:  # the health extra is not installed
        pass
    cleanup._repair_pace.reset_after_fork()  # each test's first pass repairs
    yield
    cleanup._backlog.drop_all()  # the keeper must not write into the next test's tables


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With the ledger on an alias of its own (``LEDGER_DATABASE_URL``), a test that
    touches the database touches both: the host's default and the ledger's alias."""
    from django.conf import settings

    if len(settings.DATABASES) == 1:
        return
    # A mirror (the streaming replica) is read only where a test names it: a test's own
    # transaction there would hold the standby's replay back.
    aliases = [
        alias for alias, db in settings.DATABASES.items() if not db.get("TEST", {}).get("MIRROR")
    ]
    for item in items:
        marker = item.get_closest_marker("django_db")
        uses_db = {"db", "transactional_db"} & set(getattr(item, "fixturenames", ()))
        if (marker is None and not uses_db) or (marker and "databases" in marker.kwargs):
            continue
        kwargs = dict(marker.kwargs) if marker else {}
        if marker is None and "transactional_db" in uses_db:
            kwargs["transaction"] = True
        item.add_marker(pytest.mark.django_db(databases=aliases, **kwargs), append=False)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: Any, django_db_blocker: Any) -> Any:
    """With a streaming replica (``DATABASE_REPLICA_URL``): made as a mirror (a standby
    creates nothing), then pointed at the standby's own copy of the test database, so a
    read routed there is a read of the replica, lag and all."""
    from django.db import connections

    if "replica" in connections.settings:
        replica = connections["replica"]
        replica.close()
        replica.settings_dict = {
            **connections.settings["replica"],
            "NAME": connections["default"].settings_dict["NAME"],
        }
    yield
