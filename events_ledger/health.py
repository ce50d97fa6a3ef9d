"""django-health-check checks (#15): is the ledger readable (readiness, for a load
balancer), and does the ledger need a human (for alerting). Two questions, two checks:
a run that needs a human must never take a web node out of rotation.

django-health-check (4.0 or newer) is optional, the ``health`` extra. Serve each with the
view below, which tells anyone the verdict and only staff who may view runs (or a
bearer ``METRICS_TOKEN``) the details (#25)::

    # the load balancer's: fails only when the database or the ledger cannot be read
    path("health/", LedgerHealthCheckView.as_view(
        checks=["health_check.checks.Database", "events_ledger.health.LedgerHealthCheck"])),
    # the alert's: fails while a run is incomplete or a row is owed too long
    path("health/ledger/", LedgerHealthCheckView.as_view(
        checks=["events_ledger.health.LedgerNeedsHumanCheck"])),
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse

try:
    from health_check.base import HealthCheck
    from health_check.exceptions import ServiceUnavailable
    from health_check.views import HealthCheckView
except ImportError as exc:  # not installed, or a 3.x without the check classes
    raise ImproperlyConfigured(
        "events_ledger.health needs django-health-check 4.0 or newer: "
        "pip install 'django-events-ledger[health]'"
    ) from exc

from .metrics import may_view, token_matches
from .models import EventRun
from .status import naming_incomplete, snapshot

#: What an anonymous caller is told of an unhealthy ledger (#25): the verdict, not which
#: runs, modules or ages (django-health-check: "messages must not contain sensitive
#: information"). Staff read the rest in the console or ``manage.py ledger_status``.
VERDICT_ONLY = (
    "the events ledger needs a human (details: the admin's events ledger page, or "
    "manage.py ledger_status)"
)


@dataclasses.dataclass
class LedgerHealthCheck(HealthCheck):
    """Readiness: this process can read the ledger (one query of one row). Fails only
    when it cannot; never for a run that needs a human, which is not "this node cannot
    serve" (one failed revert in a game module took every web node out of rotation)."""

    #: Kept for the view, which gives it to every ledger check; readiness has no details.
    details: bool = dataclasses.field(default=False, repr=False)

    async def run(self) -> None:
        # In the request's own thread (thread_sensitive), on its own connection: a
        # worker thread of the event loop would leave a connection open behind it.
        try:
            await sync_to_async(_readable, thread_sensitive=True)()
        except DatabaseError as exc:
            raise ServiceUnavailable(f"the ledger could not be read: {type(exc).__name__}") from exc


def _readable() -> None:
    list(EventRun.objects.order_by().values_list("pk")[:1])


#: How long an anonymous caller's "needs a human" verdict is reused: a probe that polls
#: (or a flood of them) costs the database one snapshot per this many seconds.
VERDICT_REUSED_S = 10.0
_verdicts: dict[str, tuple[float, tuple[str, ...]]] = {}


@dataclasses.dataclass
class LedgerNeedsHumanCheck(HealthCheck):
    """The same verdict as ``manage.py ledger_status`` and the ``events_ledger_healthy``
    metric: fails while a run's cleanup is incomplete or an unresolved row is older than
    ``HEALTH_MAX_UNRESOLVED_AGE``. For an alert or an uptime check, never for a load
    balancer. Without ``details`` (anonymous callers) it says so and nothing more, from
    a verdict at most ``VERDICT_REUSED_S`` old; with them, the problems in full."""

    #: The problems in full (the runs, the modules, the oldest row's age). Not in repr:
    #: the check's name in the report stays ``LedgerNeedsHumanCheck()``.
    details: bool = dataclasses.field(default=False, repr=False)

    async def run(self) -> None:
        try:
            problems = await sync_to_async(_problems, thread_sensitive=True)(self.details)
        except DatabaseError as exc:
            raise ServiceUnavailable(f"the ledger could not be read: {type(exc).__name__}") from exc
        if problems:
            raise ServiceUnavailable("; ".join(problems) if self.details else VERDICT_ONLY)


def _problems(details: bool) -> tuple[str, ...]:
    if details:
        return tuple(naming_incomplete(snapshot()).problems)
    now = time.monotonic()
    kept = _verdicts.get("anonymous")
    if kept is not None and now - kept[0] < VERDICT_REUSED_S:
        return kept[1]
    problems = tuple(snapshot().problems)
    _verdicts["anonymous"] = (now, problems)
    return problems


class LedgerHealthCheckView(HealthCheckView):
    """django-health-check's view, whose ``LedgerNeedsHumanCheck`` gives its details only to
    a staff user who may view runs (``events_ledger.view_eventrun``, the console's
    permission) or a request with the bearer ``METRICS_TOKEN``; anyone else (a load
    balancer, an uptime check) reads the verdict."""

    details = False

    async def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        matches = token_matches(request)
        if matches is None:
            user = await request.auser()
            self.details = await sync_to_async(may_view)(user)
        else:
            self.details = matches
        return await super().get(request, *args, **kwargs)

    def get_checks(self) -> Any:
        for check in super().get_checks():
            if isinstance(check, LedgerNeedsHumanCheck) and self.details:
                check = dataclasses.replace(check, details=True)
            yield check
