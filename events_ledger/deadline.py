"""Bounding a module's call: control comes back after its budget, whatever it does."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import connections
from django.db.backends.signals import connection_created

logger = logging.getLogger("events_ledger")

_watched = threading.local()

T = TypeVar("T")


@dataclass(frozen=True)
class CallResult:
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    what: str = ""
    budget_s: float = 0.0
    #: The answer of a call that had outlived its deadline, handed to ``late``.
    late: bool = False

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

#: #15: told ``(what, seconds, outcome)`` of every module call: ``answered`` or ``raised``
#: when it ends (also after its deadline), ``overdue`` when its deadline passes. The
#: process's metrics are kept this way, in one place rather than at every call site.
call_observers: list[Callable[[str, float, str], None]] = []


def _observe(what: str, seconds: float, outcome: str) -> None:
    for observer in list(call_observers):
        try:
            observer(what, seconds, outcome)
        except Exception:  # bookkeeping must never change a call's answer
            logger.exception("an observer of module calls failed")


def call_with_deadline(
    fn: Callable[[], Any],
    budget_s: float,
    what: str,
    *,
    late: Callable[[CallResult], None] | None = None,
) -> CallResult:
    """Call ``fn`` in a daemon thread and wait at most ``budget_s`` seconds.

    Python cannot kill a thread: a call abandoned at its deadline may still change
    the world later. ``late``, when given, is called in that thread with the answer
    the call gives after its deadline, so the answer is recorded rather than lost;
    whether the call ended in time or late is decided under one lock, so exactly one
    of the caller and ``late`` sees the answer. The thread is a daemon so a hung call
    never blocks process exit. It closes its database connections when it ends. A call
    abandoned with no ``late`` has the server-side sessions it opened killed, so none
    is left open (holding locks or a transaction) behind the caller; one whose answer
    is awaited keeps them until it ends.
    """
    box: dict[str, Any] = {"opened": [], "state": "running"}
    lock = threading.Lock()

    def target() -> None:
        _watched.opened = box["opened"]
        value: Any = None
        error: BaseException | None = None
        started = time.monotonic()
        try:
            value = fn()
        except BaseException as exc:  # a module may raise anything; it is an answer
            error = exc
        finally:
            _watched.opened = None
            _close_connections()
        _observe(what, time.monotonic() - started, "raised" if error is not None else "answered")
        with lock:
            box["value"], box["error"], box["opened"] = value, error, []
            abandoned = box["state"] == "abandoned"
            box["state"] = "done"
        if abandoned and late is not None:
            try:
                late(CallResult(value, error, what=what, budget_s=budget_s, late=True))
            except BaseException:
                logger.exception("handling the late answer of %s failed", what)
            finally:
                _close_connections()

    # The caller's context goes with the call (#15): the log context of the step or run it
    # serves, also in a late answer's handling.
    worker = threading.Thread(
        target=contextvars.copy_context().run,
        args=(target,),
        name=f"events-ledger:{what}",
        daemon=True,
    )
    worker.start()
    try:
        worker.join(budget_s)
    except BaseException:
        # Interrupted while waiting (a task queue's soft time limit, an alarm, Ctrl-C):
        # the answer must still be recorded, by ``late``, whether the call has ended
        # or not; the caller's claim is ``late``'s to let go.
        _interrupted(box, lock, late, what, budget_s)
        raise
    with lock:
        if box["state"] == "done":
            return CallResult(
                value=box.get("value"), error=box.get("error"), what=what, budget_s=budget_s
            )
        box["state"] = "abandoned"
        opened = list(box["opened"])
    _observe(what, budget_s, "overdue")
    if late is None:
        _abandon(opened)
    # else: the call is still in the world and its answer is awaited; its sessions are
    # part of it (killing them would fail a call that was about to answer). It closes
    # them when it ends.
    return CallResult(timed_out=True, what=what, budget_s=budget_s)


def _interrupted(
    box: dict[str, Any],
    lock: threading.Lock,
    late: Callable[[CallResult], None] | None,
    what: str,
    budget_s: float,
) -> None:
    if late is None:
        return
    with lock:
        ended = box["state"] == "done"
        if not ended:
            box["state"] = "abandoned"  # the worker thread calls ``late`` when it ends
    if ended:
        result = CallResult(box.get("value"), box.get("error"), what=what, budget_s=budget_s)

        def deliver() -> None:
            try:
                late(result)
            except BaseException:
                logger.exception("handling the answer of an interrupted %s failed", what)
            finally:
                _close_connections()

        threading.Thread(target=deliver, name=f"events-ledger:{what}:late", daemon=True).start()


def call_all(
    calls: Sequence[Callable[[], T]],
    width: int,
    *,
    should_stop: Callable[[], bool] | None = None,
) -> list[T | None]:
    """Make ``calls`` (each a module call under its own deadline) at most ``width`` at a
    time; answers their results in order.

    A pass that calls its modules one after the other takes the sum of their times; in
    parallel it takes about the longest. A call not yet started when ``should_stop``
    says so is not started, and answers None. What a call raises is raised here, once
    every started call has ended (so no answer is lost behind it).
    """

    def one(call: Callable[[], T]) -> T | None:
        if should_stop is not None and should_stop():
            return None
        try:
            return call()
        finally:
            # A call's deadline may have killed sessions from this thread's connection.
            _close_connections()

    if width <= 1 or len(calls) <= 1:
        return [None if should_stop is not None and should_stop() else call() for call in calls]
    with ThreadPoolExecutor(
        max_workers=min(width, len(calls)), thread_name_prefix="events-ledger:calls"
    ) as pool:
        # Each call in the caller's context (#15: the log context of the pass).
        futures = [pool.submit(contextvars.copy_context().run, one, call) for call in calls]
    return [future.result() for future in futures]


def _close_connections() -> None:
    try:
        connections.close_all()
    except Exception:  # a killed session may fail to close; it is gone either way
        logger.debug("closing a worker thread's connections failed", exc_info=True)


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
