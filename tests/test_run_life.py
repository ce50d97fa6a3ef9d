"""A run's whole life (SPEC R, "Run transitions are compare-and-set too"): only the
moves of its state machine, named when refused, and a status the database refuses."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from events_ledger import InvalidTransition
from events_ledger.models import EventRun
from events_ledger.states import RUN_MOVES, RUN_STATUSES, RUN_TERMINAL
from tests.helpers import new_run

pytestmark = pytest.mark.django_db


def test_a_word_that_is_no_run_status_is_refused_and_nothing_is_written():  # R, #35
    # On a419c07 "complete" (the cleanup word) was stored, and no sweep saw the run again.
    run = new_run(status="running")
    for to, from_ in [("complete", "running"), ("completed", "runing"), ("finished", "running")]:
        with pytest.raises(InvalidTransition, match="no run status"):
            EventRun.objects.transition(run, to, from_=from_)
    run.refresh_from_db()
    assert run.status == "running"


@pytest.mark.parametrize("terminal", RUN_TERMINAL)
def test_a_terminal_status_is_final(terminal):  # R, #35: no way back
    run = new_run(status=terminal)
    for to in RUN_STATUSES:
        if to == terminal:
            continue
        with pytest.raises(InvalidTransition, match=f"{terminal} → {to}"):
            EventRun.objects.transition(run, to, from_=terminal)
    assert EventRun.objects.get(pk=run.pk).status == terminal


def test_every_move_of_the_machine_is_made_once_and_refreshes_the_instance():  # R, #35
    for source, targets in RUN_MOVES.items():
        for to in targets:
            run = new_run(status=source)
            assert EventRun.objects.transition(run, to, from_=source)
            assert run.status == to  # the instance says what the row says
            assert (run.finished_at is not None) == (to in RUN_TERMINAL)
            assert not EventRun.objects.transition(run.pk, to, from_=source)  # lost: moved


def test_the_database_refuses_a_status_that_is_none():  # R, #35: whatever path writes it
    with pytest.raises(IntegrityError), transaction.atomic():
        EventRun.objects.create(name="typo", status="finished")
    run = new_run(status="running")
    with pytest.raises(IntegrityError), transaction.atomic():
        EventRun.objects.filter(pk=run.pk).update(status="complete")
    with pytest.raises(IntegrityError), transaction.atomic():
        EventRun.objects.filter(pk=run.pk).update(cleanup_status="done")
    assert EventRun.objects.get(pk=run.pk).status == "running"
