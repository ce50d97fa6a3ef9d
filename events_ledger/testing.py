"""The contract kit: check a host app's actions and leases against the ledger's promises.

One call per action or lease, from the host app's own test suite::

    from events_ledger.testing import check_action, check_lease

    def test_spawn_keeps_the_ledgers_promises():
        check_action("world.spawn", params={"region": "north", "count": 2},
                     exists=lambda r: Creature.objects.filter(serial=r["ref"]).exists()).assert_kept()

    def test_spawn_rate_keeps_the_ledgers_promises():
        check_lease("world.spawn_rate", target="north", value=5, move_to=42).assert_kept()

The kit makes real calls, each under ``call_with_deadline`` with the action's (or the
lease's) budget, as the ledger itself would: a module that hangs is a broken promise, not
a hung test suite, and one that raises is a broken promise with the exception in the
details. It uses ``run_id=0`` unless told otherwise and a fresh idempotency key for every
perform but the one retry it makes on purpose, and gives back what it made wherever it
can. A module that keeps its data in a database needs committed data to see it from the
deadline's worker threads: with pytest-django, ``@pytest.mark.django_db(transaction=True)``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .deadline import CallResult, call_with_deadline
from .envelopes import classify_revert, describe, is_success, normalise, read_reconcile
from .registry import Action, Lease, NotRegistered, default_registry, split_lease_ref

__all__ = [
    "ACTION_PROMISES",
    "LEASE_PROMISES",
    "ContractReport",
    "check_action",
    "check_lease",
]

# ── the promises, by stable name ──

#: ``perform`` answers ``{"ok": True, "resources": [{"kind", "ref"}, ...]}``, each entry one
#: the ledger accepts (``events_ledger.envelopes.normalise``).
PERFORM_ANSWERS_ENVELOPE = "perform_answers_envelope"
#: A second ``perform`` with the same key makes nothing new and answers what the first
#: made: the ledger retries a step with its key after a lost answer, and records only the
#: retry's answer.
PERFORM_IS_IDEMPOTENT_BY_KEY = "perform_is_idempotent_by_key"
#: ``revert`` of resources that never existed answers ``ok: True``.
REVERT_OF_MISSING_IS_SUCCESS = "revert_of_missing_is_success"
#: ``revert`` of what ``perform`` reported, twice: both answer ``ok: True``.
REVERT_TWICE_IS_SAFE = "revert_twice_is_safe"
#: ``revert(resources=[], idempotency_key=k)`` gives back what the ``perform`` with key
#: ``k`` made, when its answer was lost.
REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER = "revert_by_key_gives_back_lost_answer"
#: ``revert(resources=[], idempotency_key=k)`` gives back everything the ``perform`` with
#: key ``k`` made, also what its answer reported and the ledger recorded: when part of an
#: answer cannot be recorded, the step's placeholder stays and the ledger asks by key,
#: with an empty list, for all of it.
REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER = "revert_by_key_gives_back_partly_recorded_answer"
#: ``reconcile``, when declared, answers ``{"ok": True, "in_force": [refs]}``.
RECONCILE_ANSWERS_ENVELOPE_OR_NOTHING = "reconcile_answers_envelope_or_nothing"
#: ``reconcile`` lists what ``perform`` just made: a live resource it leaves out would be
#: marked orphaned by the ledger, and never given back.
RECONCILE_LISTS_WHAT_IS_IN_FORCE = "reconcile_lists_what_is_in_force"

#: ``restore(baseline, expected=value)`` after ``apply(value)`` answers ``ok: True`` and
#: ``read()`` gives the baseline again.
RESTORE_PUTS_BASELINE_BACK = "restore_puts_baseline_back"
#: When somebody else moved the value after ``apply``, ``restore`` answers
#: ``{"drifted": True, "current": ...}`` and leaves their value in place.
RESTORE_ANSWERS_DRIFTED_WHEN_VALUE_MOVED = "restore_answers_drifted_when_value_moved"
#: ``restore`` when the value is already the baseline answers ``ok: True``.
RESTORE_IS_SAFE_WHEN_ALREADY_BACK = "restore_is_safe_when_already_back"

ACTION_PROMISES = (
    PERFORM_ANSWERS_ENVELOPE,
    PERFORM_IS_IDEMPOTENT_BY_KEY,
    RECONCILE_ANSWERS_ENVELOPE_OR_NOTHING,
    RECONCILE_LISTS_WHAT_IS_IN_FORCE,
    REVERT_TWICE_IS_SAFE,
    REVERT_OF_MISSING_IS_SUCCESS,
    REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER,
    REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER,
)
LEASE_PROMISES = (
    RESTORE_IS_SAFE_WHEN_ALREADY_BACK,
    RESTORE_PUTS_BASELINE_BACK,
    RESTORE_ANSWERS_DRIFTED_WHEN_VALUE_MOVED,
)

Resource = dict[str, Any]
Exists = Callable[[Resource], bool]


# ── the report ──


@dataclass(frozen=True)
class ContractReport:
    """What one ``check_action`` or ``check_lease`` found.

    ``broken`` lists the broken promises by name, in the order of ``ACTION_PROMISES`` /
    ``LEASE_PROMISES``; ``details`` explains every promise checked, kept or broken;
    ``skipped`` names the promises (or the parts of one) that could not be checked, and
    why. A promise whose answer was checked but whose effect could not be is both kept
    and in ``skipped``.
    """

    subject: str
    kept: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.broken

    def assert_kept(self) -> None:
        """Raise ``AssertionError`` naming each broken promise and why."""
        if self.broken:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        if not self.broken:
            head = f"{self.subject} keeps the ledger's promises ({len(self.kept)} checked)"
        else:
            head = f"{self.subject} breaks {len(self.broken)} of the ledger's promises:"
        lines = [head]
        lines += [f"  - {name}: {self.details.get(name, '')}" for name in self.broken]
        if self.skipped:
            lines.append("  not checked:")
            lines += [f"  - {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


class _Broken(Exception):
    """The promise being checked is broken; the message says how."""


class _Skipped(Exception):
    """The promise being checked cannot be checked; the message says why."""


class _Checker:
    """Collects verdicts, one per promise, and calls modules under their deadline."""

    def __init__(self, subject: str, order: tuple[str, ...], budget_s: float) -> None:
        self.subject, self.order, self.budget_s = subject, order, budget_s
        self.kept: list[str] = []
        self.broken: list[str] = []
        self.details: dict[str, str] = {}
        self.skipped: dict[str, str] = {}

    def call(self, fn: Callable[[], Any], what: str) -> CallResult:
        return call_with_deadline(fn, self.budget_s, what)

    def promise(self, name: str, check: Callable[[], str]) -> bool:
        """Run one promise's check: it answers a note (kept), or raises ``_Broken`` or
        ``_Skipped``. Answers whether the promise was kept."""
        try:
            note = check()
        except _Broken as exc:
            self.broken.append(name)
            self.details[name] = str(exc)
            return False
        except _Skipped as exc:
            self.skipped[name] = str(exc)
            return False
        self.kept.append(name)
        self.details[name] = note
        return True

    def report(self) -> ContractReport:
        rank = {name: i for i, name in enumerate(self.order)}
        return ContractReport(
            subject=self.subject,
            kept=sorted(self.kept, key=rank.__getitem__),
            broken=sorted(self.broken, key=rank.__getitem__),
            details=dict(self.details),
            skipped={k: self.skipped[k] for k in sorted(self.skipped, key=rank.__getitem__)},
        )


def _answer(call: CallResult) -> Any:
    """The module's answer, or ``_Broken`` when it raised or did not answer in time."""
    if call.timed_out or call.error is not None:
        raise _Broken(call.message)
    return call.value


