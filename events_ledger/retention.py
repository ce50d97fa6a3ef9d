"""History kept as long as it is needed (#28): pruning finished runs that owe nothing,
archived first, in small batches beside the live ledger."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import stat
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
from .db import causal_reads, drop_if_dead, dropping_dead, in_transaction, ledger_db
from .models import EventRun, EventRunLog, EventRunResource, EventRunStep
from .states import RESOLVED_FOR_GOOD, RUN_TERMINAL, UNRESOLVED, CleanupStatus, StepStatus

#: Runs per batch, each batch one short transaction: its locks are held for one batch only.
DEFAULT_BATCH = 200
#: The most runs a batch may hold: its id lists stay under every backend's bind limit.
MAX_BATCH = 2000
#: How many runs a dry run names (the figures count them all).
NAMED = 100
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

    def __init__(self, using: str | None = None) -> None:
        self.using = ledger_db(using)

    def next_prunable(self, after: int, size: int, cutoff: datetime) -> list[int]:
        """The next ``size`` runs after id ``after`` that may go now, by id: a walk of the
        primary key read without a lock, so a whole prune reads each run once. Nothing
        about ids and times is assumed: a due run with a higher id than a young one
        (imported history, hosts whose clocks disagree) is found all the same (the walk
        once stopped at the first window of young runs, and skipped it for good)."""
        return list(
            self._may_go(cutoff)
            .filter(pk__gt=after)
            .order_by("pk")
            .values_list("pk", flat=True)[:size]
        )

    def _may_go(self, cutoff: datetime, ids: Sequence[int] | None = None) -> Any:
        # #28: terminal, owing nothing, ended before the cut-off (a run whose end was
        # never stamped: its last change), no unresolved row, no step in flight.
        rows = EventRunResource.objects.filter(run=OuterRef("pk"), status__in=UNRESOLVED)
        running = EventRunStep.objects.filter(run=OuterRef("pk"), status=StepStatus.RUNNING)
        runs = EventRun.objects.using(self.using)
        if ids is not None:
            runs = runs.filter(pk__in=list(ids))
        return (
            runs.filter(status__in=RUN_TERMINAL, cleanup_status__in=SETTLED)
            .alias(ended=Coalesce("finished_at", "updated_at"))
            .filter(ended__lt=cutoff)
            .filter(~Exists(rows), ~Exists(running))
        )

    def prunable(self, ids: Sequence[int], cutoff: datetime) -> list[int]:
        """Of ``ids``, the runs a prune may remove now, by id. A read without locks: what
        it answers is re-checked under the lock (``lock``) before anything goes."""
        return list(self._may_go(cutoff, ids).order_by("pk").values_list("pk", flat=True))

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
        return {name: qs._raw_delete(self.using) for name, qs in self._going(ids).items()}

    def _going(self, ids: Sequence[int]) -> dict[str, Any]:
        """What a prune of ``ids`` removes, table by table (children first)."""
        ids = list(ids)
        return {
            "log": EventRunLog.objects.using(self.using).filter(run_id__in=ids),
            "resources": EventRunResource.objects.using(self.using).filter(
                run_id__in=ids, status__in=RESOLVED_FOR_GOOD
            ),
            "steps": EventRunStep.objects.using(self.using)
            .filter(run_id__in=ids)
            .exclude(status=StepStatus.RUNNING),
            "runs": EventRun.objects.using(self.using).filter(pk__in=ids),
        }

    def count(self, ids: Sequence[int]) -> dict[str, int]:
        """What ``delete`` would remove now, counted (a dry run's figures)."""
        return {name: qs.count() for name, qs in self._going(ids).items()}

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


class ArchiveRefused(Exception):
    """The archive's path cannot be written as this ledger's archive (it cannot be opened,
    is not a regular file of ours, is not such an archive, or is damaged before its last
    batch). Raised before anything is deleted; the file is left as it was."""


@dataclass
class _Scan:
    """What lies from an offset of an archive on: its complete gzip members as (start,
    end) offsets, where damage begins (bytes that are no gzip member: not a torn write),
    and the file's size."""

    members: list[tuple[int, int]]
    damaged_at: int | None
    size: int

    @property
    def good(self) -> int:
        return self.members[-1][1] if self.members else -1


def _scan(fd: int, start: int = 0) -> _Scan:
    """Read gzip members from ``start`` to the end, in chunks (memory for one chunk). A
    member cut short at the end is a torn write; bytes zlib refuses are damage."""
    members: list[tuple[int, int]] = []
    consumed = begin = start
    inflater: Any = None
    buf = b""
    size = os.fstat(fd).st_size
    offset = start
    while True:
        if not buf:
            buf = os.pread(fd, 1 << 16, offset)
            offset += len(buf)
            if not buf:
                break
        if inflater is None:
            inflater, begin = zlib.decompressobj(31), consumed
        try:
            inflater.decompress(buf)
        except zlib.error:
            return _Scan(members, begin, size)
        if inflater.eof:
            used = len(buf) - len(inflater.unused_data)
            consumed += used
            members.append((begin, consumed))
            buf, inflater = inflater.unused_data, None
        else:
            consumed += len(buf)
            buf = b""
    return _Scan(members, None, size)


def _lines(data: bytes) -> list[dict[str, Any]]:
    out = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line]
    if not all(isinstance(d, dict) and d.get("v") == ARCHIVE_VERSION and "run" in d for d in out):
        raise ValueError("a line that is not a run of this ledger's archive")
    return out


