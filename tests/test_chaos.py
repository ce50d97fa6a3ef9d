"""Reliability under fire: fault injection on real processes and real servers.

Each scenario asserts its invariant and records one figure. ``make test`` runs the short
version of every scenario; ``make chaos`` runs the long one (``LEDGER_CHAOS=long``) on
every database and prints the table of figures (``scripts/chaos``). Faults are real: a
SIGKILL, a SIGSTOP, a hung call, a process that dies inside a module's call. The world
is the demo's; the database is never faked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import OperationalError, connections
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from events_ledger import Action, Lease
from events_ledger.cleanup import cleanup_run, reconcile_module, sweep
from events_ledger.ledger import execute_step
from events_ledger.models import EventRun, EventRunResource, EventRunStep
from project.world import world as w
from project.world.models import Arena, Call, Creature
from tests.conftest import age_rows
from tests.helpers import (
    PATIENCE_S,
    LiveRowSampler,
    age_step_claims,
    all_given_back,
    despawn_calls_per_creature,
    finished_run,
    new_run,
    new_step,
    phased_run,
    spawn_step,
    wait_until,
)
from tests.processes import finish, race, start

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
Res = EventRunResource.objects
LONG = os.environ.get("LEDGER_CHAOS") == "long"


def size(short: int, long: int) -> int:
    return long if LONG else short


# ── 8 sweepers, every revert exactly once ──


def test_sweepers_together_revert_every_resource_exactly_once(world, vendor, figure):  # C5, R5
    sweepers, runs_n, per_run = 8, size(20, 200), size(5, 10)
    runs = [finished_run(per_run, name=f"r{i}") for i in range(runs_n)]
    results = race("sweep", [{} for _ in range(sweepers)], timeout=900)
    histogram = despawn_calls_per_creature()
    crashes = [r for r in results if "crash" in r]
    holds = histogram == Counter({1: runs_n * per_run}) and all_given_back(runs) and not crashes
    figure(
        f"{runs_n * per_run} resources, {sweepers} sweepers: calls per resource {dict(histogram)}",
        holds,
        lost=Creature.objects.count(),
        stuck=Res.filter(run__in=runs).unresolved().count(),
    )
    assert not crashes, crashes
    assert histogram == Counter({1: runs_n * per_run}), histogram
    assert all_given_back(runs)


# ── #26: 8 sweepers, three dependent phases, the last phase first ──


def test_sweepers_together_give_back_dependent_phases_in_order(world, vendor, figure):  # C8
    """The arena refuses, loudly, to go while a creature stands in it: an earlier phase
    taken before a later one's resources are gone would show as a refusal. Eight
    sweepers started together over the runs never take an earlier phase first."""
    sweepers, runs_n, per_run = 8, size(25, 200), 3
    runs = [phased_run(f"pit{i}", name=f"phased{i}", count=per_run) for i in range(runs_n)]
    started = time.monotonic()
    results = race("sweep", [{} for _ in range(sweepers)], timeout=900)
    seconds = time.monotonic() - started
    crashes = [r for r in results if "crash" in r]
    calls = list(Call.objects.order_by("pk").values_list("pk", "verb", "idempotency_key", "refs"))
    refused = [c for c in calls if c[1] == "arena.refused"]
    # Per run, by the order the world was asked: its rate, then its creatures, then its arena.
    keys = dict(EventRunStep.objects.filter(run__in=runs).values_list("idempotency_key", "run_id"))
    arena_of = {f"pit{i}": run.pk for i, run in enumerate(runs)}
    asked: dict[int, list[str]] = {run.pk: [] for run in runs}
    for _pk, verb, key, refs in calls:
        run_id = keys.get(key) or arena_of.get(key)
        if run_id is None and refs:
            run_id = arena_of.get(refs[0])
        if run_id is not None and verb in ("restore", "despawn", "arena.down"):
            asked[run_id].append(verb)
    out_of_order = {r: v for r, v in asked.items() if v != ["restore", "despawn", "arena.down"]}
    histogram = despawn_calls_per_creature()
    holds = (
        not refused
        and not out_of_order
        and not crashes
        and histogram == Counter({1: runs_n * per_run})
        and all_given_back(runs)
    )
    figure(
        f"{runs_n} runs × 3 phases, {sweepers} sweepers: {len(refused)} refusals, "
        f"{len(out_of_order)} runs out of order, calls per creature {dict(histogram)}, "
        f"{runs_n * (per_run + 2) / seconds:.0f} resources/s",
        holds,
        refused=len(refused),
        out_of_order=len(out_of_order),
    )
    assert not crashes, crashes
    assert not refused, refused[:5]
    assert not out_of_order, dict(list(out_of_order.items())[:5])
    assert histogram == Counter({1: runs_n * per_run}), histogram
    assert all_given_back(runs) and not Arena.objects.exists()


# ── SIGKILL of a sweeper at each of four points ──

POINTS = ("after_claim", "inside_revert", "after_revert", "during_verdict")
#: Calls of revert per step a trial makes: the dead sweeper's, and the one that finishes.
#: ``during_verdict`` dies right after the verdict's statement was sent, its answer never
#: read (before the summaries and the log). Every group given back whole, the verdicts
#: are that one statement, atomic and sent on its own (#27): it has landed, so the next
#: pass finds the rows given back and calls nothing again (before #27 it was a
#: transaction, of which none landed, and the revert was called a second time).
CALLS = {"after_claim": 1, "inside_revert": 2, "after_revert": 2, "during_verdict": 1}


@pytest.mark.parametrize("point", POINTS)
def test_a_sweeper_killed_at_any_point_is_finished_by_the_next(world, point, figure):  # R5, C4
    trials, resolved, calls_seen = size(2, 50), 0, Counter()
    for trial in range(trials):
        Call.objects.all().delete()
        run = finished_run(2, name=f"{point}-{trial}")
        if point == "inside_revert":
            world.switch_on("despawn.die", 1)
        child = start("cleanup_killed_at", {"run_id": run.pk, "point": point})
        child.wait(PATIENCE_S)
        assert child.returncode == -signal.SIGKILL, finish(child)
        rows = list(Res.filter(run=run, kind="creature"))
        # A kill is not a failure: no attempt was spent.
        assert {r.revert_attempts for r in rows} == {0}
        # The claim TTL passes (the dead sweeper never writes again), then one pass.
        age_rows(EventRunResource, [r.pk for r in rows], seconds=3600)
        sweep()
        resolved += all_given_back([run])
        assert {r.revert_attempts for r in Res.filter(run=run, kind="creature")} == {0}
        calls_seen[Call.objects.filter(verb="despawn").count()] += 1
    holds = resolved == trials and set(calls_seen) == {CALLS[point]}
    figure(
        f"{point}: {resolved}/{trials} resolved within TTL + one pass; revert calls {dict(calls_seen)}",
        holds,
    )
    assert resolved == trials
    assert set(calls_seen) == {CALLS[point]}, calls_seen


# ── SIGSTOP past the claim TTL, then SIGCONT ──


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in /proc)."""
    tasks = Path(f"/proc/{pid}/task")
    states = []
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        states.append(stat[stat.rindex(")") + 2])
    return bool(states) and all(state in "Tt" for state in states)


