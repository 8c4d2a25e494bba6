"""The operator's MCP servers, as tools: started lazily, restarted with backoff, policed.

Only tools that the config declares (safety, effect, resource keys) become :class:`ToolSpec`s;
whatever else a server offers is never callable, and a declared tool whose input schema cannot
be compiled is unavailable (logged once per listing) while the server's other tools work.

A session asks only for the servers of the tools it lists, and waits for them only briefly
(see :meth:`MCPServerPool.tool_specs`): a server that is not up by then is the concern of a
call to one of its tools, never of the session or the turn.

A stdio server's environment is exactly: the variables its config lists, plus ``PATH``,
``HOME``, ``LOGNAME``, ``SHELL``, ``TERM`` and ``USER`` (:data:`BASE_ENV`, each when set),
never the daemon's whole environment, which holds API keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TextIO

from mcp import StdioServerParameters, stdio_client
from mcp import types as mt
from mcp.client import Transport
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from geodebot.config.schema import MCPServerConfig, MCPToolPolicy
from geodebot.engine.mcp.connection import (
    Connection,
    TransportFactory,
    describe,
    http_transport,
)
from geodebot.engine.tools.schema import SchemaError
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

# What a stdio server gets from our environment besides the variables its config lists. The
# SDK's stdio transport adds the same names from the process environment whatever we pass
# (mcp.client.stdio.get_default_environment); passing them ourselves makes this list, which
# the README documents, the whole truth, and a test keeps the SDK's list inside it.
BASE_ENV = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")

# Of a turn's remaining budget, the share that session set-up may wait for listed servers
# to come up, and the share that a call to a tool of a server never up yet may wait for it.
_SETUP_SHARE = 0.1
_CALL_SHARE = 0.5


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


class _NotUp(ToolError):
    """The server did not come up within the wait; it goes on starting for later calls."""


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
    # From the last connection that came up (``listed_by``): what the server listed, the
    # specs of its declared tools, and why each declared tool without a spec has none. A
    # server that goes down keeps them, so a session's plan does not depend on when a crash
    # happened; their calls fail until it is back.
    listed_by: Connection | None = None
    listing: dict[str, mt.Tool] | None = None
    specs: dict[str, ToolSpec] = field(default_factory=dict)
    unusable: dict[str, str] = field(default_factory=dict)
    failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class MCPServerPool:
    """``connect_grace_s``: how long a session's set-up waits at most for a listed server that
    is not up yet (never more than a tenth of its turn's remaining budget); a call to one of
    its tools then waits for it within the call's own deadline. ``connect_timeout_s`` bounds
    a server's start, whoever waits for it."""

    def __init__(
        self,
        servers: Sequence[MCPServerConfig],
        *,
        environ: Mapping[str, str],
        cwd: Path,
        backoff: Backoff = Backoff(),
        connect_timeout_s: float = 30.0,
        connect_grace_s: float = 3.0,
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
        self._grace_s = connect_grace_s
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

    async def tool_specs(
        self,
        names: Collection[str] | None = None,
        *,
        deadline: float | None = None,
        wait_s: float | None = None,
        patient: bool = False,
    ) -> list[ToolSpec]:
        """The specs of the declared tools ``names`` lists (all of them when None).

        Only the servers of those tools are started, and each is waited for at most
        ``wait_s`` (default: the grace), and never more than a tenth of what is left until
        ``deadline`` (the turn's end, on the event loop's clock); ``patient``, half of what is
        left (see ToolSource.tool_specs). A server that is not up by
        then keeps the specs of its last listing; one that has never been listed gets a
        stand-in for each tool (see :meth:`_stand_in`), which connects when called.
        """
        wanted = self._wanted(names)
        wait = self._grace_s if wait_s is None else wait_s
        if deadline is not None:
            left = max(0.0, deadline - asyncio.get_running_loop().time())
            # Patient: a stand-in would change the plan a pending approval was given under,
            # and the call would be refused as changed; that is worth half the turn's time.
            wait = left * _CALL_SHARE if patient else min(wait, left * _SETUP_SHARE)
        per_server = await asyncio.gather(
            *(self._specs(self._slots[name], tools, wait, deadline) for name, tools in wanted)
        )
        return [spec for specs in per_server for spec in specs]

    async def call(
        self,
        server: str,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        timeout_s: float | None = None,
    ) -> str:
        """Call a declared tool; ``timeout_s`` (default: its declared timeout) bounds both
        waiting for the server and the call."""
        slot = self._slots[server]
        policy = slot.config.tools.get(tool)
        if policy is None:
            raise ToolError(f"{tool} is not a declared tool of MCP server {server}")
        if timeout_s is None:
            timeout_s = policy.timeout_s
        conn, left = await self._ready(slot, server, tool, timeout_s)
        result = await self._call_tool(conn, server, tool, arguments, left, timeout_s)
        slot.failures = 0
        text = _render(result)
        if result.is_error:
            raise ToolError(text or f"{tool} failed without saying why")
        return text

    async def _ready(
        self, slot: _Slot, server: str, tool: str, timeout_s: float
    ) -> tuple[Connection, float]:
        """The server's connection, up within ``timeout_s``, and the time left for the call."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            conn = await self._connect(slot, within=timeout_s)
        except _NotUp as exc:
            raise ToolError(f"{exc}; {tool} was not run") from None
        if conn.client is None:
            raise ToolError(f"MCP server {server} stopped before the call could be sent")
        left = timeout_s - (loop.time() - started)
        if left <= 0:
            raise ToolError(f"MCP server {server} came up too late; {tool} was not run")
        return conn, left

    async def _call_tool(
        self,
        conn: Connection,
        server: str,
        tool: str,
        arguments: Mapping[str, Any],
        left: float,
        timeout_s: float,
    ) -> mt.CallToolResult:
        assert conn.client is not None
        try:
            async with asyncio.timeout(left):
                return await conn.client.call_tool(tool, dict(arguments))
        except TimeoutError:
            conn.probe()
            raise ToolOutcomeUnknown(
                f"{tool} on MCP server {server} did not answer within {timeout_s:g} s; "
                "it may have acted before it was stopped"
            ) from None
        except asyncio.CancelledError:
            # Whoever gave up (usually the authority pipeline's own deadline) may be looking at a
            # wedged server.
            conn.probe()
            raise
        except MCPError as exc:
            raise self._refused(conn, server, tool, exc) from None
        except ValidationError:
            raise ToolError(f"MCP server {server} sent a malformed result for {tool}") from None
        except Exception as exc:
            log.warning("MCP server %s failed calling %s", server, tool, exc_info=True)
            conn.fail(describe(exc))
            raise ToolOutcomeUnknown(
                f"MCP server {server} failed during the call ({describe(exc)}); it is "
                "restarted on the next call"
            ) from None

    async def status(self) -> dict[str, dict[str, Any]]:
        now = self._clock()
        report: dict[str, dict[str, Any]] = {}
        for name, slot in self._slots.items():
            report[name] = {
                "state": self._state(slot),
                "transport": slot.config.transport,
                "last_error": slot.last_error,
                "failures": slot.failures,
                "retry_in_s": round(max(0.0, slot.retry_at - now), 1),
                # Declared tools the server offers and that can be called; None: never listed.
                "tools": None if slot.listing is None else len(slot.specs),
                "unusable": dict(slot.unusable),
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

    def _wanted(self, names: Collection[str] | None) -> list[tuple[str, list[str]]]:
        """(server, declared tools) for the tools named; only servers with one are asked."""
        wanted = []
        for name, slot in self._slots.items():
            tools = [
                tool
                for tool in slot.config.tools
                if names is None or tool_name(name, tool) in names
            ]
            if tools:
                wanted.append((name, tools))
        return wanted

    async def _specs(
        self, slot: _Slot, tools: list[str], wait: float, deadline: float | None
    ) -> list[ToolSpec]:
        try:
            await self._connect(slot, within=wait)
        except _NotUp:
            pass  # it goes on starting; a call to one of its tools waits for it
        except ToolError as exc:
            log.warning("%s", exc)
        if slot.listing is None:
            name = slot.config.name
            return [
                self._stand_in(name, tool, deadline)
                for tool in tools
                if _TOOL_NAME.match(tool_name(name, tool))
            ]
        return [slot.specs[tool] for tool in tools if tool in slot.specs]

    def _listed(self, slot: _Slot, conn: Connection) -> None:
        """Build the specs of a new connection's listing, once, saying once what is wrong."""
        if slot.listed_by is conn:
            return
        name = slot.config.name
        listing = {tool.name: tool for tool in conn.tools}
        specs: dict[str, ToolSpec] = {}
        unusable: dict[str, str] = {}
        for tool, policy in slot.config.tools.items():
            offered = listing.get(tool)
            full = tool_name(name, tool)
            if offered is None:
                unusable[tool] = "the server does not offer it"
            elif not _TOOL_NAME.match(full):
                unusable[tool] = "its name is not usable with model APIs"
            else:
                spec = self._spec(name, offered, policy)
                try:
                    spec.arguments_schema  # noqa: B018 - compiled now, so a bad one is found now
                    specs[tool] = spec
                    continue
                except SchemaError as exc:
                    unusable[tool] = f"its input schema is unusable ({exc})"
            log.warning("MCP tool %s is unavailable: %s", full, unusable[tool])
        slot.listed_by, slot.listing, slot.specs, slot.unusable = conn, listing, specs, unusable

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

    def _stand_in(self, server: str, tool: str, deadline: float | None) -> ToolSpec:
        """A declared tool of a server never listed yet: the operator's policy, any arguments.

        Called, it waits for the server within the tool's own timeout (and never more than
        half of what is left until ``deadline``), checks the arguments against the schema the
        server then lists, and calls it; otherwise the call fails, naming the server and why.
        """
        policy = self._slots[server].config.tools[tool]

        async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
            return await self._call_when_up(server, tool, arguments, deadline)

        return ToolSpec(
            name=tool_name(server, tool),
            description=(
                f"[{server}] {tool}: its MCP server is not connected yet, so its description "
                "and arguments are not known; a call waits briefly for the server."
            ),
            input_schema={"type": "object"},
            safety=Safety(policy.safety),
            effect=Effect(policy.effect),
            handler=handler,
            resource_keys=policy.resource_keys,
            timeout_s=policy.timeout_s,
        )

    async def _call_when_up(
        self, server: str, tool: str, arguments: Mapping[str, Any], deadline: float | None
    ) -> str:
        slot = self._slots[server]
        loop = asyncio.get_running_loop()
        started = loop.time()
        wait = slot.config.tools[tool].timeout_s
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - started) * _CALL_SHARE)
        try:
            await self._connect(slot, within=wait)
        except _NotUp as exc:
            raise ToolError(f"{exc}; {tool} was not run") from None
        spec = slot.specs.get(tool)
        if spec is None:
            reason = slot.unusable.get(tool, "the server does not offer it")
            raise ToolError(f"{tool_name(server, tool)} is unavailable: {reason}; it was not run")
        problems = spec.arguments_schema.problems(arguments)
        if problems:
            raise ToolError(f"invalid arguments for {spec.name}: " + "; ".join(problems))
        left = spec.timeout_s - (loop.time() - started)
        return await self.call(server, tool, arguments, timeout_s=max(left, 0.0))

    @staticmethod
    def _refused(conn: Connection, server: str, tool: str, exc: MCPError) -> ToolError:
        """What a JSON-RPC error answering a call means: the session ended, or only the call
        failed."""
        if conn.rejected is None:
            if not _connection_lost(exc):
                return ToolError(f"MCP server {server} refused the call: {exc.message}")
            conn.fail(exc.message)
            return ToolOutcomeUnknown(
                f"MCP server {server} went away during the call ({exc.message}); it may have "
                "acted, and it is restarted on the next call"
            )
        status, reason = conn.rejected
        conn.fail_rejected()
        if status < 500:
            # A 4xx answer: the server did not take the request in, so nothing ran.
            return ToolError(
                f"MCP server {server} rejected the session ({reason}: {exc.message}); {tool} "
                "was not run, and the next call connects anew"
            )
        return ToolOutcomeUnknown(
            f"MCP server {server} failed the call ({reason}: {exc.message}); it may have "
            "acted, and the next call connects anew"
        )

    async def _connect(self, slot: _Slot, *, within: float | None) -> Connection:
        """The server's connection once up, waiting at most ``within`` (None: until its
        start ends); _NotUp if it is still starting then, ToolError if it is down."""
        try:
            async with asyncio.timeout(within):
                return await self._connect_now(slot)
        except TimeoutError:
            raise _NotUp(
                f"MCP server {slot.config.name} is not connected yet: it did not come up "
                f"within {within or 0:.1f} s"
            ) from None

    async def _connect_now(self, slot: _Slot) -> Connection:
        name = slot.config.name
        async with slot.lock:
            if self._closed:
                raise ToolError(f"MCP server {name} is shut down")
            conn = slot.conn
            if conn is not None:
                # A session the server refused a request of (no call took the answer).
                conn.fail_rejected()
            if conn is not None and conn.usable:
                # A server whose last call timed out is being checked: a call sent now could
                # be stuck in a wedged server and then reported as "may have acted". Wait for
                # the verdict (the health check's own timeout bounds this).
                await conn.checked()
            if conn is not None and conn.usable:
                self._listed(slot, conn)
                return conn
            if conn is not None and not conn.starting:
                # Let the old connection finish going down, so two copies of a server
                # never run side by side.
                await asyncio.wait({conn.task})
                conn = None
            if conn is None:
                conn = self._start(slot)
            # Shielded: a waiter that gives up leaves the start running for the next one;
            # the connection bounds its own start.
            await asyncio.shield(conn.ready)
            if self._closed:
                raise ToolError(f"MCP server {name} is shut down")
            if not conn.usable:
                raise ToolError(f"MCP server {name} is down: {conn.error or slot.last_error}")
            self._listed(slot, conn)
            return conn

    def _start(self, slot: _Slot) -> Connection:
        config = slot.config
        wait = slot.retry_at - self._clock()
        if wait > 0:
            raise ToolError(
                f"MCP server {config.name} is down ({slot.last_error}); "
                f"next attempt in {wait:.0f} s"
            )
        transport: TransportFactory
        if config.transport == "stdio":
            params = StdioServerParameters(
                command=config.command[0],
                args=list(config.command[1:]),
                env=self._server_env(config),
                cwd=self._cwd,
            )
            errlog = self._stderr or sys.stderr

            def transport(rejected: Callable[[int, str], None]) -> Transport:
                return stdio_client(params, errlog=errlog)

        else:
            assert config.url is not None  # the config model requires it for http
            transport = http_transport(config.url)

        conn = Connection(
            transport,
            name=config.name,
            start_timeout_s=self._connect_timeout_s,
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
        for name in BASE_ENV:
            value = self._environ.get(name)
            if value is not None:
                env[name] = value
        for name in config.env:
            value = self._environ.get(name)
            if value is not None:
                env[name] = value
            else:
                log.warning("MCP server %s: variable %s is not set", config.name, name)
        return env
