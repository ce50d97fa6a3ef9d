"""The ledger's cost per step through Celery, against the same no-op as a bare Celery task
on the same workers in the same run (#14, #27). Printed, never asserted.

    DATABASE_URL=... REDIS_URL=... python -m project.bench.celery_bench [--steps N]
        [--connections default,persistent] [--layouts 3x2,1x1] [--json out.json]

Makes a scratch database beside ``DATABASE_URL``'s (``<name>_celery_bench``, dropped at
the end). For each connection set-up it starts its own ``celery worker`` processes on it
and sends N ``bench.bare_noop`` tasks, then N ``events_ledger.step`` tasks whose action
(``bench.noop``) does the same nothing, each batch timed from the first send to the last
answer. Each set-up runs in each layout of workers × pool processes: 3 × 2 (more
processes than this machine's cores, as a loaded worker host is), and 1 × 1 (one task at a
time: its wall time is what a step occupies a worker, with no other worker's task
waiting for the same core). The set-ups:

- ``default``: Django's and Celery's defaults (``CELERY_DB_REUSE_MAX=0``, whatever the
  example project's settings say). ``CONN_MAX_AGE=0``, and Celery's Django fixup closes every database connection before and after every task anyway: each step
  opens a connection of its own.
- ``persistent``: what ``docs/running-at-scale.md`` tells a host to set: ``CONN_MAX_AGE``
  with ``CONN_HEALTH_CHECKS`` (in the URL) and ``CELERY_DB_REUSE_MAX``, without which the
  fixup closes the connection ``CONN_MAX_AGE`` would have kept.

What it prints per set-up, ledgered step against bare task:

- tasks per second through the workers;
- **worker CPU per step**: the CPU time the worker processes (and their pool children)
  spent, read from ``/proc``, divided by the tasks: it does not grow when the machine's
  cores are shared, as a wall-clock figure does;
- **machine CPU per step**: every core's busy time (``/proc/stat``) over the batch, the
  database server's, Redis's and this client's included;
- **worker wall time per step**: the batch's wall time × worker processes ÷ tasks: what
  a step occupies a worker, waits for the database included. It is honest in the 1 × 1
  layout; in 3 × 2, with more processes than cores, it counts waiting for a core too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

ROOT = Path(__file__).resolve().parent.parent.parent
#: Clock ticks per second, the unit of /proc's CPU times.
_TICK = os.sysconf("SC_CLK_TCK")
#: What "persistent" adds: to the URL, and to the workers' environment.
PERSISTENT_URL = {"conn_max_age": "300", "conn_health_checks": "true"}
PERSISTENT_ENV = {"CELERY_DB_REUSE_MAX": "1000"}
SETUPS = ("default", "persistent")


@dataclass
class Batch:
    tasks: int
    wall_s: float
    worker_cpu_s: float
    machine_cpu_s: float

    @property
    def per_s(self) -> float:
        return self.tasks / self.wall_s


def _proc_cpu(pid: int) -> float:
    """A process's own CPU seconds and those of its children it has reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    # After the name: state is field 3, utime..cstime are fields 14..17.
    return sum(int(x) for x in fields[11:15]) / _TICK


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return found


def _workers_cpu(workers: list[subprocess.Popen[bytes]]) -> float:
    """The workers' CPU seconds: each main process and its pool's children."""
    total = 0.0
    for w in workers:
        total += _proc_cpu(w.pid) + sum(_proc_cpu(c) for c in _children(w.pid))
    return total


