"""``manage.py prune_ledger``: remove the history that is no longer needed (#28)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.db import DatabaseError
from django.utils.dateparse import parse_duration
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from events_ledger.management.base import NEEDS_HUMAN, OK, LedgerCommand
from events_ledger.retention import (
    DEFAULT_BATCH,
    MAX_BATCH,
    ArchiveBusy,
    ArchiveRefused,
    NoRetention,
    PruneReport,
    prune,
)

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> timedelta | None:
    """``90d``, ``12h``, ``30m``, ``3600`` (seconds), or what Django's ``parse_duration``
    reads (``P90D``, ``90 00:00:00``); None when it is none of these."""
    match = _AGE.match(text)
    if match:
        return timedelta(seconds=float(match[1]) * _UNIT[match[2]])
    return parse_duration(text)


class Command(LedgerCommand):
    help = gettext_noop(
        "Remove finished runs that owe nothing and ended before the cut-off (--older-than, "
        "else the RETENTION setting) with their steps, ledger rows and log, in small batches; "
        "with --archive, written first to a compressed JSON-lines file. Exit status 0: done "
        "(or nothing to do); 1: a batch failed or the database refused a run; 2: bad arguments."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--older-than",
            metavar="AGE",
            help=_("Remove runs that ended longer ago than AGE (90d, 12h, 30m, seconds, P90D)."),
        )
        parser.add_argument(
            "--dry-run", action="store_true", help=_("Count what would be removed; write nothing.")
        )
        parser.add_argument(
            "--batch",
            type=int,
            default=DEFAULT_BATCH,
            metavar="N",
            help=_("Runs per batch, each its own short transaction (default %(default)s)."),
        )
        parser.add_argument(
            "--archive",
            metavar="PATH",
            help=_(
                "Append what is removed to PATH (gzip, one run a line), written before each "
                "batch's delete commits."
            ),
        )
        self.add_json_argument(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        older_than = None
        if opts["older_than"] is not None:
            older_than = parse_age(opts["older_than"])
            if older_than is None or older_than <= timedelta(0):
                raise self.bad_input(
                    _("--older-than takes a positive age such as 90d, 12h or 30m; not %(given)r.")
                    % {"given": opts["older_than"]}
                )
        if not 1 <= opts["batch"] <= MAX_BATCH:
            raise self.bad_input(
                _("--batch takes 1 to %(max)d runs; not %(given)d.")
                % {"max": MAX_BATCH, "given": opts["batch"]}
            )
        if opts["dry_run"] and opts["archive"]:
            raise self.bad_input(_("--dry-run writes nothing: it takes no --archive."))
        self.as_json = opts["json"]
        try:
            report = prune(
                older_than=older_than,
                batch=opts["batch"],
                archive=opts["archive"],
                dry_run=opts["dry_run"],
                on_batch=self._progress,
            )
        except NoRetention as exc:
            if self.as_json:
                self.emit_json({"kept_for_ever": True, "runs": 0})
            elif self.verbosity:
                self.stdout.write(str(exc))
            return self.finish(OK, "")
        except (ArchiveBusy, ArchiveRefused) as exc:
            # Refused before anything was deleted: the path is the operator's to mend.
            raise self.bad_input(str(exc)) from exc
        except (DatabaseError, OSError) as exc:
            # The batches before this one are removed (and archived); the next run goes on.
            return self.finish(
                NEEDS_HUMAN, _("a batch failed: %(error)s") % {"error": f"{exc!r}"[:500]}
            )
        self._report(report)
        self.finish(
            NEEDS_HUMAN if report.refused else OK,
            _("the database refused to delete runs %(ids)s (another table points at them).")
            % {"ids": ", ".join(map(str, report.refused[:20]))},
        )

    def _progress(self, runs: int) -> None:
        if self.verbosity >= 2 and not self.as_json:
            self.stdout.write(_("%(runs)d runs removed so far") % {"runs": runs})

    def _report(self, report: PruneReport) -> None:
        if self.as_json:
            self.emit_json(report.as_dict())
            return
        if not self.verbosity:
            return
        values = {
            "runs": report.runs,
            "cutoff": report.cutoff.isoformat(timespec="seconds"),
            "steps": report.steps,
            "resources": report.resources,
            "log": report.log,
            "batches": report.batches,
            "seconds": report.seconds,
        }
        if report.dry_run:
            self.stdout.write(
                _(
                    "would remove %(runs)d runs that ended before %(cutoff)s (%(steps)d "
                    "steps, %(resources)d ledger rows, %(log)d log entries)"
                )
                % values
            )
            if report.run_ids and self.verbosity >= 2:
                shown = ", ".join(map(str, report.run_ids))
                more = report.runs - len(report.run_ids)
                self.stdout.write(
                    _("runs: %(ids)s") % {"ids": shown + (f", … ({more} more)" if more else "")}
                )
        else:
            self.stdout.write(
                _(
                    "removed %(runs)d runs that ended before %(cutoff)s (%(steps)d steps, "
                    "%(resources)d ledger rows, %(log)d log entries) in %(batches)d batches, "
                    "%(seconds).1fs"
                )
                % values
            )
        if report.archive:
            self.stdout.write(_("archived to %(path)s") % {"path": report.archive})
        if report.archive_torn_bytes or report.archive_runs_dropped:
            self.stdout.write(
                _(
                    "the archive was repaired first: %(bytes)d bytes of a torn batch cut, "
                    "%(runs)d runs of a batch that never committed taken out (they are "
                    "archived again when they go)"
                )
                % {"bytes": report.archive_torn_bytes, "runs": report.archive_runs_dropped}
            )
        for pk in report.refused:
            self.stdout.write(
                self.style.ERROR(_("run %(id)d kept: the database refused its delete") % {"id": pk})
            )
