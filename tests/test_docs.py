"""Every code block in docs/ is executed or validated (issue 6), so the docs cannot drift.

Sybil (https://sybil.readthedocs.io) reads the pages: ``docs/conftest.py`` hands pytest its
collector, so each ``docs/*.md`` page (not README.md) is a file of the suite and each fenced
block one test of it, in page order (``pytest docs``, ``pytest docs/cron.md``, ``-k docs``;
``testpaths`` holds docs/, so every run of the suite runs them). Sybil's Markdown lexers find
the blocks (``RawFencedCodeBlockLexer``, with the whole info string) and the skip markers
(``DirectiveInHTMLCommentLexer``); :func:`parse_page` makes each block a :class:`Block` and
its evaluator hands it to the page's :class:`PageRun`, which does the checking below. A page
is one unit: its blocks share the ``docs_page`` fixture, one per page, with a Django test
database (``transaction=True``, sequences reset so the first run is run 1, flushed after the
page), the demo world clean, the action registry isolated and the settings the page's
fragments set. A block that fails is the page's failing test; the page's later blocks still
run. The block's info string says what it is:

``python``
    Executed; the page's python and pycon blocks share one namespace, in page order.
``python file=PATH``
    A file of the host project. ``file=settings.py`` (any directory) is a settings
    fragment: executed, ``INSTALLED_APPS`` (if set) must list ``events_ledger``, an
    ``EVENTS_LEDGER`` must pass the app's system checks and is applied to the rest of the
    page, and the child processes below execute the fragment as part of their settings.
    A page's fragments are one settings file, pasted in order: only quickstart.md makes the
    ``EVENTS_LEDGER`` dict; on every other page it exists already (the reader's) and a
    fragment may only add keys to it; binding it anew fails (#25).
    Any other path is written under a temporary host directory (packages get an
    ``__init__.py``) and imported; its top-level package becomes an installed app of the
    child processes (so their autodiscovery finds an ``event_actions.py``), and its
    ``test_*`` functions are called. Blocks with the same path are one file, continued.
``pycon``
    Run with doctest (ELLIPSIS, NORMALIZE_WHITESPACE): the shown output must match.
``console``
    ``$ command`` lines, each followed by its expected output (matched as in doctest, and
    only when some is shown). A command exits 0 unless the next line is ``$ echo $?``,
    whose output is the status it must exit with.
``shell``
    Commands without prompts; each must exit 0.

In ``console`` and ``shell`` blocks, ``python manage.py ...`` (with optional ``VAR=value``
prefixes) is run as a real process against the test database (see tests/processes.py),
with the page's settings fragments and host apps; ``pip install`` is validated against
pyproject.toml (the package's name and extras), not run. Any other command fails the
test, except in a shell block marked ``<!-- doctest: skip (why) -->`` on the line before
it (blank lines between are allowed), which is allowed only for commands that need a real
systemd or crontab (systemctl, journalctl, crontab); another ``doctest:`` comment fails.

``crontab``
    Each entry: five valid schedule fields (or an @-schedule) and a /bin/sh command whose
    ``manage.py`` part names a real command with options its own parser accepts; a
    ``cleanup_runs`` entry without ``--loop`` is also run with ``--dry-run`` and must exit 0.
``ini file=NAME.service|NAME.timer``
    A systemd unit, parsed with configparser. A service's ExecStart is checked as a cron
    command is (and must not rely on a shell); a timer needs a schedule (OnCalendar is
    checked with ``systemd-analyze calendar`` where the machine has it) and a service of
    the same page to start.
``yaml file=NAME.yml``
    A Prometheus file (issue 15), parsed with PyYAML. Alert rules (``groups:``): every
    metric an expression names is one the app exposes, with labels it has; a scrape
    config (``scrape_configs:``): its ``metrics_path`` is the app's metrics view in the
    example project, read with a bearer token. Both are also checked with ``promtool``
    where the machine has it (rules first: a config names the page's rule files).

A block with no language, or another language, fails the page, as do an info string that
is not ``LANG key=value ...`` and a fence never closed.

The tests in this file check the parts themselves (the parsing, each check failing on a
wrong block) and what the pages must say (every setting, status, permission).
"""

from __future__ import annotations

import configparser
import doctest
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, get_commands, load_command_class
from django.test import TransactionTestCase, override_settings
from sybil import Document, Example, Region, Sybil
from sybil.example import SybilFailure
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, RawFencedCodeBlockLexer

from events_ledger import registry
from events_ledger.checks import check_settings
from events_ledger.conf import DEFAULTS
from tests.processes import ROOT, child_env

DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
REQUIRED_PAGES = {
    "monitoring.md",
    "production.md",
    "quickstart.md",
    "actions-and-leases.md",
    "cron.md",
    "settings.md",
    "console.md",
    "statuses.md",
}

KNOWN_LANGUAGES = {"python", "pycon", "console", "shell", "crontab", "ini", "yaml"}
#: Commands a skipped shell block may hold: they need a real systemd or crontab.
NEEDS_THE_MACHINE = {"systemctl", "journalctl", "crontab"}
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}
CHILD_SETTINGS = "docs_host_settings"
#: The page that makes the one ``EVENTS_LEDGER`` dict; the others add keys to it (#25).
SETTINGS_PAGE = "quickstart.md"


class DocError(AssertionError):
    """A block of the docs does not do what the page says."""


# ── the pages, read by Sybil ──


class Fences(RawFencedCodeBlockLexer):
    """Sybil's lexer of fenced code blocks, with the whole info string. As in CommonMark, a
    fence closes a block only alone on its line (Sybil's own also takes ```` ```pycon ````);
    a block never closed is kept, marked, and fails the page."""

    def __init__(self) -> None:
        super().__init__(info_pattern=re.compile(r"(?P<info>[^\n]*)(?:\n|\Z)"))

    @staticmethod
    def match_closes_existing(current: re.Match[str], existing: re.Match[str]) -> bool:
        end = current.string.find("\n", current.end())
        rest = current.string[current.end() : None if end == -1 else end]
        return RawFencedCodeBlockLexer.match_closes_existing(current, existing) and not rest.strip()

    def make_region(
        self, opening: re.Match[str], document: Document, closing: re.Match[str] | None
    ) -> Region | None:
        region = super().make_region(opening, document, closing)
        if region is not None:
            region.lexemes["closed"] = closing is not None
        return region


