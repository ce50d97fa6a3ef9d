"""Actions and leases that host apps register, and how they are found at start-up."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .conf import ledger_settings

logger = logging.getLogger("events_ledger")

#: What the ledger does with an action's effects. ``none``: nothing to undo; ``self``:
#: it undoes itself; ``ledger``: it declares ``revert()`` and what it made is known
#: only from its answer; ``override``: it borrows a value through a lease.
REVERSIBLE_CLASSES = ("none", "self", "ledger", "override")

#: The core action that takes a lease (W6).
LEASE_ACTION_ID = "core.lease"


class AlreadyRegistered(Exception):
    """An action or lease id is registered twice."""


class NotRegistered(Exception):
    """No action or lease has that id."""


def budget_seconds(budget_ms: int | None) -> float:
    """A module's budget in seconds; one that sets none (``None`` or 0) gets
    ``DEFAULT_REVERT_BUDGET``, whatever the call: a deadline of 0 would time out
    every call at once."""
    if budget_ms:
        return budget_ms / 1000
    return ledger_settings.DEFAULT_REVERT_BUDGET.total_seconds()


@dataclass(frozen=True)
class Action:
    """A verb a host app offers to runs.

    ``perform(*, run_id, params, idempotency_key) -> dict``,
    ``revert(*, run_id, resources, idempotency_key) -> dict`` and
    ``reconcile(*, run_id, resources) -> dict`` answer plain envelopes, which the
    ledger classifies defensively: only ``{"ok": True, ...}`` is a success.
    """

    id: str
    owner: str
    reversible: str = "none"
    perform: Callable[..., Any] | None = None
    revert: Callable[..., Any] | None = None
    reconcile: Callable[..., Any] | None = None
    #: None (or 0): ``DEFAULT_REVERT_BUDGET``, as a lease's, so the setting reaches every
    #: module that sets no budget of its own.
    budget_ms: int | None = None
    description: str = ""
    #: C8: what it makes stands alone, depending on nothing of its run and nothing
    #: depending on it: given back whenever (never waiting for a later phase, never
    #: holding an earlier one), in parallel with the rest.
    independent: bool = False

    @property
    def budget_s(self) -> float:
        """The deadline of each call of ``perform``, ``revert`` and ``reconcile``."""
        return budget_seconds(self.budget_ms)


@dataclass(frozen=True)
class Lease:
    """A way to borrow a value and put it back.

    ``read(*, target) -> value`` gives the baseline, ``apply(value, *, target, run_id)
    -> dict`` sets it, ``restore(baseline, *, expected, run_id, target) -> dict`` puts
    it back, answering ``{"drifted": True, "current": v}`` when somebody else's value
    is in place.
    """

    id: str
    owner: str
    read: Callable[..., Any] | None = None
    apply: Callable[..., Any] | None = None
    restore: Callable[..., Any] | None = None
    budget_ms: int | None = None
    description: str = ""
    #: C8: restored whenever, in parallel, whatever phase took it (see ``Action``).
    independent: bool = False

    @property
    def budget_s(self) -> float:
        """The deadline of each call of ``read``, ``apply`` and ``restore``."""
        return budget_seconds(self.budget_ms)


@dataclass(frozen=True)
class LeaseRef:
    """A lease found through a ref: ``world.spawn_rate#dungeon-3`` names the lease
    ``world.spawn_rate`` and the target ``dungeon-3``."""

    lease: Lease
    target: str | None


def split_lease_ref(ref: str) -> tuple[str, str | None]:
    lease_id, sep, target = str(ref).partition("#")
    return lease_id, (target if sep else None)


@dataclass
class Registry:
    actions: dict[str, Action] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    #: Problems met while discovering host apps' modules, reported by the system checks.
    problems: list[str] = field(default_factory=list)

    # ── registration ──

    def register_action(self, action: Action) -> Action:
        if not isinstance(action, Action):
            raise TypeError(f"register_action() takes an Action, not {type(action).__name__}")
        if action.id in self.actions:
            raise AlreadyRegistered(f"the action {action.id!r} is already registered")
        self.actions[action.id] = action
        return action

    def register_lease(self, lease: Lease) -> Lease:
        if not isinstance(lease, Lease):
            raise TypeError(f"register_lease() takes a Lease, not {type(lease).__name__}")
        if lease.id in self.leases:
            raise AlreadyRegistered(f"the lease {lease.id!r} is already registered")
        if "#" in lease.id:
            raise ValueError(
                f"a lease id cannot contain '#': {lease.id!r} (it separates the target)"
            )
        self.leases[lease.id] = lease
        return lease

    def unregister_action(self, action_id: str) -> None:
        if self.actions.pop(action_id, None) is None:
            raise NotRegistered(f"no action {action_id!r} is registered")

    def unregister_lease(self, lease_id: str) -> None:
        if self.leases.pop(lease_id, None) is None:
            raise NotRegistered(f"no lease {lease_id!r} is registered")

    # ── lookup ──

    def action(self, action_id: str | None) -> Action | None:
        return self.actions.get(action_id) if action_id else None

    def lease(self, lease_id: str | None) -> Lease | None:
        return self.leases.get(lease_id) if lease_id else None

    def lease_for_ref(self, ref: str | None) -> LeaseRef | None:
        """Resolve a lease ref, targeted or not, through the lease's own id."""
        if not ref:
            return None
        lease_id, target = split_lease_ref(ref)
        lease = self.leases.get(lease_id)
        return LeaseRef(lease, target) if lease else None

    @contextmanager
    def isolated(self) -> Iterator[Registry]:
        """Register and unregister freely inside; everything is put back after."""
        saved = (dict(self.actions), dict(self.leases), list(self.problems))
        try:
            yield self
        finally:
            self.actions, self.leases, self.problems = (
                saved[0],
                saved[1],
                saved[2],
            )


