"""How cost grows (#27): a backlog of ended runs given back by 1, 2, 4 and 8 sweeper
processes at once. Printed, never asserted; what it checks is that every resource was
given back exactly once, and it exits non-zero when one was not.

    DATABASE_URL=... DJANGO_SETTINGS_MODULE=project.settings \\
        python -m project.bench.scaling [--runs 10000] [--sweepers 1,2,4,8] [--json out.json]

For each number of sweepers it builds the backlog afresh: N runs of one step of the
bench's own action (``shapes.NOOP``, one resource each), recorded by ``execute_step`` as a
host records them (in a few builder processes, so 10,000 take seconds, not a minute),
then ended. Then K real OS processes, each connected and waiting, are released together;
each calls ``sweep(limit=CLEANUP_RUN_BATCH, scope=SCOPE)`` until a pass finds nothing. The
figure is the resources given back per second from the release to the last process's end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

#: Children are started with ``spawn``: a fresh interpreter, no copy of the parent's
#: threads (the claim keeper, the verdict writer) or of its open connections.
_CONTEXT = multiprocessing.get_context("spawn")
#: Seconds a child may take to start, and a phase to finish.
_PATIENCE_S = 600.0


# ── the children's side: fresh interpreters, released together ──


def _setup_child(db_name: str, ledger: dict[str, Any] | None) -> Any:
    """Django in the child, on the parent's database (a test's database has its own
    name), with the parent's ledger settings and the bench's action counting its
    reverts. Answers the counter."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection

    from events_ledger.registry import default_registry

    from . import shapes

    connection.close()
    connection.settings_dict["NAME"] = db_name
    if ledger is not None:
        settings.EVENTS_LEDGER = ledger
    shapes.register(default_registry, 0)
    counter = {"reverts": 0}
    action = default_registry.actions.pop(shapes.NOOP)
    plain = action.revert
    assert plain is not None

    def counted(**kwargs: Any) -> Any:
        counter["reverts"] += 1
        return plain(**kwargs)

    default_registry.register_action(replace(action, revert=counted))
    connection.ensure_connection()  # connected before the release, as a cron's sweeper is
    return counter


def _child(
    role: str,
    index: int,
    db_name: str,
    ledger: dict[str, Any] | None,
    job: dict[str, Any],
    go: Any,
    answers: Any,
) -> None:
    try:
        counter = _setup_child(db_name, ledger)
        answers.put(("ready", index, None))
        if not go.wait(_PATIENCE_S):
            raise RuntimeError("never released")
        answer = _build(index, **job) if role == "build" else _sweep_until_empty(counter)
        answers.put(("done", index, answer))
    except BaseException as exc:  # the parent must hear of it, not wait out its patience
        import traceback

        answers.put(("failed", index, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        from django.db import connection

        connection.close()


def _build(index: int, runs: int) -> dict[str, Any]:
    from . import shapes

    made = shapes._make_runs(shapes.Shape(resources=1, runs=runs), shapes.NOOP, f"scale {index}")
    shapes._execute(made)
    shapes._end(made)
    return {"runs": len(made), "ended": time.monotonic()}


def _sweep_until_empty(counter: dict[str, int]) -> dict[str, Any]:
    """Passes until one finds nothing and this process holds no verdict unwritten."""
    from events_ledger.cleanup import sweep
    from events_ledger.conf import ledger_settings

    from . import shapes

    passes = reverted = fenced = 0
    errors: list[str] = []
    for _ in range(1_000_000):  # a bound, should the passes never run dry
        report = sweep(limit=ledger_settings.CLEANUP_RUN_BATCH, scope=shapes.SCOPE)
        errors += [f"run {pk}: {error}" for pk, error in report.errors.items()]
        if report.repair_error:
            errors.append(f"repair: {report.repair_error}")
        if not report.runs and not report.in_hand:
            break
        passes += 1 if report.runs else 0
        reverted += sum(s.reverted for s in report.runs)
        fenced += sum(s.fenced for s in report.runs)
    return {
        "ended": time.monotonic(),
        "passes": passes,
        "reverted": reverted,
        "fenced": fenced,
        "revert_calls": counter["reverts"],
        "errors": errors,
    }


# ── the parent's side ──


def _in_children(role: str, jobs: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    """One child per job, each set up and connected before all are released together.
    Answers the seconds from the release to the last child's end, and their answers."""
    from django.conf import settings
    from django.db import connection

    db_name = str(connection.settings_dict["NAME"])
    ledger = getattr(settings, "EVENTS_LEDGER", None)
    connection.close()  # the parent holds no connection, no lock, while they work
    go, answers = _CONTEXT.Event(), _CONTEXT.Queue()
    procs = [
        _CONTEXT.Process(
            target=_child, args=(role, i, db_name, ledger, job, go, answers), daemon=True
        )
        for i, job in enumerate(jobs)
    ]
    for p in procs:
        p.start()
    try:
        _collect(answers, procs, "ready")
        released = time.monotonic()
        go.set()
        done = _collect(answers, procs, "done")
    finally:
        go.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    return max(a["ended"] for a in done) - released, done


def _collect(answers: Any, procs: list[Any], stage: str) -> list[Any]:
    got: dict[int, Any] = {}
    deadline = time.monotonic() + _PATIENCE_S
    while len(got) < len(procs):
        try:
            kind, index, answer = answers.get(timeout=1)
        except Exception:  # queue.Empty: see that they still live
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in got]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"child process(es) {dead or '?'} gave no '{stage}'") from None
            continue
        if kind == "failed":
            raise RuntimeError(f"child process {index} failed:\n{answer}")
        if kind == stage:
            got[index] = answer
    return [got[i] for i in range(len(procs))]


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts) if total]