FENCES = Fences()
#: ``<!-- doctest: ... -->``; its arguments must be ``skip (why)``.
DIRECTIVES = DirectiveInHTMLCommentLexer(directive="doctest")
SKIP = re.compile(r"skip\s*\((?P<why>[^)]+)\)")


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    attrs: dict[str, str]
    source: str
    skip: str | None = None  # the reason of a skip marker right above the block
    problem: str | None = None  # what is wrong with the block as written, found by the parser

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def parse_page(document: Document) -> Iterator[Region]:
    """Sybil's parser of a docs page: each fenced block, in order, is one example whose
    ``parsed`` is a :class:`Block` (with the skip marker right above it, if any) and whose
    evaluator hands it to the page's :class:`PageRun`. Indented code blocks are not used
    by these docs. A malformed block is still an example: it fails when it is evaluated."""
    page = Path(document.path).name
    fences = list(FENCES(document))
    markers = [
        m for m in DIRECTIVES(document) if not any(f.start <= m.start < f.end for f in fences)
    ]
    for fence in fences:
        info = fence.lexemes["info"].strip()
        problem = None if fence.lexemes["closed"] else "the code fence is never closed"
        try:
            words = shlex.split(info)
        except ValueError as exc:
            words, problem = [], problem or f"the info string {info!r} does not parse: {exc}"
        attrs: dict[str, str] = {}
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep:
                problem = problem or f"attributes are key=value, not {word!r}"
            attrs[key] = value
        skip = None
        for marker in markers:
            # Right above: only the comment's end and blank lines between them.
            if re.fullmatch(r"-*->\s*", document.text[marker.end : fence.start]):
                why = SKIP.fullmatch(marker.lexemes["arguments"].strip())
                if why is None:
                    problem = problem or (
                        f"<!-- doctest: {marker.lexemes['arguments']} -->: the one directive "
                        "is `skip (why)`"
                    )
                skip = why["why"] if why else None
        block = Block(
            page,
            document.text.count("\n", 0, fence.start) + 1,
            words[0] if words else "",
            attrs,
            str(fence.lexemes["source"]),
            skip,
            problem,
        )
        yield Region(fence.start, fence.end, parsed=block, evaluator=evaluate)


def evaluate(example: Example) -> str | None:
    """Sybil's evaluator: the block runs in its page's :class:`PageRun` (the ``docs_page``
    fixture); what the page says wrongly comes back as the example's failure."""
    try:
        example.namespace["docs_page"].run(example.parsed)
    except DocError as exc:
        return str(exc)
    return None


#: The docs pages, collected by ``docs/conftest.py``: each page is a file of the suite, each
#: block one of its tests, all sharing the page's ``docs_page``.
PAGES_SYBIL = Sybil(parsers=[parse_page], path=str(DOCS), patterns=["*.md"], fixtures=["docs_page"])


def page_blocks(text: str, page: str = "page.md") -> list[Block]:
    """The blocks Sybil finds in a page's text, in order."""
    document = Document(text, str(DOCS / page))
    for region in parse_page(document):
        document.add(region)
    return [example.parsed for example in document.examples()]


def check_kind(block: Block) -> None:
    """Every block is of a kind this test executes or validates."""
    if block.problem is not None:
        raise DocError(f"{block.where}: {block.problem}")
    if not block.lang:
        raise DocError(
            f"{block.where}: a code block without a language (name one of "
            f"{', '.join(sorted(KNOWN_LANGUAGES))})"
        )
    if block.lang not in KNOWN_LANGUAGES:
        raise DocError(
            f"{block.where}: the language {block.lang!r} is not executed by tests/test_docs.py"
        )
    allowed = {"python": {"file"}, "ini": {"file"}, "yaml": {"file"}}.get(block.lang, set())
    if set(block.attrs) - allowed:
        raise DocError(f"{block.where}: unknown attributes {sorted(set(block.attrs) - allowed)}")
    if block.lang == "python" and "file" in block.attrs and not block.attrs["file"].endswith(".py"):
        raise DocError(f"{block.where}: a python file= must end in .py")
    if block.lang == "ini" and not re.search(r"\.(service|timer)$", block.attrs.get("file", "")):
        raise DocError(
            f"{block.where}: an ini block is a systemd unit: file=NAME.service or NAME.timer"
        )
    if block.lang == "yaml" and not re.search(r"\.ya?ml$", block.attrs.get("file", "")):
        raise DocError(
            f"{block.where}: a yaml block is a Prometheus file: file=NAME.yml (rules or a "
            "scrape config)"
        )
    if block.skip is not None:
        if block.lang != "shell":
            raise DocError(f"{block.where}: only a shell block may be skipped, not {block.lang}")
        for _, command in shell_commands(block.source):
            words = shlex.split(command)
            words = words[1:] if words[:1] == ["sudo"] else words
            if not words or words[0] not in NEEDS_THE_MACHINE:
                raise DocError(
                    f"{block.where}: a skipped block may only hold commands that need a real "
                    f"systemd or crontab ({', '.join(sorted(NEEDS_THE_MACHINE))}), not {command!r}"
                )


# ── shell text ──


def shell_commands(source: str) -> Iterator[tuple[int, str]]:
    """(line offset, command) of a prompt-less block: comments dropped, ``\\`` joined."""
    pending, first = "", 0
    for n, line in enumerate(source.splitlines()):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            first = n
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield first, pending + stripped
        pending = ""
    if pending:
        yield first, pending


@dataclass
class Command:
    offset: int
    text: str
    expected: list[str] = field(default_factory=list)


def console_commands(source: str) -> list[Command]:
    commands: list[Command] = []
    continuing = False
    for n, line in enumerate(source.splitlines()):
        if continuing:
            commands[-1].text += " " + line.strip().removesuffix("\\").strip()
            continuing = line.rstrip().endswith("\\")
        elif line.startswith("$ "):
            commands.append(Command(n, line[2:].strip().removesuffix("\\").strip()))
            continuing = line.rstrip().endswith("\\")
        elif commands:
            commands[-1].expected.append(line)
        elif line.strip():
            raise DocError(f"console text before the first $ prompt: {line!r}")
    return commands


def output_matches(expected: str, got: str) -> bool:
    return doctest.OutputChecker().check_output(
        expected, got, doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def is_python(word: str) -> bool:
    return re.fullmatch(r"python(3(\.\d+)?)?", Path(word).name) is not None


def check_manage(words: list[str], where: str) -> tuple[str, list[str]]:
    """``[python] [path/]manage.py COMMAND ARGS``: a real command whose own parser
    accepts the options. Answers the command's name and arguments."""
    at = next((i for i, w in enumerate(words) if Path(w).name == "manage.py"), None)
    if at is None or at > 1 or (at == 1 and not is_python(words[0])):
        raise DocError(f"{where}: not a manage.py command: {shlex.join(words)!r}")
    if len(words) < at + 2:
        raise DocError(f"{where}: manage.py without a command")
    name, args = words[at + 1], words[at + 2 :]
    commands = get_commands()
    if name not in commands:
        raise DocError(f"{where}: manage.py has no command {name!r}")
    app = commands[name]
    command = app if not isinstance(app, str) else load_command_class(app, name)
    try:
        command.create_parser("manage.py", name).parse_args(args)
    except CommandError as exc:  # a parser not called from the command line raises this
        raise DocError(f"{where}: manage.py {name} refuses {shlex.join(args)!r}: {exc}") from None
    return name, args


PIP_INSTALL = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)(\[(?P<extras>[A-Za-z0-9_,.-]+)\])?")


