"""A raw JSON-RPC MCP server that misbehaves on request (the SDK's own server never would).

It speaks the handshake-era protocol (``initialize``, then ``tools/list`` and ``tools/call``)
and answers the SDK client's ``server/discover`` probe with "method not found", like a legacy
server. Over stdio (``python tests/support/fakes/mcp_misbehaving_server.py [options]``):

* ``--hang-initialize``: never answers ``initialize``; it reads on, and exits at end of input,
  like a server wedged in its start-up.
* ``--bad-schemas``: besides the good ``echo`` tool it advertises ``bad_type`` (an unknown
  type), ``bad_pattern`` (a ``pattern`` that is not a linear-time regex) and ``bad_ref`` (a
  ``$ref`` that points nowhere). Without it only ``echo`` and ``pid`` are listed.
* ``--started-file PATH``: appends the process id to PATH at start, so a test can tell
  whether the server was started at all.

Over streamable HTTP (session-based, like the reference ``server-everything``), either
in-process::

    async with FakeMCPHTTP(bad_schemas=False) as srv:
        ...  # connect to srv.url
        srv.restart()  # forget every session, as a restarted process would

or as a process with ``--http PORT``. A request carrying a session id the server does not know
(or none) is answered ``400 Bad Request`` with a JSON-RPC error (code -32600), as a
restarted ``server-everything`` answers a stale session; ``stale_status=404`` answers 404 with
``-32001 Session not found`` (the TypeScript SDK's answer), and ``stale_body="text"`` gives a
plain-text body instead of JSON-RPC (``--stale-status``, ``--stale-text`` as a process).

Tools: ``echo(text)`` answers the text (``env:NAME`` the variable's value or ``unset``);
``pid()`` the server's process id.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

if TYPE_CHECKING:
    from aiohttp import web

PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")

GOOD_TOOLS: list[dict[str, Any]] = [
    {
        "name": "echo",
        "description": "Repeat the text; env:NAME reports an environment variable.",
        "inputSchema": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
    {"name": "pid", "description": "The server's process id.", "inputSchema": {"type": "object"}},
]
BAD_TOOLS: list[dict[str, Any]] = [
    {
        "name": "bad_type",
        "description": "An argument of a type that does not exist.",
        "inputSchema": {"type": "object", "properties": {"x": {"type": "strng"}}},
    },
    {
        "name": "bad_pattern",
        "description": "A lookbehind pattern, which no linear-time engine accepts.",
        "inputSchema": {
            "type": "object",
            "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}},
        },
    },
    {
        "name": "bad_ref",
        "description": "A reference to a definition that is not there.",
        "inputSchema": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
    },
]


class Tools:
    """The JSON-RPC side, shared by both transports; ``answer`` is None for notifications."""

    def __init__(self, *, bad_schemas: bool, hang_initialize: bool = False) -> None:
        self.tools = GOOD_TOOLS + (BAD_TOOLS if bad_schemas else [])
        self.hang_initialize = hang_initialize
        self.calls: list[str] = []

    def answer(self, message: Mapping[str, Any]) -> dict[str, Any] | None:
        if "id" not in message or "method" not in message:
            return None  # a notification, or a response to something we never asked
        method, params, rid = message["method"], message.get("params") or {}, message["id"]
        if method == "initialize":
            if self.hang_initialize:
                return None
            asked = params.get("protocolVersion")
            version = asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1]
            return _result(
                rid,
                {
                    "protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": {"name": "geodebot-fake-misbehaving", "version": "1"},
                },
            )
        if method == "ping":
            return _result(rid, {})
        if method == "tools/list":
            return _result(rid, {"tools": self.tools})
        if method == "tools/call":
            return self._call(rid, params)
        return _error(rid, -32601, f"method not found: {method}")

    def _call(self, rid: Any, params: Mapping[str, Any]) -> dict[str, Any]:
        name = params.get("name")
        self.calls.append(str(name))
        arguments = params.get("arguments") or {}
        if name == "echo":
            text = str(arguments.get("text", ""))
            if text.startswith("env:"):
                text = os.environ.get(text.removeprefix("env:"), "unset")
            return _result(rid, {"content": [{"type": "text", "text": text}]})
        if name == "pid":
            return _result(rid, {"content": [{"type": "text", "text": str(os.getpid())}]})
        if any(tool["name"] == name for tool in self.tools):
            return _result(rid, {"content": [{"type": "text", "text": f"{name} ran"}]})
        return _error(rid, -32602, f"unknown tool {name!r}")


def _result(rid: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def _error(rid: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}


class FakeMCPHTTP:
    """Session-based streamable HTTP on 127.0.0.1; ``restart()`` forgets every session."""

    def __init__(
        self,
        *,
        bad_schemas: bool = False,
        stale_status: int = 400,
        stale_body: Literal["json", "text"] = "json",
        port: int = 0,
    ) -> None:
        self.handler = Tools(bad_schemas=bad_schemas)
        self.stale_status = stale_status
        self.stale_body = stale_body
        self.sessions: set[str] = set()
        # Every session id ever issued, and each request's (method, status), for assertions.
        self.issued: list[str] = []
        self.log: list[tuple[str, int]] = []
        self._ids = itertools.count(1)
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def restart(self) -> None:
        self.sessions.clear()

    async def start(self) -> Self:
        # Imported here: over stdio the fake starts without it, a few hundred ms sooner.
        from aiohttp import web

        app = web.Application()
        app.router.add_route("*", "/mcp", self._mcp)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _stale(self, rid: Any) -> web.Response:
        from aiohttp import web

        if self.stale_body == "text":
            return web.Response(status=self.stale_status, text="Invalid or missing session ID")
        if self.stale_status == 404:
            body = _error(rid, -32001, "Session not found")
        else:
            body = _error(rid, -32600, "Bad Request: No valid session ID provided")
        return web.json_response(body, status=self.stale_status)

    async def _mcp(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        session = request.headers.get("mcp-session-id")
        if request.method == "GET":
            return web.Response(status=405)
        if request.method == "DELETE":
            known = session in self.sessions
            self.sessions.discard(session or "")
            return web.Response(status=200 if known else 404)
        if request.method != "POST":
            return web.Response(status=405)
        message = await request.json()
        method = str(message.get("method", ""))
        if method == "initialize":
            session = f"session-{next(self._ids)}"
            self.sessions.add(session)
            self.issued.append(session)
            self.log.append((method, 200))
            answer = self.handler.answer(message)
            return web.json_response(answer, headers={"mcp-session-id": session})
        if method == "server/discover":
            self.log.append((method, 200))
            return web.json_response(self.handler.answer(message))
        if session not in self.sessions:
            self.log.append((method, self.stale_status))
            return self._stale(message.get("id"))
        answer = self.handler.answer(message)
        self.log.append((method, 200 if answer is not None else 202))
        if answer is None:
            return web.Response(status=202)
        return web.json_response(answer)


def _serve_stdio(handler: Tools) -> None:
    for line in sys.stdin:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        answer = handler.answer(message) if isinstance(message, dict) else None
        if answer is not None:
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()


async def _serve_http(port: int, *, bad_schemas: bool, stale_status: int, text: bool) -> None:
    body: Literal["json", "text"] = "text" if text else "json"
    async with FakeMCPHTTP(
        bad_schemas=bad_schemas, stale_status=stale_status, stale_body=body, port=port
    ):
        await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="mcp_misbehaving_server")
    parser.add_argument("--hang-initialize", action="store_true")
    parser.add_argument("--bad-schemas", action="store_true")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP")
    parser.add_argument("--stale-status", type=int, default=400, choices=(400, 404))
    parser.add_argument("--stale-text", action="store_true")
    parser.add_argument("--started-file", metavar="PATH", help="append our pid here at start")
    args = parser.parse_args()
    if args.started_file:
        with open(args.started_file, "a", encoding="utf-8") as handle:
            handle.write(f"{os.getpid()}\n")
    if args.http is not None:
        asyncio.run(
            _serve_http(
                args.http,
                bad_schemas=args.bad_schemas,
                stale_status=args.stale_status,
                text=args.stale_text,
            )
        )
    else:
        tools = Tools(bad_schemas=args.bad_schemas, hang_initialize=args.hang_initialize)
        _serve_stdio(tools)


if __name__ == "__main__":
    main()
