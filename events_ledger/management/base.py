"""What the ledger's commands share: JSON output and exit statuses a cron monitor reads."""

from __future__ import annotations

import io
import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
from django.utils.translation import gettext as _

#: Exit statuses. 0: clean, or retries pending. 1: something needs a human. 2: bad input.
OK, NEEDS_HUMAN, BAD_INPUT = 0, 1, 2


class LedgerCommand(BaseCommand):
    verbosity = 1

    def execute(self, *args: Any, **options: Any) -> Any:
        self.verbosity = options.get("verbosity", 1)
        return super().execute(*args, **options)

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
        self.stdout.write(json.dumps(document, indent=2, default=str, sort_keys=True))

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
