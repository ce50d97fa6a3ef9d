"""The app's settings: one ``EVENTS_LEDGER`` dict, read on every access."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

DEFAULTS: dict[str, Any] = {
    # R5: a `reverting` row older than this belongs to a process that died mid-revert.
    "REVERT_CLAIM_TTL": timedelta(minutes=15),
    # Rule 2: automatic tries before a row is left for a human.
    "MAX_REVERT_ATTEMPTS": 3,
    # A row claimed this often with no verdict kills or hangs its sweeper: fail it.
    "MAX_CLAIMS_WITHOUT_VERDICT": 5,
    "CLEANUP_RUN_BATCH": 10,
    "CLEANUP_GROUPS_PER_RUN": 25,
    # How many module calls (revert, restore, reconcile) one pass makes at once; each
    # under its own deadline. 1 calls them one after the other.
    "CLEANUP_CONCURRENCY": 8,
    "DEFAULT_REVERT_BUDGET": timedelta(seconds=10),
    # How often a step is tried before it is failed for good.
    "MAX_STEP_ATTEMPTS": 3,
    # A `running` step older than this belongs to a worker that died.
    "STEP_CLAIM_TTL": timedelta(minutes=15),
    # C6 safety bound: one reconcile answer may orphan at most this share of a module's rows.
    "RECONCILE_MAX_ORPHAN_FRACTION": 0.5,
    # #15: the health check and `ledger_status` call the ledger unhealthy when an
    # unresolved row is older than this (rows of runs still going count too, so a run
    # stuck in `running` is caught: choose it above your longest run).
    "HEALTH_MAX_UNRESOLVED_AGE": timedelta(days=1),
    # #15: a bearer token that may read the metrics view besides a staff session; None:
    # staff only. A secret, so read it from the environment.
    "METRICS_TOKEN": None,
}

_DURATIONS = {
    "REVERT_CLAIM_TTL",
    "DEFAULT_REVERT_BUDGET",
    "STEP_CLAIM_TTL",
    "HEALTH_MAX_UNRESOLVED_AGE",
}
#: A shorter bearer token is guessable; the check says so at start-up.
MIN_TOKEN_LENGTH = 16
_POSITIVE_INTS = {
    "MAX_REVERT_ATTEMPTS",
    "MAX_CLAIMS_WITHOUT_VERDICT",
    "CLEANUP_RUN_BATCH",
    "CLEANUP_GROUPS_PER_RUN",
    "CLEANUP_CONCURRENCY",
    "MAX_STEP_ATTEMPTS",
}


class LedgerSettings:
    """Attribute access to ``settings.EVENTS_LEDGER`` with defaults.

    Read lazily on each access (never at import), so ``override_settings`` works and a
    wrong value is reported where it is used, by name, instead of at import time.
    """

    def _user(self) -> dict[str, Any]:
        value = getattr(django_settings, "EVENTS_LEDGER", None) or {}
        if not isinstance(value, dict):
            raise ImproperlyConfigured("EVENTS_LEDGER must be a dict.")
        return value

    def unknown_keys(self) -> list[str]:
        return sorted(set(self._user()) - set(DEFAULTS))

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(name)
        value = self._user().get(name, DEFAULTS[name])
        return _validate(name, value)


def _validate(name: str, value: Any) -> Any:
    if name in _DURATIONS:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # Plain numbers are seconds, as Django's own timeouts are.
            value = timedelta(seconds=value)
        if not isinstance(value, timedelta) or value <= timedelta(0):
            raise ImproperlyConfigured(
                f"EVENTS_LEDGER[{name!r}] must be a positive timedelta or number of seconds, "
                f"not {value!r}."
            )
        return value
    if name in _POSITIVE_INTS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ImproperlyConfigured(
                f"EVENTS_LEDGER[{name!r}] must be a whole number of at least 1, not {value!r}."
            )
        return value
    if name == "RECONCILE_MAX_ORPHAN_FRACTION":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ImproperlyConfigured(
                f"EVENTS_LEDGER[{name!r}] must be a number from 0 to 1, not {value!r}."
            )
        return float(value)
    if name == "METRICS_TOKEN":
        if value is not None and (not isinstance(value, str) or len(value) < MIN_TOKEN_LENGTH):
            shown = f"{len(value)} characters" if isinstance(value, str) else repr(value)
            raise ImproperlyConfigured(
                f"EVENTS_LEDGER[{name!r}] must be None or a string of at least "
                f"{MIN_TOKEN_LENGTH} characters, not {shown}."
            )
        return value
    return value


ledger_settings = LedgerSettings()
