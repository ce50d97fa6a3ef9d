"""Pictures for the console (#15): a bar chart of the unresolved rows by module, and a run's
timeline, as geometry the templates draw in SVG on the server (no JavaScript).

Only numbers and the ledger's own words come out of here; the templates escape every
text. Colours come from CSS classes (``el-fill-<status>`` in the console's style), so the
pictures follow the admin's light and dark themes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Q
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.translation import gettext as _

from .conf import ledger_settings
from .models import EventRun, EventRunResource, EventRunStep
from .retention import HistorySize, history_size
from .states import HELD, STEP_KIND, UNRESOLVED, CleanupStatus, StepStatus
from .status import LedgerStatus, ModuleRows, duration

#: The one way the console writes a moment (#25): the run page, the timeline, the dashboard,
#: a row's page; in the current time zone, as Django's templates show it.
DATETIME_FORMAT = "Y-m-d H:i:s"
#: A tick of the timeline's axis under a day: the same, without the date.
TIME_FORMAT = "H:i:s"

#: Modules drawn in the bar chart; the rest are counted under it.
MAX_BARS = 12
#: Lanes of a run's timeline, steps first; the rest are counted under it.
MAX_STEP_LANES = 20
MAX_ROW_LANES = 40


# ── the bar chart ──


@dataclass(frozen=True)
class Segment:
    status: str
    count: int
    x: float
    width: float


@dataclass(frozen=True)
class Bar:
    owner: str
    total: int
    y: float
    segments: list[Segment]
    value_x: float


@dataclass(frozen=True)
class BarChart:
    width: int
    height: int
    label_width: int
    bar_height: int
    bars: list[Bar]
    statuses: list[str]
    #: Modules not drawn (beyond MAX_BARS), and their rows.
    more: int = 0
    more_rows: int = 0


def bar_chart(modules: Sequence[ModuleRows], width: int = 760) -> BarChart:
    """Unresolved rows by owner module, one bar each, stacked by status; the modules
    with most rows first, scaled to the largest."""
    label_width, value_width, row, bar_height = 170, 60, 28, 18
    ranked = sorted(modules, key=lambda m: (-m.total, m.owner))
    shown, hidden = ranked[:MAX_BARS], ranked[MAX_BARS:]
    plot = width - label_width - value_width
    largest = max((m.total for m in shown), default=0) or 1
    bars = []
    for i, module in enumerate(shown):
        x = float(label_width)
        segments = []
        for status in UNRESOLVED:
            n = module.by_status.get(status, 0)
            if not n:
                continue
            w = max(plot * n / largest, 2.0)  # a single row is still seen
            segments.append(Segment(status, n, round(x, 1), round(w, 1)))
            x += w
        bars.append(Bar(module.owner, module.total, i * row + 4, segments, round(x + 6, 1)))
    return BarChart(
        width=width,
        height=max(len(bars), 1) * row + 8,
        label_width=label_width,
        bar_height=bar_height,
        bars=bars,
        statuses=[s for s in UNRESOLVED if any(m.by_status.get(s) for m in shown)],
        more=len(hidden),
        more_rows=sum(m.total for m in hidden),
    )


# ── what earlier phases wait behind (C8) ──


@dataclass(frozen=True)
class Behind:
    """C8: a run's last phase with an unresolved row, given back first, and how many rows
    of its earlier phases wait behind it (what ``Group.behind`` says of one run)."""

    run_id: int
    phase: str
    rank: int
    #: Its unresolved rows.
    rows: int
    #: Every one of them has spent its attempts: stuck until a human retries.
    stuck: bool
    #: Unresolved rows of the run's earlier phases.
    waiting: int


def waiting_behind(run_ids: set[int]) -> dict[int, Behind]:
    """For each of these runs whose earlier phases wait behind a later one, that later
    phase: one GROUP BY over their unresolved rows, a range of the ``(run, status)``
    index each, so the dashboard names the phases of its few runs in one query however
    many they are (``plan_run`` would take a few per run). The rule is the planner's
    (``cleanup._mark_behind``): a row of no phase neither waits nor holds."""
    if not run_ids or not ledger_settings.GIVE_BACK_IN_ORDER:
        return {}
    spent = Q(revert_attempts__gte=ledger_settings.MAX_REVERT_ATTEMPTS) | Q(
        claim_count__gte=ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT
    )
    ranks: dict[int, list[dict[str, Any]]] = {}
    for row in (
        EventRunResource.objects.filter(
            run_id__in=sorted(run_ids), status__in=UNRESOLVED, phase_rank__isnull=False
        )
        .order_by()
        .values("run_id", "phase_rank")
        .annotate(n=Count("pk"), spent=Count("pk", filter=spent), phase=Max("step__phase"))
    ):
        ranks.setdefault(row["run_id"], []).append(row)
    out = {}
    for run_id, phases in ranks.items():
        if len(phases) < 2:
            continue  # one phase: nothing waits behind it
        top = max(phases, key=lambda p: p["phase_rank"])
        out[run_id] = Behind(
            run_id=run_id,
            phase=top["phase"] or f"#{top['phase_rank']}",
            rank=top["phase_rank"],
            rows=top["n"],
            stuck=top["spent"] == top["n"],
            waiting=sum(p["n"] for p in phases if p is not top),
        )
    return out


@dataclass(frozen=True)
class Overview:
    """The app index's dashboard: everything drawn from one snapshot."""

    status: LedgerStatus
    runs: list[tuple[str, str, int, str]]  # (key, label, runs, the run list's filter)
    chart: BarChart
    # (row, age, the later phase it waits behind or None: C8)
    oldest: list[tuple[EventRunResource, str, Behind | None]]
    running: list[tuple[EventRunStep, str]]  # (step, running for)
    max_age: str  # HEALTH_MAX_UNRESOLVED_AGE, as an operator reads it
    # #28: the history's size (runs, rows) and how old the oldest run kept is.
    history: HistorySize | None = None
    oldest_run: str = ""
    #: C8: the incomplete runs named whose earlier phases wait behind a later one.
    behind: list[Behind] = field(default_factory=list)


