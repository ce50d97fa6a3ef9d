"""The ledger's work as Celery tasks (``pip install django-events-ledger[celery]``).

Celery's own tasks, not Django Tasks on a Celery backend: no Celery backend for Django
Tasks was mature when this was written, and Celery's ``acks_late`` and
``reject_on_worker_lost`` are what let a run outlive the worker that had it.

The same work as ``events_ledger.tasks``: each task wraps one function of
``events_ledger.jobs``. Registered by name (``events_ledger.run``, ``events_ledger.step``,
``events_ledger.sweep``, ``events_ledger.reconcile``, ``events_ledger.prune``), so a beat schedule or another
service can name them without importing this module.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from . import jobs

# acks_late + reject_on_worker_lost: a worker killed while it runs a step gives the
# message back, and another worker takes the run up. That is safe only because every
# step is fenced by its claim (one call of a step in the world at a time): the step the
# dead worker held answers ``busy`` until its claim goes stale, then is claimed again
# (an attempt counted, MAX_STEP_ATTEMPTS bounding it) and performed by its same key.
_REDELIVERED = {"acks_late": True, "reject_on_worker_lost": True}


@shared_task(name="events_ledger.step", **_REDELIVERED)
def step_task(step_id: int) -> dict[str, Any]:
    """Execute one step (W5)."""
    return jobs.execute_one_step(step_id)


@shared_task(bind=True, name="events_ledger.run", max_retries=jobs.BUSY_RETRIES, **_REDELIVERED)
def run_task(self: Any, run_id: int, on_refused: str = "fail") -> dict[str, Any]:
    """Execute a run's steps in order and end the run (``runner.run_steps``). A run whose
    step another call holds (``busy``) is tried again later, with the same message."""
    answer = jobs.run_run(run_id, on_refused)
    if answer["outcome"] == "busy":
        raise self.retry(countdown=jobs.busy_retry_delay())
    return answer


@shared_task(name="events_ledger.sweep")
def sweep_task(limit: int | None = None, scope: str | None = None) -> dict[str, Any]:
    """One sweep pass (C5). Run it from Celery beat, as cron runs ``cleanup_runs``;
    passes that overlap are safe (every row is claimed), and a lost one is the next.
    ``scope``: that scope's runs only (a beat entry per team)."""
    return jobs.sweep_once(limit, scope)


@shared_task(name="events_ledger.reconcile")
def reconcile_task(owner: str | None = None, force: bool = False) -> dict[str, Any]:
    """Reconcile one module, or every module with live rows (C6). ``force`` is refused
    (the task fails with the reason): the orphan bound holds, as in the console (#25)."""
    return jobs.reconcile_once(owner, force)


@shared_task(name="events_ledger.prune")
def prune_task(
    older_than: float | None = None, batch: int | None = None, archive: str | None = None
) -> dict[str, Any]:
    """Prune the history (#28): runs that ended ``older_than`` seconds ago (else
    ``RETENTION``) and owe nothing. Run it daily from Celery beat; a prune killed half-way
    is finished by the next."""
    return jobs.prune_once(older_than, batch, archive)
