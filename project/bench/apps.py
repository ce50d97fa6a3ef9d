"""The bench app: a management command and its helpers, no models."""

from __future__ import annotations

from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "project.bench"
    label = "ledger_bench"
    verbose_name = "events_ledger benchmark"
