"""A new user's first hour: the built wheel installed into a fresh project (issue: reusable app)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import django
import pytest
from django.db import connection

import events_ledger
from tests.processes import ROOT

pytestmark = pytest.mark.slow

ACTIONS = """
import json
from pathlib import Path

from events_ledger import Action, register_action

WORLD = Path(__file__).with_name("world.json")


def _load():
    return json.loads(WORLD.read_text()) if WORLD.exists() else {}


def make(*, run_id, params, idempotency_key):
    world = _load()
    made = [f"{idempotency_key}-{i}" for i in range(params["count"])]
    for ref in made:
        world[ref] = idempotency_key
    WORLD.write_text(json.dumps(world))
    return {"ok": True, "resources": [{"kind": "thing", "ref": ref} for ref in made]}


def unmake(*, run_id, resources, idempotency_key):
    world = _load()
    refs = [r["ref"] for r in resources] or [k for k, v in world.items() if v == idempotency_key]
    for ref in refs:
        world.pop(ref, None)
    WORLD.write_text(json.dumps(world))
    return {"ok": True}


register_action(Action(id="host.make", owner="host", reversible="ledger", perform=make, revert=unmake))
"""

RUN_A_STEP = """
from events_ledger import execute_step
from events_ledger.models import EventRun, EventRunStep
run = EventRun.objects.create(name="first", status="running")
step = EventRunStep.objects.create(run=run, action_id="host.make", params={"count": 3})
result = execute_step(step)
assert result.outcome == "done" and result.recorded == 3, result
EventRun.objects.transition(run, "completed", from_="running")
print("RUN", run.pk)
"""


def sh(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_the_wheel_installs_into_a_new_project_and_gives_resources_back(tmp_path):  # reusable app
    if connection.vendor != "sqlite":
        pytest.skip("proved once per Django line, on a new project's own SQLite database")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "DATABASE_URL")
    }
    dist = tmp_path / "dist"
    sh(
        sys.executable,
        "-m",
        "build",
        "--sdist",
        "--wheel",
        "-o",
        str(dist),
        str(ROOT),
        cwd=tmp_path,
        env=env,
    )
    [wheel] = dist.glob("*.whl")
    assert wheel.name.startswith(f"django_events_ledger-{events_ledger.__version__}-")
    [sdist] = dist.glob("*.tar.gz")
    import tarfile

    with tarfile.open(sdist) as tar:
        members = [m.split("/", 1)[1] for m in tar.getnames() if "/" in m]
    assert "events_ledger/migrations/0001_initial.py" in members and "CHANGELOG.md" in members
    assert "events_ledger/static/events_ledger/admin/console.css" in members
    assert not [m for m in members if m.startswith(("project/", "tests/", "docs/"))]
    names = subprocess.run(
        [sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True
    ).stdout
    assert "events_ledger/migrations/0001_initial.py" in names and "events_ledger/py.typed" in names
    assert "project/" not in names and "tests/" not in names
    assert "events_ledger/static/events_ledger/admin/console.css" in names  # the console's CSS

    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", str(venv), cwd=tmp_path, env=env)
    py = venv / "bin" / "python"
    sh(
        str(py),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        f"Django=={django.get_version()}",
        str(wheel),
        cwd=tmp_path,
        env=env,
    )
    sh(str(venv / "bin" / "django-admin"), "startproject", "host", cwd=tmp_path, env=env)
    host = tmp_path / "host"
    app = host / "hostapp"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "event_actions.py").write_text(textwrap.dedent(ACTIONS))
    settings = host / "host" / "settings.py"
    settings.write_text(settings.read_text() + '\nINSTALLED_APPS += ["events_ledger", "hostapp"]\n')

    manage = [str(py), "manage.py"]
    sh(*manage, "migrate", "-v0", cwd=host, env=env)
    sh(*manage, "check", "--fail-level", "WARNING", cwd=host, env=env)
    where = sh(
        str(py),
        "-c",
        "import events_ledger, sys; print(events_ledger.__file__, events_ledger.__version__)",
        cwd=host,
        env=env,
    ).stdout
    assert str(venv) in where and str(ROOT) not in where
    assert where.split()[-1] == events_ledger.__version__  # the checkout's number, installed
    out = sh(*manage, "shell", "-c", RUN_A_STEP, cwd=host, env=env).stdout
    assert len(json.loads((app / "world.json").read_text())) == 3
    run_id = out.split("RUN")[1].strip()
    swept = sh(*manage, "cleanup_runs", cwd=host, env=env).stdout
    assert f"run {run_id}: attempted 3, reverted 3" in swept and "-> complete" in swept
    assert json.loads((app / "world.json").read_text()) == {}
    # #15: without the metrics and health extras the app works, and says how to get them.
    assert sh(*manage, "ledger_status", cwd=host, env=env).stdout.startswith(
        "events ledger: healthy"
    )
    missing = sh(
        *manage,
        "shell",
        "-c",
        "from django.core.exceptions import ImproperlyConfigured\n"
        "from events_ledger.metrics import LedgerCollector\n"
        "try:\n    LedgerCollector()\nexcept ImproperlyConfigured as exc:\n    print(exc)\n"
        "try:\n    import events_ledger.health\nexcept ImproperlyConfigured as exc:\n    print(exc)\n",
        cwd=host,
        env=env,
    ).stdout
    assert "pip install 'django-events-ledger[metrics]'" in missing
    assert "pip install 'django-events-ledger[health]'" in missing


def test_the_version_is_written_once():  # one number (#13)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "events_ledger.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", events_ledger.__version__)
