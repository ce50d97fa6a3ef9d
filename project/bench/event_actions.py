"""The bench's no-op, found by events_ledger when Django starts: the same call ledgered
(``events_ledger.step``) and bare (``bench.bare_noop``), to price the ledger per step."""

from events_ledger import Action, register_action

from .noop import noop, noop_revert

register_action(
    Action(
        id="bench.noop",
        owner="bench",
        reversible="ledger",
        perform=noop,
        budget_ms=2_000,
        revert=noop_revert,
        description="does nothing (the Celery bench's step)",
    )
)
