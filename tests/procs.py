"""Child processes for the multi-process tests: ``python -m tests.procs TASK JSON``.

Each child connects, prints ``ready``, waits for a line on stdin (so all of them start
together), does its task and prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback
from typing import Any


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

    ttl = timedelta(seconds=ttl_s) if ttl_s else None
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

    worked = 0
    for _ in range(rounds):
        report = sweep()
        if not report.runs and not report.errors:
            break
        worked += len(report.runs)
    return {"worked": worked}


def task_execute(step_id: int) -> dict[str, Any]:
    from events_ledger.ledger import execute_step

    result = execute_step(step_id)
    return {"outcome": result.outcome, "recorded": result.recorded, "error": result.error}


TASKS.update({"cleanup": task_cleanup, "sweep": task_sweep_until_done, "execute": task_execute})


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.child_settings")
    task, args = sys.argv[1], json.loads(sys.argv[2])
    import django

    django.setup()
    from django.db import connection

    connection.ensure_connection()
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        result = TASKS[task](**args)
    except Exception:
        result = {"crash": traceback.format_exc()}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
