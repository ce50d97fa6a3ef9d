"""Settings for the child processes of the race tests: the parent's test database."""

import json
import os

from project.settings import *  # noqa: F403
from project.settings import DATABASES

for _alias, _name in json.loads(os.environ["LEDGER_CHILD_DB_NAMES"]).items():
    DATABASES[_alias]["NAME"] = _name
# A cluster's other node (the Galera scenarios spread their processes over the nodes).
if os.environ.get("LEDGER_CHILD_DB_PORT"):
    DATABASES["default"]["PORT"] = os.environ["LEDGER_CHILD_DB_PORT"]

# Ledger settings a test hands its children (short TTLs for the chaos scenarios).
EVENTS_LEDGER.update(json.loads(os.environ.get("LEDGER_CHILD_SETTINGS", "{}")))  # noqa: F405

# Each database connection the child opens, appended to this file (a test that counts
# them: whether a Celery worker keeps its connection between steps, #27).
if os.environ.get("LEDGER_CHILD_CONNECTIONS_LOG"):
    from django.db.backends.signals import connection_created

    def _note_connection(sender, connection, **kwargs):  # type: ignore[no-untyped-def]
        with open(os.environ["LEDGER_CHILD_CONNECTIONS_LOG"], "a") as log:
            log.write(f"{os.getpid()} {connection.alias}\n")

    connection_created.connect(_note_connection, weak=False)
