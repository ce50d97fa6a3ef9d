"""Faults at every statement (#24): each unit of work of the ledger, a step, a sweep pass,
a reconcile, is run with a real fault at its k-th round trip, for every k:

- through the rig's proxy (``scripts/rig/faultproxy.py``): the reply lost after the server
  ran the request (a COMMIT's too: the outcome is unknown to the client), and the
  connection reset before the request reached the server;
- from the server itself, at the k-th statement that writes: a lock wait timeout behind
  another session's locks, the statement interrupted (``KILL QUERY`` /
  ``pg_cancel_backend``), its statement timeout, and its session killed.

After each fault the same invariants hold, and then the run is ended and swept clean: the
host's own write on the same connection is never lost (no session is left inside a
transaction Django does not know of); no object is recorded twice; no object is given
back twice; the world is back at its start; no step is left claimed by a call that no
longer runs; every run's summary agrees with its rows.

MariaDB and PostgreSQL (SQLite has no server to fault). A step takes the fast path (a
compound statement on MariaDB, one statement of CTEs on PostgreSQL) and, with
``FAST_PATH`` off, the general path. ``make test`` runs the short version (every k of the proxy's faults, the
server's at the first, middle and last write); ``make chaos`` every k of every kind."""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from events_ledger.background import keeper
from events_ledger.cleanup import cleanup_run, reconcile_module, sweep
from events_ledger.ledger import execute_step
from events_ledger.models import STEP_KIND, EventRun, EventRunLog, EventRunResource, EventRunStep
from events_ledger.retention import History, prune, read_archive
from events_ledger.runner import RESOLVED_BY_HAND, end_run, resolve_by_hand
from project.world.models import Arena, Call, Creature, RegionSetting
from tests import faults
from tests.helpers import connection, new_run, phased_run, spawn_step
from tests.test_retention import KEEP, old_run, same_document, whole

proxied_db = faults.proxied_db
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
Res = EventRunResource.objects
FULL = os.environ.get("LEDGER_CHAOS") == "long"
PROXY_KINDS = ("lose_reply", "reset")
#: The TTLs a fault may leave a claim waiting for: short, so a trial ends in seconds.
TTL = timedelta(seconds=1)
#: How long the clean-up after a fault may take: the TTL, and passes to spare.
SETTLE_S = 30.0


@pytest.fixture
def short_ttls(settings: Any, world: Any) -> Iterator[None]:
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "STEP_CLAIM_TTL": TTL,
        "REVERT_CLAIM_TTL": TTL,
    }
    yield


@dataclass
class Tally:
    """What a scenario tried, per kind of fault, for its figure."""

    tried: Counter[str] = field(default_factory=Counter)
    fired: Counter[str] = field(default_factory=Counter)
    raised: Counter[str] = field(default_factory=Counter)
    #: Faults armed for a round trip the unit did not make this time (it ended sooner:
    #: a read it needed no longer, a branch it did not take).
    unreached: Counter[str] = field(default_factory=Counter)

    def figure(self, unit: str) -> str:
        kinds = ", ".join(
            f"{kind} {self.fired[kind]}/{self.tried[kind]}" for kind in sorted(self.tried)
        )
        return f"{unit}: faults fired/tried {kinds}; every invariant held"

    def report(self, figure: Callable[..., None], unit: str) -> None:
        """Record the scenario's figure, and fail it when no fault fired at all."""
        figure(self.figure(unit), True, tried=dict(self.tried), fired=dict(self.fired))
        assert sum(self.fired.values()) > 0, self


