"""Prometheus metrics (#15): the ledger's state read from the database at scrape time, and
counters of what this process did.

``LedgerCollector`` reads ``status.snapshot()`` at every scrape (three queries, whatever
the size of the tables) and the history's size (up to six more, each bounded), so every
process and host that serves it reports the same numbers. Hosts that already expose metrics register it themselves::

    from prometheus_client import REGISTRY
    from events_ledger.metrics import LedgerCollector

    REGISTRY.register(LedgerCollector())

The process counters (reverts, failures, fenced verdicts, seconds per module call) live
in prometheus_client's default registry, kept by the app's signals and the module-call
hook, never by code at the call sites. prometheus_client is optional (the ``metrics``
extra): this module imports it only when asked for a metric.
"""

from __future__ import annotations

import hmac
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from django.core.exceptions import ImproperlyConfigured

PREFIX = "events_ledger"
#: Seconds a module call takes: from a quick HTTP call to a long restore.
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
INSTALL_HINT = "pip install 'django-events-ledger[metrics]'"


def counters_available() -> bool:
    return importlib.util.find_spec("prometheus_client") is not None


def prometheus() -> Any:
    """prometheus_client, or ImproperlyConfigured saying how to get it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"events_ledger's metrics need prometheus_client: {INSTALL_HINT}"
        ) from exc
    return prometheus_client


# ── who may read them (the metrics view, and the health check's details) ──

#: What a session needs to read the metrics: what the dashboard needs (#25).
VIEW_PERMISSION = "events_ledger.view_eventrun"


def _bearer(request: Any) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def token_matches(request: Any) -> bool | None:
    """None without a bearer token; else whether it equals ``METRICS_TOKEN`` (compared in
    constant time; never, when the setting is not set)."""
    token = _bearer(request)
    if token is None:
        return None
    from django.core.exceptions import ImproperlyConfigured

    from .conf import ledger_settings

    try:
        expected = ledger_settings.METRICS_TOKEN
    except ImproperlyConfigured:
        # A wrong setting (the system check names it) lets no token in; it is no 500.
        return False
    return expected is not None and hmac.compare_digest(token.encode(), expected.encode())


def may_view(user: Any) -> bool:
    """An active staff user with the permission to view runs (the console's own)."""
    return bool(
        user is not None and user.is_active and user.is_staff and user.has_perm(VIEW_PERMISSION)
    )


# ── the database, at scrape time ──


class LedgerCollector:
    """A custom collector: where the ledger stands, read when Prometheus scrapes."""

    def __init__(self) -> None:
        prometheus()  # fail here, clearly, not at the first scrape

    def describe(self) -> Iterator[Any]:
        # Names without samples: registering reads no database (a registry with
        # auto_describe would otherwise call collect() at registration).
        yield from self._families()

    def collect(self) -> Iterator[Any]:
        from .status import snapshot

        started = time.monotonic()
        status = snapshot()
        families = self._families()
        runs, unresolved, oldest, poison, spent, steps, stale, step_age, healthy, took = families
        by_cleanup: dict[tuple[str, str], int] = {}
        for (cleanup_status, run_status), n in status.runs.items():
            key = (cleanup_status, "true" if run_status in _terminal() else "false")
            by_cleanup[key] = by_cleanup.get(key, 0) + n
        for cleanup_status in _cleanup_statuses():
            for finished in ("true", "false"):
                if finished == "true" and cleanup_status in _HISTORY:
                    continue  # #25: history, not counted (it only grows)
                runs.add_metric(
                    [cleanup_status, finished], by_cleanup.get((cleanup_status, finished), 0)
                )
        for module in status.modules:
            for row_status, n in module.by_status.items():
                unresolved.add_metric([module.owner, row_status], n)
            oldest.add_metric([module.owner], status.age(module.oldest) or 0.0)
            poison.add_metric([module.owner], module.poison)
            spent.add_metric([module.owner], module.spent)
        for action in status.steps:
            steps.add_metric([action.action], action.in_flight)
            stale.add_metric([action.action], action.stale)
            if action.oldest is not None:
                step_age.add_metric([action.action], status.age(action.oldest) or 0.0)
        healthy.add_metric([], 1 if status.healthy else 0)
        took.add_metric([], time.monotonic() - started)
        yield from families

    def _families(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        def gauge(name: str, text: str, labels: list[str] | None = None) -> Any:
            return GaugeMetricFamily(f"{PREFIX}_{name}", text, labels=labels or [])

        return [
            gauge(
                "runs",
                "Runs by cleanup status, and whether the run has finished (a finished run "
                "whose cleanup is pending is the sweep's backlog). Finished runs whose cleanup "
                "is complete or not required are history and not counted.",
                ["cleanup_status", "finished"],
            ),
            gauge(
                "unresolved_resources",
                "Ledger rows not given back yet (held, orphaned or drifted), by owner module "
                "and status.",
                ["owner", "status"],
            ),
            gauge(
                "oldest_unresolved_resource_age_seconds",
                "Age of the oldest unresolved ledger row, by owner module.",
                ["owner"],
            ),
            gauge(
                "poison_resources",
                "Unresolved rows claimed without a verdict (their sweeper died or hung), by "
                "owner module.",
                ["owner"],
            ),
            gauge(
                "spent_resources",
                "Unresolved rows the sweep will not try again (attempts or claims spent): "
                "they wait for a human's retry.",
                ["owner"],
            ),
            gauge(
                "steps_in_flight",
                "Steps a call of which may still change the world (claim kept fresh), by action.",
                ["action"],
            ),
            gauge(
                "steps_stale_claims",
                "Running steps whose claim went stale (their process died), by action.",
                ["action"],
            ),
            gauge(
                "oldest_step_in_flight_age_seconds",
                "How long the oldest call in flight has been running, by action.",
                ["action"],
            ),
            gauge(
                "healthy",
                "1 when no run is incomplete and no unresolved row is older than "
                "HEALTH_MAX_UNRESOLVED_AGE, else 0 (the health check's verdict).",
            ),
            gauge("collect_duration_seconds", "Seconds this scrape spent reading the ledger."),
        ]


class HistoryCollector:
    """#28: the history's size, a collector of its own beside ``LedgerCollector`` (whose
    scrape reads no history, #25): rows kept by table, counted below
    ``retention.EXACT_BELOW`` and estimated from the database's statistics above, and the
    oldest run's age. A few reads of indexes and statistics, never a table's scan."""

    def __init__(self) -> None:
        prometheus()

    def describe(self) -> Iterator[Any]:
        yield from self._families()

    def collect(self) -> Iterator[Any]:
        from django.utils import timezone

        from .retention import history_size

        rows, oldest = families = self._families()
        history = history_size()
        for table, n in history.tables().items():
            rows.add_metric([table], n)
        if history.oldest_run_at is not None:
            age = (timezone.now() - history.oldest_run_at).total_seconds()
            oldest.add_metric([], max(age, 0.0))
        yield from families

    def _families(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        return [
            GaugeMetricFamily(
                f"{PREFIX}_history_rows",
                "Rows the ledger keeps, finished or not, by table (runs, steps, resources, "
                "log): counted below 10,000, the database's estimate above. prune_ledger "
                "works it down.",
                labels=["table"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_oldest_run_age_seconds",
                "Age of the oldest run kept, finished or not: about RETENTION plus the "
                "interval between prunes while pruning keeps up.",
            ),
        ]


#: Cleanup statuses of a finished run that owes nothing: history, never counted (#25).
_HISTORY = ("complete", "not_required")


def _terminal() -> tuple[str, ...]:
    from .states import RUN_TERMINAL

    return RUN_TERMINAL


def _cleanup_statuses() -> list[str]:
    from .models import EventRun

    return list(EventRun.CleanupStatus.values)


# ── what this process did ──


class _Counters:
    def __init__(self, pc: Any) -> None:
        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Any:
            return pc.Counter(f"{PREFIX}_{name}", text, labels)

        self.reverted = counter("resources_reverted", "Resources this process gave back.")
        self.failed = counter(
            "revert_failures",
            "Resources whose give-back failed in this process (the module refused, raised, "
            "timed out or answered no envelope; a collision with another run's hold).",
        )
        self.drifted = counter(
            "resources_drifted", "Lease rows this process found drifted (another value in place)."
        )
        self.fenced = counter(
            "fenced_verdicts",
            "Verdicts this process did not write: another sweeper had taken the claim over.",
        )
        self.incomplete = counter(
            "cleanups_incomplete", "Runs whose cleanup this process left incomplete."
        )
        self.steps_failed = counter(
            "steps_failed", "Steps this process failed for good, by action.", ("action",)
        )
        self.late = counter(
            "late_answers",
            "Step answers this process recorded after cleanup had given their placeholder "
            "back (the order of giving back was broken after the fact), by action.",
            ("action",),
        )
        self.orphaned = counter(
            "resources_orphaned", "Rows this process's reconcile orphaned, by owner.", ("owner",)
        )
        self.call_seconds = pc.Histogram(
            f"{PREFIX}_module_call_seconds",
            "Seconds a module call (perform, revert, restore, reconcile, a lease's read or "
            "apply) took in this process, by call and whether it answered or raised; a "
            "call past its deadline is observed when it ends.",
            ("call", "outcome"),
            buckets=CALL_BUCKETS,
        )
        self.overdue = counter(
            "module_calls_overdue",
            "Module calls of this process that outlived their deadline, by call.",
            ("call",),
        )

    # Receivers: each gets what its signal sends (see events_ledger.signals).

    def on_cleanup_worked(self, sender: Any, summary: Any, **kwargs: Any) -> None:
        self.reverted.inc(summary.reverted)
        self.failed.inc(summary.failed)
        self.drifted.inc(summary.drifted)
        self.fenced.inc(summary.fenced)

    def on_cleanup_incomplete(self, sender: Any, summary: Any = None, **kwargs: Any) -> None:
        if summary is not None:  # the repair's summaries were left by another pass
            self.incomplete.inc()

    def on_step_failed(self, sender: Any, step: Any, **kwargs: Any) -> None:
        self.steps_failed.labels(step.action_id).inc()

    def on_late_answer(self, sender: Any, step: Any, **kwargs: Any) -> None:
        self.late.labels(step.action_id).inc()

    def on_orphaned(self, sender: Any, owner: str, resources: Any, **kwargs: Any) -> None:
        self.orphaned.labels(owner).inc(resources.count())

    def on_call(self, what: str, seconds: float, outcome: str) -> None:
        if outcome == "overdue":
            self.overdue.labels(what).inc()
        else:
            self.call_seconds.labels(what, outcome).observe(seconds)


_counters: _Counters | None = None
_install_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _install_lock
    _install_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def install() -> None:
    """Create the process counters in prometheus_client's default registry and connect
    them to the signals and the module-call hook; once per process."""
    global _counters
    with _install_lock:
        if _counters is not None:
            return
        from . import signals
        from .deadline import call_observers

        counters = _Counters(prometheus())
        uid = "events_ledger.metrics"
        signals.cleanup_worked.connect(counters.on_cleanup_worked, dispatch_uid=uid, weak=False)
        signals.cleanup_incomplete.connect(
            counters.on_cleanup_incomplete, dispatch_uid=uid, weak=False
        )
        signals.step_failed.connect(counters.on_step_failed, dispatch_uid=uid, weak=False)
        signals.resources_orphaned.connect(counters.on_orphaned, dispatch_uid=uid, weak=False)
        signals.late_answer.connect(counters.on_late_answer, dispatch_uid=uid, weak=False)
        call_observers.append(counters.on_call)
        _counters = counters


# ── the exposition ──


class _DefaultRegistry:
    """This process's counters from prometheus_client's default registry, served beside
    the collector. Only the ledger's own families (#25): the default registry's
    ``python_info``, ``process_*`` and ``python_gc_*`` describe whichever web process
    answered and tell the reader its versions; a host that wants them serves its own
    registry."""

    def collect(self) -> Iterator[Any]:
        for family in prometheus().REGISTRY.collect():
            if family.name.startswith(f"{PREFIX}_"):
                yield family


def exposition_registry() -> Any:
    """The registry the metrics view serves: the collector, and this process's counters
    (all processes' counters in prometheus_client's multiprocess mode, when
    ``PROMETHEUS_MULTIPROC_DIR`` is set, as under gunicorn)."""
    pc = prometheus()
    registry = pc.CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector())
    registry.register(HistoryCollector())  # #28
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_DefaultRegistry())
    return registry


def render(accept: str | None) -> tuple[bytes, str]:
    """The exposition in the format the scraper asked for (text or OpenMetrics)."""
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(accept or "")
    return encoder(exposition_registry()), content_type
