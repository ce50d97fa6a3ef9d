"""A django-health-check check (#15): unhealthy when a run's cleanup is incomplete or an
unresolved resource is older than ``HEALTH_MAX_UNRESOLVED_AGE``.

django-health-check (4.0 or newer) is optional, the ``health`` extra. Name the check in
the view's ``checks``::

    HealthCheckView.as_view(checks=["health_check.checks.Database", "events_ledger.health.LedgerHealthCheck"])
"""

from __future__ import annotations

import dataclasses

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError

try:
    from health_check.base import HealthCheck
    from health_check.exceptions import ServiceUnavailable
except ImportError as exc:  # not installed, or a 3.x without the check classes
    raise ImproperlyConfigured(
        "events_ledger.health needs django-health-check 4.0 or newer: "
        "pip install 'django-events-ledger[health]'"
    ) from exc

from .status import LedgerStatus, naming_incomplete, snapshot


@dataclasses.dataclass
class LedgerHealthCheck(HealthCheck):
    """The same verdict as ``manage.py ledger_status`` and the ``events_ledger_healthy``
    metric, read from the database (three queries; a fourth names the incomplete runs when there are some)."""

    async def run(self) -> None:
        # In the request's own thread (thread_sensitive), on its own connection: a
        # worker thread of the event loop would leave a connection open behind it.
        try:
            status: LedgerStatus = await sync_to_async(_status, thread_sensitive=True)()
        except DatabaseError as exc:
            raise ServiceUnavailable(f"the ledger could not be read: {type(exc).__name__}") from exc
        if status.problems:
            raise ServiceUnavailable("; ".join(status.problems))


def _status() -> LedgerStatus:
    return naming_incomplete(snapshot())
