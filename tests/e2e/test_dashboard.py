"""The operators' dashboard in a real browser (Debian's chromium driven by Playwright) against
the real stack: log in, watch a task appear and finish without reloading, open a task, read a
failure's message.

`CONVEYOR_SCREENSHOTS=DIR` keeps the overview's and a task page's screenshots there (the
README's come from such a run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from tests.e2e.conftest import Stack
from tests.support.gateway import Client, GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes, free_port

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


def _drawn(page: Page, timeout: float = WAIT_MS) -> None:
    """The page drew itself from the API at least once (the indicator says when)."""
    expect(page.locator("#live")).to_have_text(re.compile(r"^live · "), timeout=timeout)


def _answers_within(page: Page) -> float:
    """Seconds the tab takes to run a trivial script: a tab blocked by its own drawing is slow."""
    started = time.monotonic()
    page.evaluate("1 + 1")
    return time.monotonic() - started


def test_a_deeply_nested_request_does_not_freeze_the_task_page(
    stack: Stack, page: Page, platform: Platform
) -> None:
    """A body within the limits (1 MiB, nesting < 128) pretty-printed to 130 M characters: the
    page took 20 s to draw it and stayed blocked, redrawing it every 2 s."""
    chain: Any = 0
    for _ in range(120):
        chain = [chain]
    raw = json.dumps({"body": {"sleep": 0, "d": [chain] * 4300}}, separators=(",", ":"))
    answer = stack.http.post(
        stack.gateway.tasks_url(stack.service.name),
        content=raw,
        headers={"Content-Type": "application/json"},
    )
    assert answer.status_code == 201, answer.text
    task_id = answer.json()["data"]["taskId"]

    _log_in(page, f"{stack.gateway.url}/ui/", platform.operator())
    _drawn(page)
    page.goto(f"{stack.gateway.url}/ui/tasks/{task_id}")
    _drawn(page, timeout=10_000)  # a frozen tab takes 15+ s
    shown = page.locator("#request pre")
    text = shown.text_content() or ""
    # still readable: compact, and capped; the body as accepted, its keys in their order
    assert text.startswith('{"sleep":0,"d":[[[['), text[:80]
    assert len(text) <= 200_000
    expect(page.locator("#request .omitted")).to_contain_text("characters not shown")

    shown.evaluate("pre => { pre.dataset.kept = 'yes'; }")
    time.sleep(5)  # two refreshes: the unchanged value keeps its node, nothing re-laid out
    assert _answers_within(page) < 3
    expect(shown).to_have_attribute("data-kept", "yes")
    _drawn(page)


def test_the_indicator_says_stale_while_the_gateway_does_not_answer(
    procs: Processes, database_url: str, amqp_url: str, page: Page, platform: Platform
) -> None:
    """A gateway that accepts connections but never answers (here SIGSTOPped) left the page
    saying `live`: its requests had no timeout, and the hung one held off every refresh."""
    gateway = GatewayProcess(procs, gateway_env(database_url, amqp_url), "gateway-frozen")
    _log_in(page, f"{gateway.url}/ui/", platform.operator())
    _drawn(page)
    live = page.locator("#live")
    gateway.proc.signal(signal.SIGSTOP)
    try:
        expect(live).to_have_class(re.compile(r"\bstale\b"), timeout=15_000)
        expect(live).to_have_text(re.compile(r"^not refreshed"))
    finally:
        gateway.proc.signal(signal.SIGCONT)
    _drawn(page, timeout=15_000)  # and back to live once it answers again
    expect(live).not_to_have_class(re.compile(r"\bstale\b"))


class _LongError(BaseHTTPRequestHandler):
    """A function failing every call with a 5,000-character message without a space."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        data = json.dumps({"errorMessage": "E" * 5000}).encode()
        self.send_response(422)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def long_error_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _LongError)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()


def test_a_long_error_message_stays_within_the_page(
    stack: Stack, page: Page, platform: Platform, long_error_url: str
) -> None:
    """An error message without spaces widened the page to 40,000 px (cells never broke it)."""
    stack.dispatcher("pod-long-error", FUNCTION_URL=long_error_url)
    failed = stack.submit({"sleep": 0})
    assert stack.finish(failed)["status"] == "FAILURE"
    base = stack.gateway.url

    _log_in(page, f"{base}/ui/", platform.operator())
    _drawn(page)
    for path in (f"/ui/services/{stack.service.name}", f"/ui/tasks/{failed}"):
        page.goto(base + path)
        expect(page.locator(".error", has_text="EEEE").first).to_be_visible()
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 1280, f"{path} is {width} px wide"


def test_the_pages_log_no_errors(stack: Stack, page: Page, platform: Platform) -> None:
    """Every page load logged a 404 for /favicon.ico: an error an operator (or a test) should
    never have to sort from real ones."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    task_id = stack.submit({"sleep": 0})
    base = stack.gateway.url

    _log_in(page, f"{base}/ui/", platform.operator())
    for path in ("/ui/", f"/ui/services/{stack.service.name}", f"/ui/tasks/{task_id}"):
        page.goto(base + path)
        _drawn(page)
        page.wait_for_timeout(1_000)  # the icon is asked for after the load; its error comes later
    assert errors == []


def test_a_page_of_a_task_or_service_that_does_not_exist_says_so(
    stack: Stack, page: Page, platform: Platform
) -> None:
    """Found by a black-box test: /ui/tasks/<unknown> and /ui/services/<unknown> kept
    `Loading…` in the page for good; only the small indicator said `not found`."""
    base = stack.gateway.url
    _log_in(page, f"{base}/ui/", platform.operator())
    _drawn(page)
    for path, said in (
        (f"/ui/tasks/{uuid.uuid4()}", "Task not found."),
        ("/ui/services/no-such-service", "Service not found."),
    ):
        page.goto(base + path)
        expect(page.locator("#main [role=alert]")).to_have_text(said)
        expect(page.locator("#main")).not_to_contain_text("Loading")
        expect(page.locator("#main a[href='/ui/']")).to_be_visible()
