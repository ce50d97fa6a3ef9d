"""Bounding a module's call: control comes back after its budget, whatever it does."""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
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
    if connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
        # Behind a pooler in transaction mode (what Django asks this setting for), a
        # session serves this connection for one transaction only: the session an id
        # names now serves another client when the deadline comes, and ending it would
        # kill that client's work. The abandoned call keeps its session until it ends.
        opened.append((connection.alias, connection.vendor, None, connection))
        return
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
    """Call ``fn`` in a daemon thread (one kept between calls, see ``_Workers``) and wait
    at most ``budget_s`` seconds.

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

    ended = threading.Event()

    def job() -> None:
        try:
            target()
        finally:
            ended.set()

    # The caller's context goes with the call (#15): the log context of the step or run it
    # serves, also in a late answer's handling.
    context = contextvars.copy_context()
    workers.run(lambda: context.run(job), f"events-ledger:{what}")
    try:
        # ``ended`` is set after ``late`` has run, so a late answer always finds the
        # state "abandoned" and is handled by ``late``, never lost in between.
        ended.wait(budget_s)
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


#: Idle call threads kept for the next calls; more are started when calls overlap.
MAX_IDLE_WORKERS = 16
#: An idle call thread ends after this long without a call.
IDLE_WORKER_S = 60.0


class _Workers:
    """The threads module calls run in, kept between calls.

    Starting a thread per call costs little on a busy CPU but, measured on this
    project's machine, 0.5 to 3.5 ms when the CPU had gone idle while the step's
    commit waited on the disk: more than the rest of a small step. A kept thread takes
    a call in about 0.05 ms. A call that outlives its deadline keeps its thread (Python
    cannot stop one) until it ends, so a call finding no idle thread gets a new one,
    and never waits for another call.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        # Also in a forked child: it inherits no threads, and a lock another thread
        # held at the fork would stay held for ever.
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._pid = os.getpid()

    def run(self, job: Callable[[], None], name: str) -> None:
        """Start ``job`` in a thread named ``name`` while it runs; do not wait for it."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child inherits no threads
                self._idle, self._pid = [], os.getpid()
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self)
        worker.give(job, name)

    def back(self, worker: _Worker) -> bool:
        """A worker is free again: kept idle (True) or to end (False)."""
        with self._lock:
            if self._pid != os.getpid() or len(self._idle) >= MAX_IDLE_WORKERS:
                return False
            self._idle.append(worker)
            return True

    def retire(self, worker: _Worker) -> bool:
        """An idle worker waited long enough: it ends, unless a call has just taken it."""
        with self._lock:
            if worker in self._idle:
                self._idle.remove(worker)
                return True
            return False

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)


class _Worker:
    IDLE_NAME = "events-ledger:idle"

    def __init__(self, pool: _Workers) -> None:
        self._pool = pool
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], str]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=self.IDLE_NAME, daemon=True)
        self._thread.start()

    def give(self, job: Callable[[], None], name: str) -> None:
        self._jobs.put((job, name))

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                job, name = self._jobs.get(timeout=IDLE_WORKER_S)
            except queue.Empty:
                if self._pool.retire(self):
                    return
                continue  # taken for a call just now: its job is on the way
            me.name = name
            try:
                job()
            except BaseException:  # ``job`` handles its call's errors; this is a bug
                logger.exception("a module call's thread failed")
            finally:
                me.name = self.IDLE_NAME
            if not self._pool.back(self):
                return


workers = _Workers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=workers._reset)


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


class Calls:
    """Module calls (each under its own deadline) made at most ``width`` at a time on the
    kept worker threads, never in the caller's thread; ``wait`` answers their results in
    order.

    A pass that calls its modules one after the other takes the sum of their times; in
    parallel it takes about the longest. The caller only waits, so an exception the host
    raises in it (a task queue's soft time limit, an alarm, Ctrl-C) never lands inside a
    call and is never taken for the module's answer: the caller ``stop``s the calls not
    yet started (they answer None) and hands the running ones' answers on with
    ``when_done``, while those calls go on. What a call raises is raised by ``wait``, once
    every started call has ended (so no answer is lost behind it).
    """

    def __init__(
        self,
        calls: Sequence[Callable[[], T]],
        width: int,
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.answers: list[Any] = [None] * len(calls)
        self._raised: list[BaseException | None] = [None] * len(calls)
        self._calls = calls
        self._should_stop = should_stop
        self._stopped = False
        self._lock = threading.Lock()
        self._todo = iter(range(len(calls)))
        self._lanes = max(1, min(width, len(calls)))
        self._then: list[Callable[[], None]] = []
        self.done = threading.Event()
        if not calls:
            self.done.set()
            return
        # Each call in the caller's context (#15: the log context of the pass).
        self._contexts = [contextvars.copy_context() for _ in calls]
        # Lanes on the kept worker threads (``workers``), each taking the next call until
        # none is left: a pool of threads made and joined per pass cost a pass of ten
        # quick calls some 6 ms, twenty times the calls themselves (#27).
        for _ in range(self._lanes):
            workers.run(self._lane, "events-ledger:calls")

    def stop(self) -> None:
        """Start no more calls; the running ones go on."""
        self._stopped = True

    def _next(self) -> int | None:
        with self._lock:
            if self._stopped or (self._should_stop is not None and self._should_stop()):
                return None
            return next(self._todo, None)

    def _lane(self) -> None:
        try:
            while (i := self._next()) is not None:
                try:
                    self.answers[i] = self._contexts[i].run(self._calls[i])
                except BaseException as exc:  # raised by ``wait``, once every call has ended
                    self._raised[i] = exc
                finally:
                    # A call's deadline may have killed sessions from this connection.
                    _close_connections()
        finally:
            with self._lock:
                self._lanes -= 1
                last = self._lanes == 0
                then = list(self._then) if last else []
                if last:
                    self.done.set()
            for fn in then:
                _safely(fn)

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once every started call has ended: in the last call's thread, or in
        a thread of its own if that has already happened."""
        with self._lock:
            if not self.done.is_set():
                self._then.append(fn)
                return
        threading.Thread(target=_safely, args=(fn,), name="events-ledger:then", daemon=True).start()

    def wait(self) -> list[Any]:
        self.done.wait()
        for exc in self._raised:
            if exc is not None:
                raise exc
        return self.answers


def _safely(fn: Callable[[], None]) -> None:
    try:
        fn()
    except BaseException:
        logger.exception("handing on the answers of module calls failed")


def call_all(
    calls: Sequence[Callable[[], T]],
    width: int,
    *,
    should_stop: Callable[[], bool] | None = None,
) -> list[T | None]:
    """``Calls(...).wait()``: make ``calls``, ``width`` at a time, and answer their results."""
    return Calls(calls, width, should_stop=should_stop).wait()


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
