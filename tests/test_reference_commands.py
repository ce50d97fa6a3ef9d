"""docs/commands.md, the commands' reference, cannot drift: each command has its section,
which names every option its parser takes, has an "Exit status" part, and names every
key its ``--json`` output really has."""

from __future__ import annotations

import json
import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command, get_commands, load_command_class
from django.utils import timezone

from tests.factories import ResourceFactory, RunFactory, StepFactory

PAGE = Path(__file__).resolve().parent.parent / "docs" / "commands.md"
COMMANDS = sorted(name for name, app in get_commands().items() if app == "events_ledger")
DJANGO_OPTIONS = {"-h", "--help", "--version", "-v", "--verbosity", "--settings", "--pythonpath"}
DJANGO_OPTIONS |= {"--traceback", "--no-color", "--force-color", "--skip-checks"}


def sections() -> dict[str, str]:
    """Each ``## title`` of the page, and its text up to the next one."""
    parts = re.split(r"^## +(.+?) *$", PAGE.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def in_backticks(word: str, text: str) -> bool:
    """``word`` opens a code span: `--run`, `--run ID`, `RUN_ID`."""
    return re.search(rf"`{re.escape(word)}(?![\w-])[^`\n]*`", text) is not None


def test_every_command_has_a_section_with_an_exit_status_part():  # docs
    found = sections()
    for name in COMMANDS:
        assert name in found, f"docs/commands.md has no section ## {name}"
        assert re.search(r"^\*\*Exit status\.\*\*", found[name], re.M), f"{name}: no exit status"


@pytest.mark.parametrize("name", COMMANDS)
def test_the_section_names_every_option_of_the_command(name):  # docs
    parser = load_command_class("events_ledger", name).create_parser("manage.py", name)
    section = sections()[name]
    for action in parser._actions:
        words = action.option_strings or [action.metavar or action.dest]
        for word in set(words) - DJANGO_OPTIONS:
            assert in_backticks(word, section), f"## {name} does not name `{word}`"


@pytest.fixture
def ledger(db):
    """A run still going with a step in flight, and an ended run whose row used up its
    tries (its cleanup incomplete), so every part of every document has something in it."""
    going = RunFactory(status="running")
    StepFactory(run=going, status="running", claimed_at=timezone.now(), claimed_by="host:1")
    ResourceFactory(run=going)
    ended = RunFactory(status="completed", cleanup_status="incomplete")
    row = ResourceFactory(run=ended, status="drifted", revert_attempts=99, last_error="42")
    return {"going": going.pk, "ended": ended.pk, "row": row.pk}


def objects_at(document: Any, path: str) -> list[Any]:
    """The objects at ``path`` of a document: ``$`` itself, ``$.a.b``, ``*`` every value of
    an object or a list. An object keyed by data (run ids, owners) is not named itself."""
    objects = [document]
    for step in path.split(".")[1:]:
        if step == "*":
            objects = [v for o in objects for v in (o.values() if isinstance(o, dict) else o)]
        else:
            objects = [o[step] for o in objects]
    assert objects, f"nothing at {path}"  # the data must fill every part the test reads
    return objects


JSON_CASES = [
    ("cleanup_runs", "--run {ended}", "$ $.runs.*"),
    ("cleanup_runs", "--dry-run --run {ended} --reset-attempts", "$ $.runs.*.*"),
    ("end_run", "{going} --reason died", "$"),
    ("ledger_status", "", "$ $.runs $.unresolved $.unresolved.modules.* $.unresolved.oldest.*"),
    (
        "ledger_status",
        "",
        "$.steps_in_flight $.steps_in_flight.actions.* $.steps_in_flight.running.*",
    ),
    ("prune_ledger", "--older-than 1d --dry-run", "$"),
    ("prune_ledger", "", "$"),  # no RETENTION: every run is kept
    ("reconcile_resources", "", "$.*"),
    ("resolve_rows", "{row} --reason keep", "$"),
]


@pytest.mark.parametrize(("name", "args", "paths"), JSON_CASES)
def test_the_section_names_every_key_of_the_json_output(ledger, name, args, paths):  # docs
    out = StringIO()
    try:
        call_command(name, *args.format(**ledger).split(), "--json", stdout=out)
    except CommandError as exc:  # exit 1 (incomplete, unhealthy): the document is printed
        assert exc.returncode == 1, exc
    document, section = json.loads(out.getvalue()), sections()[name]
    for path in paths.split():
        for key in (key for part in objects_at(document, path) for key in part):
            assert re.search(rf'[`"]{re.escape(key)}[`"]', section), f"## {name}: no {key!r}"