def _stop_and_age(child: subprocess.Popen[Any], pks: list[int]) -> None:
    """SIGSTOP the sweeper inside its module's call, then age its claim past the TTL.

    On SQLite a process stopped in the middle of a read (the module polls its switch
    every 20 ms) keeps the file's shared lock, and no other process may write until it
    runs again: the ageing write then failed "database is locked" (a fresh clone's
    ``make test``, once). Such a stop is let go and taken again; the module still waits
    on its switch, so the claim is the same one."""
    for _ in range(20):
        os.kill(child.pid, signal.SIGSTOP)
        # kill() returns before the stop takes: on two cores the child can still run for
        # a moment (its call seeing the switch go off, its verdict written before the
        # takeover this test is about). Every thread is read stopped before going on.
        wait_until(lambda: _stopped(child.pid), "the sweeper to stop")
        try:
            age_rows(EventRunResource, pks, seconds=3600)
            return
        except OperationalError as exc:
            if "database is locked" not in str(exc):
                raise
            os.kill(child.pid, signal.SIGCONT)
            time.sleep(0.05)
    raise AssertionError("the stopped sweeper held the database file at every stop")


def test_a_stopped_sweeper_writes_no_verdict_after_its_claim_was_taken(world, figure):  # R5
    trials, late_verdicts, fenced = size(2, 200), 0, 0
    for trial in range(trials):
        Call.objects.all().delete()
        run = finished_run(1, name=f"stop-{trial}")
        world.switch_on("despawn.wait")
        child = start("cleanup", {"run_id": run.pk})
        try:
            wait_until(lambda: Call.objects.filter(verb="despawn").exists(), "the revert")
            rows = list(Res.filter(run=run, kind="creature"))
            _stop_and_age(child, [r.pk for r in rows])
            world.switch_off("despawn.wait")
            sweep()  # takes the claim over and gives the resource back
            assert all_given_back([run])
        finally:
            os.kill(child.pid, signal.SIGCONT)
        result = finish(child)
        late_verdicts += result.get("reverted", 0) + result.get("failed", 0)
        fenced += result.get("fenced", 0)
    figure(
        f"{late_verdicts} verdicts written after takeover in {trials} trials", late_verdicts == 0
    )
    assert late_verdicts == 0 and fenced == trials


