"""``manage.py cleanup_runs``: the cron job that gives back what finished runs took."""

from __future__ import annotations

import getpass
import logging
import math
import signal
import threading
import time
from typing import Any

from django.db import DatabaseError, close_old_connections, connections
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from events_ledger.cleanup import (
    CleanupSummary,
    RunNotTerminal,
    VerdictsInHand,
    cleanup_run,
    plan_run,
    scan,
    sweep,
    write_verdicts_in_hand,
)
from events_ledger.conf import ledger_settings
from events_ledger.db import ledger_db
from events_ledger.diagnosis import plan_lines
from events_ledger.management.base import NEEDS_HUMAN, OK, LedgerCommand
from events_ledger.models import EventRun
from events_ledger.states import CleanupStatus

logger = logging.getLogger("events_ledger")

#: Why a sweep exits 1; the lines above it say which runs.
NEEDS_A_HUMAN = gettext_noop("a run is incomplete, or a pass failed: a human must look.")
#: The shortest --loop interval: a tighter loop only hammers the database.
MIN_LOOP_S = 0.1
#: How long a single pass keeps trying to write verdicts it holds before it exits (#24).
IN_HAND_PAUSES = (0.5, 1.0, 2.0, 4.0, 8.0)
#: How long a loop waits after a pass failed, at most (doubling from the interval).
MAX_BACKOFF_S = 300.0
#: Incomplete runs a pass names (it exits 1 while any is left).
STUCK_NAMED = 10