def _check(runs: int, answers: list[dict[str, Any]]) -> dict[str, Any]:
    """What the database and the sweepers say was given back: each resource once."""
    from events_ledger.models import UNRESOLVED, EventRun, EventRunLog, EventRunResource
    from events_ledger.states import STEP_KIND

    from . import shapes

    mine = EventRunResource.objects.filter(run__scope=shapes.SCOPE).exclude(kind=STEP_KIND)
    found = {
        "resources": mine.count(),
        "reverted_rows": mine.filter(status="reverted").count(),
        "unresolved": mine.filter(status__in=UNRESOLVED).count(),
        "runs_not_complete": EventRun.objects.filter(scope=shapes.SCOPE)
        .exclude(cleanup_status="complete")
        .count(),
        "reverted_log_entries": EventRunLog.objects.filter(
            run__scope=shapes.SCOPE, kind="cleanup.reverted"
        ).count(),
        "reverted_by_sweepers": sum(a["reverted"] for a in answers),
        "revert_calls": sum(a["revert_calls"] for a in answers),
        "errors": [e for a in answers for e in a["errors"]],
    }
    wrong = [
        f"{key} = {found[key]}, not {runs}"
        for key in (
            "resources",
            "reverted_rows",
            "reverted_log_entries",
            "reverted_by_sweepers",
            "revert_calls",
        )
        if found[key] != runs
    ]
    wrong += [f"{key} = {found[key]}" for key in ("unresolved", "runs_not_complete") if found[key]]
    if found["errors"]:
        wrong.append(f"{len(found['errors'])} sweep error(s): {found['errors'][:3]}")
    found["wrong"] = wrong
    return found


def sweep_backlog(runs: int, sweepers: int, builders: int = 4) -> dict[str, Any]:
    """A backlog of ``runs`` ended one-resource runs, built by ``builders`` processes,
    given back by ``sweepers`` processes released together; then checked, and deleted.
    The bench's action must not be needed in this process: the children register it."""
    from . import shapes

    shapes.delete_runs()
    try:
        build_s, _ = _in_children("build", [{"runs": n} for n in _split(runs, builders)])
        seconds, answers = _in_children("sweep", [{}] * sweepers)
        check = _check(runs, answers)
    finally:
        shapes.delete_runs()
    return {
        "sweepers": sweepers,
        "runs": runs,
        "build_seconds": build_s,
        "seconds": seconds,
        "per_s": runs / seconds if seconds else 0.0,
        "passes": sum(a["passes"] for a in answers),
        "passes_per_process": [a["passes"] for a in answers],
        "fenced": sum(a["fenced"] for a in answers),
        "check": check,
        "ok": not check["wrong"],
    }


