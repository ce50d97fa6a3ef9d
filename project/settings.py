"""The example host project: events_ledger installed as any Django project would."""

from __future__ import annotations

from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import environ
from django.core.management.utils import get_random_secret_key

BASE_DIR = Path(__file__).resolve().parent

env = environ.Env()
environ.Env.read_env(BASE_DIR.parent / ".env", overwrite=False)

# #25: off unless asked for (DEBUG=true, as `make serve` does): a debug page shows settings
# and code to anyone who makes an error happen.
DEBUG = env.bool("DEBUG", default=False)
# #25: no public key outside DEBUG. Unset, a key is made for this process alone: nothing
# signed (a session, a password-reset link) outlives it, and nobody can forge one. Set
# SECRET_KEY in the environment of anything that serves users.
SECRET_KEY = env("SECRET_KEY", default="") or (
    "events-ledger-example-debug-only" if DEBUG else get_random_secret_key()
)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "events_ledger",
    "project.world",
    # The benchmark (manage.py ledger_bench): the host's, not the app's.
    "project.bench",
    # #15: the health page's HTML template (the check itself is named in urls.py).
    "health_check",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
# psycopg2 beside psycopg 3: Django takes psycopg 3 when it can import it, so a process
# that must speak psycopg2 (the test suite's second PostgreSQL run) hides it here, before
# the first connection imports the backend.
if env("LEDGER_PG_DRIVER", default="psycopg") == "psycopg2":
    import sys

    sys.modules["psycopg"] = None  # type: ignore[assignment]


def _tuned(db: dict[str, Any], alias: str) -> dict[str, Any]:
    # A host that wraps every request in a transaction: `make test` runs the console's
    # tests and the in-flight property machine with it on too (the ledger's commits stay
    # its own).
    db["ATOMIC_REQUESTS"] = env.bool("DATABASE_ATOMIC_REQUESTS", default=False)
    # Behind a pooler in transaction mode (PgBouncer): a session serves one transaction,
    # so no cursor may outlive it (Django's advice), and the ledger kills no session by
    # its id (it would be another client's by then). `make test` runs a suite so.
    if env.bool("DATABASE_TRANSACTION_POOLER", default=False):
        db["DISABLE_SERVER_SIDE_CURSORS"] = True
    # Django's own pool (PostgreSQL, psycopg 3; CONN_MAX_AGE must stay 0 with it): each
    # thread's connection is taken from it and given back, the deadline's and the
    # keeper's threads too. `make test` runs the web process, Celery and db_worker so.
    if env.bool("DATABASE_POOL", default=False) and db["ENGINE"].endswith("postgresql"):
        db.setdefault("OPTIONS", {})["pool"] = {"min_size": 1, "max_size": 8, "timeout": 30}
        db["CONN_MAX_AGE"] = 0
    if db["ENGINE"].endswith("sqlite3"):
        # A file, also for tests: the deadline's worker threads and the race tests' child
        # processes must see the same database as the test itself.
        name = env("SQLITE_TEST_NAME", default=str(BASE_DIR.parent / ".test-db.sqlite3"))
        db.setdefault("TEST", {})["NAME"] = name if alias == "default" else f"{name}-{alias}"
        db.setdefault("OPTIONS", {}).update({"timeout": 20})
        # Transactions take the write lock when they begin, so they wait for one another
        # instead of failing at once when a reader turns writer (Django 5.1+).
        db["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
    elif db["ENGINE"].endswith("mysql"):
        # utf8mb4 for every text; the ledger's key columns pick their own byte-wise
        # collation.
        db.setdefault("OPTIONS", {}).update({"charset": "utf8mb4"})
        # A node that stops answering after a committed write (seen on Galera) must not
        # hang a sweeper for ever: the read times out as "lost connection" (2013), which
        # the ledger treats as outcome unknown and retries only where the write is fenced.
        read_timeout = env.int("DATABASE_READ_TIMEOUT", default=60)
        if read_timeout:
            db["OPTIONS"].update({"read_timeout": read_timeout, "write_timeout": read_timeout})
    return db


_tuned(DATABASES["default"], "default")
# The ledger on an alias of its own: its tables on LEDGER_DATABASE_URL, the host's (auth,
# sessions, the admin's history) on default. `make test` runs the core suite so.
if env("LEDGER_DATABASE_URL", default=""):
    DATABASES["ledger"] = _tuned(env.db("LEDGER_DATABASE_URL"), "ledger")
    DATABASE_ROUTERS = ["events_ledger.routers.LedgerRouter"]
# A streaming replica behind a router that sends the ledger's reads to it, as a host's
# replica router would: `make test` runs both halves and the chaos scenarios so. A mirror
# while the test databases are made (a standby creates nothing); the tests then read the
# standby's own copy (tests/conftest.py).
elif env("DATABASE_REPLICA_URL", default=""):
    DATABASES["replica"] = _tuned(env.db("DATABASE_REPLICA_URL"), "replica")
    DATABASES["replica"].setdefault("TEST", {})["MIRROR"] = "default"
    DATABASE_ROUTERS = ["project.routers.ReadsFromReplica"]


DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"

EVENTS_LEDGER = {
    "REVERT_CLAIM_TTL": timedelta(
        milliseconds=env.int("EVENT_REVERT_CLAIM_TTL_MS", default=15 * 60 * 1000)
    ),
    "MAX_REVERT_ATTEMPTS": env.int("EVENT_REVERT_MAX_ATTEMPTS", default=3),
    "CLEANUP_RUN_BATCH": env.int("EVENT_CLEANUP_RUN_BATCH", default=10),
    "CLEANUP_GROUPS_PER_RUN": env.int("EVENT_CLEANUP_GROUPS_PER_RUN", default=25),
    # #15: Prometheus scrapes /metrics with this token (unset: staff sessions only).
    "METRICS_TOKEN": env("LEDGER_METRICS_TOKEN", default="") or None,
    "HEALTH_MAX_UNRESOLVED_AGE": timedelta(
        seconds=env.int("EVENT_HEALTH_MAX_UNRESOLVED_AGE_S", default=24 * 60 * 60)
    ),
    # #26: the bench measures giving back both ways (scripts/bench-all).
    "GIVE_BACK_IN_ORDER": env.bool("EVENT_GIVE_BACK_IN_ORDER", default=True),
}
if "ledger" in DATABASES:
    EVENTS_LEDGER["DATABASE"] = "ledger"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # #15: every record of the app carries run_id, step_id, action and owner; the filter
    # on the handler gives them to any record that reaches it.
    "filters": {"ledger_context": {"()": "events_ledger.logcontext.LogContextFilter"}},
    "formatters": {
        "ledger": {
            "format": "%(levelname)s %(name)s run=%(run_id)s step=%(step_id)s "
            "action=%(action)s owner=%(owner)s: %(message)s"
        }
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "filters": ["ledger_context"],
            "formatter": "ledger",
        }
    },
    "loggers": {
        "events_ledger": {
            "handlers": ["console"],
            "level": env("LEDGER_LOG_LEVEL", default="WARNING"),
        }
    },
}