def _sample(positions: list[int]) -> list[int]:
    """Every position in ``make chaos``; the first, middle and last in ``make test``."""
    if FULL or len(positions) <= 3:
        return positions
    return sorted({positions[0], positions[len(positions) // 2], positions[-1]})


# ── the invariants ──


def _host_write_survives(tag: str) -> None:
    """The host's own next write on this thread's connection commits (a session left
    inside a transaction Django does not know of would swallow it)."""
    name = f"host-{tag}"
    EventRun.objects.create(name=name)
    table = connection.ops.quote_name(EventRun._meta.db_table)
    seen = faults.direct_query(f"SELECT COUNT(*) FROM {table} WHERE name = %s", [name])
    assert seen[0][0] == 1, f"{tag}: the host's write on the same connection was lost"


def _recorded_once(run: EventRun, tag: str) -> None:
    rows = Counter(
        Res.filter(run=run).exclude(kind=STEP_KIND).values_list("kind", "ref").order_by()
    )
    twice = {target: n for target, n in rows.items() if n > 1}
    assert not twice, f"{tag}: recorded twice: {twice}"


def _given_back_once(spawned: dict[str, str], tag: str) -> None:
    """No creature was despawned twice: by its ref, or by its step's key (an empty list
    gives back whatever the key spawned). ``spawned``: serial -> the key that made it."""
    per_creature: Counter[str] = Counter()
    for key, refs in Call.objects.filter(verb="despawn").values_list("idempotency_key", "refs"):
        per_creature.update(refs or [s for s, made_by in spawned.items() if made_by == key])
    twice = {ref: n for ref, n in per_creature.items() if n > 1 and ref in spawned}
    assert not twice, f"{tag}: given back twice: {twice}"


def _end_and_sweep(run: EventRun, tag: str) -> None:
    """The run ended, then swept until its ledger is clean, within the TTL and passes to
    spare: a claim a fault left waits at most the TTL."""
    EventRun.objects.filter(pk=run.pk, status__in=["pending", "running"]).update(status="cancelled")
    deadline = time.monotonic() + SETTLE_S
    while True:
        sweep()
        run.refresh_from_db()
        clean = (
            run.cleanup_status in ("complete", "not_required")
            and not Res.filter(run=run).unresolved().exists()
        )
        if clean:
            break
        assert time.monotonic() < deadline, (
            f"{tag}: not clean after {SETTLE_S} s: {run.cleanup_status}, "
            f"{list(Res.filter(run=run).values_list('kind', 'status', 'revert_attempts'))}"
        )
        time.sleep(0.1)
    # Clean means no step of the run held it back: none was claimed by a call that
    # could still run (a claim the fault left went stale within the TTL).
    assert not keeper.held(), f"{tag}: a claim is kept fresh for a call that ended"


def _world_at_start(tag: str) -> None:
    assert Creature.objects.count() == 0, f"{tag}: the world was not given back"


def _fresh_world() -> None:
    Creature.objects.all().delete()
    Call.objects.all().delete()


def _spawned() -> dict[str, str]:
    """The creatures in the world now: serial -> the idempotency key that spawned it."""
    return dict(Creature.objects.values_list("serial", "spawned_by"))


# ── running a unit under each fault ──


def _under_proxy_faults(
    db: Any,
    tally: Tally,
    prepare: Callable[[], Any],
    unit: Callable[[Any], Any],
    check: Callable[[Any, str, dict[str, str]], None],
    stride: int = 1,
) -> None:
    """Enumerate the requests of ``unit`` on fresh input, then fault each k in turn
    (every ``stride``-th k, and the last, in ``make test``: a long unit's short version)."""
    _fresh_world()
    first = prepare()
    spawned = _spawned()
    work = db.enumerate(lambda: unit(first))
    check(first, "unfaulted", spawned)
    assert work.error is None, work.error
    assert work.requests, "the unit sent nothing through the proxy"
    every = list(range(1, work.requests + 1))
    if not FULL and stride > 1:
        every = sorted({*every[::stride], every[-1]})
    for kind in PROXY_KINDS:
        for k in every:
            tag = f"{kind}@{k}/{work.requests}"
            _fresh_world()
            given = prepare()
            spawned = _spawned()
            db.reconnect()
            session = db.session_id()
            before = db.proxy.count(session)
            db.arm(kind, k)
            tally.tried[kind] += 1
            try:
                unit(given)
            except Exception:
                tally.raised[kind] += 1
            db.proxy.disarm(session)
            fired = bool(db.fired())
            if not fired:
                # Only a unit that took a shorter way this time (a read it did not need,
                # a branch it did not take) leaves a fault unreached.
                sent = db.proxy.count(session) - before
                assert sent < k, f"{tag}: armed, not fired, yet {sent} requests went"
            tally.fired[kind] += fired
            tally.unreached[kind] += not fired
            check(given, tag, spawned)


def _under_server_faults(
    tally: Tally,
    prepare: Callable[[], Any],
    unit: Callable[[Any], Any],
    check: Callable[[Any, str, dict[str, str]], None],
) -> None:
    _fresh_world()
    first = prepare()
    spawned = _spawned()
    work = faults.enumerate_work(lambda: unit(first))
    check(first, "unfaulted", spawned)
    assert work.error is None, work.error
    assert work.faultable, "the unit wrote nothing"
    for kind in faults.server_kinds(connection):
        for k in _sample(work.faultable):
            tag = f"{kind}@{k}"
            _fresh_world()
            given = prepare()
            spawned = _spawned()
            tally.tried[kind] += 1
            with faults.server_fault(kind, k) as fault:
                try:
                    unit(given)
                except Exception:
                    tally.raised[kind] += 1
            # A write inside a transaction that already holds its table cannot be
            # blocked by another session (the harness says so); every other one fires.
            assert fault.fired or "rows only" in fault.detail, (tag, fault.detail)
            tally.fired[kind] += fault.fired
            check(given, tag, spawned)


@contextlib.contextmanager
def _fast_path(on: bool, settings: Any) -> Iterator[None]:
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, **settings.EVENTS_LEDGER, "FAST_PATH": on}
    yield


PATHS = pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "general-path"])


