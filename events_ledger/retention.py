"""History kept as long as it is needed (#28): pruning finished runs that owe nothing,
archived first, in small batches beside the live ledger."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, IntegrityError, connections
from django.db.models import Exists, Min, OuterRef
from django.db.models.functions import Coalesce
from django.utils import timezone

from .conf import ledger_settings
from .db import drop_if_dead, dropping_dead, in_transaction
from .models import EventRun, EventRunLog, EventRunResource, EventRunStep
from .states import RUN_TERMINAL, UNRESOLVED, CleanupStatus, ResourceStatus, StepStatus

#: Runs per batch, each batch one short transaction: its locks are held for one batch only.
DEFAULT_BATCH = 200
#: The most runs a batch may hold: its id lists stay under every backend's bind limit.
MAX_BATCH = 2000
#: The one archive format this module writes and reads.
ARCHIVE_VERSION = 1
#: Tables are counted exactly below this many rows, and estimated from the database's
#: statistics above it: a scrape never reads a table whole.
EXACT_BELOW = 10_000
#: A finished run that owes nothing: the only cleanup statuses a prune removes.
SETTLED = (CleanupStatus.COMPLETE.value, CleanupStatus.NOT_REQUIRED.value)


class NoRetention(Exception):
    """No ``--older-than`` and no ``RETENTION``: every run is kept for ever."""


class ArchiveBusy(Exception):
    """Another prune is writing this archive."""


# ── the SQL ──


class History:
    """The statements of retention, each one method stating what it guarantees (the
    querysets' habit; they live here, beside the one service that sends them)."""

    def __init__(self, using: str = "default") -> None:
        self.using = using

    def window(self, after: int, size: int) -> list[tuple[int, datetime]]:
        """The next ``size`` runs after id ``after``, with their creation times: a range
        of the primary key, read without a lock, so a walk costs each run one read."""
        return list(
            EventRun.objects.using(self.using)
            .filter(pk__gt=after)
            .order_by("pk")
            .values_list("pk", "created_at")[:size]
        )

    def _may_go(self, ids: Sequence[int], cutoff: datetime) -> Any:
        # #28: terminal, owing nothing, ended before the cut-off (a run whose end was
        # never stamped: its last change), no unresolved row, no step in flight.
        rows = EventRunResource.objects.filter(run=OuterRef("pk"), status__in=UNRESOLVED)
        running = EventRunStep.objects.filter(run=OuterRef("pk"), status=StepStatus.RUNNING)
        return (
            EventRun.objects.using(self.using)
            .filter(pk__in=list(ids), status__in=RUN_TERMINAL, cleanup_status__in=SETTLED)
            .alias(ended=Coalesce("finished_at", "updated_at"))
            .filter(ended__lt=cutoff)
            .filter(~Exists(rows), ~Exists(running))
        )

    def prunable(self, ids: Sequence[int], cutoff: datetime) -> list[int]:
        """Of ``ids``, the runs a prune may remove now, by id. A read without locks: what
        it answers is re-checked under the lock (``lock``) before anything goes."""
        return list(self._may_go(ids, cutoff).order_by("pk").values_list("pk", flat=True))

    def lock(self, ids: Sequence[int], cutoff: datetime) -> list[int]:
        """Inside the caller's transaction: lock ``ids`` in id order (FOR UPDATE: a row
        recorded for one of them meanwhile waits on its foreign key, then fails), then
        answer those that may still go, read after the lock, so a run that began owing
        something, or whose step was claimed, since ``prunable`` stays. SQLite: the
        transaction holds the file already (BEGIN IMMEDIATE)."""
        features = connections[self.using].features
        if features.has_select_for_update:
            ids = list(
                EventRun.objects.using(self.using)
                .filter(pk__in=list(ids), status__in=RUN_TERMINAL, cleanup_status__in=SETTLED)
                .order_by("pk")
                .select_for_update()
                .values_list("pk", flat=True)
            )
        return self.prunable(ids, cutoff) if ids else []

    def documents(self, ids: Sequence[int]) -> list[dict[str, Any]]:
        """Each run of ``ids`` whole, as one archive line: the run, its steps, its ledger
        rows and its log, every column, in id order."""
        runs = list(EventRun.objects.using(self.using).filter(pk__in=ids).order_by("pk").values())
        docs: dict[int, dict[str, Any]] = {
            r["id"]: {"v": ARCHIVE_VERSION, "run": r, "steps": [], "resources": [], "log": []}
            for r in runs
        }
        for key, model in (
            ("steps", EventRunStep),
            ("resources", EventRunResource),
            ("log", EventRunLog),
        ):
            for row in (
                model.objects.using(self.using).filter(run_id__in=ids).order_by("pk").values()
            ):
                docs[row["run_id"]][key].append(row)
        return [docs[r["id"]] for r in runs]

    def delete(self, ids: Sequence[int]) -> dict[str, int]:
        """Inside the caller's transaction, after ``lock``: remove the runs with their log,
        their released rows and their steps not in flight, by run id (each table's run
        index). An unresolved row or a running step is never deleted; one left behind
        makes the run's own DELETE fail on its foreign key, so the database itself
        refuses to drop a run that owes something."""
        ids = list(ids)
        counts = {
            "log": EventRunLog.objects.using(self.using).filter(run_id__in=ids),
            "resources": EventRunResource.objects.using(self.using).filter(
                run_id__in=ids, status=ResourceStatus.REVERTED
            ),
            "steps": EventRunStep.objects.using(self.using)
            .filter(run_id__in=ids)
            .exclude(status=StepStatus.RUNNING),
            "runs": EventRun.objects.using(self.using).filter(pk__in=ids),
        }
        return {name: qs._raw_delete(self.using) for name, qs in counts.items()}

    def any_left(self, ids: Sequence[int]) -> bool:
        """Whether any run of ``ids`` is still in the table (one read of the primary key)."""
        return bool(ids) and EventRun.objects.using(self.using).filter(pk__in=list(ids)).exists()

    def oldest_run(self) -> datetime | None:
        """When the oldest run kept was created: the lowest id, read at the end of the
        primary key (no scan)."""
        runs = EventRun.objects.using(self.using)
        first = runs.aggregate(first=Min("pk"))["first"]
        if first is None:
            return None
        return runs.filter(pk=first).values_list("created_at", flat=True).first()

    def rows(self, model: Any) -> tuple[int, bool]:
        """How many rows ``model``'s table holds, and whether that is exact: counted
        when it holds fewer than ``EXACT_BELOW`` (a read of at most that many entries of
        its smallest index, bounded by its LIMIT), else the database's own estimate
        (InnoDB's statistics, PostgreSQL's ``reltuples``, SQLite's ``sqlite_stat1``).
        Counted first: statistics go stale after a big prune, a bounded count does not."""
        table = model._meta.db_table
        with connections[self.using].cursor() as cursor:
            cursor.execute(
                f"SELECT COUNT(*) FROM (SELECT 1 FROM {table} LIMIT %s) AS t", [EXACT_BELOW]
            )
            (counted,) = cursor.fetchone()
        if counted < EXACT_BELOW:
            return counted, True
        return max(counted, self._estimate(table) or 0), False

    def _estimate(self, table: str) -> int | None:
        conn = connections[self.using]
        with conn.cursor() as cursor:
            if conn.vendor == "mysql":
                cursor.execute(
                    "SELECT TABLE_ROWS FROM information_schema.TABLES "
                    "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                    [table],
                )
            elif conn.vendor == "postgresql":
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)", [table]
                )
            elif conn.vendor == "sqlite":
                cursor.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sqlite_stat1'"
                )
                if cursor.fetchone() is None:
                    return None
                cursor.execute("SELECT stat FROM sqlite_stat1 WHERE tbl = %s", [table])
                stats = [int(str(s).split()[0]) for (s,) in cursor.fetchall() if s]
                return max(stats) if stats else None
            else:
                return None
            row = cursor.fetchone()
        # PostgreSQL answers -1 for a table never analysed: no estimate.
        return int(row[0]) if row and row[0] is not None and row[0] >= 0 else None


