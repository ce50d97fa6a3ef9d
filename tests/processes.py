"""Running real OS processes against the test database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def child_env(settings: dict[str, Any] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["LEDGER_CHILD_SETTINGS"] = json.dumps(settings or {})
    env["LEDGER_CHILD_DB_NAME"] = str(connection.settings_dict["NAME"])
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
            "tests.procs",
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
    """One child of ``tests.procs``, started and released at once."""
    child = spawn(
        "tests.procs",
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
