"""``manage.py demo``: the ledger's story on the demo world, told in tables."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from events_ledger import execute_step
from events_ledger.models import EventRun, EventRunResource, EventRunStep
from project.world import world
from project.world.models import Call, Creature, RegionSetting

ROOT = Path(settings.BASE_DIR).parent


class Command(BaseCommand):
    help = (
        "Run the demo scenario: a run changes the world, is aborted, and everything is given back."
    )

    def handle(self, *args: Any, **opts: Any) -> None:
        self.out = self.stdout.write
        # The demo clears the world's creatures and tells its story on a database of its
        # own (make demo makes a new one): never on one that holds anything else.
        others = EventRun.objects.exclude(scope="demo").count()
        if others:
            raise CommandError(
                f"this database holds {others} run(s) that are not the demo's; the demo "
                "clears the world's creatures, so it runs only on a database of its own "
                "(make demo makes one)"
            )
        world.switch_off()
        Creature.objects.all().delete()
        for region in ("north", "south"):
            RegionSetting.objects.update_or_create(region=region, defaults={"spawn_rate": 1})
        start = world.snapshot()

        self.title("1. The world before")
        self.show_world()

        self.title("2. Run 'Full moon' changes the world")
        run = EventRun.objects.create(name="Full moon", scope="demo", status="running")
        self.step(run, 1, "world.spawn", {"region": "north", "count": 3, "kind": "wolf"})
        world.switch_on("spawn.lose_answer", 1)
        lost = self.step(
            run,
            2,
            "world.spawn",
            {"region": "south", "count": 2, "kind": "bat"},
            note="the answer is lost on the way back",
        )
        self.step(run, 3, "core.lease", {"lease": "world.spawn_rate#north", "value": 5})
        self.out("")
        self.show_world()
        self.show_ledger(run)
        self.out(
            f"The lost spawn's bats are in the world, but only its placeholder (@step, keyed by "
            f"{lost.idempotency_key[:8]}…) is on the ledger: rule 1, recorded before the world changed."
        )

        self.title("3. The run is aborted; the cron gives everything back")
        EventRun.objects.transition(run, "cancelled", from_="running")
        self.cron("cleanup_runs", "-v", "2")
        self.show_world()
        self.show_ledger(run)
        call = Call.objects.filter(verb="despawn", idempotency_key=lost.idempotency_key).first()
        if call is not None:
            self.out(
                f"The lost spawn was reverted by its idempotency key: despawn(key={lost.idempotency_key[:8]}…, "
                f"resources={call.refs})."
            )
        self.verdict(world.snapshot() == start, "the world equals its starting state")

        self.title("4. Rule 2: a revert that keeps failing stays loud")
        run2 = EventRun.objects.create(name="Bat swarm", scope="demo", status="running")
        self.step(run2, 1, "world.spawn", {"region": "south", "count": 2, "kind": "bat"})
        EventRun.objects.transition(run2, "completed", from_="running")
        world.switch_on("despawn.fail")
        self.out("The despawner now refuses every request (a locked region).")
        for attempt in (1, 2, 3):
            self.out(f"\ncron pass {attempt}:")
            self.cron("cleanup_runs")
        self.show_ledger(run2)
        run2.refresh_from_db()
        self.out(
            f"cleanup status: {run2.cleanup_status}. The sweep will not try again; the rows keep their "
            "last error until a human acts."
        )
        self.out("\nThe operator fixes the region, then retries by hand:")
        world.switch_off()
        self.cron("cleanup_runs", "--run", str(run2.pk), "--reset-attempts", "--actor", "operator")
        self.show_ledger(run2)
        self.verdict(world.snapshot() == start, "the world equals its starting state again")

        self.given_back_in_order()

        self.title("6. Look at it in the console")
        password = self.demo_user()
        self.out("  make serve     then open http://127.0.0.1:8000/admin/")
        self.out(f"  user: demo     password: {password}")

    def given_back_in_order(self) -> None:
        """C8: a run of three phases, each built on the one before, given back last phase
        first. Out of order, the arena would refuse to come down under its lions."""
        self.title("5. Rule C8: the last phase is given back first")
        arena = "pit"
        RegionSetting.objects.update_or_create(region=arena, defaults={"spawn_rate": 1})
        before = world.snapshot()
        mark = Call.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        run = EventRun.objects.create(name="Arena games", scope="demo", status="running")
        self.step(run, 1, "world.build_arena", {"name": arena}, phase="arena")
        self.step(
            run, 1, "world.spawn", {"region": arena, "count": 2, "kind": "lion"}, phase="creatures"
        )
        self.step(
            run, 1, "core.lease", {"lease": f"world.spawn_rate#{arena}", "value": 9}, phase="rate"
        )
        self.out("")
        self.show_world()
        self.out(
            "The lions stand in the arena, and the arena will not come down while they do: "
            "the phases depend on the ones before them."
        )
        EventRun.objects.transition(run, "completed", from_="running")
        self.out("\nThe run ends. What the cron would do, phase by phase:")
        self.cron("cleanup_runs", "--run", str(run.pk), "--dry-run")
        self.cron("cleanup_runs", "-v", "2")
        self.show_world()
        self.show_ledger(run)
        calls = list(
            Call.objects.filter(
                pk__gt=mark, verb__in=("restore", "despawn", "arena.down", "arena.refused")
            )
            .order_by("pk")
            .values_list("verb", "refs")
        )
        self.out("  given back, in this order:")
        self.table(["call", "refs"], [[verb, refs] for verb, refs in calls])
        verbs = [verb for verb, _ in calls]
        self.verdict(
            verbs == ["restore", "despawn", "arena.down"] and world.snapshot() == before,
            "given back rate → creatures → arena, no arena.refused, the world as before",
        )

    # ── steps and the cron ──

    def step(
        self,
        run: EventRun,
        seq: int,
        action: str,
        params: dict[str, Any],
        note: str = "",
        phase: str = "main",
    ) -> EventRunStep:
        step = EventRunStep.objects.create(
            run=run, phase=phase, seq=seq, action_id=action, params=params
        )
        result = execute_step(step)
        what = f"{action} {params}" if phase == "main" else f"[{phase}] {action} {params}"
        extra = f" ({note})" if note else ""
        self.out(f"  step {seq}: {what:<70} -> {result.outcome}, recorded {result.recorded}{extra}")
        return step

    def cron(self, *argv: str) -> int:
        self.out(self.style.MIGRATE_HEADING(f"$ python manage.py {' '.join(argv)}"))
        proc = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), *argv],
            cwd=ROOT,
            env=os.environ.copy(),
            capture_output=True,
            text=True,
        )
        for line in (proc.stdout + proc.stderr).rstrip().splitlines():
            self.out(f"  {line}")
        self.out(f"  (exit status {proc.returncode})")
        return proc.returncode

    # ── printing ──

    def title(self, text: str) -> None:
        self.out("")
        self.out(self.style.MIGRATE_HEADING(f"== {text} =="))

    def verdict(self, ok: bool, text: str) -> None:
        self.out((self.style.SUCCESS("OK: ") if ok else self.style.ERROR("NOT OK: ")) + text)
        if not ok:
            raise SystemExit(1)

    def table(self, headers: list[str], rows: list[list[Any]]) -> None:
        cells = [[str(c) for c in headers]] + [
            [("" if c is None else str(c)) for c in r] for r in rows
        ]
        widths = [min(48, max(len(r[i]) for r in cells)) for i in range(len(headers))]
        for n, row in enumerate(cells):
            self.out("  " + "  ".join(c[:48].ljust(w) for c, w in zip(row, widths, strict=True)))
            if n == 0:
                self.out("  " + "  ".join("-" * w for w in widths))
        if len(cells) == 1:
            self.out("  (none)")

    def show_world(self) -> None:
        snap = world.snapshot()
        self.out("  world: creatures")
        self.table(["region", "kind", "serial"], [list(c) for c in snap["creatures"]])
        self.out("  world: spawn rates  " + ", ".join(f"{r}={v}" for r, v in snap["rates"].items()))
        self.out("  world: arenas  " + (", ".join(snap["arenas"]) or "(none)"))

    def show_ledger(self, run: EventRun) -> None:
        run.refresh_from_db()
        self.out(
            f"  ledger of run {run.pk} '{run.name}' ({run.status}, cleanup {run.cleanup_status})"
        )
        rows = EventRunResource.objects.for_run(run)
        self.table(
            ["kind", "ref", "status", "attempts", "last error"],
            [
                [
                    r.kind,
                    r.ref if len(r.ref) < 20 else r.ref[:8] + "…",
                    r.status,
                    r.revert_attempts,
                    r.last_error,
                ]
                for r in rows
            ],
        )

    def demo_user(self) -> str:
        """A new superuser ``demo`` with a new password; a ``demo`` user that exists
        already is someone's, and is left as it is (neither promoted nor given a new
        password)."""
        User = get_user_model()
        if User.objects.filter(username="demo").exists():
            return "(unchanged: the user demo existed already)"
        password = secrets.token_urlsafe(9)
        User.objects.create_superuser("demo", password=password)
        return password
