"""What this process keeps doing in the background: one keeper for every claim it holds.

A module call abandoned at its deadline goes on in its thread and may change the world
later; a pass's calls may take longer, together, than a claim's TTL; a pass's verdicts may
have to wait for the database. In each case the claim must say the truth while this
process still holds the call or its answer: nobody may take it for a dead process's and
call the module a second time (a second object, a second give-back). So one daemon thread
re-stamps the claims of step calls (``STEP_CLAIM_TTL``) and of rows being given back
(``REVERT_CLAIM_TTL``) every quarter of the shorter TTL, and does the chores that wait for
the database (verdicts in hand). A process that dies stops stamping, and its claims go
stale after the TTL: then, and only then, nothing of it can still run.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable

from django.core.signals import setting_changed
from django.db import connections

from .conf import ledger_settings

logger = logging.getLogger("events_ledger")

_MIN_BEAT_S = 0.05


def process_name() -> str:
    """Where a claim's call runs: what an operator needs to find the process."""
    return f"{socket.gethostname()}:{os.getpid()}"[:128]


class ClaimKeeper:
    """Keeps this process's claims fresh, in one daemon thread: step claims while their
    call runs, revert claims while their calls run or their verdicts wait to be written."""

    def __init__(self) -> None:
        self.reset_after_fork()
        #: Called at every beat (after the claims are stamped): work that waits for the
        #: database, such as verdicts in hand. Registered once, kept across forks.
        self.chores: list[Callable[[], None]] = []

    def reset_after_fork(self) -> None:
        # A forked child inherits no running calls and no threads; a lock another
        # thread held at the fork would stay held for ever (``hold`` would hang).
        self._lock = threading.Lock()
        self._tokens: dict[str, int] = {}
        self._reverts: Counter[str] = Counter()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._chore: threading.Thread | None = None
        self._chores_due = False
        self._pid = os.getpid()

    def _started(self) -> None:
        # Under ``self._lock``.
        if self._pid != os.getpid():  # a forked worker inherits no running calls
            self._tokens, self._reverts, self._thread = {}, Counter(), None
            self._pid = os.getpid()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="events-ledger:claim-keeper", daemon=True
            )
            self._thread.start()

    def hold(self, token: str, step_id: int) -> None:
        """A call of the step under this claim has started; keep the claim fresh."""
        with self._lock:
            self._started()
            self._tokens[token] = step_id

    def release(self, token: str) -> None:
        """The call has ended (its outcome is written): stop stamping its claim."""
        with self._lock:
            self._tokens.pop(token, None)

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._tokens)

    def hold_revert(self, token: str) -> None:
        """Rows claimed under ``token`` are being given back, or their verdicts wait to be
        written: keep them fresh until every holder let go (a pass, each overdue call)."""
        with self._lock:
            self._started()
            self._reverts[token] += 1

    def release_revert(self, token: str) -> None:
        with self._lock:
            self._reverts[token] -= 1
            if self._reverts[token] <= 0:
                del self._reverts[token]

    def reverts_held(self) -> list[str]:
        with self._lock:
            return sorted(self._reverts)

    def wake(self) -> None:
        """Beat now (a verdict is ready to be written)."""
        self._wake.set()

    def forget_all(self) -> None:
        """Stop stamping every claim (a test's teardown: the next test has other tables)."""
        with self._lock:
            self._tokens, self._reverts = {}, Counter()

    def _interval(self) -> float:
        try:
            ttl = min(ledger_settings.STEP_CLAIM_TTL, ledger_settings.REVERT_CLAIM_TTL)
            return max(ttl.total_seconds() / 4, _MIN_BEAT_S)
        except Exception:  # a bad setting is reported by the checks; keep stamping
            return 60.0

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval())
            self._wake.clear()
            try:
                self.beat()
            finally:
                # A connection per beat, not one held for the process's life: between beats
                # (a quarter of the TTL) it would sit idle as a session of its own, which
                # a database restart breaks and a test database's teardown waits on.
                try:
                    connections.close_all()
                except Exception:
                    logger.debug("closing the keeper's connection failed", exc_info=True)

    def beat(self) -> None:
        steps, reverts = list(self.held()), self.reverts_held()
        try:
            from .db import statements_retried
            from .models import EventRunResource, EventRunStep

            with statements_retried():
                if steps:
                    EventRunStep.objects.refresh_claims(steps)
                if reverts:
                    EventRunResource.objects.refresh_claims(reverts)
        except Exception:
            # The next beat tries again on a new connection; a claim that goes stale
            # meanwhile is the same as a dead process's, which the TTL is there for.
            logger.warning("could not refresh the claims this process holds", exc_info=True)
        # The chores in a thread of their own: a verdict write may wait on locks for a
        # while, and the claims must be stamped on time all the same. A beat while the
        # chores run is not lost: they run once more (a late answer kept while the last
        # one was being written waited a whole beat, a quarter of the TTL).
        if not self.chores:
            return
        with self._lock:
            self._chores_due = True
            if self._chore is not None:
                return
            self._chore = threading.Thread(
                target=self._do_chores, name="events-ledger:chores", daemon=True
            )
            self._chore.start()

    def _do_chores(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._chores_due:
                        self._chore = None
                        return
                    self._chores_due = False
                for chore in list(self.chores):
                    try:
                        chore()
                    except Exception:
                        logger.warning(
                            "a background chore failed; the next beat tries again", exc_info=True
                        )
        except BaseException:
            with self._lock:
                self._chore = None
            raise
        finally:
            try:
                connections.close_all()
            except Exception:
                logger.debug("closing the chores' connection failed", exc_info=True)


keeper = ClaimKeeper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=keeper.reset_after_fork)


def _ttl_changed(setting: str, **kwargs: object) -> None:
    # A TTL shortened at run time (a test's settings) must not wait out the old interval.
    if setting == "EVENTS_LEDGER":
        keeper.wake()


setting_changed.connect(_ttl_changed, dispatch_uid="events_ledger.background")
