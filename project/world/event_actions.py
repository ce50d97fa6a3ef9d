"""The demo world's registrations, found by events_ledger when Django starts."""

from events_ledger import Action, Lease, register_action, register_lease

from . import world

register_action(
    Action(
        id="world.spawn",
        owner="world",
        reversible="ledger",
        budget_ms=5_000,
        perform=world.spawn,
        revert=world.despawn,
        reconcile=world.still_there,
        description="spawn creatures in a region",
    )
)
register_action(
    Action(
        id="world.build_arena",
        owner="world",
        reversible="ledger",
        budget_ms=5_000,
        perform=world.build_arena,
        revert=world.take_down_arena,
        description="build an arena creatures can be spawned into (#26: taken down last)",
    )
)
register_action(
    Action(
        id="world.announce",
        owner="world",
        reversible="none",
        perform=world.announce,
        description="post an announcement",
    )
)
register_lease(
    Lease(
        id="world.spawn_rate",
        owner="world",
        read=world.current_rate,
        apply=world.set_rate,
        restore=world.put_back,
        description="a region's spawn rate (target: the region)",
    )
)
