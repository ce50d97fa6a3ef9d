"""The four tables of the ledger: runs, their steps, what they changed, and their log."""

from __future__ import annotations

import uuid
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import Case, Q, Value, When
from django.db.models.expressions import DatabaseDefault
from django.utils import timezone

from .db import KeyCharField, LedgerManager, LedgerModel
from .querysets import (  # noqa: I001
    EventRunLogManager,
    EventRunQuerySet,
    EventRunResourceQuerySet,
    EventRunStepQuerySet,
)
from .states import (
    CLEANUP_STATUSES,
    HELD,
    LIVE,
    RUN_STATUSES,
    RUN_TERMINAL,
    STEP_KIND,
    UNRESOLVED,
    CleanupStatus,
    ResourceStatus,
    RunStatus,
    StepStatus,
)


def mint_idempotency_key() -> str:
    return uuid.uuid4().hex


class EventRun(LedgerModel):
    Status = RunStatus
    CleanupStatus = CleanupStatus

    TERMINAL = RUN_TERMINAL

    name = models.CharField(max_length=200)
    scope = models.CharField(max_length=200, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    cleanup_status = models.CharField(
        max_length=16, choices=CleanupStatus.choices, default=CleanupStatus.NOT_REQUIRED
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = LedgerManager.from_queryset(EventRunQuerySet)()

    class Meta:
        base_manager_name = "objects"
        verbose_name = "event run"
        indexes = [
            models.Index(fields=["cleanup_status", "status"], name="evrun_cleanup_idx"),
            models.Index(fields=["status"], name="evrun_status_idx"),
        ]
        # A status that is none (a typo, "complete" for "completed") strands a run: no
        # sweep ever looks at it. The database refuses it, whatever path writes it.
        constraints = [
            models.CheckConstraint(
                condition=models.Q(status__in=RUN_STATUSES), name="evrun_status_valid"
            ),
            models.CheckConstraint(
                condition=models.Q(cleanup_status__in=CLEANUP_STATUSES),
                name="evrun_cleanup_status_valid",
            ),
        ]
        permissions = [
            ("retry_cleanup", "Can retry the cleanup of a run (resets revert attempts)"),
            ("reconcile_resources", "Can reconcile a module's resources with its world"),
            ("end_run", "Can end a run that will not end by itself"),
            ("resolve_by_hand", "Can resolve a ledger row by hand, without calling its module"),
        ]

    def __str__(self) -> str:
        return f"run {self.pk} {self.name}"

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL


class EventRunStep(LedgerModel):
    Status = StepStatus

    run = models.ForeignKey(EventRun, on_delete=models.CASCADE, related_name="steps")
    phase = models.CharField(max_length=64, default="main")
    # C8: the phase's place in its run. Phases run in rank order and are given back in
    # reverse; a name compared as text would run "main" before "setup". Left unset, a
    # step takes its phase's rank in the run, or one past the run's last (``save``):
    # phases rank in the order they are first planned.
    phase_rank = models.PositiveIntegerField(db_default=0)
    seq = models.PositiveIntegerField(default=0)
    action_id = models.CharField(max_length=128)
    params = models.JSONField(default=dict, blank=True, encoder=DjangoJSONEncoder)
    # Minted once when the step is created and never changed across its retries: it
    # is how a module's half-done work is found again when its answer was lost.
    idempotency_key = models.CharField(
        max_length=64, unique=True, default=mint_idempotency_key, editable=False
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(null=True, blank=True)
    claim_token = models.CharField(max_length=32, null=True, blank=True, editable=False)
    # Kept fresh for as long as a call of the step can still change the world, also
    # after its deadline; stale only when the process holding it died (STEP_CLAIM_TTL).
    claimed_at = models.DateTimeField(null=True, blank=True)
    # Where the call runs (host:pid), so an operator can find the process cleanup waits for.
    claimed_by = models.CharField(max_length=128, null=True, blank=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = LedgerManager.from_queryset(EventRunStepQuerySet)()

    class Meta:
        base_manager_name = "objects"
        verbose_name = "event run step"
        ordering = ["run_id", "phase_rank", "phase", "seq", "id"]
        indexes = [
            models.Index(fields=["run", "status"], name="evstep_run_status_idx"),
            # The claim keeper re-stamps its claims by token.
            models.Index(fields=["claim_token"], name="evstep_claim_token_idx"),
            # #15: the steps in flight (metrics, health, dashboard) without reading every
            # step ever run.
            models.Index(fields=["status", "claimed_at"], name="evstep_status_claimed_idx"),
        ]

    def __str__(self) -> str:
        return f"step {self.pk} {self.action_id}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self._state.adding and isinstance(self.phase_rank, DatabaseDefault):
            self.phase_rank = EventRunStep.objects.rank_for(self.run_id, self.phase)
        super().save(*args, **kwargs)


class EventRunResource(LedgerModel):
    Status = ResourceStatus

    # PROTECT: a run cannot be deleted while the ledger remembers anything of it;
    # deleting it would be losing track of a resource by other means.
    # No index of its own: evres_run_status_rank_idx starts with the run and serves every
    # lookup by run (MariaDB's foreign key uses it too). On PostgreSQL every claim and
    # verdict, changing an indexed column, writes a new entry in each index of the row:
    # one index fewer made them an eighth cheaper (#26).
    run = models.ForeignKey(
        EventRun, on_delete=models.PROTECT, related_name="resources", db_index=False
    )
    # The row outlives its step: it still names the action through its payload.
    step = models.ForeignKey(
        EventRunStep,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="resources",
        db_constraint=True,
    )
    owner_module = KeyCharField(max_length=64)
    kind = KeyCharField(max_length=64)
    ref = KeyCharField(max_length=190)
    payload = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    lease_until = models.DateTimeField(null=True, blank=True)
    member_key = models.CharField(max_length=190, null=True, blank=True)
    # C8: the rank of the phase whose step made the row, copied when it is recorded, so
    # the claim orders a run's rows within this one table. NULL: the row stands alone
    # (its action or lease says so, it has no step, or it was recorded before #26),
    # given back whenever, never waiting for a later phase nor holding an earlier one.
    phase_rank = models.PositiveIntegerField(null=True, blank=True, editable=False)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    revert_attempts = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=500, null=True, blank=True)
    # A verdict is written only by the holder of the current claim (fenced verdicts).
    claim_token = models.CharField(max_length=32, null=True, blank=True, editable=False)
    # Claims taken without a verdict since the last one; not revert_attempts.
    claim_count = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    # R0: 1 while held, NULL once released, so the unique key below admits one held
    # row per target and any number of released ones. Stored: PostgreSQL has no other.
    live_marker = models.GeneratedField(
        expression=Case(
            When(Q(status__in=HELD), then=Value(1)),
            default=None,
            output_field=models.SmallIntegerField(null=True),
        ),
        output_field=models.SmallIntegerField(null=True),
        db_persist=True,
    )

    objects = LedgerManager.from_queryset(EventRunResourceQuerySet)()

    class Meta:
        base_manager_name = "objects"
        verbose_name = "event run resource"
        constraints = [
            models.UniqueConstraint(
                fields=["owner_module", "kind", "ref", "live_marker"], name="uq_evres_target"
            )
        ]
        indexes = [
            # for_run, unresolved_for_run, the counts (R4); the run list's annotation.
            # C8: whether a run holds an unresolved row of a later phase than k, a
            # range of it per status, empty in the common case.
            models.Index(fields=["run", "status", "phase_rank"], name="evres_run_status_rank_idx"),
            # live_for_module, modules_with_live_rows (R9), the cleanup scan (R11):
            # released rows are outside every range these read.
            models.Index(fields=["status", "owner_module"], name="evres_status_owner_idx"),
            # A group claim reads back what it won by its token.
            models.Index(fields=["claim_token"], name="evres_claim_token_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.kind}:{self.ref}"

    @property
    def is_placeholder(self) -> bool:
        return self.kind == STEP_KIND

    def is_spent(self, max_attempts: int, max_claims: int) -> bool:
        """Rule 2's bound, for a row in hand: its automatic tries are used up (attempts,
        or claims with no verdict: its revert kills or hangs the sweeper). The SQL's
        twin is ``EventRunResourceQuerySet.retryable``."""
        return self.revert_attempts >= max_attempts or self.claim_count >= max_claims


class EventRunLog(LedgerModel):
    run = models.ForeignKey(EventRun, on_delete=models.CASCADE, related_name="log")
    kind = models.CharField(max_length=64)
    detail = models.JSONField(default=dict, blank=True, encoder=DjangoJSONEncoder)
    created_at = models.DateTimeField(default=timezone.now)

    objects = EventRunLogManager()

    class Meta:
        base_manager_name = "objects"
        verbose_name = "event run log entry"
        verbose_name_plural = "event run log"
        indexes = [models.Index(fields=["run", "created_at"], name="evlog_run_idx")]

    def __str__(self) -> str:
        return f"{self.kind} (run {self.run_id})"


__all__ = [
    "HELD",
    "LIVE",
    "STEP_KIND",
    "UNRESOLVED",
    "EventRun",
    "EventRunLog",
    "EventRunResource",
    "EventRunStep",
    "mint_idempotency_key",
]