def overview(status: LedgerStatus) -> Overview:
    # C8: one query for the runs the dashboard names (incomplete, or holding an oldest
    # row), never one per run.
    behind = waiting_behind(
        {r.pk for r in status.incomplete} | {r.run_id for r in status.oldest_rows}
    )

    def waits(row: EventRunResource) -> Behind | None:
        b = behind.get(row.run_id)
        return b if b and row.phase_rank is not None and row.phase_rank < b.rank else None

    return Overview(
        status=status,
        # #25: the runs that need watching, each a range of the runs' index; finished
        # runs given back are history, listed (not counted) behind "all runs".
        runs=[
            ("in_flight", _("In flight"), status.runs_in_flight, "status__in=pending,running"),
            (
                "pending",
                _("Cleanup pending"),
                status.cleanup_pending,
                "cleanup_status__exact=pending&status__in=completed,cancelled,failed,missed",
            ),
            (
                "incomplete",
                _("Incomplete"),
                status.incomplete_runs,
                "cleanup_status__exact=incomplete",
            ),
        ],
        chart=bar_chart(status.modules),
        oldest=[(r, duration(status.age(r.created_at)), waits(r)) for r in status.oldest_rows],
        running=[(s, duration(status.age(s.updated_at))) for s in status.running_steps],
        max_age=duration(status.max_age.total_seconds()),
        history=(history := history_size()),
        oldest_run=duration(status.age(history.oldest_run_at)) if history.oldest_run_at else "",
        behind=[behind[r.pk] for r in status.incomplete if r.pk in behind],
    )


# ── a run's timeline ──


@dataclass(frozen=True)
class Lane:
    kind: str  # "step" or "resource"
    label: str
    status: str
    y: float
    x: float
    width: float
    #: Still going at the right edge (a held row, a step not settled).
    open: bool
    title: str


@dataclass(frozen=True)
class Timeline:
    width: int
    height: int
    left: int
    right: int
    lane_height: int
    lanes: list[Lane]
    ticks: list[tuple[float, str]]
    #: The run's start and end, as vertical lines.
    marks: list[tuple[float, str]] = field(default_factory=list)
    more_steps: int = 0
    more_rows: int = 0
    steps_y: float = 0
    rows_y: float | None = None