def _skip_if_no_fast_path(fast: bool) -> None:
    mariadb = connection.vendor == "mysql" and connection.mysql_is_mariadb
    if fast and not (mariadb or connection.vendor == "postgresql"):
        pytest.skip("the fast path runs on MariaDB and PostgreSQL")


# ── a step ──


def _step_input() -> EventRunStep:
    return spawn_step(new_run(name="faulted"), "north", 2)


def _step_unit(step: EventRunStep) -> Any:
    return execute_step(step)


def _step_check(step: EventRunStep, tag: str, spawned: dict[str, str]) -> None:
    _host_write_survives(tag)
    step.refresh_from_db()
    # A fault costs at most the attempt it hit: never a step failed for good (it starts
    # with every attempt left).
    assert step.status != "failed" and step.attempts <= 1, (tag, step.status, step.attempts)
    run = EventRun.objects.get(pk=step.run_id)
    _recorded_once(run, tag)
    _end_and_sweep(run, tag)
    _recorded_once(run, tag)
    _given_back_once(spawned, tag)
    _world_at_start(tag)


@PATHS
def test_a_step_loses_nothing_to_a_fault_at_any_round_trip(
    proxied_db, short_ttls, settings, figure, fast
):  # W5, rule 1, #24
    connection.ensure_connection()
    _skip_if_no_fast_path(fast)
    tally = Tally()
    with _fast_path(fast, settings):
        _under_proxy_faults(proxied_db, tally, _step_input, _step_unit, _step_check)
    tally.report(figure, "a step")


@PATHS
def test_a_step_loses_nothing_to_a_server_fault_at_any_write(
    short_ttls, settings, figure, fast
):  # W5, rule 1, #24
    faults.require_server()
    connection.ensure_connection()
    _skip_if_no_fast_path(fast)
    tally = Tally()
    with _fast_path(fast, settings):
        _under_server_faults(tally, _step_input, _step_unit, _step_check)
    tally.report(figure, "a step")


# ── a sweep pass ──


def _pass_input() -> EventRun:
    run = new_run(name="to-give-back")
    assert execute_step(spawn_step(run, "north", 2)).outcome == "done"
    EventRun.objects.transition(run, "cancelled", from_="running")
    return run


def _pass_unit(run: EventRun) -> Any:
    return sweep()


def _pass_check(run: EventRun, tag: str, spawned: dict[str, str]) -> None:
    _host_write_survives(tag)
    _end_and_sweep(run, tag)
    _recorded_once(run, tag)
    _given_back_once(spawned, tag)
    _world_at_start(tag)


def test_a_sweep_pass_gives_back_once_whatever_round_trip_fails(
    proxied_db, short_ttls, figure
):  # C4, C5, #24
    tally = Tally()
    _under_proxy_faults(proxied_db, tally, _pass_input, _pass_unit, _pass_check)
    tally.report(figure, "a sweep pass")


