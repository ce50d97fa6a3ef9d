"""``manage.py resolve_rows``: an operator resolves ledger rows by hand, calling no module."""

from __future__ import annotations

import getpass
from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from events_ledger.management.base import OK, LedgerCommand
from events_ledger.models import EventRunResource
from events_ledger.runner import resolve_by_hand


class Command(LedgerCommand):
    help = gettext_noop(
        "Resolve ledger rows by hand, without calling their module: the other value should "
        "stay (a drifted lease), or you checked that the object is gone. Only rows of ended "
        "runs that no sweeper is giving back now. Exit status 0 when every row was "
        "resolved, 2 when a row does not exist or could not be resolved."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("rows", type=int, nargs="+", metavar="ROW_ID", help=_("The rows."))
        parser.add_argument(
            "--reason", required=True, help=_("Why, for whoever reads the run's log later.")
        )
        parser.add_argument(
            "--actor", help=_("Who resolves them, for the run's log (default: cli:<user>).")
        )
        self.add_json_argument(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        self.as_json = opts["json"]
        asked = sorted(set(opts["rows"]))
        found = set(EventRunResource.objects.filter(pk__in=asked).values_list("pk", flat=True))
        missing = [pk for pk in asked if pk not in found]
        if missing:
            raise self.bad_input(
                _("There is no ledger row %(ids)s.") % {"ids": ", ".join(map(str, missing))}
            )
        actor = opts["actor"] or f"cli:{getpass.getuser()}"
        try:
            resolved = resolve_by_hand(asked, actor=actor, reason=opts["reason"])
        except ValueError as exc:
            raise self.bad_input(str(exc)) from exc
        left = list(
            EventRunResource.objects.filter(pk__in=asked)
            .exclude(pk__in=resolved)
            .order_by("pk")
            .values_list("pk", "status")
        )
        if self.as_json:
            self.emit_json({"resolved": resolved, "by": actor, "left": dict(left)})
        elif self.verbosity:
            self.stdout.write(_("%(n)d row(s) resolved by hand") % {"n": len(resolved)})
        if left:
            raise self.bad_input(
                _(
                    "Not resolved (their run is still going, they are resolved already, "
                    "or a sweeper is giving them back now): %(rows)s"
                )
                % {"rows": ", ".join(f"{pk} ({status})" for pk, status in left)}
            )
        self.finish(OK, "")
