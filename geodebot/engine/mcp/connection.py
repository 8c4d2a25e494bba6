"""One connection to one MCP server, owned by a task of its own.

The SDK's clients are anyio context managers that must be entered and exited by the same
task, so each connection lives in a long-lived task that owns them and reacts to commands
(stop, health check, connection lost). Tool calls are ordinary requests on the session made
from the caller's task: the SDK correlates responses by id and sends the server a
cancellation when a caller gives up, so a cancelled call never disturbs the owning task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal

import anyio
import httpx2
from mcp import Client
from mcp import types as mt
from mcp.client import Transport
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from geodebot import __version__

log = logging.getLogger(__name__)

_LIST_PAGE_CAP = 50
_CLIENT_INFO = mt.Implementation(name="geodebot", version=__version__)

_Command = Literal["stop", "eof", "probe", "fail"]

# The SDK's own defaults for its HTTP client: a response stream may stay open for minutes.
_HTTP_TIMEOUT = httpx2.Timeout(30.0, read=300.0)
_SESSION_HEADER = "mcp-session-id"

# Builds a connection's transport, given what to call when the server rejects the session.
TransportFactory = Callable[[Callable[[int, str], None]], Transport]


def describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    if isinstance(exc, MCPError):
        text = exc.message
    elif not isinstance(exc, TimeoutError):
        text = f"{type(exc).__name__}: {text}"
    return text[:300]


@asynccontextmanager
async def _watched(
    transport: Transport, on_eof: Callable[[], None]
) -> AsyncIterator[TransportStreams]:
    """The transport's streams, plus ``on_eof()`` when the server side of them ends.

    The session notices a lost server only by failing the requests that wait on it; the pool
    wants to know even when nothing is waiting, to report it and restart cleanly.
    """
    async with transport as (read_stream, write_stream):
        send, receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)

        async def pump() -> None:
            async with send:
                try:
                    async for item in read_stream:
                        await send.send(item)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return  # the session closed first: our own shutdown
            on_eof()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump)
                try:
                    yield receive, write_stream
                finally:
                    tg.cancel_scope.cancel()
        finally:
            receive.close()


def http_transport(url: str) -> TransportFactory:
    """Streamable HTTP to ``url``, reporting every HTTP error answer to a session request.

    The SDK turns such an answer into an ordinary JSON-RPC error (the server's own, when its
    body holds one), which looks exactly like a tool refusing a call; only the status says
    that the server did not accept the request at all. A server that restarted answers a
    stale session with 400 or 404, and so does a proxy in front of one that is gone: the
    session is finished, and only a new connection can work again.
    """

    def build(rejected: Callable[[int, str], None]) -> Transport:
        return _http(url, rejected)

    return build


@asynccontextmanager
async def _http(url: str, rejected: Callable[[int, str], None]) -> AsyncIterator[TransportStreams]:
    async def on_response(response: httpx2.Response) -> None:
        request = response.request
        if _SESSION_HEADER not in request.headers:
            return  # initialize, or a server without sessions: not a session's failure
        status = response.status_code
        # A GET without an event stream is answered 405 by design; the DELETE at the end of
        # a session concerns a session already being given up.
        if (request.method == "POST" and status >= 400) or (
            request.method == "GET" and status in (400, 404)
        ):
            rejected(status, f"HTTP {status} {response.reason_phrase}".strip())

    client = httpx2.AsyncClient(timeout=_HTTP_TIMEOUT, event_hooks={"response": [on_response]})
    async with client, streamable_http_client(url, http_client=client) as streams:
        yield streams


async def list_tools(client: Client) -> list[mt.Tool]:
    tools: list[mt.Tool] = []
    cursor: str | None = None
    for _ in range(_LIST_PAGE_CAP):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


class Connection:
    """One session with one server, owned by its own task from connect to disconnect."""

    def __init__(
        self,
        transport: TransportFactory,
        *,
        name: str,
        start_timeout_s: float,
        probe_timeout_s: float,
        on_down: Callable[[str | None], None],
    ) -> None:
        self.client: Client | None = None
        self.tools: list[mt.Tool] = []
        self.error: str | None = None
        # The HTTP status and reason when the server refused a request of this session (see
        # http_transport): the connection is finished, but is failed by whoever reads it
        # (see fail_rejected), so that the calls in flight get their own answers first.
        self.rejected: tuple[int, str] | None = None
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self._transport = transport(self._rejected)
        self._probe_timeout_s = probe_timeout_s
        self._on_down = on_down
        self._reported = False
        self._inbox: asyncio.Queue[_Command] = asyncio.Queue()
        self._probing = False
        self._probed = asyncio.Event()
        self._probed.set()
        # Set the moment anyone learns the server is gone, before the owning task gets to
        # run, so the next call starts a fresh connection instead of using this one.
        self._lost = False
        self._fail_reason = ""
        self._cancel_reason: str | None = None
        # The start is bounded here, not by whoever waits for it: callers wait only as long
        # as their own deadline allows, and a server that never finishes its handshake must
        # still end as a failure (and back off) rather than stay "starting" for good.
        self._start_timer = loop.call_later(
            start_timeout_s, self._start_timed_out, f"did not start within {start_timeout_s:g} s"
        )
        self.task = asyncio.create_task(self._run(), name=f"mcp-server:{name}")

    @property
    def usable(self) -> bool:
        return self.client is not None and not self._lost

    @property
    def starting(self) -> bool:
        return not self.ready.done()

    def probe(self) -> None:
        """Check, off the caller's path, that a server whose call timed out still answers."""
        if self.usable and not self._probing:
            self._probing = True
            self._probed.clear()
            self._inbox.put_nowait("probe")

    async def checked(self) -> None:
        """Until a health check under way has its verdict (at once if none is)."""
        if self._probed.is_set():
            return
        verdict = asyncio.ensure_future(self._probed.wait())
        try:
            await asyncio.wait({verdict, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            verdict.cancel()

    def fail(self, reason: str) -> None:
        if self.usable:
            self._lost = True
            self._fail_reason = reason
            self._inbox.put_nowait("fail")

    def fail_rejected(self) -> None:
        """Fail a connection whose server refused one of its requests."""
        if self.rejected is not None:
            self.fail(f"the server rejected the session ({self.rejected[1]})")

    def _rejected(self, status: int, reason: str) -> None:
        if self.usable and self.rejected is None:
            self.rejected = (status, reason)

    def _start_timed_out(self, reason: str) -> None:
        if self.starting:
            self.abort(reason)

    def _eof(self) -> None:
        self._lost = True
        self._inbox.put_nowait("eof")

    def stop(self) -> None:
        if self.starting:
            # Still inside the SDK's connect, which reads no commands: cancelling is the
            # only way in, and the stdio transport still reaps its process when cancelled.
            self.abort(None)
        else:
            self._inbox.put_nowait("stop")

    def abort(self, reason: str | None) -> None:
        self._cancel_reason = reason
        self.task.cancel()

    async def _run(self) -> None:
        error: str | None = None
        try:
            async with Client(
                _watched(self._transport, self._eof),
                cache=None,
                client_info=_CLIENT_INFO,
            ) as client:
                self.tools = await list_tools(client)
                self._start_timer.cancel()
                self.client = client
                self.ready.set_result(None)
                error = await self._serve(client)
                # Unusable and reported from here on, while the SDK takes the connection
                # down (which for a wedged stdio server means seconds of escalating signals).
                self.client = None
                self._report(error)
        except asyncio.CancelledError:
            error = self._cancel_reason
            raise
        except Exception as exc:
            error = describe(exc)
            if self._lost and not self.ready.done():
                error = "the server closed the connection while starting (see its stderr)"
            log.debug("MCP connection ended", exc_info=True)
        finally:
            self._start_timer.cancel()
            self.client = None
            self._report(error)
            if not self.ready.done():
                self.ready.set_result(None)

    def _report(self, error: str | None) -> None:
        if not self._reported:
            self._reported = True
            self.error = error
            self._on_down(error)

    async def _serve(self, client: Client) -> str | None:
        while True:
            command = await self._inbox.get()
            if command == "stop":
                return None
            if command == "eof":
                return "the server closed the connection"
            if command == "fail":
                return self._fail_reason
            try:
                with anyio.fail_after(self._probe_timeout_s):
                    await client.list_tools()
            except TimeoutError:
                return f"no answer to a health check within {self._probe_timeout_s:g} s"
            except MCPError as exc:
                if exc.code == mt.CONNECTION_CLOSED:
                    return "the server closed the connection"
                return f"health check failed: {describe(exc)}"
            except Exception as exc:
                log.debug("MCP health check failed", exc_info=True)
                return f"health check failed: {describe(exc)}"
            finally:
                self._probing = False
                self._probed.set()
