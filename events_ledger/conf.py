"""The app's settings: one ``EVENTS_LEDGER`` dict, read on every access."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar, overload

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from django.utils.translation import gettext as _

DEFAULTS: dict[str, Any] = {
    # R5: a `reverting` row older than this belongs to a process that died mid-revert.
    "REVERT_CLAIM_TTL": timedelta(minutes=15),
    # Rule 2: automatic tries before a row is left for a human.
    "MAX_REVERT_ATTEMPTS": 3,
    # A row claimed this often with no verdict kills or hangs its sweeper: fail it.
    "MAX_CLAIMS_WITHOUT_VERDICT": 5,
    "CLEANUP_RUN_BATCH": 10,
    # How often at most a sweeper skips the repair of summaries while it has a backlog
    # (its last scan came back full): the repair reads every run that owes something.
    "CLEANUP_REPAIR_EVERY": timedelta(seconds=60),
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
    # #24: on MariaDB a small step's two transactions each go to the server as one
    # compound statement (one round trip each). False sends every step the general way.
    "FAST_PATH": True,
    # #28: how long a finished run that owes nothing is kept before `prune_ledger` (or
    # its task) removes it with its steps, rows and log. None keeps every run for ever.
    "RETENTION": None,
    # Where a prune from a task queue archives what it removes (a compressed JSON-lines
    # file, created 0600); None archives nothing. A setting, not a task argument: a
    # message on the broker must not choose a file to write.
    "ARCHIVE": None,
    "ARCHIVE_REDACT": None,
    # #26, C8: a run's resources are given back in reverse order of the phases that
    # made them (the last phase first). False gives every group back at once, in no
    # order, for worlds where nothing depends on anything.
    "GIVE_BACK_IN_ORDER": True,
    # The alias of DATABASES the ledger's tables live on. Every read and write of the
    # ledger goes there, whatever a host's router says: a claim decided on a lagging
    # replica would claim what another sweeper already gave back.
    "DATABASE": "default",
}

#: A shorter bearer token is guessable; the check says so at start-up.
MIN_TOKEN_LENGTH = 16
#: ``"a" * 16`` is as long and as guessable as one character.
MIN_TOKEN_DISTINCT = 8

T = TypeVar("T")


class _Setting(Generic[T]):
    """One key of ``EVENTS_LEDGER``, typed: read from the settings on every access (so
    ``override_settings`` works), its default from ``DEFAULTS``, checked by name."""

    name: str

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Setting[T]: ...

    @overload
    def __get__(self, obj: LedgerSettings, owner: type) -> T: ...

    def __get__(self, obj: LedgerSettings | None, owner: type) -> _Setting[T] | T:
        if obj is None:
            return self
        return self.check(obj._user().get(self.name, DEFAULTS[self.name]))

    def check(self, value: Any) -> T:
        raise NotImplementedError

    def wrong(self, must: str, value: Any) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            _("EVENTS_LEDGER[%(name)r] must be %(must)s, not %(value)s.")
            % {"name": self.name, "must": must, "value": value}
        )


class _Duration(_Setting[timedelta]):
    def check(self, value: Any) -> timedelta:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # Plain numbers are seconds, as Django's own timeouts are.
            value = timedelta(seconds=value)
        if not isinstance(value, timedelta) or value <= timedelta(0):
            raise self.wrong(_("a positive timedelta or number of seconds"), repr(value))
        return value


class _PositiveInt(_Setting[int]):
    def check(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.wrong(_("a whole number of at least 1"), repr(value))
        return value


class _Fraction(_Setting[float]):
    def check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise self.wrong(_("a number from 0 to 1"), repr(value))
        return float(value)


class _Token(_Setting["str | None"]):
    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        # The value is a secret: say how long it is or what type, never what it is.
        if not isinstance(value, str):
            shown = _("a value of type %(type)s") % {"type": type(value).__name__}
        elif len(value) < MIN_TOKEN_LENGTH or len(set(value)) < MIN_TOKEN_DISTINCT:
            shown = _("%(count)d characters, %(distinct)d of them different") % {
                "count": len(value),
                "distinct": len(set(value)),
            }
        else:
            return value
        raise self.wrong(
            _(
                "None or a string of at least %(min)d characters, %(distinct)d of them "
                "different (secrets.token_urlsafe(32) makes one)"
            )
            % {"min": MIN_TOKEN_LENGTH, "distinct": MIN_TOKEN_DISTINCT},
            shown,
        )


class _Retention(_Setting["timedelta | None"]):
    def check(self, value: Any) -> timedelta | None:
        # None (the default) keeps history for ever; anything else reads as a duration.
        return None if value is None else _Duration.check(self, value)  # type: ignore[arg-type]


class _Path(_Setting["str | None"]):
    def check(self, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, (str, os.PathLike)) or not os.path.isabs(value):
            shown = repr(value) if isinstance(value, str) else type(value).__name__
            raise self.wrong(_("None or an absolute path"), shown)
        return os.fspath(value)


class _Flag(_Setting[bool]):
    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.wrong(_("True or False"), repr(value))
        return value


class _Hook(_Setting["Callable[[dict[str, Any]], dict[str, Any]] | None"]):
    """A callable, or the dotted path of one (imported when used)."""

    def check(self, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
        if value is None or callable(value):
            return value
        if isinstance(value, str):
            try:
                found = import_string(value)
            except ImportError as exc:
                raise self.wrong(_("None, a callable or its dotted path"), repr(value)) from exc
            if callable(found):
                return found
        raise self.wrong(_("None, a callable or its dotted path"), repr(value))


class _Alias(_Setting[str]):
    def check(self, value: Any) -> str:
        aliases = sorted(getattr(django_settings, "DATABASES", {}))
        if not isinstance(value, str) or value not in aliases:
            must = _("one of the aliases of DATABASES (%(aliases)s)") % {
                "aliases": ", ".join(aliases)
            }
            raise self.wrong(must, repr(value))
        return value


class LedgerSettings:
    """Typed access to ``settings.EVENTS_LEDGER`` with defaults: each key is a typed
    attribute, so a misspelled name is a type error (and an AttributeError), not ``None``.

    Read lazily on each access (never at import), so ``override_settings`` works and a
    wrong value is reported where it is used, by name, instead of at import time.
    """

    REVERT_CLAIM_TTL = _Duration()
    MAX_REVERT_ATTEMPTS = _PositiveInt()
    MAX_CLAIMS_WITHOUT_VERDICT = _PositiveInt()
    CLEANUP_RUN_BATCH = _PositiveInt()
    CLEANUP_REPAIR_EVERY = _Duration()
    CLEANUP_GROUPS_PER_RUN = _PositiveInt()
    CLEANUP_CONCURRENCY = _PositiveInt()
    DEFAULT_REVERT_BUDGET = _Duration()
    MAX_STEP_ATTEMPTS = _PositiveInt()
    STEP_CLAIM_TTL = _Duration()
    RECONCILE_MAX_ORPHAN_FRACTION = _Fraction()
    HEALTH_MAX_UNRESOLVED_AGE = _Duration()
    METRICS_TOKEN = _Token()
    FAST_PATH = _Flag()
    RETENTION = _Retention()
    ARCHIVE = _Path()
    ARCHIVE_REDACT = _Hook()
    GIVE_BACK_IN_ORDER = _Flag()
    DATABASE = _Alias()

    def _user(self) -> dict[str, Any]:
        value = getattr(django_settings, "EVENTS_LEDGER", None) or {}
        if not isinstance(value, dict):
            raise ImproperlyConfigured(_("EVENTS_LEDGER must be a dict."))
        return value

    def unknown_keys(self) -> list[str]:
        return sorted(set(self._user()) - set(DEFAULTS))


ledger_settings = LedgerSettings()
