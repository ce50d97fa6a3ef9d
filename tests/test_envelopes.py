"""One reading of every module answer (``envelopes``), and the budget every call runs under.

The write half, the undo half and the contract kit read answers only through
``events_ledger.envelopes``; these tests hold that reading, and what each caller makes
of it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from events_ledger import Action, Lease
from events_ledger.cleanup import reconcile_module
from events_ledger.deadline import CallResult
from events_ledger.envelopes import (
    classify_perform,
    classify_revert,
    read_reconcile,
    read_resources,
)
from events_ledger.ledger import execute_step
from events_ledger.models import EventRunResource, EventRunStep
from tests.factories import ResourceFactory
from tests.helpers import new_run, new_step


@pytest.mark.parametrize(
    ("raw", "outcome"),
    [
        ({"ok": True}, "done"),
        ({"ok": True, "resources": "not a list"}, "done"),  # resources are read apart
        ({"ok": 1}, "retry"),
        ({"ok": False}, "retry"),
        ({"ok": False, "retry": False, "error": "no such region"}, "terminal"),
        ({"drifted": True, "current": 3}, "retry"),  # means nothing for a perform
        ("<html>", "retry"),
        (None, "retry"),
    ],
)
def test_classify_perform_reads_only_ok_true_as_done(raw, outcome):  # W5
    assert classify_perform(raw, "t.make").outcome == outcome


def test_classify_perform_and_revert_read_a_failure_alike():  # W5, C1
    for raw in ("<html>", {"ok": False, "error": "locked"}, {"retry": False}):
        perform, revert = classify_perform(raw, "x"), classify_revert(raw, "x")
        assert (perform.outcome, perform.error) == (revert.outcome, revert.error)
    timed_out = CallResult(timed_out=True, what="x.perform", budget_s=0.2)
    assert classify_perform(timed_out, "x").outcome == "retry"
    assert "0.2" in (classify_perform(timed_out, "x").error or "")
    raised = CallResult(error=RuntimeError("boom"), what="x.perform")
    assert classify_perform(raised, "x").outcome == "retry"


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "<html>",
        {"ok": True},
        {"ok": 1, "in_force": []},
        {"ok": True, "in_force": "a"},
        {"ok": True, "in_force": ["a", None]},
        {"ok": True, "in_force": ["a", True]},
        {"ok": True, "in_force": [{"ref": "a"}]},
    ],
)
def test_read_reconcile_answers_nothing_but_a_list_of_refs(raw):  # C6
    answer = read_reconcile(raw, "t.reconcile")
    assert answer.in_force is None and not answer.answered
    assert answer.error and "t.reconcile" in answer.error


def test_read_reconcile_compares_numbers_as_text():  # C6
    assert read_reconcile({"ok": True, "in_force": ["a", 7]}, "x").in_force == {"a", "7"}
    assert read_reconcile({"ok": True, "in_force": []}, "x").in_force == frozenset()


def test_read_resources_refuses_a_non_list_whole_and_keeps_the_first_of_a_ref():  # W1
    read = read_resources("many", "t.make")
    assert read.rows == {} and "not a list" in read.rejected[0]
    read = read_resources(
        [{"kind": "k", "ref": "a", "payload": 1}, {"kind": "k", "ref": "a"}, {"kind": "k"}],
        "t.make",
    )
    assert list(read.rows) == [("k", "a")] and read.rows[("k", "a")]["payload"] == 1
    assert len(read.rejected) == 1 and "bad ref" in read.rejected[0]


@pytest.mark.django_db(transaction=True)
def test_a_reconcile_listing_a_malformed_ref_orphans_nothing(isolated_registry):  # C6
    # A None among the refs names no row: read as "not in force" it would orphan every
    # live row of the action. The answer is "unanswered" instead, as the kit says.
    isolated_registry.register_action(
        Action(
            id="t.make",
            owner="t",
            reversible="ledger",
            perform=lambda **_: {"ok": True},
            revert=lambda **_: {"ok": True},
            reconcile=lambda **_: {"ok": True, "in_force": ["a", None]},
        )
    )
    run = new_run()
    step = new_step(run, "t.make")
    row = ResourceFactory(run=run, step=step, owner_module="t", ref="a")
    ResourceFactory(run=run, step=step, owner_module="t", ref="b")
    summary = reconcile_module("t")
    assert (summary.unanswered, summary.orphaned) == (2, 0)
    assert "in_force" in summary.errors[0]
    assert EventRunResource.objects.filter(run=run, status="confirmed").count() == 2
    assert EventRunResource.objects.get(pk=row.pk).status == "confirmed"


def test_a_budget_of_zero_or_none_is_the_default_budget(settings):  # W5, C1
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "DEFAULT_REVERT_BUDGET": timedelta(seconds=7),
    }
    assert Action(id="a", owner="o", budget_ms=0).budget_s == 7
    assert Action(id="a", owner="o").budget_s == 7  # not set: the setting, as a lease's
    assert Action(id="a", owner="o", budget_ms=250).budget_s == 0.25
    assert Lease(id="l", owner="o").budget_s == 7
    assert Lease(id="l", owner="o", budget_ms=1500).budget_s == 1.5


@pytest.mark.django_db(transaction=True)
def test_a_perform_without_a_budget_gets_the_default_not_none(isolated_registry):  # W5
    # Before, a perform's deadline was budget_ms / 1000: an action declaring no budget
    # (0) timed out at once, every step "overdue" however fast its module answered.
    def perform(**_):
        time.sleep(0.05)
        return {"ok": True, "resources": []}

    isolated_registry.register_action(
        Action(id="t.quick", owner="t", reversible="ledger", perform=perform, budget_ms=0)
    )
    step = new_step(new_run(), "t.quick")
    assert execute_step(step).outcome == "done"
    assert EventRunStep.objects.get(pk=step.pk).status == "done"