def run_timeline(
    run: EventRun,
    steps: Sequence[EventRunStep],
    rows: Sequence[EventRunResource],
    *,
    now: datetime | None = None,
    total_rows: int | None = None,
    width: int = 960,
    waiting: set[int] | frozenset[int] = frozenset(),
) -> Timeline:
    """A run's steps (created → settled) and its ledger rows (recorded → given back, or
    orphaned, drifted, or still held), on one time axis from the run's creation to its
    end (or now, while anything is still open). ``waiting``: rows that only wait behind a
    later phase (C8), drawn as such, not as stuck."""
    now = now or timezone.now()
    left, right, lane, head = 230, 16, 20, 26
    # #25: the @step placeholders are the ledger's bookkeeping, not what the run changed.
    rows = [r for r in rows if r.kind != STEP_KIND]
    shown_steps, shown_rows = list(steps)[:MAX_STEP_LANES], list(rows)[:MAX_ROW_LANES]
    ended = run.is_terminal
    # #25: a finished run's axis ends with its last event, not now: a row still held
    # after the run ended is drawn open to that edge, not stretched across the hours since.
    last = max(
        [
            run.finished_at or run.created_at,
            *(s.updated_at for s in shown_steps),
            *(r.updated_at for r in shown_rows),
        ]
    )
    edge = last if ended else now
    max_attempts = ledger_settings.MAX_REVERT_ATTEMPTS
    max_claims = ledger_settings.MAX_CLAIMS_WITHOUT_VERDICT
    phased = len({s.phase for s in shown_steps}) > 1

    def step_end(s: EventRunStep) -> tuple[datetime, bool]:
        done = s.status in (StepStatus.DONE, StepStatus.FAILED, StepStatus.REFUSED)
        if not done and ended and s.status == StepStatus.PENDING:
            # Never ran: its run ended first (cancelled). Not open: grey, from its creation
            # to its run's end, the wait that ended without it (#25).
            return max(run.finished_at or s.created_at, s.created_at), False
        return (s.updated_at if done else edge), not done

    def row_end(r: EventRunResource) -> tuple[datetime, bool]:
        held = r.status in HELD
        return (edge if held else r.updated_at), held

    def row_status(r: EventRunResource) -> str:
        # #25: a row the sweep has given up on (attempts or claims spent, or its run
        # incomplete) is stuck: red, not the amber of a row simply held.
        spent = r.is_spent(max_attempts, max_claims)
        if r.status in UNRESOLVED and r.pk in waiting and not spent:
            # C8: never tried, only waiting for a later phase to go first: not a failure.
            return "behind"
        stuck = r.status in UNRESOLVED and (spent or run.cleanup_status == CleanupStatus.INCOMPLETE)
        return "stuck" if stuck else r.status

    starts = [
        run.created_at,
        *(s.created_at for s in shown_steps),
        *(r.created_at for r in shown_rows),
    ]
    ends = [
        run.finished_at or run.created_at,
        *(step_end(s)[0] for s in shown_steps),
        *(row_end(r)[0] for r in shown_rows),
    ]
    t0, t1 = min(starts), max(ends)
    # Half a second at least (ticks every 0.1 s): a run of a few milliseconds is still
    # drawn on an axis a reader can count, and a run of a quarter second is not a sliver.
    if t1 - t0 < timedelta(milliseconds=500):
        t1 = t0 + timedelta(milliseconds=500)
    # #25: ticks on round values (every 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30 s, 1, 2, 5 min,
    # …), the axis widened to the ticks around it: a run of a second fills the axis.
    every = _tick_every((t1 - t0).total_seconds())
    t0 = _floor(t0, every)
    t1 = _floor(t1, every) + (every if _floor(t1, every) < t1 else timedelta(0))
    plot = width - left - right
    span = (t1 - t0).total_seconds()

    def x_of(t: datetime) -> float:
        return round(left + plot * min(max((t - t0).total_seconds() / span, 0.0), 1.0), 1)

    lanes: list[Lane] = []
    y = float(head)

    def add(
        kind: str, label: str, status: str, start: datetime, end: datetime, still: bool, title: str
    ) -> None:
        nonlocal y
        a, b = x_of(start), x_of(end)
        # At least 3 pixels: a life of a millisecond is still seen.
        lanes.append(Lane(kind, _cut(label, 34), status, y, a, max(b - a, 3.0), still, title))
        y += lane

    steps_y = y
    for s in shown_steps:
        end, still = step_end(s)
        never = ended and s.status == StepStatus.PENDING
        title = f"step #{s.seq} {s.action_id}: " + (
            f"never ran (the run was {run.status})"
            if never
            else f"{s.status}, attempt {s.attempts}; "
            f"{_when(s.created_at)} → {'still ' + s.status if still else _when(end)}"
        )
        status = "cancelled" if never else s.status
        # The phase too, in a run of several: seq starts again in each phase, and
        # "#0 · action" read three times.
        name = f"{s.phase} #{s.seq}" if phased else f"#{s.seq}"
        add("step", f"{name} · {s.action_id}", status, s.created_at, end, still, title)
    rows_y = None
    if shown_rows:
        y += 10 if shown_steps else 0
        rows_y = y
    for r in shown_rows:
        end, held = row_end(r)
        title = f"{r.owner_module} {r.kind}:{r.ref}: recorded {_when(r.created_at)}, " + (
            f"still {r.status}" if held else f"{r.status} {_when(end)}"
        )
        add("resource", f"{r.kind}:{r.ref}", row_status(r), r.created_at, end, held, title)
    count = round(span / every.total_seconds())
    tenths = every < timedelta(seconds=1)
    ticks = [(x_of(t0 + every * i), _tick(t0 + every * i, span, tenths)) for i in range(count + 1)]
    marks = []
    if run.started_at:
        marks.append((x_of(run.started_at), "started"))
    if run.finished_at:
        marks.append((x_of(run.finished_at), run.status))
    return Timeline(
        width=width,
        height=int(y) + 8,
        left=left,
        right=right,
        lane_height=lane,
        lanes=lanes,
        ticks=ticks,
        marks=marks,
        more_steps=max(len(steps) - len(shown_steps), 0),
        more_rows=max((total_rows if total_rows is not None else len(rows)) - len(shown_rows), 0),
        steps_y=steps_y,
        rows_y=rows_y,
    )


