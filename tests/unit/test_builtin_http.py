"""http_get against a local server on 127.0.0.1; nothing here may reach the internet."""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from geodebot.engine.modes import Mode
from geodebot.engine.tools import DataClass, Effect, Safety, ToolCallContext, ToolError
from geodebot.engine.tools.builtin import BuiltinSettings
from geodebot.engine.tools.builtin import http as http_mod
from geodebot.engine.tools.builtin.http import address_is_public, host_allowed, http_get_tool

CTX = ToolCallContext(session_id="s", turn_id="t", mode=Mode.IPC)
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32


class LocalServer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.port = 0
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> LocalServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._release.set()
        assert self._runner is not None
        await self._runner.cleanup()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.path_qs, request.headers.get("Host", "")))
        path = request.path
        if path == "/text":
            return web.Response(text="hello from the test server")
        if path == "/latin1":
            return web.Response(
                body="café".encode("latin-1"), content_type="text/plain", charset="iso-8859-1"
            )
        if path == "/json":
            return web.json_response({"ok": True})
        if path == "/big":
            return web.Response(text="é" * 300_000)
        if path == "/png":
            return web.Response(body=PNG, content_type="image/png")
        if path == "/slow":
            await self._release.wait()
            return web.Response(text="too late")
        if path == "/redirect":
            raise web.HTTPFound(request.query["to"])
        if path == "/loop":
            raise web.HTTPFound("/loop")
        raise web.HTTPNotFound()


@pytest.fixture
async def server() -> AsyncIterator[LocalServer]:
    async with LocalServer() as srv:
        yield srv


async def get(url: str, **settings: Any) -> str:
    spec = http_get_tool(BuiltinSettings(workspace=Path("/nonexistent"), **settings))
    return await spec.handler({"url": url}, CTX)


async def refused(url: str, **settings: Any) -> str:
    with pytest.raises(ToolError) as info:
        await get(url, **settings)
    return str(info.value)


LOCAL = {"http_allow_hosts": ("127.0.0.1",), "http_allow_private": True}


def test_spec() -> None:
    spec = http_get_tool(BuiltinSettings(workspace=Path("w"), http_allow_hosts=("a.invalid",)))
    assert (spec.name, spec.safety, spec.effect) == ("http_get", Safety.READ, Effect.NONE)
    assert spec.resource_keys == ("net",)
    assert spec.data_class is DataClass.PUBLIC
    assert not spec.needs_approval
    assert "a.invalid" in spec.description


async def test_empty_allowlist_refuses_everything(server: LocalServer) -> None:
    message = await refused(server.url("/text"), http_allow_private=True)
    assert "allowlist is empty" in message
    assert server.seen == []


async def test_happy_path(server: LocalServer) -> None:
    out = await get(server.url("/text"), **LOCAL)
    assert out.startswith("status: 200 OK\ncontent-type: text/plain; charset=utf-8\n")
    assert out.endswith("\n\nhello from the test server")
    assert server.seen == [("/text", f"127.0.0.1:{server.port}")]


async def test_by_name_through_the_pinned_address(server: LocalServer) -> None:
    out = await get(
        server.url("/json", host="localhost"),
        http_allow_hosts=("localhost",),
        http_allow_private=True,
    )
    assert out.endswith('{"ok": true}')
    assert server.seen == [("/json", f"localhost:{server.port}")]


async def test_body_is_decoded_with_its_charset(server: LocalServer) -> None:
    assert (await get(server.url("/latin1"), **LOCAL)).endswith("\n\ncafé")


async def test_redirects_to_allowed_hosts_are_followed(server: LocalServer) -> None:
    absolute = server.url("/redirect?to=" + server.url("/text"))
    out = await get(absolute, **LOCAL)
    assert f"url: {server.url('/text')}" in out
    assert out.endswith("hello from the test server")
    out = await get(server.url("/redirect?to=/json"), **LOCAL)
    assert out.endswith('{"ok": true}')
    assert [path for path, _ in server.seen] == [
        "/redirect?to=" + server.url("/text"),
        "/text",
        "/redirect?to=/json",
        "/json",
    ]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("http://evil.invalid/x", "host evil.invalid is not on the http allowlist"),
        ("http://localhost:{port}/text", "host localhost is not on the http allowlist"),
        ("ftp://127.0.0.1:{port}/text", "only http and https"),
        ("http://user:pw@127.0.0.1:{port}/text", "credentials"),
    ],
)
async def test_redirects_are_rechecked_at_every_hop(
    server: LocalServer, target: str, expected: str
) -> None:
    message = await refused(server.url("/redirect?to=" + target.format(port=server.port)), **LOCAL)
    assert expected in message
    assert len(server.seen) == 1


