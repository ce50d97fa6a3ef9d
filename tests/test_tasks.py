"""Django Tasks (#14): the ledger's tasks on the immediate backend, and on django-tasks-db
with real worker processes (``manage.py db_worker``) over the test database."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from importlib.util import find_spec

import pytest
from django.test import override_settings
from django.utils import timezone

from events_ledger.models import EventRun, EventRunStep
from project.world.models import Creature
from tests.helpers import PATIENCE_S, new_run, spawn_step
from tests.processes import ROOT, child_env

HAS_TASKS = bool(find_spec("django.tasks") or find_spec("django_tasks"))
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not HAS_TASKS, reason="needs django.tasks or django-tasks ([tasks] extra)"),
]
PACKAGE = "django.tasks" if find_spec("django.tasks") else "django_tasks"
IMMEDIATE = {"default": {"BACKEND": f"{PACKAGE}.backends.immediate.ImmediateBackend"}}
DATABASE = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}


def _runs(n: int, steps: int = 2) -> list[EventRun]:
    runs = []
    for i in range(n):
        run = new_run(name=f"task{i}", status="pending")
        for seq in range(steps):
            spawn_step(run, "north", 1, seq=seq)
        runs.append(run)
    return runs


@override_settings(TASKS=IMMEDIATE)
def test_the_tasks_on_the_immediate_backend(world):  # W5, C5, C6
    from events_ledger.tasks import reconcile_task, run_task, step_task, sweep_task

    run, lone = _runs(2)
    answer = run_task.enqueue(run.pk).return_value
    assert answer["outcome"] == "completed" and answer["finished"] is True
    assert Creature.objects.count() == 2
    step = EventRunStep.objects.filter(run=lone).first()
    assert step_task.enqueue(step.pk).return_value["outcome"] == "done"
    # C6: the world still has everything the ledger holds live.
    assert reconcile_task.enqueue("world").return_value["world"]["orphaned"] == 0
    assert set(reconcile_task.enqueue().return_value) == {"world"}
    # A sweep of another scope leaves the completed run alone; the cron's takes it.
    assert sweep_task.enqueue(None, "another-team").return_value["runs"] == 0
    swept = sweep_task.enqueue().return_value
    assert swept["runs"] == 1 and swept["remaining"] == 0
    # The completed run's creatures went back; the lone step's run is still going.
    assert list(Creature.objects.values_list("spawned_by", flat=True)) == [step.idempotency_key]


def test_importing_the_app_needs_no_task_package():  # S5
    # A fresh interpreter with both packages hidden: the app's public API still imports.
    code = (
        "import sys; sys.modules['django.tasks'] = None; sys.modules['django_tasks'] = None;"
        "sys.modules['celery'] = None; import django; django.setup();"
        "import events_ledger; events_ledger.run_steps; events_ledger.execute_step;"
        "import events_ledger.jobs, events_ledger.tasks\n"
        "try: events_ledger.tasks.run_task\n"
        "except ImportError as e: print('ok' if '[tasks]' in str(e) else e)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True
    )
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.slow
@pytest.mark.skipif(not find_spec("django_tasks_db"), reason="needs django-tasks-db")
@override_settings(TASKS=DATABASE)
def test_runs_and_a_sweep_on_django_tasks_db_workers(world):  # W5, C5
    from events_ledger.tasks import run_task, sweep_task

    runs = _runs(12)
    results = [run_task.enqueue(r.pk) for r in runs]
    env = child_env()
    env["LEDGER_TASKS_BACKEND"] = "django_tasks_db.DatabaseBackend"
    worker = [sys.executable, "manage.py", "db_worker", "--batch", "--no-startup-delay"]
    workers = [
        subprocess.Popen(worker + ["--worker-id", f"w{i}"], cwd=ROOT, env=env) for i in range(2)
    ]
    for w in workers:
        assert w.wait(PATIENCE_S) == 0
    for result in results:
        result.refresh()
        assert result.status.name == "SUCCESSFUL", result.errors
        assert result.return_value["outcome"] == "completed"
    assert set(
        EventRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)
    ) == {"completed"}
    assert Creature.objects.count() == 24
    sweep = sweep_task.enqueue(len(runs))
    subprocess.run(worker, cwd=ROOT, env=env, check=True, timeout=PATIENCE_S)
    sweep.refresh()
    assert sweep.return_value["runs"] == len(runs)
    assert Creature.objects.count() == 0


@pytest.mark.skipif(not find_spec("django_tasks_db"), reason="needs django-tasks-db")
@override_settings(TASKS=DATABASE)
def test_a_busy_run_is_enqueued_again_later_on_a_backend_that_defers(world, settings):  # W5
    from django_tasks_db.models import DBTaskResult

    from events_ledger.jobs import BUSY_RETRIES, busy_retry_delay
    from events_ledger.tasks import run_task

    (run,) = _runs(1, 1)
    step = EventRunStep.objects.get(run=run)
    # Another worker holds the step: the run cannot go on until that claim ends.
    assert EventRunStep.objects.claim(step, timedelta(minutes=15), by="elsewhere:1") is not None
    answer = run_task.call(run.pk)
    assert answer["outcome"] == "busy" and answer["enqueued_again"] is True
    again = DBTaskResult.objects.get()
    assert again.args_kwargs["args"] == [run.pk, "fail", 1]
    assert again.run_after is not None
    assert (again.run_after - timezone.now()).total_seconds() <= busy_retry_delay()
    # The bound: the last retry sends nothing more.
    DBTaskResult.objects.all().delete()
    assert "enqueued_again" not in run_task.call(run.pk, "fail", BUSY_RETRIES)
    assert not DBTaskResult.objects.exists()