#: Tick spacings, milliseconds: round values a reader counts in.
_TICKS_MS = (
    *(100, 200, 500),
    *(1_000, 2_000, 5_000, 10_000, 15_000, 30_000),
    *(60_000, 120_000, 300_000, 600_000, 900_000, 1_800_000),
    *(3_600_000, 7_200_000, 10_800_000, 21_600_000, 43_200_000, 86_400_000),
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _tick_every(span: float) -> timedelta:
    """The smallest round spacing that gives at most 6 intervals over ``span`` seconds."""
    ms = next((t for t in _TICKS_MS if span * 1000 / t <= 6), None)
    if ms is None:  # more than 6 days: whole days
        ms = int(-(-span // 6 // 86400) or 1) * 86_400_000
    return timedelta(milliseconds=ms)


def _floor(t: datetime, every: timedelta) -> datetime:
    """``t`` down to a multiple of ``every`` (counted from the epoch, in UTC)."""
    return t - (t - _EPOCH) % every


def _tick(t: datetime, span: float, tenths: bool) -> str:
    """A tick's label: the time of day under a day (with tenths when the ticks are less
    than a second apart), the date and time beyond."""
    if not tenths:
        return _when(t, short=span < 86_400)
    return f"{_when(t, short=True)}.{timezone.localtime(t).microsecond // 100_000}"


def when(t: datetime | None, fmt: str = DATETIME_FORMAT) -> str:
    """A moment as the console writes it (#25: one format everywhere), "–" for none."""
    return date_format(timezone.localtime(t), fmt) if t else "–"


def _when(t: datetime, short: bool = False) -> str:
    return when(t, TIME_FORMAT if short else DATETIME_FORMAT)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
