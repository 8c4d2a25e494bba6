"""Live updates for open console pages: an engine observer and the console's own actions
feed :class:`LiveFeed`, and ``GET /events`` streams them to each open page as server-sent
events.

It must cost nothing while no page is open: the observer's whole work then is one check.
Each page gets a bounded queue; a page that does not keep up is dropped (its browser
reconnects and reloads the parts it shows) rather than let the queue grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

MAX_CLIENTS = 16
QUEUE_SIZE = 64
KEEP_ALIVE_S = 15.0
# How soon a page that went away gives its stream's place back: a closed connection is seen
# at the next look at the socket, where a write would see it only at the next keep-alive.
GONE_CHECK_S = 1.0

# Engine events and the console topic each one touches (see static/console.js).
_ENGINE_TOPICS = {
    "turn_started": "runs",
    "turn_finished": "runs",
    "tool_call": "runs",
    # A batch is saved before its tools run, and so before any of them waits for a person.
    "batch_saved": "approvals",
}

_Event = tuple[str, str] | None  # (topic, JSON data); None ends the stream


class LiveFeed:
    """An engine observer (``build_app(observers=...)``) and the SSE endpoint's source."""

    def __init__(
        self,
        *,
        max_clients: int = MAX_CLIENTS,
        queue_size: int = QUEUE_SIZE,
        keep_alive_s: float = KEEP_ALIVE_S,
        gone_check_s: float = GONE_CHECK_S,
    ) -> None:
        self._clients: set[asyncio.Queue[_Event]] = set()
        self._max_clients = max_clients
        self._queue_size = queue_size
        self._keep_alive_s = keep_alive_s
        self._gone_check_s = min(gone_check_s, keep_alive_s)
        self._closed = False
        self.dropped = 0

    @property
    def clients(self) -> int:
        return len(self._clients)

    def __call__(self, event: str, data: Mapping[str, Any]) -> None:
        if not self._clients:
            return
        topic = _ENGINE_TOPICS.get(event)
        if topic is not None:
            self.publish(topic, session=str(data.get("session", "")), kind=event)

    def publish(self, topic: str, **data: str) -> None:
        """Tell every open page that what ``topic`` shows changed."""
        if not self._clients:
            return
        message: _Event = (topic, json.dumps(data, separators=(",", ":")))
        for queue in list(self._clients):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:
                self._drop(queue)

    def _drop(self, queue: asyncio.Queue[_Event]) -> None:
        self._clients.discard(queue)
        self.dropped += 1
        # Emptied so the end mark fits: the stream ends at its next read.
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)

    def close(self) -> None:
        """The server is stopping: every stream ends now, and no new one starts."""
        self._closed = True
        for queue in list(self._clients):
            self._drop(queue)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        if self._closed:
            raise web.HTTPServiceUnavailable(text="the daemon is stopping")
        if len(self._clients) >= self._max_clients:
            raise web.HTTPServiceUnavailable(
                text=f"at most {self._max_clients} pages may follow live updates at once"
            )
        queue: asyncio.Queue[_Event] = asyncio.Queue(self._queue_size)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            }
        )
        try:
            await response.prepare(request)
        except ConnectionError:
            # The page went away (closed, or navigated on) before its stream began.
            return response
        self._clients.add(queue)
        try:
            await response.write(b"retry: 3000\n\n")
            loop = asyncio.get_running_loop()
            quiet_since = loop.time()
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), self._gone_check_s)
                except TimeoutError:
                    transport = request.transport
                    if transport is None or transport.is_closing():
                        break
                    if loop.time() - quiet_since >= self._keep_alive_s:
                        # Proxies close a connection that says nothing for long.
                        await response.write(b": keep-alive\n\n")
                        quiet_since = loop.time()
                    continue
                quiet_since = loop.time()
                if message is None:
                    break
                topic, data = message
                await response.write(f"event: {topic}\ndata: {data}\n\n".encode())
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self._clients.discard(queue)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response
