"""The console in a real browser (SPEC S3): an operator retries an incomplete run."""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from events_ledger.ledger import execute_step
from events_ledger.models import EventRun, EventRunResource, EventRunStep
from project.world.models import Creature
from tests.helpers import new_run, spawn_step

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = "/usr/bin/chromium"  # Debian's package; Playwright never downloads a browser here
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# live_server serves from another thread, and the world's verbs run in worker threads:
# both need committed data.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def sync_playwright_or_skip():
    # `make test` installs both, so in CI a missing one is a failure, never a skip.
    missing = pytest.fail if os.environ.get("CI") else pytest.skip
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("the Python package playwright is not installed")
    if not Path(CHROMIUM).exists():
        missing(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    return sync_playwright


def logged_in(browser, url: str, after: str, scheme: str = "light"):
    """A page logged in as the test's operator, at ``after``."""
    page = browser.new_page(viewport={"width": 1280, "height": 900}, color_scheme=scheme)
    page.set_default_timeout(30_000)
    page.goto(f"{url}/admin/login/?next={after}")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "pw-operator")
    page.click("input[type=submit]")
    page.wait_for_url(f"{url}{after}")
    return page


def test_operator_retries_an_incomplete_run(live_server, world, django_user_model):  # S3, C4
    sync_playwright = sync_playwright_or_skip()
    run = new_run("Bat swarm", scope="south")
    assert execute_step(spawn_step(run, "south", 2)).outcome == "done"
    EventRun.objects.transition(run, "completed", from_="running")
    EventRunResource.objects.unresolved_for_run(run).update(
        revert_attempts=3, last_error="the shard refused: region locked"
    )
    EventRun.objects.filter(pk=run.pk).update(cleanup_status="incomplete")
    django_user_model.objects.create_superuser("operator", "operator@example.com", "pw-operator")
    assert Creature.objects.count() == 2
    ARTIFACTS.mkdir(exist_ok=True)
    runs = f"{live_server.url}/admin/events_ledger/eventrun/"

    # No ORM inside this block: Playwright's sync API runs an event loop in this thread,
    # and Django refuses database calls from an async context.
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = logged_in(browser, live_server.url, "/admin/events_ledger/eventrun/")

            page.click(f"#result_list a[href$='/eventrun/{run.pk}/change/']")
            banner = page.locator("#el-incomplete")
            banner.wait_for()
            assert "the shard refused: region locked" in banner.inner_text()
            page.screenshot(path=str(ARTIFACTS / "run-before-retry.png"), full_page=True)
            banner.locator("li a").first.click()  # "why is this stuck?" for the first row
            why = page.locator("#el-why")
            why.wait_for()
            text = why.inner_text()
            assert "world.spawn.revert(key=" in text and "3 of 3 automatic" in text
            page.screenshot(path=str(ARTIFACTS / "resource-why-stuck.png"), full_page=True)

            page.goto(runs)
            page.check(f"input[name=_selected_action][value='{run.pk}']")
            page.select_option("select[name=action]", "retry_cleanup")
            page.click("button[name=index]")
            page.wait_for_selector("text=Yes, retry cleanup")
            assert "world.spawn.revert(key=" in page.inner_text("#content")
            page.screenshot(path=str(ARTIFACTS / "retry-confirmation.png"), full_page=True)
            page.click("input[value='Yes, retry cleanup']")
            message = page.locator("ul.messagelist li").first
            message.wait_for()
            assert "cleanup complete" in message.inner_text()
            page.screenshot(path=str(ARTIFACTS / "runs-after-retry.png"), full_page=True)

            page.goto(f"{runs}{run.pk}/change/")
            assert page.locator("#el-incomplete").count() == 0
            assert page.inner_text(".fieldBox.field-cleanup_pill .el-pill") == "Complete"  # #25
            page.screenshot(path=str(ARTIFACTS / "run-after-retry.png"), full_page=True)
        finally:
            browser.close()

    run.refresh_from_db()
    assert run.cleanup_status == "complete"
    assert Creature.objects.count() == 0  # the world is restored


# The WCAG contrast of two CSS colours, computed in the page (#15: readable in dark mode).
CONTRAST_JS = """
([a, b]) => {
  const rgb = (css) => css.match(/[\\d.]+/g).slice(0, 3).map(Number);
  const lum = (c) => {
    const [r, g, b] = rgb(c).map((v) => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p);
  return (x + 0.05) / (y + 0.05);
}
"""