def _open_own(path: Path, what: str) -> int:
    """Open (or create) ``path`` for reading and writing as a file of the ledger's own:
    never through a symbolic link, a regular file with one link, owned by this user.
    Created 0600: it holds every column of the runs it removes, the steps' params
    included (``_keep_private`` narrows an existing one, once it is known to be ours)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ArchiveRefused(f"cannot open the {what} {path}: {exc.strerror or exc}") from exc
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_nlink != 1:
        problem = f"has {st.st_nlink} links (another name could read it)"
    elif st.st_uid != os.geteuid():
        problem = "belongs to another user"
    if problem:
        os.close(fd)
        raise ArchiveRefused(f"the {what} {path} {problem}")
    return fd


def _keep_private(fd: int) -> None:
    if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
        os.fchmod(fd, 0o600)


def _fsync_dir(path: Path) -> None:
    """A file just created is durable only once its directory entry is."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Archive:
    """An archive being written: gzip members appended to one file, one per batch, each
    written and fsynced before its batch's delete commits. Locked (``flock``) for as
    long as it is open, so two prunes never write one file.

    Beside it, ``<name>.committed`` holds the offset where the last committed batch
    ends, fsynced after each commit: a prune starting again reads only what lies past
    it (one batch at most, whatever the archive's size), and never cuts what lies
    before it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.mark_path = self.path.with_name(self.path.name + ".committed")
        self._fd = _open_own(self.path, "archive")
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ArchiveBusy(f"another prune is writing {self.path}") from None
        #: The mark's descriptor, opened (and created) once the archive is known ours.
        self._mark: int | None = None
        try:
            self.committed = self._read_mark()
        except BaseException:
            self.close()
            raise
        #: The member written and not yet known to be committed: (offset, run ids).
        self.pending: tuple[int, list[int]] | None = None

    def close(self) -> None:
        if self._mark is not None:
            os.close(self._mark)
            self._mark = None
        os.close(self._fd)  # releases the lock

    def _read_mark(self) -> int | None:
        try:
            fd = os.open(self.mark_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None  # a new archive, or one written before the mark existed
        except OSError as exc:
            raise ArchiveRefused(f"cannot read {self.mark_path}: {exc.strerror or exc}") from exc
        try:
            text = os.pread(fd, 64, 0).strip()
        finally:
            os.close(fd)
        try:
            return int(text) if text else None
        except ValueError:
            raise ArchiveRefused(f"{self.mark_path} does not hold an offset") from None

    def _write_mark(self, offset: int) -> None:
        if self._mark is None:
            # The archive is ours (``recover`` read it): it is kept 0600 from here on,
            # and the mark and a new archive's name are made durable.
            _keep_private(self._fd)
            self._mark = _open_own(self.mark_path, "archive's committed offset")
            _keep_private(self._mark)
            _fsync_dir(self.path)
        data = str(offset).encode()
        os.ftruncate(self._mark, 0)
        os.pwrite(self._mark, data, 0)
        os.fsync(self._mark)
        self.committed = offset

    def _refuse(self, why: str) -> ArchiveRefused:
        return ArchiveRefused(
            f"{self.path} {why}; it is left as it is and nothing was deleted (move it aside, "
            "or name another archive)"
        )

    def recover(self, any_left: Callable[[list[int]], bool]) -> tuple[int, int]:
        """Make the file hold each removed run once, and only removed runs, cutting only
        what the last append can have left past the committed offset: a torn member (a
        prune killed while writing it), or the last whole member when any of its runs is
        still in the database (killed after writing it, before its delete committed: it
        is written again when those runs go). Anything else (damage before the end, a
        file that is not such an archive, one shorter than what was committed) is
        refused, the file unchanged. Answers (bytes of a torn member cut, runs taken out
        of the archive)."""
        size = os.fstat(self._fd).st_size
        committed = self.committed
        if committed is not None and size < committed:
            if size:
                raise self._refuse(
                    f"is shorter ({size} bytes) than its committed batches ({committed})"
                )
            committed = 0  # emptied by a rotation (copytruncate): a new archive
        if committed is None:
            # No mark yet: the whole file is read once, and must be an archive throughout.
            committed = 0
            scan = _scan(self._fd, 0)
            if scan.damaged_at is not None or (size and not scan.members):
                raise self._refuse("is not an events_ledger archive, or is damaged")
            if scan.members:
                self._check_lines(scan.members[0])
            # Every member but the last is committed; the last is decided below.
            if len(scan.members) > 1:
                committed = scan.members[-2][1]
        scan = _scan(self._fd, committed)
        if scan.damaged_at is not None:
            raise self._refuse(f"is damaged from byte {scan.damaged_at}")
        if len(scan.members) > 1:
            raise self._refuse(f"holds more than one batch past its committed offset {committed}")
        good = scan.good if scan.members else committed
        torn = size - good
        if torn:
            self._cut(good)
        dropped = 0
        if scan.members:
            start, end = scan.members[0]
            ids = [line["run"]["id"] for line in self._check_lines((start, end))]
            with causal_reads():  # Galera: another node's delete must be seen
                left = any_left(ids)
            if left:
                self._cut(start)
                dropped = len(ids)
                end = start
            self._write_mark(end)
        else:
            self._write_mark(committed)
        return torn, dropped

    def _check_lines(self, member: tuple[int, int]) -> list[dict[str, Any]]:
        start, end = member
        try:
            return _lines(os.pread(self._fd, end - start, start))
        except (ValueError, UnicodeDecodeError, OSError, EOFError) as exc:
            raise self._refuse(f"is not an events_ledger archive ({exc})") from exc

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

    def committed_now(self) -> None:
        """The pending member's batch committed: the mark moves past it."""
        if self.pending is not None:
            self._write_mark(os.fstat(self._fd).st_size)
            self.pending = None

    def settle(self, any_left: Callable[[list[int]], bool]) -> None:
        """The pending member's batch did not commit when any of its runs is still in
        the database: cut the member off (its runs go, and are written, again later)."""
        if self.pending is None:
            return
        offset, ids = self.pending
        with causal_reads():
            left = any_left(ids)
        if left:
            self._cut(offset)
        else:
            self._write_mark(os.fstat(self._fd).st_size)
        self.pending = None

    def _cut(self, offset: int) -> None:
        os.ftruncate(self._fd, offset)
        os.fsync(self._fd)


