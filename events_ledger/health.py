"""A django-health-check check (#15): unhealthy when a run's cleanup is incomplete or an
unresolved resource is older than ``HEALTH_MAX_UNRESOLVED_AGE``.

django-health-check (4.0 or newer) is optional, the ``health`` extra. Serve it with the
view below, which tells anyone the verdict and only staff who may view runs (or a
bearer ``METRICS_TOKEN``) the details (#25)::

    path("health/", LedgerHealthCheckView.as_view(
        checks=["health_check.checks.Database", "events_ledger.health.LedgerHealthCheck"]))
"""

from __future__ import annotations

import dataclasses
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
from .status import LedgerStatus, naming_incomplete, snapshot

#: What an anonymous caller is told of an unhealthy ledger (#25): the verdict, not which
#: runs, modules or ages (django-health-check: "messages must not contain sensitive
#: information"). Staff read the rest in the console or ``manage.py ledger_status``.
VERDICT_ONLY = (
    "the events ledger needs a human (details: the admin's events ledger page, or "
    "manage.py ledger_status)"
)


@dataclasses.dataclass
class LedgerHealthCheck(HealthCheck):
    """The same verdict as ``manage.py ledger_status`` and the ``events_ledger_healthy``
    metric, read from the database (three queries; a fourth names the incomplete runs
    when there are some and ``details`` is on). Without ``details`` (the default) an
    unhealthy ledger says so and nothing more."""

    #: The problems in full (the runs, the modules, the oldest row's age). Not in repr:
    #: the check's name in the report stays ``LedgerHealthCheck()``.
    details: bool = dataclasses.field(default=False, repr=False)

    async def run(self) -> None:
        # In the request's own thread (thread_sensitive), on its own connection: a
        # worker thread of the event loop would leave a connection open behind it.
        try:
            status: LedgerStatus = await sync_to_async(_status, thread_sensitive=True)(self.details)
        except DatabaseError as exc:
            raise ServiceUnavailable(f"the ledger could not be read: {type(exc).__name__}") from exc
        if status.problems:
            raise ServiceUnavailable("; ".join(status.problems) if self.details else VERDICT_ONLY)


def _status(details: bool) -> LedgerStatus:
    status = snapshot()
    return naming_incomplete(status) if details else status


class LedgerHealthCheckView(HealthCheckView):
    """django-health-check's view, whose ``LedgerHealthCheck`` gives its details only to
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
            if isinstance(check, LedgerHealthCheck) and self.details:
                check = dataclasses.replace(check, details=True)
            yield check
