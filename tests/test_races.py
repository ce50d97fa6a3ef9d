"""Concurrency with real processes on the real database (R1, R5, fenced verdicts)."""

from __future__ import annotations

from collections import Counter

import pytest

from events_ledger.models import EventRunResource
from tests.conftest import age_rows
from tests.factories import ResourceFactory, RunFactory
from tests.processes import race

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

PROCS = 8


def test_eight_processes_reserving_the_same_200_targets():  # R1, R0
    runs = [RunFactory() for _ in range(PROCS)]
    refs = [f"target-{i}" for i in range(200)]
    results = race(
        "reserve", [{"run_id": r.pk, "refs": refs, "seed": i} for i, r in enumerate(runs)]
    )
    assert [e for r in results for e in r["errors"]] == []
    won = Counter(ref for r in results for ref in r["ok"])
    assert sorted(won) == sorted(refs) and set(won.values()) == {1}
    assert sum(r["held"] for r in results) == 200 * (PROCS - 1)
    held = Counter(
        EventRunResource.objects.filter(owner_module="race").held().values_list("ref", flat=True)
    )
    assert held == Counter({ref: 1 for ref in refs})


def _claim_race(ids, **extra):
    results = race("claim", [{"ids": ids, "seed": i, **extra} for i in range(PROCS)])
    return Counter(pk for r in results for pk in r["won"])


@pytest.mark.parametrize("group", [1, 7])
def test_eight_processes_claiming_fresh_rows_one_winner_each(group):  # R5
    run = RunFactory(status="completed")
    ids = [ResourceFactory(run=run, status="confirmed").pk for _ in range(200)]
    won = _claim_race(ids, group=group)
    assert sorted(won) == sorted(ids) and set(won.values()) == {1}


@pytest.mark.parametrize("group", [1, 7])
def test_eight_processes_claiming_stale_rows_one_winner_each(group):  # R5
    run = RunFactory(status="completed")
    ids = [ResourceFactory(run=run, status="reverting").pk for _ in range(200)]
    age_rows(EventRunResource, ids, seconds=3600)
    won = _claim_race(ids, ttl_s=60, group=group)
    assert sorted(won) == sorted(ids) and set(won.values()) == {1}
    assert set(
        EventRunResource.objects.filter(pk__in=ids).values_list("revert_attempts", flat=True)
    ) == {0}


def test_stale_claim_taken_over_refuses_the_old_claimants_verdict():  # R5, fenced verdicts
    run = RunFactory(status="completed")
    ids = [ResourceFactory(run=run, status="confirmed").pk for _ in range(20)]
    [old] = race("claim", [{"ids": ids, "seed": 0}])
    age_rows(EventRunResource, ids, seconds=3600)
    [new] = race("claim", [{"ids": ids, "seed": 1, "ttl_s": 60, "group": 20}])
    assert sorted(new["won"]) == sorted(ids)
    old_tokens = set(old["tokens"].values())
    results = race("verdict", [{"ids": ids, "token": t} for t in old_tokens])
    assert sum(r["written"] for r in results) == 0
    assert set(EventRunResource.objects.filter(pk__in=ids).values_list("status", flat=True)) == {
        "reverting"
    }
    [mine] = race("verdict", [{"ids": ids, "token": next(iter(new["tokens"].values()))}])
    assert mine["written"] == 20
