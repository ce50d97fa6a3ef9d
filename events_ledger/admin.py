"""The operator's console (S3): runs, their ledger and log, the human retry and reconcile."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.apps.registry import Apps
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from .cleanup import RunNotTerminal, cleanup_run, plan_run, reconcile_module
from .conf import ledger_settings
from .dashboard import DATETIME_FORMAT, TIME_FORMAT, run_timeline, when
from .db import ledger_db
from .diagnosis import claim_stamp, diagnose
from .models import EventRun, EventRunResource, EventRunStep
from .querysets import EventRunQuerySet, EventRunResourceQuerySet
from .runner import end_run, resolve_by_hand
from .states import (
    RUN_TERMINAL,
    STEP_KIND,
    UNRESOLVED,
    CleanupStatus,
    ResourceStatus,
    RunStatus,
    status_label,
)

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

logger = logging.getLogger("events_ledger")

Res = EventRunResource.objects

#: Rows and log entries shown on a run's page; the resources changelist has the rest.
PAGE_LIMIT = 500


def pill(value: str) -> str:
    # Coloured by status in static/events_ledger/admin/console.css, as the templates' pills
    # are; worded as they are (#25: "Not required" beside "Pending").
    return format_html('<span class="el-pill el-s-{}">{}</span>', value, status_label(value))


def when_cell(value: datetime | None) -> str:
    # Date and time wrap as two whole lines in a narrow list, never at a hyphen.
    if value is None:
        return "–"
    local = timezone.localtime(value)
    return format_html(
        '<span class="el-nowrap">{}</span> <span class="el-nowrap">{}</span>',
        date_format(local, "Y-m-d"),
        date_format(local, "H:i:s"),
    )


def stamp(field: str, label: StrOrPromise) -> Any:
    """A read-only date field of the change page, written as the rest of the console
    writes a moment (#25), not in the admin's own DATETIME_FORMAT."""

    @admin.display(description=label, ordering=field)
    def show(self: Any, obj: Any) -> str:
        return when(getattr(obj, field))

    return show


def as_json(value: Any, indent: int | None = None) -> str:
    """Module payloads as text; templates escape it (never mark_safe)."""
    return json.dumps(
        value, cls=DjangoJSONEncoder, sort_keys=True, indent=indent, ensure_ascii=False
    )


#: How much of a step's params its row on the run page shows (the rest: its log, the API).
ASKED_LIMIT = 300


def asked(params: Any) -> str:
    """A step's params on one line, cut at ``ASKED_LIMIT``: what it was asked to do."""
    text = as_json(params)
    return text if len(text) <= ASKED_LIMIT else text[: ASKED_LIMIT - 1] + "…"


def as_lines(value: Any, indent: str = "") -> str:
    """A log entry's detail as an operator reads it (#25): one ``key: value`` line per key,
    keys sorted, nested mappings indented under their key, lists of plain values joined
    with commas, any other list one ``- item`` per line. Text, escaped by the templates."""
    if isinstance(value, dict):
        if not value:
            return f"{indent}–"
        lines = []
        for key in sorted(value, key=str):
            item = value[key]
            if _plain(item) or (isinstance(item, list) and all(map(_plain, item))):
                lines.append(f"{indent}{key}: {_scalar(item)}")
            else:
                lines.append(f"{indent}{key}:")
                lines.append(as_lines(item, indent + "  "))
        return "\n".join(lines)
    if isinstance(value, list) and not all(map(_plain, value)):
        return "\n".join(
            f"{indent}- " + as_lines(item, indent + "  ").lstrip(" ") for item in value
        )
    return f"{indent}{_scalar(value)}"


def _plain(value: Any) -> bool:
    return not isinstance(value, dict | list)


def _scalar(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(_scalar(v) for v in value) or "–"
    if value is None:
        return "–"
    if isinstance(value, bool):
        return _("yes") if value else _("no")
    return str(value)


class LedgerAdmin(admin.ModelAdmin):
    """Shared: the console's stylesheet, and permission checks for the app's own
    permissions (declared on EventRun)."""

    class Media:
        # Pills by status, the banner, the "why" panel, the dashboard's colours. The
        # change list renders media.css, the change form and the retry page all media.
        css = {"all": ["events_ledger/admin/console.css"]}

    def _has_app_perm(self, request: HttpRequest, codename: str) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.{codename}")

    def _confirmation(
        self, request: HttpRequest, title: str, template: str, **extra: Any
    ) -> TemplateResponse:
        """An action's confirmation page (``action_confirmation.html`` and its children):
        the admin's context, the selected objects carried in the form."""
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "subtitle": None,
            "opts": self.opts,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
            **extra,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, template, context)

    def has_retry_cleanup_permission(self, request: HttpRequest) -> bool:
        return self._has_app_perm(request, "retry_cleanup")

    def has_reconcile_resources_permission(self, request: HttpRequest) -> bool:
        return self._has_app_perm(request, "reconcile_resources")

    def has_end_run_permission(self, request: HttpRequest) -> bool:
        return self._has_app_perm(request, "end_run")

    def has_resolve_by_hand_permission(self, request: HttpRequest) -> bool:
        return self._has_app_perm(request, "resolve_by_hand")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # runs are made by automation, rows by the ledger

    def get_urls(self) -> list[Any]:
        """The changelist runs the actions that call modules (the human retry,
        reconcile): under ``ATOMIC_REQUESTS`` their claims would only be savepoints of
        the request's transaction (``InCallersTransaction``), so the ledger's own
        commits are its own there. The change form and delete page keep Django's."""
        urls = super().get_urls()
        changelist = f"{self.opts.app_label}_{self.opts.model_name}_changelist"
        for pattern in urls:
            if getattr(pattern, "name", None) == changelist:
                self._non_atomic(pattern.callback)
        return urls

    def _non_atomic(self, view: Any) -> Any:
        return transaction.non_atomic_requests(using=ledger_db())(view)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the console reads; it changes state only through the services


# ── the dashboard's row on the admin index ──


class Dashboard(models.Model):
    """The "Dashboard" row under "Events ledger" on the admin index and in its sidebar
    (#25): the dashboard one click away, not only behind the app's heading.

    Not one of the app's models: it lives in a registry of its own, so it has no table,
    no migration, no content type and no permissions, and nothing that lists the app's
    models (``get_models()``, the checks, a host's tooling) sees it. A proxy or an
    unmanaged model would be all of those; overriding ``admin/index.html`` or
    ``admin/app_list.html`` would take the host's own overrides (or a theme's) away."""

    class Meta:
        apps = Apps()
        app_label = "events_ledger"
        managed = False
        default_permissions = ()
        verbose_name = gettext_lazy("dashboard")
        verbose_name_plural = gettext_lazy("dashboard")


@admin.register(Dashboard)
class DashboardAdmin(admin.ModelAdmin):
    """One URL, the row's link: a redirect to the events ledger's page, which draws the
    dashboard. Shown to whoever may view runs, the dashboard's own permission (S3)."""

    def has_module_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("events_ledger.view_eventrun")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self.has_module_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[Any]:
        # Only the list's URL, the one the index links: no object to add, change or delete.
        name = f"{self.opts.app_label}_{self.opts.model_name}_changelist"
        return [path("", self.admin_site.admin_view(self.dashboard_view), name=name)]

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        # Re-checked here: admin_view has required an active staff user only.
        if not self.has_view_permission(request):
            raise PermissionDenied
        url = reverse(
            "admin:app_list",
            kwargs={"app_label": self.opts.app_label},
            current_app=self.admin_site.name,
        )
        return HttpResponseRedirect(url)


# ── runs ──


@admin.register(EventRun)
class EventRunAdmin(LedgerAdmin):
    list_display = ("run_name", "status_pill", "cleanup_pill", "unresolved", "created")
    list_display_links = ("run_name",)
    list_filter = ("status", "cleanup_status")
    search_fields = ("name", "scope")
    ordering = ("-id",)
    # No foreign keys to join: the one per-row number comes from the annotation.
    list_select_related = False
    actions = ["retry_cleanup", "end_runs"]
    fields = (
        ("name", "scope"),
        ("status_pill", "cleanup_pill", "unresolved"),
        ("created_when", "started_when", "finished_when", "updated_when"),
    )
    readonly_fields = (
        "status_pill",
        "cleanup_pill",
        "unresolved",
        *("created_when", "started_when", "finished_when", "updated_when"),
    )
    created_when = stamp("created_at", gettext_lazy("created at"))
    started_when = stamp("started_at", gettext_lazy("started at"))
    finished_when = stamp("finished_at", gettext_lazy("finished at"))
    updated_when = stamp("updated_at", gettext_lazy("updated at"))
    change_form_template = "events_ledger/admin/eventrun_change_form.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[EventRun]:
        # S3: the count in the same query as the runs, never one query per row.
        return cast(EventRunQuerySet, super().get_queryset(request)).with_unresolved_count()

    def why_kept(self, run: EventRun) -> str | None:
        """Why the console will not delete ``run`` (#25), or None: it must have ended,
        its cleanup be complete (or never required), and the ledger remember nothing of
        it (its rows, reverted or not, are PROTECT: they are the record of what it did)."""
        if not run.is_terminal:
            return _("it is still %(status)s") % {"status": run.status}
        if run.cleanup_status not in (CleanupStatus.COMPLETE, CleanupStatus.NOT_REQUIRED):
            return _("its cleanup is %(status)s") % {"status": run.cleanup_status}
        if Res.filter(run=run).exists():
            return _("the ledger still records what it changed")
        return None

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> Any:
        """delete_selected and the delete page both ask this: a run the console keeps is
        listed as protected, with the reason, on Django's own "Cannot delete" page, and
        nothing is deleted (a permission refused per run gave a bare 403, or "your
        account doesn't have permission" to a superuser, without the reason). What a deletable
        run takes with it (its steps and log) is listed by Django's confirmation page, and
        the deletion is written to the admin's history (LogEntry)."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        # Ledger rows are deleted by nobody: a run that has any is kept, with the reason
        # below, rather than the generic "no permission to delete event run resources".
        perms_needed = set(perms_needed) - {str(Res.model._meta.verbose_name)}
        for run in objs:
            reason = self.why_kept(run)
            if reason is not None:
                protected = [*protected, _("%(run)s: %(reason)s") % {"run": run, "reason": reason}]
        return deleted, counts, perms_needed, protected

    @admin.display(description=gettext_lazy("run"), ordering="id")
    def run_name(self, run: EventRun) -> str:
        # Id and scope under the name: fewer columns, so the list fits beside its filters.
        return format_html(
            '{}<br><span class="el-quiet">#{}{}{}</span>',
            run.name,
            run.pk,
            " · " if run.scope else "",
            run.scope,
        )

    @admin.display(description=gettext_lazy("status"), ordering="status")
    def status_pill(self, run: EventRun) -> str:
        return pill(run.status)

    @admin.display(description=gettext_lazy("cleanup"), ordering="cleanup_status")
    def cleanup_pill(self, run: EventRun) -> str:
        return pill(run.cleanup_status)

    @admin.display(description=gettext_lazy("created → finished"), ordering="created_at")
    def created(self, run: EventRun) -> str:
        # One column for both, so the list fits beside its filters at 1280 pixels.
        start, end = run.created_at, run.finished_at
        same_day = end is not None and timezone.localdate(start) == timezone.localdate(end)
        return format_html(
            '<span class="el-nowrap">{}</span><br><span class="el-nowrap el-quiet">→ {}</span>',
            when(start),
            when(end, TIME_FORMAT if same_day else DATETIME_FORMAT),
        )

    @admin.display(description=gettext_lazy("unresolved"), ordering="unresolved_count")
    def unresolved(self, run: EventRun) -> str:
        count = getattr(run, "unresolved_count", None)
        if count is None:
            count = Res.unresolved_count(run)
        if not count:
            return "0"
        url = reverse("admin:events_ledger_eventrunresource_changelist")
        return format_html(
            '<a href="{}?run__id__exact={}&amp;resolution=unresolved">{}</a>', url, run.pk, count
        )

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: EventRun | None = None,
    ) -> HttpResponse:
        if obj is not None:
            # The rows themselves (refs, errors, claims) are the resources' to show: a
            # user who may view runs but not resources reads their counts only.
            rows_visible = self._has_app_perm(request, "view_eventrunresource")
            rows = list(Res.for_run(obj)[:PAGE_LIMIT]) if rows_visible else []
            log = list(obj.log.order_by("-created_at", "-pk")[:PAGE_LIMIT])
            incomplete = obj.cleanup_status == CleanupStatus.INCOMPLETE
            steps = list(obj.steps.all())
            total = Res.filter(run=obj).count()
            behind = self.waiting_behind(obj, steps)
            if behind and not rows_visible:
                behind = {**behind, "resources": []}
            waits = behind["row_ids"] if behind else set()
            stuck = [(r, r.pk in waits) for r in Res.unresolved_for_run(obj)] if incomplete else []
            # What each step was asked to do: its params, and for a lease the value it
            # found (baseline) and the one it applied, read from the lease's row.
            leased = {
                r.step_id: (r.payload.get("baseline"), r.payload.get("applied"))
                for r in rows
                if r.step_id and isinstance(r.payload, dict) and "baseline" in r.payload
            }
            context.update(
                steps=[(step, asked(step.params), leased.get(step.pk)) for step in steps],
                # #15: the same steps and rows, drawn on one time axis.
                # #25: "not drawn" counts what the run changed, not its @step placeholders.
                timeline=run_timeline(
                    obj,
                    steps,
                    rows,
                    total_rows=Res.filter(run=obj).exclude(kind=STEP_KIND).count(),
                    waiting=waits,
                ),
                ledger=[
                    (r, when(claim_stamp(r)) if r.status == ResourceStatus.REVERTING else "")
                    for r in rows
                ],
                ledger_total=total,
                log=[(e, as_lines(e.detail)) for e in log],
                stuck=stuck,
                # The banner counts what failed, not what only waits behind it (C8).
                failed_count=sum(1 for _, w in stuck if not w),
                waiting_count=sum(1 for _, w in stuck if w),
                behind=behind,
                can_retry=self.has_retry_cleanup_permission(request) and obj.is_terminal,
                page_limit=PAGE_LIMIT,
                rows_visible=rows_visible,
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def waiting_behind(self, run: EventRun, steps: list[EventRunStep]) -> dict[str, Any] | None:
        """C8: the later phase of a finished run that its earlier phases wait behind
        (``Group.behind`` of the human retry's plan, a fixed number of queries for the
        one run of the page), with the earlier phases' names and rows; None when no
        group waits."""
        if not run.is_terminal or not getattr(run, "unresolved_count", 1):
            return None
        held = [g for g in plan_run(run, reset_attempts=True) if g.behind]
        if not held:
            return None
        names = {s.phase_rank: s.phase for s in steps}
        ranks = sorted({g.rank for g in held if g.rank is not None})
        return {
            **(held[0].behind or {}),
            "phases": [names.get(rank) or f"#{rank}" for rank in ranks],
            "row_ids": {r.pk for g in held for r in g.rows},
            "waiting": sum(len(g.rows) for g in held),
        }

    # ── the human retry (C4 with reset_attempts) ──

    @admin.action(
        permissions=["retry_cleanup"], description=gettext_lazy("Retry cleanup (reset attempts)")
    )
    def retry_cleanup(
        self, request: HttpRequest, queryset: QuerySet[EventRun]
    ) -> HttpResponse | None:
        """Modelled on delete_selected: a confirmation page with the plan, then the retry."""
        runs = list(queryset.order_by("pk"))
        if request.POST.get("post"):
            for run in runs:
                self._retry_one(request, run)
            return None  # back to the changelist, with the messages
        context = {
            **self.admin_site.each_context(request),
            "title": _("Retry cleanup"),
            "subtitle": None,
            "opts": self.opts,
            "runs": [
                (run, plan_run(run, reset_attempts=True) if run.is_terminal else None)
                for run in runs
            ],
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "max_attempts": ledger_settings.MAX_REVERT_ATTEMPTS,
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        template = "events_ledger/admin/retry_cleanup_confirmation.html"
        return TemplateResponse(request, template, context)

    def _retry_one(self, request: HttpRequest, run: EventRun) -> None:
        try:
            s = self._retry(request, run)
        except RunNotTerminal as exc:
            self.message_user(request, _("Refused: %(reason)s") % {"reason": exc}, messages.ERROR)
            return
        except Exception as exc:  # one run's failure must not hide the others' results
            logger.exception("retry of run %s failed", run.pk, extra={"run_id": run.pk})
            failure = _("run %(id)s: the retry failed: %(error)s") % {
                "id": run.pk,
                "error": f"{type(exc).__name__}: {exc}",
            }
            self.message_user(request, failure, messages.ERROR)
            return
        levels: dict[str, int] = {
            CleanupStatus.COMPLETE: messages.SUCCESS,
            CleanupStatus.PENDING: messages.WARNING,
        }
        text = _(
            "run %(id)s %(name)s: reverted %(reverted)d, drifted %(drifted)d, "
            "failed %(failed)d, remaining %(remaining)d → cleanup %(status)s"
        ) % {
            "id": run.pk,
            "name": run.name,
            "reverted": s.reverted,
            "drifted": s.drifted,
            "failed": s.failed,
            "remaining": s.remaining,
            "status": s.cleanup_status,
        }
        if s.errors:
            text += f" ({'; '.join(s.errors[:3])})"
        for b in s.behind:
            # C8: what the earlier phases still wait behind once the retry ended.
            text += " " + ngettext(
                "— earlier phases wait behind phase '%(phase)s' (%(rows)d row of it unresolved)",
                "— earlier phases wait behind phase '%(phase)s' (%(rows)d rows of it unresolved)",
                b["rows"],
            ) % {"phase": b["phase"], "rows": b["rows"]}
        self.message_user(request, text, levels.get(s.cleanup_status, messages.ERROR))

    def _retry(self, request: HttpRequest, run: EventRun) -> Any:
        """C4 with the human's reset, written to the admin's history (#25: LogEntry,
        where admins look first) as well as to the run's own log."""
        summary = cleanup_run(run, reset_attempts=True, actor=request.user.get_username())
        self.log_change(
            request,
            run,
            _(
                "Retried cleanup (attempts reset): reverted %(reverted)d, drifted %(drifted)d, "
                "failed %(failed)d, remaining %(remaining)d → cleanup %(status)s"
            )
            % {
                "reverted": summary.reverted,
                "drifted": summary.drifted,
                "failed": summary.failed,
                "remaining": summary.remaining,
                "status": summary.cleanup_status,
            },
        )
        return summary

    # ── an operator ends a run that will not end by itself ──

    @admin.action(permissions=["end_run"], description=gettext_lazy("End the selected runs"))
    def end_runs(self, request: HttpRequest, queryset: QuerySet[EventRun]) -> HttpResponse | None:
        """A confirmation page (the terminal status, a reason), then ``end_run`` for each
        run, written to the run's log and the admin's history."""
        runs = list(queryset.order_by("pk"))
        status = request.POST.get("status", RunStatus.FAILED)
        reason = request.POST.get("reason", "").strip()
        if request.POST.get("post") and status in RUN_TERMINAL and reason:
            for run in runs:
                self._end_one(request, run, status, reason)
            return None
        if request.POST.get("post"):
            self.message_user(
                request, _("Give a terminal status and a reason to end a run."), messages.ERROR
            )
        return self._confirmation(
            request,
            _("End runs"),
            "events_ledger/admin/end_run_confirmation.html",
            runs=runs,
            statuses=RUN_TERMINAL,
            status=status,
            reason=reason,
        )

    def _end_one(self, request: HttpRequest, run: EventRun, status: str, reason: str) -> None:
        actor = request.user.get_username()
        if not end_run(run, status, actor=actor, reason=reason):
            run.refresh_from_db()
            self.message_user(
                request,
                _("run %(id)s had ended already (%(status)s): left as it is")
                % {"id": run.pk, "status": run.status},
                messages.WARNING,
            )
            return
        self.log_change(
            request,
            run,
            _("Ended by hand: %(status)s (%(reason)s)") % {"status": status, "reason": reason},
        )
        self.message_user(
            request,
            _("run %(id)s %(name)s ended: %(status)s; the next sweep gives its ledger back")
            % {"id": run.pk, "name": run.name, "status": status},
            messages.SUCCESS,
        )

    # ── POST /admin/events_ledger/eventrun/<id>/cleanup/ ──

    def get_urls(self) -> list[Any]:
        info = self.opts.app_label, self.opts.model_name
        own = [
            path(
                "<path:object_id>/cleanup/",
                self._non_atomic(self.admin_site.admin_view(self.cleanup_view)),
                name="{}_{}_cleanup".format(*info),
            )
        ]
        return own + super().get_urls()  # before the admin's catch-all <path:object_id>/

    def cleanup_view(self, request: HttpRequest, object_id: str) -> JsonResponse:
        """One run's manual cleanup, answering JSON. admin_view has already required an
        active staff user (else a redirect to the login page) and a CSRF token."""
        if request.method != "POST":
            return JsonResponse(
                {"ok": False, "error": "POST only"}, status=405, headers={"Allow": "POST"}
            )
        # Re-checked here: a URL is not an action, nothing filtered it by permission. Both
        # permissions before the run is looked up, so the answer (403 for every id) tells
        # someone without them nothing of which runs exist (#25).
        if not (self.has_view_permission(request) and self.has_retry_cleanup_permission(request)):
            error = (
                "permissions events_ledger.view_eventrun and events_ledger.retry_cleanup required"
            )
            return JsonResponse({"ok": False, "error": error}, status=403)
        run = self.get_object(request, unquote(object_id))
        if run is None:
            return JsonResponse({"ok": False, "error": f"no run {object_id}"}, status=404)
        try:
            summary = self._retry(request, run)
        except RunNotTerminal as exc:
            return JsonResponse({"ok": False, "run_id": run.pk, "error": str(exc)}, status=409)
        return JsonResponse({"ok": True, **summary.as_dict()}, encoder=DjangoJSONEncoder)


# ── resources ──


class ResolutionFilter(admin.SimpleListFilter):
    title = gettext_lazy("resolution")
    parameter_name = "resolution"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("unresolved", _("unresolved (stuck or owed)")), ("released", _("released"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "unresolved":
            return cast(EventRunResourceQuerySet, queryset).unresolved()
        if self.value() == "released":
            return queryset.exclude(status__in=UNRESOLVED)
        return queryset


@admin.register(EventRunResource)
class EventRunResourceAdmin(LedgerAdmin):
    list_display = ("resource", "run_link", "status_pill", "attempts", "error", "claimed_since")
    list_display_links = ("resource",)
    list_filter = (ResolutionFilter, "status", "owner_module")
    list_select_related = ("run",)
    search_fields = ("ref", "kind", "run__name")
    ordering = ("-id",)
    actions = ["reconcile", "resolve_rows_by_hand"]
    fields = (
        ("run", "step"),
        ("owner_module", "kind", "ref"),
        ("status", "revert_attempts", "claim_count"),
        "last_error",
        ("claim_token", "claimed_since"),
        ("lease_until_when", "member_key"),
        "payload_json",
        ("created_when", "updated_when"),
    )
    readonly_fields = (
        "claimed_since",
        "payload_json",
        *("lease_until_when", "created_when", "updated_when"),
    )
    lease_until_when = stamp("lease_until", gettext_lazy("lease until"))
    created_when = stamp("created_at", gettext_lazy("created at"))
    updated_when = stamp("updated_at", gettext_lazy("updated at"))
    change_form_template = "events_ledger/admin/eventrunresource_change_form.html"

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a ledger row is never deleted by hand: that is losing a resource

    @admin.action(
        permissions=["resolve_by_hand"],
        description=gettext_lazy("Resolve the selected rows by hand (no module call)"),
    )
    def resolve_rows_by_hand(
        self, request: HttpRequest, queryset: QuerySet[EventRunResource]
    ) -> HttpResponse | None:
        """A confirmation page (a reason), then ``resolve_by_hand``: written to each run's
        log and, per row, to the admin's history."""
        rows = list(queryset.select_related("run").order_by("pk"))
        reason = request.POST.get("reason", "").strip()
        if request.POST.get("post") and reason:
            actor = request.user.get_username()
            resolved = resolve_by_hand(rows, actor=actor, reason=reason)
            for row in rows:
                if row.pk not in resolved:
                    continue
                self.log_change(
                    request, row, _("Resolved by hand (%(reason)s)") % {"reason": reason}
                )
            level = messages.SUCCESS if len(resolved) == len(rows) else messages.WARNING
            self.message_user(
                request,
                _(
                    "%(resolved)d of %(asked)d row(s) resolved by hand; a row of a run still "
                    "going, given back already, or being given back now is left as it is"
                )
                % {"resolved": len(resolved), "asked": len(rows)},
                level,
            )
            return None
        if request.POST.get("post"):
            self.message_user(request, _("Give a reason to resolve rows by hand."), messages.ERROR)
        return self._confirmation(
            request,
            _("Resolve rows by hand"),
            "events_ledger/admin/resolve_confirmation.html",
            rows=rows,
            reason=reason,
        )

    def get_queryset(self, request: HttpRequest) -> QuerySet[EventRunResource]:
        return super().get_queryset(request).select_related("run", "step")

    @admin.display(description=gettext_lazy("resource"), ordering="id")
    def resource(self, row: EventRunResource) -> str:
        return format_html(
            '<code>{}:{}</code><br><span class="el-quiet">#{} · {}</span>',
            row.kind,
            row.ref,
            row.pk,
            row.owner_module,
        )

    @admin.display(description=gettext_lazy("run"), ordering="run")
    def run_link(self, row: EventRunResource) -> str:
        url = reverse("admin:events_ledger_eventrun_change", args=[row.run_id])
        return format_html(
            '<a href="{}">run {}</a><br><span class="el-quiet">{}</span>',
            url,
            row.run_id,
            row.run.name,
        )

    @admin.display(description=gettext_lazy("attempts"), ordering="revert_attempts")
    def attempts(self, row: EventRunResource) -> int:
        return row.revert_attempts

    @admin.display(description=gettext_lazy("status"), ordering="status")
    def status_pill(self, row: EventRunResource) -> str:
        return pill(row.status)

    @admin.display(description=gettext_lazy("last error"))
    def error(self, row: EventRunResource) -> str:
        text = row.last_error or ""
        return text if len(text) <= 80 else text[:79] + "…"

    @admin.display(description=gettext_lazy("claimed"))
    def claimed_since(self, row: EventRunResource) -> str:
        stamp = claim_stamp(row)
        return when_cell(stamp) if stamp else ""

    @admin.display(description=gettext_lazy("payload"))
    def payload_json(self, row: EventRunResource) -> str:
        return format_html('<pre class="el-json">{}</pre>', as_json(row.payload, indent=1))

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: EventRunResource | None = None,
    ) -> HttpResponse:
        if obj is not None:
            context.update(
                diagnosis=diagnose(obj),
                can_retry=self.has_retry_cleanup_permission(request) and obj.run.is_terminal,
                max_attempts=ledger_settings.MAX_REVERT_ATTEMPTS,
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    @admin.action(
        permissions=["reconcile_resources"],
        description=gettext_lazy("Reconcile the selected resources' modules"),
    )
    def reconcile(self, request: HttpRequest, queryset: QuerySet[EventRunResource]) -> None:
        """C6 for each owner module among the selection; never forced from here (the
        orphan bound holds; `reconcile_resources --force` is the deliberate override)."""
        owners = sorted(set(queryset.order_by().values_list("owner_module", flat=True).distinct()))
        for owner in owners:
            s = reconcile_module(owner)
            # #25: in the admin's history, on the selected rows of the module it asked.
            for row in queryset.filter(owner_module=owner).order_by("pk")[:PAGE_LIMIT]:
                self.log_change(
                    request,
                    row,
                    _(
                        "Reconciled module %(owner)s: asked %(asked)d, in force %(in_force)d, "
                        "orphaned %(orphaned)d, unanswered %(unanswered)d"
                    )
                    % {
                        "owner": owner,
                        "asked": s.asked,
                        "in_force": s.in_force,
                        "orphaned": s.orphaned,
                        "unanswered": s.unanswered,
                    },
                )
            text = _(
                "%(owner)s: asked %(asked)d, in force %(in_force)d, orphaned %(orphaned)d, "
                "unanswered %(unanswered)d"
            ) % {
                "owner": owner,
                "asked": s.asked,
                "in_force": s.in_force,
                "orphaned": s.orphaned,
                "unanswered": s.unanswered,
            }
            if s.held_back:
                held = _("%(summary)s. Held back: %(reason)s") % {
                    "summary": text,
                    "reason": s.reason,
                }
                self.message_user(request, held, messages.WARNING)
            else:
                level = messages.WARNING if s.unanswered else messages.SUCCESS
                self.message_user(request, text, level)
