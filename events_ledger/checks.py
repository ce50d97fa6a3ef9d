"""System checks for registrations, with stable ids."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, Tags, Warning, register

from .conf import ledger_settings
from .registry import REVERSIBLE_CLASSES
from .registry import default_registry as registry

E001 = "events_ledger.E001"  # duplicate id
E002 = "events_ledger.E002"  # unknown reversible class
E003 = "events_ledger.E003"  # ledger action without revert
E004 = "events_ledger.E004"  # lease without restore
E005 = "events_ledger.E005"  # action without perform
E006 = "events_ledger.E006"  # bad setting
W001 = "events_ledger.W001"  # unknown setting key

HINT_REVERT = "A 'ledger' action must declare revert(*, run_id, resources, idempotency_key)."


@register(Tags.compatibility)
def check_registrations(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    errors: list[Any] = []
    for problem in registry.problems:
        errors.append(Error(problem, hint="Give every action and lease its own id.", id=E001))
    for action in registry.actions.values():
        where = f"action {action.id!r}"
        if action.reversible not in REVERSIBLE_CLASSES:
            errors.append(
                Error(
                    f"{where} has the unknown reversible class {action.reversible!r}.",
                    hint=f"Use one of {', '.join(REVERSIBLE_CLASSES)}.",
                    id=E002,
                )
            )
        if action.reversible == "ledger" and not callable(action.revert):
            errors.append(
                Error(f"{where} is 'ledger' but declares no revert().", hint=HINT_REVERT, id=E003)
            )
        if action.owner != "core" and not callable(action.perform):
            errors.append(Error(f"{where} declares no perform().", id=E005))
    for lease in registry.leases.values():
        if not callable(lease.restore):
            errors.append(
                Error(
                    f"lease {lease.id!r} declares no restore().",
                    hint="restore(baseline, *, expected, run_id, target) puts the value back.",
                    id=E004,
                )
            )
        if not callable(lease.read) or not callable(lease.apply):
            errors.append(Error(f"lease {lease.id!r} must declare read() and apply().", id=E004))
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
        messages.append(Warning(f"EVENTS_LEDGER has the unknown key {key!r}.", id=W001))
    for key in DEFAULTS:
        try:
            getattr(ledger_settings, key)
        except ImproperlyConfigured as exc:
            messages.append(Error(str(exc), id=E006))
    return messages
