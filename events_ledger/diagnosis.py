"""Why is this stuck? The words the console and ``cleanup_runs --dry-run`` both show."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop, ngettext

from .cleanup import Group, plan_run
from .conf import ledger_settings
from .models import EventRunResource, EventRunStep
from .states import UNRESOLVED, ResourceStatus

#: Said under a call by key: the step's answer may be on the ledger only in part.
BY_KEY_NOTE = gettext_noop(
    "(its step's answer may be on the ledger in part: the module is asked for everything "
    "the key made)"
)


@dataclass(frozen=True)
class PlannedCall:
    """One group of a cleanup plan, in words: the call, or the step it waits for."""

    call: str
    #: Why the call cannot be made (no such action, no ``revert``, no lease).
    problem: str | None
    #: The module is asked for everything the key made; the note says why.
    note: str | None


def planned_call(group: Group) -> PlannedCall:
    waiting = group.waiting_for is not None
    return PlannedCall(
        call=group.call,
        problem=group.problem,
        note=_(BY_KEY_NOTE) if group.by_key and not waiting else None,
    )


def plan_lines(groups: list[Group]) -> list[str]:
    """The plan of one run as ``cleanup_runs --dry-run`` prints it, a line per call."""
    lines = []
    for group in groups:
        planned = planned_call(group)
        problem = (
            _("  [cannot: %(problem)s]") % {"problem": planned.problem} if planned.problem else ""
        )
        lines.append(f"  - {planned.call}{problem}")
        if planned.note:
            lines.append(f"    {planned.note}")
    return lines


def claim_stamp(row: EventRunResource) -> datetime | None:
    # A `reverting` row's updated_at is its claim's stamp (R5 re-stamps on every claim).
    return row.updated_at if row.status == ResourceStatus.REVERTING else None


def find_group(row: EventRunResource) -> tuple[Group | None, list[Group]]:
    """The group of the human retry's plan (`cleanup_runs --dry-run`) holding this row,
    and the plan."""
    plan = plan_run(row.run_id, reset_attempts=True)
    return next((g for g in plan if any(r.pk == row.pk for r in g.rows)), None), plan


def behind_note(behind: dict[str, Any]) -> str:
    """C8: why a group waits (``Group.behind``): the later phase of its run given back
    first, how much of it is left, and whether the sweep will ever get to it."""
    values = {
        "phase": behind["phase"],
        "rows": behind["rows"],
        "resources": ", ".join(behind["resources"])
        + (", …" if behind["rows"] > len(behind["resources"]) else ""),
    }
    if behind["stuck"]:
        note = ngettext(
            "It waits behind phase '%(phase)s' of its run, given back first (the last phase "
            "first): %(rows)d row of it is unresolved (%(resources)s) and its attempts are "
            "spent, so no sweep gives it back, nor this row after it. Retry cleanup of its "
            "run would reset the attempts, give back phase '%(phase)s' first, then call:",
            "It waits behind phase '%(phase)s' of its run, given back first (the last phase "
            "first): %(rows)d rows of it are unresolved (%(resources)s) and their attempts "
            "are spent, so no sweep gives them back, nor this row after them. Retry cleanup "
            "of its run would reset the attempts, give back phase '%(phase)s' first, then call:",
            behind["rows"],
        )
    else:
        note = ngettext(
            "It waits behind phase '%(phase)s' of its run, given back first (the last phase "
            "first): %(rows)d row of it is still unresolved (%(resources)s). Retry cleanup of "
            "its run would give back phase '%(phase)s' first, then call:",
            "It waits behind phase '%(phase)s' of its run, given back first (the last phase "
            "first): %(rows)d rows of it are still unresolved (%(resources)s). Retry cleanup "
            "of its run would give back phase '%(phase)s' first, then call:",
            behind["rows"],
        )
    return note % values


@dataclass(frozen=True)
class Diagnosis:
    """The answer to "why is this stuck?" for one ledger row."""

    row: EventRunResource
    unresolved: bool
    claim_stale: bool
    call: str | None
    problem: str | None
    note: str


def diagnose(row: EventRunResource) -> Diagnosis:
    """Reads the row and its run's plan; writes nothing."""
    unresolved = row.status in UNRESOLVED
    group, plan = find_group(row) if unresolved else (None, [])
    since = claim_stamp(row)
    # Decided by the database's clock, which stamped the claim (one clock: a web host
    # whose clock is ahead called a fresh claim stale).
    stale = since is not None and EventRunResource.objects.claim_is_stale(
        row, ledger_settings.REVERT_CLAIM_TTL
    )
    if not unresolved:
        note = _("Nothing: this row is %(status)s, its target is released.") % {
            "status": row.status
        }
    elif group is None:
        note = _(
            "Not in the next retry: a pass calls at most %(groups)d groups "
            "(CLEANUP_GROUPS_PER_RUN); it comes in a later one."
        ) % {"groups": len(plan)}
    elif group.waiting_for:
        w = group.waiting_for
        # #25: the step as the run's page names it (#seq), not its database id.
        seq = EventRunStep.objects.filter(pk=w["step"]).values_list("seq", flat=True).first()
        note = _(
            "Its step %(step)s (%(action)s) is in flight on %(host)s since %(since)s UTC: a "
            "call of it may still change the world, so cleanup waits until the call ends (or "
            "until its claim goes stale, STEP_CLAIM_TTL after that process stopped stamping it)."
        ) % {
            "step": f"#{seq}" if seq is not None else w["step"],
            "action": w["action"],
            "host": w["claimed_by"] or _("an unknown host"),
            "since": w["claimed_at"],
        }
    elif not row.run.is_terminal:
        note = _("The run is still %(status)s: cleanup starts when it ends. It would call:") % {
            "status": row.run.status
        }
    elif group.behind:
        note = behind_note(group.behind)
    else:
        note = _("Retry cleanup of its run would reset its attempts and call:")
    planned = planned_call(group) if group is not None else None
    # While its step is in flight no call is made: the note says what it waits for.
    waiting = group is not None and group.waiting_for is not None
    return Diagnosis(
        row=row,
        unresolved=unresolved,
        claim_stale=stale,
        call=planned.call if planned is not None and not waiting else None,
        problem=planned.problem if planned is not None else None,
        note=note,
    )