class Command(LedgerCommand):
    scope: str | None = None

    help = gettext_noop(
        "Give back what terminal runs still hold: one sweep (or one run with --run). "
        "Exit status 0: clean or retries pending; 1: a run is incomplete (waiting for a "
        "human's retry) or failed to sweep; 2: bad arguments."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--run", type=int, metavar="ID", help=_("Clean up this run only."))
        parser.add_argument(
            "--reset-attempts",
            action="store_true",
            help=_(
                "With --run: the human retry. Zero the attempt counters first (logged with --actor)."
            ),
        )
        parser.add_argument(
            "--actor", help=_("Who asks for the human retry (default: the OS user).")
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help=_("List what would be given back; write nothing."),
        )
        parser.add_argument(
            "--scope",
            help=_("Sweep only runs of this scope (a cron per team); every run by default."),
        )
        parser.add_argument(
            "--loop",
            type=float,
            metavar="SECONDS",
            help=_("Sweep every SECONDS until SIGTERM/SIGINT, finishing the calls in hand."),
        )
        self.add_json_argument(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["reset_attempts"] and opts["run"] is None:
            raise self.bad_input(
                _("--reset-attempts is the human retry of one run: give --run ID.")
            )
        if opts["actor"] is not None and not opts["reset_attempts"]:
            # Only the human retry is logged with who asked: an actor anywhere else would
            # be dropped without a word, and the operator would believe it recorded.
            raise self.bad_input(
                _("--actor names who asks for the human retry: add --reset-attempts.")
            )
        if opts["scope"] is not None and opts["run"] is not None:
            raise self.bad_input(_("--scope chooses the runs a sweep works; --run names one."))
        self.scope = opts["scope"]
        if opts["loop"] is not None and (opts["run"] is not None or opts["dry_run"]):
            raise self.bad_input(_("--loop sweeps; it does not go with --run or --dry-run."))
        if opts["loop"] is not None and (
            not math.isfinite(opts["loop"]) or opts["loop"] < MIN_LOOP_S
        ):
            raise self.bad_input(
                _("--loop takes a finite number of seconds, at least %(min)g; not %(given)r.")
                % {"min": MIN_LOOP_S, "given": opts["loop"]}
            )
        try:
            ledger_settings.CLEANUP_RUN_BATCH  # noqa: B018  (a wrong setting is bad input, said plainly)
        except Exception as exc:
            raise self.bad_input(str(exc)) from exc
        self.as_json = opts["json"]
        run = self._run(opts["run"]) if opts["run"] is not None else None
        if opts["dry_run"]:
            return self.finish(self._dry_run(run, opts["reset_attempts"]), "")
        if run is not None:
            actor = opts["actor"] or f"cli:{getpass.getuser()}"
            try:
                summary = cleanup_run(
                    run,
                    reset_attempts=opts["reset_attempts"],
                    actor=actor if opts["reset_attempts"] else None,
                )
            except RunNotTerminal as exc:
                raise self._not_terminal(exc) from exc
            except VerdictsInHand as exc:
                # The modules answered; their verdicts could not be written yet: written
                # now (within the pauses a single pass takes), never a traceback.
                self.stderr.write(self.style.ERROR(str(exc)))
                written = self._wrote_what_is_in_hand()
                run.refresh_from_db()
                done = written and run.cleanup_status != CleanupStatus.INCOMPLETE
                return self.finish(
                    OK if done else NEEDS_HUMAN,
                    _("run %(id)s: its verdicts were written late; it is %(status)s.")
                    % {"id": run.pk, "status": run.cleanup_status}
                    if written
                    else _("run %(id)s: its verdicts could not be written.") % {"id": run.pk},
                )
            incomplete = summary.cleanup_status == CleanupStatus.INCOMPLETE
            # The document says what the exit status says: this run needs a human.
            self._report([summary], {}, stuck=[run.pk] if incomplete else [])
            return self.finish(
                NEEDS_HUMAN if incomplete else OK,
                _("run %(id)s is incomplete: a human must look.") % {"id": run.pk},
            )
        if opts["loop"] is not None:
            return self.finish(self._loop(opts["loop"]), _(NEEDS_A_HUMAN))
        try:
            status = self._sweep_once()
        except DatabaseError as exc:
            self.stderr.write(self.style.ERROR(_("the pass failed: %(error)s") % {"error": exc}))
            status = NEEDS_HUMAN
        if not self._wrote_what_is_in_hand():
            status = NEEDS_HUMAN
        return self.finish(status, _(NEEDS_A_HUMAN))

    def _wrote_what_is_in_hand(self) -> bool:
        """A single pass that could not write its modules' answers (the rows locked past
        its retries, the database away) keeps trying a while before the process ends
        with them: once it is gone, their claims wait out ``REVERT_CLAIM_TTL`` and the
        modules are asked again."""
        held = write_verdicts_in_hand()
        for pause in IN_HAND_PAUSES:
            if not held:
                return True
            time.sleep(pause)
            held = write_verdicts_in_hand()
        if held:
            self.stderr.write(
                self.style.ERROR(
                    _(
                        "%(count)d pass(es)' verdicts could not be written; their rows are "
                        "given back again after REVERT_CLAIM_TTL"
                    )
                    % {"count": held}
                )
            )
        return not held

    def _run(self, pk: int) -> EventRun:
        try:
            return EventRun.objects.get(pk=pk)
        except EventRun.DoesNotExist:
            raise self.bad_input(_("There is no run %(id)s.") % {"id": pk}) from None

    # ── one pass ──

    def _sweep_once(self, should_stop: Any = None) -> int:
        report = sweep(should_stop=should_stop, scope=self.scope)
        errors = dict(report.errors)
        # #25: every pass, not only the one that made it so: a monitor that reads the exit
        # status stays red while a run in scope is still incomplete (a range of the
        # runs' cleanup index, however long the history).
        stuck = list(
            EventRun.objects.in_scope(self.scope)
            .filter(cleanup_status=CleanupStatus.INCOMPLETE)
            .order_by("pk")
            .values_list("pk", flat=True)[: STUCK_NAMED + 1]
        )
        self._report(
            report.runs,
            errors,
            repaired=report.repaired_runs,
            repair_error=report.repair_error,
            stuck=stuck,
        )
        # Exit 1 while a run is incomplete (left so by this pass or an earlier one), or
        # when something failed: a human should look.
        return NEEDS_HUMAN if stuck or report.incomplete or errors or report.repair_error else OK

    def _report(
        self,
        summaries: list[CleanupSummary],
        errors: dict[int, str],
        repaired: list[tuple[int, str]] | None = None,
        repair_error: str | None = None,
        stuck: list[int] | None = None,
    ) -> None:
        repaired = repaired or []
        stuck = stuck or []
        if self.as_json:
            self.emit_json(
                {
                    "runs": [s.as_dict() for s in summaries],
                    "errors": errors,
                    "repaired": {str(pk): status for pk, status in repaired},
                    "repair_error": repair_error,
                    "incomplete": stuck[:STUCK_NAMED],
                }
            )
            return
        if self.verbosity == 0:
            return
        for s in summaries:
            if s.cleanup_status == CleanupStatus.COMPLETE:
                style = self.style.SUCCESS
            elif s.cleanup_status == CleanupStatus.INCOMPLETE:
                style = self.style.ERROR
            else:
                style = self.style.WARNING
            self.stdout.write(
                style(
                    _(
                        "run %(id)s: attempted %(attempted)d, reverted %(reverted)d, "
                        "drifted %(drifted)d, failed %(failed)d, remaining %(remaining)d -> %(status)s"
                    )
                    % {
                        "id": s.run_id,
                        "attempted": s.attempted,
                        "reverted": s.reverted,
                        "drifted": s.drifted,
                        "failed": s.failed,
                        "remaining": s.remaining,
                        "status": s.cleanup_status,
                    }
                )
            )
            if s.failed and s.errors and self.verbosity < 2:
                # "failed 2" alone sends the reader to the console for the why.
                others = len(s.errors) - 1
                self.stdout.write(
                    _("  first error: %(error)s") % {"error": s.errors[0]}
                    + (
                        _(" (and %(more)d more; -v 2 lists them)") % {"more": others}
                        if others
                        else ""
                    )
                )
            for w in s.waiting:
                self.stdout.write(
                    _(
                        "  waits for step %(step)s (%(action)s) in flight on %(host)s since %(since)s"
                    )
                    % {
                        # #25: the step as the run page names it.
                        "step": f"#{w['seq']}" if w.get("seq") is not None else w["step"],
                        "action": w["action"],
                        "host": w["claimed_by"] or _("an unknown host"),
                        "since": w["claimed_at"],
                    }
                )
            for b in s.behind:
                # C8: the later phase the run's earlier phases still wait behind.
                line = _(
                    "  earlier phases wait behind phase '%(phase)s': %(rows)d row(s) of it "
                    "unresolved%(spent)s (%(resources)s)"
                ) % {
                    "phase": b["phase"],
                    "rows": b["rows"],
                    "spent": _(", their attempts spent") if b["stuck"] else "",
                    "resources": ", ".join(b["resources"])
                    + (", …" if b["rows"] > len(b["resources"]) else ""),
                }
                self.stdout.write(line)
            if self.verbosity >= 2:
                for g in s.groups:
                    line = (
                        f"  {g['call']} {g['what']}: {', '.join(g['resources'])} -> {g['outcome']}"
                    )
                    self.stdout.write(line + (f" ({g['error']})" if g.get("error") else ""))
        for run_id, error in errors.items():
            failed = _("run %(id)s: the sweep failed: %(error)s") % {"id": run_id, "error": error}
            self.stderr.write(self.style.ERROR(failed))
        if repair_error:
            failed = _("repairing summaries failed: %(error)s") % {"error": repair_error}
            self.stderr.write(self.style.ERROR(failed))
        for pk, status in repaired:
            style = self.style.ERROR if status == CleanupStatus.INCOMPLETE else self.style.WARNING
            line = _("run %(id)s: summary re-derived from its rows -> %(status)s")
            self.stdout.write(style(line % {"id": pk, "status": status}))
        if not summaries and not errors:
            self.stdout.write(_("nothing to give back"))
        if stuck:
            ids = ", ".join(str(pk) for pk in stuck[:STUCK_NAMED])
            more = ", …" if len(stuck) > STUCK_NAMED else ""
            line = _("incomplete, waiting for a human's retry: run %(ids)s")
            self.stdout.write(self.style.ERROR(line % {"ids": ids + more}))

    # ── dry run ──

    def _not_terminal(self, exc: Exception) -> Exception:
        return self.bad_input(
            _(
                "%(reason)s. Finish or cancel it first (manage.py end_run ID --reason TEXT "
                "ends a run that will not end by itself)."
            )
            % {"reason": exc}
        )

    def _dry_run(self, run: EventRun | None, human: bool) -> int:
        if run is not None and not run.is_terminal:
            # Refused as the real command refuses it: a plan it would not carry out misleads.
            raise self._not_terminal(
                RunNotTerminal(f"run {run.pk} is {run.status}: only a finished run is cleaned up")
            )
        # The batch the pass would take: the same scan, with the same bounds.
        runs = [run] if run is not None else scan(scope=self.scope)
        plans = {r.pk: plan_run(r, reset_attempts=human) for r in runs}
        if self.as_json:
            self.emit_json(
                {
                    "dry_run": True,
                    "runs": {pk: [g.describe() for g in groups] for pk, groups in plans.items()},
                }
            )
            return OK
        if not any(plans.values()):
            if run is not None and not human and run.cleanup_status == CleanupStatus.INCOMPLETE:
                self.stdout.write(
                    _(
                        "nothing would be given back: run %(id)s is incomplete (its rows' "
                        "automatic tries are spent); --reset-attempts --dry-run shows the "
                        "human retry's plan"
                    )
                    % {"id": run.pk}
                )
            else:
                self.stdout.write(_("nothing would be given back"))
        for pk, groups in plans.items():
            run = next(r for r in runs if r.pk == pk)
            if not groups:
                continue
            line = _("run %(id)s (%(name)s, %(status)s) would give back:")
            self.stdout.write(line % {"id": pk, "name": run.name, "status": run.status})
            # The same words as the console's "why is this stuck?", from the same code.
            for line in plan_lines(groups):
                self.stdout.write(line)
        return OK

    # ── loop ──

    def _loop(self, every: float) -> int:
        stop = threading.Event()

        def request_stop(signum: int, frame: Any) -> None:
            if self.verbosity:
                # Beside the JSON documents, never among them.
                (self.stderr if self.as_json else self.stdout).write(
                    _("signal %(signal)s: finishing the calls in hand, then stopping")
                    % {"signal": signum}
                )
            stop.set()

        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        status = OK
        wait = every
        try:
            while not stop.is_set():
                try:
                    status = max(status, self._sweep_once(should_stop=stop.is_set))
                    wait = every
                except DatabaseError as exc:
                    # The database went away (restarted, failed over): this pass is
                    # lost, the loop is not. Back off, doubling, and try again.
                    status = NEEDS_HUMAN
                    wait = min(max(wait * 2, every), MAX_BACKOFF_S)
                    logger.warning("a sweep pass failed; next try in %.1fs", wait, exc_info=True)
                    self.stderr.write(
                        self.style.ERROR(
                            _("the pass failed: %(error)s; trying again in %(wait).1fs")
                            % {"error": exc, "wait": wait}
                        )
                    )
                finally:
                    # Never hold a connection (or a snapshot) across passes: a server
                    # that went away between passes is reconnected to on the next.
                    try:
                        close_old_connections()
                        connections[ledger_db()].close()
                    except DatabaseError:
                        logger.debug("closing a dead connection failed", exc_info=True)
                stop.wait(wait)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        # Stopped (SIGTERM from systemd or a rollout, SIGINT): the modules' answers this
        # process holds are written before it goes, as after a single pass; gone with
        # it, their rows would wait out REVERT_CLAIM_TTL and be given back again.
        if not self._wrote_what_is_in_hand():
            status = NEEDS_HUMAN
        return status