# ── the archive ──


def _members(path: Path) -> tuple[list[tuple[int, int]], int]:
    """The complete gzip members of an archive, as (start, end) offsets, and the file's
    size. Read in chunks: an archive of years costs memory for one chunk."""
    members: list[tuple[int, int]] = []
    consumed = start = 0
    inflater: Any = None
    buf = b""
    with open(path, "rb") as f:
        while True:
            if not buf:
                buf = f.read(1 << 16)
                if not buf:
                    break
            if inflater is None:
                inflater, start = zlib.decompressobj(31), consumed
            try:
                inflater.decompress(buf)
            except zlib.error:
                break  # garbage after the last good member: cut off like a torn write
            if inflater.eof:
                used = len(buf) - len(inflater.unused_data)
                consumed += used
                members.append((start, consumed))
                buf, inflater = inflater.unused_data, None
            else:
                consumed += len(buf)
                buf = b""
        size = f.seek(0, os.SEEK_END)
    return members, size


def _lines(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line]


class Archive:
    """An archive being written: gzip members appended to one file, one per batch, each
    written and fsynced before its batch's delete commits. Locked (``flock``) for as
    long as it is open, so two prunes never write one file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ArchiveBusy(f"another prune is writing {self.path}") from None
        #: The member written and not yet known to be committed: (offset, run ids).
        self.pending: tuple[int, list[int]] | None = None

    def close(self) -> None:
        os.close(self._fd)  # releases the lock

    def recover(self, any_left: Callable[[list[int]], bool]) -> tuple[int, int]:
        """Make the file hold each removed run once, and only removed runs: cut a torn
        last member (a prune killed while writing it), then the last whole member when
        any of its runs is still in the database (killed after writing it, before its
        delete committed: it is written again when those runs go). Answers (bytes of a
        torn member cut, runs taken out of the archive)."""
        members, size = _members(self.path)
        good = members[-1][1] if members else 0
        torn = size - good
        if torn:
            self._cut(good)
        dropped = 0
        if members:
            start, end = members[-1]
            with open(self.path, "rb") as f:
                f.seek(start)
                ids = [line["run"]["id"] for line in _lines(f.read(end - start))]
            if any_left(ids):
                self._cut(start)
                dropped = len(ids)
        return torn, dropped

    def append(self, documents: list[dict[str, Any]]) -> None:
        """Write one batch as a gzip member at the end, and fsync it: durable before the
        caller commits the delete (an interrupted prune loses nothing)."""
        text = "".join(
            json.dumps(d, cls=DjangoJSONEncoder, sort_keys=True) + "\n" for d in documents
        )
        data = gzip.compress(text.encode(), mtime=0)
        offset = os.lseek(self._fd, 0, os.SEEK_END)
        self.pending = (offset, [d["run"]["id"] for d in documents])
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)

    def settle(self, any_left: Callable[[list[int]], bool]) -> None:
        """The pending member's batch did not commit when any of its runs is still in
        the database: cut the member off (its runs go, and are written, again later)."""
        if self.pending is None:
            return
        offset, ids = self.pending
        if any_left(ids):
            self._cut(offset)
        self.pending = None

    def _cut(self, offset: int) -> None:
        os.ftruncate(self._fd, offset)
        os.fsync(self._fd)


def read_archive(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every run an archive holds, one mapping each (``run``, ``steps``, ``resources``,
    ``log``), in the order they were removed. A torn last member (a prune killed while
    writing it; its runs were never deleted) is left out."""
    members, _size = _members(Path(path))
    with open(path, "rb") as f:
        for start, end in members:
            f.seek(start)
            yield from _lines(f.read(end - start))


