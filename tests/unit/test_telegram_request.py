"""``AiohttpRequest``: PTB's network layer on aiohttp, against a small local HTTP server.

What the Bot API fake cannot show: multipart uploads, the proxy taken from the environment,
and how failures map to PTB's errors (and which of them mean the request never left).
"""

from __future__ import annotations

import asyncio
import io
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from telegram import Bot, InputFile
from telegram.error import NetworkError, TimedOut

from geodebot.channels.telegram.request import AiohttpRequest, never_sent

TOKEN = "123456:AAHtest-token_for-request-0123456789"
ME = {"id": 1, "is_bot": True, "first_name": "geodebot", "username": "geodebot"}


@dataclass
class Seen:
    """What the server received: one dict per request."""

    requests: list[dict[str, object]] = field(default_factory=list)
    stall: asyncio.Event | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


SEEN = web.AppKey("seen", Seen)


async def _handle(request: web.Request) -> web.Response:
    seen = request.app[SEEN]
    entry: dict[str, object] = {
        "host": request.headers.get("Host"),
        "path": request.path,
        "url": str(request.url),
        "type": request.content_type,
        "agent": request.headers.get("User-Agent"),
    }
    if request.content_type == "multipart/form-data":
        fields: dict[str, object] = {}
        async for part in await request.multipart():
            data = await part.read()  # type: ignore[union-attr]  # aiohttp types parts loosely
            fields[part.name or ""] = (part.filename, bytes(data))  # type: ignore[union-attr]  # aiohttp types parts loosely
        entry["fields"] = fields
    else:
        entry["fields"] = dict(await request.post())
    seen.requests.append(entry)
    seen.arrived.set()
    if seen.stall is not None:
        await seen.stall.wait()
    if request.path.endswith("/sendDocument"):
        message = {"message_id": 7, "date": 0, "chat": {"id": 5, "type": "private"}}
        return web.json_response({"ok": True, "result": message | {"document": _doc()}})
    return web.json_response({"ok": True, "result": ME})


def _doc() -> dict[str, object]:
    return {"file_id": "f", "file_unique_id": "u"}


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Seen]]:
    app = web.Application()
    app[SEEN] = seen = Seen()
    app.router.add_route("*", "/{tail:.*}", _handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        if seen.stall is not None:
            seen.stall.set()
        await runner.cleanup()


def _bot(base: str, request: AiohttpRequest) -> Bot:
    return Bot(TOKEN, base_url=f"{base}/bot", request=request, get_updates_request=request)


async def test_form_fields_and_multipart_upload(server: tuple[str, Seen]) -> None:
    base, seen = server
    request = AiohttpRequest(connection_pool_size=2)
    bot = _bot(base, request)
    async with bot:
        me = await bot.get_me()
        assert me.username == "geodebot"
        await bot.send_document(
            5, InputFile(io.BytesIO(b"report body"), filename="r.txt"), caption="the report"
        )
    *_, get_me, send = seen.requests  # initialize() asked getMe first
    assert get_me["path"] == f"/bot{TOKEN}/getMe"
    assert str(get_me["agent"]).startswith("python-telegram-bot")
    assert send["type"] == "multipart/form-data"
    fields = send["fields"]
    assert isinstance(fields, dict)
    assert fields["chat_id"] == (None, b"5")
    assert fields["caption"] == (None, b"the report")
    assert fields["document"] == ("r.txt", b"report body")


async def test_plain_calls_are_form_encoded(server: tuple[str, Seen]) -> None:
    base, seen = server
    request = AiohttpRequest()
    try:
        await _bot(base, request).do_api_request(
            "getThing", api_kwargs={"nested": {"a": [1, 2]}, "text": "é & ="}
        )
    finally:
        await request.shutdown()
    (entry,) = seen.requests
    assert entry["type"] == "application/x-www-form-urlencoded"
    assert entry["fields"] == {"nested": '{"a": [1, 2]}', "text": "é & ="}


async def test_proxy_from_the_environment_once_per_host(
    server: tuple[str, Seen], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, seen = server
    monkeypatch.setenv("http_proxy", base)
    monkeypatch.setenv("no_proxy", "localhost")
    request = AiohttpRequest()
    bot = _bot("http://api.telegram.invalid", request)
    try:
        # The host does not resolve: only the proxy (our server) can have answered.
        await bot.get_me()
        monkeypatch.delenv("http_proxy")  # read once per host, not per request
        await bot.get_me()
    finally:
        await request.shutdown()
    assert [e["host"] for e in seen.requests] == ["api.telegram.invalid"] * 2
    assert str(seen.requests[0]["url"]).startswith("http://api.telegram.invalid/bot")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    direct = AiohttpRequest()
    try:
        await _bot(base, direct).get_me()  # no_proxy: straight to the server, not to port 9
    finally:
        await direct.shutdown()
    assert len(seen.requests) == 3


async def test_refused_connection_never_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("http_proxy", raising=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    request = AiohttpRequest()
    try:
        with pytest.raises(NetworkError) as refused:
            await _bot(f"http://127.0.0.1:{port}", request).get_me()
        assert never_sent(refused.value)
    finally:
        await request.shutdown()


async def test_slow_answer_times_out_and_may_have_been_acted_on(
    server: tuple[str, Seen],
) -> None:
    base, seen = server
    seen.stall = asyncio.Event()
    request = AiohttpRequest(read_timeout=0.3)
    try:
        with pytest.raises(TimedOut) as slow:
            await _bot(base, request).get_me()
        assert not never_sent(slow.value)
        assert len(seen.requests) == 1
    finally:
        await request.shutdown()


async def test_post_json_reads_the_raw_answer(server: tuple[str, Seen]) -> None:
    base, _ = server
    request = AiohttpRequest()
    try:
        answer = await request.post_json(f"{base}/bot{TOKEN}/getMe", {"offset": 3}, 5.0)
        assert answer == {"ok": True, "result": ME}
    finally:
        await request.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        await request.post_json(f"{base}/x", {}, 1.0)


async def test_no_free_connection_in_time_never_left(server: tuple[str, Seen]) -> None:
    """The only pooled connection is busy: the next call gives up unsent, after the pool wait
    plus the connect budget (aiohttp cannot bound them apart)."""
    base, seen = server
    seen.stall = asyncio.Event()
    request = AiohttpRequest(connection_pool_size=1, pool_timeout=0.2, connect_timeout=0.3)
    bot = _bot(base, request)
    try:
        busy = asyncio.create_task(bot.get_me(read_timeout=30))
        await seen.arrived.wait()
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimedOut) as waited:
            await bot.get_me()
        elapsed = asyncio.get_running_loop().time() - started
        assert never_sent(waited.value)
        assert 0.4 <= elapsed < 3.0
        assert len(seen.requests) == 1  # the second call never reached the server
        seen.stall.set()
        await busy
    finally:
        await request.shutdown()
