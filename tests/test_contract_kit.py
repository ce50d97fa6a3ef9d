"""The contract kit (issue 6): the demo world keeps the ledger's promises, and modules
broken on purpose are reported by the names of exactly the promises they break."""

from __future__ import annotations

import ast
import re
import threading
import time
from dataclasses import FrozenInstanceError, replace
from pathlib import Path
from typing import Any

import pytest
from django.test import TransactionTestCase

import events_ledger.testing as kit
from events_ledger import Action, Lease, NotRegistered
from events_ledger.testing import (
    ACTION_PROMISES,
    LEASE_PROMISES,
    PERFORM_ANSWERS_ENVELOPE,
    PERFORM_IS_IDEMPOTENT_BY_KEY,
    RECONCILE_ANSWERS_ENVELOPE_OR_NOTHING,
    RECONCILE_LISTS_WHAT_IS_IN_FORCE,
    RESTORE_ANSWERS_DRIFTED_WHEN_VALUE_MOVED,
    RESTORE_IS_SAFE_WHEN_ALREADY_BACK,
    RESTORE_PUTS_BASELINE_BACK,
    REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER,
    REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER,
    REVERT_OF_MISSING_IS_SUCCESS,
    REVERT_TWICE_IS_SAFE,
    ContractReport,
    check_action,
    check_lease,
)
from project.world.models import Announcement, Creature, RegionSetting

world_db = pytest.mark.django_db(transaction=True)

#: Hang cases cost this much per hung call; the whole check must stay well under a second or two.
SHORT_BUDGET_MS = 150


# ── a small world for modules broken on purpose ──