def _new_key() -> str:
    return uuid.uuid4().hex


# ── actions ──


def check_action(
    action: str | Action,
    params: Mapping[str, Any] | None = None,
    *,
    exists: Exists | None = None,
    missing: list[Resource] | None = None,
    run_id: int = 0,
) -> ContractReport:
    """Check an action against the ledger's promises, with real calls.

    ``action`` is a registered id or an ``Action``; ``params`` are what a step would
    pass to ``perform``. ``exists(resource) -> bool`` is an optional probe of your world
    (``resource`` is the dict the ledger passes to ``revert``: kind, ref, payload,
    member_key): it proves that ``revert(resources=[], idempotency_key=k)`` really gave
    back what the ``perform`` with key ``k`` made. Without it the kit asks the action's
    own ``reconcile``, and without either it checks only the answer and says so in
    ``skipped``. ``missing`` are resources that do not exist, for the revert-of-missing
    promise; by default the kit makes some up from what ``perform`` reported.

    A ``ledger`` action is performed five times with four keys: one answer kept, one
    treated as lost, one treated as partly recorded, and one key performed twice, as a
    retried step is. Everything it made is given back. A ``none`` or ``self`` action is
    performed once and only its answer is checked. An ``override`` action borrows
    through a lease: check the lease with ``check_lease``.
    """
    act = _resolve_action(action)
    if act.reversible == "override":
        raise ValueError(
            f"{act.id} borrows values through a lease: check the lease with check_lease()"
        )
    if not callable(act.perform):
        raise ValueError(f"{act.id} declares no perform(): there is nothing to check")
    checker = _Checker(f"action {act.id}", ACTION_PROMISES, act.budget_s)
    _ActionCheck(act, dict(params or {}), exists, missing, run_id, checker).run()
    return checker.report()


