"""The operator's MCP servers, as tools: started lazily, restarted with backoff, policed.

Only tools that the config declares (safety, effect, resource keys) become :class:`ToolSpec`s;
whatever else a server offers is never callable. A stdio server gets the variables its config
names and ``PATH``, never the daemon's whole environment, which holds API keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TextIO

from mcp import StdioServerParameters, stdio_client
from mcp import types as mt
from mcp.client import Transport
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from geodebot.config import MCPServerConfig, MCPToolPolicy
from geodebot.engine.mcp.connection import Connection, describe
from geodebot.engine.tools.spec import (
    Effect,
    Safety,
    ToolCallContext,
    ToolError,
    ToolOutcomeUnknown,
    ToolSpec,
)

log = logging.getLogger(__name__)

# What the model APIs accept as a tool name (OpenAI's limit is the tighter one).
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_State = Literal["not started", "starting", "up", "down", "stopped"]


def tool_name(server: str, tool: str) -> str:
    return f"mcp__{server}__{tool}"


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before the next start after ``failures`` consecutive failures."""

    initial_s: float = 1.0
    max_s: float = 300.0

    def delay(self, failures: int) -> float:
        # One crash is usually a one-off, so the first restart is immediate; a server that
        # keeps failing is then left alone for exponentially longer.
        if failures <= 1:
            return 0.0
        return min(self.max_s, self.initial_s * 2.0 ** (failures - 2))