def test_a_sweep_pass_with_the_default_revert_ttl_strands_nothing_whatever_round_trip_fails(
    proxied_db, world, settings, figure
):  # C4, C5, R5: a claim's token is known before the claim is sent
    # REVERT_CLAIM_TTL at its default (15 minutes): a claim whose answer was lost must be
    # handed back by this process's next pass, not wait the TTL out (with a token minted
    # inside the claim, nobody knew it: on a419c07 the rows stayed `reverting`, and each
    # lost claim counted toward the poison limit).
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "STEP_CLAIM_TTL": TTL}
    tally = Tally()
    _under_proxy_faults(proxied_db, tally, _pass_input, _pass_unit, _pass_check)
    tally.report(figure, "a sweep pass (default revert TTL)")


def test_a_sweep_pass_gives_back_once_whatever_write_the_server_fails(
    short_ttls, figure
):  # C4, C5, #24
    faults.require_server()
    tally = Tally()
    _under_server_faults(tally, _pass_input, _pass_unit, _pass_check)
    tally.report(figure, "a sweep pass")


# ── a human's retry of a run the sweep gave up on ──


def _retry_input() -> EventRun:
    """A run whose rows spent their automatic attempts: only a human's retry starts it
    over (rule 2)."""
    run = _pass_input()
    spent = Res.filter(run=run).exclude(kind=STEP_KIND)
    assert spent.update(revert_attempts=3, last_error="the world said no") == 2
    EventRun.objects.filter(pk=run.pk).update(cleanup_status="incomplete")
    return run


def _retry_unit(run: EventRun) -> Any:
    return cleanup_run(run, reset_attempts=True, actor="ops")


def _retry_check(run: EventRun, tag: str, spawned: dict[str, str]) -> None:
    _host_write_survives(tag)
    # Whatever the fault cut, the rows are either still spent, for the human to press
    # again, or reset and given back at most once; never left reset and unclaimable.
    if Res.filter(run=run, revert_attempts__gte=3).unresolved().exists():
        cleanup_run(run, reset_attempts=True, actor="ops")
    _end_and_sweep(run, tag)
    _recorded_once(run, tag)
    _given_back_once(spawned, tag)
    _world_at_start(tag)
    pressed = EventRunLog.objects.filter(run=run, kind="cleanup.retry")
    assert pressed.exists(), f"{tag}: the human's retry was not logged"


def test_a_human_retry_gives_back_once_whatever_round_trip_fails(
    proxied_db, short_ttls, figure
):  # rule 2, C4, #24
    tally = Tally()
    _under_proxy_faults(proxied_db, tally, _retry_input, _retry_unit, _retry_check)
    tally.report(figure, "a human's retry")


def test_a_human_retry_gives_back_once_whatever_write_the_server_fails(
    short_ttls, figure
):  # rule 2, C4, #24
    faults.require_server()
    tally = Tally()
    _under_server_faults(tally, _retry_input, _retry_unit, _retry_check)
    tally.report(figure, "a human's retry")


# ── an operator ending a run by hand ──


def _stuck_input() -> EventRun:
    """A run still `running` whose step made two creatures: its driver is gone."""
    run = new_run(name="stuck")
    assert execute_step(spawn_step(run, "north", 2)).outcome == "done"
    return run


def _end_unit(run: EventRun) -> Any:
    return end_run(run.pk, "failed", actor="ops", reason="its driver died")


def _end_check(run: EventRun, tag: str, spawned: dict[str, str]) -> None:
    _host_write_survives(tag)
    logged = EventRunLog.objects.filter(run=run, kind="run.ended_by_hand")
    status = EventRun.objects.get(pk=run.pk).status
    # One transaction: the run's end and its log line, or neither.
    assert (status, logged.count()) in {("running", 0), ("failed", 1)}, f"{tag}: {status}"
    if status == "running":
        assert _end_unit(run), f"{tag}: pressed again, it did not end"
    assert logged.count() == 1 and not _end_unit(run), f"{tag}: ended twice"
    _end_and_sweep(run, tag)
    _given_back_once(spawned, tag)
    _world_at_start(tag)


def test_ending_a_run_by_hand_is_whole_or_nothing_whatever_round_trip_fails(
    proxied_db, short_ttls, figure
):  # R, C7: the operator's end and its record land together
    tally = Tally()
    _under_proxy_faults(proxied_db, tally, _stuck_input, _end_unit, _end_check)
    tally.report(figure, "ending a run by hand")


