"""The metrics view (#15): Prometheus scrapes it with a bearer token, a staff user reads it
in the browser. Wire it in the host's URLs: ``path("metrics", metrics)``."""

from __future__ import annotations

import hmac

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from .conf import ledger_settings
from .metrics import render


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def allowed(request: HttpRequest) -> bool:
    """A bearer token equal to ``METRICS_TOKEN`` (compared in constant time), or an
    active staff user's session. A token is checked even when a session is present, so
    a wrong one is refused, not papered over."""
    token = _bearer(request)
    expected = ledger_settings.METRICS_TOKEN
    if token is not None:
        return expected is not None and hmac.compare_digest(token.encode(), expected.encode())
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_active and user.is_staff)


@never_cache
@require_http_methods(["GET", "HEAD"])
def metrics(request: HttpRequest) -> HttpResponse:
    if not allowed(request):
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated and _bearer(request) is None:
            return HttpResponse("Staff only.\n", status=403, content_type="text/plain")
        response = HttpResponse(
            "A bearer token (EVENTS_LEDGER['METRICS_TOKEN']) or a staff session is needed.\n",
            status=401,
            content_type="text/plain",
        )
        response["WWW-Authenticate"] = 'Bearer realm="events_ledger metrics"'
        return response
    body, content_type = render(request.headers.get("Accept"))
    return HttpResponse(body, content_type=content_type)