def _render(result: mt.CallToolResult) -> str:
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, mt.TextContent):
            parts.append(block.text)
        elif isinstance(block, mt.ImageContent):
            parts.append(f"[image {block.mime_type}]")
        elif isinstance(block, mt.AudioContent):
            parts.append(f"[audio {block.mime_type}]")
        elif isinstance(block, mt.ResourceLink):
            parts.append(f"[resource {block.uri}]")
        elif isinstance(block.resource, mt.TextResourceContents):
            parts.append(block.resource.text)
        else:
            parts.append(f"[resource {block.resource.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _connection_lost(exc: MCPError) -> bool:
    if exc.code == mt.CONNECTION_CLOSED:
        return True
    # A legacy (session-based) HTTP server that restarted has forgotten our session and
    # answers 404, which the SDK reports only in this shape; a new connection fixes it.
    return exc.code == mt.INVALID_REQUEST and exc.message == "Session terminated"


@dataclass
class _Slot:
    config: MCPServerConfig
    conn: Connection | None = None
    listing: dict[str, mt.Tool] | None = None
    failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class MCPServerPool:
    def __init__(
        self,
        servers: Sequence[MCPServerConfig],
        *,
        environ: Mapping[str, str],
        cwd: Path,
        backoff: Backoff = Backoff(),
        connect_timeout_s: float = 30.0,
        probe_timeout_s: float | None = None,
        stop_timeout_s: float = 10.0,
        stderr: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._slots: dict[str, _Slot] = {}
        for server in servers:
            if server.name in self._slots:
                raise ValueError(f"MCP server {server.name!r} is configured twice")
            self._slots[server.name] = _Slot(server)
        self._environ = environ
        self._cwd = cwd
        self._backoff = backoff
        self._connect_timeout_s = connect_timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._stderr = stderr
        self._clock = clock
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def tool_specs(self) -> list[ToolSpec]:
        """A spec for every declared tool the server offers (connecting servers as needed)."""
        per_server = await asyncio.gather(*(self._specs(slot) for slot in self._slots.values()))
        return [spec for specs in per_server for spec in specs]

    async def call(
        self,
        server: str,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
    ) -> str:
        """Call a declared tool; ``timeout_s`` defaults to its declared timeout."""
        slot = self._slots[server]
        policy = slot.config.tools.get(tool)
        if policy is None:
            raise ToolError(f"{tool} is not a declared tool of MCP server {server}")
        if timeout_s is None:
            timeout_s = policy.timeout_s
        conn = await self._connect(slot)
        client = conn.client
        if client is None:
            raise ToolError(f"MCP server {server} stopped before the call could be sent")
        try:
            async with asyncio.timeout(timeout_s):
                result = await client.call_tool(tool, dict(arguments))
        except TimeoutError:
            conn.probe()
            raise ToolOutcomeUnknown(
                f"{tool} on MCP server {server} did not answer within {timeout_s:g} s; "
                "it may have acted before it was stopped"
            ) from None
        except asyncio.CancelledError:
            # Whoever gave up (usually the executor's own deadline) may be looking at a
            # wedged server.
            conn.probe()
            raise
        except MCPError as exc:
            if not _connection_lost(exc):
                raise ToolError(f"MCP server {server} refused the call: {exc.message}") from None
            conn.fail(exc.message)
            raise ToolOutcomeUnknown(
                f"MCP server {server} went away during the call ({exc.message}); it may have "
                "acted, and it is restarted on the next call"
            ) from None
        except ValidationError:
            raise ToolError(f"MCP server {server} sent a malformed result for {tool}") from None
        except Exception as exc:
            log.warning("MCP server %s failed calling %s", server, tool, exc_info=True)
            conn.fail(describe(exc))
            raise ToolOutcomeUnknown(
                f"MCP server {server} failed during the call ({describe(exc)}); it is "
                "restarted on the next call"
            ) from None
        slot.failures = 0
        text = _render(result)
        if result.is_error:
            raise ToolError(text or f"{tool} failed without saying why")
        return text

    async def status(self) -> dict[str, dict[str, Any]]:
        now = self._clock()
        report: dict[str, dict[str, Any]] = {}
        for name, slot in self._slots.items():
            declared = slot.config.tools
            offered = None if slot.listing is None else len(set(declared) & set(slot.listing))
            report[name] = {
                "state": self._state(slot),
                "transport": slot.config.transport,
                "last_error": slot.last_error,
                "failures": slot.failures,
                "retry_in_s": round(max(0.0, slot.retry_at - now), 1),
                "tools": offered,
            }
        return report

    async def aclose(self) -> None:
        self._closed = True
        conns = [slot.conn for slot in self._slots.values() if slot.conn is not None]
        tasks = {conn.task for conn in conns if not conn.task.done()}
        for conn in conns:
            if not conn.task.done():
                conn.stop()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self._stop_timeout_s)
        for task in pending:
            log.warning("MCP connection %s did not stop in time; cancelling it", task.get_name())
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=self._stop_timeout_s)

    def _state(self, slot: _Slot) -> _State:
        conn = slot.conn
        if conn is None:
            return "stopped" if self._closed and slot.listing is not None else "not started"
        if conn.usable:
            return "up"
        if conn.starting:
            return "starting"
        return "stopped" if self._closed and conn.error is None else "down"

    async def _specs(self, slot: _Slot) -> list[ToolSpec]:
        name = slot.config.name
        try:
            await self._connect(slot)
        except ToolError as exc:
            # A server that is down keeps the tools it had, so a session's plan does not
            # depend on when a crash happened; their calls fail until it is back.
            log.warning("%s", exc)
        if slot.listing is None:
            return []
        specs = []
        for tool, policy in slot.config.tools.items():
            offered = slot.listing.get(tool)
            full = tool_name(name, tool)
            if offered is None:
                log.warning("MCP server %s does not offer declared tool %s; skipped", name, tool)
            elif not _TOOL_NAME.match(full):
                log.warning("MCP tool name %s is not usable with model APIs; skipped", full)
            else:
                specs.append(self._spec(name, offered, policy))
        return specs

    def _spec(self, server: str, tool: mt.Tool, policy: MCPToolPolicy) -> ToolSpec:
        timeout_s = policy.timeout_s
        remote = tool.name

        async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
            return await self.call(server, remote, arguments, timeout_s=timeout_s)

        return ToolSpec(
            name=tool_name(server, remote),
            description=f"[{server}] {tool.description or tool.title or remote}",
            input_schema=tool.input_schema,
            safety=Safety(policy.safety),
            effect=Effect(policy.effect),
            handler=handler,
            resource_keys=policy.resource_keys,
            timeout_s=timeout_s,
        )

    async def _connect(self, slot: _Slot) -> Connection:
        name = slot.config.name
        async with slot.lock:
            if self._closed:
                raise ToolError(f"MCP server {name} is shut down")
            conn = slot.conn
            if conn is not None and conn.usable:
                # A server whose last call timed out is being checked: a call sent now could
                # be stuck in a wedged server and then reported as "may have acted". Wait for
                # the verdict (the health check's own timeout bounds this).
                await conn.checked()
            if conn is not None and conn.usable:
                return conn
            if conn is not None and not conn.starting:
                # Let the old connection finish going down, so two copies of a server
                # never run side by side.
                await asyncio.wait({conn.task})
                conn = slot.conn = None
            if conn is None:
                conn = self._start(slot)
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    await asyncio.shield(conn.ready)
            except TimeoutError:
                conn.abort(f"did not start within {self._connect_timeout_s:g} s")
                await asyncio.wait({conn.task})
            if self._closed:
                raise ToolError(f"MCP server {name} is shut down")
            if not conn.usable:
                raise ToolError(f"MCP server {name} is down: {conn.error or slot.last_error}")
            slot.listing = {tool.name: tool for tool in conn.tools}
            return conn

    def _start(self, slot: _Slot) -> Connection:
        config = slot.config
        wait = slot.retry_at - self._clock()
        if wait > 0:
            raise ToolError(
                f"MCP server {config.name} is down ({slot.last_error}); "
                f"next attempt in {wait:.0f} s"
            )
        transport: Transport
        if config.transport == "stdio":
            params = StdioServerParameters(
                command=config.command[0],
                args=list(config.command[1:]),
                env=self._server_env(config),
                cwd=self._cwd,
            )
            transport = stdio_client(params, errlog=self._stderr or sys.stderr)
        else:
            assert config.url is not None  # the config model requires it for http
            transport = streamable_http_client(config.url)

        conn = Connection(
            transport,
            name=config.name,
            probe_timeout_s=config.probe_timeout_s
            if self._probe_timeout_s is None
            else self._probe_timeout_s,
            on_down=lambda error: self._ended(slot, error),
        )
        slot.conn = conn
        log.info("starting MCP server %s", config.name)
        return conn

    def _ended(self, slot: _Slot, error: str | None) -> None:
        if error is None:
            return
        slot.failures += 1
        slot.last_error = error
        delay = self._backoff.delay(slot.failures)
        slot.retry_at = self._clock() + delay
        log.warning(
            "MCP server %s is down (%s); failure %d, next start allowed in %.0f s",
            slot.config.name,
            error,
            slot.failures,
            delay,
        )

    def _server_env(self, config: MCPServerConfig) -> dict[str, str]:
        env: dict[str, str] = {}
        for name in (*config.env, "PATH"):
            value = self._environ.get(name)
            if value is not None:
                env[name] = value
            elif name != "PATH":
                log.warning("MCP server %s: variable %s is not set", config.name, name)
        return env