def test_ending_a_run_by_hand_is_whole_or_nothing_whatever_write_the_server_fails(
    short_ttls, figure
):  # R, C7
    faults.require_server()
    tally = Tally()
    _under_server_faults(tally, _stuck_input, _end_unit, _end_check)
    tally.report(figure, "ending a run by hand")


# ── an operator resolving rows by hand ──


def _resolve_input() -> EventRun:
    """A run whose rows spent their attempts, and the ids the operator picked (read here:
    a read in the unit would be the unit's first faulted round trip)."""
    run = _retry_input()
    run.picked = list(Res.filter(run=run).exclude(kind=STEP_KIND).values_list("pk", flat=True))  # type: ignore[attr-defined]
    return run


def _resolve_unit(run: EventRun) -> Any:
    return resolve_by_hand(run.picked, actor="ops", reason="gone, I checked")  # type: ignore[attr-defined]


def _resolve_check(run: EventRun, tag: str, spawned: dict[str, str]) -> None:
    _host_write_survives(tag)
    rows = Res.filter(run=run).exclude(kind=STEP_KIND)
    logged = EventRunLog.objects.filter(run=run, kind=RESOLVED_BY_HAND)
    # One transaction: whatever the fault cut, the rows and their log line went together.
    resolved = rows.filter(status="resolved").count()
    assert (resolved, logged.count()) in {(0, 0), (2, 1)}, (
        f"{tag}: {resolved} rows, {logged.count()} lines"
    )
    if not resolved:
        _resolve_unit(run)  # the operator presses again
    assert rows.filter(status="resolved").count() == 2 and logged.count() == 1, tag
    assert not Call.objects.filter(verb="despawn").exists(), f"{tag}: a module was called"
    sweep()
    run.refresh_from_db()
    assert run.cleanup_status == "complete", f"{tag}: {run.cleanup_status}"


def test_resolving_by_hand_is_whole_or_nothing_whatever_round_trip_fails(
    proxied_db, short_ttls, figure
):  # rule 2, C7: the operator's decision and its record land together
    tally = Tally()
    _under_proxy_faults(proxied_db, tally, _resolve_input, _resolve_unit, _resolve_check)
    tally.report(figure, "resolving rows by hand")


def test_resolving_by_hand_is_whole_or_nothing_whatever_write_the_server_fails(
    short_ttls, figure
):  # rule 2, C7
    faults.require_server()
    tally = Tally()
    _under_server_faults(tally, _resolve_input, _resolve_unit, _resolve_check)
    tally.report(figure, "resolving rows by hand")


# ── a sweep pass over three dependent phases (#26) ──


def _phased_input() -> EventRun:
    Arena.objects.all().delete()
    RegionSetting.objects.all().delete()
    return phased_run("faulted", count=2)


def _phased_check(run: EventRun, tag: str, spawned: dict[str, str]) -> None:
    _pass_check(run, tag, spawned)
    refused = Call.objects.filter(verb="arena.refused").count()
    assert not refused, f"{tag}: an earlier phase was given back before a later one (C8)"
    assert not Arena.objects.exists(), f"{tag}: the arena was not given back"
    assert RegionSetting.objects.get(region="faulted").spawn_rate == 1, tag


def test_a_phased_pass_keeps_the_order_whatever_round_trip_fails(
    proxied_db, short_ttls, figure
):  # C8, C4, #26
    tally = Tally()
    _under_proxy_faults(proxied_db, tally, _phased_input, _pass_unit, _phased_check, stride=4)
    tally.report(figure, "a phased pass")


def test_a_phased_pass_keeps_the_order_whatever_write_the_server_fails(
    short_ttls, figure
):  # C8, C4, #26
    faults.require_server()
    tally = Tally()
    _under_server_faults(tally, _phased_input, _pass_unit, _phased_check)
    tally.report(figure, "a phased pass")


# ── a reconcile ──


def _reconcile_input() -> EventRun:
    """A run whose world restarted under one of its three creatures."""
    run = new_run(name="restarted")
    assert execute_step(spawn_step(run, "north", 3)).outcome == "done"
    gone = Creature.objects.order_by("pk").first()
    assert gone is not None
    gone.delete()
    return run


def _reconcile_unit(run: EventRun) -> Any:
    return reconcile_module("world")