def _machine() -> dict[str, Any]:
    import django
    from django.db import connection

    conn: Any = connection
    if conn.vendor == "sqlite":
        server, version = "SQLite", conn.Database.sqlite_version
    elif conn.vendor == "postgresql":
        conn.ensure_connection()
        server, version = "PostgreSQL", f"{conn.pg_version // 10000}.{conn.pg_version % 10000}"
    else:
        conn.ensure_connection()
        server = "MariaDB" if conn.mysql_is_mariadb else "MySQL"
        version = ".".join(map(str, conn.mysql_version))
    return {
        "database": conn.vendor,
        "server": server,
        "version": str(version),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "django": django.get_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_at_start": os.getloadavg()[0],
    }


def text(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"{m['server']} {m['version']}: a backlog of {doc['runs']:,} ended runs of 1 resource, "
        f"given back by sweeper processes (sweep, batch {doc['batch']}; "
        f"{m['cpus']} cores, load {m['load_at_start']:.1f} → {m.get('load_at_end', 0):.1f}):",
        f"  {'sweepers':>8}  {'resources/s':>11}  {'seconds':>8}  {'passes':>7}  "
        f"{'runs/pass':>9}  {'fenced':>6}  {'built in':>8}  given back once",
    ]
    for r in doc["results"]:
        lines.append(
            f"  {r['sweepers']:>8}  {r['per_s']:>11,.0f}  {r['seconds']:>8.2f}  {r['passes']:>7}  "
            f"{r['runs'] / max(r['passes'], 1):>9.1f}  {r['fenced']:>6}  {r['build_seconds']:>7.1f}s  "
            + ("yes" if r["ok"] else "NO: " + "; ".join(r["check"]["wrong"]))
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000, help="runs in the backlog")
    parser.add_argument("--sweepers", default="1,2,4,8", help="sweeper processes, e.g. 1,2,4,8")
    parser.add_argument("--builders", type=int, default=4, help="processes building a backlog")
    parser.add_argument("--json", metavar="PATH", help="also write the figures there")
    parser.add_argument(
        "--i-know", action="store_true", help="run on a database that holds real runs"
    )
    args = parser.parse_args(argv)
    try:
        counts = [int(k) for k in args.sweepers.split(",") if k.strip()]
    except ValueError:
        parser.error("--sweepers takes whole numbers separated by commas")
    if args.runs < 1 or args.builders < 1 or not counts or min(counts) < 1:
        parser.error("--runs, --builders and every number of sweepers must be at least 1")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from events_ledger.conf import ledger_settings
    from events_ledger.models import EventRun

    from . import shapes

    foreign = EventRun.objects.exclude(scope=shapes.SCOPE).count()
    if foreign and not args.i_know:
        print(
            f"This database holds {foreign} real run(s); run on a database of its own, "
            "or pass --i-know (only the bench's own runs are swept and deleted).",
            file=sys.stderr,
        )
        return 2
    doc: dict[str, Any] = {
        "machine": _machine(),
        "runs": args.runs,
        "batch": ledger_settings.CLEANUP_RUN_BATCH,
        "results": [],
    }
    for k in counts:
        result = sweep_backlog(args.runs, k, args.builders)
        doc["results"].append(result)
        print(
            f"  {k} sweeper(s): {result['per_s']:,.0f} resources/s"
            + ("" if result["ok"] else "  NOT GIVEN BACK EXACTLY ONCE"),
            file=sys.stderr,
        )
    doc["machine"]["load_at_end"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as out:
            json.dump(doc, out, indent=1)
    print(text(doc))
    bad = [r for r in doc["results"] if not r["ok"]]
    for r in bad:
        print(
            f"!!! {r['sweepers']} sweeper(s): a resource was not given back exactly once: "
            + "; ".join(r["check"]["wrong"]),
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