def _resolve_action(action: str | Action) -> Action:
    if isinstance(action, Action):
        return action
    found = default_registry.action(action)
    if found is None:
        raise NotRegistered(f"no action {action!r} is registered")
    return found


class _ActionCheck:
    def __init__(
        self,
        action: Action,
        params: dict[str, Any],
        exists: Exists | None,
        missing: list[Resource] | None,
        run_id: int,
        checker: _Checker,
    ) -> None:
        self.action, self.params, self.exists, self.missing = action, params, exists, missing
        self.run_id, self.c = run_id, checker
        self.ledgered = action.reversible == "ledger"
        self.key = _new_key()
        #: What the first perform reported (the ledger's revert shape); None: unknown.
        self.made: list[Resource] | None = None
        self.perform_timed_out = False
        #: Its reconcile answered the envelope and listed what perform made.
        self.reconcile_trusted = False
        self.in_force: set[str] = set()

    def run(self) -> None:
        c, action = self.c, self.action
        try:
            c.promise(PERFORM_ANSWERS_ENVELOPE, self.perform_answers_envelope)
            if not self.ledgered:
                why = f"a {action.reversible!r} action has nothing for the ledger to give back"
                for name in ACTION_PROMISES[1:]:
                    c.skipped[name] = why
                return
            c.promise(RECONCILE_ANSWERS_ENVELOPE_OR_NOTHING, self.reconcile_answers_envelope)
            if callable(action.reconcile) and RECONCILE_ANSWERS_ENVELOPE_OR_NOTHING in c.kept:
                self.reconcile_trusted = c.promise(
                    RECONCILE_LISTS_WHAT_IS_IN_FORCE, self.reconcile_lists
                )
            elif callable(action.reconcile):
                c.skipped[RECONCILE_LISTS_WHAT_IS_IN_FORCE] = (
                    "its reconcile does not answer the envelope"
                )
            else:
                c.skipped[RECONCILE_LISTS_WHAT_IS_IN_FORCE] = "the action declares no reconcile"
            c.promise(REVERT_TWICE_IS_SAFE, self.revert_twice)
            c.promise(REVERT_OF_MISSING_IS_SUCCESS, self.revert_of_missing)
            c.promise(REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER, self.revert_by_key)
            c.promise(REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER, self.revert_by_key_partly)
            # Last: whether revert by key gives back both answers is read only when the
            # lost-answer promise is not broken already (one fault, named once).
            c.promise(PERFORM_IS_IDEMPOTENT_BY_KEY, self.perform_is_idempotent)
        finally:
            if self.ledgered and REVERT_TWICE_IS_SAFE not in c.kept:
                # Give back what the first perform made, whatever went wrong above.
                self.give_back(self.made or [], self.key)

    # ── calls ──

    def perform(self, key: str) -> CallResult:
        perform, params = self.action.perform, self.params
        assert perform is not None
        return self.c.call(
            lambda: perform(run_id=self.run_id, params=dict(params), idempotency_key=key),
            f"{self.action.id}.perform",
        )

    def revert(self, resources: list[Resource], key: str) -> CallResult:
        revert = self.action.revert
        assert revert is not None
        return self.c.call(
            lambda: revert(
                run_id=self.run_id, resources=[dict(r) for r in resources], idempotency_key=key
            ),
            f"{self.action.id}.revert",
        )

    def reconcile(self, resources: list[Resource]) -> CallResult:
        reconcile = self.action.reconcile
        assert reconcile is not None
        return self.c.call(
            lambda: reconcile(run_id=self.run_id, resources=[dict(r) for r in resources]),
            f"{self.action.id}.reconcile",
        )

    def give_back(self, resources: list[Resource], key: str) -> None:
        """Best effort, answer ignored: the kit's own cleanup, not a check."""
        if callable(self.action.revert):
            self.revert(resources, key)

    def require_revert(self, call: CallResult, which: str) -> None:
        # The ledger's own reading (C1): only ok: True is done, and a `failed` list
        # names resources it could not give back.
        answer = _answer(call)
        verdict = classify_revert(call, self.action.id)
        if verdict.outcome != "done":
            raise _Broken(
                f"{which} answered {describe(answer)}, which the ledger reads as "
                f"{verdict.outcome}: {verdict.error}"
            )
        if verdict.failed:
            raise _Broken(f"{which} answered ok but listed {verdict.failed} as not given back")

    # ── promises ──

    def perform_answers_envelope(self) -> str:
        call = self.perform(self.key)
        self.perform_timed_out = call.timed_out
        answer = _answer(call)
        resources = answer.get("resources") if isinstance(answer, dict) else None
        entries = resources if isinstance(resources, list) else []
        made, refused = [], []
        for entry in entries:
            parsed = normalise(entry, self.action.id)
            if parsed.ok and parsed.row is not None:
                made.append(_revert_shape(parsed.row))
            else:
                refused.append(parsed.reason or "")
        if isinstance(resources, list):
            self.made = made  # even when the answer is broken: what can be given back is
        if not is_success(answer):
            raise _Broken(
                f'perform answered {describe(answer)}: only {{"ok": true, ...}} '
                "(the literal True) is success"
            )
        if self.ledgered and not isinstance(resources, list):
            raise _Broken(
                f"perform answered resources={describe(resources)}: a 'ledger' action's "
                "answer is the only record of what it made, so it must be a list"
            )
        if resources is not None and not isinstance(resources, list):
            raise _Broken(f"perform answered resources={describe(resources)}, which is not a list")
        if refused:
            raise _Broken("the ledger refuses what perform reported: " + "; ".join(refused))
        return f"answered ok with {len(made)} resource(s) the ledger accepts"

    def reconcile_answers_envelope(self) -> str:
        if not callable(self.action.reconcile):
            return "declares no reconcile: the ledger reads that as 'unanswered' and leaves its rows alone"
        # The very reading reconcile_resources applies (C4).
        answer = read_reconcile(self.reconcile(self.made or self.missing_resources()), "reconcile")
        if answer.in_force is None:
            raise _Broken(answer.error or "reconcile did not answer")
        self.in_force = set(answer.in_force)
        return f"answered the envelope, {len(answer.in_force)} ref(s) in force"

    def reconcile_lists(self) -> str:
        if not self.made:
            raise _Skipped("perform reported nothing live to ask reconcile about")
        left_out = [r["ref"] for r in self.made if r["ref"] not in self.in_force]
        if left_out:
            raise _Broken(
                f"reconcile left out {describe(left_out)}, which perform had just made: "
                "the ledger would mark them orphaned and never give them back"
            )
        return f"listed all {len(self.made)} resource(s) perform had just made"

    def revert_twice(self) -> str:
        if self.made is None:
            raise _Skipped("perform did not report what it made, so there is nothing to revert")
        self.require_revert(self.revert(self.made, self.key), "the first revert")
        self.require_revert(
            self.revert(self.made, self.key), "the second revert of the same resources"
        )
        return f"both reverts of {len(self.made)} resource(s) answered ok"

    def missing_resources(self) -> list[Resource]:
        if self.missing is not None:
            return [dict(r) for r in self.missing]
        # Shaped like what perform reports, naming objects that never existed.
        models = self.made or [{"kind": "contract-kit", "payload": None, "member_key": None}]
        return [{**r, "ref": f"missing-{uuid.uuid4().hex[:24]}"} for r in models]

    def revert_of_missing(self) -> str:
        resources = self.missing_resources()
        self.require_revert(
            self.revert(resources, _new_key()), "revert of resources that never existed"
        )
        return f"revert of {describe([r['ref'] for r in resources], 80)} answered ok"

    def revert_by_key(self) -> str:
        if self.perform_timed_out:
            raise _Skipped("perform did not answer within its budget; a second one would hang too")
        key = _new_key()
        lost = self.perform(key)  # its answer is "lost": only the key is used below
        return self.gives_back_by_key(
            REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER,
            key,
            _reported(lost.value, self.action.id),
            "the lost perform",
        )

    def revert_by_key_partly(self) -> str:
        # The module cannot tell this case from a lost answer, and need not: the same
        # call must give back everything the key made. What differs is the ledger's side:
        # the recorded part is live on its ledger, so reconcile may be asked about it
        # before the give-back, and a module that takes the list for "what the ledger
        # holds" and the empty list for "only the rest" leaves the recorded part behind.
        self.require_answers("there is no answer to record")
        key = _new_key()
        call = self.perform(key)
        if call.timed_out or call.error is not None or not is_success(call.value):
            self.give_back([], key)
            why = call.message if call.timed_out or call.error else describe(call.value)
            raise _Skipped(f"perform with a fresh key did not answer ok this time: {why}")
        made = _reported(call.value, self.action.id)
        # Read as the ledger reads an answer whose last entry it refused: the rest is
        # recorded, and the placeholder stays.
        recorded = made[:-1]
        if recorded and callable(self.action.reconcile):
            if RECONCILE_ANSWERS_ENVELOPE_OR_NOTHING in self.c.kept:
                self.reconcile(recorded)  # as reconcile_resources may, while the run goes on
        return self.gives_back_by_key(
            REVERT_BY_KEY_GIVES_BACK_PARTLY_RECORDED_ANSWER,
            key,
            made,
            "the perform whose answer was partly recorded",
        )

    def perform_is_idempotent(self) -> str:
        name = PERFORM_IS_IDEMPOTENT_BY_KEY
        self.require_answers("its answers cannot be compared")
        key = _new_key()
        made: list[Resource] = []
        given_back = False
        try:
            call = self.perform(key)
            made = _reported(call.value, self.action.id)
            if call.timed_out or call.error is not None or not is_success(call.value):
                why = call.message if call.timed_out or call.error else describe(call.value)
                raise _Skipped(f"the first perform with a fresh key did not answer ok: {why}")
            retry = self.perform(key)
            again = _reported(retry.value, self.action.id)
            made = _unique(made + again)
            if retry.timed_out or retry.error is not None or not is_success(retry.value):
                why = retry.message if retry.timed_out or retry.error else describe(retry.value)
                raise _Broken(
                    f"a second perform with the same key did not answer ok ({why}): the "
                    "ledger retries a step with its key after a lost answer, so a retry "
                    "must answer ok with what the key made"
                )
            before = {(r["kind"], r["ref"]) for r in _reported(call.value, self.action.id)}
            after = {(r["kind"], r["ref"]) for r in again}
            if after - before:
                raise _Broken(
                    "a second perform with the same key answered "
                    f"{describe(sorted(ref for _, ref in after - before))}, which the first "
                    "did not: a retried step would make it twice"
                )
            if before - after:
                raise _Broken(
                    "a second perform with the same key left out "
                    f"{describe(sorted(ref for _, ref in before - after))}, which the first "
                    "reported: the ledger records a retry's answer, so what it leaves out "
                    "would never be given back"
                )
            same = f"both performs with one key answered the same {len(before)} resource(s)"
            if REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER in self.c.broken:
                self.c.skipped[name] = (
                    "whether revert by key gives back what both performs made: "
                    f"{REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER} is broken already"
                )
                return same
            given_back = True
            return f"{same}; " + self.gives_back_by_key(name, key, made, "the two performs")
        finally:
            if not given_back:
                # The kit's own cleanup: by key, unless that is what is broken, and by
                # the refs the performs reported.
                if REVERT_BY_KEY_GIVES_BACK_LOST_ANSWER not in self.c.broken:
                    self.give_back([], key)
                if made:
                    self.give_back(made, key)

    def require_answers(self, otherwise: str) -> None:
        """A promise about a received answer needs a perform that answers the envelope."""
        if self.perform_timed_out:
            raise _Skipped("perform did not answer within its budget; a second one would hang too")
        if PERFORM_ANSWERS_ENVELOPE not in self.c.kept:
            raise _Skipped(
                f"perform does not answer the envelope (see {PERFORM_ANSWERS_ENVELOPE}), so "
                + otherwise
            )

    def gives_back_by_key(self, name: str, key: str, made: list[Resource], whose: str) -> str:
        """``revert(resources=[], idempotency_key=key)`` answers ok and what ``whose``
        reported (``made``) is gone. What could not be seen gone is given back by its
        refs afterwards, so the kit leaves the world as it found it."""
        verified = False
        try:
            self.require_revert(self.revert([], key), "revert(resources=[], idempotency_key=k)")
            note, verified = self.check_gone(name, made, whose)
            return note
        finally:
            if made and not verified:
                self.give_back(made, key)

    def check_gone(self, name: str, made: list[Resource], whose: str) -> tuple[str, bool]:
        """Look, with ``exists=`` or the trusted reconcile, whether ``made`` is gone.
        Answers the promise's note and whether it was seen gone; ``_Broken`` when it is
        still there. What cannot be seen is said in ``skipped``, under ``name``."""
        answered = "revert(resources=[], idempotency_key=k) answered ok"
        if not made:
            self.c.skipped[name] = (
                f"whether it gave anything back: {whose} reported nothing to look for"
            )
            return answered, False
        refs = [r["ref"] for r in made]
        if self.exists is not None:
            still = [r["ref"] for r in made if self.exists(dict(r))]
            if still:
                raise _Broken(
                    f"{answered}, but what {whose} made is still there: {describe(still)}"
                )
            return f"{answered} and exists() finds none of {describe(refs, 80)}", True
        if not self.reconcile_trusted:
            self.c.skipped[name] = (
                "whether it gave anything back: pass exists=, or declare a reconcile "
                "that lists what is in force"
            )
            return answered, False
        answer = read_reconcile(self.reconcile(made), "reconcile")
        if answer.in_force is None:
            self.c.skipped[name] = (
                "whether it gave anything back: reconcile did not answer the envelope"
            )
            return answered, False
        still = [ref for ref in refs if ref in answer.in_force]
        if still:
            raise _Broken(
                f"{answered}, but reconcile still lists what {whose} made: {describe(still)}"
            )
        return f"{answered} and reconcile lists none of {describe(refs, 80)}", True


