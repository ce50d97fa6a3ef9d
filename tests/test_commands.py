"""The cron commands (SPEC S1, S2): output, dry run, human retry, loop, exit statuses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from events_ledger.ledger import execute_step
from events_ledger.models import EventRun, EventRunLog, EventRunResource
from project.world.models import Call, Creature
from tests.factories import ResourceFactory, RunFactory, StepFactory
from tests.helpers import new_run, spawn_step, step_ttl
from tests.processes import ROOT, child_env

pytestmark = pytest.mark.django_db(transaction=True)
Res = EventRunResource.objects


def finished_run(status="completed", count=2, region="north"):
    run = new_run()
    assert execute_step(spawn_step(run, region, count)).outcome == "done"
    EventRun.objects.transition(run, status, from_="running")
    return run


def command(*args):
    out, err = StringIO(), StringIO()
    code = 0
    try:
        call_command(*args, stdout=out, stderr=err)
    except CommandError as exc:
        code = exc.returncode
        err.write(str(exc))
    return code, out.getvalue(), err.getvalue()


def manage(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_one_sweep_with_a_line_per_run(world):  # S1, C5
    run = finished_run()
    code, out, _ = command("cleanup_runs")
    assert code == 0
    assert (
        f"run {run.pk}: attempted 2, reverted 2, drifted 0, failed 0, remaining 0 -> complete"
        in out
    )
    assert Creature.objects.count() == 0


def test_verbosity_zero_is_silent_and_two_shows_each_resource(world):  # S1
    finished_run()
    assert command("cleanup_runs", "--verbosity", "0")[1] == ""
    run = finished_run()
    serials = list(Creature.objects.values_list("serial", flat=True))
    _, out, _ = command("cleanup_runs", "--verbosity", "2")
    assert f"run {run.pk}:" in out and all(f"creature:{s}" in out for s in serials)


def test_json_output(world):  # S1
    run = finished_run()
    code, out, _ = command("cleanup_runs", "--json")
    doc = json.loads(out)
    assert (
        code == 0
        and doc["runs"][0]["run_id"] == run.pk
        and doc["runs"][0]["cleanup_status"] == "complete"
    )


def test_dry_run_lists_the_plan_and_writes_nothing(world):  # S1
    run = finished_run()
    step = run.steps.get()
    before = list(Res.filter(run=run).values_list("pk", "status", "revert_attempts", "updated_at"))
    code, out, _ = command("cleanup_runs", "--dry-run")
    assert code == 0
    assert f"run {run.pk}" in out and f"world.spawn.revert(key={step.idempotency_key}" in out
    assert all(f"creature:{s}" in out for s in Creature.objects.values_list("serial", flat=True))
    assert (
        list(Res.filter(run=run).values_list("pk", "status", "revert_attempts", "updated_at"))
        == before
    )
    assert Creature.objects.count() == 2
    doc = json.loads(command("cleanup_runs", "--dry-run", "--json")[1])
    assert doc["dry_run"] and doc["runs"][str(run.pk)][0]["call"] == "revert"


def test_the_human_retry_is_logged_with_its_actor(world):  # S1, C4, rule 2
    run = finished_run()
    Res.filter(run=run).update(revert_attempts=3)
    EventRun.objects.filter(pk=run.pk).update(cleanup_status="incomplete")
    assert "nothing to give back" in command("cleanup_runs")[1]
    code, out, _ = command(
        "cleanup_runs", "--run", str(run.pk), "--reset-attempts", "--actor", "alice"
    )
    assert code == 0 and "-> complete" in out
    assert EventRunLog.objects.get(run=run, kind="cleanup.retry").detail["by"] == "alice"


@pytest.mark.slow
def test_exit_statuses_a_cron_monitor_reads(world):  # S1
    clean = manage("cleanup_runs")
    assert clean.returncode == 0, clean.stderr
    run = finished_run()
    Res.filter(run=run).update(revert_attempts=2)
    world.switch_on("despawn.fail")
    stuck = manage("cleanup_runs")
    assert stuck.returncode == 1 and "-> incomplete" in stuck.stdout
    assert "CommandError: a run is incomplete" in stuck.stderr
    bad = manage("cleanup_runs", "--reset-attempts")
    assert bad.returncode == 2 and "--run" in bad.stderr
    missing = manage("cleanup_runs", "--run", "987654")
    assert missing.returncode == 2 and "no run 987654" in missing.stderr
    running = new_run()
    busy = manage("cleanup_runs", "--run", str(running.pk))
    assert busy.returncode == 2 and "running" in busy.stderr
    assert manage("cleanup_runs", "--loop", "nonsense").returncode == 2


@pytest.mark.slow
def test_loop_sweeps_until_sigterm(world):  # S1
    first = finished_run()
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "cleanup_runs", "--loop", "0.2"],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def wait_complete(run):
            deadline = time.monotonic() + 60
            while EventRun.objects.get(pk=run.pk).cleanup_status != "complete":
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the loop never swept the run"
                time.sleep(0.1)

        wait_complete(first)
        second = finished_run(region="south")  # a later pass picks up a new run
        wait_complete(second)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "finishing the calls in hand" in out
    assert Creature.objects.count() == 0


def test_reconcile_resources_summary_bound_and_force(world):  # S2, C6
    run = new_run()
    execute_step(spawn_step(run, "north", 4))
    world.restart()
    code, out, _ = command("reconcile_resources")
    assert code == 1
    assert "world: asked 4, in force 0, orphaned 0" in out and "more than 50%" in out
    assert set(Res.filter(kind="creature").values_list("status", flat=True)) == {"confirmed"}
    code, out, _ = command("reconcile_resources", "--module", "world", "--force", "--json")
    assert code == 0 and json.loads(out)["world"]["orphaned"] == 4
    assert set(Res.filter(kind="creature").values_list("status", flat=True)) == {"orphaned"}


def test_reconcile_resources_unknown_module_is_bad_input(world):  # S2
    code, _, err = command("reconcile_resources", "--module", "nobody")
    assert code == 2 and "nobody" in err


@pytest.mark.parametrize("every", ["nan", "inf", "-inf", "0.05", "0", "-1"])
def test_loop_refuses_intervals_that_are_not_a_sane_number(every):  # S1
    code, _, err = command("cleanup_runs", f"--loop={every}")
    assert code == 2 and "--loop" in err


def test_loop_survives_the_database_going_away(world):  # S1, connections die
    """The database goes away between passes (every connection is refused): the pass
    fails and is reported, the loop backs off and, once the database is back, sweeps."""
    import os
    import threading

    from django.db import connections

    from tests.helpers import connection

    first = finished_run()
    out, err = StringIO(), StringIO()
    real_name = connection.settings_dict["NAME"]
    trouble: list[BaseException] = []

    def wait(condition, what):
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def complete(run):
        try:
            return EventRun.objects.get(pk=run.pk).cleanup_status == "complete"
        finally:
            connections.close_all()

    def operator():
        try:
            wait(lambda: complete(first), "the first pass")
            # The database goes away: every new connection is refused from now on.
            connection.settings_dict["NAME"] = "/nonexistent/ledger/gone"
            wait(lambda: err.getvalue().count("the pass failed") >= 2, "two failed passes")
            connection.settings_dict["NAME"] = real_name
            second = finished_run(region="south")
            connections.close_all()
            wait(lambda: complete(second), "a pass after the database came back")
        except BaseException as exc:  # reported by the test below
            trouble.append(exc)
        finally:
            connection.settings_dict["NAME"] = real_name
            os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=operator, daemon=True)
    helper.start()
    code = 0
    try:
        call_command("cleanup_runs", "--loop", "0.1", stdout=out, stderr=err)
    except CommandError as exc:
        code = exc.returncode
    helper.join(60)
    assert not trouble, trouble
    assert code == 1  # a pass failed: a human should know
    assert "trying again in" in err.getvalue()
    assert Creature.objects.count() == 0


def test_a_run_left_incomplete_by_the_repair_exits_1(world):  # S1, summaries race too
    run = finished_run()
    # Rows spent and a summary that says otherwise (a sweeper died before writing it).
    Res.filter(run=run).update(revert_attempts=3, status="confirmed")
    EventRun.objects.filter(pk=run.pk).update(cleanup_status="complete")
    code, out, _ = command("cleanup_runs")
    assert code == 1
    assert f"run {run.pk}: summary re-derived from its rows -> incomplete" in out
    code, out, _ = command("cleanup_runs", "--json")
    # #25: the next pass repairs nothing, and still exits 1: the run is incomplete.
    assert code == 1 and json.loads(out)["repaired"] == {}
    assert json.loads(out)["incomplete"] == [run.pk]


def test_reconcile_resources_exits_1_when_a_module_fails(world):  # S2, C6
    run = new_run()
    execute_step(spawn_step(run, "north", 2))
    world.switch_on("reconcile.garbage")
    code, out, err = command("reconcile_resources", "--json")
    assert code == 1
    assert json.loads(out)["world"]["errors"] and json.loads(out)["world"]["orphaned"] == 0


def test_dry_run_and_json_name_the_step_cleanup_waits_for(world):  # S1, the invariant
    from events_ledger.ledger import reserve_step
    from events_ledger.models import EventRunStep
    from events_ledger.registry import default_registry

    run = new_run()
    step = spawn_step(run)
    EventRunStep.objects.claim(step, step_ttl(), by="worker-3:777")
    reserve_step(run, step, default_registry.action("world.spawn"))
    EventRun.objects.transition(run, "cancelled", from_="running")
    code, out, _ = command("cleanup_runs", "--dry-run")
    assert code == 0
    # #25: named as the run page names it, by its place in the run.
    assert f"waits for step #{step.seq} (world.spawn) in flight on worker-3:777 since" in out
    code, out, _ = command("cleanup_runs", "--dry-run", "--json")
    [group] = json.loads(out)["runs"][str(run.pk)]
    assert group["waiting_for"]["claimed_by"] == "worker-3:777"
    code, out, _ = command("cleanup_runs", "--json")
    [summary] = json.loads(out)["runs"]
    assert summary["cleanup_status"] == "pending" and summary["waiting"][0]["step"] == step.pk
    assert Res.filter(run=run).unresolved().count() == 1


def test_cleanup_runs_names_the_phase_earlier_ones_wait_behind():  # S1, C8
    # A finished run of phase "a" then "b"; b's rows have spent their attempts.
    run = RunFactory(status="completed", cleanup_status="incomplete")
    a = StepFactory(run=run, phase="a", action_id="t.build")
    b = StepFactory(run=run, phase="b", action_id="t.wall")
    ResourceFactory(run=run, step=a, phase_rank=a.phase_rank)
    later = ResourceFactory.create_batch(
        2, run=run, step=b, phase_rank=b.phase_rank, revert_attempts=3
    )
    refs = ", ".join(f"{r.kind}:{r.ref}" for r in later)
    said = "after phase 'b' is given back (2 row(s) of it unresolved, their attempts spent)"
    # The dry run says it through the plan's call, and --json through describe().
    code, out, _ = command("cleanup_runs", "--dry-run", "--run", str(run.pk))
    assert code == 0 and said in out
    doc = json.loads(command("cleanup_runs", "--dry-run", "--run", str(run.pk), "--json")[1])
    [group] = doc["runs"][str(run.pk)]
    assert group["behind"]["phase"] == "b" and group["behind"]["stuck"] is True
    # A real cleanup gives nothing back (phase b is stuck) and says what waits behind what.
    code, out, _ = command("cleanup_runs", "--run", str(run.pk))
    assert code == 1 and "remaining 3 -> incomplete" in out
    line = (
        "  earlier phases wait behind phase 'b': 2 row(s) of it unresolved, "
        f"their attempts spent ({refs})"
    )
    assert line in out.splitlines()
    code, out, _ = command("cleanup_runs", "--run", str(run.pk), "--json")
    [summary] = json.loads(out)["runs"]
    assert code == 1 and [e["phase"] for e in summary["behind"]] == ["b"]
    assert json.loads(out)["incomplete"] == [run.pk]  # the document says what exit 1 says
    assert summary["behind"][0]["resources"] == refs.split(", ")


def test_the_human_retrys_log_entry_survives_a_killed_pass(world):  # C4, rule 2, crash
    run = finished_run()
    Res.filter(run=run).update(revert_attempts=3)
    world.switch_on("despawn.hang")
    child = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "cleanup_runs",
            "--run",
            str(run.pk),
            "--reset-attempts",
            "--actor",
            "ops:ana",
        ],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not Call.objects.filter(verb="despawn").exists():  # inside revert() now
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the pass never reached the revert"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    [entry] = EventRunLog.objects.filter(run=run, kind="cleanup.retry")
    assert entry.detail == {"resources": 2, "by": "ops:ana"}


def test_cleanup_runs_scope_sweeps_one_scope_only(world):  # S1, C5
    ours, theirs = finished_run(region="north"), finished_run(region="south")
    EventRun.objects.filter(pk=ours.pk).update(scope="team-a")
    code, out, _ = command("cleanup_runs", "--scope", "team-a")
    assert code == 0 and f"run {ours.pk}:" in out and f"run {theirs.pk}:" not in out
    assert Res.filter(run=theirs, status="confirmed").count() == 2
    code, _, err = command("cleanup_runs", "--scope", "team-a", "--run", str(ours.pk))
    assert code == 2 and "--scope" in err
    # An actor is logged only with the human retry: anywhere else it would be dropped.
    code, _, err = command("cleanup_runs", "--run", str(ours.pk), "--actor", "ops:ana")
    assert code == 2 and "--reset-attempts" in err


def test_cleanup_runs_exits_1_on_every_pass_while_a_run_in_scope_is_incomplete():
    # S1, #25: a monitor that reads the status stays red until a human's retry.
    from tests.factories import ResourceFactory, RunFactory

    stuck = RunFactory(status="completed", cleanup_status="incomplete", scope="south")
    ResourceFactory(run=stuck, revert_attempts=3, last_error="refused")
    for _ in range(2):  # the pass that made it so is long gone: every pass says it
        code, out, err = command("cleanup_runs")
        assert code == 1, out + err
        assert "nothing to give back" in out
        assert f"incomplete, waiting for a human's retry: run {stuck.pk}" in out
    assert command("cleanup_runs", "--scope", "north")[0] == 0  # not in that cron's scope
    assert command("cleanup_runs", "--scope", "south")[0] == 1
    code, out, _ = command("cleanup_runs", "--json")
    assert code == 1 and json.loads(out)["incomplete"] == [stuck.pk]
    # Once a human has given it back, the next pass is green again.
    Res.filter(run=stuck).update(status="reverted")
    EventRun.objects.filter(pk=stuck.pk).update(cleanup_status="complete")
    assert command("cleanup_runs") == (0, "nothing to give back\n", "")


def test_commands_print_database_text_as_text():
    # #25: an escape sequence in a module's error, a ref or a run's name must not reach
    # the operator's terminal (here one that would retitle it), in any command's output.
    from tests.factories import ResourceFactory, RunFactory

    evil = "\x1b]0;pwned\x07\x1b[2J"
    run = RunFactory(name=f"night{evil}", status="completed", cleanup_status="incomplete")
    ResourceFactory(run=run, ref=f"r{evil}", revert_attempts=3, last_error=f"refused{evil}")
    outputs = [
        command("ledger_status", "--verbosity", "2"),
        command("cleanup_runs", "--dry-run", "--run", str(run.pk), "--reset-attempts"),
        command("cleanup_runs"),
    ]
    for _code, out, err in outputs:
        assert "\x1b" not in out + err and "\x07" not in out + err
    assert "refused\\x1b]0;pwned\\x07\\x1b[2J" in outputs[0][1]  # shown, not obeyed
    assert "night\\x1b]0;pwned" in outputs[1][1]
    # The commands' own colours still reach a terminal that wants them.
    out = StringIO()
    with pytest.raises(CommandError):
        call_command("ledger_status", stdout=out, force_color=True)
    assert "\x1b[" in out.getvalue() and "\x1b]" not in out.getvalue()


def test_database_text_cannot_forge_a_line_or_reorder_one():  # #25, S1
    # A module's error that holds a line break (or a Unicode line separator, or a
    # direction mark) stays on its own line: cron mail cannot be told "OK" by a module.
    from tests.factories import ResourceFactory, RunFactory

    forged = "boom\nOK: nothing to do\r\u2028\u200f\u061c"
    run = RunFactory(name="night", status="completed", cleanup_status="incomplete")
    ResourceFactory(run=run, ref="r", revert_attempts=3, last_error=forged)
    code, out, err = command("ledger_status", "--verbosity", "2")
    assert "boom\\x0aOK: nothing to do\\x0d\\u2028\\u200f\\u061c" in out
    assert not any(line.startswith("OK: nothing") for line in (out + err).splitlines())
    assert "\u200f" not in out and "\u2028" not in out
    # The JSON documents keep their own structure, their strings escaped by json itself.
    code, out, _ = command("cleanup_runs", "--dry-run", "--json")
    json.loads(out)
