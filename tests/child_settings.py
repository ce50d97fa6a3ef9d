"""Settings for the child processes of the race tests: the parent's test database."""

import os

from project.settings import *  # noqa: F403
from project.settings import DATABASES

DATABASES["default"]["NAME"] = os.environ["LEDGER_CHILD_DB_NAME"]