# ── SIGKILL of a worker inside perform, the run then cancelled ──


def test_a_worker_killed_inside_perform_is_given_back_by_key(world, figure):  # rule 1, W5
    trials, given_back = size(3, 50), 0
    for trial in range(trials):
        run = new_run(name=f"perform-{trial}")
        step = spawn_step(run, "north", 2)
        world.switch_on("spawn.hang_after", 1)
        child = start("execute", {"step_id": step.pk})
        wait_until(
            lambda key=step.idempotency_key: Creature.objects.filter(spawned_by=key).count() == 2,
            "the spawn",
        )
        child.kill()
        child.wait(PATIENCE_S)
        EventRun.objects.transition(run, "cancelled", from_="running")
        age_step_claims(run)
        sweep()
        given_back += all_given_back([run])
    figure(
        f"{given_back}/{trials} ({100 * given_back // trials}%) given back by key",
        given_back == trials,
    )
    assert given_back == trials


# ── many processes reserving and releasing the same targets ──


def test_processes_reserving_the_same_targets_hold_one_live_row_each(vendor, figure):  # R0, R1
    procs, targets, rounds = size(6, 16), size(100, 500), size(2, 3)
    if vendor == "sqlite":
        procs = min(procs, 4)
    run = new_run()
    refs = [f"t{i}" for i in range(targets)]
    with LiveRowSampler() as sampler:
        results = race(
            "reserve_release",
            [{"run_id": run.pk, "refs": refs, "seed": i, "rounds": rounds} for i in range(procs)],
            timeout=900,
        )
    worst, samples = [sampler.worst], [sampler.samples]
    errors = [e for r in results for e in r["errors"]]
    holds = worst[0] <= 1 and not errors
    figure(
        f"{procs} processes x {targets} targets: at most {worst[0]} live row per target in "
        f"{samples[0]} samples, {len(errors)} errors escaped",
        holds,
        reserved=sum(r["reserved"] for r in results),
    )
    assert not errors, errors[:5]
    assert worst[0] <= 1 and samples[0] > 0


# ── a module whose revert kills its sweeper every time ──


