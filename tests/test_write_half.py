"""The write half (SPEC W1–W6): recording before the world changes."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from events_ledger import Action, registry
from events_ledger.envelopes import normalise
from events_ledger.ledger import (
    execute_step,
    mark_run_dirty,
    record_answer,
    reserve_step,
)
from events_ledger.models import STEP_KIND, EventRunLog, EventRunResource, EventRunStep
from project.world.models import Creature, RegionSetting
from tests.factories import ResourceFactory
from tests.helpers import connection, lease_step, new_run, new_step, spawn_step, step_ttl

Res = EventRunResource.objects
LEDGER = Action(
    id="t.make",
    owner="t",
    reversible="ledger",
    perform=lambda **kw: {"ok": True},
    revert=lambda **kw: {"ok": True},
)


# ── W1 ──


@pytest.mark.parametrize(
    "entry,why",
    [
        ("creature", "not a mapping"),
        (["creature", "x"], "not a mapping"),
        ({"kind": "", "ref": "x"}, "bad kind"),
        ({"kind": "k" * 65, "ref": "x"}, "bad kind"),
        ({"kind": "@step", "ref": "x"}, "reserved kind"),
        ({"kind": "creature", "ref": ""}, "bad ref"),
        ({"kind": "creature"}, "bad ref"),
        ({"kind": "creature", "ref": "r" * 191}, "bad ref"),
        ({"kind": "creature", "ref": "x", "member_key": "m" * 191}, "member_key"),
        ({"kind": "creature", "ref": "x", "until": "next tuesday"}, "bad until"),
        ({"kind": "creature", "ref": "x", "until": 12}, "bad until"),
        ({"kind": "override", "ref": "nobody.lease"}, "no module registers"),
        ({"kind": "override", "ref": "nobody.lease#north"}, "no module registers"),
    ],
)
def test_normalise_refuses_with_a_reason(entry, why):  # W1
    answer = normalise(entry, "t.make")
    assert not answer.ok and answer.row is None
    assert why in answer.reason and "t.make" in answer.reason


def test_normalise_accepts_and_never_truncates():  # W1
    ok = normalise(
        {
            "kind": "creature",
            "ref": "r" * 190,
            "member_key": "m",
            "until": "2030-01-01T00:00:00Z",
            "payload": {"hp": 3},
        },
        "t.make",
    )
    assert ok.ok and ok.row["ref"] == "r" * 190 and ok.row["member_key"] == "m"
    assert ok.row["lease_until"].year == 2030 and ok.row["payload"] == {"hp": 3}
    # A targeted lease ref resolves through the lease's own id.
    assert normalise({"kind": "override", "ref": "world.spawn_rate#dungeon-3"}, "t.make").ok


# ── W2, W4 ──


@pytest.mark.django_db
def test_reserve_step_writes_the_placeholder_and_marks_the_run_dirty():  # W2, W4
    run = new_run()
    step = new_step(run, "t.make")
    pk = reserve_step(run, step, LEDGER)
    row = Res.get(pk=pk)
    assert (row.kind, row.ref, row.status, row.owner_module) == (
        STEP_KIND,
        step.idempotency_key,
        "pending",
        "t",
    )
    assert row.payload == {"action": "t.make", "phase": "main", "seq": step.seq}
    run.refresh_from_db()
    assert run.cleanup_status == "pending"
    # The step's next attempt reuses it.
    assert reserve_step(run, step, LEDGER) == pk
    assert Res.filter(kind=STEP_KIND).count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("reversible", ["none", "self", "override"])
def test_only_ledger_actions_get_a_placeholder(reversible):  # W2
    run = new_run()
    action = Action(id="t.x", owner="t", reversible=reversible, perform=lambda **kw: None)
    assert reserve_step(run, new_step(run, "t.x"), action) is None
    assert not Res.exists()


@pytest.mark.django_db
def test_mark_run_dirty_from_not_required_or_complete():  # W4, late answers
    for start, end in [
        ("not_required", "pending"),
        # Rows recorded after the cleanup ended make the run need cleanup again.
        ("complete", "pending"),
        # A human's case stays one; the sweep's repair re-derives it from the rows.
        ("incomplete", "incomplete"),
    ]:
        run = new_run(cleanup_status=start)
        mark_run_dirty(run)
        run.refresh_from_db()
        assert run.cleanup_status == end


# ── W3 ──


@pytest.mark.django_db
def test_record_answer_records_drops_skips_and_names_holders():  # W3
    run, other = new_run(), new_run()
    step = new_step(run, "t.make")
    ph = reserve_step(run, step, LEDGER)
    theirs = ResourceFactory(
        run=other, owner_module="t", kind="thing", ref="taken", status="confirmed"
    )
    answer = [
        {"kind": "thing", "ref": "a", "payload": {"x": 1}},
        {"kind": "thing", "ref": "b"},
        {"kind": "thing", "ref": "a"},  # twice in one answer: once on the ledger
        {"kind": "thing", "ref": "taken"},
        {"kind": "", "ref": "bad"},
        42,
    ]
    out = record_answer(run, step, LEDGER, ph, answer)
    assert out.recorded == 2
    assert any(f"held by run {other.pk}" in r for r in out.rejected)
    assert sum("bad kind" in r for r in out.rejected) == 1
    assert sum("not a mapping" in r for r in out.rejected) == 1
    assert len(out.rejected) == 3
    rows = {r.ref: r for r in Res.filter(run=run).exclude(kind=STEP_KIND)}
    assert set(rows) == {"a", "b"} and {r.status for r in rows.values()} == {"confirmed"}
    assert rows["a"].payload == {"x": 1} and rows["a"].step_id == step.pk
    # Refused entries: the answer is not wholly on the ledger, so the placeholder stays
    # and cleanup will ask for everything the key made.
    assert not out.complete and Res.get(pk=ph).status == "pending"
    assert Res.get(pk=theirs.pk).run_id == other.pk
    # The same answer again (a retried step), its good part only: nothing recorded
    # twice, nothing said, and now the whole answer is on the ledger.
    again = record_answer(run, step, LEDGER, ph, answer[:3])
    assert again.recorded == 0 and again.rejected == [] and again.complete
    assert Res.get(pk=ph).status == "reverted"
    assert Res.filter(run=run).exclude(kind=STEP_KIND).count() == 2


@pytest.mark.django_db
def test_record_answer_resolves_the_placeholder_when_nothing_was_made():  # W3
    run = new_run()
    step = new_step(run, "t.make")
    ph = reserve_step(run, step, LEDGER)
    out = record_answer(run, step, LEDGER, ph, [])
    assert out.recorded == 0 and Res.get(pk=ph).status == "reverted"


@pytest.mark.django_db
def test_record_answer_marks_the_run_dirty():  # W3
    run = new_run()
    step = new_step(run, "t.make")
    record_answer(run, step, LEDGER, None, [{"kind": "thing", "ref": "a"}])
    run.refresh_from_db()
    assert run.cleanup_status == "pending"


@pytest.mark.django_db
def test_recording_costs_the_same_statements_for_5_and_50_resources():  # W3, bulk
    def cost(n):
        run = new_run()
        step = new_step(run, "t.make")
        ph = reserve_step(run, step, LEDGER)
        with CaptureQueriesContext(connection) as q:
            out = record_answer(
                run, step, LEDGER, ph, [{"kind": "thing", "ref": f"{run.pk}-{i}"} for i in range(n)]
            )
        assert out.recorded == n
        return len(q)

    assert cost(5) == cost(50)


junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=250),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["kind", "ref", "until", "member_key", "payload", "memberKey", "x"])
            | st.text(max_size=5),
            children,
            max_size=6,
        )
    ),
    max_leaves=12,
)
entries = (
    st.lists(
        junk
        | st.fixed_dictionaries(
            {"kind": st.text(max_size=70), "ref": st.text(max_size=200)},
            optional={"until": junk, "member_key": junk, "payload": junk},
        ),
        max_size=8,
    )
    | junk
)


@pytest.mark.django_db
@hsettings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(resources=entries)
def test_garbage_answers_never_raise_and_never_record_a_bad_row(resources):  # W3, W1
    run = new_run()
    step = new_step(run, "t.make")
    ph = reserve_step(run, step, LEDGER)
    out = record_answer(run, step, LEDGER, ph, resources)
    rows = list(Res.filter(run=run).exclude(kind=STEP_KIND))
    assert out.recorded == len(rows)
    for row in rows:
        assert 0 < len(row.kind) <= 64 and row.kind != STEP_KIND
        assert 0 < len(row.ref) <= 190
        assert row.status == "confirmed"
        reported = [
            e
            for e in (resources if isinstance(resources, list) else [])
            if isinstance(e, dict)
            and str(e.get("ref")) == row.ref
            and str(e.get("kind")) == row.kind
        ]
        assert reported, "a row nobody reported"
    # Resolved only when every reported entry is on the ledger.
    assert (Res.get(pk=ph).status == "reverted") == (out.complete and not out.rejected)
    if out.rejected:
        assert Res.get(pk=ph).status == "pending"


# ── W5: step execution on the demo world ──

pytestmark_world = pytest.mark.django_db(transaction=True)


@pytestmark_world
def test_a_spawn_records_one_confirmed_row_per_creature(world):  # W5, W3
    run = new_run()
    step = spawn_step(run, count=3)
    result = execute_step(step)
    assert (result.outcome, result.recorded, result.rejected) == ("done", 3, [])
    serials = set(Creature.objects.values_list("serial", flat=True))
    rows = Res.filter(run=run, kind="creature")
    assert set(rows.values_list("ref", flat=True)) == serials and len(serials) == 3
    assert set(rows.values_list("status", flat=True)) == {"confirmed"}
    assert Res.get(kind=STEP_KIND).status == "reverted"
    step.refresh_from_db()
    assert (step.status, step.attempts) == ("done", 1)
    # A clean success lives on the step row; the log keeps what an operator must read.
    assert not EventRunLog.objects.filter(run=run).exists()


@pytestmark_world
def test_a_lost_answer_leaves_the_placeholder_and_the_creatures(world):  # W5, rule 1
    world.switch_on("spawn.lose_answer")
    run = new_run()
    step = spawn_step(run, count=2)
    result = execute_step(step)
    assert result.outcome == "retry" and "answer arrived" in result.error
    assert Creature.objects.count() == 2
    ph = Res.get(run=run)
    assert (ph.kind, ph.ref, ph.status) == (STEP_KIND, step.idempotency_key, "pending")
    step.refresh_from_db()
    assert step.status == "pending" and step.last_error
    assert EventRunLog.objects.get(run=run, kind="step.retry").detail["error"] == step.last_error


@pytestmark_world
def test_a_reexecuted_step_records_nothing_twice(world):  # W5, W2, W3
    world.switch_on("spawn.lose_answer", 1)
    run = new_run()
    step = spawn_step(run, count=3)
    assert execute_step(step).outcome == "retry"
    again = execute_step(step)
    assert (again.outcome, again.recorded) == ("done", 3)
    assert Creature.objects.count() == 3  # the world is idempotent by key
    assert Res.filter(run=run, kind="creature").count() == 3
    assert Res.filter(run=run, kind=STEP_KIND).count() == 1
    EventRunStep.objects.filter(pk=step.pk).update(status="pending")
    third = execute_step(step)
    assert (third.outcome, third.recorded, third.rejected) == ("done", 0, [])
    assert Res.filter(run=run, kind="creature").count() == 3
    assert set(Res.filter(run=run, kind=STEP_KIND).values_list("status", flat=True)) == {"reverted"}


def _with_action(isolated_registry, **kw):
    action = Action(
        id="t.world", owner="world", reversible="ledger", revert=lambda **k: {"ok": True}, **kw
    )
    isolated_registry.register_action(action)
    return action


@pytestmark_world
def test_a_hung_perform_returns_at_its_deadline_as_a_timeout(
    world, isolated_registry
):  # W5, deadline
    from project.world import world as w

    _with_action(isolated_registry, perform=w.spawn, budget_ms=300)
    world.switch_on("spawn.hang")
    run = new_run()
    step = new_step(run, "t.world", {"count": 1})
    result = execute_step(step)
    assert result.outcome == "overdue" and "did not answer within 0.3s" in result.error
    assert Res.get(run=run).status == "pending"
    # The call still lives: its step stays claimed, and a retry beside it is refused.
    step.refresh_from_db()
    assert step.status == "running" and step.claimed_by
    assert execute_step(step).outcome == "busy"


@pytest.mark.django_db(transaction=True)
def test_a_hung_call_leaves_no_database_connection_open(
    world, isolated_registry, vendor
):  # W5, deadline
    if vendor not in ("mysql", "postgresql"):
        pytest.skip("server sessions exist only on server databases")
    from events_ledger.deadline import call_with_deadline
    from project.world import world as w

    def sessions():
        with connection.cursor() as c:
            if vendor == "mysql":
                c.execute(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE()"
                )
            else:
                c.execute(
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()"
                )
            return c.fetchone()[0]

    before = sessions()
    world.switch_on("spawn.hang")
    call = call_with_deadline(
        lambda: w.spawn(run_id=1, params={}, idempotency_key="k"), 0.5, "hang"
    )
    assert call.timed_out
    import time

    # Not one session more than before: the hung call's was ended (the server ends a
    # killed session asynchronously). Fewer is no leak: Django's pool, where it is on,
    # closes idle sessions of its own meanwhile.
    for _ in range(50):
        if sessions() <= before:
            break
        time.sleep(0.1)
    assert sessions() <= before


@pytestmark_world
@pytest.mark.parametrize(
    "answer,outcome",
    [
        ("garbage", "retry"),
        (None, "retry"),
        ({"ok": 1, "resources": [{"kind": "thing", "ref": "x"}]}, "retry"),
        ({"ok": "true"}, "retry"),
        ({"ok": False, "error": "nope"}, "retry"),
        ({"ok": False, "error": "never", "retry": False}, "failed"),
    ],
)
def test_nothing_but_explicit_success_is_success(isolated_registry, answer, outcome):  # W5
    _with_action(isolated_registry, perform=lambda **kw: answer)
    run = new_run()
    result = execute_step(new_step(run, "t.world"))
    assert result.outcome == outcome and result.recorded == 0
    assert not Res.filter(run=run).exclude(kind=STEP_KIND).exists()
    assert Res.get(run=run, kind=STEP_KIND).status == "pending"


@pytestmark_world
def test_a_perform_that_raises_is_a_failed_attempt(world, isolated_registry, settings):  # W5
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "MAX_STEP_ATTEMPTS": 2}
    world.switch_on("spawn.raise")
    run = new_run()
    step = spawn_step(run)
    assert execute_step(step).outcome == "retry"
    last = execute_step(step)
    assert last.outcome == "failed" and "RuntimeError" in last.error
    step.refresh_from_db()
    assert (step.status, step.attempts) == ("failed", 2)


@pytestmark_world
def test_a_claimed_step_is_not_run_twice(world):  # W5
    run = new_run()
    step = spawn_step(run)
    assert EventRunStep.objects.claim(step, step_ttl())
    assert execute_step(step).outcome == "busy"
    assert Creature.objects.count() == 0


@pytestmark_world
def test_a_stale_step_claim_is_taken_over(world):  # W5
    run = new_run()
    step = spawn_step(run)
    EventRunStep.objects.claim(step, step_ttl())
    from events_ledger.db import UtcNow

    EventRunStep.objects.filter(pk=step.pk).update(claimed_at=UtcNow() - timedelta(hours=1))
    assert execute_step(step).outcome == "done"


@pytestmark_world
def test_unknown_actions_and_terminal_runs_are_not_performed(world):  # W5
    run = new_run()
    assert execute_step(new_step(run, "nobody.knows")).outcome == "failed"
    cancelled = new_run(status="cancelled")
    result = execute_step(spawn_step(cancelled))
    assert result.outcome == "failed" and "cancelled" in result.error
    assert Creature.objects.count() == 0


# ── W6: leases ──


@pytestmark_world
def test_a_lease_reserves_its_row_before_writing_the_world(world):  # W6
    RegionSetting.objects.create(region="north", spawn_rate=1)
    run = new_run()
    result = execute_step(lease_step(run, "north", 5))
    assert (result.outcome, result.recorded) == ("done", 1)
    row = Res.get(run=run)
    assert (row.kind, row.ref, row.status, row.owner_module) == (
        "override",
        "world.spawn_rate#north",
        "confirmed",
        "world",
    )
    assert row.payload == {"baseline": 1, "applied": 5}
    assert RegionSetting.objects.get(region="north").spawn_rate == 5
    run.refresh_from_db()
    assert run.cleanup_status == "pending"


@pytestmark_world
def test_two_runs_leasing_one_region_one_is_refused_naming_the_other(world):  # W6
    RegionSetting.objects.create(region="north", spawn_rate=1)
    first, second = new_run(), new_run()
    assert execute_step(lease_step(first, "north", 5)).outcome == "done"
    refused = execute_step(lease_step(second, "north", 9))
    assert refused.outcome == "refused" and refused.holder_run_id == first.pk
    assert f"run {first.pk}" in refused.error
    assert RegionSetting.objects.get(region="north").spawn_rate == 5  # world untouched
    assert not Res.filter(run=second).exists()
    assert EventRunStep.objects.get(run=second).status == "refused"
    # Another region is free.
    assert execute_step(lease_step(second, "south", 9)).outcome == "done"


@pytestmark_world
def test_a_lease_of_no_registered_module_fails(world):  # W6
    run = new_run()
    result = execute_step(new_step(run, "core.lease", {"lease": "nobody.rate#x", "value": 1}))
    assert result.outcome == "failed" and "no module registers" in result.error


@pytestmark_world
def test_a_retried_lease_keeps_its_first_baseline(world, isolated_registry):  # W6
    from events_ledger import Lease
    from project.world import world as w

    calls = {"n": 0}

    def flaky_apply(value, *, target, run_id):
        w.set_rate(value, target=target, run_id=run_id)
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("answer lost")
        return {"ok": True}

    isolated_registry.leases.pop("world.spawn_rate")
    isolated_registry.register_lease(
        Lease(
            id="world.spawn_rate",
            owner="world",
            read=w.current_rate,
            apply=flaky_apply,
            restore=w.put_back,
        )
    )
    RegionSetting.objects.create(region="north", spawn_rate=1)
    run = new_run()
    step = lease_step(run, "north", 5)
    assert execute_step(step).outcome == "retry"
    assert Res.get(run=run).status == "pending"  # rule 1: the value may be applied
    assert execute_step(step).outcome == "done"
    assert Res.get(run=run).payload == {"baseline": 1, "applied": 5}


# ── W5: what a step costs; the claim's count ──


def _making(isolated_registry, things=None, calls=None) -> Action:
    """A ledger action whose answer names ``things``, or ``params["n"]`` things of its key."""

    def perform(*, run_id, params, idempotency_key):
        if calls is not None:
            calls.append(idempotency_key)
        refs = things or [f"{idempotency_key}-{i}" for i in range(params.get("n", 1))]
        return {"ok": True, "resources": [{"kind": "thing", "ref": ref} for ref in refs]}

    action = Action(
        id="t.make",
        owner="t",
        reversible="ledger",
        perform=perform,
        revert=lambda **k: {"ok": True},
    )
    isolated_registry.register_action(action)
    return action


def _statements(step) -> tuple[list[tuple[int, str]], int]:
    """The statements a step runs, each with the transaction it ran in (1, 2, ...; 0 for
    an autocommitted one), and the round trips they took. MariaDB's compound statement
    (``fastpath``) is read statement by statement; its ``START TRANSACTION`` opens a
    transaction and its ``COMMIT`` closes it, as ``atomic`` blocks do elsewhere."""
    seen: list[tuple[int, str]] = []
    blocks: list[object] = []
    trips = [0]
    manual: list[object | None] = [None]

    def wrapper(execute, sql, params, many, context):
        trips[0] += 1
        for part in sql.split(";\n"):
            word = part.split()[0].upper()
            if word == "START":
                manual[0] = object()
                blocks.append(manual[0])
                continue
            if word in ("COMMIT", "ROLLBACK", "IF"):
                # IF: MariaDB's compound statement commits or rolls back on the server.
                manual[0] = None
                continue
            if word in ("BEGIN", "SAVEPOINT", "RELEASE", "DECLARE", "SET", "END"):
                continue
            conn = context["connection"]
            block = conn.atomic_blocks[0] if conn.in_atomic_block else manual[0]
            if block is not None and all(b is not block for b in blocks):
                blocks.append(block)
            seen.append((next((i for i, b in enumerate(blocks, 1) if b is block), 0), word))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        result = execute_step(step)
    assert result.outcome == "done" and not result.rejected, result
    return seen, trips[0]


@pytestmark_world  # the step's own transactions, not a test's around them
def test_a_step_costs_two_transactions_of_fixed_statements_whatever_its_size(
    isolated_registry,
):  # W5, rule 1, performance
    _making(isolated_registry)
    run = new_run()
    # Durable moment 2: the outcome (which also checks the claim), the rows, the resolve.
    second = [(2, "UPDATE"), (2, "INSERT"), (2, "UPDATE")]
    fast = connection.vendor == "mysql" and connection.mysql_is_mariadb
    if connection.vendor == "postgresql":
        # The fast path (PostgreSQL, #27): each transaction one statement of CTEs, in
        # autocommit (the mark, the claim, the placeholder and the read back; then the
        # outcome, the rows and the resolve), decided by the server.
        first, dirty, second_pg, trips = [(0, "WITH")], [(0, "WITH")], [(0, "WITH")], 2
        statements, sent = _statements(new_step(run, "t.make", {"n": 1}))
        assert (statements, sent) == (first + second_pg, trips)
        statements, sent = _statements(new_step(run, "t.make", {"n": 50}, seq=1))
        assert (statements, sent) == (dirty + second_pg, trips)
        statements, sent = _statements(new_step(run, "t.make", {"n": 1}, seq=2).pk)
        assert (statements, sent) == ([(0, "SELECT"), *first, *second_pg], trips + 1)
        assert Res.filter(run=run, kind="thing", status="confirmed").count() == 52
        return
    if fast:
        # The fast path (MariaDB): the step passed (not its id) is not read first. In
        # one compound statement, mark the run dirty (a no-op once it is), claim,
        # insert the placeholder under the claim, read the step's attempts and
        # parameters back, and commit; the second transaction is one compound
        # statement too, which commits on the server.
        first = [(1, "UPDATE"), (1, "UPDATE"), (1, "INSERT"), (1, "SELECT")]
        dirty = first
        trips = 2
    else:
        # Durable moment 1: read the step and its run, mark the run dirty, claim,
        # placeholder.
        first = [(1, "SELECT"), (1, "UPDATE"), (1, "UPDATE"), (1, "INSERT")]
        # The run is dirty already, so its mark is not written again.
        dirty = [first[0], *first[2:]]
        trips = None
    statements, sent = _statements(new_step(run, "t.make", {"n": 1}))
    assert statements == first + second
    # 50 rows cost the same.
    statements, sent_50 = _statements(new_step(run, "t.make", {"n": 50}, seq=1))
    assert statements == dirty + second
    if trips is not None:
        assert sent == sent_50 == trips
    statements, sent = _statements(new_step(run, "t.make", {"n": 1}, seq=2).pk)
    if fast:
        # By its id, the step is read first (autocommitted); the compound statement
        # carries the run's mark always (it tells there whether the run has ended).
        assert statements == [(0, "SELECT"), *first, *second]
        assert sent == trips + 1
    else:
        assert statements == dirty + second  # the same, read in the first transaction
    assert Res.filter(run=run, kind="thing", status="confirmed").count() == 52


@pytest.mark.django_db
@pytest.mark.parametrize("bound,outcome,attempts", [(3, "done", 2), (1, "failed", 2)])
def test_a_claim_between_the_read_and_the_claim_is_counted(
    isolated_registry, monkeypatch, settings, bound, outcome, attempts
):  # W5, bounds: MAX_STEP_ATTEMPTS
    """Another worker claims the step and gives it back between this worker's read of
    the step and its claim: the claim, a compare-and-set on the count read, loses; the
    count is read again and the claim retried, so every claim counts towards the bound
    (a bound of 1 fails the step without a call, as a read-back count did)."""
    from events_ledger.querysets import EventRunStepQuerySet

    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "MAX_STEP_ATTEMPTS": bound}
    calls: list[str] = []
    _making(isolated_registry, calls=calls)
    step = new_step(new_run(), "t.make")
    read = EventRunStepQuerySet.with_run

    def read_then_another_worker_claims(self, pk):
        found = read(self, pk)
        token = EventRunStep.objects.claim(pk, step_ttl())
        assert EventRunStep.objects.settle(pk, token, "pending", "that worker's retry")
        return found

    monkeypatch.setattr(EventRunStepQuerySet, "with_run", read_then_another_worker_claims)
    result = execute_step(step)
    assert result.outcome == outcome
    assert len(calls) == (outcome == "done")
    step.refresh_from_db()
    assert (step.status, step.attempts) == (outcome, attempts)


@pytest.mark.django_db
def test_a_target_held_by_another_run_keeps_the_placeholder_and_the_step_says_so(
    isolated_registry,
):  # W3, W5
    """The step's outcome is written before its rows, as the answer reads; a row the
    database then skips (its target held by another run) corrects the text."""
    _making(isolated_registry, things=["x", "y"])
    other = new_run()
    assert Res.reserve(other, owner="t", kind="thing", ref="x").ok
    run = new_run()
    step = new_step(run, "t.make")
    result = execute_step(step)
    assert (result.outcome, result.recorded) == ("done", 1)
    assert result.rejected == [f"thing 'x' is already held by run {other.pk}"]
    assert "placeholder stays" in result.error
    step.refresh_from_db()
    assert (step.status, step.last_error) == ("done", result.error)
    assert Res.get(run=run, kind=STEP_KIND).status == "pending"
    assert Res.get(run=run, kind="thing").ref == "y"
    assert EventRunLog.objects.get(run=run, kind="step.done").detail["error"] == result.error


def test_registry_api_is_exported_from_the_package_root():  # S5
    import events_ledger

    assert registry.action("world.spawn").reversible == "ledger"
    found = registry.lease_for_ref("world.spawn_rate#dungeon-3")
    assert found.lease.id == "world.spawn_rate" and found.target == "dungeon-3"
    assert events_ledger.execute_step is execute_step
