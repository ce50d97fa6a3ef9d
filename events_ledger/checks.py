"""System checks for registrations, with stable ids."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, Tags, Warning, register
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from .conf import ledger_settings
from .registry import REVERSIBLE_CLASSES
from .registry import default_registry as registry

E001 = "events_ledger.E001"  # duplicate id
E002 = "events_ledger.E002"  # unknown reversible class
E003 = "events_ledger.E003"  # ledger action without revert
E004 = "events_ledger.E004"  # lease without restore
E005 = "events_ledger.E005"  # action without perform
E006 = "events_ledger.E006"  # bad setting
E007 = "events_ledger.E007"  # a budget as long as a claim's TTL
E008 = "events_ledger.E008"  # an owner name longer than the ledger's column
E009 = "events_ledger.E009"  # a metrics token without prometheus_client

#: The ``owner_module`` column's length: a longer owner would be cut by MySQL's
#: ``INSERT IGNORE`` (rows filed under another owner) and refused by PostgreSQL.
MAX_OWNER = 64
W001 = "events_ledger.W001"  # unknown setting key
W002 = "events_ledger.W002"  # the ledger's own alias, without its router

#: Marked here, translated where it is used (a check runs after translation is set up).
HINT_REVERT = gettext_noop(
    "A 'ledger' action must declare revert(*, run_id, resources, idempotency_key)."
)


@register(Tags.compatibility)
def check_registrations(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    errors: list[Any] = []
    for problem in registry.problems:
        errors.append(Error(problem, hint=_("Give every action and lease its own id."), id=E001))
    for action in registry.actions.values():
        where = _("action %(id)r") % {"id": action.id}
        if action.reversible not in REVERSIBLE_CLASSES:
            errors.append(
                Error(
                    _("%(where)s has the unknown reversible class %(class)r.")
                    % {"where": where, "class": action.reversible},
                    hint=_("Use one of %(classes)s.") % {"classes": ", ".join(REVERSIBLE_CLASSES)},
                    id=E002,
                )
            )
        if action.reversible == "ledger" and not callable(action.revert):
            errors.append(
                Error(
                    _("%(where)s is 'ledger' but declares no revert().") % {"where": where},
                    hint=_(HINT_REVERT),
                    id=E003,
                )
            )
        if action.owner != "core" and not callable(action.perform):
            errors.append(Error(_("%(where)s declares no perform().") % {"where": where}, id=E005))
        if not action.owner or len(action.owner) > MAX_OWNER:
            errors.append(
                Error(
                    _("%(where)s needs an owner of 1–%(max)d characters, not %(owner)r.")
                    % {"where": where, "max": MAX_OWNER, "owner": action.owner},
                    id=E008,
                )
            )
    for lease in registry.leases.values():
        if not lease.owner or len(lease.owner) > MAX_OWNER:
            errors.append(
                Error(
                    _("lease %(id)r needs an owner of 1–%(max)d characters, not %(owner)r.")
                    % {"id": lease.id, "max": MAX_OWNER, "owner": lease.owner},
                    id=E008,
                )
            )
        if not callable(lease.restore):
            errors.append(
                Error(
                    _("lease %(id)r declares no restore().") % {"id": lease.id},
                    hint=_("restore(baseline, *, expected, run_id, target) puts the value back."),
                    id=E004,
                )
            )
        if not callable(lease.read) or not callable(lease.apply):
            errors.append(
                Error(
                    _("lease %(id)r must declare read() and apply().") % {"id": lease.id}, id=E004
                )
            )
    return errors + _budget_errors()


def _budget_errors() -> list[Any]:
    """A call that may outlive the claim that covers it breaks "one call at a time": a
    step's claim (or a revert's) would look dead to another worker while the call runs.
    A live worker keeps a step's claim fresh, but a process that stalls (swapped out,
    stopped) stamps nothing, so the budget must fit inside the TTL all the same."""
    try:
        step_ttl = ledger_settings.STEP_CLAIM_TTL.total_seconds()
        revert_ttl = ledger_settings.REVERT_CLAIM_TTL.total_seconds()
        default = ledger_settings.DEFAULT_REVERT_BUDGET.total_seconds()
    except Exception:  # reported by check_settings
        return []
    errors: list[Any] = []

    def too_long(what: str, budget_s: float, ttl_s: float, ttl_name: str) -> None:
        if budget_s >= ttl_s:
            errors.append(
                Error(
                    _(
                        "%(what)s has a budget of %(budget)gs, not shorter than %(ttl_name)s (%(ttl)gs)."
                    )
                    % {"what": what, "budget": budget_s, "ttl_name": ttl_name, "ttl": ttl_s},
                    hint=_(
                        "Shorten the budget or lengthen EVENTS_LEDGER[%(ttl_name)r]: a call "
                        "must end before the claim that covers it can be taken for dead."
                    )
                    % {"ttl_name": ttl_name},
                    id=E007,
                )
            )

    if default >= revert_ttl:
        too_long("DEFAULT_REVERT_BUDGET", default, revert_ttl, "REVERT_CLAIM_TTL")
    for action in registry.actions.values():
        if callable(action.perform):
            where = _("action %(id)r") % {"id": action.id}
            too_long(where, action.budget_s, step_ttl, "STEP_CLAIM_TTL")
        if callable(action.revert):
            where = _("action %(id)r") % {"id": action.id}
            too_long(where, action.budget_s, revert_ttl, "REVERT_CLAIM_TTL")
    for lease in registry.leases.values():
        where = _("lease %(id)r") % {"id": lease.id}
        too_long(where, lease.budget_s, step_ttl, "STEP_CLAIM_TTL")
        too_long(where, lease.budget_s, revert_ttl, "REVERT_CLAIM_TTL")
    return errors


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    from django.core.exceptions import ImproperlyConfigured

    from .conf import DEFAULTS

    messages: list[Any] = []
    try:
        unknown = ledger_settings.unknown_keys()
    except ImproperlyConfigured as exc:
        return [Error(str(exc), id=E006)]
    for key in unknown:
        messages.append(
            Warning(_("EVENTS_LEDGER has the unknown key %(key)r.") % {"key": key}, id=W001)
        )
    for key in DEFAULTS:
        try:
            getattr(ledger_settings, key)
        except ImproperlyConfigured as exc:
            messages.append(Error(str(exc), id=E006))
    return messages + _feature_errors() + _alias_warnings()


def _alias_warnings() -> list[Any]:
    """The ledger on an alias of its own, but ``migrate`` would put its tables on
    ``default`` too (or not on its alias): the host forgot the router."""
    from django.core.exceptions import ImproperlyConfigured
    from django.db import router

    try:
        alias = ledger_settings.DATABASE
    except ImproperlyConfigured:
        return []  # reported above
    if alias == "default" or (
        router.allow_migrate(alias, "events_ledger")
        and not router.allow_migrate("default", "events_ledger")
    ):
        return []
    return [
        Warning(
            _(
                "EVENTS_LEDGER['DATABASE'] is %(alias)r, but migrate would not keep the "
                "ledger's tables on it alone."
            )
            % {"alias": alias},
            hint=_("Add 'events_ledger.routers.LedgerRouter' to DATABASE_ROUTERS."),
            id=W002,
        )
    ]


def _feature_errors() -> list[Any]:
    """#15: a feature configured without the package it needs fails at start-up, by
    name, not at the first scrape."""
    from django.core.exceptions import ImproperlyConfigured

    from .metrics import INSTALL_HINT, counters_available

    try:
        token = ledger_settings.METRICS_TOKEN
    except ImproperlyConfigured:
        return []  # reported above
    if token is not None and not counters_available():
        return [
            Error(
                _("EVENTS_LEDGER['METRICS_TOKEN'] is set, but prometheus_client is not installed."),
                hint=_("The metrics view needs it: %(hint)s") % {"hint": INSTALL_HINT},
                id=E009,
            )
        ]
    return []
