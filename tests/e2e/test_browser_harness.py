"""The headless-browser harness (tests/support/browser.py) on a page of this test's own.

An aiohttp site on 127.0.0.1 serves a form that posts and a list fed by server-sent events,
the two things the console's pages do; Debian's chromium loads it, posts the form, sees a
pushed update arrive without a reload, and has its requests beyond 127.0.0.1 refused and
reported. One browser serves the whole module.
"""

from __future__ import annotations

import asyncio
import html
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import expect

from tests.support.browser import CHROMIUM_ENV, VIEWPORT, Tab, chromium_executable

pytestmark = pytest.mark.asyncio(loop_scope="module")

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Harness</title>
<style>body {{ font-family: sans-serif; margin: 2rem; }}</style></head>
<body>
<h1>Harness</h1>
<form method="post" action="/notes">
  <input name="text" aria-label="Note"> <button type="submit">Add</button>
</form>
<ul id="notes">{notes}</ul>
<p id="state">connecting</p>
<ul id="live"></ul>
<script>
const events = new EventSource("/events");
events.onopen = () => {{ document.getElementById("state").textContent = "live"; }};
events.onmessage = (event) => {{
  const item = document.createElement("li");
  item.textContent = event.data;
  document.getElementById("live").append(item);
}};
</script>
</body></html>
"""

OUTSIDE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Outside</title></head>
<body>
<img id="picture" alt="" src="http://example.com/x.png"
     onerror="document.body.dataset.picture = 'failed'"
     onload="document.body.dataset.picture = 'loaded'">
<script>
const socket = new WebSocket("ws://example.com/socket");
socket.onclose = () => { document.body.dataset.socket = "closed"; };
</script>
</body></html>
"""

BROKEN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Broken</title></head>
<body><script>throw new Error("broken on purpose");</script></body></html>
"""


class Site:
    """The page under test: notes posted by its form, updates pushed to its open pages."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._streams: set[asyncio.Queue[str | None]] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_post("/notes", self._post)
        app.router.add_get("/events", self._events)
        app.router.add_get("/outside", self._fixed(OUTSIDE))
        app.router.add_get("/broken", self._fixed(BROKEN))
        # handler_cancellation: a page that goes away ends its event stream at once.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._runner = runner
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def close(self) -> None:
        for stream in self._streams:
            stream.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    def push(self, text: str) -> int:
        """Sends ``text`` to every open page; returns how many there are."""
        for stream in self._streams:
            stream.put_nowait(text)
        return len(self._streams)

    async def _page(self, request: web.Request) -> web.Response:
        notes = "".join(f"<li>{html.escape(note)}</li>" for note in self.notes)
        return web.Response(text=PAGE.format(notes=notes), content_type="text/html")

    async def _post(self, request: web.Request) -> web.Response:
        form = await request.post()
        self.notes.append(str(form["text"]))
        raise web.HTTPSeeOther("/")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        stream: asyncio.Queue[str | None] = asyncio.Queue()
        self._streams.add(stream)
        try:
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            while (text := await stream.get()) is not None:
                await response.write(f"data: {text}\n\n".encode())
            return response
        finally:
            self._streams.discard(stream)

    @staticmethod
    def _fixed(text: str) -> web.Handler:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(text=text, content_type="text/html")

        return handler


@pytest_asyncio.fixture(loop_scope="module")
async def site() -> AsyncIterator[Site]:
    served = Site()
    await served.start()
    try:
        yield served
    finally:
        await served.close()


async def test_a_posted_form_and_a_pushed_update_show_on_the_page(tab: Tab, site: Site) -> None:
    page = tab.page
    await page.goto(site.url)
    await expect(page.locator("#state")).to_have_text("live")

    await page.get_by_label("Note").fill("first <note>")
    await page.get_by_role("button", name="Add").click()
    await expect(page.locator("#notes li")).to_have_text(["first <note>"])
    assert site.notes == ["first <note>"]

    # The page the redirect loaded opens its own stream; a reload would lose the mark.
    await expect(page.locator("#state")).to_have_text("live")
    await page.evaluate("window.mark = 'this page'")
    assert site.push("run 1 finished") >= 1
    await expect(page.locator("#live li")).to_have_text(["run 1 finished"])
    site.push("run 2 finished")
    await expect(page.locator("#live li")).to_have_text(["run 1 finished", "run 2 finished"])
    assert await page.evaluate("window.mark") == "this page"
    tab.check()


async def test_requests_beyond_loopback_are_refused_and_reported(tab: Tab, site: Site) -> None:
    page = tab.page
    await page.goto(f"{site.url}/outside")
    await expect(page.locator("body")).to_have_attribute("data-picture", "failed")
    await expect(page.locator("body")).to_have_attribute("data-socket", "closed")
    assert sorted(tab.blocked) == [
        "GET http://example.com/x.png",
        "WEBSOCKET ws://example.com/socket",
    ]
    with pytest.raises(AssertionError, match=r"beyond 127\.0\.0\.1.*example\.com/x\.png"):
        tab.check()
    tab.take_blocked()  # expected here: the fixture's own check at teardown passes
    tab.check()


async def test_an_uncaught_script_error_is_reported(tab: Tab, site: Site) -> None:
    async with tab.context.expect_event("weberror") as raised:
        await tab.page.goto(f"{site.url}/broken")
    assert "broken on purpose" in str((await raised.value).error)
    with pytest.raises(AssertionError, match="broken on purpose"):
        tab.check()
    tab.errors.clear()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def test_a_screenshot_is_the_whole_page_at_the_fixed_width(
    tab: Tab, site: Site, tmp_path: Path
) -> None:
    await tab.page.goto(site.url)
    await expect(tab.page.locator("#state")).to_have_text("live")
    await tab.page.evaluate("document.body.style.height = '2000px'")
    path = await tab.screenshot("harness", folder=tmp_path)
    assert path == tmp_path / "harness.png"
    width, height = png_size(path)
    assert width == VIEWPORT["width"]
    assert height > 2000  # the whole page, not the 800-pixel viewport
    written = path.stat().st_mtime_ns
    # The same page again is the same picture: the file is left as it was.
    assert await tab.screenshot("harness", folder=tmp_path) == path
    assert path.stat().st_mtime_ns == written
    with pytest.raises(AssertionError, match="screenshot name"):
        await tab.screenshot("../elsewhere", folder=tmp_path)


async def test_a_missing_chromium_fails_naming_the_install_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CHROMIUM_ENV, str(tmp_path / "no-chromium"))
    with pytest.raises(pytest.fail.Exception, match=r"no chromium at .*\.ci/run"):
        chromium_executable()
