"""``{% ledger_dashboard %}``: the app index's dashboard (#15), a thin shell over the
status snapshot and the pictures made from it; and the console's two filters (#25):
``status_label`` (a status as every page words it) and ``ledger_when`` (a moment as every
page writes it)."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from django import template

from events_ledger import dashboard, states
from events_ledger.dashboard import overview
from events_ledger.status import snapshot

register = template.Library()


@register.inclusion_tag("events_ledger/admin/dashboard.html", takes_context=True)
def ledger_dashboard(context: Any) -> dict[str, Any]:
    request = context.get("request")
    user = getattr(request, "user", None)
    # What the console's lists show, to whoever may read them (S3's view permissions).
    if user is None or not user.has_perm("events_ledger.view_eventrun"):
        return {"dashboard": None}
    shown = overview(snapshot(details=True))
    rows_visible = user.has_perm("events_ledger.view_eventrunresource")
    if not rows_visible:
        # The oldest rows' refs and errors are the resources' to show (S3).
        shown = dataclasses.replace(shown, oldest=[])
    return {"dashboard": shown, "request": request, "rows_visible": rows_visible}


@register.filter
def status_label(value: object) -> str:
    return states.status_label(str(value))


@register.filter
def ledger_when(value: datetime | None) -> str:
    return dashboard.when(value)
