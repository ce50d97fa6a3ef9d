"""Small builders shared by the tests."""

from __future__ import annotations

from typing import Any

from events_ledger.models import EventRun, EventRunStep


def new_run(name: str = "run", status: str = "running", **kw: Any) -> EventRun:
    return EventRun.objects.create(name=name, status=status, **kw)


def new_step(
    run: EventRun, action_id: str, params: dict[str, Any] | None = None, seq: int = 0
) -> EventRunStep:
    return EventRunStep.objects.create(run=run, action_id=action_id, params=params or {}, seq=seq)


def spawn_step(run: EventRun, region: str = "north", count: int = 3, seq: int = 0) -> EventRunStep:
    return new_step(run, "world.spawn", {"region": region, "count": count, "kind": "wolf"}, seq)


def lease_step(
    run: EventRun, region: str = "north", value: int = 5, seq: int = 0, **extra: Any
) -> EventRunStep:
    return new_step(
        run, "core.lease", {"lease": f"world.spawn_rate#{region}", "value": value, **extra}, seq
    )


def ledger_action(
    registry: Any, action_id: str = "t.make", owner: str = "t", revert: Any = None, **kw: Any
) -> Any:
    """Register a `ledger` action whose perform does nothing and whose revert answers
    what the test says (ok by default)."""
    from events_ledger import Action

    action = Action(
        id=action_id,
        owner=owner,
        reversible="ledger",
        perform=lambda **_: None,
        revert=revert or (lambda **_: {"ok": True}),
        **kw,
    )
    registry.register_action(action)
    return action


def short_budget_world_spawn(registry: Any, budget_ms: int = 300) -> Any:
    """The demo's own `world.spawn`, with a budget short enough that a hang costs a
    fraction of a second."""
    from events_ledger import Action
    from project.world import world as w

    registry.actions.pop("world.spawn", None)
    action = Action(
        id="world.spawn",
        owner="world",
        reversible="ledger",
        budget_ms=budget_ms,
        perform=w.spawn,
        revert=w.despawn,
        reconcile=w.still_there,
    )
    registry.register_action(action)
    return action
