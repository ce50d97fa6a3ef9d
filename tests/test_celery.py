"""Celery (#14): the ledger's tasks on real Celery worker processes over the rig's Redis.

The scenario: 3 workers (prefork, concurrency 2) execute the steps of many runs against
the demo world; some runs are cancelled while their steps are queued or running; one
worker (its main process and its pool) is SIGKILLed in the middle of a ``perform``;
sweeps run as periodic tasks from Celery beat. After the queue drains and the claim TTL passes: the world equals its
starting state, nothing is unresolved, no two calls of one step overlapped, and every
run's summary agrees with its rows. ``make test`` runs it short; ``make chaos`` long
(``LEDGER_CHAOS=long``: 2,000 steps of 500 runs).

Needs ``REDIS_URL`` (``scripts/rig/redis up``); skipped without it, except under
``scripts/test-all`` (``LEDGER_REQUIRE_REDIS=1``), where its absence fails.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from events_ledger.ledger import execute_step
from events_ledger.models import EventRun, EventRunResource, EventRunStep
from project.world.models import Call, Creature, RegionSetting
from tests.helpers import PATIENCE_S, connection, new_run, spawn_step, wait_until
from tests.processes import ROOT, child_env

REDIS_URL = os.environ.get("REDIS_URL", "")
if not REDIS_URL and os.environ.get("LEDGER_REQUIRE_REDIS") == "1":
    raise RuntimeError("LEDGER_REQUIRE_REDIS=1 but REDIS_URL is not set (scripts/rig/redis up)")
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.skipif(not REDIS_URL, reason="needs Redis: REDIS_URL (scripts/rig/redis up)"),
    pytest.mark.skipif(
        os.environ.get("DATABASE_URL", "").startswith("sqlite"),
        reason="six worker processes writing at once: a server database",
    ),
]
LONG = os.environ.get("LEDGER_CHAOS") == "long"
#: Short, so a step whose worker was killed is claimed again soon (the TTL is the wait).
CLAIM_TTL_S = 6
#: Short, so the runs a killed worker held come back from Redis soon (a message is
#: delivered again after this long unacknowledged; a run still going then is `busy`).
VISIBILITY_TIMEOUT_S = 4


def size(short: int, long: int) -> int:
    return long if LONG else short


@pytest.fixture
def celery_app() -> Any:
    from project.celery import app

    app.control.purge()  # a message left by an earlier test's workers is not this test's
    return app


class Workers:
    """Real ``celery worker`` processes (and optionally ``celery beat``) on the test
    database; stopped, whatever happened, when the test ends."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        #: Each worker's main process, by its name.
        self.by_name: dict[str, subprocess.Popen[bytes]] = {}
        self.timers: list[threading.Timer] = []

    def _env(self, **extra: str) -> dict[str, str]:
        # Above the demo spawn's 5 s budget, as events_ledger.E007 asks.
        env = child_env({"STEP_CLAIM_TTL": CLAIM_TTL_S})
        env["CELERY_VISIBILITY_TIMEOUT_S"] = str(VISIBILITY_TIMEOUT_S)
        env.update(extra)
        return env

    def _start(self, name: str, args: list[str], **extra: str) -> None:
        # Files, not pipes: a worker logging a traceback nobody reads must not block.
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "project", *args],
                cwd=ROOT,
                env=self._env(**extra),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole, pool and all
            )
        self.procs.append(proc)
        self.by_name[name] = proc

    def start_later(self, delay_s: float, app: Any, first: int) -> None:
        """Start one more worker ``delay_s`` from now, as a process supervisor restarts a
        dead one, while the test goes on."""
        timer = threading.Timer(
            delay_s, self.start, (app, 1), {"concurrency": 2, "first": first, "wait": False}
        )
        self.timers.append(timer)
        timer.start()

    def kill(self, name: str) -> datetime:
        """SIGKILL a worker whole: its main process and every pool process, at once.
        Answers when: a call of a killed process lasted at most until then."""
        os.killpg(self.by_name[name].pid, signal.SIGKILL)
        at = timezone.now()
        self.by_name[name].wait(PATIENCE_S)
        return at

    def start(
        self,
        app: Any,
        n: int,
        concurrency: int = 2,
        first: int = 0,
        wait: bool = True,
        options: tuple[str, ...] = (),
        **extra: str,
    ) -> list[str]:
        names = [f"w{i}-{os.getpid()}@ledger" for i in range(first, first + n)]
        for name in names:
            self._start(
                name,
                ["worker", "--pool", "prefork", "--concurrency", str(concurrency), "-n", name]
                + ["-l", "warning", "--without-gossip", "--without-mingle", *options],
                **extra,
            )
        if wait:
            wait_until(lambda: self._answering(app) >= set(names), "the workers to answer a ping")
        return names

    def beat(self, every_s: float) -> None:
        self._start(
            "beat",
            ["beat", "-l", "warning", "-s", str(self.tmp / "beat-schedule")],
            LEDGER_SWEEP_EVERY_S=str(every_s),
        )

    def _answering(self, app: Any) -> set[str]:
        return {name for reply in app.control.ping(timeout=0.5) for name in reply}

    def pool_pids(self, app: Any) -> dict[int, str]:
        """Each prefork pool process's pid, with the worker it belongs to."""
        stats = app.control.inspect(timeout=2).stats() or {}
        return {pid: name for name, s in stats.items() for pid in s["pool"]["processes"]}

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.tmp.glob("*.log"))

    def stop(self) -> None:
        for timer in self.timers:
            timer.cancel()
            timer.join()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(PATIENCE_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(PATIENCE_S)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    running = Workers(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def _runs(n: int, steps: int, name: str = "celery") -> list[EventRun]:
    out = []
    for i in range(n):
        run = new_run(name=f"{name}{i}", status="pending")
        for seq in range(steps):
            spawn_step(run, region=f"r{i % 7}", count=1, seq=seq)
        out.append(run)
    return out


@pytest.mark.parametrize("kept", [False, True], ids=["celery-default", "conn-max-age"])
def test_a_worker_keeps_its_connection_between_steps_only_when_told(
    kept, celery_app, workers, tmp_path
):  # #27
    """Celery's Django fixup closes every connection before and after every task unless
    ``CELERY_DB_REUSE_MAX`` is set, whatever ``CONN_MAX_AGE`` says: each step then
    opens a connection (PostgreSQL's costs some 10 ms). With both set, as
    docs/running-at-scale.md tells a host, one connection serves step after step."""
    from events_ledger.celery import step_task

    log = tmp_path / "connections.log"
    extra = {"LEDGER_CHILD_CONNECTIONS_LOG": str(log), "CELERY_DB_REUSE_MAX": "0"}
    if kept:
        url = os.environ["DATABASE_URL"]
        extra["DATABASE_URL"] = (
            url + ("&" if "?" in url else "?") + "conn_max_age=300&conn_health_checks=true"
        )
        extra["CELERY_DB_REUSE_MAX"] = "1000"
    workers.start(celery_app, 1, concurrency=1, **extra)
    run = new_run(name="kept" if kept else "not kept", status="running")
    steps = [EventRunStep.objects.create(run=run, action_id="bench.noop", seq=i) for i in range(9)]
    assert step_task.delay(steps[0].pk).get(timeout=PATIENCE_S)["outcome"] == "done"
    log.write_text("")  # what the worker opened while starting, and for its first step
    for step in steps[1:]:
        assert step_task.delay(step.pk).get(timeout=PATIENCE_S)["outcome"] == "done"
    opened = log.read_text().splitlines()
    if kept:
        assert opened == [], opened
        # The server drops the kept connection between tasks (a restart, a timeout):
        # the health check finds it dead and the next step gets a new one, not an error.
        _end_other_sessions()
        more = EventRunStep.objects.create(run=run, action_id="bench.noop", seq=len(steps))
        assert step_task.delay(more.pk).get(timeout=PATIENCE_S)["outcome"] == "done"
        assert len(log.read_text().splitlines()) == 1
    else:
        assert len(opened) >= len(steps) - 1, opened


def _end_other_sessions() -> None:
    """End every other session of the test database, as a server restart would."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return
        cursor.execute(
            "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = DATABASE() "
            "AND ID <> CONNECTION_ID()"
        )
        for (session,) in cursor.fetchall():
            cursor.execute("KILL CONNECTION %s", [session])


def test_runs_steps_sweeps_and_reconciles_on_celery_workers(world, celery_app, workers):  # W5, C5
    from events_ledger.celery import reconcile_task, run_task, step_task, sweep_task

    workers.start(celery_app, 2)
    runs = _runs(6, 3)
    answers = [run_task.delay(r.pk) for r in runs]
    for answer in answers:
        assert answer.get(timeout=PATIENCE_S)["outcome"] == "completed"
    assert Creature.objects.count() == 18
    lone = new_run(name="lone")
    step = spawn_step(lone, "east", 2)
    assert step_task.delay(step.pk).get(timeout=PATIENCE_S)["outcome"] == "done"
    assert reconcile_task.delay("world").get(timeout=PATIENCE_S)["world"]["orphaned"] == 0
    swept = sweep_task.delay(len(runs) + 1).get(timeout=PATIENCE_S)
    assert swept["runs"] == len(runs) and swept["remaining"] == 0
    # The completed runs gave everything back; the lone run is still going.
    assert set(Creature.objects.values_list("spawned_by", flat=True)) == {step.idempotency_key}


def test_a_sweep_past_its_soft_time_limit_asks_each_key_once(
    world, celery_app, workers
):  # C4, R5: the host's interrupt ends the pass, not the calls' claims
    """Celery raises ``SoftTimeLimitExceeded`` (a plain Exception) in the task while the
    pass waits on its module calls. The calls go on under their claims in the pool
    process, and their answers are written there when they end: a sweep right after
    asks nothing again (it used to hand the claims back and ask the same keys, or count
    the interrupt as a failed attempt)."""
    from celery.exceptions import SoftTimeLimitExceeded

    from events_ledger.celery import sweep_task

    workers.start(celery_app, 1, concurrency=1)
    run = new_run(name="soft limit", status="running")
    for seq, region in enumerate(("north", "south")):
        assert execute_step(spawn_step(run, region, count=1, seq=seq)).outcome == "done"
    EventRun.objects.transition(run, "cancelled", from_="running")
    world.switch_on("despawn.wait")  # the world takes longer than the task may
    with pytest.raises(SoftTimeLimitExceeded):
        sweep_task.apply_async(soft_time_limit=1).get(timeout=PATIENCE_S)
    asked = Call.objects.filter(verb="despawn").count()
    assert asked >= 1
    again = sweep_task.delay().get(timeout=PATIENCE_S)
    assert again["runs"] == 0 and Call.objects.filter(verb="despawn").count() == asked
    assert not EventRunResource.objects.filter(revert_attempts__gt=0).exists()
    world.switch_off("despawn.wait")
    wait_until(
        lambda: not EventRunResource.objects.filter(run=run, status="reverting").exists(),
        "the interrupted pass's answers written by the worker",
    )
    while sweep_task.delay().get(timeout=PATIENCE_S)["runs"]:
        pass
    keys = list(Call.objects.filter(verb="despawn").values_list("idempotency_key", flat=True))
    assert len(keys) == len(set(keys)) == 2
    assert set(
        EventRunResource.objects.filter(run=run, kind="creature").values_list(
            "status", "revert_attempts"
        )
    ) == {("reverted", 0)}


def _cancelled_two_key_run() -> EventRun:
    run = new_run(name="two keys", status="running")
    for seq, region in enumerate(("north", "south")):
        assert execute_step(spawn_step(run, region, count=1, seq=seq)).outcome == "done"
    EventRun.objects.transition(run, "cancelled", from_="running")
    return run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_pool_process_that_ends_after_an_interrupted_sweep_leaves_one_call_at_a_time(
    world, celery_app, workers
):  # C4, R5: max_tasks_per_child=1 after a soft time limit
    """The pool process ends after its one task, while the interrupted pass's call still
    waits in the world: the call ends with it. Its rows are asked again only after that
    process is gone (their claim stale), never beside the first call."""
    import json

    from celery.exceptions import SoftTimeLimitExceeded

    from events_ledger.celery import sweep_task

    ttl = json.dumps({"STEP_CLAIM_TTL": CLAIM_TTL_S, "REVERT_CLAIM_TTL": 3})
    workers.start(
        celery_app,
        1,
        concurrency=1,
        options=("--max-tasks-per-child", "1"),
        LEDGER_CHILD_SETTINGS=ttl,
    )
    run = _cancelled_two_key_run()
    world.switch_on("despawn.wait")
    with pytest.raises(SoftTimeLimitExceeded):
        sweep_task.apply_async(soft_time_limit=1).get(timeout=PATIENCE_S)
    first = {c.idempotency_key: c for c in Call.objects.filter(verb="despawn")}
    [pid] = {c.pid for c in first.values()}
    wait_until(lambda: not _alive(pid), "the pool process to end after its one task")
    gone_at = timezone.now()
    world.switch_off("despawn.wait")
    wait_until(
        lambda: (
            sweep_task.delay().get(timeout=PATIENCE_S) is not None
            and not EventRunResource.objects.filter(run=run).exclude(status="reverted").exists()
        ),
        "the rows given back by a later pool process",
    )
    for call in Call.objects.filter(verb="despawn").exclude(pk__in=[c.pk for c in first.values()]):
        # A second call of a key began only once the first call's process was gone.
        assert call.pid != pid and call.created_at >= gone_at, call
    assert set(
        EventRunResource.objects.filter(run=run, kind="creature").values_list("status", flat=True)
    ) == {"reverted"}


def test_a_warm_shutdown_lets_the_pass_end_and_write_its_verdicts(
    world, celery_app, workers
):  # C4, R5: SIGTERM of a Celery worker while a sweep's calls run
    from events_ledger.celery import sweep_task

    [name] = workers.start(celery_app, 1, concurrency=1)
    run = _cancelled_two_key_run()
    world.switch_on("despawn.wait")
    answer = sweep_task.delay()
    wait_until(lambda: Call.objects.filter(verb="despawn").exists(), "the sweep inside despawn")
    workers.by_name[name].send_signal(signal.SIGTERM)  # warm: the running task may end
    world.switch_off("despawn.wait")
    assert answer.get(timeout=PATIENCE_S)["runs"] == 1
    assert workers.by_name[name].wait(PATIENCE_S) == 0
    keys = list(Call.objects.filter(verb="despawn").values_list("idempotency_key", flat=True))
    assert len(keys) == len(set(keys)) == 2
    assert set(
        EventRunResource.objects.filter(run=run, kind="creature").values_list("status", flat=True)
    ) == {"reverted"}


def _overlaps(killed: dict[int, datetime]) -> list[str]:
    """Keys two of whose calls were in the world at once. A call lasts from its
    ``perform`` row to its ``performed`` row, or to the moment its process was killed."""
    events: dict[str, list[tuple[datetime, str, int]]] = {}
    for verb, key, pid, at in Call.objects.filter(verb__in=("perform", "performed")).values_list(
        "verb", "idempotency_key", "pid", "created_at"
    ):
        events.setdefault(key, []).append((at, verb, pid))
    bad = []
    for key, seen in events.items():
        open_until: datetime | None = None
        for at, verb, pid in sorted(seen):
            if verb == "perform":
                if open_until is not None and at < open_until:
                    bad.append(key)
                    break
                open_until = killed.get(pid, datetime.max.replace(tzinfo=at.tzinfo))
            else:
                open_until = None
    return bad


def _summaries_agree(runs: list[EventRun]) -> list[str]:
    """Every run's status and cleanup summary as its rows say they must be."""
    wrong = []
    for run in EventRun.objects.filter(pk__in=[r.pk for r in runs]):
        steps = list(EventRunStep.objects.filter(run=run).values_list("status", flat=True))
        unresolved = EventRunResource.objects.filter(run=run).unresolved().count()
        if run.status == "completed" and set(steps) != {"done"}:
            wrong.append(f"run {run.pk} completed with steps {steps}")
        if run.status == "failed" and "failed" not in steps:
            wrong.append(f"run {run.pk} failed with no failed step: {steps}")
        if run.status not in ("completed", "failed", "cancelled"):
            wrong.append(f"run {run.pk} is {run.status}")
        if unresolved or run.cleanup_status not in ("complete", "not_required"):
            wrong.append(f"run {run.pk}: {run.cleanup_status} with {unresolved} unresolved")
    return wrong


def test_scenario_workers_cancels_a_sigkill_and_beat_sweeps(world, celery_app, workers, figure):
    # W5 (one call of a step at a time), rule 1, C5, the invariant
    from events_ledger.celery import run_task

    runs_n, per_run = size(40, 500), size(3, 4)
    rng = random.Random(14)
    rates_before = dict(RegionSetting.objects.values_list("region", "spawn_rate"))
    world.switch_on("spawn.trace")
    runs = _runs(runs_n, per_run, name="scenario")
    workers.start(celery_app, 3, concurrency=2)
    pools = workers.pool_pids(celery_app)
    workers.beat(every_s=0.5)
    # Held in the middle of a perform, the first one to get there is killed there.
    world.switch_on("spawn.wait")
    for run in runs:
        run_task.delay(run.pk)
    cancelled_queued = rng.sample(runs, max(1, runs_n // 10))
    for run in cancelled_queued:  # queued: most have not started yet
        EventRun.objects.transition(run, "cancelled", from_=("pending", "running"))
    wait_until(lambda: Call.objects.filter(verb="perform.waiting").exists(), "a perform to wait")
    waiting = Call.objects.filter(verb="perform.waiting").order_by("pk").first()
    assert waiting is not None
    assert waiting.pid in pools, (waiting.pid, pools)
    # The whole worker goes, main process and pool: its runs' messages were taken and
    # never acknowledged, and come back from Redis after the visibility timeout.
    owner = pools[waiting.pid]
    at = workers.kill(owner)
    killed = {pid: at for pid, name in pools.items() if name == owner}
    world.switch_off("spawn.wait")
    # As a process supervisor would, a new worker takes the dead one's place. Kombu's
    # Redis transport puts back messages unacknowledged for longer than the visibility
    # timeout on a worker's first tick (about 10 s after it starts), then only about
    # every 100 s: the new worker starts once the dead one's messages are that old. The
    # surviving workers' ticks may hand out runs still going too: their steps answer
    # `busy` and are retried. The cancels below go on meanwhile, while the queue drains.
    workers.start_later(VISIBILITY_TIMEOUT_S + 1, celery_app, first=3)

    # More while the queue drains, spread over it: each is cancelled once the runs ahead
    # of it have gone by, so its steps are queued or running when it is.
    ids = [r.pk for r in runs]
    rest = [r for r in runs if r not in cancelled_queued]
    later = sorted(rng.sample(rest, max(1, runs_n // 10)), key=lambda r: r.pk)
    cancelled_running = []
    for run in later:
        ahead = sum(1 for r in runs if r.pk < run.pk) // 2
        wait_until(
            lambda ahead=ahead: (
                EventRun.objects.filter(pk__in=ids).exclude(status="pending").count() >= ahead
            ),
            f"the runs ahead of run {run.pk} to start",
        )
        if EventRun.objects.transition(run, "cancelled", from_=("pending", "running")):
            cancelled_running.append(run)

    def drained_and_given_back() -> bool:
        return (
            not EventRun.objects.filter(pk__in=ids, status__in=("pending", "running")).exists()
            and not EventRunResource.objects.filter(run_id__in=ids).unresolved().exists()
            and not EventRun.objects.filter(pk__in=ids, cleanup_status="pending").exists()
            and not Creature.objects.exists()
        )

    t0 = time.monotonic()
    wait_until(drained_and_given_back, "every run to end and be given back", PATIENCE_S * 3)
    elapsed = time.monotonic() - t0
    overlaps = _overlaps(killed)
    wrong = _summaries_agree(runs)
    statuses = dict(Counter(EventRun.objects.filter(pk__in=ids).values_list("status", flat=True)))
    retried = EventRunStep.objects.filter(run_id__in=ids, attempts__gt=1).count()
    rates_after = dict(RegionSetting.objects.values_list("region", "spawn_rate"))
    holds = not overlaps and not wrong and rates_after == rates_before
    figure(
        f"{runs_n * per_run} steps of {runs_n} runs on 3 Celery workers x 2 (one killed, one "
        f"started in its place): {statuses}, "
        f"{len(cancelled_queued) + len(cancelled_running)} cancelled, 1 worker (its main "
        f"process and pool) SIGKILLed mid-perform, {retried} steps claimed again; drained "
        f"and given back {elapsed:.1f} s after the kill; overlapping calls: {len(overlaps)}",
        holds,
    )
    assert not overlaps, overlaps[:5]
    assert not wrong, wrong[:5]
    assert rates_after == rates_before
    assert not Creature.objects.exists()
    # The killed perform's step was claimed again after the TTL and finished by its key,
    # unless its run was cancelled meanwhile: then the sweep gave it back by its key.
    killed_step = EventRunStep.objects.select_related("run").get(
        idempotency_key=waiting.idempotency_key
    )
    assert killed_step.attempts >= 2 or killed_step.run.status == "cancelled", killed_step
