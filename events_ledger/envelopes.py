"""Reading a module's answers defensively: no shape of failure may read as success."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from .deadline import CallResult

Outcome = Literal["done", "retry", "terminal", "drifted"]


def is_success(answer: Any) -> bool:
    # `== True` would accept 1 and 1.0; only the literal True is success.
    return isinstance(answer, dict) and answer.get("ok") is True


def describe(value: Any, limit: int = 120) -> str:
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class Verdict:
    """What a revert (or restore) answer means for the rows it covers."""

    outcome: Outcome
    error: str | None = None
    failed: list[str] = field(default_factory=list)


def classify_revert(call: CallResult | Any, what: str) -> Verdict:
    """C1: a timeout → retry; no mapping → retry ("no envelope"); ``ok: True`` → done
    (with an optional ``failed`` list of refs); ``drifted: True`` → drifted (not an
    error: somebody else's value is in place and is left alone); otherwise retry, or
    terminal when the answer says ``retry: False``.

    Takes either a ``CallResult`` from the deadline or the raw answer.
    """
    if isinstance(call, CallResult):
        if call.timed_out or call.error is not None:
            return Verdict("retry", call.message)
        raw = call.value
    else:
        raw = call
    if not isinstance(raw, dict):
        return Verdict("retry", f"{what} answered with no envelope: {describe(raw)}")
    if raw.get("ok") is True:
        failed = raw.get("failed")
        refs = [str(r) for r in failed] if isinstance(failed, (list, tuple)) else []
        return Verdict("done", failed=refs)
    if raw.get("drifted") is True:
        return Verdict(
            "drifted",
            f"the value is now {describe(raw.get('current'))}, not what this run applied, "
            "so it was left alone",
        )
    error = raw.get("error")
    message = str(error) if error not in (None, "") else f"{what} did not confirm: {describe(raw)}"
    return Verdict("terminal" if raw.get("retry") is False else "retry", message)
