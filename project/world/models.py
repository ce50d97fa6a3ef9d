"""The demo world: a small stand-in for a game server's state."""

from __future__ import annotations

from django.db import models


class Creature(models.Model):
    serial = models.CharField(max_length=32, unique=True)
    kind = models.CharField(max_length=32)
    region = models.CharField(max_length=32)
    # The world's own record of which request made it: how `revert(key, [])` finds
    # what a step whose answer was lost spawned.
    spawned_by = models.CharField(max_length=64, db_index=True)

    def __str__(self) -> str:
        return f"{self.kind} {self.serial} in {self.region}"


class Arena(models.Model):
    """#26: a place creatures are spawned into (their region is its name). It cannot be
    taken down while a creature stands in it: the dependency an event's phases have."""

    name = models.CharField(max_length=32, unique=True)
    built_by = models.CharField(max_length=64, db_index=True)

    def __str__(self) -> str:
        return f"arena {self.name}"


class RegionSetting(models.Model):
    region = models.CharField(max_length=32, unique=True)
    spawn_rate = models.IntegerField(default=1)

    def __str__(self) -> str:
        return f"{self.region}: {self.spawn_rate}"


class Announcement(models.Model):
    text = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)


class Switch(models.Model):
    """A fault to inject, seen by every process (tests, demo, the cron command)."""

    name = models.CharField(max_length=64, primary_key=True)
    value = models.JSONField(null=True)


class Call(models.Model):
    """Every revert the world was asked for: what the tests and the demo count."""

    verb = models.CharField(max_length=32)
    idempotency_key = models.CharField(max_length=64, blank=True, default="")
    refs = models.JSONField(default=list)
    pid = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