def _unique(resources: list[Resource]) -> list[Resource]:
    """Resources once each, by kind and ref, in the order first seen."""
    seen: dict[tuple[str, str], Resource] = {}
    for r in resources:
        seen.setdefault((r["kind"], r["ref"]), r)
    return list(seen.values())


def _reported(answer: Any, action_id: str) -> list[Resource]:
    """What an answer reports that the ledger would accept, in the revert shape."""
    entries = answer.get("resources") if isinstance(answer, dict) else None
    out = []
    for entry in entries if isinstance(entries, list) else []:
        parsed = normalise(entry, action_id)
        if parsed.ok and parsed.row is not None:
            out.append(_revert_shape(parsed.row))
    return out


def _revert_shape(row: dict[str, Any]) -> Resource:
    """A normalised row as ``revert(resources=...)`` receives it from the ledger."""
    return {
        "kind": row["kind"],
        "ref": row["ref"],
        "payload": row["payload"],
        "member_key": row["member_key"],
    }


# ── leases ──


def check_lease(
    lease: str | Lease,
    *,
    value: Any,
    move_to: Any,
    target: str | None = None,
    run_id: int = 0,
) -> ContractReport:
    """Check a lease against the ledger's promises, with real calls.

    ``lease`` is a registered id, a targeted ref (``"world.spawn_rate#north"``) or a
    ``Lease``. ``value`` is what a run would apply; ``move_to`` is what "somebody else"
    sets afterwards, to see ``restore`` answer ``drifted``. Both must differ from the
    current value and from each other. The baseline is put back at the end.
    """
    found, target = _resolve_lease(lease, target)
    for name in ("read", "apply", "restore"):
        if not callable(getattr(found, name)):
            raise ValueError(f"the lease {found.id} declares no {name}()")
    if value == move_to:
        raise ValueError(
            "value and move_to must differ: the drift check needs somebody else's value"
        )
    subject = f"lease {found.id}" + (f"#{target}" if target is not None else "")
    checker = _Checker(subject, LEASE_PROMISES, found.budget_s)
    _LeaseCheck(found, target, value, move_to, run_id, checker).run()
    return checker.report()


