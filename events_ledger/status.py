"""Where the ledger stands, read from the database in a fixed number of queries (#15).

One snapshot serves every surface that shows it: the Prometheus collector, the health
check, ``manage.py ledger_status`` and the admin dashboard. Read from the database, not
from a process's memory, so every process and host reports the same. Each query is a
GROUP BY over a range of an index (unresolved rows by ``(status, owner_module)``, running
steps by ``(status, claimed_at)``, runs by ``(cleanup_status, status)``): the released
history, however long, is never read. Nor are finished runs whose cleanup is ``complete``
or ``not_required`` counted (#25): their number only grows with history, and a count of
them would read the whole runs index on every scrape and health probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Min, Q
from django.utils import timezone

from .conf import ledger_settings
from .db import UtcNow
from .models import EventRun, EventRunResource, EventRunStep
from .states import UNRESOLVED, CleanupStatus, ResourceStatus, RunStatus, StepStatus

#: Rows of each list a detailed snapshot carries (the dashboard, the command).
DETAIL_LIMIT = 10

#: Runs not finished yet.
IN_FLIGHT = (RunStatus.PENDING.value, RunStatus.RUNNING.value)
#: #25: the runs counted, each a range of the index ``(cleanup_status, status)``: those
#: owing something or waiting for a human, and those not finished. What is left out
#: (finished, cleanup complete or never required) is history.
OWING_RUNS = Q(cleanup_status__in=(CleanupStatus.PENDING, CleanupStatus.INCOMPLETE))
CLEAR_RUNS_IN_FLIGHT = Q(
    cleanup_status__in=(CleanupStatus.NOT_REQUIRED, CleanupStatus.COMPLETE), status__in=IN_FLIGHT
)


@dataclass(frozen=True)
class ModuleRows:
    """A module's unresolved rows."""

    owner: str
    by_status: dict[str, int]
    #: ``created_at`` of its oldest unresolved row.
    oldest: datetime
    #: Claimed without a verdict: a claim ended (its sweeper died or hung) and no verdict
    #: was written, or a row is claimed again, or its claim is stale.
    poison: int
    #: The automatic sweep will not try them again (attempts or claims spent): a human's.
    spent: int

    @property
    def total(self) -> int:
        return sum(self.by_status.values())


@dataclass(frozen=True)
class StepsInFlight:
    """An action's running steps: claims kept fresh (a call may still change the world)
    and claims gone stale (their process died; a retry or cleanup takes them)."""

    action: str
    in_flight: int
    stale: int
    #: When the oldest call in flight was claimed.
    oldest: datetime | None


