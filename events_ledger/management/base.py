"""What the ledger's commands share: JSON output and exit statuses a cron monitor reads."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.utils.translation import gettext as _

#: Exit statuses. 0: clean, or retries pending. 1: something needs a human. 2: bad input.
OK, NEEDS_HUMAN, BAD_INPUT = 0, 1, 2

#: What a terminal would obey in database text: controls below 0x20 but tab, DEL, the
#: controls 0x80-0x9f (0x9b is a CSI on its own), the bidirectional marks and overrides that
#: reorder a line (#25: an ``ESC]0;…`` in a row's last_error retitled the operator's
#: terminal), and every line break: each write is one line of the command's own, so a
#: module's error ``"boom\nOK: nothing to do"`` cannot forge a line in the cron's mail.
_CONTROLS = re.compile(
    r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``), so
    database text (a module's error, a ref, a run's name) reaches a terminal as text.
    ``lines`` keeps plain newlines (a report of several lines the command did not write
    from database text)."""
    if lines:
        return "\n".join(printable(line) for line in text.split("\n"))
    return _CONTROLS.sub(
        lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text
    )


class _Styled(str):
    """Text the command styled itself: its escape codes are the command's own."""


class _PrintableStyle:
    """The command's ``style``, each style made printable before it is coloured."""

    def __init__(self, style: Any, *, lines: bool = False) -> None:
        self._style = style
        self._lines = lines

    def __getattr__(self, name: str) -> Any:
        style = getattr(self._style, name)
        if not callable(style):
            return style
        return lambda text: _Styled(style(printable(str(text), lines=self._lines)))


class _PrintableOutput(OutputWrapper):
    """stdout/stderr that print database text as text: anything not styled by the
    command is made printable on its way out (#25)."""

    def write(  # type: ignore[override]  # OutputWrapper's own signature
        self,
        msg: str = "",
        style_func: Callable[[str], str] | None = None,
        ending: str | None = None,
    ) -> None:
        if not isinstance(msg, _Styled):
            # A style function passed in is Django's own multi-line report (a system
            # check's); every other write is one line, so its line breaks are escaped.
            msg = printable(msg, lines=style_func is not None)
        super().write(msg, style_func, ending)


def _printable_output(out: Any) -> _PrintableOutput:
    if isinstance(out, _PrintableOutput):
        return out
    if isinstance(out, OutputWrapper):
        wrapped = _PrintableOutput(out._out, ending=out.ending)  # type: ignore[arg-type]
        wrapped.style_func = out._style_func
        return wrapped
    return _PrintableOutput(out)


class LedgerCommand(BaseCommand):
    """The ledger's commands: exit statuses a cron monitor reads, JSON for machines, and
    every line printable (no database text drives the operator's terminal)."""

    verbosity = 1

    # Django assigns these in __init__ and execute(); each is wrapped as it is assigned.
    @property
    def stdout(self) -> OutputWrapper:
        return self._printable_stdout

    @stdout.setter
    def stdout(self, out: Any) -> None:
        self._printable_stdout = _printable_output(out)

    @property
    def stderr(self) -> OutputWrapper:
        return self._printable_stderr

    @stderr.setter
    def stderr(self, out: Any) -> None:
        self._printable_stderr = _printable_output(out)

    @property
    def style(self) -> Any:
        return self._printable_style

    @style.setter
    def style(self, style: Any) -> None:
        self._printable_style = (
            style if isinstance(style, _PrintableStyle) else _PrintableStyle(style)
        )

    def execute(self, *args: Any, **options: Any) -> Any:
        self.verbosity = options.get("verbosity", 1)
        return super().execute(*args, **options)

    def check(self, *args: Any, **kwargs: Any) -> None:
        # Django's system-check report is several lines of its own, made from settings,
        # not from database text: its line breaks stay.
        style = self._printable_style
        self._printable_style = _PrintableStyle(style._style, lines=True)
        try:
            super().check(*args, **kwargs)
        finally:
            self._printable_style = style

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # ``help`` is marked with gettext_noop (argparse cannot take a lazy string), and
        # translated here, when the parser is built in the user's language.
        parser.description = _(self.help) if self.help else None
        return parser

    def add_json_argument(self, parser: Any) -> None:
        parser.add_argument(
            "--json", action="store_true", help=_("Print one JSON document, for machines.")
        )

    def emit_json(self, document: Any) -> None:
        # json.dumps escapes every control and non-ASCII character inside its strings:
        # its own line breaks are the document's structure.
        self.stdout.write(_Styled(json.dumps(document, indent=2, default=str, sort_keys=True)))

    def bad_input(self, message: str) -> CommandError:
        return CommandError(message, returncode=BAD_INPUT)

    def finish(self, status: int, reason: str) -> None:
        """End with the exit status a cron monitor reads: nothing for OK, else a
        CommandError carrying it, which Django prints as ``CommandError: <reason>``."""
        if not status:
            return
        if self.verbosity == 0:
            # Verbosity 0 promises cron a silent job (cron mails whatever a job prints):
            # the status alone says it, so Django's line about the error goes nowhere.
            self.stderr = OutputWrapper(io.StringIO())
        raise CommandError(reason, returncode=status)
