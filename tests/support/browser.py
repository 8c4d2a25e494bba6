"""A real headless browser for the tests: Debian's chromium driven by Playwright.

``.ci/run`` installs Debian's ``chromium``; Playwright (the ``test`` extra) brings its own
driver and never downloads a browser: it drives ``/usr/bin/chromium`` (or the executable named
by ``GEODEBOT_CHROMIUM``) through ``executable_path``. A missing browser fails the test.

Fixtures (registered for every test by tests/conftest.py):

- ``browser``: one chromium per test module, started headless with a fresh profile in a
  temporary directory (Playwright makes one per launch and removes it on close).
- ``tab``: a fresh browser context and page per test (:class:`Tab`), at a fixed viewport.
  Every request that is not to 127.0.0.1 is aborted and recorded; the test fails at teardown
  if one was attempted and not taken with :meth:`Tab.take_blocked`. An uncaught script error
  on a page of the context fails it alike.

Playwright's objects belong to the event loop they were made on, so a module that uses these
fixtures runs its tests, and its own async fixtures, on the module's loop::

    pytestmark = pytest.mark.asyncio(loop_scope="module")

    @pytest_asyncio.fixture(loop_scope="module")
    async def server() -> AsyncIterator[...]: ...

A function-scoped async fixture without ``loop_scope="module"`` runs on a loop of its own that
is idle while the test runs: a server started there never answers the browser.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

if TYPE_CHECKING:
    from playwright.async_api import (
        Browser,
        BrowserContext,
        Page,
        Route,
        ViewportSize,
        WebError,
        WebSocketRoute,
    )

CHROMIUM_ENV = "GEODEBOT_CHROMIUM"
DEFAULT_CHROMIUM = "/usr/bin/chromium"
ALLOWED_HOST = "127.0.0.1"
# Screenshots are compared across runs and machines: one size, one pixel ratio, one clock.
VIEWPORT: ViewportSize = {"width": 1280, "height": 800}
# Where the console's screenshots go: the README's pictures (docs/console) only when asked,
# with GEODEBOT_SCREENSHOTS=docs/console, as they show times and temporary paths that change
# with every run; otherwise a folder of the system's temporary directory.
SCREENSHOTS_ENV = "GEODEBOT_SCREENSHOTS"
TIMEOUT_MS = 10_000  # a page that takes longer than this in a test is broken, not slow
LAUNCH_TIMEOUT_MS = 60_000  # a cold start on a busy 2-core machine

CHROMIUM_ARGS = (
    "--no-sandbox",  # CI runs as root, where chromium refuses its sandbox
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # The browser's own fetches (updates, safe browsing, ...) never pass the page's route
    # handler: no host name resolves, so they fail here instead of leaving the machine.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


def chromium_executable() -> str:
    """The chromium to drive; fails the test, naming the install step, when it is missing."""
    path = os.environ.get(CHROMIUM_ENV) or DEFAULT_CHROMIUM
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(
            f"no chromium at {path} ({CHROMIUM_ENV} names another): the browser tests drive "
            "Debian's package chromium, which .ci/run installs (apt-get install chromium)",
            pytrace=False,
        )
    return path


@asynccontextmanager
async def launched_chromium() -> AsyncIterator[Browser]:
    """Debian's chromium, headless, with its own fresh profile, closed on exit."""
    executable = chromium_executable()
    try:
        from playwright.async_api import async_playwright
    except ImportError as exc:
        pytest.fail(
            f"Playwright is missing ({exc}): install the test extra, pip install -e '.[test]' "
            "(make test does)",
            pytrace=False,
        )
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=executable,
            headless=True,
            args=list(CHROMIUM_ARGS),
            timeout=LAUNCH_TIMEOUT_MS,
        )
        try:
            yield browser
        finally:
            await browser.close()


def screenshot_folder() -> Path:
    given = os.environ.get(SCREENSHOTS_ENV)
    if given:
        return Path(given).resolve()
    return Path(tempfile.gettempdir()) / "geodebot-screenshots"


def allowed(url: str) -> bool:
    return urlsplit(url).hostname == ALLOWED_HOST


@dataclass
class Tab:
    """One test's browser context and page, and what they tried that they may not."""

    context: BrowserContext
    page: Page
    blocked: list[str] = field(default_factory=list)  # "METHOD url" of each refused request
    errors: list[str] = field(default_factory=list)  # uncaught script errors, on any page

    def take_blocked(self) -> list[str]:
        """The refused requests so far, which the test thereby expected; clears the list."""
        taken, self.blocked = self.blocked, []
        return taken

    def check(self) -> None:
        """Fails when the page tried to leave 127.0.0.1 or a script on it failed."""
        assert not self.blocked, f"the page tried to reach beyond {ALLOWED_HOST}: {self.blocked}"
        assert not self.errors, f"uncaught script errors on the page: {self.errors}"

    async def screenshot(self, name: str, folder: Path | None = None) -> Path:
        """The whole page as ``folder/<name>.png`` (by default see SCREENSHOTS_ENV).

        The file is left alone when the picture is the same, so a re-run changes nothing.
        """
        assert _NAME.fullmatch(name), f"screenshot name {name!r}: lowercase, digits, - and _"
        folder = folder if folder is not None else screenshot_folder()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.png"
        png = await self.page.screenshot(full_page=True, animations="disabled", caret="hide")
        if not path.is_file() or path.read_bytes() != png:
            path.write_bytes(png)
        return path

    def _script_error(self, error: WebError) -> None:
        self.errors.append(str(error.error))

    async def _route(self, route: Route) -> None:
        request = route.request
        if allowed(request.url):
            await route.continue_()
        else:
            self.blocked.append(f"{request.method} {request.url}")
            await route.abort("blockedbyclient")

    async def _route_socket(self, socket: WebSocketRoute) -> None:
        if allowed(socket.url):
            socket.connect_to_server()
        else:
            self.blocked.append(f"WEBSOCKET {socket.url}")
            await socket.close(code=1008, reason="outside 127.0.0.1")


async def open_tab(browser: Browser) -> Tab:
    """A fresh context and page on ``browser``, fenced to 127.0.0.1."""
    context = await browser.new_context(
        viewport=VIEWPORT,
        device_scale_factor=1,
        locale="en-US",
        timezone_id="UTC",
        color_scheme="light",
        reduced_motion="reduce",
        # A service worker's requests would bypass the route handler.
        service_workers="block",
    )
    context.set_default_timeout(TIMEOUT_MS)
    page = await context.new_page()
    tab = Tab(context, page)
    await context.route("**/*", tab._route)
    await context.route_web_socket(re.compile(".*"), tab._route_socket)
    context.on("weberror", tab._script_error)
    return tab


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with launched_chromium() as launched:
        yield launched


@pytest_asyncio.fixture(loop_scope="module")
async def tab(browser: Browser) -> AsyncIterator[Tab]:
    opened = await open_tab(browser)
    try:
        yield opened
    finally:
        await opened.context.close()
    opened.check()
