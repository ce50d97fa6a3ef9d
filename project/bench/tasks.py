"""The bench's bare Celery task (found by ``autodiscover_tasks``): the no-op without the ledger."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from .noop import noop


@shared_task(name="bench.bare_noop", acks_late=True)
def bare_noop(step_id: int) -> dict[str, Any]:
    return {"outcome": "done" if noop()["ok"] is True else "failed", "step_id": step_id}
