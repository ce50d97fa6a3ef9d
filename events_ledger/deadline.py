"""Bounding a module's call: control comes back after its budget, whatever it does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connections


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


def call_with_deadline(fn: Callable[[], Any], budget_s: float, what: str) -> CallResult:
    """Call ``fn`` in a daemon thread and wait at most ``budget_s`` seconds.

    Python cannot kill a thread: a call abandoned at its deadline may still change
    the world later, which is exactly why a step's placeholder stays pending then.
    The thread is a daemon so a hung call never blocks process exit, and it closes
    its own database connections when it ends so none is left open behind it.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # a module may raise anything; it is an answer
            box["error"] = exc
        finally:
            connections.close_all()

    worker = threading.Thread(target=target, name=f"events-ledger:{what}", daemon=True)
    worker.start()
    worker.join(budget_s)
    if worker.is_alive():
        return CallResult(timed_out=True, what=what, budget_s=budget_s)
    return CallResult(
        value=box.get("value"), error=box.get("error"), what=what, budget_s=budget_s
    )
