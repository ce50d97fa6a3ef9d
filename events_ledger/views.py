"""The metrics view (#15): Prometheus scrapes it with a bearer token, a staff user who may
view runs reads it in the browser. Wire it in the host's URLs: ``path("metrics", metrics)``."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from .metrics import VIEW_PERMISSION, may_view, render, token_matches


def allowed(request: HttpRequest) -> bool:
    """A bearer token equal to ``METRICS_TOKEN``, or the session of a staff user who may
    view runs. A token is checked even when a session is present, so a wrong one is
    refused, not papered over."""
    matches = token_matches(request)
    if matches is not None:
        return matches
    return may_view(getattr(request, "user", None))


@never_cache
@require_http_methods(["GET", "HEAD"])
def metrics(request: HttpRequest) -> HttpResponse:
    if not allowed(request):
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated and token_matches(request) is None:
            return HttpResponse(
                f"A staff user with the permission {VIEW_PERMISSION} only.\n",
                status=403,
                content_type="text/plain",
            )
        response = HttpResponse(
            "A bearer token (EVENTS_LEDGER['METRICS_TOKEN']) or a staff session is needed.\n",
            status=401,
            content_type="text/plain",
        )
        response["WWW-Authenticate"] = 'Bearer realm="events_ledger metrics"'
        return response
    body, content_type = render(request.headers.get("Accept"))
    return HttpResponse(body, content_type=content_type)
