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