#: pip options whose value is the next word (#25: the wheel found in a directory).
PIP_VALUE_OPTIONS = {"--find-links", "-f"}
#: Tools a page may have the reader install beside the package (#25: the wheel's build).
PIP_TOOLS = {"build"}


def check_pip(words: list[str], where: str) -> None:
    """``pip install NAME[EXTRAS]`` names this package and extras it declares (or a
    tool of ``PIP_TOOLS``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    rest = iter(words[2:])
    for word in rest:
        if word in PIP_VALUE_OPTIONS:
            next(rest, None)
            continue
        if word.startswith("-") or word in PIP_TOOLS:
            continue
        wanted = PIP_INSTALL.fullmatch(word)
        if wanted is None or re.sub(r"[-_.]+", "-", wanted["name"]).lower() != project["name"]:
            raise DocError(f"{where}: pip install {word!r}: the package is {project['name']!r}")
        extras = set(filter(None, (wanted["extras"] or "").split(",")))
        unknown = extras - set(project.get("optional-dependencies", {}))
        if unknown:
            raise DocError(
                f"{where}: pip install {word!r}: no extras {sorted(unknown)} in pyproject.toml"
            )


def check_build(args: list[str], where: str) -> None:
    """``python -m build [--wheel] [--sdist] [--outdir DIR] CHECKOUT``, with ``build``'s own
    options (#25: the package is installed from a checkout)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m build", exit_on_error=False)
    parser.add_argument("srcdir")
    parser.add_argument("--wheel", "-w", action="store_true")
    parser.add_argument("--sdist", "-s", action="store_true")
    parser.add_argument("--outdir", "-o")
    try:
        parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise DocError(f"{where}: python -m build refuses {shlex.join(args)!r}: {exc}") from None


def check_wheel(args: list[str], where: str) -> None:
    """``pip wheel --no-deps --wheel-dir DIR git+file:///CLONE``: the wheel built from a copy
    of a clone's commit, nothing written into the clone."""
    import argparse

    parser = argparse.ArgumentParser(prog="pip wheel", exit_on_error=False)
    parser.add_argument("source")
    parser.add_argument("--no-deps", action="store_true")
    parser.add_argument("--wheel-dir", "-w", required=True)
    try:
        found = parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise DocError(f"{where}: pip wheel refuses {shlex.join(args)!r}: {exc}") from None
    if not (found.no_deps and found.source.startswith("git+file:///")):
        raise DocError(f"{where}: pip wheel --no-deps from a git+file:/// clone, not {args!r}")


CRON_FIELDS = [  # (low, high, names)
    (0, 59, []),
    (0, 23, []),
    (1, 31, []),
    (1, 12, ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]),
    (0, 7, ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]),
]
CRON_SPECIALS = {
    "@reboot",
    "@yearly",
    "@annually",
    "@monthly",
    "@weekly",
    "@daily",
    "@midnight",
    "@hourly",
}


def check_cron_field(value: str, low: int, high: int, names: list[str]) -> bool:
    def number(word: str) -> int | None:
        if word.isdigit():
            return int(word) if low <= int(word) <= high else None
        if word.lower() in names:
            return names.index(word.lower()) + low
        return None

    for part in value.split(","):
        m = re.fullmatch(r"(?P<range>\*|(?P<a>\w+)(-(?P<b>\w+))?)(/(?P<step>\d+))?", part)
        if m is None or (m["step"] is not None and int(m["step"]) == 0):
            return False
        if m["a"] is not None:
            a = number(m["a"])
            b = number(m["b"]) if m["b"] is not None else a
            if a is None or b is None or a > b:
                return False
    return True


# ── one page ──


