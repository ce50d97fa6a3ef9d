"""The router a host adds when the ledger lives on an alias of its own
(``EVENTS_LEDGER["DATABASE"]``): its tables are migrated there and nowhere else.

The ledger's reads and writes never ask a router (its managers and models name their
alias themselves), so a host router that sends reads to a replica cannot reach them;
this router is needed only for ``migrate``.
"""

from __future__ import annotations

from typing import Any

from .db import ledger_db

APP_LABEL = "events_ledger"


class LedgerRouter:
    def db_for_read(self, model: type, **hints: Any) -> str | None:
        return ledger_db() if model._meta.app_label == APP_LABEL else None  # type: ignore[attr-defined]

    db_for_write = db_for_read

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        ours = {obj._meta.app_label == APP_LABEL for obj in (obj1, obj2)}
        return True if ours == {True} else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        own = ledger_db()
        if app_label == APP_LABEL:
            return db == own
        # An alias of the ledger's own holds the ledger's tables only.
        return False if db == own and own != "default" else None
