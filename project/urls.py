"""The example project's URLs: the admin is the console (S3); metrics and health (#15)."""

from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

from events_ledger.health import LedgerHealthCheckView
from events_ledger.views import metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    # Prometheus scrapes it with EVENTS_LEDGER["METRICS_TOKEN"]; staff read it logged in.
    path("metrics", metrics, name="metrics"),
    # A load balancer reads it: 500 only when the database or the ledger cannot be read.
    path(
        "health/",
        LedgerHealthCheckView.as_view(
            checks=["health_check.checks.Database", "events_ledger.health.LedgerHealthCheck"]
        ),
        name="health",
    ),
    # An alert or uptime check reads it: 500 while a run is incomplete or an unresolved
    # resource is older than HEALTH_MAX_UNRESOLVED_AGE. The verdict for anyone; which
    # runs and modules only for staff who may view runs, or the token.
    path(
        "health/ledger/",
        LedgerHealthCheckView.as_view(checks=["events_ledger.health.LedgerNeedsHumanCheck"]),
        name="health-ledger",
    ),
    path("", RedirectView.as_view(pattern_name="admin:index")),
]
