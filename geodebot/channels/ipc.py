"""The local IPC channel: newline-delimited JSON over a unix socket (mode 0600).

It is the one channel with a person at the other end who can approve tool calls, so its
sessions run in IPC mode. Frames, one JSON object per line:

client -> daemon   {"op": "turn", "session": "ID", "text": "..."}   |   {"op": "ping"}
                   {"op": "approval", "id": "...", "approved": true|false}   |   {"op": "status"}
daemon -> client   {"op": "reply", "session", "turn_id", "outcome", "text"}
                   {"op": "status", ...}   (what ``geodebot status`` shows)
                   {"op": "approval_request", "id", "tool", "arguments", "safety", "effect",
                    "reason"}   (while a turn runs; unanswered requests time out as "no")
                   {"op": "pong"}   |   {"op": "error", "message": "..."}

One turn runs at a time per connection; the connection keeps reading while it runs, so the
user can answer approval requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from geodebot.engine.session import TurnResult
from geodebot.engine.tools.spec import ApprovalRequest, Approver

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 20
MAX_TEXT_CHARS = 100_000
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107

TurnHandler = Callable[[str, str, Approver], Awaitable[TurnResult]]
StatusHandler = Callable[[], Awaitable[dict[str, Any]]]
ApprovalPrompt = Callable[[dict[str, Any]], Awaitable[bool]]


class IPCError(Exception):
    pass


# _handle's answer for a status request, which needs an await before it can be sent.
_STATUS: dict[str, Any] = {"op": "status"}


def _encode(frame: dict[str, Any]) -> bytes:
    return json.dumps(frame, ensure_ascii=False).encode() + b"\n"


class IPCServer:
    def __init__(
        self, path: Path, on_turn: TurnHandler, on_status: StatusHandler | None = None
    ) -> None:
        self._path = path
        self._on_turn = on_turn
        self._on_status = on_status
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._turns: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> IPCServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        if len(os.fsencode(self._path)) > MAX_SOCKET_PATH:
            raise IPCError(f"socket path too long ({self._path}); choose a shorter state_dir")
        self._remove_stale()
        # The socket must never exist with wider permissions, not even for an instant.
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(
                self._accept, path=str(self._path), limit=MAX_FRAME_BYTES
            )
        finally:
            os.umask(old_umask)
        os.chmod(self._path, 0o600)

    def _remove_stale(self) -> None:
        if not self._path.exists():
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self._path))
        except OSError:
            self._path.unlink()
            return
        finally:
            probe.close()
        raise IPCError(f"another geodebot is already listening on {self._path}")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in [*self._clients, *self._turns]:
                task.cancel()
            await asyncio.gather(*self._clients, *self._turns, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        conn = _Connection(writer)
        try:
            await self._serve_client(reader, conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._clients.discard(task)
            # Nobody is left to answer: pending approvals are a "no". A running turn goes on
            # (its checkpoints keep the conversation); only its reply has nowhere to go.
            conn.close()
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve_client(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        while True:
            try:
                line = await reader.readline()
            except ValueError:
                # The frame was larger than the limit: the stream is no longer framed.
                await conn.send({"op": "error", "message": "frame too large"})
                return
            if not line:
                return
            answer = self._handle(line, conn)
            if answer is _STATUS:
                answer = await self._status()
            if answer is not None:
                await conn.send(answer)

    def _handle(self, line: bytes, conn: _Connection) -> dict[str, Any] | None:
        try:
            frame = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {"op": "error", "message": "frame is not JSON"}
        if not isinstance(frame, dict):
            return {"op": "error", "message": "frame is not a JSON object"}
        op = frame.get("op")
        if op == "ping":
            return {"op": "pong"}
        if op == "status":
            return _STATUS
        if op == "approval":
            if not conn.resolve(frame.get("id"), frame.get("approved") is True):
                return {"op": "error", "message": "no such approval request"}
            return None
        if op != "turn":
            return {"op": "error", "message": f"unknown op {op!r}"}
        return self._start_turn(frame, conn)

    def _start_turn(self, frame: dict[str, Any], conn: _Connection) -> dict[str, Any] | None:
        session, text = frame.get("session"), frame.get("text")
        if not isinstance(session, str) or not session or len(session) > 200:
            return {"op": "error", "message": "session must be a non-empty string"}
        if not isinstance(text, str) or not text.strip():
            return {"op": "error", "message": "text must be a non-empty string"}
        if len(text) > MAX_TEXT_CHARS:
            return {"op": "error", "message": f"message longer than {MAX_TEXT_CHARS} characters"}
        if conn.turn is not None and not conn.turn.done():
            return {"op": "error", "message": "a turn is already running on this connection"}
        conn.turn = asyncio.create_task(self._turn(conn, session, text))
        self._turns.add(conn.turn)
        conn.turn.add_done_callback(self._turns.discard)
        return None

    async def _status(self) -> dict[str, Any]:
        if self._on_status is None:
            return {"op": "error", "message": "this server has no status"}
        try:
            return {"op": "status", **await self._on_status()}
        except Exception:
            log.exception("IPC status failed")
            return {"op": "error", "message": "the status could not be read"}

    async def _turn(self, conn: _Connection, session: str, text: str) -> None:
        try:
            result = await self._on_turn(session, text, conn)
        except Exception:
            # The engine answers its own failures; reaching here is a bug, but the client
            # must still hear back rather than wait forever.
            log.exception("IPC turn in session %s failed", session)
            with contextlib.suppress(ConnectionError):
                await conn.send({"op": "error", "message": "the turn failed inside geodebot"})
            return
        with contextlib.suppress(ConnectionError):
            await conn.send(
                {
                    "op": "reply",
                    "session": result.session_id,
                    "turn_id": result.turn_id,
                    "outcome": result.outcome,
                    "text": result.text,
                }
            )


class _Connection:
    """One client: serialised writes, and the approval requests waiting for its answer."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._lock = asyncio.Lock()
        self._pending: dict[str, asyncio.Future[bool]] = {}
        self._closed = False
        self.turn: asyncio.Task[None] | None = None

    async def send(self, frame: dict[str, Any]) -> None:
        async with self._lock:
            self._writer.write(_encode(frame))
            await self._writer.drain()

    async def approve(self, request: ApprovalRequest) -> bool:
        if self._closed:
            return False
        request_id = uuid.uuid4().hex[:12]
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self.send(
                {
                    "op": "approval_request",
                    "id": request_id,
                    "tool": request.tool,
                    "arguments": dict(request.arguments),
                    "safety": request.safety.value,
                    "effect": request.effect.value,
                    "reason": request.reason,
                }
            )
            return await future
        except ConnectionError:
            return False
        finally:
            self._pending.pop(request_id, None)

    def resolve(self, request_id: object, approved: bool) -> bool:
        future = self._pending.get(request_id) if isinstance(request_id, str) else None
        if future is None or future.done():
            return False
        future.set_result(approved)
        return True

    def close(self) -> None:
        self._closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_result(False)


