"""Bounding a module's call: control comes back after its budget, whatever it does."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.backends.signals import connection_created

logger = logging.getLogger("events_ledger")

_watched = threading.local()


@dataclass(frozen=True)
class CallResult:
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    what: str = ""
    budget_s: float = 0.0

    @property
    def message(self) -> str:
        if self.timed_out:
            return f"{self.what} did not answer within {self.budget_s:g}s"
        if self.error is not None:
            return f"{self.what} raised {type(self.error).__name__}: {self.error}"
        return ""


def _note_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
    opened = getattr(_watched, "opened", None)
    if opened is None:
        return
    server_id = None
    try:
        with connection.cursor() as cursor:
            if connection.vendor == "mysql":
                cursor.execute("SELECT CONNECTION_ID()")
                server_id = cursor.fetchone()[0]
            elif connection.vendor == "postgresql":
                cursor.execute("SELECT pg_backend_pid()")
                server_id = cursor.fetchone()[0]
    except Exception:  # only bookkeeping; the module's own call decides
        logger.debug("could not read the server id of a worker connection", exc_info=True)
    opened.append((connection.alias, connection.vendor, server_id, connection))


connection_created.connect(_note_connection, dispatch_uid="events_ledger.deadline")


def call_with_deadline(fn: Callable[[], Any], budget_s: float, what: str) -> CallResult:
    """Call ``fn`` in a daemon thread and wait at most ``budget_s`` seconds.

    Python cannot kill a thread: a call abandoned at its deadline may still change
    the world later, which is exactly why a step's placeholder stays pending then.
    The thread is a daemon so a hung call never blocks process exit. It closes its
    database connections when it ends; when it does not end in time, the server-side
    sessions it opened are killed, so none is left open behind the caller.
    """
    box: dict[str, Any] = {"opened": []}

    def target() -> None:
        _watched.opened = box["opened"]
        try:
            box["value"] = fn()
        except BaseException as exc:  # a module may raise anything; it is an answer
            box["error"] = exc
        finally:
            _watched.opened = None
            connections.close_all()

    worker = threading.Thread(target=target, name=f"events-ledger:{what}", daemon=True)
    worker.start()
    worker.join(budget_s)
    if worker.is_alive():
        _abandon(box["opened"])
        return CallResult(timed_out=True, what=what, budget_s=budget_s)
    return CallResult(value=box.get("value"), error=box.get("error"), what=what, budget_s=budget_s)


def _abandon(opened: list[tuple[str, str, Any, Any]]) -> None:
    for alias, vendor, server_id, _wrapper in list(opened):
        try:
            if vendor == "mysql" and server_id is not None:
                with connections[alias].cursor() as cursor:
                    cursor.execute("KILL CONNECTION %s", [int(server_id)])
            elif vendor == "postgresql" and server_id is not None:
                with connections[alias].cursor() as cursor:
                    cursor.execute("SELECT pg_terminate_backend(%s)", [int(server_id)])
        except Exception:
            logger.warning(
                "could not end the connection of an abandoned %s call", alias, exc_info=True
            )
