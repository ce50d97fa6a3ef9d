"""Log records with context: every record of the app carries run_id, step_id, action, owner.

The services bind what they work on (a step, a run, a group of rows, a module) to the
current context; a filter on the app's logger copies it onto each record as attributes,
as ``extra=`` would, so a JSON handler gets them as fields and a format string can name
them. A field that is not known where the record is logged is None, never missing.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

#: The fields every record of the app carries (#15).
FIELDS = ("run_id", "step_id", "action", "owner")
LOGGER = "events_ledger"

_EMPTY: MappingProxyType[str, Any] = MappingProxyType({})
_context: contextvars.ContextVar[MappingProxyType[str, Any]] = contextvars.ContextVar(
    "events_ledger_log_context", default=_EMPTY
)


def current() -> dict[str, Any]:
    """The fields bound here, each of ``FIELDS`` (None where nothing is bound)."""
    bound = _context.get()
    return {name: bound.get(name) for name in FIELDS}


def _merged(fields: dict[str, Any]) -> MappingProxyType[str, Any]:
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown log context fields {sorted(unknown)}; known: {FIELDS}")
    return MappingProxyType({**_context.get(), **fields})


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Bind fields for the block; what the block binds more goes when it ends."""
    token = _context.set(_merged(fields))
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Add fields to the current block's context (up to the end of the enclosing
    ``log_context``); for what is known only half-way through it, such as a step's run."""
    _context.set(_merged(fields))


class LogContextFilter(logging.Filter):
    """Copies the bound fields onto each record that does not carry them already (an
    explicit ``extra=`` wins). Never drops a record. Attach it to a handler to give the
    host's own records (inside a module's ``perform``, say) the same fields."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _context.get()
        for name in FIELDS:
            if not hasattr(record, name):
                setattr(record, name, bound.get(name))
        return True


def install() -> None:
    """Put the filter on the app's logger, once. Every module of the app logs through
    ``logging.getLogger("events_ledger")`` itself, where a logger's filters apply."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, LogContextFilter) for f in logger.filters):
        logger.addFilter(LogContextFilter())