def _reconcile_check(run: EventRun, tag: str, spawned: dict[str, str]) -> None:
    _host_write_survives(tag)
    reconcile_module("world")  # the next reconcile, unfaulted, finishes what was cut
    there = set(Creature.objects.values_list("serial", flat=True))
    rows = Res.filter(run=run).exclude(kind=STEP_KIND)
    orphaned = set(rows.filter(status="orphaned").values_list("ref", flat=True))
    live = set(rows.filter(status="confirmed").values_list("ref", flat=True))
    assert live == there and len(orphaned) == 1 and not orphaned & there, (tag, live, orphaned)
    logged = EventRunLog.objects.filter(run=run, kind="resource.orphaned")
    assert logged.exists(), f"{tag}: a row was orphaned without its log entry (C7)"
    _end_and_sweep(run, tag)
    _recorded_once(run, tag)
    _given_back_once(spawned, tag)
    _world_at_start(tag)


def test_a_reconcile_orphans_once_whatever_round_trip_fails(
    proxied_db, short_ttls, figure
):  # C6, C7, #24
    tally = Tally()
    _under_proxy_faults(proxied_db, tally, _reconcile_input, _reconcile_unit, _reconcile_check)
    tally.report(figure, "a reconcile")


def test_a_reconcile_orphans_once_whatever_write_the_server_fails(
    short_ttls, figure
):  # C6, C7, #24
    faults.require_server()
    tally = Tally()
    _under_server_faults(tally, _reconcile_input, _reconcile_unit, _reconcile_check)
    tally.report(figure, "a reconcile")


# ── a prune (#28) ──


@dataclass
class _History:
    """What a prune is given: runs it may remove (with what the archive must read back
    for each) and runs it must keep (with what the tables hold of each)."""

    archive: Path
    gone: dict[int, dict[str, Any]]
    kept: dict[int, dict[str, int]]


def _prune_input(tmp: Path) -> Callable[[], _History]:
    trials = iter(range(1_000_000))

    def prepare() -> _History:
        # The same history every trial, so the k-th statement is the same one: what an
        # earlier trial kept (and the host's writes) goes first.
        for model in (EventRunResource, EventRunStep, EventRunLog, EventRun):
            model.objects.all().delete()
        gone = [old_run(name=f"pruned-{i}", rows=("reverted",) * (i % 3)) for i in range(4)]
        kept = [
            old_run(name="pruned-owes", cleanup="pending", rows=("confirmed",)),
            old_run(name="pruned-incomplete", cleanup="incomplete", rows=("drifted",)),
        ]
        docs = History().documents([r.pk for r in gone])
        return _History(
            archive=tmp / f"trial-{next(trials)}.jsonl.gz",
            gone={d["run"]["id"]: d for d in docs},
            kept={r.pk: whole(r.pk) for r in kept},
        )

    return prepare


def _prune_unit(given: _History) -> Any:
    # Two runs a batch: a fault falls in the first batch, the second, or between.
    return prune(older_than=KEEP, batch=2, archive=given.archive)


def _prune_check(given: _History, tag: str, spawned: dict[str, str]) -> None:
    _host_write_survives(tag)
    for pk, held in given.kept.items():
        assert whole(pk) == held, f"{tag}: a run that owes something lost rows"
    # The next prune, unfaulted, finishes the job from the archive the fault left.
    prune(older_than=KEEP, batch=2, archive=given.archive)
    assert not EventRun.objects.filter(pk__in=given.gone).exists(), tag
    for pk, held in given.kept.items():
        assert whole(pk) == held, f"{tag}: a run that owes something lost rows"
    read = list(read_archive(given.archive))
    archived = Counter(doc["run"]["id"] for doc in read)
    assert archived == Counter(list(given.gone)), f"{tag}: archived {dict(archived)}"
    for doc in read:
        assert same_document(doc, given.gone[doc["run"]["id"]]), f"{tag}: not whole"


def test_a_prune_archives_each_run_once_whatever_round_trip_fails(
    proxied_db, tmp_path, figure
):  # #28, #24
    tally = Tally()
    _under_proxy_faults(proxied_db, tally, _prune_input(tmp_path), _prune_unit, _prune_check)
    tally.report(figure, "a prune")