def _resolve_lease(lease: str | Lease, target: str | None) -> tuple[Lease, str | None]:
    if isinstance(lease, Lease):
        return lease, target
    lease_id, ref_target = split_lease_ref(lease)
    if ref_target is not None and target is not None and ref_target != target:
        raise ValueError(
            f"{lease!r} names the target {ref_target!r}, and target={target!r} another"
        )
    found = default_registry.lease(lease_id)
    if found is None:
        raise NotRegistered(f"no lease {lease_id!r} is registered")
    return found, target if target is not None else ref_target


class _LeaseCheck:
    def __init__(
        self,
        lease: Lease,
        target: str | None,
        value: Any,
        move_to: Any,
        run_id: int,
        checker: _Checker,
    ) -> None:
        self.lease, self.target, self.value, self.move_to = lease, target, value, move_to
        self.run_id, self.c = run_id, checker

    def run(self) -> None:
        c = self.c
        try:
            self.baseline = self.read()
        except _Broken as exc:
            for name in LEASE_PROMISES:
                c.broken.append(name)
                c.details[name] = f"{exc}: there is no baseline to put back"
            return
        if self.baseline in (self.value, self.move_to):
            raise ValueError(
                f"value and move_to must differ from the current value "
                f"{describe(self.baseline)}, or nothing would change"
            )
        try:
            c.promise(RESTORE_IS_SAFE_WHEN_ALREADY_BACK, self.already_back)
            c.promise(RESTORE_PUTS_BASELINE_BACK, self.puts_back)
            c.promise(RESTORE_ANSWERS_DRIFTED_WHEN_VALUE_MOVED, self.drifted)
        finally:
            # Leave the world as it was found.
            try:
                if self.read() != self.baseline:
                    self.apply(self.baseline, "putting the baseline back")
            except _Broken:
                pass  # best effort: what broke is in the report already

    # ── calls ──

    def read(self) -> Any:
        read = self.lease.read
        assert read is not None
        return _answer(self.c.call(lambda: read(target=self.target), f"{self.lease.id}.read"))

    def apply(self, value: Any, why: str) -> None:
        apply = self.lease.apply
        assert apply is not None
        answer = _answer(
            self.c.call(
                lambda: apply(value, target=self.target, run_id=self.run_id),
                f"{self.lease.id}.apply",
            )
        )
        if not is_success(answer):
            raise _Broken(
                f"apply({describe(value)}) while {why} answered {describe(answer)}, not ok"
            )

    def restore(self) -> tuple[Any, CallResult]:
        restore, baseline, value = self.lease.restore, self.baseline, self.value
        assert restore is not None
        call = self.c.call(
            lambda: restore(baseline, expected=value, run_id=self.run_id, target=self.target),
            f"{self.lease.id}.restore",
        )
        return _answer(call), call

    def require_done(self, answer: Any, call: CallResult, when: str) -> None:
        verdict = classify_revert(call, self.lease.id)
        if verdict.outcome != "done" or verdict.failed:
            raise _Broken(
                f"restore {when} answered {describe(answer)}, which the ledger reads as "
                f"{verdict.outcome}" + (f": {verdict.error}" if verdict.error else "")
            )

    def require_value(self, expected: Any, when: str) -> None:
        current = self.read()
        if current != expected:
            raise _Broken(f"{when}, read() gives {describe(current)}, not {describe(expected)}")

    # ── promises ──

    def already_back(self) -> str:
        answer, call = self.restore()
        self.require_done(
            answer, call, f"with the value already at the baseline {describe(self.baseline)}"
        )
        self.require_value(self.baseline, "after that restore")
        return "restore with nothing to put back answered ok and changed nothing"

    def puts_back(self) -> str:
        self.apply(self.value, "borrowing the value")
        answer, call = self.restore()
        self.require_done(answer, call, f"after apply({describe(self.value)})")
        self.require_value(self.baseline, "after restore answered ok")
        return f"apply({describe(self.value)}) then restore gave back {describe(self.baseline)}"

    def drifted(self) -> str:
        self.apply(self.value, "borrowing the value")
        self.apply(self.move_to, "somebody else moving it")
        answer, call = self.restore()
        verdict = classify_revert(call, self.lease.id)
        if verdict.outcome != "drifted":
            raise _Broken(
                f"restore after somebody else moved the value to {describe(self.move_to)} answered "
                f"{describe(answer)}, which the ledger reads as {verdict.outcome}, not drifted "
                '(answer {"drifted": true, "current": value} and leave their value alone)'
            )
        if "current" not in answer:
            raise _Broken(
                f"restore answered {describe(answer)}: a drifted answer names the current value"
            )
        self.require_value(self.move_to, "after restore answered drifted")
        return f"restore answered drifted and left {describe(self.move_to)} in place"