def _dashboard_world() -> tuple[EventRun, EventRun]:
    """Runs in every cleanup status, unresolved rows of three modules, a step in flight,
    and a run whose steps and rows make a timeline."""
    from django.utils import timezone

    from tests.factories import ResourceFactory, RunFactory, StepFactory
    from tests.helpers import new_step

    stuck = RunFactory(name="Wolf night", status="completed", cleanup_status="incomplete")
    ResourceFactory.create_batch(
        2, run=stuck, owner_module="world", revert_attempts=3, last_error="region locked"
    )
    ResourceFactory(run=stuck, owner_module="world", status="drifted", kind="override")
    ResourceFactory.create_batch(5, run=stuck, owner_module="banners", status="orphaned")
    ResourceFactory.create_batch(3, run=stuck, owner_module="shop")
    for cleanup_status in ("complete", "complete", "pending", "not_required"):
        RunFactory(status="completed", cleanup_status=cleanup_status)
    StepFactory(
        run=RunFactory(name="Owl watch"),
        action_id="world.slow_spawn",
        status="running",
        claimed_at=timezone.now(),
        claimed_by="worker-2:4242",
    )
    run = RunFactory(name="Boar hunt", status="cancelled", cleanup_status="pending")
    for seq, status in enumerate(("done", "done", "failed")):
        step = new_step(run, "world.spawn", seq=seq)
        EventRunStep.objects.filter(pk=step.pk).update(status=status, attempts=1)
        ResourceFactory(
            run=run, step=step, kind="creature", owner_module="world", status="reverted"
        )
        ResourceFactory(run=run, step=step, kind="creature", owner_module="world")
    return stuck, run


def test_operator_reads_the_dashboard_and_a_timeline_in_light_and_dark(
    live_server, django_user_model
):  # #15: dashboard, server-rendered SVG, readable in dark mode
    sync_playwright = sync_playwright_or_skip()
    stuck, timed = _dashboard_world()
    django_user_model.objects.create_superuser("operator", "operator@example.com", "pw-operator")
    ARTIFACTS.mkdir(exist_ok=True)

    # No ORM inside this block (Playwright's sync API runs an event loop in this thread).
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            for scheme in ("light", "dark"):
                page = logged_in(browser, live_server.url, "/admin/events_ledger/", scheme)
                page.locator("#el-dashboard").wait_for()
                assert "Needs a human" in page.inner_text("#el-health")
                assert f"run {stuck.pk}" in page.inner_text("#el-health")
                tiles = page.locator("#el-runs-by-cleanup .el-tile")
                assert tiles.count() == 4
                assert page.inner_text("a[data-status=incomplete] .el-tile-n") == "1"
                # One bar per module, longest first, each drawn with a width.
                owners = page.eval_on_selector_all(
                    "#el-unresolved-chart g.el-bar", "gs => gs.map(g => g.dataset.owner)"
                )
                assert owners == ["world", "banners", "shop"]
                widths = page.eval_on_selector_all(
                    "#el-unresolved-chart rect", "rs => rs.map(r => r.getBBox().width)"
                )
                assert len(widths) == 4 and all(w > 1 for w in widths)
                assert "world.slow_spawn" in page.inner_text("#el-in-flight")
                assert "worker-2:4242" in page.inner_text("#el-in-flight")
                assert "region locked" in page.inner_text("#el-oldest")
                # Readable: the labels' colour against the page, the bars against it too.
                background = page.evaluate("getComputedStyle(document.body).backgroundColor")
                label = page.eval_on_selector(
                    "#el-unresolved-chart .el-chart-label", "t => getComputedStyle(t).fill"
                )
                bars = page.eval_on_selector_all(
                    "#el-unresolved-chart rect",
                    "els => els.map(e => getComputedStyle(e).fill)",
                )
                dark_page = page.evaluate(CONTRAST_JS, [background, "rgb(0, 0, 0)"]) < 2
                assert dark_page == (scheme == "dark")
                assert page.evaluate(CONTRAST_JS, [label, background]) >= 4.5
                for fill in bars:  # graphics against the page: WCAG 1.4.11
                    assert page.evaluate(CONTRAST_JS, [fill, background]) >= 3, fill
                page.screenshot(path=str(ARTIFACTS / f"dashboard-{scheme}.png"), full_page=True)

                page.goto(f"{live_server.url}/admin/events_ledger/eventrun/{timed.pk}/change/")
                page.locator("#el-timeline svg").wait_for()
                lanes = page.eval_on_selector_all(
                    "#el-timeline g.el-lane",
                    "gs => gs.map(g => [g.classList.contains('el-lane-step'), g.dataset.status])",
                )
                assert lanes == [
                    [True, "done"],
                    [True, "done"],
                    [True, "failed"],
                    *[[False, s] for s in ("reverted", "confirmed") * 3],
                ]
                held = page.locator("#el-timeline rect.el-open")
                assert held.count() == 3  # the rows still held run to the right edge
                text = page.eval_on_selector(
                    "#el-timeline .el-chart-label", "t => getComputedStyle(t).fill"
                )
                assert page.evaluate(CONTRAST_JS, [text, background]) >= 4.5
                solid = page.eval_on_selector_all(
                    "#el-timeline rect:not(.el-open)", "rs => rs.map(r => getComputedStyle(r).fill)"
                )
                for fill in solid:
                    assert page.evaluate(CONTRAST_JS, [fill, background]) >= 3, fill
                page.locator("#el-timeline").screenshot(
                    path=str(ARTIFACTS / f"run-timeline-{scheme}.png")
                )
                page.close()
        finally:
            browser.close()


