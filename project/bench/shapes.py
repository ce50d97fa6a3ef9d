"""The measured shapes: each one both ways (the ledger's and the per-row way), and the
module calls of one sweep pass made one after the other or in parallel."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.test.utils import override_settings

from events_ledger.cleanup import sweep
from events_ledger.conf import ledger_settings
from events_ledger.ledger import execute_step
from events_ledger.models import UNRESOLVED, EventRun, EventRunLog, EventRunResource, EventRunStep
from events_ledger.registry import Action, Registry

from . import per_row
from .meter import Counts, measured

#: Every run the bench makes carries this scope; it deletes them all when it is done.
SCOPE = "ledger-bench"
OWNER = "bench"
NOOP = "bench.noop"
SLEEP = "bench.sleep"

Res = EventRunResource.objects


@dataclass(frozen=True)
class Shape:
    resources: int
    runs: int
    steps: int = 1
    #: #26: each step of a run a phase of its own, so giving back goes phase by phase.
    phased: bool = False

    @property
    def total(self) -> int:
        return self.resources * self.runs * self.steps


# ── the bench's module: answers n resources, gives back at once or after a sleep ──


def _perform(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> dict[str, Any]:
    n = int(params.get("n", 1))
    return {
        "ok": True,
        "resources": [{"kind": "thing", "ref": f"{idempotency_key}-{i}"} for i in range(n)],
    }


def _revert(**kwargs: Any) -> dict[str, Any]:
    return {"ok": True}


def register(reg: Registry, revert_ms: int) -> None:
    """The bench's two actions, on an isolated registry (the caller puts it back)."""

    def sleepy_revert(**kwargs: Any) -> dict[str, Any]:
        time.sleep(revert_ms / 1000)
        return {"ok": True}

    for action_id, revert in ((NOOP, _revert), (SLEEP, sleepy_revert)):
        reg.actions.pop(action_id, None)
        reg.register_action(
            Action(
                id=action_id,
                owner=OWNER,
                reversible="ledger",
                budget_ms=30_000,
                perform=_perform,
                revert=revert,
            )
        )


# ── set-up and tidying, never measured ──


def _make_runs(shape: Shape, action_id: str, tag: str) -> list[tuple[EventRun, list[EventRunStep]]]:
    made = []
    for r in range(shape.runs):
        run = EventRun.objects.create(name=f"bench {tag} {r}", scope=SCOPE, status="running")
        steps = EventRunStep.objects.bulk_create(
            [
                EventRunStep(
                    run=run,
                    seq=i,
                    phase=f"p{i}" if shape.phased else "main",
                    phase_rank=i if shape.phased else 0,
                    action_id=action_id,
                    params={"n": shape.resources},
                )
                for i in range(shape.steps)
            ]
        )
        made.append((run, steps))
    return made


def _end(made: list[tuple[EventRun, list[EventRunStep]]]) -> None:
    """The runs end, as a host ends them, so cleanup may give them back."""
    for run, _ in made:
        EventRun.objects.filter(pk=run.pk, status="running").update(status="completed")
        run.status = "completed"


def _left(made: list[tuple[EventRun, list[EventRunStep]]]) -> int:
    return Res.filter(run__in=[run.pk for run, _ in made], status__in=UNRESOLVED).count()


def delete_runs(runs: Q | None = None) -> None:
    """Delete the bench's runs (all of them, or those ``runs`` selects) and all they hold."""
    selected = EventRun.objects.filter(scope=SCOPE)
    if runs is not None:
        selected = selected.filter(runs)
    Res.filter(run__in=selected).delete()  # PROTECT: the rows go before their runs
    EventRunLog.objects.filter(run__in=selected).delete()
    EventRunStep.objects.filter(run__in=selected).delete()
    selected.delete()


def _done(made: list[tuple[EventRun, list[EventRunStep]]]) -> None:
    delete_runs(Q(pk__in=[run.pk for run, _ in made]))


# ── figures ──


@dataclass
class Legs:
    """What one way cost, both halves, summed over rounds."""

    recording: Counts = field(default_factory=Counts)
    giving_back: Counts = field(default_factory=Counts)
    #: Sweep passes that gave something back (the ledger's way only).
    passes: int = 0

    def __iadd__(self, other: Legs) -> Legs:
        self.recording += other.recording
        self.giving_back += other.giving_back
        self.passes += other.passes
        return self


def _figures(counts: Counts, resources: int, per: str, units: int) -> dict[str, Any]:
    return {
        "resources": resources,
        "seconds": counts.seconds,
        "per_s": resources / counts.seconds if counts.seconds else 0.0,
        "statements": counts.statements,
        "statements_per_resource": counts.statements / resources,
        "commits": counts.commits,
        "writing_commits": counts.writing_commits,
        "transaction_control": counts.control,
        "round_trips": counts.round_trips,
        f"round_trips_per_{per}": counts.round_trips / units,
        f"commits_per_{per}": counts.commits / units,
        f"writing_commits_per_{per}": counts.writing_commits / units,
    }


def _execute(made: list[tuple[EventRun, list[EventRunStep]]]) -> None:
    for _, steps in made:
        for step in steps:
            result = execute_step(step)
            if result.outcome != "done":
                raise RuntimeError(f"a bench step did not finish: {result}")


# ── the two ways ──