async def test_a_redirect_into_a_private_address_is_refused(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pretend 127.0.0.1 is public so the first hop is allowed with allow_private off.
    real_check = http_mod.address_is_public
    monkeypatch.setattr(
        http_mod,
        "address_is_public",
        lambda addr: str(addr) == "127.0.0.1" or real_check(addr),
    )
    target = f"http://10.0.0.1:{server.port}/text"
    message = await refused(
        server.url("/redirect?to=" + target), http_allow_hosts=("127.0.0.1", "10.0.0.1")
    )
    assert "non-public address (10.0.0.1)" in message
    assert len(server.seen) == 1


async def test_redirect_limit(server: LocalServer) -> None:
    assert "too many redirects" in await refused(server.url("/loop"), **LOCAL)
    assert len(server.seen) == http_mod.MAX_REDIRECTS + 1


async def test_body_is_capped(server: LocalServer) -> None:
    out = await get(server.url("/big"), http_max_bytes=1001, **LOCAL)
    body = out.split("\n\n", 1)[1]
    assert body.endswith("\n[truncated: the body is longer than 1001 bytes]")
    # 1001 bytes hold 500 two-byte characters; the cut half character is dropped, not garbled.
    assert body.split("\n[truncated")[0] == "é" * 500


async def test_timeout(server: LocalServer) -> None:
    started = time.monotonic()
    message = await refused(server.url("/slow"), http_timeout_s=0.3, **LOCAL)
    assert message == "http_get timed out after 0.3 s"
    assert time.monotonic() - started < 2


async def test_non_text_is_refused_with_a_note(server: LocalServer) -> None:
    message = await refused(server.url("/png"), **LOCAL)
    assert "content-type: image/png" in message
    assert "not a text content type" in message
    assert "PNG" not in message


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "[::1]",
        "10.0.0.1",
        "169.254.169.254",
        "[::ffff:127.0.0.1]",
        "0.0.0.0",
        "localhost",
        "2130706433",
    ],
)
async def test_private_addresses_are_refused_without_connecting(
    server: LocalServer, host: str
) -> None:
    message = await refused(server.url("/text", host=host), http_allow_hosts=(host,))
    assert "resolves to a non-public address" in message
    assert server.seen == []


async def test_a_name_resolving_to_a_private_address_is_refused(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def rebinding(host: str, port: int) -> list[str]:
        return {"rebind.invalid": ["127.0.0.1"], "mixed.invalid": ["192.0.2.1", "10.1.1.1"]}[host]

    monkeypatch.setattr(http_mod, "resolve_host", rebinding)
    for host in ("rebind.invalid", "mixed.invalid"):
        message = await refused(server.url("/text", host=host), http_allow_hosts=(host,))
        assert f"{host} resolves to a non-public address" in message
    assert server.seen == []


async def test_the_connection_uses_only_the_vetted_address(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    lookups: list[str] = []

    async def one_answer(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(http_mod, "resolve_host", one_answer)
    # .invalid never resolves through DNS, so reaching the server proves the pin was used.
    out = await get(
        server.url("/text", host="api.pinned.invalid"),
        http_allow_hosts=("*.pinned.invalid",),
        http_allow_private=True,
    )
    assert out.endswith("hello from the test server")
    assert lookups == ["api.pinned.invalid"]
    assert server.seen == [("/text", f"api.pinned.invalid:{server.port}")]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("file:///etc/passwd", "only http and https"),
        ("/relative", "must be absolute"),
        ("http://user:pw@127.0.0.1/", "credentials"),
        ("http://a.invalid/", "host a.invalid is not on the http allowlist"),
        ("http://[::1", "not a valid URL"),
    ],
)
async def test_bad_urls(url: str, expected: str) -> None:
    assert expected in await refused(url, **LOCAL)


@pytest.mark.parametrize(
    ("host", "patterns", "allowed"),
    [
        ("example.invalid", ("example.invalid",), True),
        ("EXAMPLE.invalid.", ("example.invalid",), True),
        ("a.example.invalid", ("example.invalid",), False),
        ("a.example.invalid", ("*.example.invalid",), True),
        ("a.b.example.invalid", ("*.example.invalid",), True),
        ("example.invalid", ("*.example.invalid",), False),
        ("badexample.invalid", ("*.example.invalid",), False),
        ("::1", ("[::1]",), True),
        ("::ffff:7f00:1", ("::ffff:127.0.0.1",), True),
        ("xn--bcher-kva.invalid", ("bücher.invalid",), True),
    ],
)
def test_allowlist_matching(host: str, patterns: tuple[str, ...], allowed: bool) -> None:
    assert host_allowed(host, patterns) is allowed


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700::1111", True),
        ("::ffff:8.8.8.8", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("100.64.0.1", False),
        ("169.254.169.254", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("fec0::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("2002:7f00:1::", False),
        ("64:ff9b::a00:1", False),
    ],
)
def test_address_classification(address: str, public: bool) -> None:
    assert address_is_public(ipaddress.ip_address(address)) is public