class Shelf:
    """Things made by key, in memory. The methods keep every promise; the tests break one
    at a time by overriding a method or by wiring a broken function in its place."""

    def __init__(self) -> None:
        self.things: dict[str, str] = {}  # ref -> the idempotency key that made it
        self.lock = threading.Lock()
        self.calls: list[tuple[str, Any, str | None]] = []  # (verb, run_id, key)

    def perform(self, *, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
        self.calls.append(("perform", run_id, idempotency_key))
        refs = [f"{idempotency_key[:12]}-{i}" for i in range(int(params.get("count", 2)))]
        with self.lock:
            for ref in refs:
                self.things[ref] = idempotency_key
        return {"ok": True, "resources": [{"kind": "thing", "ref": ref} for ref in refs]}

    def revert(self, *, run_id: int, resources: list[dict[str, Any]], idempotency_key: str) -> Any:
        self.calls.append(("revert", run_id, idempotency_key))
        with self.lock:
            if resources:
                for r in resources:
                    self.things.pop(r["ref"], None)
            else:
                for ref, key in list(self.things.items()):
                    if key == idempotency_key:
                        del self.things[ref]
        return {"ok": True}

    def reconcile(self, *, run_id: int, resources: list[dict[str, Any]]) -> Any:
        self.calls.append(("reconcile", run_id, None))
        return {"ok": True, "in_force": [r["ref"] for r in resources if r["ref"] in self.things]}

    def exists(self, resource: dict[str, Any]) -> bool:
        return resource["ref"] in self.things


def shelve(registry, shelf: Shelf, **overrides: Any) -> str:
    """Register the shelf's action (with any part replaced) and answer its id."""
    action = Action(
        id="t.shelve",
        owner="t",
        reversible="ledger",
        budget_ms=2_000,
        perform=shelf.perform,
        revert=shelf.revert,
        reconcile=shelf.reconcile,
    )
    registry.register_action(replace(action, **overrides))
    return action.id


def hang(**kwargs: Any) -> Any:
    time.sleep(2)  # longer than the budget; ends soon after, so no thread lingers long


class Dial:
    """One borrowed value per target, in memory, with a restore that keeps every promise."""

    def __init__(self, value: int = 1) -> None:
        self.values: dict[str | None, int] = {}
        self.start = value

    def read(self, *, target: str | None) -> int:
        return self.values.setdefault(target, self.start)

    def apply(self, value: int, *, target: str | None, run_id: int) -> Any:
        self.values[target] = value
        return {"ok": True}

    def restore(self, baseline: int, *, expected: int, run_id: int, target: str | None) -> Any:
        current = self.read(target=target)
        if current == expected:
            self.values[target] = baseline
            return {"ok": True}
        if current == baseline:
            return {"ok": True}
        return {"ok": False, "drifted": True, "current": current}


def dial(registry, d: Dial, **overrides: Any) -> str:
    lease = Lease(id="t.dial", owner="t", read=d.read, apply=d.apply, restore=d.restore)
    registry.register_lease(replace(lease, **overrides))
    return lease.id


# ── the demo world passes ──


@world_db
def test_the_demo_worlds_spawn_keeps_every_promise(world):  # contract kit, W5, C3, C6
    report = check_action(
        "world.spawn",
        params={"region": "north", "count": 2, "kind": "wolf"},
        exists=lambda r: Creature.objects.filter(serial=r["ref"]).exists(),
    )
    report.assert_kept()
    assert report.passed and report.broken == [] and report.skipped == {}
    assert report.kept == list(ACTION_PROMISES)
    assert "exists() finds none" in report.details[REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER]
    assert "exists() finds none" in report.details[REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER]
    assert "the same 2 resource(s)" in report.details[PERFORM_IS_IDEMPOTENT_BY_KEY]
    assert Creature.objects.count() == 0  # the kit gave back what it made


class KitUnderDjangosRunner(TransactionTestCase):
    """#25, contract kit: under ``manage.py test`` the kit runs in a TransactionTestCase
    (docs/actions-and-leases.md), its worker threads seeing the test's committed data."""

    def setUp(self) -> None:
        from project.world import world as w

        w.switch_off()
        self.addCleanup(w.switch_off)

    def test_the_kit_checks_an_action_and_a_lease(self) -> None:
        RegionSetting.objects.create(region="north", spawn_rate=3)
        exists = lambda r: Creature.objects.filter(serial=r["ref"]).exists()  # noqa: E731
        check_action(
            "world.spawn", params={"region": "north", "count": 2}, exists=exists
        ).assert_kept()
        check_lease("world.spawn_rate", target="north", value=5, move_to=42).assert_kept()
        self.assertEqual(Creature.objects.count(), 0)
        self.assertEqual(RegionSetting.objects.get(region="north").spawn_rate, 3)


@world_db
def test_the_demo_worlds_spawn_is_checked_through_its_own_reconcile(world):  # contract kit, C6
    report = check_action("world.spawn", params={"region": "south", "count": 1})
    assert report.broken == [] and report.skipped == {}
    assert "reconcile lists none" in report.details[REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER]
    assert "reconcile lists none" in report.details[PERFORM_IS_IDEMPOTENT_BY_KEY]
    assert Creature.objects.count() == 0


@world_db
def test_the_demo_worlds_spawn_rate_keeps_every_promise(world):  # contract kit, W6, C2
    RegionSetting.objects.create(region="north", spawn_rate=3)
    report = check_lease("world.spawn_rate", target="north", value=5, move_to=42)
    report.assert_kept()
    assert report.kept == list(LEASE_PROMISES) and report.skipped == {}
    assert report.subject == "lease world.spawn_rate#north"
    assert RegionSetting.objects.get(region="north").spawn_rate == 3  # left as found
    # A targeted ref names the target as well as target= does.
    assert check_lease("world.spawn_rate#north", value=6, move_to=7).passed


@world_db
def test_an_action_with_nothing_to_give_back_has_only_its_answer_checked(world):  # contract kit
    report = check_action("world.announce", params={"text": "hello"})
    assert report.passed and report.kept == [PERFORM_ANSWERS_ENVELOPE]
    assert set(report.skipped) == set(ACTION_PROMISES[1:])
    assert "'none' action" in report.skipped[REVERT_TWICE_IS_SAFE]
    assert Announcement.objects.count() == 1


# ── a module keeping its promises, in memory ──


def test_a_well_behaved_module_keeps_every_promise(isolated_registry):  # contract kit
    shelf = Shelf()
    report = check_action(
        shelve(isolated_registry, shelf), {"count": 3}, exists=shelf.exists, run_id=7
    )
    assert report.passed and report.kept == list(ACTION_PROMISES)
    assert shelf.things == {}
    assert {run_id for _, run_id, _ in shelf.calls} == {7}
    performs = [key for verb, _, key in shelf.calls if verb == "perform"]
    # A fresh key per perform, but for the retry of one key (the idempotency promise).
    assert len(performs) == 5 and len(set(performs)) == 4
    assert [key for key in performs if performs.count(key) == 2] == [performs[-1]] * 2
    assert all(re.fullmatch(r"[0-9a-f]{32}", key) for key in performs)  # uuid4 hex
    shelf.calls.clear()
    check_action("t.shelve", {"count": 1})
    assert {run_id for _, run_id, _ in shelf.calls} == {0}  # run_id=0 unless told


def test_the_report_is_a_small_frozen_value(isolated_registry):  # contract kit
    shelf = Shelf()
    report = check_action(shelve(isolated_registry, shelf), exists=shelf.exists)
    assert isinstance(report, ContractReport)
    with pytest.raises(FrozenInstanceError):
        report.subject = "x"  # type: ignore[misc]
    assert "keeps the ledger's promises" in str(report)
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)+", name) for name in ACTION_PROMISES + LEASE_PROMISES)
    assert len(set(ACTION_PROMISES + LEASE_PROMISES)) == len(ACTION_PROMISES + LEASE_PROMISES)


