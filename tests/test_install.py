"""A new user's first hour: the built wheel installed into a fresh project (issue: reusable app)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import django
import pytest

import events_ledger
from tests.helpers import connection
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


# ── #25: a fresh project from the docs alone, with the built wheel, to a Celery run ──

DOCS = ROOT / "docs"
#: The pages (and their sections) an adopter follows to a Celery run, metrics and health.
ADOPTER_PATH = [
    ("quickstart.md", None),
    ("running-at-scale.md", "Celery"),
    ("monitoring.md", "Metrics for Prometheus"),
    ("monitoring.md", "A health check"),
]
#: The docs' own broker and project names, and what this project has instead.
DOCS_BROKER = "redis://127.0.0.1:6379/0"
SEND_A_RUN = """
import time
from functools import partial

from django.db import transaction

from events_ledger.celery import run_task
from events_ledger.models import EventRun, EventRunStep

# As running-at-scale.md says: enqueued once the run is committed.
with transaction.atomic():
    run = EventRun.objects.create(name="spring festival")
    EventRunStep.objects.create(run=run, action_id="banners.post", params={"text": "Spring!"})
    transaction.on_commit(partial(run_task.delay, run.pk))
deadline = time.monotonic() + 40
while run.status not in EventRun.TERMINAL and time.monotonic() < deadline:
    time.sleep(0.1)
    run.refresh_from_db()
print("RUN", run.pk, run.status)
"""


def doc_files(page: str, section: str | None) -> list[tuple[str, str]]:
    """(file=, source) of a page's ``python file=`` blocks, in order; only those under
    its ``## section`` when one is named."""
    text = (DOCS / page).read_text()
    if section is not None:
        text = text.partition(f"\n## {section}\n")[2].partition("\n## ")[0]
        assert text, f"docs/{page} has no section {section!r}"
    return re.findall(r"^```python file=(\S+)\n(.*?)^```", text, re.M | re.S)


