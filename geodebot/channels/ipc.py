"""The local IPC channel: newline-delimited JSON over a unix socket (mode 0600).

It is the one channel with a person at the other end who can approve tool calls, so its
sessions run in IPC mode. Frames, one JSON object per line:

client -> daemon   {"op": "turn", "session": "ID", "text": "..."}   |   {"op": "ping"}
daemon -> client   {"op": "reply", "session", "turn_id", "outcome", "text"}
                   {"op": "pong"}   |   {"op": "error", "message": "..."}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from geodebot.engine.session import TurnResult

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 20
MAX_TEXT_CHARS = 100_000
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107

TurnHandler = Callable[[str, str], Awaitable[TurnResult]]


class IPCError(Exception):
    pass


def _encode(frame: dict[str, Any]) -> bytes:
    return json.dumps(frame, ensure_ascii=False).encode() + b"\n"


class IPCServer:
    def __init__(self, path: Path, on_turn: TurnHandler) -> None:
        self._path = path
        self._on_turn = on_turn
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()

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
            for task in list(self._clients):
                task.cancel()
            await asyncio.gather(*self._clients, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            await self._serve_client(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._clients.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            try:
                line = await reader.readline()
            except ValueError:
                # The frame was larger than the limit: the stream is no longer framed.
                writer.write(_encode({"op": "error", "message": "frame too large"}))
                await writer.drain()
                return
            if not line:
                return
            writer.write(_encode(await self._answer(line)))
            await writer.drain()

    async def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            frame = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {"op": "error", "message": "frame is not JSON"}
        if not isinstance(frame, dict):
            return {"op": "error", "message": "frame is not a JSON object"}
        op = frame.get("op")
        if op == "ping":
            return {"op": "pong"}
        if op != "turn":
            return {"op": "error", "message": f"unknown op {op!r}"}
        session, text = frame.get("session"), frame.get("text")
        if not isinstance(session, str) or not session or len(session) > 200:
            return {"op": "error", "message": "session must be a non-empty string"}
        if not isinstance(text, str) or not text.strip():
            return {"op": "error", "message": "text must be a non-empty string"}
        if len(text) > MAX_TEXT_CHARS:
            return {"op": "error", "message": f"message longer than {MAX_TEXT_CHARS} characters"}
        result = await self._on_turn(session, text)
        return {
            "op": "reply",
            "session": result.session_id,
            "turn_id": result.turn_id,
            "outcome": result.outcome,
            "text": result.text,
        }


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
        if self._reader is None or self._writer is None:
            raise IPCError("not connected")
        self._writer.write(_encode(frame))
        await self._writer.drain()
        line = await self._reader.readline()
        if not line:
            raise IPCError("the daemon closed the connection")
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise IPCError("the daemon sent a malformed frame")
        return answer

    async def turn(self, session: str, text: str) -> dict[str, Any]:
        return await self.request({"op": "turn", "session": session, "text": text})
