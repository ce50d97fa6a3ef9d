"""``manage.py reconcile_resources``: ask modules which of their resources still exist."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from events_ledger.cleanup import reconcile_all
from events_ledger.management.base import NEEDS_HUMAN, OK, LedgerCommand
from events_ledger.models import EventRunResource


class Command(LedgerCommand):
    help = gettext_noop(
        "Ask each module with live rows (or --module OWNER) which are still in force; rows "
        "no longer in force become orphaned. Exit status 1 when answers were held back by "
        "the safety bound, or when a module's reconcile failed."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--module", metavar="OWNER", help=_("Ask this module only."))
        parser.add_argument(
            "--force",
            action="store_true",
            help=_(
                "Orphan even when the answers would orphan more than RECONCILE_MAX_ORPHAN_FRACTION."
            ),
        )
        self.add_json_argument(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        owner = opts["module"]
        if owner is not None:
            if owner not in EventRunResource.objects.modules_with_live_rows():
                known = ", ".join(EventRunResource.objects.modules_with_live_rows()) or _("none")
                raise self.bad_input(
                    _("The module %(owner)r has no live rows (modules with live rows: %(known)s).")
                    % {"owner": owner, "known": known}
                )
        # One module or all, a reconcile that fails is reported as a summary's error.
        results = reconcile_all(force=opts["force"], owners=None if owner is None else [owner])
        held_back = [s for s in results.values() if s.held_back]
        failed = [s for s in results.values() if s.errors]
        if opts["json"]:
            self.emit_json({owner: s.as_dict() for owner, s in results.items()})
        elif opts["verbosity"]:
            if not results:
                self.stdout.write(_("no module has live rows"))
            for name, s in results.items():
                line = _(
                    "%(owner)s: asked %(asked)d, in force %(in_force)d, orphaned %(orphaned)d, "
                    "unanswered %(unanswered)d"
                ) % {
                    "owner": name,
                    "asked": s.asked,
                    "in_force": s.in_force,
                    "orphaned": s.orphaned,
                    "unanswered": s.unanswered,
                }
                self.stdout.write(self.style.ERROR(line) if s.held_back else line)
                if s.reason:
                    self.stdout.write(f"  {s.reason}")
                for error in s.errors:
                    self.stderr.write(self.style.ERROR(f"  {name}: {error}"))
        self.finish(
            NEEDS_HUMAN if held_back or failed else OK,
            _("a module's answer was held back or failed: a human must look."),
        )
