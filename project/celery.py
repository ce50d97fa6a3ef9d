"""The example project's Celery app: ``celery -A project worker`` / ``celery -A project beat``.

Celery's usual set-up, nothing of the ledger's own: ``autodiscover_tasks()`` imports
``events_ledger.tasks``, which registers ``events_ledger.celery``'s tasks.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
