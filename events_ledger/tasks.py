"""The ledger's work as Django Tasks: Django 6's ``django.tasks``, or the ``django-tasks``
backport on Django 5.2 (``pip install django-events-ledger[tasks]``).

A run is one task (``run_task``), not one task per step: its steps must run in
``(phase, seq)`` order, one after another, and one task keeps that order in one process
without a chain of messages that a cancelled run would leave queued. Many runs are many
tasks, spread over the workers. ``step_task`` is there for hosts that order steps
themselves. Each task wraps one function of ``events_ledger.jobs``; ``events_ledger``
itself never imports this module, so the app needs neither package.

Celery's usual set-up, ``app.autodiscover_tasks()``, imports ``<app>.tasks`` of every
installed app: this module must then import without any Django Tasks package (a host on
Celery alone), and it is also where the Celery tasks are found (``events_ledger.celery``),
so that set-up registers them with no more configuration.
"""

from __future__ import annotations

from datetime import timedelta
from importlib.util import find_spec
from typing import Any

from django.utils import timezone

from . import jobs

MISSING = (
    "events_ledger.tasks needs Django 6's django.tasks or the django-tasks backport: "
    "pip install 'django-events-ledger[tasks]'"
)
TASKS = ("step_task", "run_task", "sweep_task", "reconcile_task", "prune_task")


def _task_decorator() -> Any:
    """``task`` of Django 6's framework, else of the backport, else None."""
    try:
        from django.tasks import task
    except ImportError:  # Django 5.2
        try:
            from django_tasks import task
        except ImportError:
            return None
    return task


task = _task_decorator()

if find_spec("celery") is not None:
    from . import celery as celery  # noqa: F401  (registers the Celery tasks; see above)

if task is not None:

    @task()
    def step_task(step_id: int) -> dict[str, Any]:
        """Execute one step (W5)."""
        return jobs.execute_one_step(step_id)

    @task()
    def run_task(run_id: int, on_refused: str = "fail", busy_retries: int = 0) -> dict[str, Any]:
        """Execute a run's steps in order and end the run (see ``runner.run_steps``).

        A run whose step another call holds (``busy``: a call that outlived its budget,
        or a worker that died, until ``STEP_CLAIM_TTL``) is enqueued again to run a
        quarter of the TTL later, at most ``BUSY_RETRIES`` times, on a backend that can
        defer (django-tasks-db can); elsewhere its answer, ``finished: false``, asks the
        host to."""
        busy_retries = jobs.bounded_int("busy_retries", busy_retries, 0, jobs.BUSY_RETRIES)
        answer = jobs.run_run(run_id, on_refused)
        if answer["outcome"] == "busy" and busy_retries < jobs.BUSY_RETRIES:
            answer["enqueued_again"] = _again(run_id, on_refused, busy_retries + 1)
        return answer

    def _again(run_id: int, on_refused: str, busy_retries: int) -> bool:
        if not run_task.get_backend().supports_defer:
            return False
        later = timezone.now() + timedelta(seconds=jobs.busy_retry_delay())
        run_task.using(run_after=later).enqueue(run_id, on_refused, busy_retries)
        return True

    @task()
    def sweep_task(limit: int | None = None, scope: str | None = None) -> dict[str, Any]:
        """One sweep pass (C5): enqueue it on a schedule, as cron runs ``cleanup_runs``
        (``scope``: that scope's runs only, as ``cleanup_runs --scope``)."""
        return jobs.sweep_once(limit, scope)

    @task()
    def reconcile_task(owner: str | None = None, force: bool = False) -> dict[str, Any]:
        """Reconcile one module, or every module with live rows (C6)."""
        return jobs.reconcile_once(owner, force)

    @task()
    def prune_task(
        older_than: float | None = None, batch: int | None = None, archive: str | None = None
    ) -> dict[str, Any]:
        """Prune the history (#28): runs that ended ``older_than`` seconds ago (else
        ``RETENTION``) and owe nothing; enqueue it daily, beside the sweep."""
        return jobs.prune_once(older_than, batch, archive)

else:

    def __getattr__(name: str) -> Any:
        if name in TASKS:
            raise ImportError(MISSING)
        raise AttributeError(f"module 'events_ledger.tasks' has no attribute {name!r}")