def test_a_prune_archives_each_run_once_whatever_write_the_server_fails(
    tmp_path, figure
):  # #28, #24
    faults.require_server()
    tally = Tally()
    _under_server_faults(tally, _prune_input(tmp_path), _prune_unit, _prune_check)
    tally.report(figure, "a prune")


# ── #24, finding 2: a COMMIT whose answer was lost, and a cleanup before the client knew ──


@PATHS
def test_an_answer_committed_unanswered_and_given_back_since_is_never_recorded_again(
    proxied_db, short_ttls, settings, fast
):  # W3, W5, C4, #24: finding 2 (recorded and given back twice)
    """The step's second transaction commits and its answer is lost on the way back; before
    the worker learns anything, the run is cancelled and cleaned up (its rows given
    back). What the worker then does must not record the answer again: the rows would be
    live again, the run pending, and every object given back a second time."""
    connection.ensure_connection()
    _skip_if_no_fast_path(fast)
    import threading

    _fresh_world()
    with _fast_path(fast, settings):
        unfaulted = _step_input()
        work = proxied_db.enumerate(lambda: _step_unit(unfaulted))
        # The request that commits the answer: the last of the unit.
        k = work.requests
        _end_and_sweep(EventRun.objects.get(pk=unfaulted.run_id), "unfaulted")
        _fresh_world()
        step = _step_input()
        spawned_before: dict[str, str] = {}
        cleaned: list[bool] = []

        def clean_up_meanwhile() -> None:
            try:
                spawned_before.update(_spawned())
                EventRun.objects.filter(pk=step.run_id).update(status="cancelled")
                sweep()
                cleaned.append(True)
            finally:
                from django.db import connections

                connections.close_all()

        def first_statement_after_the_fault(execute, sql, params, many, context):
            if proxied_db.fired() and not cleaned:
                thread = threading.Thread(target=clean_up_meanwhile)
                thread.start()
                thread.join()
            return execute(sql, params, many, context)

        proxied_db.reconnect()
        session = proxied_db.session_id()
        proxied_db.arm("lose_reply", k)
        with connection.execute_wrapper(first_statement_after_the_fault):
            with contextlib.suppress(Exception):
                execute_step(step)
        proxied_db.proxy.disarm(session)
        assert proxied_db.fired() and cleaned, "the fault or the cleanup did not happen"
        run = EventRun.objects.get(pk=step.run_id)
        _recorded_once(run, "lost commit answer")
        _end_and_sweep(run, "lost commit answer")
        _given_back_once({**spawned_before, **_spawned()}, "lost commit answer")
        _world_at_start("lost commit answer")
        assert Creature.objects.count() == 0


# ── #24 review: a lost claim on a step's last attempt ──


def test_a_claim_whose_answer_was_lost_on_the_last_attempt_is_not_failed_for_good(
    proxied_db, short_ttls, settings
):  # W5, #24
    """The general path's first transaction commits its claim and the answer is lost.
    No call was made under the claim: handed back with its attempt not counted, the
    step is still to be tried, never failed for good on its last attempt unperformed."""
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        **settings.EVENTS_LEDGER,
        "FAST_PATH": False,
    }
    connection.ensure_connection()
    max_attempts = 3
    _fresh_world()
    unfaulted = _step_input()
    work = proxied_db.enumerate(lambda: _step_unit(unfaulted))
    _end_and_sweep(EventRun.objects.get(pk=unfaulted.run_id), "unfaulted")
    for k in range(1, work.requests + 1):
        _fresh_world()
        step = _step_input()
        EventRunStep.objects.filter(pk=step.pk).update(attempts=max_attempts - 1)
        step.refresh_from_db()
        proxied_db.reconnect()
        session = proxied_db.session_id()
        proxied_db.arm("lose_reply", k)
        with contextlib.suppress(Exception):
            execute_step(step)
        proxied_db.proxy.disarm(session)
        step.refresh_from_db()
        performed = Creature.objects.filter(spawned_by=step.idempotency_key).exists()
        assert step.status != "failed" or performed, (k, step.status, step.last_error)
        _end_and_sweep(EventRun.objects.get(pk=step.run_id), f"last attempt, lose_reply@{k}")
        _world_at_start(f"last attempt, lose_reply@{k}")