def ledger_way(shape: Shape) -> Legs:
    """``execute_step`` per step; then ``sweep`` passes until one finds nothing to do (that
    last, empty pass is not counted: the per-row way has no scan to match it)."""
    made = _make_runs(shape, NOOP, "ledger")
    legs = Legs()
    with measured() as legs.recording:
        _execute(made)
    _end(made)
    for _ in range(shape.runs + 2):  # a bound, should a pass ever give back nothing
        with measured() as one:
            report = sweep(limit=ledger_settings.CLEANUP_RUN_BATCH, scope=SCOPE)
        if report.errors:
            raise RuntimeError(f"a bench sweep failed: {report.errors}")
        if not report.runs:
            break
        legs.giving_back += one
        legs.passes += 1
    _check(made)
    return legs


def per_row_way(shape: Shape) -> Legs:
    """The seeds' protocol (see ``per_row``), on the same tables, shape and module."""
    made = _make_runs(shape, NOOP, "per-row")
    legs = Legs()
    with measured() as legs.recording:
        for run, steps in made:
            for step in steps:
                per_row.record_step(run, step, OWNER, _perform)
    _end(made)
    with measured() as legs.giving_back:
        for run, _ in made:
            per_row.give_back_run(run, _revert)
    _check(made)
    return legs


def _check(made: list[tuple[EventRun, list[EventRunStep]]]) -> None:
    left = _left(made)
    _done(made)
    if left:
        raise RuntimeError(f"{left} rows were not given back")


def both_ways(shape: Shape, rounds: int = 2) -> dict[str, Any]:
    """Both ways over the shape's runs, cut into ``rounds`` rounds taken in the order
    ledger, per-row, then per-row, ledger, and so on: the machine is shared, and a load
    that rises or falls during the measurement then weighs on both ways alike."""
    ways = {"ledger": (ledger_way, Legs()), "per_row": (per_row_way, Legs())}
    rounds = max(1, min(rounds, shape.runs))
    for i in range(rounds):
        runs = shape.runs // rounds + (1 if i < shape.runs % rounds else 0)
        part = Shape(resources=shape.resources, runs=runs, steps=shape.steps)
        order = ("ledger", "per_row") if i % 2 == 0 else ("per_row", "ledger")
        for name in order:
            way, legs = ways[name]
            legs += way(part)
    out: dict[str, Any] = {
        "resources_per_step": shape.resources,
        "steps_per_run": shape.steps,
        "runs": shape.runs,
        "rounds": rounds,
    }
    for name, (_, legs) in ways.items():
        out[name] = {
            "recording": _figures(legs.recording, shape.total, "step", shape.runs * shape.steps),
            "giving_back": _figures(legs.giving_back, shape.total, "run", shape.runs),
        }
    back = ways["ledger"][1]
    out["ledger"]["giving_back"]["passes"] = back.passes
    out["ledger"]["giving_back"]["commits_per_pass"] = (
        back.giving_back.commits / back.passes if back.passes else 0.0
    )
    out["ratio"] = {
        leg: out["ledger"][leg]["per_s"] / out["per_row"][leg]["per_s"]
        if out["per_row"][leg]["per_s"]
        else None
        for leg in ("recording", "giving_back")
    }
    return out


def warm_up() -> None:
    """Steps both ways first, unreported: connections, the claim keeper's thread and
    Django's caches are then set up, and a server started just before (as ``make bench``
    starts its own) has its tables' pages in memory, before anything is timed."""
    shape = Shape(resources=2, runs=100)
    ledger_way(shape)
    per_row_way(shape)


# ── module calls, one after the other or in parallel ──


def _one_pass(runs: int, groups: int, concurrency: int) -> dict[str, Any]:
    made = _make_runs(Shape(resources=1, runs=runs, steps=groups), SLEEP, f"calls x{concurrency}")
    _execute(made)
    _end(made)
    # One pass takes every run and every group: the batch is the runs, as many groups
    # as a run has (the defaults: 10 runs, 25 groups a run).
    overrides = {
        **(getattr(settings, "EVENTS_LEDGER", None) or {}),
        "CLEANUP_CONCURRENCY": concurrency,
        "CLEANUP_RUN_BATCH": max(10, runs),
        "CLEANUP_GROUPS_PER_RUN": max(25, groups),
    }
    with override_settings(EVENTS_LEDGER=overrides), measured() as one:
        report = sweep(scope=SCOPE)
    out = {
        "concurrency": concurrency,
        "seconds": one.seconds,
        "runs_swept": len(report.runs),
        "left": _left(made),
        "statements": one.statements,
        "commits": one.commits,
    }
    _done(made)
    return out


def module_calls(runs: int, groups: int, revert_ms: int, concurrency: int) -> dict[str, Any]:
    """One sweep pass over ``runs`` × ``groups`` one-resource groups whose revert sleeps
    ``revert_ms``: with ``CLEANUP_CONCURRENCY`` 1, then ``concurrency``."""
    sequential = _one_pass(runs, groups, 1)
    parallel = _one_pass(runs, groups, concurrency)
    return {
        "runs": runs,
        "groups_per_run": groups,
        "revert_ms": revert_ms,
        "sequential": sequential,
        "parallel": parallel,
        "ratio": parallel["seconds"] / sequential["seconds"] if sequential["seconds"] else None,
    }


__all__ = [
    "SCOPE",
    "Shape",
    "both_ways",
    "delete_runs",
    "module_calls",
    "register",
    "warm_up",
]