# ── the service ──


@dataclass(frozen=True)
class PruneReport:
    """What one prune did (or, dry, would do)."""

    cutoff: datetime
    dry_run: bool
    runs: int = 0
    steps: int = 0
    resources: int = 0
    log: int = 0
    batches: int = 0
    #: Runs the database refused to delete (a host's table points at them): kept.
    refused: list[int] = field(default_factory=list)
    archive: str | None = None
    #: Bytes of a torn member and runs of an uncommitted one cut from the archive at start.
    archive_torn_bytes: int = 0
    archive_runs_dropped: int = 0
    seconds: float = 0.0
    longest_batch_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "cutoff": self.cutoff.isoformat(),
            "dry_run": self.dry_run,
            "runs": self.runs,
            "steps": self.steps,
            "resources": self.resources,
            "log": self.log,
            "batches": self.batches,
            "refused": self.refused,
            "archive": self.archive,
            "archive_torn_bytes": self.archive_torn_bytes,
            "archive_runs_dropped": self.archive_runs_dropped,
            "seconds": round(self.seconds, 3),
            "longest_batch_s": round(self.longest_batch_s, 3),
        }


def cutoff_for(older_than: timedelta | None) -> datetime:
    """The cut-off: ``older_than`` (else ``RETENTION``) before now. NoRetention when
    neither is set: history is kept for ever."""
    keep = older_than if older_than is not None else ledger_settings.RETENTION
    if keep is None:
        raise NoRetention("RETENTION is not set and no --older-than was given: every run is kept")
    if keep <= timedelta(0):
        raise ValueError(f"the retention must be positive, not {keep}")
    return timezone.now() - keep