def _seconds_of_day(t: datetime | str) -> float:
    """A moment, or a tick's label ("10:20:37" or "10:20:37.4"), as seconds of its day."""
    if isinstance(t, datetime):
        return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6
    h, m, sec = t.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)


def _timeline_runs() -> dict[str, tuple[EventRun, datetime]]:
    """#25: three runs an hour old, each with what its timeline must draw well: (a) one
    that lasted about a second, its @step placeholders beside its rows; (b) one cancelled
    before its second step ran; (c) one whose cleanup gave up. Each with the moment of its
    last event, where its axis must end (not now, an hour later)."""
    from tests.factories import ResourceFactory, RunFactory, StepFactory

    t0 = (timezone.now() - timedelta(hours=1)).replace(microsecond=200_000)
    if _seconds_of_day(timezone.localtime(t0)) > 86_390:  # the axes stay in one day
        t0 -= timedelta(minutes=1)

    def at(ms: int) -> datetime:
        return t0 + timedelta(milliseconds=ms)

    def run(name: str, status: str, cleanup: str, end: int) -> EventRun:
        return RunFactory(
            name=name,
            status=status,
            cleanup_status=cleanup,
            created_at=at(0),
            started_at=at(20),
            finished_at=at(end),
            updated_at=at(end),
        )

    def step(r: EventRun, seq: int, status: str, start: int, end: int, action: str = "world.spawn"):
        return StepFactory(
            run=r,
            seq=seq,
            action_id=action,
            status=status,
            attempts=int(status != "pending"),
            created_at=at(start),
            updated_at=at(end),
        )

    def row(r: EventRun, s, ref: str, status: str, start: int, end: int, **kw):
        return ResourceFactory(
            run=r,
            step=s,
            kind=kw.pop("kind", "creature"),
            ref=ref,
            owner_module="world",
            status=status,
            created_at=at(start),
            updated_at=at(end),
            **kw,
        )

    # (a) About a second: two steps, their placeholders (@step, resolved), four creatures
    # given back within the second.
    quick = run("Quick raid", "completed", "complete", 1_000)
    for seq in range(2):
        s = step(quick, seq, "done", 40 + 450 * seq, 420 + 450 * seq)
        row(quick, s, f"{s.idempotency_key}", "reverted", 40 + 450 * seq, 900, kind="@step")
        for i in range(2):
            row(quick, s, f"wolf-{seq}{i}", "reverted", 60 + 450 * seq + 100 * i, 950 + 20 * i)
    # (b) Cancelled after its first step: the second never ran; everything given back.
    cancelled = run("Boar hunt", "cancelled", "complete", 2_500)
    s = step(cancelled, 0, "done", 40, 1_800)
    row(cancelled, s, "boar-1", "reverted", 300, 2_900)
    row(cancelled, s, "boar-2", "reverted", 900, 3_100)
    step(cancelled, 1, "pending", 50, 50, action="world.feast")
    # (c) Incomplete: the sweep gave up on two rows; one was given back.
    stuck = run("Wolf night", "completed", "incomplete", 3_000)
    s = step(stuck, 0, "done", 40, 2_000)
    row(stuck, s, "wolf-a", "reverted", 500, 4_000)
    for ref in ("wolf-b", "wolf-c"):
        row(stuck, s, ref, "confirmed", 800, 6_000, revert_attempts=3, last_error="region locked")
    return {
        "one-second": (quick, at(1_000)),
        "cancelled": (cancelled, at(3_100)),
        "incomplete": (stuck, at(6_000)),
    }


