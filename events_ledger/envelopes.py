"""Reading a module's answers defensively: no shape of failure may read as success.

The one place that reads what a module answers: ``perform`` and a lease's ``apply``
(``classify_perform``), ``revert`` and ``restore`` (``classify_revert``), ``reconcile``
(``read_reconcile``), the resources an answer reports (``normalise``,
``read_resources``) and a lease's ``until`` (``parse_until``). The write half, the undo
half and the contract kit only call it, so the kit checks a module against the very
reading the ledger applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from .deadline import CallResult
from .registry import default_registry
from .states import STEP_KIND

#: ``overdue``: a revert or restore outlived its budget and still runs; there is no
#: verdict yet, and its rows stay claimed (kept fresh) until its answer is written.
Outcome = Literal["done", "retry", "terminal", "drifted", "overdue"]

MAX_KIND = 64
MAX_REF = 190
MAX_MEMBER_KEY = 190


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
    """What an answer means: for a revert or restore, for the rows it covers; for a
    perform or an apply that did not succeed, whether to try again (``retry``) or not
    (``terminal``)."""

    outcome: Outcome
    error: str | None = None
    failed: list[str] = field(default_factory=list)


def _raw(call: CallResult | Any) -> tuple[Any, Verdict | None]:
    """The answer inside a call, or the verdict of a call that gave none (C1: a
    timeout or an exception is retried)."""
    if isinstance(call, CallResult):
        if call.timed_out or call.error is not None:
            return None, Verdict("retry", call.message)
        return call.value, None
    return call, None


def _not_confirmed(raw: Any, what: str) -> Verdict:
    """An answer that is not ``ok: True``: retried, unless it says ``retry: False``."""
    if not isinstance(raw, dict):
        return Verdict("retry", f"{what} answered with no envelope: {describe(raw)}")
    error = raw.get("error")
    message = str(error) if error not in (None, "") else f"{what} did not confirm: {describe(raw)}"
    return Verdict("terminal" if raw.get("retry") is False else "retry", message)


def classify_revert(call: CallResult | Any, what: str) -> Verdict:
    """C1: a timeout → retry; no mapping → retry ("no envelope"); ``ok: True`` → done
    (with an optional ``failed`` list of refs); ``drifted: True`` → drifted (not an
    error: somebody else's value is in place and is left alone); otherwise retry, or
    terminal when the answer says ``retry: False``.

    Takes either a ``CallResult`` from the deadline or the raw answer.
    """
    raw, unanswered = _raw(call)
    if unanswered is not None:
        return unanswered
    if isinstance(raw, dict) and raw.get("ok") is True:
        failed = raw.get("failed")
        refs = [str(r) for r in failed] if isinstance(failed, (list, tuple)) else []
        return Verdict("done", failed=refs)
    if isinstance(raw, dict) and raw.get("drifted") is True:
        return Verdict(
            "drifted",
            f"the value is now {describe(raw.get('current'))}, not what this run applied, "
            "so it was left alone",
        )
    return _not_confirmed(raw, what)


def classify_perform(call: CallResult | Any, what: str) -> Verdict:
    """W5: a ``perform`` (or a lease's ``apply``) answer. Only ``ok: True`` is done (its
    resources are read apart, by ``read_resources``); a timeout, an exception or any
    other shape is retried, unless the answer says ``retry: False`` (terminal). A
    ``drifted`` answer means nothing here: it did not confirm."""
    raw, unanswered = _raw(call)
    if unanswered is not None:
        return unanswered
    if is_success(raw):
        return Verdict("done")
    return _not_confirmed(raw, what)


@dataclass(frozen=True)
class ReconcileAnswer:
    """C4: the refs a ``reconcile`` says are in force, or why its answer is unanswered."""

    in_force: frozenset[str] | None
    error: str | None = None

    @property
    def answered(self) -> bool:
        return self.in_force is not None


def read_reconcile(call: CallResult | Any, what: str) -> ReconcileAnswer:
    """C4: only ``{"ok": True, "in_force": [refs]}`` is an answer, each ref a string
    (or a number, compared as its text). Anything else, a timeout and an exception are
    "unanswered": the rows are left alone, since an entry that names no row would
    otherwise read as "not in force" and orphan a live resource."""
    raw, unanswered = _raw(call)
    if unanswered is not None:
        return ReconcileAnswer(None, unanswered.error)
    in_force = raw.get("in_force") if isinstance(raw, dict) else None
    if not is_success(raw) or not isinstance(in_force, list):
        return ReconcileAnswer(
            None, f'{what} answered {describe(raw)}, not {{"ok": true, "in_force": [refs]}}'
        )
    bad = [ref for ref in in_force if isinstance(ref, bool) or not isinstance(ref, (str, int))]
    if bad:
        return ReconcileAnswer(
            None,
            f"{what} listed {describe(bad)} in in_force: each entry must be a ref (a string), "
            "as the ledger compares it with its rows' refs",
        )
    return ReconcileAnswer(frozenset(str(ref) for ref in in_force))


# ── W1: the resources an answer reports ──


@dataclass(frozen=True)
class Normalised:
    ok: bool
    row: dict[str, Any] | None = None
    reason: str | None = None


def _refuse(action_id: str, why: str) -> Normalised:
    return Normalised(ok=False, reason=f"{action_id} reported a resource {why}")


def as_text(value: Any) -> str:
    """A module's value as text; None is empty (refused as a kind or ref)."""
    return "" if value is None else str(value)


def normalise(entry: Any, action_id: str) -> Normalised:
    """W1: one reported resource → a row, or the reason it is refused.

    Every refusal is the module's mistake, not the world's, so none is retried. Nothing
    is ever cut to fit: a truncated ref names the wrong object.
    """
    if not isinstance(entry, dict):
        return _refuse(action_id, f"that is not a mapping: {describe(entry, 60)}")
    kind, ref = as_text(entry.get("kind")), as_text(entry.get("ref"))
    if not kind or len(kind) > MAX_KIND:
        return _refuse(action_id, f"with a bad kind {describe(entry.get('kind'), 80)}")
    if kind == STEP_KIND:
        # The app's own: a module that could write one could make its own step look resolved.
        return _refuse(action_id, f"of the reserved kind {kind!r}")
    if not ref or len(ref) > MAX_REF:
        return _refuse(
            action_id, f"with a bad ref {describe(entry.get('ref'), 80)} (1–{MAX_REF} characters)"
        )
    if "\x00" in kind or "\x00" in ref or not _utf8(kind) or not _utf8(ref):
        return _refuse(action_id, "with a NUL or a lone surrogate in its kind or ref")
    member_key = entry.get("member_key", entry.get("memberKey"))
    member_key = None if member_key is None else str(member_key)
    if member_key is not None and len(member_key) > MAX_MEMBER_KEY:
        return _refuse(action_id, f"with a member_key over {MAX_MEMBER_KEY} characters")
    if member_key is not None and ("\x00" in member_key or not _utf8(member_key)):
        return _refuse(action_id, "with a NUL or a lone surrogate in its member_key")
    until = entry.get("until")
    lease_until: datetime | None = None
    if until is not None:
        lease_until = parse_until(until)
        if lease_until is None:
            return _refuse(action_id, f"with a bad until {describe(until, 60)}")
    if kind == "override" and default_registry.lease_for_ref(ref) is None:
        # The ledger gives an override back through the lease registry; a ref naming
        # no lease is a promise to undo something it has no way to undo.
        return _refuse(action_id, f"naming the lease {ref!r}, which no module registers")
    payload = entry.get("payload")
    try:
        if payload is not None:
            check_json(payload)
    except (TypeError, ValueError) as exc:
        return _refuse(action_id, f"with a payload that is not JSON ({exc})")
    return Normalised(
        ok=True,
        row={
            "kind": kind,
            "ref": ref,
            "payload": payload,
            "lease_until": lease_until,
            "member_key": member_key,
        },
    )


def parse_until(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        parsed: datetime | None = value
    elif isinstance(value, str):
        try:
            parsed = parse_datetime(value.strip())
        except ValueError:
            return None
    else:
        return None
    if parsed is None:
        return None
    if timezone.is_naive(parsed):
        parsed = timezone.make_aware(parsed, UTC)
    try:
        # The databases store years 1–9999 only; a value outside is not a date for us.
        parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        return None
    return parsed


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_json(payload: Any) -> None:
    """Raise ``TypeError``/``ValueError`` unless every backend can store ``payload``."""
    json.dumps(payload, cls=DjangoJSONEncoder, allow_nan=False)
    # What one backend stores and another refuses is refused for all: PostgreSQL's
    # jsonb has no NUL, and no backend stores a lone surrogate.
    if not _storable_strings(payload):
        raise ValueError("it holds a NUL or a lone surrogate")


def _storable_strings(value: Any, depth: int = 0) -> bool:
    if isinstance(value, str):
        return "\x00" not in value and _utf8(value)
    if depth > 100:
        return True  # json.dumps has already refused anything circular
    if isinstance(value, dict):
        return all(
            _storable_strings(k, depth + 1) and _storable_strings(v, depth + 1)
            for k, v in value.items()
        )
    if isinstance(value, (list, tuple)):
        return all(_storable_strings(v, depth + 1) for v in value)
    return True


@dataclass
class Resources:
    """An answer's resources as W1 reads them: rows by (kind, ref), first one kept, and
    the reason each refused entry was refused."""

    rows: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)


def read_resources(resources: Any, action_id: str) -> Resources:
    """W1 over a whole answer's ``resources``: ``None`` is none; anything but a list is
    refused as a whole, since a ``ledger`` action's answer is the only record of what
    it made."""
    out = Resources()
    if resources is None:
        entries: list[Any] = []
    elif isinstance(resources, (list, tuple)):
        entries = list(resources)
    else:
        entries = []
        out.rejected.append(
            f"{action_id} reported resources that are not a list: {describe(resources, 60)}"
        )
    for entry in entries:
        parsed = normalise(entry, action_id)
        if not parsed.ok:
            out.rejected.append(parsed.reason or "")
            continue
        assert parsed.row is not None
        out.rows.setdefault((parsed.row["kind"], parsed.row["ref"]), parsed.row)
    return out