def read_archive(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every run an archive holds, one mapping each (``run``, ``steps``, ``resources``,
    ``log``), in the order they were removed. A torn last member (a prune killed while
    writing it; its runs were never deleted) is left out; damage before it raises
    ``ArchiveRefused``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        scan = _scan(fd)
        if scan.damaged_at is not None:
            raise ArchiveRefused(f"{path} is damaged from byte {scan.damaged_at}")
        for start, end in scan.members:
            yield from _lines(os.pread(fd, end - start, start))
    finally:
        os.close(fd)


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
    #: A dry run's first ``NAMED`` runs that would go, by id.
    run_ids: list[int] = field(default_factory=list)
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
            "run_ids": self.run_ids,
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
    using: str | None = None,
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
    using = ledger_db(using)
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be 1 to {MAX_BATCH}, not {batch}")
    cutoff = cutoff_for(older_than)
    if dry_run and archive is not None:
        raise ValueError("a dry run writes nothing: it takes no archive")
    history = History(using)
    started = time.monotonic()
    out: dict[str, Any] = {"runs": 0, "steps": 0, "resources": 0, "log": 0, "batches": 0}
    refused: list[int] = []
    named: list[int] = []
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
                ids = history.next_prunable(after, batch, cutoff)
                if not ids:
                    break
                after = ids[-1]
                if dry_run:
                    # The same figures a real prune reports (it said 0 steps, 0 rows),
                    # and which runs.
                    for key, n in history.count(ids).items():
                        out[key] += n
                    named.extend(ids[: max(0, NAMED - len(named))])
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
        run_ids=named,
        archive=str(archive) if archive is not None else None,
        archive_torn_bytes=torn,
        archive_runs_dropped=dropped,
        seconds=time.monotonic() - started,
        longest_batch_s=longest,
        **out,
    )


def _redacted(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The host's ``ARCHIVE_REDACT`` over each run's document (step params, payloads and
    errors may hold what must not sit in a file). A hook that loses a run's identity is
    refused before anything is written or deleted: the batch stays in the database."""
    redact = ledger_settings.ARCHIVE_REDACT
    if redact is None:
        return documents
    out = []
    for document in documents:
        run_id = document["run"]["id"]
        kept = redact(document)
        if not isinstance(kept, dict) or (kept.get("run") or {}).get("id") != run_id:
            raise ArchiveRefused(
                f"ARCHIVE_REDACT must answer each run's document with its run's id "
                f"(run {run_id}); nothing of this batch was archived or deleted"
            )
        out.append(kept)
    return out


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
            file.append(_redacted(history.documents(locked)))
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
        file.committed_now()  # the member stays, and the mark moves past it
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


def history_size(using: str | None = None) -> HistorySize:
    """The history's size in a few reads of indexes and statistics, never a scan."""
    using = ledger_db(using)
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