def test_timelines_of_a_short_a_cancelled_and_an_incomplete_run_read_well(
    live_server, django_user_model
):  # #25: the console seen in Chromium, light and dark
    sync_playwright = sync_playwright_or_skip()
    runs = _timeline_runs()
    django_user_model.objects.create_superuser("operator", "operator@example.com", "pw-operator")
    ARTIFACTS.mkdir(exist_ok=True)
    # Each run's last event, as seconds of the local day: where its axis must end.
    ends = {name: _seconds_of_day(timezone.localtime(last)) for name, (_, last) in runs.items()}

    # No ORM inside this block (Playwright's sync API runs an event loop in this thread).
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            for scheme in ("light", "dark"):
                page = logged_in(browser, live_server.url, "/admin/", scheme)
                for name, (run, _) in runs.items():
                    page.goto(f"{live_server.url}/admin/events_ledger/eventrun/{run.pk}/change/")
                    page.locator("#el-timeline svg").wait_for()
                    lanes = page.eval_on_selector_all(
                        "#el-timeline g.el-lane",
                        """gs => gs.map(g => {
                            const r = g.querySelector('rect');
                            return {
                              label: g.querySelector('text').textContent,
                              status: g.dataset.status,
                              open: r.classList.contains('el-open'),
                              x: r.getBBox().x, width: r.getBBox().width,
                              fill: getComputedStyle(r).fill,
                            };
                        })""",
                    )
                    ticks = page.eval_on_selector_all(
                        "#el-timeline .el-chart-tick", "ts => ts.map(t => t.textContent)"
                    )
                    plot = (
                        page.eval_on_selector("#el-timeline svg", "s => s.viewBox.baseVal.width")
                        - 230
                        - 16
                    )
                    # No @step placeholder rows, no hash labels: what the run changed.
                    assert not [x for x in lanes if "@step" in x["label"]], lanes
                    # The axis ends at the run's last event, not at now (an hour later).
                    # Its last tick is the first round value at or after that event.
                    marks = [_seconds_of_day(t) for t in ticks]
                    spacing = marks[-1] - marks[-2]
                    assert marks[-1] - spacing < ends[name] <= marks[-1], (name, ticks)
                    assert spacing <= 1 if name == "one-second" else spacing == 1, ticks
                    # A finished run draws nothing as still open; stuck rows are red.
                    if name == "one-second":
                        assert [x["label"] for x in lanes] == [
                            "#0 · world.spawn",
                            "#1 · world.spawn",
                            *[f"creature:wolf-{i}" for i in ("00", "01", "10", "11")],
                        ]
                        # Read, not slivers: the second the run lasted fills most of the axis.
                        left = min(x["x"] for x in lanes)
                        right = max(x["x"] + x["width"] for x in lanes)
                        assert right - left > plot * 0.75, (left, right, plot)
                        assert not [x for x in lanes if x["open"]]
                    elif name == "cancelled":
                        never = lanes[1]
                        assert never["label"] == "#1 · world.feast"
                        assert never["status"] == "cancelled" and not never["open"]
                        assert never["fill"] == "rgb(138, 138, 138)"  # grey, not held
                        # From its creation to its run's end (the mark), not open to now.
                        finish = page.eval_on_selector_all(
                            "#el-timeline line.el-mark", "ls => ls.map(l => l.x1.baseVal.value)"
                        )[-1]
                        assert abs(never["x"] + never["width"] - finish) < 1, (never, finish)
                        assert not [x for x in lanes if x["open"]]
                    else:
                        stuck = [x for x in lanes if x["status"] == "stuck"]
                        assert [x["label"] for x in stuck] == ["creature:wolf-b", "creature:wolf-c"]
                        assert {x["fill"] for x in stuck} == {"rgb(214, 69, 69)"}  # red
                        assert "creature:wolf-a" in [
                            x["label"] for x in lanes if x["status"] == "reverted"
                        ]
                    page.locator("#el-timeline").screenshot(
                        path=str(ARTIFACTS / f"timeline-{name}-{scheme}.png")
                    )
                page.close()
        finally:
            browser.close()
