"""``manage.py ledger_status``: where the ledger stands, on one screen (#15)."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from events_ledger.management.base import NEEDS_HUMAN, OK, LedgerCommand
from events_ledger.status import LedgerStatus, duration, snapshot


class Command(LedgerCommand):
    help = gettext_noop(
        "Print where the ledger stands: runs in flight, owing or incomplete, unresolved resources by "
        "module, the oldest of them, steps in flight. Exit status 1 when it is unhealthy "
        "(a run incomplete, or an unresolved resource older than HEALTH_MAX_UNRESOLVED_AGE)."
    )

    def add_arguments(self, parser: Any) -> None:
        self.add_json_argument(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        status = snapshot(details=True)
        if opts["json"]:
            self.emit_json(status.as_dict())
        elif opts["verbosity"]:
            self._print(status, opts["verbosity"])
        self.finish(OK if status.healthy else NEEDS_HUMAN, _("the ledger is unhealthy."))

    def _print(self, s: LedgerStatus, verbosity: int) -> None:
        out = self.stdout.write
        if s.healthy:
            out(self.style.SUCCESS(_("events ledger: healthy")))
        else:
            out(self.style.ERROR(_("events ledger: UNHEALTHY")))
            for problem in s.problems:
                out(self.style.ERROR(f"  - {problem}"))
        # #25: the runs that need watching; finished and given back is history, not counted.
        out(
            _(
                "runs: in flight %(in_flight)d · cleanup pending %(pending)d · incomplete %(incomplete)d"
            )
            % {
                "in_flight": s.runs_in_flight,
                "pending": s.cleanup_pending,
                "incomplete": s.incomplete_runs,
            }
        )
        oldest = duration(s.age(s.oldest_unresolved))
        out(
            _("unresolved resources: %(count)d (oldest %(oldest)s)")
            % {"count": s.unresolved, "oldest": oldest}
        )
        width = max((len(m.owner) for m in s.modules), default=0)
        for m in s.modules:
            statuses = ", ".join(f"{name} {n}" for name, n in m.by_status.items())
            out(
                f"  {m.owner:<{width}}  {statuses}; oldest {duration(s.age(m.oldest))}; "
                f"claimed without verdict {m.poison}; left for a human {m.spent}"
            )
        out(_("steps in flight: %(count)d") % {"count": s.in_flight})
        for a in s.steps:
            stale = f", {a.stale} with a stale claim" if a.stale else ""
            out(f"  {a.action}: {a.in_flight} (oldest {duration(s.age(a.oldest))}){stale}")
        if s.oldest_rows:
            out(_("oldest unresolved:"))
            for r in s.oldest_rows:
                line = (
                    f"  #{r.pk} {r.owner_module} {r.kind}:{r.ref} {r.status}, run {r.run_id}, "
                    f"{duration(s.age(r.created_at))} old"
                )
                if r.last_error:  # #25: what the alert's text promises
                    line += f": {r.last_error}"
                out(line)
        if s.running_steps and verbosity > 1:
            out(_("longest in flight:"))
            for step in s.running_steps:
                out(
                    f"  step {step.pk} ({step.action_id}) of run {step.run_id} on "
                    f"{step.claimed_by or 'an unknown host'}, {duration(s.age(step.updated_at))}"
                )
