"""Real OS processes against the test database, both sides of them.

The parent's side (``spawn``, ``race``, ``start``, ``finish``) starts children and collects
their answers. The child's side is ``python -m tests.processes TASK JSON``: each child
connects, prints ``ready``, waits for a line on stdin (so all of them start together),
does its task and prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from django.db import connections

ROOT = Path(__file__).resolve().parent.parent
#: The module a child runs: this one.
CHILD = "tests.processes"


def _ledger() -> Any:
    """The ledger's connection (its own alias's in the own-alias run); read once the
    child's Django is set up."""
    from events_ledger.db import ledger_db

    return connections[ledger_db()]


# ── the parent's side ──


def child_env(settings: dict[str, Any] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["LEDGER_CHILD_SETTINGS"] = json.dumps(settings or {})
    # Each alias's test database (the ledger may have one of its own).
    env["LEDGER_CHILD_DB_NAMES"] = json.dumps(
        {alias: str(connections[alias].settings_dict["NAME"]) for alias in connections}
    )
    env["DJANGO_SETTINGS_MODULE"] = "tests.child_settings"
    env["PYTHONPATH"] = str(ROOT)
    return env


def spawn(
    module: str,
    *args: str,
    settings: dict[str, Any] | None = None,
    port: str | None = None,
    **popen: Any,
) -> subprocess.Popen[str]:
    env = child_env(settings)
    if port:
        env["LEDGER_CHILD_DB_PORT"] = str(port)
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        text=True,
        **popen,
    )


