"""The demo world's verbs, and the switches that make it misbehave on purpose."""

from __future__ import annotations

import os
import secrets
import signal
import time
from typing import Any

from django.db import IntegrityError, transaction

from .models import Announcement, Arena, Call, Creature, RegionSetting, Switch

#: Faults the tests and the demo can turn on. Each is read when the verb runs.
SWITCHES = {
    "spawn.lose_answer": "spawn, then lose the answer (raise as a dropped connection would)",
    "spawn.hang": "hang for ever before answering",
    "spawn.hang_after": "spawn, then hang for ever before answering",
    "spawn.raise": "raise before doing anything",
    "spawn.garbage": "answer something that is not an envelope",
    "spawn.trace": "write a Call when a spawn begins and ends (its key, its pid): who overlapped",
    "spawn.wait": "spawn, then wait while this switch is on (a Call says so), then answer",
    "despawn.fail": "answer {ok: false} (value: how many times; true: always)",
    "despawn.hang": "hang for ever",
    "despawn.die": "kill the process that asked (SIGKILL), as a crashing sweeper host would",
    "despawn.wait": "wait while this switch is on, then despawn",
    "despawn.raise": "raise",
    "despawn.garbage": "answer garbage",
    "reconcile.hang": "hang for ever",
    "reconcile.garbage": "answer garbage",
    "rate.restore_fail": "answer {ok: false} to restore",
}


class AnswerLost(ConnectionError):
    pass


def switch_on(name: str, value: Any = True) -> None:
    Switch.objects.update_or_create(name=name, defaults={"value": value})


def switch_off(name: str | None = None) -> None:
    (Switch.objects.all() if name is None else Switch.objects.filter(name=name)).delete()


def _fault(name: str) -> bool:
    """Is the fault on? A whole number counts down: on that many more times."""
    value = Switch.objects.filter(name=name).values_list("value", flat=True).first()
    if value is None or value is False:
        return False
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            return False
        Switch.objects.filter(name=name).update(value=value - 1)
    return True


def _hang() -> None:
    while True:
        time.sleep(3600)


# ── creatures ──


