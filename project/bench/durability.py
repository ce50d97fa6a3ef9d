"""What a commit means on the database the bench ran on: the settings, read back."""

from __future__ import annotations

from typing import Any

from django.db import connection

#: SQLite's PRAGMA synchronous answers a number.
_SQLITE_SYNC = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}


def durability() -> dict[str, Any]:
    """The server's settings that decide whether a commit is on disk when acknowledged,
    and ``durable``: whether they make it so (as a production server is set up)."""
    conn: Any = connection
    with conn.cursor() as cursor:
        if conn.vendor == "mysql":
            cursor.execute(
                "SELECT @@innodb_flush_log_at_trx_commit, @@innodb_flush_method, "
                "@@innodb_doublewrite, @@log_bin, @@sync_binlog"
            )
            flush, method, doublewrite, log_bin, sync_binlog = cursor.fetchone()
            settings = {
                "innodb_flush_log_at_trx_commit": int(flush),
                "innodb_flush_method": str(method),
                "innodb_doublewrite": int(doublewrite),
                "log_bin": int(log_bin),
                "sync_binlog": int(sync_binlog),
            }
            # 0 and 2 acknowledge before the log is flushed; nosync and O_DIRECT_NO_FSYNC
            # skip the fsync the flush needs.
            durable = int(flush) == 1 and str(method) not in ("nosync", "O_DIRECT_NO_FSYNC")
        elif conn.vendor == "postgresql":
            settings = {}
            for name in ("fsync", "synchronous_commit", "full_page_writes"):
                cursor.execute(f"SHOW {name}")
                settings[name] = cursor.fetchone()[0]
            durable = settings["fsync"] == "on" and settings["synchronous_commit"] in (
                "on",
                "local",
                "remote_write",
                "remote_apply",
            )
        else:
            cursor.execute("PRAGMA journal_mode")
            journal = str(cursor.fetchone()[0])
            cursor.execute("PRAGMA synchronous")
            sync = int(cursor.fetchone()[0])
            settings = {"journal_mode": journal, "synchronous": _SQLITE_SYNC.get(sync, str(sync))}
            # NORMAL in WAL mode may lose the last commits on a power cut; FULL does not.
            durable = sync >= 2
    return {"settings": settings, "durable": durable}
