"""The console in a real browser (SPEC S3): an operator retries an incomplete run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from events_ledger.ledger import execute_step
from events_ledger.models import EventRun, EventRunResource
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
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(30_000)
            page.goto(f"{live_server.url}/admin/login/?next=/admin/events_ledger/eventrun/")
            page.fill("#id_username", "operator")
            page.fill("#id_password", "pw-operator")
            page.click("input[type=submit]")
            page.wait_for_url(runs)

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
            assert page.inner_text(".fieldBox.field-cleanup_pill .el-pill") == "complete"
            page.screenshot(path=str(ARTIFACTS / "run-after-retry.png"), full_page=True)
        finally:
            browser.close()

    run.refresh_from_db()
    assert run.cleanup_status == "complete"
    assert Creature.objects.count() == 0  # the world is restored
