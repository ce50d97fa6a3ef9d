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
#: The rows reconcile asks about.
LIVE = (ResourceStatus.PENDING.value, ResourceStatus.CONFIRMED.value)

RUN_TERMINAL = (
    RunStatus.COMPLETED.value,
    RunStatus.CANCELLED.value,
    RunStatus.FAILED.value,
    RunStatus.MISSED.value,
)
