"""What the ledger's commands share: JSON output and exit statuses a cron monitor reads."""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

#: Exit statuses. 0: clean, or retries pending. 1: something needs a human. 2: bad input.
OK, NEEDS_HUMAN, BAD_INPUT = 0, 1, 2


class LedgerCommand(BaseCommand):
    def add_json_argument(self, parser: Any) -> None:
        parser.add_argument(
            "--json", action="store_true", help="Print one JSON document, for machines."
        )

    def emit_json(self, document: Any) -> None:
        self.stdout.write(json.dumps(document, indent=2, default=str, sort_keys=True))

    def bad_input(self, message: str) -> CommandError:
        return CommandError(message, returncode=BAD_INPUT)

    def finish(self, status: int) -> None:
        if status:
            sys.exit(status)