def spawn(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
    """Spawn ``count`` creatures of ``kind`` in ``region``. Idempotent by key."""
    traced = _fault("spawn.trace")
    if traced:
        _trace("perform", idempotency_key)
    if _fault("spawn.raise"):
        raise RuntimeError("the spawner crashed")
    if _fault("spawn.hang"):
        _hang()
    if _fault("spawn.garbage"):
        return "<html>502 Bad Gateway</html>"
    # In the order they were made: the same key always answers the same list.
    existing = list(Creature.objects.filter(spawned_by=idempotency_key).order_by("pk"))
    if not existing:
        with transaction.atomic():
            for _ in range(int(params.get("count", 1))):
                existing.append(
                    Creature.objects.create(
                        serial=f"0x{secrets.token_hex(4)}",
                        kind=str(params.get("kind", "wolf")),
                        region=str(params.get("region", "north")),
                        spawned_by=idempotency_key,
                    )
                )
    if _fault("spawn.hang_after"):
        _hang()
    if Switch.objects.filter(name="spawn.wait").exists():
        # In the middle of a perform, the world changed and no answer given: where a test
        # kills the process that asked.
        _trace("perform.waiting", idempotency_key)
        deadline = time.monotonic() + 120
        while Switch.objects.filter(name="spawn.wait").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    if _fault("spawn.lose_answer"):
        raise AnswerLost("connection reset before the answer arrived")
    if traced:
        _trace("performed", idempotency_key)
    return {"ok": True, "resources": [{"kind": "creature", "ref": c.serial} for c in existing]}


def _trace(verb: str, idempotency_key: str) -> None:
    Call.objects.create(verb=verb, idempotency_key=idempotency_key, pid=os.getpid())


def despawn(*, run_id: int, resources: list[dict[str, Any]], idempotency_key: str) -> Any:
    """Remove the listed creatures; with an empty list, whatever the key spawned.
    Removing what is not there is a success."""
    Call.objects.create(
        verb="despawn",
        idempotency_key=idempotency_key or "",
        refs=[r.get("ref") for r in resources],
        pid=os.getpid(),
    )
    if _fault("despawn.raise"):
        raise RuntimeError("the despawner crashed")
    if _fault("despawn.hang"):
        _hang()
    if _fault("despawn.die"):
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while Switch.objects.filter(name="despawn.wait").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if _fault("despawn.garbage"):
        return ["not", "an", "envelope"]
    if _fault("despawn.fail"):
        return {"ok": False, "error": "the shard refused: region locked"}
    serials = [r["ref"] for r in resources if r.get("kind") == "creature"]
    if serials:
        Creature.objects.filter(serial__in=serials).delete()
    else:
        Creature.objects.filter(spawned_by=idempotency_key).delete()
    return {"ok": True}


def still_there(*, run_id: int, resources: list[dict[str, Any]]) -> Any:
    if _fault("reconcile.hang"):
        _hang()
    if _fault("reconcile.garbage"):
        return {"ok": "yes"}
    serials = [r["ref"] for r in resources]
    return {
        "ok": True,
        "in_force": list(
            Creature.objects.filter(serial__in=serials).values_list("serial", flat=True)
        ),
    }


def restart() -> int:
    """The world restarts: every creature is gone."""
    return Creature.objects.all().delete()[0]


# ── arenas (#26) ──


def build_arena(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
    """Build the arena ``name``. Idempotent by key."""
    name = str(params.get("name", "arena"))
    arena = Arena.objects.filter(built_by=idempotency_key).first()
    if arena is None:
        try:
            arena = Arena.objects.create(name=name, built_by=idempotency_key)
        except IntegrityError:
            return {"ok": False, "error": f"the arena {name} stands already"}
    return {"ok": True, "resources": [{"kind": "arena", "ref": arena.name}]}


def take_down_arena(*, run_id: int, resources: list[dict[str, Any]], idempotency_key: str) -> Any:
    """Take the arenas down; refused, loudly, while a creature stands in one: what the
    world says when a run is given back out of order (C8). A refusal is written as a
    Call (verb ``arena.refused``) so tests and the demo can count them."""
    names = [r["ref"] for r in resources if r.get("kind") == "arena"]
    arenas = (
        Arena.objects.filter(name__in=names)
        if names
        else Arena.objects.filter(built_by=idempotency_key)
    )
    names = list(arenas.values_list("name", flat=True))
    standing = sorted(
        set(Creature.objects.filter(region__in=names).values_list("region", flat=True))
    )
    if standing:
        Call.objects.create(
            verb="arena.refused",
            idempotency_key=idempotency_key or "",
            refs=standing,
            pid=os.getpid(),
        )
        return {"ok": False, "error": f"creatures still stand in {', '.join(standing)}"}
    Call.objects.create(
        verb="arena.down", idempotency_key=idempotency_key or "", refs=names, pid=os.getpid()
    )
    arenas.delete()
    return {"ok": True}


# ── announcements ──


def announce(*, run_id: int, params: dict[str, Any], idempotency_key: str) -> Any:
    Announcement.objects.create(text=str(params.get("text", ""))[:200])
    return {"ok": True}


# ── spawn rate (a lease) ──


def current_rate(*, target: str | None) -> int:
    setting, _ = _region(target)
    return setting.spawn_rate


def _region(target: str | None) -> tuple[RegionSetting, bool]:
    try:
        return RegionSetting.objects.get_or_create(region=target or "default")
    except IntegrityError:
        return RegionSetting.objects.get(region=target or "default"), False


def set_rate(value: Any, *, target: str | None, run_id: int) -> Any:
    _region(target)
    RegionSetting.objects.filter(region=target or "default").update(spawn_rate=int(value))
    return {"ok": True}


def put_back(baseline: Any, *, expected: Any, run_id: int, target: str | None) -> Any:
    """Put the baseline back, unless somebody else's value is in place now."""
    Call.objects.create(
        verb="restore", idempotency_key=target or "", refs=[baseline], pid=os.getpid()
    )
    if _fault("rate.restore_fail"):
        return {"ok": False, "error": "the settings service is read-only right now"}
    region = target or "default"
    # Compare-and-set, like the ledger: only our own value is replaced.
    if RegionSetting.objects.filter(region=region, spawn_rate=expected).update(spawn_rate=baseline):
        return {"ok": True}
    current = (
        RegionSetting.objects.filter(region=region).values_list("spawn_rate", flat=True).first()
    )
    if current == baseline:
        return {"ok": True}  # already back (or never applied)
    return {"ok": False, "drifted": True, "current": current}


def snapshot() -> dict[str, Any]:
    """The world as a newcomer would want to see it."""
    return {
        "arenas": sorted(Arena.objects.values_list("name", flat=True)),
        "creatures": sorted((c.region, c.kind, c.serial) for c in Creature.objects.all()),
        "rates": dict(RegionSetting.objects.order_by("region").values_list("region", "spawn_rate")),
    }
