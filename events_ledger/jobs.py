"""The work a task queue does for the ledger, as plain functions answering JSON.

``events_ledger.tasks`` (Django Tasks) and ``events_ledger.celery`` (Celery) wrap these
and nothing else, so the two queues do exactly the same work. Arguments and answers are
ids, strings and JSON mappings: a broker carries no model instance.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta
from typing import Any

from django.db import close_old_connections

#: Times a run whose step another call holds is sent again, before it is left to the host
#: (it stays ``running``; the health check reports it once its rows grow old).
BUSY_RETRIES = 100


def busy_retry_delay() -> float:
    """Seconds before a ``busy`` run is tried again: a quarter of ``STEP_CLAIM_TTL``
    (between 1 s and a minute). A claim held by a dead worker goes stale after the TTL,
    so a few tries per TTL find it soon after, and none hammer it before."""
    from .conf import ledger_settings

    ttl = ledger_settings.STEP_CLAIM_TTL
    return min(max(ttl / 4, timedelta(seconds=1)), timedelta(minutes=1)).total_seconds()


#: The most runs one sweep task may ask for: a message on the broker is not trusted to
#: size a pass (its claims, its id lists, its time).
MAX_SWEEP_LIMIT = 1000


def bounded_int(name: str, value: Any, low: int, high: int) -> int:
    """A task argument as an int within ``low..high``, or a ValueError naming it: every
    argument comes from a broker, which anyone who can publish to it writes."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low} to {high}, not {value!r}")
    return value


def _fresh_connection() -> None:
    # A worker lives for days between tasks: a connection the server closed meanwhile
    # ("server has gone away") is dropped here instead of failing the task's first query.
    close_old_connections()


def execute_one_step(step_id: int) -> dict[str, Any]:
    """W5 through ``execute_step``: one step, answered as ``StepResult`` reads."""
    from .ledger import execute_step

    _fresh_connection()
    try:
        return asdict(execute_step(int(step_id)))
    finally:
        _fresh_connection()


def run_run(run_id: int, on_refused: str = "fail") -> dict[str, Any]:
    """A run's steps in order, then its end (``runner.run_steps``)."""
    from .runner import ON_REFUSED, run_steps

    if on_refused not in ON_REFUSED:
        raise ValueError(f"on_refused must be one of {ON_REFUSED}, not {on_refused!r}")
    _fresh_connection()
    try:
        report = run_steps(int(run_id), on_refused=on_refused)  # type: ignore[arg-type]
    finally:
        _fresh_connection()
    out = asdict(report)
    out["finished"] = report.finished
    return out


def sweep_once(limit: int | None = None, scope: str | None = None) -> dict[str, Any]:
    """C5: one sweep pass, summed up (the cron's leg, run by a periodic task); with
    ``scope``, over that scope's runs only."""
    from .cleanup import sweep

    if limit is not None:
        limit = bounded_int("limit", limit, 1, MAX_SWEEP_LIMIT)
    if scope is not None and not isinstance(scope, str):
        raise ValueError(f"scope must be a string, not {type(scope).__name__}")
    _fresh_connection()
    try:
        report = sweep(limit, scope=scope)
    finally:
        _fresh_connection()
    return {
        "runs": len(report.runs),
        "reverted": sum(s.reverted for s in report.runs),
        "remaining": sum(s.remaining for s in report.runs),
        "errors": {str(k): v for k, v in report.errors.items()},
        "repaired": report.repaired,
        "incomplete": report.incomplete,
        # A task that ran is green in a queue's console: this says what cleanup_runs' exit
        # status 1 says, so a result backend's reader (or a chained task) can page.
        "needs_a_human": bool(report.incomplete or report.errors),
    }


#: Why a queue never forces a reconcile (#25).
FORCE_REFUSED = (
    "a reconcile is never forced from a task queue (anyone who can publish to the broker "
    "could send it): the orphan bound (RECONCILE_MAX_ORPHAN_FRACTION) holds, as in the "
    "console; a human forces it with manage.py reconcile_resources --force"
)


def reconcile_once(owner: str | None = None, force: bool = False) -> dict[str, Any]:
    """C6: one module (``owner``), or every module with live rows; never forced (#25):
    ``force`` is refused, so a message from the broker cannot skip the orphan bound."""
    from .cleanup import reconcile_all, reconcile_module

    if force is not False:
        raise ValueError(FORCE_REFUSED)
    _fresh_connection()
    try:
        if owner:
            return {owner: reconcile_module(owner).as_dict()}
        return {name: s.as_dict() for name, s in reconcile_all().items()}
    finally:
        _fresh_connection()


#: The longest a task may ask history to be kept (a cut-off a century back).
LONGEST_KEPT = timedelta(days=36525)

#: Why a task names no archive.
ARCHIVE_REFUSED = (
    "a prune from a task queue archives to EVENTS_LEDGER['ARCHIVE'], never to a path a "
    "message names (anyone who can publish to the broker could name any file the worker "
    "can write); a human chooses another with manage.py prune_ledger --archive"
)


def prune_once(
    older_than: float | None = None, batch: int | None = None, archive: str | None = None
) -> dict[str, Any]:
    """#28: one prune of the history, beside the sweep; nothing when ``RETENTION`` is not
    set (history kept for ever). A message may keep runs longer (``older_than`` in
    seconds, at least ``RETENTION``), never shorter, and names no archive: the archive is
    ``ARCHIVE``'s."""
    from .conf import ledger_settings
    from .retention import DEFAULT_BATCH, MAX_BATCH, prune

    if archive is not None:
        raise ValueError(ARCHIVE_REFUSED)
    keep = ledger_settings.RETENTION
    if keep is None:
        return {"kept_for_ever": True, "runs": 0}
    if older_than is not None:
        if isinstance(older_than, bool) or not isinstance(older_than, (int, float)):
            raise ValueError(f"older_than must be a number of seconds, not {older_than!r}")
        if not keep.total_seconds() <= older_than <= LONGEST_KEPT.total_seconds():
            raise ValueError(
                f"older_than must be at least RETENTION ({keep.total_seconds():g} s): a "
                f"task may keep history longer, never shorter, not {older_than!r}"
            )
        keep = timedelta(seconds=float(older_than))
    size = DEFAULT_BATCH if batch is None else bounded_int("batch", batch, 1, MAX_BATCH)
    _fresh_connection()
    try:
        report = prune(older_than=keep, batch=size, archive=ledger_settings.ARCHIVE)
    finally:
        _fresh_connection()
    return report.as_dict()