def test_a_revert_that_kills_every_sweeper_is_failed_for_good(world, settings, figure):  # poison
    run = finished_run(1)
    world.switch_on("despawn.die")
    max_claims = settings.EVENTS_LEDGER.get("MAX_CLAIMS_WITHOUT_VERDICT", 5)
    claims = 0
    for _ in range(max_claims + 2):
        row = Res.get(run=run, kind="creature")
        if row.claim_count >= max_claims and row.status == "confirmed":
            break  # spent: the sweep leaves it for a human
        age_rows(EventRunResource, [row.pk], seconds=3600)
        child = start("cleanup", {"run_id": run.pk})
        child.wait(PATIENCE_S)
        claims += 1
    row = Res.get(run=run, kind="creature")
    module_calls = Call.objects.filter(verb="despawn").count()
    holds = row.status == "confirmed" and row.revert_attempts >= 1 and claims == max_claims
    figure(f"failed for good at claim {claims} ({module_calls} module calls)", holds)
    assert claims == max_claims and module_calls == max_claims - 1
    assert "without a verdict" in row.last_error
    run.refresh_from_db()
    assert run.cleanup_status == "incomplete"


# ── a module whose revert hangs ──


def test_a_hung_revert_costs_the_pass_its_budget(world, isolated_registry, figure):  # deadline
    budget_s = 0.5
    isolated_registry.actions.pop("world.spawn")
    isolated_registry.register_action(
        Action(
            id="world.spawn",
            owner="world",
            reversible="ledger",
            budget_ms=int(budget_s * 1000),
            perform=w.spawn,
            revert=w.despawn,
        )
    )
    run = finished_run(1)
    world.switch_on("despawn.hang")
    started = time.monotonic()
    summary = cleanup_run(run)
    took = time.monotonic() - started
    # The call still runs: its row is neither failed nor handed back, only overdue.
    holds = took <= budget_s + 1 and (summary.overdue, summary.failed) == (1, 0)
    figure(f"the pass came back in {took:.2f}s (budget {budget_s}s)", holds)
    assert holds


# ── garbage answers ──

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["ok", "error", "retry", "drifted", "failed", "in_force", "resources"]),
            children,
            max_size=4,
        )
    ),
    max_leaves=8,
)


