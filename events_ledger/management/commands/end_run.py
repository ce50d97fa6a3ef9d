"""``manage.py end_run``: an operator ends a run that will not end by itself."""

from __future__ import annotations

import getpass
from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from events_ledger.management.base import OK, LedgerCommand
from events_ledger.models import EventRun
from events_ledger.runner import end_run
from events_ledger.states import RUN_TERMINAL


class Command(LedgerCommand):
    help = gettext_noop(
        "End a run stuck in pending or running (its worker died, its driver never came "
        "back): it moves to --status (failed by default) with your reason on its log, and "
        "the next sweep gives its ledger back. Exit status 0 when it was ended, 2 for a run "
        "that does not exist or has ended already."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("run", type=int, metavar="RUN_ID", help=_("The run to end."))
        parser.add_argument(
            "--status",
            choices=RUN_TERMINAL,
            default="failed",
            help=_("The terminal status it ends in (default: failed)."),
        )
        parser.add_argument(
            "--reason", required=True, help=_("Why, for whoever reads the run's log later.")
        )
        parser.add_argument(
            "--actor", help=_("Who ends it, for the run's log (default: cli:<user>).")
        )
        self.add_json_argument(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            run = EventRun.objects.get(pk=opts["run"])
        except EventRun.DoesNotExist:
            raise self.bad_input(_("There is no run %(id)s.") % {"id": opts["run"]}) from None
        self.as_json = opts["json"]
        actor = opts["actor"] or f"cli:{getpass.getuser()}"
        try:
            ended = end_run(run, opts["status"], actor=actor, reason=opts["reason"])
        except ValueError as exc:
            raise self.bad_input(str(exc)) from exc
        if not ended:
            run.refresh_from_db()
            raise self.bad_input(
                _("Run %(id)s has ended already (%(status)s): nothing to end.")
                % {"id": run.pk, "status": run.status}
            )
        if self.as_json:
            self.emit_json({"run": run.pk, "status": run.status, "by": actor})
        elif self.verbosity:
            self.stdout.write(
                _("run %(id)s ended: %(status)s; the next sweep gives its ledger back")
                % {"id": run.pk, "status": run.status}
            )
        self.finish(OK, "")