@dataclass(frozen=True)
class LedgerStatus:
    at: datetime
    max_age: timedelta
    #: ``(cleanup_status, status) → runs``, of the runs owing or in flight (finished
    #: runs whose cleanup is complete or not required are history, not counted).
    runs: dict[tuple[str, str], int]
    modules: list[ModuleRows]
    steps: list[StepsInFlight]
    #: With ``details``: the first incomplete runs, the oldest unresolved rows, the
    #: longest-running steps in flight (``DETAIL_LIMIT`` each).
    incomplete: list[EventRun] = field(default_factory=list)
    oldest_rows: list[EventRunResource] = field(default_factory=list)
    running_steps: list[EventRunStep] = field(default_factory=list)

    @property
    def runs_in_flight(self) -> int:
        """Runs not finished yet (pending or running), whatever their cleanup."""
        return sum(n for (_, status), n in self.runs.items() if status in IN_FLIGHT)

    @property
    def cleanup_pending(self) -> int:
        """Finished runs whose cleanup is ``pending``: the sweep's backlog. A run still
        going that recorded something is ``pending`` too, but it is in flight, not owed
        yet (counted twice, one running run read as a backlog)."""
        return sum(
            n
            for (c, status), n in self.runs.items()
            if c == CleanupStatus.PENDING and status not in IN_FLIGHT
        )

    @property
    def incomplete_runs(self) -> int:
        return sum(n for (c, _), n in self.runs.items() if c == CleanupStatus.INCOMPLETE)

    @property
    def unresolved(self) -> int:
        return sum(m.total for m in self.modules)

    @property
    def oldest_unresolved(self) -> datetime | None:
        return min((m.oldest for m in self.modules), default=None)

    def age(self, stamp: datetime | None) -> float | None:
        """Seconds from ``stamp`` to this snapshot (never negative: clocks differ)."""
        return None if stamp is None else max(0.0, (self.at - stamp).total_seconds())

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.steps)

    @property
    def problems(self) -> list[str]:
        """Why the ledger is unhealthy; empty when it is healthy (#15: a run is
        incomplete, or an unresolved row is older than HEALTH_MAX_UNRESOLVED_AGE)."""
        out = []
        if self.incomplete_runs:
            ids = ", ".join(str(r.pk) for r in self.incomplete)
            more = "" if len(self.incomplete) >= self.incomplete_runs or not ids else ", …"
            out.append(
                f"{self.incomplete_runs} run(s) incomplete"
                + (f" (run {ids}{more})" if ids else "")
                + ": a human must look and retry"
            )
        oldest = self.age(self.oldest_unresolved)
        if oldest is not None and oldest > self.max_age.total_seconds():
            old = [
                m.owner
                for m in self.modules
                if (self.age(m.oldest) or 0) > self.max_age.total_seconds()
            ]
            out.append(
                f"an unresolved resource is {duration(oldest)} old, older than "
                f"HEALTH_MAX_UNRESOLVED_AGE ({duration(self.max_age.total_seconds())}); "
                f"module(s): {', '.join(old)}"
            )
        return out

    @property
    def healthy(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as plain data (``ledger_status --json``)."""
        return {
            "healthy": self.healthy,
            "problems": self.problems,
            "at": self.at.isoformat(),
            "runs": {
                "in_flight": self.runs_in_flight,
                "cleanup_pending": self.cleanup_pending,
                "incomplete_count": self.incomplete_runs,
                "incomplete": [r.pk for r in self.incomplete],
            },
            "unresolved": {
                "total": self.unresolved,
                "oldest_age_seconds": self.age(self.oldest_unresolved),
                "max_age_seconds": self.max_age.total_seconds(),
                "modules": {
                    m.owner: {
                        "by_status": m.by_status,
                        "total": m.total,
                        "oldest_age_seconds": self.age(m.oldest),
                        "poison": m.poison,
                        "spent": m.spent,
                    }
                    for m in self.modules
                },
                "oldest": [
                    {
                        "id": r.pk,
                        "run_id": r.run_id,
                        "owner": r.owner_module,
                        "kind": r.kind,
                        "ref": r.ref,
                        "status": r.status,
                        "age_seconds": self.age(r.created_at),
                        "last_error": r.last_error,
                    }
                    for r in self.oldest_rows
                ],
            },
            "steps_in_flight": {
                "total": self.in_flight,
                "actions": {
                    s.action: {
                        "in_flight": s.in_flight,
                        "stale": s.stale,
                        "oldest_age_seconds": self.age(s.oldest),
                    }
                    for s in self.steps
                },
                "running": [
                    {
                        "step": s.pk,
                        "run_id": s.run_id,
                        "action": s.action_id,
                        "claimed_by": s.claimed_by,
                        "age_seconds": self.age(s.updated_at),
                    }
                    for s in self.running_steps
                ],
            },
        }


def snapshot(*, details: bool = False) -> LedgerStatus:
    """Read where the ledger stands: three queries, whatever the size of the tables (none
    reads the history: released rows, settled steps, runs finished and given back);
    ``details`` adds three more, each bounded by ``DETAIL_LIMIT`` rows."""
    at = timezone.now()
    step_ttl = ledger_settings.STEP_CLAIM_TTL
    fresh = Q(claimed_at__gte=UtcNow() - step_ttl)
    # #25: one range of the runs' index each, in one statement. Written as one WHERE
    # with an OR, SQLite's planner reads the whole index instead (for its GROUP BY order).
    owing, in_flight = (
        EventRun.objects.filter(where)
        .order_by()
        .values("cleanup_status", "status")
        .annotate(n=Count("pk"))
        for where in (OWING_RUNS, CLEAR_RUNS_IN_FLIGHT)
    )
    runs = {
        (row["cleanup_status"], row["status"]): row["n"] for row in owing.union(in_flight, all=True)
    }
    steps = [
        StepsInFlight(
            action=row["action_id"],
            in_flight=row["in_flight"],
            stale=row["stale"],
            oldest=row["oldest"],
        )
        for row in EventRunStep.objects.filter(status=StepStatus.RUNNING)
        .order_by()
        .values("action_id")
        .annotate(
            in_flight=Count("pk", filter=fresh),
            stale=Count("pk", filter=~fresh),
            oldest=Min("updated_at", filter=fresh),
        )
        .order_by("action_id")
    ]
    status = LedgerStatus(
        at=at,
        max_age=ledger_settings.HEALTH_MAX_UNRESOLVED_AGE,
        runs=runs,
        modules=_modules(),
        steps=steps,
    )
    if not details:
        return status
    return replace(
        naming_incomplete(status),
        oldest_rows=_oldest_unresolved() if status.modules else [],
        running_steps=list(
            EventRunStep.objects.in_flight(step_ttl).order_by("updated_at", "pk")[:DETAIL_LIMIT]
        )
        if status.in_flight
        else [],
    )


def naming_incomplete(status: LedgerStatus) -> LedgerStatus:
    """The snapshot with its first incomplete runs (one more query, only when some are)."""
    if not status.incomplete_runs:
        return status
    # Through the ids, as _oldest_unresolved: given ORDER BY pk and a LIMIT, SQLite's
    # planner walks the whole table in pk order instead of the index's range (#25).
    ids = EventRun.objects.filter(cleanup_status=CleanupStatus.INCOMPLETE).values("pk")
    runs = EventRun.objects.filter(pk__in=ids).order_by("pk")[:DETAIL_LIMIT]
    return replace(status, incomplete=list(runs))


def _oldest_unresolved() -> list[EventRunResource]:
    # Through the ids: given `status IN (...)` and an ORDER BY, SQLite's planner (no
    # histograms: half the table per status, it guesses) reads the whole table instead
    # of the index once most rows are released. The ids come from the index alone.
    ids = EventRunResource.objects.filter(status__in=UNRESOLVED).values("pk")
    rows = EventRunResource.objects.filter(pk__in=ids).order_by("created_at", "pk")
    return list(rows[:DETAIL_LIMIT])


def _modules() -> list[ModuleRows]:
    max_attempts = ledger_settings.MAX_REVERT_ATTEMPTS
    max_claims = ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT
    stale_claim = Q(
        status=ResourceStatus.REVERTING,
        updated_at__lt=UtcNow() - ledger_settings.REVERT_CLAIM_TTL,
    )
    poison = (
        (~Q(status=ResourceStatus.REVERTING) & Q(claim_count__gte=1))
        | Q(status=ResourceStatus.REVERTING, claim_count__gte=2)
        | stale_claim
    )
    spent = Q(revert_attempts__gte=max_attempts) | Q(claim_count__gte=max_claims)
    rows = (
        EventRunResource.objects.filter(status__in=UNRESOLVED)
        .order_by()
        .values("owner_module", "status")
        .annotate(
            n=Count("pk"),
            oldest=Min("created_at"),
            poison=Count("pk", filter=poison),
            spent=Count("pk", filter=spent),
        )
    )
    by_owner: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = by_owner.setdefault(
            row["owner_module"], {"by_status": {}, "oldest": row["oldest"], "poison": 0, "spent": 0}
        )
        entry["by_status"][row["status"]] = row["n"]
        entry["oldest"] = min(entry["oldest"], row["oldest"])
        entry["poison"] += row["poison"]
        entry["spent"] += row["spent"]
    return [
        ModuleRows(
            owner=owner,
            by_status={s: e["by_status"][s] for s in UNRESOLVED if s in e["by_status"]},
            oldest=e["oldest"],
            poison=e["poison"],
            spent=e["spent"],
        )
        for owner, e in sorted(by_owner.items())
    ]


def duration(seconds: float | None) -> str:
    """3d 4h, 5h 10m, 12m 3s, 40s: what an operator reads at a glance."""
    if seconds is None:
        return "–"
    s = int(seconds)
    days, s = divmod(s, 86_400)
    hours, s = divmod(s, 3_600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {s}s"
    return f"{s}s"
