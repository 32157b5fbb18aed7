"""The operators' dashboard in a real browser (Debian's chromium driven by Playwright) against
the real stack: log in, watch a task appear and finish without reloading, open a task, read a
failure's message.

`CONVEYOR_SCREENSHOTS=DIR` keeps the overview's and a task page's screenshots there (the
README's come from such a run).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from tests.e2e.conftest import Stack
from tests.support.gateway import Client, Platform

pytestmark = pytest.mark.timeout(180)
WAIT_MS = 30_000


def _chromium() -> str:
    found = os.environ.get("CONVEYOR_CHROMIUM") or shutil.which("chromium")
    if not found:  # make test installs it: a missing browser is a failure, not a skip
        pytest.fail("no chromium here: `make test` installs Debian's chromium")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 720})
    made = context.new_page()
    made.set_default_timeout(WAIT_MS)
    yield made
    context.close()


def _log_in(page: Page, url: str, operator: Client) -> None:
    page.goto(url)
    page.fill("#operator-id", operator.client_id)
    page.fill("#operator-secret", operator.secret)
    page.click("#login button[type=submit]")


def _shot(page: Page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("CONVEYOR_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name), full_page=True)


def test_a_client_cannot_log_in(stack: Stack, page: Page) -> None:
    _log_in(page, f"{stack.gateway.url}/ui/", stack.client)
    expect(page.locator("#login [role=alert]")).to_have_text("Wrong operator id or secret.")
    expect(page.locator("#services")).to_have_count(0)


def test_an_operator_watches_tasks_finish_and_reads_a_failure(
    stack: Stack, page: Page, platform: Platform, tmp_path: Path
) -> None:
    operator = platform.operator()
    stack.dispatcher("pod-ui")
    base = stack.gateway.url
    name = stack.service.name

    _log_in(page, f"{base}/ui/", operator)
    row = page.locator(f'#services tr[data-service="{name}"]')
    expect(row).to_be_visible()

    page.goto(f"{base}/ui/services/{name}")  # the credentials stay with the tab
    slow = stack.submit({"sleep": 2})
    task_row = page.locator(f'#tasks tr[data-task="{slow}"]')
    expect(task_row).to_be_visible()  # appeared without a reload
    expect(task_row.locator("[data-status]")).to_have_attribute(
        "data-status", "SUCCESS", timeout=WAIT_MS
    )

    failed = stack.submit({"sleep": 0, "mustSucceed": False})
    failure = page.locator(f'#failures tr[data-task="{failed}"]')
    expect(failure.locator("td.error")).to_have_text("Argh!")

    page.goto(f"{base}/ui/")
    expect(row.locator('[data-count="SUCCESS"]')).to_have_text("1")
    expect(row.locator('[data-count="FAILURE"]')).to_have_text("1")
    _shot(page, "dashboard-overview.png", tmp_path)

    page.goto(f"{base}/ui/services/{name}")
    failure.locator("a").click()
    expect(page).to_have_url(f"{base}/ui/tasks/{failed}")
    expect(page.locator("#error-message")).to_have_text("Argh!")
    expect(page.locator('[data-field="Client"]')).to_have_text(stack.client.client_id)
    expect(page.locator("#attempts tbody tr")).to_have_count(1)
    _shot(page, "dashboard-task.png", tmp_path)


def test_the_api_docs_render_with_no_way_out(stack: Stack, page: Page) -> None:
    """SPEC §3.4, OpenAPI at /docs: the page loaded Swagger UI from a CDN, so it stayed blank
    in a cluster (or on a machine) without the internet. Its files are the gateway's own now:
    with every request elsewhere refused, the operations still render."""
    base = stack.gateway.url
    elsewhere: list[str] = []

    def only_the_gateway(route: Route) -> None:
        if route.request.url.startswith(base):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_gateway)
    page.goto(f"{base}/docs")
    expect(page.locator(".opblock").first).to_be_visible()
    expect(page.get_by_text("Create a task").first).to_be_visible()
    assert elsewhere == []