#: The process's registry. The module itself is the public face of it:
#: ``from events_ledger import registry; registry.action("world.spawn")``.
default_registry = Registry()
action = default_registry.action
lease = default_registry.lease
lease_for_ref = default_registry.lease_for_ref
isolated = default_registry.isolated
unregister_action = default_registry.unregister_action
unregister_lease = default_registry.unregister_lease


def register_action(action: Action | None = None, **options: Any) -> Any:
    """Register an action. As a call: ``register_action(Action(...))``. As a decorator
    of the ``perform`` function: ``@register_action(id=..., owner=..., ...)``."""
    if action is not None:
        return default_registry.register_action(action)

    def decorator(perform: Callable[..., Any]) -> Callable[..., Any]:
        default_registry.register_action(Action(perform=perform, **options))
        return perform

    return decorator


def register_lease(lease: Lease) -> Lease:
    return default_registry.register_lease(lease)


def autodiscover() -> None:
    """Import ``event_actions`` of every installed app, as the admin imports ``admin``.

    A duplicate id in a host app is recorded for the system check instead of
    stopping every process at start-up; any other import error propagates.
    """
    from django.apps import apps
    from django.utils.module_loading import module_has_submodule

    _register_core()
    from importlib import import_module

    for config in apps.get_app_configs():
        if not module_has_submodule(config.module, "event_actions"):
            continue
        try:
            import_module(f"{config.name}.event_actions")
        except AlreadyRegistered as exc:
            problem = f"{config.name}.event_actions: {exc}"
            if problem not in default_registry.problems:
                default_registry.problems.append(problem)


def _register_core() -> None:
    if LEASE_ACTION_ID not in default_registry.actions:
        # Executed by the ledger itself (W6): it has no perform of its own, and its
        # rows are given back through the lease registry.
        default_registry.register_action(
            Action(
                id=LEASE_ACTION_ID,
                owner="core",
                reversible="override",
                description="borrow a value through a registered lease",
            )
        )
