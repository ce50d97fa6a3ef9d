"""A host's read-replica router, as many projects have one: the example project uses it
when ``DATABASE_REPLICA_URL`` names a streaming replica. It sends the ledger's reads to
the replica; the ledger never asks it (it reads and writes its own alias), which is what
``make test`` proves with a replica that lags behind on purpose."""

from __future__ import annotations

from typing import Any


class ReadsFromReplica:
    def db_for_read(self, model: type, **hints: Any) -> str | None:
        # Only the ledger's tables: the demo world and the console's users are read
        # where they are written, so what is tested is the ledger alone.
        return "replica" if model._meta.app_label == "events_ledger" else None  # type: ignore[attr-defined]

    def db_for_write(self, model: type, **hints: Any) -> str | None:
        return "default"

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True  # one database, two ways in

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db != "replica"
