"""Steps in flight: a step's claim stays fresh for as long as a call of it can still run.

A ``perform`` abandoned at its deadline goes on in its thread and may change the world
later. While it lives, no second call of the step may start (a retry would make a
second object) and cleanup may not give the step back (it would give back by key
before the object exists). Both read the step's claim, so the claim must say the truth:
this process re-stamps ``claimed_at`` of every call it still runs, every quarter of
``STEP_CLAIM_TTL``, and stops when the call ends. A process that dies stops stamping,
and its claims go stale after the TTL: then, and only then, nothing of it can still run.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from django.db import connections

from .conf import ledger_settings

logger = logging.getLogger("events_ledger")

_MIN_BEAT_S = 0.05


def process_name() -> str:
    """Where a claim's call runs: what an operator needs to find the process."""
    return f"{socket.gethostname()}:{os.getpid()}"[:128]


class ClaimKeeper:
    """Keeps the claims of this process's running step calls fresh, in one daemon thread."""

    def __init__(self) -> None:
        self.reset_after_fork()

    def reset_after_fork(self) -> None:
        # A forked child inherits no running calls and no threads; a lock another
        # thread held at the fork would stay held for ever (``hold`` would hang).
        self._lock = threading.Lock()
        self._tokens: dict[str, int] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def hold(self, token: str, step_id: int) -> None:
        """A call of the step under this claim has started; keep the claim fresh."""
        with self._lock:
            if self._pid != os.getpid():  # a forked worker inherits no running calls
                self._tokens, self._thread, self._pid = {}, None, os.getpid()
            self._tokens[token] = step_id
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="events-ledger:claim-keeper", daemon=True
                )
                self._thread.start()

    def release(self, token: str) -> None:
        """The call has ended (its outcome is written): stop stamping its claim."""
        with self._lock:
            self._tokens.pop(token, None)

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._tokens)

    def _run(self) -> None:
        while True:
            try:
                interval = ledger_settings.STEP_CLAIM_TTL.total_seconds() / 4
            except Exception:  # a bad setting is reported by the checks; keep stamping
                interval = 60.0
            self._wake.wait(max(interval, _MIN_BEAT_S))
            tokens = list(self.held())
            if not tokens:
                continue
            try:
                from .db import statements_retried
                from .models import EventRunStep

                with statements_retried():
                    EventRunStep.objects.refresh_claims(tokens)
            except Exception:
                # The next beat tries again on a new connection; a claim that goes stale
                # meanwhile is the same as a dead process's, which the TTL is there for.
                logger.warning("could not refresh the claims of steps in flight", exc_info=True)
            finally:
                # A connection per beat, not one held for the process's life: between beats
                # (a quarter of the TTL) it would sit idle as a session of its own, which
                # a database restart breaks and a test database's teardown waits on.
                try:
                    connections.close_all()
                except Exception:
                    logger.debug("closing the keeper's connection failed", exc_info=True)


keeper = ClaimKeeper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=keeper.reset_after_fork)