def _machine_cpu() -> float:
    """Every core's busy seconds since boot (not idle, not waiting for the disk)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / _TICK


def _timed(send: Any, ids: list[int], timeout: float, workers: list[Any]) -> Batch:
    """From the first send to the last answer: the wall time, and the CPU spent."""
    cpu0, machine0 = _workers_cpu(workers), _machine_cpu()
    started = time.perf_counter()
    results = [send(i) for i in ids]
    for result in results:
        answer = result.get(timeout=timeout)
        assert answer["outcome"] == "done", answer
    wall = time.perf_counter() - started
    return Batch(len(ids), wall, _workers_cpu(workers) - cpu0, _machine_cpu() - machine0)


def _start_workers(n: int, concurrency: int, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    worker = [sys.executable, "-m", "celery", "-A", "project", "worker", "--pool", "prefork"]
    return [
        subprocess.Popen(
            [*worker, "--concurrency", str(concurrency), "-n", f"bench{i}-{os.getpid()}@ledger"]
            + ["-l", "warning", "--without-gossip", "--without-mingle"],
            cwd=ROOT,
            env=env,
            start_new_session=True,
            # The banners and the root warning would bury the figure; a failing worker
            # shows as the bench's timeout.
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(n)
    ]


def _wait_for(app: Any, n: int, patience_s: float = 120) -> None:
    deadline = time.monotonic() + patience_s
    while len(app.control.ping(timeout=0.5)) < n:
        if time.monotonic() > deadline:
            raise SystemExit("the workers did not answer a ping")


def _worker_env(url: Any, name: str, setup: str) -> dict[str, str]:
    query = {k: v for k, v in parse_qsl(url.query) if k not in PERSISTENT_URL}
    # "default": Celery's own default (0: close before and after every task), whatever
    # the example project's settings choose.
    extra = dict.fromkeys(PERSISTENT_ENV, "0")
    if setup == "persistent":
        query.update(PERSISTENT_URL)
        extra = PERSISTENT_ENV
    db = urlunparse(url._replace(path=f"/{name}", query=urlencode(query)))
    return dict(os.environ, DATABASE_URL=db, **extra)


def measure(setup: str, layout: tuple[int, int], steps: int, url: Any, name: str) -> dict[str, Any]:
    from events_ledger.celery import step_task
    from events_ledger.models import EventRun, EventRunStep
    from project.bench.tasks import bare_noop
    from project.celery import app

    workers_n, concurrency = layout
    app.control.purge()
    workers = _start_workers(workers_n, concurrency, _worker_env(url, name, setup))
    try:
        _wait_for(app, workers_n)
        warm = list(range(workers_n * concurrency * 4))
        _timed(bare_noop.delay, warm, 120, workers)
        runs = [
            EventRun.objects.create(name=f"bench {setup} {i}", status="running") for i in range(4)
        ]
        made = EventRunStep.objects.bulk_create(
            EventRunStep(run=runs[i % 4], action_id="bench.noop", seq=i)
            for i in range(steps + len(warm))
        )
        step_ids = [s.pk for s in made]
        _timed(step_task.delay, step_ids[: len(warm)], 120, workers)
        bare = _timed(bare_noop.delay, list(range(steps)), 600, workers)
        ledgered = _timed(step_task.delay, step_ids[len(warm) :], 600, workers)
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(120)
    processes = workers_n * concurrency
    per_ms = lambda b, attr: getattr(b, attr) / b.tasks * 1000  # noqa: E731
    return {
        "setup": setup,
        "layout": f"{workers_n}x{concurrency}",
        "bare": asdict(bare) | {"per_s": bare.per_s},
        "ledgered": asdict(ledgered) | {"per_s": ledgered.per_s},
        "worker_cpu_ms": per_ms(ledgered, "worker_cpu_s") - per_ms(bare, "worker_cpu_s"),
        "machine_cpu_ms": per_ms(ledgered, "machine_cpu_s") - per_ms(bare, "machine_cpu_s"),
        "worker_wall_ms": processes * (per_ms(ledgered, "wall_s") - per_ms(bare, "wall_s")),
        "bare_worker_cpu_ms": per_ms(bare, "worker_cpu_s"),
    }


def text(doc: dict[str, Any]) -> str:
    lines = [
        f"{doc['vendor']}, Celery workers x pool processes (prefork), "
        f"{doc['steps']} tasks each, {doc['cores']} cores, load average "
        f"{doc['load_before']:.1f} before, {doc['load_after']:.1f} after:"
    ]
    for r in doc["results"]:
        lines += [
            f"  connections {r['setup']}, {r['layout']}:",
            f"    bare Celery task:        {r['bare']['per_s']:8.1f} tasks/s, "
            f"{r['bare_worker_cpu_ms']:.2f} ms of worker CPU each",
            f"    ledgered step:           {r['ledgered']['per_s']:8.1f} steps/s",
            f"    the ledger per step:     {r['worker_cpu_ms']:8.2f} ms of worker CPU",
            f"                             {r['machine_cpu_ms']:8.2f} ms of the machine's CPU "
            "(servers included)",
            f"                             {r['worker_wall_ms']:8.2f} ms of worker wall time"
            + ("" if r["layout"] == "1x1" else " (waiting for a core counted)"),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--connections", default=",".join(SETUPS))
    parser.add_argument("--layouts", default="3x2,1x1", help="workers x pool processes, ...")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    setups = [s for s in args.connections.split(",") if s]
    if not setups or any(s not in SETUPS for s in setups):
        parser.error(f"--connections: a comma-separated choice of {', '.join(SETUPS)}")
    try:
        layouts = [tuple(int(n) for n in x.split("x", 1)) for x in args.layouts.split(",")]
        assert layouts and all(len(x) == 2 and min(x) >= 1 for x in layouts)
    except (ValueError, AssertionError):
        parser.error("--layouts: WORKERSxPROCESSES[,...], each at least 1x1")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DEBUG", "false")
    import django

    django.setup()
    from django.db import connection

    url = urlparse(os.environ["DATABASE_URL"])
    name = f"{url.path.strip('/')}_celery_bench"
    connection.settings_dict.setdefault("TEST", {})["NAME"] = name
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    load_before = os.getloadavg()[0]
    try:
        results = [
            measure(s, layout, args.steps, url, name)  # type: ignore[arg-type]
            for s in setups
            for layout in layouts
        ]
    finally:
        connection.creation.destroy_test_db(name, verbosity=0)
    doc = {
        "vendor": connection.vendor,
        "steps": args.steps,
        "cores": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "results": results,
    }
    print(text(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
