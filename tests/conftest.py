from __future__ import annotations

import pytest
from django.db import connection


@pytest.fixture
def vendor() -> str:
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
