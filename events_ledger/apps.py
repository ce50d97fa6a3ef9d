"""App configuration: pins the key type, registers checks, finds host apps' actions."""

from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class EventsLedgerConfig(AppConfig):
    name = "events_ledger"
    verbose_name = _("Events ledger")
    # Pinned, so a host's DEFAULT_AUTO_FIELD never makes a migration in site-packages.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .logcontext import install as install_log_context
        from .metrics import counters_available
        from .registry import autodiscover

        # Here, not in admin.py: a cron process that never imports the admin must see
        # the same actions as the web process.
        autodiscover()
        # #15: every record of the app carries run_id, step_id, action and owner.
        install_log_context()
        # #15: what this process did, counted when prometheus_client is installed (the
        # `metrics` extra); without it the app runs the same, uncounted.
        if counters_available():
            from .metrics import install as install_counters

            install_counters()