# #14: the task queues, each wired only when its package is installed (the app itself
# needs neither). Django Tasks: Django 6's own, or the django-tasks backport on 5.2.
# The immediate backend by default; LEDGER_TASKS_BACKEND names another (the tests'
# workers use django_tasks_db.DatabaseBackend: workers over the database, no broker).
_TASKS_PACKAGE = "django.tasks" if find_spec("django.tasks") else "django_tasks"
_HAS_TASKS = _TASKS_PACKAGE == "django.tasks" or bool(find_spec("django_tasks"))
if _TASKS_PACKAGE == "django_tasks" and _HAS_TASKS:
    INSTALLED_APPS.append("django_tasks")
if _HAS_TASKS and find_spec("django_tasks_db"):
    INSTALLED_APPS.append("django_tasks_db")
TASKS = {
    "default": {
        "BACKEND": env(
            "LEDGER_TASKS_BACKEND", default=f"{_TASKS_PACKAGE}.backends.immediate.ImmediateBackend"
        )
    }
}

# #14: Celery (project/celery.py), over Redis: the rig's (REDIS_URL) in the tests.
CELERY_BROKER_URL = env("REDIS_URL", default="redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
# With the ledger's tasks acknowledged late, a worker holds only the message it runs: a
# prefetched run would wait behind a long step, and go back to the queue if it died.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A message a worker took and never acknowledged (the worker was killed) is delivered
# again after this long: longer than the longest run (a run delivered twice is safe, its
# steps answer `busy`, but it waits). The tests kill a whole worker and set it short.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env.float("CELERY_VISIBILITY_TIMEOUT_S", default=3600.0)
}
# Celery's Django fixup closes every database connection before and after every task,
# whatever CONN_MAX_AGE says, unless this is set: then only every this many tasks, and
# a connection kept by CONN_MAX_AGE (`?conn_max_age=300&conn_health_checks=true` in
# DATABASE_URL) serves the next task instead of a new one per task (#27: a connection
# to PostgreSQL costs a step some 10 ms). Without CONN_MAX_AGE, the ledger's tasks
# still close theirs at the end (`close_old_connections`).
CELERY_DB_REUSE_MAX = env.int("CELERY_DB_REUSE_MAX", default=1000)
CELERY_TASK_SERIALIZER = CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# The sweep as a periodic task (`celery -A project beat`), instead of cron. Passes that
# overlap are safe; `expires` drops a pass still queued when the next is due.
_SWEEP_EVERY_S = env.float("LEDGER_SWEEP_EVERY_S", default=60.0)
CELERY_BEAT_SCHEDULE = {
    "events-ledger-sweep": {
        "task": "events_ledger.sweep",
        "schedule": _SWEEP_EVERY_S,
        "options": {"expires": _SWEEP_EVERY_S},
    },
}