def test_garbage_answers_are_never_read_as_success(isolated_registry, figure):  # C1, W5, C6
    answers: dict[str, Any] = {}
    seen = {"examples": 0, "as_success": 0}

    def answer(kind: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: answers[kind]

    isolated_registry.register_action(
        Action(
            id="junk.act",
            owner="junk",
            reversible="ledger",
            budget_ms=5_000,
            perform=answer("perform"),
            revert=answer("revert"),
            reconcile=answer("reconcile"),
        )
    )
    isolated_registry.register_lease(
        Lease(
            id="junk.lease",
            owner="junk",
            read=lambda **kw: 1,
            apply=lambda *a, **kw: {"ok": True},
            restore=answer("restore"),
        )
    )

    @hsettings(
        max_examples=size(60, 1000),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(value=junk, target=st.sampled_from(["perform", "revert", "restore", "reconcile"]))
    def check(value: Any, target: str) -> None:
        seen["examples"] += 1
        ref = f"x{seen['examples']}"
        answers.clear()
        answers.update(
            perform={"ok": True, "resources": [{"kind": "thing", "ref": ref}]},
            revert={"ok": True},
            restore={"ok": True},
            reconcile={"ok": True, "in_force": [ref]},
        )
        answers[target] = value
        success = isinstance(value, dict) and value.get("ok") is True
        run = new_run()
        if target == "perform":
            outcome = execute_step(new_step(run, "junk.act")).outcome
            seen["as_success"] += outcome == "done" and not success
            Res.filter(run=run).update(status="reverted")
            return
        if target == "restore":
            assert (
                execute_step(
                    new_step(run, "core.lease", {"lease": "junk.lease", "value": 2})
                ).outcome
                == "done"
            )
        else:
            assert execute_step(new_step(run, "junk.act")).outcome == "done"
        if target == "reconcile":
            orphaned = reconcile_module("junk", force=True).orphaned
            valid = success and isinstance(value.get("in_force"), list)
            seen["as_success"] += bool(orphaned) and not valid
            Res.filter(run=run).update(status="reverted")
            return
        EventRun.objects.transition(run, "completed", from_="running")
        summary = cleanup_run(run)
        drifted = isinstance(value, dict) and value.get("drifted") is True and not success
        seen["as_success"] += summary.reverted > 0 and not success and not drifted
        Res.filter(run=run).update(status="reverted")

    check()
    holds = seen["as_success"] == 0
    figure(f"{seen['as_success']} of {seen['examples']} garbage answers read as success", holds)
    assert holds


# ── the database server killed and restarted under a cron loop ──


def _restart_rig_mariadb() -> float:
    """SIGKILL the rig's MariaDB and start it again on its own data; answers how long
    it was unreachable."""
    import shutil
    from pathlib import Path

    rig = Path(os.environ.get("RIG_DIR", Path(__file__).resolve().parent.parent / ".rig"))
    pid = int((rig / "mariadb" / "mariadbd.pid").read_text().split()[0])
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), "the server to die")
    binary = shutil.which("mariadbd") or shutil.which("mysqld")
    assert binary, "no mariadbd on PATH"
    subprocess.Popen(
        [binary, f"--defaults-file={rig / 'my.cnf'}", "--user=root"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def accepting() -> bool:
        # A real login: the port opens before the server has finished its recovery.
        probe = connections.create_connection("default")
        try:
            with probe.cursor() as cursor:
                cursor.execute("SELECT 1")
            return True
        except Exception:
            return False
        finally:
            probe.close()

    wait_until(accepting, "the server to come back")
    return time.monotonic() - started


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_the_cron_loop_survives_the_database_server_restarting(
    world, vendor, figure, tmp_path
):  # C5
    """The server is SIGKILLed while a pass is inside a module's revert, and started
    again. The loop survives; the claims its failed pass left are handed back by its
    next pass, so the runs finish without waiting out REVERT_CLAIM_TTL (20 s here)."""
    if vendor != "mysql":
        pytest.skip(
            "the rig restarts its MariaDB server; the loop's reconnect is the same elsewhere"
        )
    from tests.processes import ROOT, child_env

    ttl_s = 20
    runs = [finished_run(2, name=f"restart-{i}") for i in range(size(12, 60))]
    world.switch_on("despawn.wait")  # the pass's first revert waits inside the module
    env = child_env()
    env.update(EVENT_CLEANUP_RUN_BATCH="100", EVENT_REVERT_CLAIM_TTL_MS=str(ttl_s * 1000))
    # A file, not a pipe: a loop that logs a traceback per failed run would fill a pipe
    # nobody reads until the end, and block on it.
    out_path, err_path = tmp_path / "loop.out", tmp_path / "loop.err"
    with open(out_path, "w") as out_file, open(err_path, "w") as err_file:
        loop = subprocess.Popen(
            [sys.executable, "manage.py", "cleanup_runs", "--loop", "0.2"],
            cwd=ROOT,
            env=env,
            stdout=out_file,
            stderr=err_file,
        )
    try:
        wait_until(lambda: Call.objects.filter(verb="despawn").exists(), "a pass inside revert")
        connections.close_all()
        down_s = _restart_rig_mariadb()
        back = time.monotonic()
        world.switch_off("despawn.wait")
        connections.close_all()
        wait_until(lambda: all_given_back(runs), "every run given back after the restart")
        took = time.monotonic() - back
        alive = loop.poll() is None
    finally:
        loop.send_signal(signal.SIGTERM)
        loop.wait(PATIENCE_S)
    err = err_path.read_text()
    failed = err.count("the pass failed") + err.count("the sweep failed")
    holds = alive and all_given_back(runs) and took < ttl_s
    figure(
        f"server killed mid-pass, down {down_s:.1f}s; all {len(runs)} runs complete "
        f"{took:.1f}s after it came back (claim TTL {ttl_s}s); the loop survived "
        f"({failed} failures reported)",
        holds,
    )
    assert alive, err[-2000:]
    assert all_given_back(runs)
    assert took < ttl_s, "the failed pass's claims were not handed back"


# ── #28: pruning the history beside the live ledger ──


def test_prune_beside_eight_sweepers_and_four_step_workers(world, vendor, figure, tmp_path):  # #28
    import json as _json

    from events_ledger.retention import read_archive
    from tests.helpers import revert_ttl
    from tests.processes import spawn
    from tests.test_retention import fill_history

    historical = size(3_000, 100_000)
    fill_history(historical)
    stop, archive = tmp_path / "stop", tmp_path / "ledger.jsonl.gz"
    sweepers = [start("sweep_live", {"stop": str(stop)}) for _ in range(8)]
    workers = [start("live_steps", {"stop": str(stop), "region": f"live{i}"}) for i in range(4)]
    # The live runs settle within seconds: with a 2 s retention the prune meets them too.
    pruner = spawn(
        "manage",
        "prune_ledger",
        "--older-than",
        "2",
        "--json",
        "--archive",
        str(archive),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = pruner.communicate(timeout=3600)
    finally:
        stop.touch()
    results = [finish(p, timeout=PATIENCE_S) for p in sweepers + workers]
    assert pruner.returncode == 0, err
    report = _json.loads(out)
    swept, stepped = results[:8], results[8:]
    crashes = [r for r in results if not r or "crash" in r]
    errors = [e for r in stepped for e in r.get("errors", [])]
    live = [pk for r in stepped for pk in r.get("runs", [])]
    while sweep().runs:  # what the sweepers left when they stopped
        pass
    archived = Counter(d["run"]["id"] for d in read_archive(archive))
    pruned_live = set(live) - set(EventRun.objects.filter(pk__in=live).values_list("pk", flat=True))
    kept_live = EventRun.objects.filter(pk__in=live)
    # Every live run given back: the world empty, nothing unresolved, every summary complete.
    given_back = (
        Creature.objects.count() == 0
        and not Res.filter(run__in=kept_live).unresolved().exists()
        and set(kept_live.values_list("cleanup_status", flat=True)) <= {"complete"}
    )
    rate = report["runs"] / report["seconds"]
    wait_ms = 1000 * max(r.get("longest_s", 0) for r in results)
    holds = (
        not crashes
        and not errors
        and report["runs"] >= historical
        and not EventRun.objects.filter(name__startswith="bulk-").exists()
        and set(archived.values()) == {1}
        and pruned_live <= set(archived)
        and given_back
    )
    figure(
        f"{report['runs']} runs pruned at {rate:.0f} runs/s beside 8 sweepers and 4 step "
        f"workers ({len(live)} live runs, {sum(r['worked'] for r in swept)} swept); longest "
        f"statement a live worker waited {wait_ms:.0f} ms",
        holds,
        batches=report["batches"],
        longest_batch_s=report["longest_batch_s"],
        longest_pass_s=max(r["longest_pass_s"] for r in swept),
    )
    assert not crashes, crashes
    assert not errors, errors[:5]
    assert report["runs"] >= historical
    assert not EventRun.objects.filter(name__startswith="bulk-").exists()
    assert set(archived.values()) == {1}, "a run archived twice"
    # Live runs went only once settled, and went through the archive like the history.
    assert pruned_live <= set(archived)
    assert given_back, (
        Creature.objects.count(),
        Counter(kept_live.values_list("status", "cleanup_status")),
    )
    assert max(r["longest_pass_s"] for r in swept) < revert_ttl().total_seconds()
