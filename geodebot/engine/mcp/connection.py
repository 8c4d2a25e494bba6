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
from mcp import Client
from mcp import types as mt
from mcp.client import Transport
from mcp.client._transport import TransportStreams
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from geodebot import __version__

log = logging.getLogger(__name__)

_LIST_PAGE_CAP = 50
_CLIENT_INFO = mt.Implementation(name="geodebot", version=__version__)

_Command = Literal["stop", "eof", "probe", "fail"]


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
        transport: Transport,
        *,
        name: str,
        probe_timeout_s: float,
        on_down: Callable[[str | None], None],
    ) -> None:
        self.client: Client | None = None
        self.tools: list[mt.Tool] = []
        self.error: str | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._transport = transport
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
