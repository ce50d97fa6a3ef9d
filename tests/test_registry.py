"""The registry and its system checks (SPEC S5)."""

from __future__ import annotations

import pytest
from django.core import checks

from events_ledger import Action, AlreadyRegistered, Lease, NotRegistered, register_action, registry
from events_ledger.checks import check_registrations, check_settings


def ids(messages):
    return sorted(m.id for m in messages)


def test_registering_an_id_twice_raises(isolated_registry):  # S5
    register_action(Action(id="t.a", owner="t", perform=lambda **kw: {"ok": True}))
    with pytest.raises(AlreadyRegistered):
        register_action(Action(id="t.a", owner="t", perform=lambda **kw: {"ok": True}))
    isolated_registry.register_lease(
        Lease(id="t.rate", owner="t", read=int, apply=int, restore=int)
    )
    with pytest.raises(AlreadyRegistered):
        isolated_registry.register_lease(
            Lease(id="t.rate", owner="t", read=int, apply=int, restore=int)
        )


def test_unregister_and_isolation(isolated_registry):  # S5
    register_action(Action(id="t.b", owner="t", perform=lambda **kw: None))
    assert registry.action("t.b") is not None
    registry.unregister_action("t.b")
    assert registry.action("t.b") is None
    with pytest.raises(NotRegistered):
        registry.unregister_action("t.b")


def test_decorator_form(isolated_registry):  # S5
    @register_action(id="t.deco", owner="t", reversible="none")
    def perform(*, run_id, params, idempotency_key):
        return {"ok": True}

    assert registry.action("t.deco").perform is perform


def test_lease_refs_resolve_through_the_lease_id():  # S5, W1
    assert registry.lease_for_ref("world.spawn_rate").target is None
    assert registry.lease_for_ref("world.spawn_rate#dungeon-3").target == "dungeon-3"
    assert registry.lease_for_ref("world.nothing#x") is None
    assert registry.lease_for_ref("") is None


def test_event_actions_modules_are_found_at_start_up():  # S5
    # project/world/event_actions.py registered these without anything importing it.
    assert registry.action("world.spawn").revert is not None
    assert registry.action("core.lease").reversible == "override"
    assert registry.lease("world.spawn_rate") is not None


@pytest.mark.django_db  # SQLite's JSONField check asks the database what it supports
def test_the_shipped_registrations_pass_the_checks():  # S5
    assert check_registrations() == []
    assert [m for m in checks.run_checks() if m.id.startswith("events_ledger")] == []


@pytest.mark.parametrize(
    "action,expected",
    [
        (
            Action(id="t.c", owner="t", reversible="sometimes", perform=lambda **kw: None),
            ["events_ledger.E002"],
        ),
        (
            Action(id="t.c", owner="t", reversible="ledger", perform=lambda **kw: None),
            ["events_ledger.E003"],
        ),
        (Action(id="t.c", owner="t", reversible="none"), ["events_ledger.E005"]),
    ],
)
def test_checks_report_bad_actions(isolated_registry, action, expected):  # S5
    register_action(action)
    assert ids(check_registrations()) == expected


def test_checks_report_a_lease_without_restore(isolated_registry):  # S5
    isolated_registry.register_lease(Lease(id="t.rate", owner="t", read=int, apply=int))
    assert ids(check_registrations()) == ["events_ledger.E004"]


def test_a_duplicate_in_a_host_apps_module_is_a_check_error(
    isolated_registry, tmp_path, monkeypatch
):  # S5
    import sys

    from django.apps import apps

    pkg = tmp_path / "dupapp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "event_actions.py").write_text(
        "from events_ledger import Action, register_action\n"
        "register_action(Action(id='world.spawn', owner='dup', perform=lambda **kw: None))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.MonkeyPatch.context():
        from django.test.utils import modify_settings

        # Installing the app runs the ledger's ready(), which discovers it.
        with modify_settings(INSTALLED_APPS={"append": "dupapp"}):
            pass
    sys.modules.pop("dupapp.event_actions", None)
    sys.modules.pop("dupapp", None)
    errors = check_registrations()
    assert ids(errors) == ["events_ledger.E001"]
    assert "world.spawn" in errors[0].msg and "dupapp" in errors[0].msg
    assert apps.is_installed("dupapp") is False


@pytest.mark.parametrize(
    "value,key",
    [
        ({"MAX_REVERT_ATTEMPTS": 0}, "MAX_REVERT_ATTEMPTS"),
        ({"MAX_REVERT_ATTEMPTS": "3"}, "MAX_REVERT_ATTEMPTS"),
        ({"REVERT_CLAIM_TTL": -5}, "REVERT_CLAIM_TTL"),
        ({"RECONCILE_MAX_ORPHAN_FRACTION": 2}, "RECONCILE_MAX_ORPHAN_FRACTION"),
    ],
)
def test_a_wrong_setting_is_a_clear_check_error(settings, value, key):  # S4
    settings.EVENTS_LEDGER = value
    errors = check_settings()
    assert ids(errors) == ["events_ledger.E006"] and key in errors[0].msg


def test_an_unknown_setting_is_a_warning(settings):  # S4
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "MAX_REVERT_ATTEMPS": 3}
    assert ids(check_settings()) == ["events_ledger.W001"]


def test_settings_are_read_on_access(settings):  # S4
    from datetime import timedelta

    from events_ledger.conf import ledger_settings

    assert ledger_settings.REVERT_CLAIM_TTL == timedelta(minutes=15)
    settings.EVENTS_LEDGER = {**settings.EVENTS_LEDGER, "REVERT_CLAIM_TTL": 30}
    assert ledger_settings.REVERT_CLAIM_TTL == timedelta(seconds=30)


def test_each_setting_is_a_typed_attribute(settings):  # S4, #13
    from datetime import timedelta

    from events_ledger.conf import DEFAULTS, LedgerSettings, ledger_settings

    typed = {name for name, value in vars(LedgerSettings).items() if hasattr(value, "check")}
    assert typed == set(DEFAULTS)  # a key without its typed attribute, or one too many
    settings.EVENTS_LEDGER = {
        **settings.EVENTS_LEDGER,
        "CLEANUP_RUN_BATCH": 7,
        "STEP_CLAIM_TTL": 2.5,
    }
    assert ledger_settings.CLEANUP_RUN_BATCH == 7
    assert ledger_settings.STEP_CLAIM_TTL == timedelta(seconds=2.5)
    assert ledger_settings.RECONCILE_MAX_ORPHAN_FRACTION == 0.5
    assert ledger_settings.METRICS_TOKEN is None
    with pytest.raises(AttributeError):
        ledger_settings.CLEANUP_RUN_BACTH  # noqa: B018  (a misspelling is no setting)
