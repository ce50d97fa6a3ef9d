"""The bench's no-op call: nothing in the world, an empty answer."""

from __future__ import annotations

from typing import Any


def noop(*, run_id: int | None = None, params: Any = None, idempotency_key: str = "") -> Any:
    return {"ok": True, "resources": []}


def noop_revert(*, run_id: int, resources: list[Any], idempotency_key: str) -> Any:
    return {"ok": True}
