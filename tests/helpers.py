"""Small builders shared by the tests."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections
from django.utils.connection import ConnectionProxy

from events_ledger.db import ledger_db
from events_ledger.models import EventRun, EventRunResource, EventRunStep

#: The ledger's connection, which is what a test means by ``connection``: default's,
#: unless the ledger has an alias of its own (``make test``'s own-alias run).
connection = ConnectionProxy(connections, ledger_db())

#: Long enough for any wait of a test on a loaded machine; a test that needs it failed.
PATIENCE_S = 120


def new_run(name: str = "run", status: str = "running", **kw: Any) -> EventRun:
    """A run as a host makes one (no scope unless given), built by the factory."""
    from tests.factories import RunFactory

    return RunFactory(name=name, status=status, scope=kw.pop("scope", ""), **kw)


def new_step(
    run: EventRun, action_id: str, params: dict[str, Any] | None = None, seq: int = 0
) -> EventRunStep:
    from tests.factories import StepFactory

    return StepFactory(run=run, action_id=action_id, params=params or {}, seq=seq)


def spawn_step(run: EventRun, region: str = "north", count: int = 3, seq: int = 0) -> EventRunStep:
    return new_step(run, "world.spawn", {"region": region, "count": count, "kind": "wolf"}, seq)


def lease_step(
    run: EventRun, region: str = "north", value: int = 5, seq: int = 0, **extra: Any
) -> EventRunStep:
    return new_step(
        run, "core.lease", {"lease": f"world.spawn_rate#{region}", "value": value, **extra}, seq
    )


def ledger_action(
    registry: Any,
    action_id: str = "t.make",
    owner: str = "t",
    revert: Any = None,
    perform: Any = None,
    **kw: Any,
) -> Any:
    """Register a `ledger` action whose perform does what the test says (nothing by
    default) and whose revert answers what the test says (ok by default)."""
    from events_ledger import Action

    action = Action(
        id=action_id,
        owner=owner,
        reversible="ledger",
        perform=perform or (lambda **_: None),
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


def wait_until(condition: Callable[[], bool], what: str, patience_s: float = PATIENCE_S) -> None:
    """Poll a condition the test is entitled to expect, with a deadline that fails."""
    deadline = time.monotonic() + patience_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def finished_run(count: int, name: str = "chaos", region: str = "north") -> EventRun:
    """A run that spawned ``count`` creatures in the demo world and was cancelled."""
    from events_ledger.ledger import execute_step

    run = new_run(name=name)
    assert execute_step(spawn_step(run, region, count)).outcome == "done"
    EventRun.objects.transition(run, "cancelled", from_="running")
    return run


def phased_run(arena: str = "pit", *, name: str = "event", count: int = 3) -> EventRun:
    """#26: a run of three dependent phases, run to its end: an arena, ``count``
    creatures in it, and the arena's spawn rate raised over them."""
    from events_ledger.ledger import execute_step
    from tests.factories import StepFactory

    run = new_run(name=name)
    plan = [
        ("arena", "world.build_arena", {"name": arena}),
        ("creatures", "world.spawn", {"region": arena, "count": count, "kind": "wolf"}),
        ("rate", "core.lease", {"lease": f"world.spawn_rate#{arena}", "value": 9}),
    ]
    for phase, action_id, params in plan:
        step = StepFactory(run=run, phase=phase, action_id=action_id, params=params)
        assert execute_step(step.pk).outcome == "done", phase
    EventRun.objects.transition(run, "completed", from_="running")
    return run


def despawn_calls_per_creature() -> Counter[int]:
    """How many creatures the world was asked to despawn once, twice, …"""
    from project.world.models import Call

    per_ref = Counter(
        ref
        for refs in Call.objects.filter(verb="despawn").values_list("refs", flat=True)
        for ref in refs
    )
    return Counter(per_ref.values())


def all_given_back(runs: list[EventRun]) -> bool:
    """The world is empty, nothing of the runs is unresolved, every summary is complete."""
    from project.world.models import Creature

    statuses = set(
        EventRun.objects.filter(pk__in=[r.pk for r in runs]).values_list(
            "cleanup_status", flat=True
        )
    )
    return (
        Creature.objects.count() == 0
        and not EventRunResource.objects.filter(run__in=runs).unresolved().exists()
        and statuses == {"complete"}
    )


def age_step_claims(run: EventRun) -> None:
    """The claim as a dead worker leaves it: nobody stamps it any more, and the TTL passed."""
    EventRunStep.objects.filter(run=run).update(claimed_at=datetime(2000, 1, 1, tzinfo=UTC))


class Gate:
    """Holds a module's call inside the world until the test opens it, and counts how
    many calls were inside at once."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self._lock = threading.Lock()

    def pass_through(self) -> None:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.entered.set()
        try:
            assert self.opened.wait(PATIENCE_S), "the test never opened the gate"
        finally:
            with self._lock:
                self.inside -= 1

    def open(self) -> None:
        self.opened.set()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a daemon thread; its answer (or what it raised) lands in the box."""
    from django.db import connections

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


class LiveRowSampler:
    """Samples, in a thread of its own, the most live rows any one target has while
    processes reserve and release: at most one, whatever they do."""

    def __init__(self) -> None:
        self.samples = 0
        self.worst = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from django.db import connections

        table = EventRunResource._meta.db_table
        probe = connections.create_connection("default")
        try:
            while not self._stop.is_set():
                with probe.cursor() as c:
                    c.execute(
                        f"SELECT COUNT(*) FROM {table} WHERE status IN ('pending','confirmed',"
                        "'reverting') GROUP BY owner_module, kind, ref ORDER BY 1 DESC LIMIT 1"
                    )
                    row = c.fetchone()
                self.samples += 1
                self.worst = max(self.worst, row[0] if row else 0)
        finally:
            probe.close()

    def __enter__(self) -> LiveRowSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(PATIENCE_S)


def step_ttl() -> timedelta:
    """The step claim TTL the services pass to the querysets (which read no setting)."""
    from events_ledger.conf import ledger_settings

    return ledger_settings.STEP_CLAIM_TTL


def revert_ttl() -> timedelta:
    """The revert claim TTL the services pass to the querysets (which read no setting)."""
    from events_ledger.conf import ledger_settings

    return ledger_settings.REVERT_CLAIM_TTL