# ── broken actions are reported by name ──


class RefusesUnknown(Shelf):
    """revert answers ok:false for refs it does not know, and so for a second revert too."""

    def revert(self, *, run_id, resources, idempotency_key):
        if any(r["ref"] not in self.things for r in resources):
            return {"ok": False, "error": "no such thing"}
        return super().revert(run_id=run_id, resources=resources, idempotency_key=idempotency_key)


class RaisesTheSecondTime(Shelf):
    def __init__(self) -> None:
        super().__init__()
        self.reverted: set[str] = set()

    def revert(self, *, run_id, resources, idempotency_key):
        if any(r["ref"] in self.reverted for r in resources):
            raise RuntimeError("double free")
        self.reverted |= {r["ref"] for r in resources}
        return super().revert(run_id=run_id, resources=resources, idempotency_key=idempotency_key)


class IgnoresAnEmptyList(Shelf):
    """revert(resources=[], key) answers ok and gives back nothing: a lost spawn stays."""

    def revert(self, *, run_id, resources, idempotency_key):
        for r in resources:
            self.things.pop(r["ref"], None)
        return {"ok": True}


class HoldsBackWhatTheLedgerHolds(Shelf):
    """Takes the list for "what the ledger holds" and the empty list for "only the rest":
    what reconcile was asked about (the ledger holds it) is left out of a give-back by key,
    so the recorded part of a partly recorded answer stays in the world."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def reconcile(self, *, run_id, resources):
        self.asked |= {r["ref"] for r in resources}
        return super().reconcile(run_id=run_id, resources=resources)

    def revert(self, *, run_id, resources, idempotency_key):
        if not resources:
            mine = [ref for ref, key in self.things.items() if key == idempotency_key]
            resources = [{"ref": ref} for ref in mine if ref not in self.asked]
            if not resources:
                return {"ok": True}
        return super().revert(run_id=run_id, resources=resources, idempotency_key=idempotency_key)


class MakesAgainOnRetry(Shelf):
    """Not idempotent: every perform makes new things, whatever its key (all kept by key,
    so a revert by key still gives back both calls' things)."""

    def __init__(self) -> None:
        super().__init__()
        self.performed = 0

    def perform(self, *, run_id, params, idempotency_key):
        self.performed += 1
        refs = [f"{idempotency_key[:12]}-{self.performed}-{i}" for i in range(2)]
        with self.lock:
            for ref in refs:
                self.things[ref] = idempotency_key
        return {"ok": True, "resources": [{"kind": "thing", "ref": ref} for ref in refs]}


class AnswersNothingOnRetry(Shelf):
    """A retry with a key it has seen answers ok with nothing ("already done"): the ledger
    would record that answer, and the first call's things would never be given back."""

    def perform(self, *, run_id, params, idempotency_key):
        if idempotency_key in self.things.values():
            return {"ok": True, "resources": []}
        return super().perform(run_id=run_id, params=params, idempotency_key=idempotency_key)


class RaisesOnRetry(Shelf):
    """A retry with a key it has seen raises ("already exists"): no retry ever answers."""

    def perform(self, *, run_id, params, idempotency_key):
        if idempotency_key in self.things.values():
            raise KeyError("already exists")
        return super().perform(run_id=run_id, params=params, idempotency_key=idempotency_key)


@pytest.mark.parametrize(
    "shelf_class,broken",
    [
        (RefusesUnknown, [REVERT_TWICE_IS_SAFE, REVERT_OF_MISSING_IS_SUCCESS]),
        (RaisesTheSecondTime, [REVERT_TWICE_IS_SAFE]),
        (
            IgnoresAnEmptyList,
            [REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER, REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER],
        ),
        (HoldsBackWhatTheLedgerHolds, [REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER]),
        (MakesAgainOnRetry, [PERFORM_IS_IDEMPOTENT_BY_KEY]),
        (AnswersNothingOnRetry, [PERFORM_IS_IDEMPOTENT_BY_KEY]),
        (RaisesOnRetry, [PERFORM_IS_IDEMPOTENT_BY_KEY]),
    ],
)
def test_a_broken_module_is_named(isolated_registry, shelf_class, broken):  # contract kit, W5, C3
    shelf = shelf_class()
    report = check_action(shelve(isolated_registry, shelf), exists=shelf.exists)
    assert report.broken == broken and not report.passed
    assert set(report.kept) == set(ACTION_PROMISES) - set(broken)
    with pytest.raises(AssertionError) as failure:
        report.assert_kept()
    assert all(name in str(failure.value) for name in broken)
    assert shelf.things == {} or shelf_class is IgnoresAnEmptyList  # the kit cleans up where it can


def test_the_exception_of_a_broken_revert_is_in_the_details(isolated_registry):  # contract kit
    shelf = RaisesTheSecondTime()
    report = check_action(shelve(isolated_registry, shelf))
    assert "raised RuntimeError: double free" in report.details[REVERT_TWICE_IS_SAFE]


# ── revert by key after a partly recorded answer (the in-flight issue) ──


def test_the_recorded_part_is_asked_about_before_the_give_back_by_key(
    isolated_registry,
):  # contract kit, the invariant, C3
    shelf = Shelf()
    report = check_action(shelve(isolated_registry, shelf), {"count": 3}, exists=shelf.exists)
    assert REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER in report.kept
    # The ledger's order for a step whose placeholder stayed: perform answered, the
    # recorded part is live (reconcile may ask about it), then revert by key with [].
    keys = [key for verb, _, key in shelf.calls if verb == "perform"]
    partly = keys[2]
    at = shelf.calls.index(("perform", 0, partly))
    assert shelf.calls[at + 1 : at + 3] == [("reconcile", 0, None), ("revert", 0, partly)]


@pytest.mark.parametrize(
    "probe,why",
    [
        (True, "what the perform whose answer was partly recorded made is still there"),
        (False, "reconcile still lists what the perform whose answer was partly recorded made"),
    ],
)
def test_a_module_that_holds_back_what_the_ledger_holds_is_named(
    isolated_registry, probe, why
):  # contract kit, the invariant, C3
    shelf = HoldsBackWhatTheLedgerHolds()
    report = check_action(shelve(isolated_registry, shelf), exists=shelf.exists if probe else None)
    assert report.broken == [REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER]
    assert why in report.details[REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER]
    assert shelf.things == {}  # given back by the reported refs afterwards


# ── a second perform with the same key ──


@pytest.mark.parametrize(
    "shelf_class,why",
    [
        (MakesAgainOnRetry, "a retried step would make it twice"),
        (AnswersNothingOnRetry, "would never be given back"),
        (RaisesOnRetry, "raised KeyError"),
    ],
)
def test_a_perform_that_is_not_idempotent_by_key_says_how(
    isolated_registry, shelf_class, why
):  # contract kit, W5
    shelf = shelf_class()
    report = check_action(shelve(isolated_registry, shelf), exists=shelf.exists)
    assert why in report.details[PERFORM_IS_IDEMPOTENT_BY_KEY]
    assert shelf.things == {}  # both calls' things given back, by key


def test_the_union_is_not_looked_for_when_revert_by_key_is_broken_already(
    isolated_registry,
):  # contract kit
    shelf = IgnoresAnEmptyList()
    report = check_action(shelve(isolated_registry, shelf), exists=shelf.exists)
    # One fault, named where it is: the idempotency promise is kept, its by-key part not read.
    assert PERFORM_IS_IDEMPOTENT_BY_KEY in report.kept
    assert "is broken already" in report.skipped[PERFORM_IS_IDEMPOTENT_BY_KEY]
    assert shelf.things == {}  # given back by the reported refs instead


def test_a_lost_spawn_left_behind_is_seen_through_reconcile_without_a_probe(
    isolated_registry,
):  # contract kit
    shelf = IgnoresAnEmptyList()
    report = check_action(shelve(isolated_registry, shelf))
    assert report.broken == [
        REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER,
        REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER,
    ]
    assert "reconcile still lists" in report.details[REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER]
    assert shelf.things == {}  # given back by the reported resources afterwards


def test_with_neither_probe_nor_reconcile_the_lost_spawn_part_is_skipped(
    isolated_registry,
):  # contract kit
    shelf = IgnoresAnEmptyList()
    report = check_action(shelve(isolated_registry, shelf, reconcile=None))
    # The answer was checked (ok), whether anything came back could not be: said, not hidden.
    assert report.broken == [] and REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER in report.kept
    for name in (
        REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER,
        REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER,
        PERFORM_IS_IDEMPOTENT_BY_KEY,
    ):
        assert name in report.kept and "exists=" in report.skipped[name]
    assert report.skipped[RECONCILE_LISTS_WHAT_IS_IN_FORCE] == "the action declares no reconcile"
    assert "declares no reconcile" in report.details[RECONCILE_ANSWERS_ENVELOPE_OR_NOTHING]
    assert "not checked" in str(report)


@pytest.mark.parametrize(
    "garbage",
    [
        {"ok": "yes"},
        ["a"],
        {"ok": True, "in_force": "all"},
        {"ok": True, "in_force": [{"ref": "x"}]},
        None,
    ],
)
def test_a_reconcile_answering_garbage_is_named(isolated_registry, garbage):  # contract kit, C6
    shelf = Shelf()
    report = check_action(
        shelve(isolated_registry, shelf, reconcile=lambda **kw: garbage), exists=shelf.exists
    )
    assert report.broken == [RECONCILE_ANSWERS_ENVELOPE_OR_NOTHING]
    assert RECONCILE_LISTS_WHAT_IS_IN_FORCE in report.skipped


def test_a_reconcile_that_forgets_live_resources_is_named_and_not_trusted(
    isolated_registry,
):  # contract kit, C6
    shelf = IgnoresAnEmptyList()
    report = check_action(
        shelve(isolated_registry, shelf, reconcile=lambda **kw: {"ok": True, "in_force": []})
    )
    assert report.broken == [RECONCILE_LISTS_WHAT_IS_IN_FORCE]
    assert "orphaned" in report.details[RECONCILE_LISTS_WHAT_IS_IN_FORCE]
    # Its silence proves nothing, so the lost spawn left behind is not declared gone.
    assert REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER in report.skipped
    assert REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER in report.skipped


@pytest.mark.parametrize(
    "answer,why",
    [
        ({"ok": 1, "resources": []}, "literal True"),
        ({"ok": True}, "must be a list"),
        ({"ok": True, "resources": [{"kind": "@step", "ref": "x"}]}, "reserved kind"),
        ({"ok": True, "resources": [{"kind": "thing", "ref": "r" * 191}]}, "bad ref"),
        ("<html>502</html>", "only"),
    ],
)
def test_a_perform_answering_a_bad_envelope_is_named(
    isolated_registry, answer, why
):  # contract kit, W1, W5
    shelf = Shelf()
    report = check_action(
        shelve(isolated_registry, shelf, perform=lambda **kw: answer), exists=shelf.exists
    )
    assert report.broken == [PERFORM_ANSWERS_ENVELOPE]
    assert why in report.details[PERFORM_ANSWERS_ENVELOPE]


def test_a_perform_that_raises_is_named_with_its_exception(isolated_registry):  # contract kit
    def explode(**kwargs):
        raise ConnectionError("shard down")

    report = check_action(shelve(isolated_registry, Shelf(), perform=explode))
    assert report.broken == [PERFORM_ANSWERS_ENVELOPE]
    assert "raised ConnectionError: shard down" in report.details[PERFORM_ANSWERS_ENVELOPE]


def test_a_hanging_perform_is_a_broken_promise_not_a_hung_suite(isolated_registry):  # contract kit
    started = time.monotonic()
    report = check_action(
        shelve(isolated_registry, Shelf(), perform=hang, budget_ms=SHORT_BUDGET_MS)
    )
    assert time.monotonic() - started < 1.5
    assert report.broken == [PERFORM_ANSWERS_ENVELOPE]
    assert "did not answer within 0.15s" in report.details[PERFORM_ANSWERS_ENVELOPE]
    for name in (
        REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER,
        REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER,
        PERFORM_IS_IDEMPOTENT_BY_KEY,
    ):
        assert "budget" in report.skipped[name]  # a hung perform is called once, not again


def test_a_revert_that_hangs_on_an_empty_list_is_named(isolated_registry):  # contract kit
    shelf = Shelf()

    def revert(*, run_id, resources, idempotency_key):
        if not resources:
            hang()
        return shelf.revert(run_id=run_id, resources=resources, idempotency_key=idempotency_key)

    started = time.monotonic()
    report = check_action(
        shelve(isolated_registry, shelf, revert=revert, budget_ms=SHORT_BUDGET_MS),
        exists=shelf.exists,
    )
    assert time.monotonic() - started < 1.5
    assert report.broken == [
        REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER,
        REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER,
    ]
    assert "did not answer within" in report.details[REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER]
    assert shelf.things == {}  # what the lost perform made was given back by its refs


def test_what_cannot_be_checked_is_refused_plainly(isolated_registry):  # contract kit
    with pytest.raises(NotRegistered):
        check_action("t.nobody")
    with pytest.raises(ValueError, match="check_lease"):
        check_action("core.lease")
    with pytest.raises(NotRegistered):
        check_lease("t.nobody", value=1, move_to=2)
    name = dial(isolated_registry, Dial(value=1))
    with pytest.raises(ValueError, match="differ"):
        check_lease(name, value=1, move_to=2)  # value is the baseline: nothing would change
    with pytest.raises(ValueError, match="differ"):
        check_lease(name, value=2, move_to=2)


# ── broken leases are reported by name ──


def test_a_well_behaved_lease_keeps_every_promise(isolated_registry):  # contract kit
    d = Dial(value=1)
    report = check_lease(dial(isolated_registry, d), target="a", value=5, move_to=9)
    assert report.passed and report.kept == list(LEASE_PROMISES)
    assert d.values == {"a": 1}


def overwrites(d: Dial):
    def restore(baseline, *, expected, run_id, target):
        d.values[target] = baseline  # never drifted: somebody else's value is lost
        return {"ok": True}

    return restore


def answers_ok_doing_nothing(d: Dial):
    return lambda baseline, **kw: {"ok": True}


def refuses_when_already_back(d: Dial):
    def restore(baseline, *, expected, run_id, target):
        current = d.read(target=target)
        if current == expected:
            d.values[target] = baseline
            return {"ok": True}
        return {"ok": False, "drifted": True, "current": current}  # "already back" read as drift

    return restore


def drifted_without_current(d: Dial):
    def restore(baseline, *, expected, run_id, target):
        if d.read(target=target) == expected:
            d.values[target] = baseline
            return {"ok": True}
        return {"ok": True} if d.read(target=target) == baseline else {"drifted": True}

    return restore


@pytest.mark.parametrize(
    "make_restore,broken",
    [
        (overwrites, [RESTORE_ANSWERS_DRIFTED_WHEN_VALUE_MOVED]),
        (
            answers_ok_doing_nothing,
            [RESTORE_PUTS_BASELINE_BACK, RESTORE_ANSWERS_DRIFTED_WHEN_VALUE_MOVED],
        ),
        (refuses_when_already_back, [RESTORE_IS_SAFE_WHEN_ALREADY_BACK]),
        (drifted_without_current, [RESTORE_ANSWERS_DRIFTED_WHEN_VALUE_MOVED]),
    ],
)
def test_a_broken_restore_is_named(isolated_registry, make_restore, broken):  # contract kit, C1, C2
    d = Dial(value=1)
    report = check_lease(dial(isolated_registry, d, restore=make_restore(d)), value=5, move_to=9)
    assert report.broken == broken
    with pytest.raises(AssertionError, match=broken[0]):
        report.assert_kept()
    assert d.values == {None: 1}  # the baseline is put back whatever broke


def test_a_restore_that_overwrites_says_what_the_ledger_would_read(
    isolated_registry,
):  # contract kit, C1
    d = Dial(value=1)
    report = check_lease(dial(isolated_registry, d, restore=overwrites(d)), value=5, move_to=9)
    assert "reads as done, not drifted" in report.details[RESTORE_ANSWERS_DRIFTED_WHEN_VALUE_MOVED]


def test_a_hanging_restore_breaks_every_lease_promise_quickly(isolated_registry):  # contract kit
    d = Dial(value=1)
    started = time.monotonic()
    report = check_lease(
        dial(isolated_registry, d, restore=lambda *a, **kw: hang(), budget_ms=SHORT_BUDGET_MS),
        value=5,
        move_to=9,
    )
    assert time.monotonic() - started < 1.5
    assert report.broken == list(LEASE_PROMISES)
    assert all("did not answer within" in report.details[name] for name in LEASE_PROMISES)
    assert d.values == {None: 1}


def test_a_lease_whose_read_raises_breaks_every_promise(isolated_registry):  # contract kit
    def read(*, target):
        raise OSError("settings service down")

    report = check_lease(dial(isolated_registry, Dial(), read=read), value=5, move_to=9)
    assert report.broken == list(LEASE_PROMISES)
    assert "raised OSError: settings service down" in report.details[RESTORE_PUTS_BASELINE_BACK]


# ── shipped in the wheel ──


def test_the_kit_imports_nothing_from_the_example_project_or_the_tests():  # contract kit
    tree = ast.parse(Path(kit.__file__).read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.split(".")[0] in ("project", "tests")}
