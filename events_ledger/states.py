"""The ledger's vocabulary of states, shared by the models and their SQL."""

from __future__ import annotations

#: The one ``kind`` the app owns: a step in flight, keyed by its idempotency key.
STEP_KIND = "@step"

#: Row statuses in which the ledger still believes the target is this run's. Exactly
#: the ones ``live_marker`` keeps non-NULL, so the unique key holds while a row is in
#: one of them and releases when it leaves.
HELD = ("pending", "confirmed", "reverting")
#: Everything that still wants a retry or a human: held, plus the two ways of letting
#: go that were not clean.
UNRESOLVED = (*HELD, "orphaned", "drifted")
#: The rows reconcile asks about.
LIVE = ("pending", "confirmed")

RUN_TERMINAL = ("completed", "cancelled", "failed", "missed")