def race(
    task: str,
    arg_list: list[dict[str, Any]],
    timeout: float = 120,
    settings: dict[str, Any] | None = None,
    ports: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Start one child per argument set, release them together, collect their answers.
    ``ports``: the database port of each child in turn (a cluster's nodes)."""
    procs = [
        spawn(
            CHILD,
            task,
            json.dumps(args),
            settings=settings,
            port=ports[i % len(ports)] if ports else None,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for i, args in enumerate(arg_list)
    ]
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.strip() == "ready", f"child did not start: {line!r}"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            result = json.loads(out.strip().splitlines()[-1])
            assert "crash" not in result, result["crash"]
            results.append(result)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def start(
    task: str, args: dict[str, Any], settings: dict[str, Any] | None = None, port: str | None = None
) -> subprocess.Popen[str]:
    """One child of ``python -m tests.processes``, started and released at once."""
    child = spawn(
        CHILD,
        task,
        json.dumps(args),
        settings=settings,
        port=port,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    child.stdin.write("go\n")
    child.stdin.flush()
    return child


def finish(child: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    """The child's one JSON answer (empty when it died without one)."""
    out, _ = child.communicate(timeout=timeout)
    lines = (out or "").strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


# ── the child's side: its tasks ──


def task_reserve(run_id: int, refs: list[str], seed: int) -> dict[str, Any]:
    from events_ledger.models import EventRunResource

    random.Random(seed).shuffle(refs)
    out: dict[str, Any] = {"ok": [], "held": 0, "errors": []}
    for ref in refs:
        try:
            answer = EventRunResource.objects.reserve(run_id, owner="race", kind="thing", ref=ref)
        except Exception as exc:  # the test asserts none escapes
            out["errors"].append(f"{type(exc).__name__}: {exc}")
            continue
        if answer.ok:
            out["ok"].append(ref)
        else:
            assert answer.code == "held" and answer.holder is not None, answer
            out["held"] += 1
    return out


def task_claim(
    ids: list[int], seed: int, ttl_s: float | None = None, group: int = 1
) -> dict[str, Any]:
    from datetime import timedelta

    from events_ledger.models import EventRunResource
    from tests.helpers import revert_ttl

    ttl = timedelta(seconds=ttl_s) if ttl_s else revert_ttl()
    random.Random(seed).shuffle(ids)
    won: list[int] = []
    tokens: dict[str, str] = {}
    for i in range(0, len(ids), group):
        claim = EventRunResource.objects.claim_group(ids[i : i + group], ttl=ttl)
        won.extend(claim.ids)
        for pk in claim.ids:
            tokens[str(pk)] = claim.token
    return {"won": won, "tokens": tokens}


def task_verdict(ids: list[int], token: str) -> dict[str, Any]:
    from events_ledger.models import EventRunResource

    return {"written": EventRunResource.objects.mark_reverted(ids, token=token)}


TASKS = {"reserve": task_reserve, "claim": task_claim, "verdict": task_verdict}


def task_cleanup(run_id: int) -> dict[str, Any]:
    from events_ledger.cleanup import cleanup_run

    return cleanup_run(run_id).as_dict()


def task_sweep_until_done(rounds: int = 200) -> dict[str, Any]:
    from events_ledger.cleanup import sweep
    from events_ledger.db import retries

    worked = 0
    for _ in range(rounds):
        report = sweep()
        if not report.runs and not report.errors and not report.in_hand:
            break
        worked += len(report.runs)
    return {"worked": worked, "retries": dict(retries)}


def task_execute(step_id: int) -> dict[str, Any]:
    from events_ledger.ledger import execute_step

    result = execute_step(step_id)
    return {"outcome": result.outcome, "recorded": result.recorded, "error": result.error}


TASKS.update({"cleanup": task_cleanup, "sweep": task_sweep_until_done, "execute": task_execute})


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def task_cleanup_killed_at(run_id: int, point: str) -> dict[str, Any]:
    """The chaos suite's sweeper: cleans one run up and SIGKILLs itself at ``point``
    (``inside_revert`` is the world's own fault switch, set by the parent)."""
    from events_ledger import cleanup
    from events_ledger.querysets import EventRunResourceQuerySet as Rows

    if point == "after_claim":
        claim = Rows.claim_group

        def claim_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            claim(self, *args, **kwargs)
            _die()

        Rows.claim_group = claim_then_die  # type: ignore[method-assign]
    elif point == "after_revert":
        # The module answered; the sweeper dies before it reads the answer.
        cleanup.classify_revert = lambda *args, **kwargs: _die()  # type: ignore[assignment]
    elif point == "during_verdict":
        verdict = Rows.mark_reverted

        def verdict_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            verdict(self, *args, **kwargs)  # written, and its answer never read
            _die()

        Rows.mark_reverted = verdict_then_die  # type: ignore[method-assign]
    return cleanup.cleanup_run(run_id).as_dict()


def task_reserve_release(run_id: int, refs: list[str], seed: int, rounds: int) -> dict[str, Any]:
    """Reserve and release the same targets as fast as possible, against other processes."""
    from events_ledger.models import EventRunResource
    from tests.helpers import revert_ttl

    rows = EventRunResource.objects
    rng = random.Random(seed)
    out: dict[str, Any] = {"reserved": 0, "held": 0, "errors": []}
    for _ in range(rounds):
        rng.shuffle(refs)
        for ref in refs:
            try:
                answer = rows.reserve(run_id, owner="chaos", kind="thing", ref=ref)
                if not answer.ok:
                    out["held"] += 1
                    continue
                out["reserved"] += 1
                token = rows.claim_revert(answer.id, revert_ttl())
                if token is not None:
                    rows.mark_reverted([answer.id], token=token)
            except Exception as exc:  # the test asserts none escapes
                out["errors"].append(f"{type(exc).__name__}: {exc}")
    return out


TASKS.update({"cleanup_killed_at": task_cleanup_killed_at, "reserve_release": task_reserve_release})


def task_prune_killed_at(
    point: str, older_than_s: float, archive: str, batch: int
) -> dict[str, Any]:
    """#28: a prune that SIGKILLs itself at ``point``: ``while_writing`` (half of a batch's
    archive member on disk), ``after_flush`` (the member fsynced, its delete not
    committed), ``after_commit`` (the first batch committed)."""
    from datetime import timedelta

    from events_ledger import retention

    on_batch = None
    append = retention.Archive.append
    if point == "while_writing":

        def torn(self: Any, documents: Any) -> None:
            write = os.write

            def half(fd: int, data: Any) -> int:
                write(fd, bytes(data)[: len(data) // 2])
                os.fsync(fd)
                _die()
                return 0

            os.write = half  # type: ignore[assignment]
            append(self, documents)

        retention.Archive.append = torn  # type: ignore[method-assign]
    elif point == "after_flush":

        def then_die(self: Any, documents: Any) -> None:
            append(self, documents)
            _die()

        retention.Archive.append = then_die  # type: ignore[method-assign]
    else:
        on_batch = lambda runs: _die()  # noqa: E731
    report = retention.prune(
        older_than=timedelta(seconds=older_than_s), batch=batch, archive=archive, on_batch=on_batch
    )
    return report.as_dict()


TASKS.update({"prune_killed_at": task_prune_killed_at})


def _longest_statement() -> tuple[Any, list[float]]:
    """An execute wrapper keeping the longest statement this connection waited for: a
    lock another process held shows up here (#28's figure)."""
    import time

    longest = [0.0]

    def timed(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        began = time.monotonic()
        try:
            return execute(sql, params, many, context)
        finally:
            longest[0] = max(longest[0], time.monotonic() - began)

    return timed, longest


def task_live_steps(stop: str, region: str) -> dict[str, Any]:
    """#28: a step worker on live runs until ``stop`` exists: a run spawns a creature in
    the demo world and is cancelled, for the sweepers to give back."""
    from tests.helpers import finished_run

    timed, longest = _longest_statement()
    runs: list[int] = []
    errors: list[str] = []
    with _ledger().execute_wrapper(timed):
        while not os.path.exists(stop):
            try:
                runs.append(finished_run(1, name="live", region=region).pk)
            except Exception as exc:  # the test asserts none escapes
                errors.append(f"{type(exc).__name__}: {exc}")
    return {"runs": runs, "errors": errors, "longest_s": longest[0]}


def task_sweep_live(stop: str) -> dict[str, Any]:
    """#28: a sweeper passing over and over until ``stop`` exists."""
    import time

    from events_ledger.cleanup import sweep

    timed, longest = _longest_statement()
    passes = worked = 0
    longest_pass = 0.0
    with _ledger().execute_wrapper(timed):
        while not os.path.exists(stop):
            began = time.monotonic()
            report = sweep()
            longest_pass = max(longest_pass, time.monotonic() - began)
            passes += 1
            worked += len(report.runs)
            if not report.runs:
                time.sleep(0.05)  # an idle sweeper, as a cron's interval
    return {
        "passes": passes,
        "worked": worked,
        "longest_s": longest[0],
        "longest_pass_s": longest_pass,
    }


TASKS.update({"live_steps": task_live_steps, "sweep_live": task_sweep_live})


def task_sweep_then_exit() -> dict[str, Any]:
    """A sweeper whose verdict writes are refused (a lock held past every retry) until
    its process exits on its own, as a task worker's ``max_tasks_per_child`` ends it."""
    import atexit
    import threading

    from django.db import OperationalError

    from events_ledger import cleanup
    from events_ledger.cleanup import sweep

    exiting = threading.Event()
    write = cleanup._write_verdicts

    def refusing(*args: Any, **kwargs: Any) -> Any:
        if not exiting.is_set():
            raise OperationalError(1205, "Lock wait timeout exceeded")
        return write(*args, **kwargs)

    cleanup.VERDICT_WRITE_BUDGET_S = 0.0  # type: ignore[attr-defined]
    cleanup._write_verdicts = refusing  # type: ignore[attr-defined]
    atexit.register(exiting.set)  # runs before the ledger's own (last in, first out)
    report = sweep()
    return {"errors": len(report.errors), "in_hand": len(cleanup._backlog)}


TASKS.update({"sweep_then_exit": task_sweep_then_exit})


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.child_settings")
    task, args = sys.argv[1], json.loads(sys.argv[2])
    import django

    django.setup()
    _ledger().ensure_connection()
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        result = TASKS[task](**args)
    except Exception:
        result = {"crash": traceback.format_exc()}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
