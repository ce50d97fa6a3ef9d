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
