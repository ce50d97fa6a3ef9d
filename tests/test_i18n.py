"""The app's words are marked for translation (#13): given a catalog, the admin, the
checks, the "why is this stuck?" notes and the commands speak the user's language."""

from __future__ import annotations

import struct
from io import StringIO
from pathlib import Path

import pytest
from django.contrib import admin
from django.core.management import call_command
from django.urls import reverse
from django.utils import translation

from events_ledger.checks import check_settings
from events_ledger.diagnosis import diagnose
from events_ledger.models import EventRun
from tests.factories import ResourceFactory, RunFactory

#: English as the app writes it → a German a test can recognise.
CATALOG = {
    "Retry cleanup (reset attempts)": "Aufräumen wiederholen (Versuche zurücksetzen)",
    "EVENTS_LEDGER has the unknown key %(key)r.": "EVENTS_LEDGER kennt den Schlüssel %(key)r nicht.",
    "nothing to give back": "nichts zurückzugeben",
    "Nothing: this row is %(status)s, its target is released.": (
        "Nichts: diese Zeile ist %(status)s, ihr Ziel ist frei."
    ),
    "Events ledger": "Ereignisbuch",
    "Why is this stuck?": "Warum hängt das fest?",
    "Retry cleanup of run %(run_id)s…": "Aufräumen von Lauf %(run_id)s wiederholen…",
}


def write_mo(path: Path, messages: dict[str, str]) -> None:
    """A GNU .mo catalog (the format msgfmt writes), so the test needs no gettext tools."""
    entries = sorted((k.encode(), v.encode()) for k, v in {"": "", **messages}.items())
    entries[0] = (b"", b"Content-Type: text/plain; charset=UTF-8\n")
    n = len(entries)
    keys_at, values_at = 28, 28 + 8 * n
    data_at = values_at + 8 * n
    table, blob = [], b""
    for key, _ in entries:
        table.append((len(key), data_at + len(blob)))
        blob += key + b"\0"
    for _, value in entries:
        table.append((len(value), data_at + len(blob)))
        blob += value + b"\0"
    header = struct.pack("<7I", 0x950412DE, 0, n, keys_at, values_at, 0, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(header + b"".join(struct.pack("<2I", *entry) for entry in table) + blob)


@pytest.fixture
def german(settings, tmp_path):
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "django.mo", CATALOG)
    settings.LOCALE_PATHS = [str(tmp_path)]  # resets Django's cached catalogs
    with translation.override("de"):
        yield


def test_the_admins_action_and_the_apps_name(german):
    run_admin = admin.site._registry[EventRun]
    assert (
        str(run_admin.retry_cleanup.short_description) == CATALOG["Retry cleanup (reset attempts)"]
    )
    assert str(EventRun._meta.app_config.verbose_name) == "Ereignisbuch"


def test_a_checks_message(german, settings):
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "NO_SUCH_KEY": 1}
    [warning] = check_settings()
    assert warning.msg == "EVENTS_LEDGER kennt den Schlüssel 'NO_SUCH_KEY' nicht."


@pytest.mark.django_db
def test_why_is_this_stuck(german):
    row = ResourceFactory(run=RunFactory(status="completed"), status="reverted")
    assert diagnose(row).note == "Nichts: diese Zeile ist reverted, ihr Ziel ist frei."


@pytest.mark.django_db
def test_a_commands_output(german):
    out = StringIO()
    call_command("cleanup_runs", stdout=out)
    assert out.getvalue() == "nichts zurückzugeben\n"


@pytest.mark.django_db
def test_the_consoles_pages(german, admin_client):
    run = RunFactory(status="failed", cleanup_status="pending")
    row = ResourceFactory(run=run)
    url = reverse("admin:events_ledger_eventrunresource_change", args=[row.pk])
    html = admin_client.get(url, headers={"accept-language": "de"}).content.decode()
    assert "Warum hängt das fest?" in html
    assert f"Aufräumen von Lauf {run.pk} wiederholen…" in html
