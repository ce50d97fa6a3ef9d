"""The ledger's vocabulary of states: one set of enums, used by the models, their SQL,
the services, the admin and the templates. Nothing here imports the rest of the app.

Members are ``str`` (``TextChoices``), so a status read from the database compares equal
to its member and either may be written. The tuples below hold plain strings: they go
into the schema (``live_marker``'s expression, the indexes' conditions), whose
migrations must not change when the enums do.
"""

from __future__ import annotations

from django.db import models


class RunStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    MISSED = "missed"


class CleanupStatus(models.TextChoices):
    #: Nothing was ever ledgered for the run.
    NOT_REQUIRED = "not_required", "Not required"  # #25: as the others read ("Pending")
    #: Something is (or may be) left to give back: the sweep will work the run.
    PENDING = "pending"
    #: Everything was given back (or never needed to be).
    COMPLETE = "complete"
    #: A row is spent (attempts or claims) or released unclean: it waits for a human.
    INCOMPLETE = "incomplete"


def status_label(value: str) -> str:
    """A status as the console shows it (#25): one capital, words apart, as the choices'
    labels and the list filters read ("Pending", "Not required", "In flight")."""
    return value.replace("_", " ").capitalize()


class StepStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    REFUSED = "refused"


class ResourceStatus(models.TextChoices):
    PENDING = "pending"
    CONFIRMED = "confirmed"
    REVERTING = "reverting"
    REVERTED = "reverted"
    ORPHANED = "orphaned"
    DRIFTED = "drifted"
    #: An operator resolved it by hand, without a call (kept the other value, checked
    #: it is gone): released and resolved, with who and why on the run's log.
    RESOLVED = "resolved"


#: The one ``kind`` the app owns: a step in flight, keyed by its idempotency key.
STEP_KIND = "@step"

#: Row statuses in which the ledger still believes the target is this run's. Exactly
#: the ones ``live_marker`` keeps non-NULL, so the unique key holds while a row is in
#: one of them and releases when it leaves.
HELD = (
    ResourceStatus.PENDING.value,
    ResourceStatus.CONFIRMED.value,
    ResourceStatus.REVERTING.value,
)
#: The two ways of letting go of a target that were not clean: still unresolved.
RELEASED_UNCLEAN = (ResourceStatus.ORPHANED.value, ResourceStatus.DRIFTED.value)
#: Everything that still wants a retry or a human.
UNRESOLVED = (*HELD, *RELEASED_UNCLEAN)
#: What an operator may resolve by hand: every unresolved status but ``reverting``,
#: which only a stale claim makes resolvable (a call may still be giving it back).
RESOLVABLE = (
    ResourceStatus.PENDING.value,
    ResourceStatus.CONFIRMED.value,
    *RELEASED_UNCLEAN,
)
#: Rows that owe nothing any more: given back, or resolved by an operator.
RESOLVED_FOR_GOOD = (ResourceStatus.REVERTED.value, ResourceStatus.RESOLVED.value)
#: The rows reconcile asks about.
LIVE = (ResourceStatus.PENDING.value, ResourceStatus.CONFIRMED.value)

RUN_TERMINAL = (
    RunStatus.COMPLETED.value,
    RunStatus.CANCELLED.value,
    RunStatus.FAILED.value,
    RunStatus.MISSED.value,
)

#: Every run status and every cleanup status, as the database's check constraints hold
#: them (plain strings: the schema does not follow the enums).
RUN_STATUSES = (
    RunStatus.PENDING.value,
    RunStatus.RUNNING.value,
    *RUN_TERMINAL,
)
CLEANUP_STATUSES = (
    CleanupStatus.NOT_REQUIRED.value,
    CleanupStatus.PENDING.value,
    CleanupStatus.COMPLETE.value,
    CleanupStatus.INCOMPLETE.value,
)

#: The run's state machine: where each status may go. A pending run may start; a run
#: that has not ended may end in any terminal status (a run with nothing to do
#: completes; a scheduler may mark one missed after its window whatever it reached). A
#: terminal status goes nowhere: a run that ended was cleaned up as ended, and reopened
#: it would grow a ledger no sweep looks at while it runs.
RUN_MOVES: dict[str, tuple[str, ...]] = {
    RunStatus.PENDING.value: (RunStatus.RUNNING.value, *RUN_TERMINAL),
    RunStatus.RUNNING.value: RUN_TERMINAL,
    **{status: () for status in RUN_TERMINAL},
}


class InvalidTransition(ValueError):
    """A run's status was asked to move where the state machine does not go, or to or
    from a word that is no run status (``"complete"`` is a cleanup status, not a run's).
    Raised before anything is written."""


def check_run_move(to: str, sources: tuple[str, ...]) -> None:
    """Raise ``InvalidTransition`` unless every move ``source → to`` is in ``RUN_MOVES``."""
    words = [w for w in (to, *sources) if w not in RUN_MOVES]
    if words:
        raise InvalidTransition(
            f"{', '.join(map(repr, words))} is no run status (the run statuses: "
            f"{', '.join(RUN_STATUSES)})"
        )
    refused = [source for source in sources if to not in RUN_MOVES[source]]
    if refused:
        moves = ", ".join(f"{source} → {to}" for source in refused)
        raise InvalidTransition(
            f"a run does not move {moves} (a terminal status is final; from pending: "
            f"{', '.join(RUN_MOVES['pending'])}; from running: "
            f"{', '.join(RUN_MOVES['running'])})"
        )
