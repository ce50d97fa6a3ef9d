"""events_ledger: write down everything a run changes before it happens, give it all back."""

from __future__ import annotations

from typing import Any

#: The one version number: pyproject.toml reads it from here (``[tool.setuptools.dynamic]``),
#: so the built package's metadata and a checkout say the same.
__version__ = "0.1.0"

_EXPORTS = {
    "Action": "registry",
    "Lease": "registry",
    "register_action": "registry",
    "register_lease": "registry",
    "registry": "registry",
    "AlreadyRegistered": "registry",
    "NotRegistered": "registry",
    "execute_step": "ledger",
    "StepResult": "ledger",
    "classify_revert": "envelopes",
    # The status vocabulary (#13): str enums, equal to the values stored.
    "RunStatus": "states",
    "CleanupStatus": "states",
    "StepStatus": "states",
    "ResourceStatus": "states",
    "InvalidTransition": "states",
    "cleanup_run": "cleanup",
    "plan_run": "cleanup",
    "sweep": "cleanup",
    "reconcile": "cleanup",
    "reconcile_module": "cleanup",
    "reconcile_all": "cleanup",
    "RunNotTerminal": "cleanup",
    "InCallersTransaction": "db",
    # #15: operating it
    "signals": "signals",
    "snapshot": "status",
    "LedgerStatus": "status",
    "log_context": "logcontext",
    # #14: running a run
    "run_steps": "runner",
    "RunReport": "runner",
    "end_run": "runner",
    "resolve_by_hand": "runner",
}


def __getattr__(name: str) -> Any:
    # Lazy, so importing the package never imports models before the app registry.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'events_ledger' has no attribute {name!r}")
    from importlib import import_module

    if name == module:  # the module is its own public face (events_ledger.registry)
        return import_module(f"events_ledger.{module}")
    return getattr(import_module(f"events_ledger.{module}"), name)


def __dir__() -> list[str]:
    # The lazy names too, so dir() and a shell's completion show the public API.
    return sorted({*globals(), *_EXPORTS})


__all__ = sorted(_EXPORTS)
