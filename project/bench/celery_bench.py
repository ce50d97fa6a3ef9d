"""Ledgered steps per second through Celery, against the same no-op as a bare Celery task
on the same workers in the same run (#14). Printed, never asserted.

    DATABASE_URL=... REDIS_URL=... python -m project.bench.celery_bench [--steps N]

Makes a scratch database beside ``DATABASE_URL``'s (``<name>_celery_bench``, dropped at
the end), starts its own ``celery worker`` processes on it, and sends N ``bench.bare_noop``
tasks, then N ``events_ledger.step`` tasks whose action (``bench.noop``) does the same
nothing, each batch timed from the first send to the last answer.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parent.parent.parent


def _timed(send: Any, ids: list[int], timeout: float) -> float:
    """Seconds from the first send to the last answer."""
    started = time.perf_counter()
    results = [send(i) for i in ids]
    for result in results:
        answer = result.get(timeout=timeout)
        assert answer["outcome"] == "done", answer
    return time.perf_counter() - started


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DEBUG", "false")
    import django

    django.setup()
    from django.db import connection

    from events_ledger.celery import step_task
    from events_ledger.models import EventRun, EventRunStep
    from project.bench.tasks import bare_noop
    from project.celery import app

    url = urlparse(os.environ["DATABASE_URL"])
    name = f"{url.path.strip('/')}_celery_bench"
    connection.settings_dict.setdefault("TEST", {})["NAME"] = name
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    env = dict(os.environ, DATABASE_URL=urlunparse(url._replace(path=f"/{name}")))
    app.control.purge()
    workers = _start_workers(args.workers, args.concurrency, env)
    try:
        _wait_for(app, args.workers)
        warm = list(range(args.workers * args.concurrency * 4))
        _timed(bare_noop.delay, warm, 120)
        runs = [EventRun.objects.create(name=f"bench{i}", status="running") for i in range(4)]
        steps = EventRunStep.objects.bulk_create(
            EventRunStep(run=runs[i % 4], action_id="bench.noop", seq=i)
            for i in range(args.steps + len(warm))
        )
        step_ids = [s.pk for s in steps]
        _timed(step_task.delay, step_ids[: len(warm)], 120)
        bare_s = _timed(bare_noop.delay, list(range(args.steps)), 600)
        ledgered_s = _timed(step_task.delay, step_ids[len(warm) :], 600)
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(120)
        connection.creation.destroy_test_db(name, verbosity=0)
    processes = args.workers * args.concurrency
    bare_rate, ledgered_rate = args.steps / bare_s, args.steps / ledgered_s
    overhead_ms = processes * (ledgered_s - bare_s) / args.steps * 1000
    load = os.getloadavg()[0]
    print(
        f"{connection.vendor}, {args.workers} workers x {args.concurrency} (prefork), "
        f"{args.steps} tasks each, {os.cpu_count()} cores, load average {load:.1f}:\n"
        f"  bare Celery task:      {bare_rate:8.1f} tasks/s\n"
        f"  ledgered step:         {ledgered_rate:8.1f} steps/s\n"
        f"  the ledger per step:   {overhead_ms:8.1f} ms of a worker process's time"
    )


if __name__ == "__main__":
    main()