class IPCClient:
    """A connection to a running daemon, as used by ``geodebot chat``."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> IPCClient:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                str(self._path), limit=MAX_FRAME_BYTES
            )
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise IPCError(
                f"no geodebot daemon is listening on {self._path} (start it with geodebot serve)"
            ) from exc
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        await self.send(frame)
        return await self.receive()

    async def turn(
        self, session: str, text: str, on_approval: ApprovalPrompt | None = None
    ) -> dict[str, Any]:
        """Run a turn; approval requests on the way go to ``on_approval`` (default: no)."""
        answer = await self.request({"op": "turn", "session": session, "text": text})
        while answer.get("op") == "approval_request":
            approved = await on_approval(answer) if on_approval is not None else False
            await self.send({"op": "approval", "id": answer.get("id"), "approved": approved})
            answer = await self.receive()
        return answer

    async def send(self, frame: dict[str, Any]) -> None:
        if self._writer is None:
            raise IPCError("not connected")
        self._writer.write(_encode(frame))
        await self._writer.drain()

    async def receive(self) -> dict[str, Any]:
        if self._reader is None:
            raise IPCError("not connected")
        line = await self._reader.readline()
        if not line:
            raise IPCError("the daemon closed the connection")
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise IPCError("the daemon sent a malformed frame")
        return answer