def prune(
    *,
    older_than: timedelta | None = None,
    batch: int = DEFAULT_BATCH,
    archive: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    using: str = "default",
    on_batch: Callable[[int], None] | None = None,
) -> PruneReport:
    """Remove the runs that ended before the cut-off, are terminal and owe nothing, with
    their steps, ledger rows and log (#28). Never a run that owes anything, is
    ``incomplete`` or still going, never an unresolved row, never a step in flight.

    The runs are walked by primary key, ``batch`` at a time; each batch is one short
    transaction (locked, re-checked, archived, deleted), retried on a deadlock. With
    ``archive``, each batch is written to it and fsynced before its delete commits; an
    archive left by a killed prune is repaired first, so it holds each removed run once.
    """
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be 1 to {MAX_BATCH}, not {batch}")
    cutoff = cutoff_for(older_than)
    if dry_run and archive is not None:
        raise ValueError("a dry run writes nothing: it takes no archive")
    history = History(using)
    started = time.monotonic()
    out: dict[str, Any] = {"runs": 0, "steps": 0, "resources": 0, "log": 0, "batches": 0}
    refused: list[int] = []
    longest = 0.0
    file = Archive(archive) if archive is not None else None
    torn = dropped = 0
    # A connection a fault killed is dropped: the host's next statement on this thread
    # reconnects instead of failing with "gone away" (#24).
    try:
        with dropping_dead(using):
            if file is not None:
                torn, dropped = file.recover(history.any_left)
            after = 0
            while True:
                window = history.window(after, batch)
                if not window:
                    break
                after = window[-1][0]
                older = [pk for pk, created in window if created < cutoff]
                if not older:
                    break  # every run from here on began after the cut-off
                ids = history.prunable(older, cutoff)
                if not ids:
                    continue
                if dry_run:
                    out["runs"] += len(ids)
                    continue
                began = time.monotonic()
                counts = _prune_batch(history, ids, cutoff, file, refused)
                longest = max(longest, time.monotonic() - began)
                for key, n in counts.items():
                    out[key] += n
                out["batches"] += 1
                if on_batch is not None:
                    on_batch(out["runs"])
    finally:
        if file is not None:
            file.close()
    return PruneReport(
        cutoff=cutoff,
        dry_run=dry_run,
        refused=refused,
        archive=str(archive) if archive is not None else None,
        archive_torn_bytes=torn,
        archive_runs_dropped=dropped,
        seconds=time.monotonic() - started,
        longest_batch_s=longest,
        **out,
    )


def _prune_batch(
    history: History,
    ids: list[int],
    cutoff: datetime,
    file: Archive | None,
    refused: list[int],
) -> dict[str, int]:
    def work() -> dict[str, int]:
        if file is not None:
            file.settle(history.any_left)  # an attempt a deadlock rolled back
        locked = history.lock(ids, cutoff)
        if not locked:
            return {}
        if file is not None:
            file.append(history.documents(locked))
        return history.delete(locked)

    try:
        counts = in_transaction(work, using=history.using)
    except IntegrityError:
        # A table of the host points at one of the runs: the database refuses its delete.
        # The batch is rolled back whole; its runs go one by one, the refused one stays.
        _settle_after_failure(history, file)
        if file is not None and file.pending is not None:
            # The database could not say whether the member's runs are still there:
            # only the next prune's ``recover`` may decide, and only while that member
            # is the archive's last (another batch appended after it would archive its
            # runs twice).
            raise
        if len(ids) == 1:
            refused.extend(ids)
            return {}
        counts = {}
        for pk in ids:
            for key, n in _prune_batch(history, [pk], cutoff, file, refused).items():
                counts[key] = counts.get(key, 0) + n
        return counts
    except DatabaseError:
        _settle_after_failure(history, file)
        raise
    if file is not None:
        file.pending = None  # committed: the member stays
    return {k: counts.get(k, 0) for k in ("runs", "steps", "resources", "log")}


def _settle_after_failure(history: History, file: Archive | None) -> None:
    """After a batch failed: its member is cut when its runs are still there. When the
    database cannot say (its connection died with the commit's answer), the member is
    left for the next prune's ``recover``, which asks again."""
    if file is None or file.pending is None:
        return
    try:
        file.settle(history.any_left)
    except DatabaseError as exc:
        drop_if_dead(exc, history.using)


# ── the history's size ──


@dataclass(frozen=True)
class HistorySize:
    """How much the ledger keeps, finished or not: what retention works down."""

    runs: int
    steps: int
    resources: int
    log: int
    #: Whether every figure was counted (small tables) rather than estimated.
    exact: bool
    oldest_run_at: datetime | None

    def tables(self) -> dict[str, int]:
        return {
            "runs": self.runs,
            "steps": self.steps,
            "resources": self.resources,
            "log": self.log,
        }


def history_size(using: str = "default") -> HistorySize:
    """The history's size in a few reads of indexes and statistics, never a scan."""
    history = History(using)
    counted = {
        name: history.rows(model)
        for name, model in (
            ("runs", EventRun),
            ("steps", EventRunStep),
            ("resources", EventRunResource),
            ("log", EventRunLog),
        )
    }
    return HistorySize(
        **{name: n for name, (n, _exact) in counted.items()},
        exact=all(exact for _n, exact in counted.values()),
        oldest_run_at=history.oldest_run(),
    )


__all__ = [
    "ARCHIVE_VERSION",
    "DEFAULT_BATCH",
    "MAX_BATCH",
    "Archive",
    "ArchiveBusy",
    "History",
    "HistorySize",
    "NoRetention",
    "PruneReport",
    "cutoff_for",
    "history_size",
    "prune",
    "read_archive",
]
