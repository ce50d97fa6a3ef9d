"""Both PostgreSQL drivers: the suite's second PostgreSQL run speaks psycopg2
(``LEDGER_PG_DRIVER=psycopg2``, see scripts/test-all), and what the ledger reads of an
error, or decides about its fast path, does not depend on which one a host installed."""

from __future__ import annotations

import os

import pytest
from django.db import DatabaseError, IntegrityError, transaction

from events_ledger import fastpath
from events_ledger.db import is_unique_violation, sqlstate
from events_ledger.models import EventRunResource
from tests.helpers import connection, new_run

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not os.environ.get("DATABASE_URL", "").startswith("postgres"),
        reason="the PostgreSQL drivers",
    ),
]


def driver() -> str:
    connection.ensure_connection()
    return connection.Database.__name__


def test_the_driver_asked_for_is_the_one_in_use():  # the run is what it says it is
    assert driver() == os.environ.get("LEDGER_PG_DRIVER", "psycopg")


def test_a_servers_error_is_read_alike_on_both_drivers():  # R1: held, not a crash
    run = new_run()
    EventRunResource.objects.create(run=run, owner_module="t", kind="thing", ref="a")
    with pytest.raises(IntegrityError) as second, transaction.atomic():
        EventRunResource.objects.create(run=run, owner_module="t", kind="thing", ref="a")
    # On psycopg2 the SQLSTATE is ``pgcode``: read as psycopg 3's ``sqlstate`` only, a
    # held target raised IntegrityError out of reserve() instead of the held refusal.
    assert is_unique_violation(second.value) and sqlstate(second.value) == "23505"
    with pytest.raises(DatabaseError) as zero, connection.cursor() as cursor:
        cursor.execute("SELECT 1/0")
    assert sqlstate(zero.value) == "22012"


def test_a_held_target_is_refused_by_name_on_both_drivers():  # R1
    run, other = new_run(), new_run()
    Res = EventRunResource.objects
    assert Res.reserve(run, owner="t", kind="thing", ref="a").ok
    refused = Res.reserve(other, owner="t", kind="thing", ref="a")
    assert (refused.ok, refused.code) == (False, "held")
    assert refused.holder is not None and refused.holder.run_id == run.pk


def test_the_fast_path_is_taken_only_where_its_driver_is_tested():  # fast path
    assert fastpath.enabled() == (driver() == "psycopg")