class PageRun:
    """Executes one page's blocks in order, keeping what they share."""

    def __init__(self, page: str, tmp: Path, settings: Any) -> None:
        self.page, self.settings = page, settings
        self.host, self.media = tmp / "host", tmp / "media"
        self.host.mkdir()
        self.media.mkdir()
        settings.MEDIA_ROOT = str(self.media)
        self.ns: dict[str, Any] = {"__name__": f"docs.{Path(page).stem}"}
        self.fragments: list[Block] = []
        #: The page's settings.py, fragment after fragment (see settings_fragment).
        # What startproject's settings.py defines above the fragments pasted at its end.
        self.settings_ns: dict[str, Any] = {
            "__name__": "settings",
            "BASE_DIR": self.host,
            "DATABASES": {
                "default": {
                    "ENGINE": "django.db.backends.sqlite3",
                    "NAME": self.host / "db.sqlite3",
                }
            },
        }
        if page != SETTINGS_PAGE:
            self.settings_ns["EVENTS_LEDGER"] = {}
        self.files: dict[str, str] = {}
        self.apps: list[str] = []
        self.registered: tuple[set[str], set[str]] = (set(), set())
        self.units: set[str] = set()
        self.prometheus = tmp / "prometheus"
        sys.path.insert(0, str(self.host))

    def close(self) -> None:
        sys.path.remove(str(self.host))
        self.forget_modules()

    def forget_modules(self) -> None:
        for name in list(sys.modules):
            if name.split(".")[0] in self.apps:
                del sys.modules[name]
        importlib.invalidate_caches()

    def run(self, block: Block) -> None:
        check_kind(block)
        if block.lang == "python" and "file" in block.attrs:
            if Path(block.attrs["file"]).name == "settings.py":
                self.settings_fragment(block)
            else:
                self.host_file(block)
        elif block.lang == "python":
            exec(compile(block.source, block.where, "exec"), self.ns)
        elif block.lang == "pycon":
            self.pycon(block)
        elif block.lang == "console":
            self.console(block)
        elif block.lang == "shell":
            self.shell(block)
        elif block.lang == "crontab":
            self.crontab(block)
        elif block.lang == "ini":
            self.unit(block)
        elif block.lang == "yaml":
            self.prometheus_file(block)

    # ── python ──

    def settings_fragment(self, block: Block) -> None:
        # #25: a page's fragments are one settings.py, pasted in order. The quick start
        # makes the one EVENTS_LEDGER dict; every other page finds it made (the reader's
        # own) and only adds keys to it: a fragment that binds it anew would silently drop
        # the keys another page or fragment set (a METRICS_TOKEN lost, Prometheus at 401).
        ns = self.settings_ns
        before = ns.get("EVENTS_LEDGER")
        keys_before = dict(before) if before is not None else None
        exec(compile(block.source, block.where, "exec"), ns)
        if before is not None and ns.get("EVENTS_LEDGER") is not before:
            ns["EVENTS_LEDGER"] = before
            raise DocError(
                f"{block.where}: binds EVENTS_LEDGER anew, dropping the keys set before it "
                "(pasted in order, settings overwrite each other): add keys instead, "
                "EVENTS_LEDGER[KEY] = ... or EVENTS_LEDGER.update(...)"
            )
        apps = ns.get("INSTALLED_APPS")
        if apps is not None and "events_ledger" not in apps:
            raise DocError(f"{block.where}: INSTALLED_APPS does not list events_ledger")
        for app in apps or []:
            # The reader's own app, which exists in their project: an empty package here,
            # filled by the page's file= blocks.
            if isinstance(app, str) and "." not in app and importlib.util.find_spec(app) is None:
                (self.host / app).mkdir(exist_ok=True)
                (self.host / app / "__init__.py").touch()
                self.apps.append(app)
        if "EVENTS_LEDGER" in ns and ns["EVENTS_LEDGER"] != keys_before:
            self.settings.EVENTS_LEDGER = dict(ns["EVENTS_LEDGER"])
            problems = check_settings()
            if problems:
                raise DocError(f"{block.where}: EVENTS_LEDGER fails the checks: {problems}")
        self.fragments.append(block)

    def host_file(self, block: Block) -> None:
        rel = block.attrs["file"]
        path = self.host / rel
        previous = self.files.get(rel)
        self.files[rel] = block.source if previous is None else previous + "\n" + block.source
        for parent in list(path.parents)[: len(Path(rel).parts) - 1]:
            parent.mkdir(parents=True, exist_ok=True)
            (parent / "__init__.py").touch()
        path.write_text(self.files[rel])
        app = Path(rel).parts[0].removesuffix(".py")
        if app not in self.apps:
            self.apps.append(app)
        # Import every host file afresh, against the registry as it was before them.
        actions, leases = self.registered
        for action_id in actions:
            registry.default_registry.actions.pop(action_id, None)
        for lease_id in leases:
            registry.default_registry.leases.pop(lease_id, None)
        self.forget_modules()
        before = (set(registry.default_registry.actions), set(registry.default_registry.leases))
        modules = {}
        for name in self.files:
            modules[name] = importlib.import_module(name.removesuffix(".py").replace("/", "."))
        self.registered = (
            set(registry.default_registry.actions) - before[0],
            set(registry.default_registry.leases) - before[1],
        )
        for name, fn in sorted(vars(modules[rel]).items()):
            if name.startswith("test_") and callable(fn):
                fn()

    def pycon(self, block: Block) -> None:
        test = doctest.DocTestParser().get_doctest(
            block.source, self.ns, block.where, f"docs/{block.page}", block.line
        )
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        report: list[str] = []
        runner.run(test, out=report.append, clear_globs=False)
        self.ns.update(test.globs)
        if runner.failures:
            raise DocError("".join(report))

    # ── commands ──

    def write_child_settings(self) -> None:
        lines = [
            f'"""Settings of the child processes of docs/{self.page} (written by tests/test_docs.py)."""',
            "from tests.child_settings import *  # noqa: F403",
            "from tests.child_settings import INSTALLED_APPS",
            "_BASE_APPS = list(INSTALLED_APPS)",
        ]
        if self.page != SETTINGS_PAGE:
            lines.append("EVENTS_LEDGER = dict(EVENTS_LEDGER)  # the reader's own, made before")
        lines += [f"exec(compile({b.source!r}, {b.where!r}, 'exec'))" for b in self.fragments]
        lines += [
            "INSTALLED_APPS = _BASE_APPS + [a for a in INSTALLED_APPS if isinstance(a, str) and a not in _BASE_APPS]",
            f"INSTALLED_APPS += [a for a in {self.apps!r} if a not in INSTALLED_APPS]",
            f"MEDIA_ROOT = {str(self.media)!r}",
        ]
        (self.host / f"{CHILD_SETTINGS}.py").write_text("\n".join(lines) + "\n")

    def execute(self, command: str, where: str) -> subprocess.CompletedProcess[str]:
        words = shlex.split(command, comments=True)
        env, words = split_env(words)
        if words[:2] == ["pip", "install"] or (
            len(words) > 3 and is_python(words[0]) and words[1:4] == ["-m", "pip", "install"]
        ):
            check_pip(words if words[0] == "pip" else words[2:], where)
            return subprocess.CompletedProcess(words, 0, "", "")
        if words[:2] == ["pip", "wheel"]:
            check_wheel(words[2:], where)  # run for real by tests/test_install.py
            return subprocess.CompletedProcess(words, 0, "", "")
        if len(words) > 2 and is_python(words[0]) and words[1:3] == ["-m", "build"]:
            check_build(words[3:], where)  # run for real by tests/test_install.py
            return subprocess.CompletedProcess(words, 0, "", "")
        if not words or not is_python(words[0]) or words[1:2] != ["manage.py"]:
            raise DocError(
                f"{where}: tests/test_docs.py runs only python manage.py and pip install, "
                f"not {command!r}"
            )
        check_manage(words, where)
        self.write_child_settings()
        child = child_env()
        child.update(env)
        child["DJANGO_SETTINGS_MODULE"] = CHILD_SETTINGS
        child["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(self.host)])
        return subprocess.run(
            [sys.executable, "manage.py", *words[2:]],
            cwd=ROOT,
            env=child,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def console(self, block: Block) -> None:
        commands = console_commands(block.source)
        status: int | None = None
        for n, command in enumerate(commands):
            where = f"docs/{block.page}:{block.line + 1 + command.offset}"
            if command.text == "echo $?":
                got = f"{status}\n"
            else:
                done = self.execute(command.text, where)
                status, got = done.returncode, done.stdout + done.stderr
                follows = commands[n + 1] if n + 1 < len(commands) else None
                said = int(follows.expected[0]) if follows and follows.text == "echo $?" else 0
                if status != said:
                    raise DocError(
                        f"{where}: `{command.text}` exited {status}, the page says {said}:\n{got}"
                    )
            expected = "\n".join(command.expected).strip("\n")
            if expected and not output_matches(expected + "\n", got):
                raise DocError(
                    f"{where}: `{command.text}` printed\n{got}\nthe page shows\n{expected}"
                )

    def shell(self, block: Block) -> None:
        if block.skip is not None:
            return  # check_kind has limited it to commands that need the machine
        for offset, command in shell_commands(block.source):
            where = f"docs/{block.page}:{block.line + 1 + offset}"
            done = self.execute(command, where)
            if done.returncode != 0:
                raise DocError(
                    f"{where}: `{command}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
                )

    # ── crontab and systemd ──

    def scheduled_command(self, words: list[str], where: str) -> None:
        """A cron or systemd command: a real manage.py command with valid options; a single
        sweep also runs with --dry-run against the test database, and must exit 0."""
        name, args = check_manage(words, where)
        if name == "cleanup_runs" and not any(a.split("=")[0] == "--loop" for a in args):
            dry = self.execute(shlex.join(["python", "manage.py", name, *args, "--dry-run"]), where)
            if dry.returncode != 0:
                raise DocError(
                    f"{where}: {name} {shlex.join(args)} --dry-run exited {dry.returncode}:\n"
                    f"{dry.stdout}{dry.stderr}"
                )

    def crontab(self, block: Block) -> None:
        for n, line in enumerate(block.source.splitlines()):
            where = f"docs/{block.page}:{block.line + 1 + n}"
            entry = line.strip()
            if (
                not entry
                or entry.startswith("#")
                or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\s*=.*", entry)
            ):
                continue
            if entry.startswith("@"):
                special, _, command = entry.partition(" ")
                if special not in CRON_SPECIALS:
                    raise DocError(f"{where}: unknown schedule {special!r}")
            else:
                fields = entry.split(None, 5)
                if len(fields) < 6:
                    raise DocError(
                        f"{where}: a crontab entry has five schedule fields and a command"
                    )
                for value, (low, high, names) in zip(fields[:5], CRON_FIELDS, strict=True):
                    if not check_cron_field(value, low, high, names):
                        raise DocError(
                            f"{where}: {value!r} is not a valid schedule field ({low}-{high})"
                        )
                command = fields[5]
            if re.search(r"(?<!\\)%", command):
                raise DocError(f"{where}: cron turns an unescaped % into a newline")
            self.cron_command(command.strip(), where)

    def cron_command(self, command: str, where: str) -> None:
        segments: list[list[str]] = [[]]
        for word in shlex.split(command):  # operators are written between spaces in these docs
            if word in SHELL_OPERATORS:
                segments.append([])
            else:
                segments[-1].append(word)
        ran = False
        for words in segments:
            _, words = split_env(words)
            words = strip_redirections(words)
            if words[:1] == ["cd"] and len(words) == 2:
                continue
            if any(Path(w).name == "manage.py" for w in words):
                self.scheduled_command(words, where)
                ran = True
                continue
            raise DocError(
                f"{where}: cron runs {shlex.join(words)!r}: only cd and manage.py are checked"
            )
        if not ran:
            raise DocError(f"{where}: the entry runs no manage.py command")

    def unit(self, block: Block) -> None:
        name = Path(block.attrs["file"]).name
        parser = configparser.ConfigParser(
            interpolation=None, strict=False, delimiters=("=",), comment_prefixes=("#", ";")
        )
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        try:
            parser.read_string(block.source, source=block.where)
        except configparser.Error as exc:
            raise DocError(f"{block.where}: not a unit file: {exc}") from None
        unknown = set(parser.sections()) - {"Unit", "Service", "Timer", "Install"}
        if unknown:
            raise DocError(f"{block.where}: unknown sections {sorted(unknown)}")
        if name.endswith(".service"):
            self.service(block, parser)
        else:
            self.timer(block, parser, name)
        self.units.add(name)

    def service(self, block: Block, unit: configparser.ConfigParser) -> None:
        if not unit.has_option("Service", "ExecStart"):
            raise DocError(f"{block.where}: a service needs [Service] ExecStart=")
        words = shlex.split(unit["Service"]["ExecStart"])
        if any(w in SHELL_OPERATORS or re.match(r"\d?>", w) for w in words):
            raise DocError(
                f"{block.where}: systemd runs ExecStart without a shell: {shlex.join(words)!r}"
            )
        if not words[0].startswith("/"):
            raise DocError(f"{block.where}: ExecStart's program is an absolute path")
        manage = next((w for w in words if Path(w).name == "manage.py"), "")
        if not manage.startswith("/") and not unit.has_option("Service", "WorkingDirectory"):
            raise DocError(f"{block.where}: a relative manage.py needs WorkingDirectory=")
        loops = any(w.split("=")[0] == "--loop" for w in words)
        kind = unit["Service"].get("Type", "simple")
        if loops == (kind == "oneshot"):
            raise DocError(
                f"{block.where}: Type={kind} with{'' if loops else 'out'} --loop: a single "
                "sweep is a oneshot (a timer starts it), a loop is a long-running service"
            )
        self.scheduled_command(words, block.where)

    def timer(self, block: Block, unit: configparser.ConfigParser, name: str) -> None:
        schedules = {
            "OnCalendar",
            "OnActiveSec",
            "OnBootSec",
            "OnStartupSec",
            "OnUnitActiveSec",
            "OnUnitInactiveSec",
        }
        if not unit.has_section("Timer") or not schedules & set(unit["Timer"]):
            raise DocError(f"{block.where}: a timer needs [Timer] with a schedule")
        calendar = unit["Timer"].get("OnCalendar")
        analyze = shutil.which("systemd-analyze")
        if calendar and analyze:
            done = subprocess.run([analyze, "calendar", calendar], capture_output=True, text=True)
            if done.returncode != 0:
                raise DocError(f"{block.where}: OnCalendar={calendar}: {done.stderr.strip()}")
        service = unit["Timer"].get("Unit", name.removesuffix(".timer") + ".service")
        if service not in self.units:
            raise DocError(
                f"{block.where}: the timer starts {service}, which the page does not define above it"
            )
        if not unit.has_section("Install") or unit["Install"].get("WantedBy") != "timers.target":
            raise DocError(
                f"{block.where}: a timer is enabled with [Install] WantedBy=timers.target"
            )

    # ── Prometheus ──

    def prometheus_file(self, block: Block) -> None:
        import yaml

        try:
            doc = yaml.safe_load(block.source)
        except yaml.YAMLError as exc:
            raise DocError(f"{block.where}: not YAML: {exc}") from None
        if isinstance(doc, dict) and "groups" in doc:
            check_rules(doc, block.where)
            command = "rules"
        elif isinstance(doc, dict) and "scrape_configs" in doc:
            check_scrape_configs(doc, block.where)
            command = "config"
        else:
            raise DocError(
                f"{block.where}: neither alert rules (groups:) nor a scrape config "
                "(scrape_configs:)"
            )
        self.prometheus.mkdir(exist_ok=True)
        path = self.prometheus / Path(block.attrs["file"]).name
        path.write_text(block.source)
        for job in doc.get("scrape_configs") or []:
            secret = (job.get("authorization") or {}).get("credentials_file")
            if secret and not Path(secret).is_absolute():
                # The reader's secret, beside their prometheus.yml: promtool reads it.
                (self.prometheus / secret).write_text("a-token-of-the-readers-own\n")
        promtool = shutil.which("promtool")
        if promtool:
            done = subprocess.run(
                [promtool, "check", command, str(path)],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise DocError(
                    f"{block.where}: promtool check {command}:\n{done.stdout}{done.stderr}"
                )


METRIC_REF = re.compile(r"\b(?P<name>events_ledger_[a-z0-9_]+)\b(?:\{(?P<matchers>[^}]*)\})?")


def exposed_metrics() -> dict[str, set[str]]:
    """Every series name the app exposes (gauges, counters' ``_total``, a histogram's
    ``_bucket``/``_count``/``_sum``), with its label names."""
    from events_ledger import metrics

    metrics.install()
    out: dict[str, set[str]] = {}
    # The history's gauges too: an alert on the archive's age is as checkable as any.
    for collector in (metrics.LedgerCollector(), metrics.HistoryCollector()):
        for family in collector.describe():
            out[family.name] = set(family._labelnames)
    counters = metrics._counters
    assert counters is not None
    for metric in vars(counters).values():
        name, labels = metric._name, set(metric._labelnames)
        if metric._type == "counter":
            out[f"{name}_total"] = labels
        elif metric._type == "histogram":
            out[f"{name}_bucket"] = labels | {"le"}
            out[f"{name}_count"] = out[f"{name}_sum"] = labels
    return out


def check_rules(doc: dict[str, Any], where: str) -> None:
    exposed = exposed_metrics()
    groups = doc.get("groups")
    if not isinstance(groups, list) or not groups:
        raise DocError(f"{where}: groups is a list of rule groups")
    for group in groups:
        if not group.get("name") or not isinstance(group.get("rules"), list):
            raise DocError(f"{where}: a group needs a name and rules")
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            expr = rule.get("expr")
            if not name or not isinstance(expr, str):
                raise DocError(f"{where}: a rule needs alert (or record) and expr: {rule}")
            refs = list(METRIC_REF.finditer(expr))
            if not refs:
                raise DocError(f"{where}: {name} names no metric of the app: {expr}")
            labels: set[str] = set()
            for ref in refs:
                if ref["name"] not in exposed:
                    raise DocError(f"{where}: {name}: the app exposes no {ref['name']}")
                known = exposed[ref["name"]]
                labels |= known
                for matcher in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", ref["matchers"] or ""):
                    if matcher not in known:
                        raise DocError(f"{where}: {name}: {ref['name']} has no label {matcher!r}")
            for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                for label in filter(None, (g.strip() for g in grouping.split(","))):
                    if label not in labels:
                        raise DocError(
                            f"{where}: {name}: no metric it reads has the label {label!r}"
                        )
            templated = " ".join(str(v) for v in (rule.get("annotations") or {}).values())
            for label in re.findall(r"\$labels\.(\w+)", templated):
                if label not in labels:
                    raise DocError(f"{where}: {name}: its annotations name the label {label!r}")


def check_scrape_configs(doc: dict[str, Any], where: str) -> None:
    from django.urls import Resolver404, resolve

    from events_ledger.views import metrics

    for job in doc["scrape_configs"]:
        path = job.get("metrics_path", "/metrics")
        try:
            match = resolve(path)
        except Resolver404:
            raise DocError(f"{where}: {job.get('job_name')}: nothing is served at {path}") from None
        if match.func is not metrics:
            raise DocError(f"{where}: {path} is not the ledger's metrics view")
        auth = job.get("authorization") or {}
        if str(auth.get("type", "Bearer")).lower() != "bearer" or not (
            auth.get("credentials") or auth.get("credentials_file")
        ):
            raise DocError(f"{where}: the metrics view reads a bearer token (authorization:)")


def strip_redirections(words: list[str]) -> list[str]:
    out, skip_next = [], False
    for word in words:
        if skip_next:
            skip_next = False
            continue
        m = re.fullmatch(r"(\d?)(>>?|<)(&\d)?(.*)", word)
        if m is None:
            out.append(word)
        elif not m[3] and not m[4]:
            skip_next = True  # `> file`: the file is the next word
    return out


# ── one page, one database ──


class PageSettings:
    """Settings changed by one page and put back after it, as pytest-django's ``settings``
    fixture does for one test (which cannot outlive a test: a page is many)."""

    def __init__(self) -> None:
        object.__setattr__(self, "overrides", [])

    def __setattr__(self, name: str, value: Any) -> None:
        override = override_settings(**{name: value})
        override.enable()
        self.overrides.append(override)

    def __getattr__(self, name: str) -> Any:
        from django.conf import settings

        return getattr(settings, name)

    def restore(self) -> None:
        while self.overrides:
            self.overrides.pop().disable()


class PageDatabase(TransactionTestCase):
    """A page's test database: pytest-django's ``django_db(transaction=True,
    reset_sequences=True)`` for the length of a page rather than of one test."""

    reset_sequences = True


@contextmanager
def page_database(django_db_blocker: Any) -> Iterator[None]:
    """Set up as pytest-django sets up a transactional test (the sequences reset, so the
    page's first run is run 1), flushed after the page."""
    with django_db_blocker.unblock():
        PageDatabase.setUpClass()  # a TransactionTestCase's runs its _pre_setup eagerly
        case = PageDatabase(methodName="__init__")
        if PageDatabase._pre_setup_ran_eagerly:
            PageDatabase._pre_setup_ran_eagerly = False
        else:
            case._pre_setup()
        try:
            yield
        finally:
            case._post_teardown()
            PageDatabase.tearDownClass()
            PageDatabase.doClassCleanups()


@pytest.fixture(scope="module")
def docs_page(request, django_db_setup, django_db_blocker, tmp_path_factory):
    """The :class:`PageRun` of one docs page, shared by its blocks. Sybil's items take
    "module" scope as their file's, so this lives for one page: its test database, a clean
    demo world, an isolated action registry, its settings, its own temporary directory."""
    from project.world import world

    page = request.node.path.name
    settings = PageSettings()
    with page_database(django_db_blocker), registry.isolated():
        world.switch_off()
        run = PageRun(page, tmp_path_factory.mktemp(Path(page).stem), settings)
        try:
            yield run
        finally:
            run.close()
            world.switch_off()
            settings.restore()


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """docs/conftest.py's hook: Sybil collects the pages (``pytest docs``, or one page). A
    page's blocks spawn processes (slow) and use a transactional test database, which
    ``docs_page`` gives them: the marker has pytest-django create it, and run the pages
    among the transactional tests."""
    page: pytest.Collector | None = PAGES_SYBIL.pytest()(file_path, parent)
    if page is not None:
        page.add_marker(pytest.mark.slow)
        page.add_marker(pytest.mark.django_db(transaction=True, reset_sequences=True))
    return page


# ── the tests ──


def test_the_docs_are_all_there():  # docs
    assert REQUIRED_PAGES <= set(PAGES)


def test_every_page_is_collected_and_run_with_the_suite():  # docs
    """The pages' blocks run as tests of their own (docs/conftest.py), in every run of the
    suite: ``testpaths`` holds docs/ beside tests/."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "docs" in pyproject["tool"]["pytest"]["ini_options"]["testpaths"]
    assert "tests.test_docs" in (DOCS / "conftest.py").read_text()
    assert all(PAGES_SYBIL.should_parse(DOCS / page) for page in PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_of_a_kind_that_is_executed(page):  # docs
    blocks = [example.parsed for example in PAGES_SYBIL.parse(DOCS / page).examples()]
    assert blocks, f"docs/{page} has no code block"
    for block in blocks:
        check_kind(block)


def as_written(value: Any) -> str:
    """A default as the settings page writes it: 15 minutes, 10 seconds, 1 day, 3, 0.5,
    not set."""
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        if seconds % 86_400 == 0:
            days = seconds // 86_400
            return f"{days} day" if days == 1 else f"{days} days"
        if seconds == 60:
            return "1 minute"
        return f"{seconds // 60} minutes" if seconds % 60 == 0 else f"{seconds} seconds"
    return "not set" if value is None else str(value)


def test_the_settings_page_names_every_key_with_its_default():  # docs, S4
    text = (DOCS / "settings.md").read_text()
    for key, default in DEFAULTS.items():
        row = re.search(rf"^\|\s*`{key}`\s*\|\s*(?P<default>[^|]*?)\s*\|", text, re.M)
        assert row, f"settings.md has no row for {key}"
        assert row["default"] == as_written(default), f"settings.md gives {key} another default"


#: The rules' ids (R5, C8) and the issues' numbers (#26) belong to the internals page; a
#: user page says what happens instead (a log line's "step #0" is output, in code).
INTERNAL_ID = re.compile(r"(?<![\w.])(?:[RWCS]\d{1,2}|#\d+)\b")


def user_text(page: str) -> str:
    """A page's prose: fenced blocks and inline code taken out."""
    text = re.sub(r"^(```|~~~).*?^\1", "", (DOCS / page).read_text(), flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


@pytest.mark.parametrize("page", sorted(set(PAGES) - {"internals.md"}) + ["../README.md"])
def test_user_pages_carry_no_internal_ids(page):  # docs
    found = INTERNAL_ID.findall(user_text(page))
    assert not found, f"docs/{page} names {found}: say what it means instead"


def test_the_statuses_page_explains_every_status():  # docs
    from events_ledger.models import EventRun, EventRunResource, EventRunStep

    text = (DOCS / "statuses.md").read_text()
    for model in (
        EventRun.Status,
        EventRun.CleanupStatus,
        EventRunResource.Status,
        EventRunStep.Status,
    ):
        for value in model.values:
            assert f"`{value}`" in text, f"statuses.md does not explain {value}"


def test_the_console_page_names_the_permissions_and_the_endpoint():  # docs, S3
    from events_ledger.models import EventRun

    text = (DOCS / "console.md").read_text()
    for codename, _ in EventRun._meta.permissions:
        assert f"events_ledger.{codename}" in text
    assert "/admin/events_ledger/eventrun/<id>/cleanup/" in text


# ── the checks themselves fail when the docs are wrong ──


def test_sybil_finds_fences_info_strings_and_skip_markers():  # docs
    text = "\n".join(
        [
            "# Title",
            "",
            "```python file=app/x.py",
            "x = 1",
            "```",
            "",
            "<!-- doctest: skip (needs systemd) -->",
            "~~~~shell",
            "systemctl start x",
            "```",
            "~~~~",
            "``inline`` text",
            "   ```pycon",
            "   >>> 1",
            "   1",
            "   ```",
            "```console",
            "```text",
            "```",
        ]
    )
    blocks = page_blocks(text)
    assert [(b.lang, b.attrs, b.line) for b in blocks] == [
        ("python", {"file": "app/x.py"}, 3),
        ("shell", {}, 8),
        ("pycon", {}, 13),
        ("console", {}, 17),
    ]
    assert blocks[1].skip == "needs systemd" and blocks[1].source == "systemctl start x\n```\n"
    assert blocks[0].skip is None and blocks[2].source == ">>> 1\n1\n"
    assert blocks[3].source == "```text\n"  # a fence with an info string closes nothing
    assert all(b.problem is None for b in blocks)
    # A marker is the block's only when nothing but blank lines is between them.
    (after_text,) = page_blocks("<!-- doctest: skip (x) -->\ntext\n\n```shell\nx\n```\n")
    assert after_text.skip is None
    (unclosed,) = page_blocks("```python\nx = 1\n")
    with pytest.raises(DocError, match="never closed"):
        check_kind(unclosed)


@pytest.mark.parametrize(
    "text,error",
    [
        ("```\nx\n```", "without a language"),
        ("```text\nx\n```", "not executed"),
        ("```yaml\nx: 1\n```", "file=NAME.yml"),
        ("```toml\nx = 1\n```", "not executed"),
        ("```python run\nx\n```", "key=value"),
        ("```ini file=x.conf\n[a]\n```", "systemd unit"),
        ("<!-- doctest: skip (lazy) -->\n```python\nx = 1\n```", "only a shell block"),
        ("<!-- doctest: skip (lazy) -->\n```shell\npython manage.py migrate\n```", "need a real"),
        ("<!-- doctest: skipped -->\n```shell\nsystemctl start x\n```", "is `skip \\(why\\)`"),
    ],
)
def test_a_block_of_an_unknown_kind_fails(text, error):  # docs
    with pytest.raises(DocError, match=error):
        for block in page_blocks(text):
            check_kind(block)


def test_a_wrong_block_fails_its_example_with_the_pages_words(tmp_path, settings):  # docs
    document = Document(
        "```pycon\n>>> 1 + 1\n3\n```\n\n```toml\nx = 1\n```\n\n```python\n1 / 0\n```\n",
        str(DOCS / "x.md"),
    )
    for region in parse_page(document):
        document.add(region)
    run = PageRun("x.md", tmp_path, settings)
    document.namespace["docs_page"] = run
    try:
        wrong_output, unknown, raising = document.examples()
        with pytest.raises(
            SybilFailure, match=r"File \"docs/x.md\", line 2(.|\n)*Expected:\n +3\nGot:\n +2"
        ):
            wrong_output.evaluate()
        with pytest.raises(SybilFailure, match="docs/x.md:6: the language 'toml'"):
            unknown.evaluate()
        with pytest.raises(ZeroDivisionError):
            raising.evaluate()
    finally:
        run.close()


def test_console_text_is_read_as_commands_output_and_statuses():  # docs
    commands = console_commands("$ python manage.py x \\\n  --y\nline one\n$ echo $?\n2\n")
    assert [(c.text, c.expected) for c in commands] == [
        ("python manage.py x --y", ["line one"]),
        ("echo $?", ["2"]),
    ]
    assert output_matches(
        "run ...: attempted 1 -> complete\n", "run 17: attempted 1  -> complete\n"
    )
    assert not output_matches("-> complete\n", "-> incomplete\n")


def test_scheduled_commands_are_checked_against_the_real_parsers():  # docs
    assert check_manage(
        ["/srv/app/.venv/bin/python", "manage.py", "cleanup_runs", "--verbosity", "0"], "x"
    )
    with pytest.raises(DocError, match="refuses"):
        check_manage(["python", "manage.py", "cleanup_runs", "--every", "5"], "x")
    with pytest.raises(DocError, match="no command"):
        check_manage(["python", "manage.py", "cleanup_everything"], "x")
    with pytest.raises(DocError, match="not a manage.py command"):
        check_manage(["bash", "-c", "manage.py"], "x")
    assert check_cron_field("*/5", 0, 59, []) and check_cron_field("1-5", 0, 7, [])
    assert check_cron_field("mon-fri", 0, 7, CRON_FIELDS[4][2])
    assert not check_cron_field("60", 0, 59, []) and not check_cron_field("*/0", 0, 59, [])
    assert not check_cron_field("5-1", 0, 59, []) and not check_cron_field("x", 0, 59, [])
    assert strip_redirections(["a", ">>", "/var/log/x", "2>&1", ">/dev/null"]) == ["a"]


def test_crontab_and_unit_mistakes_are_caught(tmp_path, settings):  # docs
    run = PageRun("x.md", tmp_path, settings)
    try:
        bad = [
            ("crontab", {}, "*/5 *  cleanup\n", "five schedule fields"),
            ("crontab", {}, "* * * *  python manage.py cleanup_runs\n", "not a valid schedule"),
            ("crontab", {}, "61 * * * *  python manage.py cleanup_runs\n", "not a valid schedule"),
            (
                "crontab",
                {},
                "* * * * *  python manage.py cleanup_runs --json > $(date +%F)\n",
                "unescaped %",
            ),
            ("crontab", {}, "* * * * *  rm -rf /tmp/x\n", "only cd and manage.py"),
            (
                "ini",
                {"file": "a.service"},
                "[Service]\nType=oneshot\nExecStart=/usr/bin/python "
                "/srv/manage.py cleanup_runs && echo ok\n",
                "without a shell",
            ),
            (
                "ini",
                {"file": "a.service"},
                "[Service]\nType=oneshot\nExecStart=/usr/bin/python "
                "/srv/manage.py cleanup_runs --loop 30\n",
                "long-running",
            ),
            (
                "ini",
                {"file": "a.service"},
                "[Service]\nType=oneshot\nExecStart=python manage.py x\n",
                "absolute",
            ),
            (
                "ini",
                {"file": "b.timer"},
                "[Timer]\nOnCalendar=*:0/1\n[Install]\nWantedBy=timers.target\n",
                "does not define",
            ),
            (
                "ini",
                {"file": "b.timer"},
                "[Timer]\nPersistent=true\n",
                "needs \\[Timer\\] with a schedule",
            ),
            ("ini", {"file": "b.timer"}, "[Sevrice]\nx=1\n", "unknown sections"),
        ]
        for lang, attrs, source, error in bad:
            with pytest.raises(DocError, match=error):
                run.run(Block("x.md", 1, lang, attrs, source))
    finally:
        run.close()


def test_prometheus_files_are_checked_against_the_app(tmp_path, settings):  # docs, #15
    run = PageRun("x.md", tmp_path, settings)
    rule = "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: {expr}\n"
    scrape = (
        "scrape_configs:\n  - job_name: j\n    metrics_path: {path}\n"
        "    authorization:\n      credentials_file: /etc/token\n"
    )
    try:
        run.run(
            Block(
                "x.md",
                1,
                "yaml",
                {"file": "ok.rules.yml"},
                rule.format(expr="events_ledger_healthy == 0"),
            )
        )
        bad = [
            (rule.format(expr="events_ledger_nothing > 0"), "exposes no events_ledger_nothing"),
            (rule.format(expr='events_ledger_runs{owner="x"} > 0'), "has no label 'owner'"),
            (rule.format(expr="max by (action) (events_ledger_runs) > 0"), "the label 'action'"),
            (rule.format(expr="up == 0"), "names no metric of the app"),
            (scrape.format(path="/admin/"), "not the ledger's metrics view"),
            (scrape.format(path="/nowhere"), "nothing is served"),
            ("x: 1\n", "neither alert rules"),
        ]
        for source, error in bad:
            with pytest.raises(DocError, match=error):
                run.run(Block("x.md", 1, "yaml", {"file": "bad.yml"}, source))
    finally:
        run.close()


# ── links (#25: two pages renamed; a link to a page or heading that is gone fails) ──

LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped,
    spaces to hyphens (fenced code skipped)."""
    anchors, fenced = set(), False
    for line in text.splitlines():
        if line.startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            title = re.sub(r"[^\w\- ]", "", m[1].strip().lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def broken_links(page: Path) -> list[str]:
    broken = []
    for m in LINK.finditer(page.read_text()):
        target = m["target"]
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif (
            anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text())
        ):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


@pytest.mark.parametrize("page", [*PAGES, "../README.md"])
def test_every_link_leads_to_a_page_and_heading_that_exist(page):  # docs, #25
    assert broken_links(DOCS / page) == []


def test_a_link_to_a_page_or_heading_that_is_gone_is_caught(tmp_path):  # docs, #25
    (tmp_path / "a.md").write_text("# A page: `--loop` here\n\ntext\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#a-page---loop-here) [gone](operating.md) [x](a.md#nowhere)\n")
    assert broken_links(page) == [
        "b.md: operating.md (no such file)",
        "b.md: a.md#nowhere (no such heading)",
    ]


def test_two_settings_fragments_of_a_page_do_not_overwrite_each_other(tmp_path, settings):
    # docs, #25: pasted in order, the second dict would silently drop the first's token.
    run = PageRun("x.md", tmp_path, settings)
    try:
        run.run(
            Block(
                "x.md",
                1,
                "python",
                {"file": "settings.py"},
                'EVENTS_LEDGER["METRICS_TOKEN"] = "t0k3n-0f-s1xteen+"\n',
            )
        )
        with pytest.raises(DocError, match="binds EVENTS_LEDGER anew"):
            run.run(
                Block(
                    "x.md",
                    9,
                    "python",
                    {"file": "settings.py"},
                    'EVENTS_LEDGER = {"MAX_REVERT_ATTEMPTS": 4}\n',
                )
            )
        run.run(
            Block(
                "x.md",
                19,
                "python",
                {"file": "settings.py"},
                "EVENTS_LEDGER.update(MAX_REVERT_ATTEMPTS=4)\n",
            )
        )
        assert settings.EVENTS_LEDGER == {
            "METRICS_TOKEN": "t0k3n-0f-s1xteen+",
            "MAX_REVERT_ATTEMPTS": 4,
        }
    finally:
        run.close()