def redis_url_or_skip() -> str:
    url = os.environ.get("REDIS_URL", "")
    if not url:
        if os.environ.get("LEDGER_REQUIRE_REDIS") == "1":
            pytest.fail("LEDGER_REQUIRE_REDIS=1 but REDIS_URL is not set (scripts/rig/redis up)")
        pytest.skip("needs Redis: REDIS_URL (scripts/rig/redis up)")
    # A database of the server of its own: the suite's other Celery workers never take
    # this project's messages, nor this worker theirs.
    from urllib.parse import urlsplit

    return urlsplit(url)._replace(path="/11").geturl()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_new_project_follows_the_docs_to_a_celery_run_a_sweep_metrics_and_health(tmp_path):
    # #25: "a fresh Django project following only the docs reaches a Celery run, a sweep,
    # metrics and health with no step the docs leave out", with the built wheel.
    if connection.vendor != "sqlite":
        pytest.skip("proved once per Django line, on a new project's own SQLite database")
    broker = redis_url_or_skip()
    import sysconfig
    import urllib.error
    import urllib.request

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "DATABASE_URL")
    }
    # quickstart.md, "Install": the wheel built once into a directory of one's own, from a
    # copy of the clone's last commit: nothing is written into the clone (#35).
    wheels = tmp_path / "wheels"
    before = sorted(p.name for p in ROOT.iterdir())
    sh(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--disable-pip-version-check",
        "--no-deps",
        "--wheel-dir",
        str(wheels),
        f"git+file://{ROOT}",
        cwd=tmp_path,
        env=env,
    )
    assert sorted(p.name for p in ROOT.iterdir()) == before, "the build wrote into the clone"
    # A new environment that sees this one's packages (Django, Celery, the extras), but
    # not the checkout: the app comes from the wheel, found by its name with --find-links.
    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", str(venv), cwd=tmp_path, env=env)
    py = str(venv / "bin" / "python")
    purelib = sh(
        py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path, env=env
    ).stdout.strip()
    (Path(purelib) / "host-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [
        py,
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-index",
        "--no-deps",
    ]
    sh(*pip, "--find-links", str(wheels), "django-events-ledger", cwd=tmp_path, env=env)
    sh(py, "-m", "django", "startproject", "proj", cwd=tmp_path, env=env)
    host = tmp_path / "proj"

    # The pages' files, pasted as a reader pastes them: settings fragments at the end of
    # settings.py ("..." in a list is what the list held), the rest as files. Every page
    # calls the project's package proj, as the Celery page's own files must.
    settings = host / "proj" / "settings.py"
    written: dict[str, str] = {}
    for page, section in ADOPTER_PATH:
        for name, source in doc_files(page, section):
            if name == "settings.py":
                source = re.sub(r"^(\s*)\.\.\.,.*$", r"\1*INSTALLED_APPS,", source, flags=re.M)
                source = source.replace(DOCS_BROKER, broker)  # the reader's own broker
                settings.write_text(settings.read_text() + "\n" + source)
                continue
            written[name] = source if name not in written else written[name] + "\n" + source
            path = host / name
            path.parent.mkdir(exist_ok=True)
            (path.parent / "__init__.py").touch()
            path.write_text(written[name])
    assert set(written) == {
        "banners/event_actions.py",
        "proj/celery.py",
        "proj/__init__.py",
        "proj/urls.py",
    }
    # A reader merging the pages' lists lists an app once.
    settings.write_text(
        settings.read_text() + "\nINSTALLED_APPS = list(dict.fromkeys(INSTALLED_APPS))\n"
    )

    token = "a-token-of-sixteen-or-more"
    env = {**env, "LEDGER_METRICS_TOKEN": token}
    manage = [py, "manage.py"]
    sh(*manage, "migrate", "-v0", cwd=host, env=env)
    sh(*manage, "check", "--fail-level", "WARNING", cwd=host, env=env)
    where = sh(py, "-c", "import events_ledger; print(events_ledger.__file__)", cwd=host, env=env)
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout  # the wheel's

    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            list(args),
            cwd=host,
            env=env,
            text=True,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        started.append(proc)
        return proc

    try:
        # running-at-scale.md: "celery -A proj worker", one process is enough here.
        worker = start(
            py, "-m", "celery", "-A", "proj", "worker", "--concurrency", "1", "-l", "warning"
        )
        out = sh(*manage, "shell", "-c", SEND_A_RUN, cwd=host, env=env).stdout
        run_id, status = out.split("RUN", 1)[1].split()
        assert status == "completed", out
        banners = host / "media" / "banners"  # quickstart.md's MEDIA_ROOT
        assert len(list(banners.iterdir())) == 1  # the banner is up
        # quickstart.md, "Give it back": the sweep.
        swept = sh(*manage, "cleanup_runs", cwd=host, env=env).stdout
        assert f"run {run_id}: attempted 1, reverted 1" in swept and "-> complete" in swept
        assert list(banners.iterdir()) == []

        # monitoring.md: /metrics with the bearer token, /health/ to anyone.
        port = free_port()
        server = start(*manage, "runserver", f"127.0.0.1:{port}", "--noreload")
        base = f"http://127.0.0.1:{port}"

        def get(path: str, **headers: str) -> tuple[int, str]:
            request = urllib.request.Request(base + path, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        deadline = time.monotonic() + 30
        while True:  # until the server answers (it prints nothing we could wait on)
            try:
                get("/health/", Accept="application/json")
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None, server.stdout.read() if server.stdout else ""
                assert time.monotonic() < deadline, "runserver never answered"
                time.sleep(0.1)
        code, health = get("/health/", Accept="application/json")
        assert code == 200 and "LedgerHealthCheck" in health, health
        code, text = get("/metrics", Authorization=f"Bearer {token}")
        assert code == 200 and "events_ledger_healthy 1.0" in text, text
        assert get("/metrics")[0] == 401  # no token, no session: asked to authenticate
        assert worker.poll() is None  # the worker ran the run and is still up
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
