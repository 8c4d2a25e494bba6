"""The IPC socket: framing, bad input, permissions, stale sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from geodebot.channels.ipc import MAX_FRAME_BYTES, IPCClient, IPCError, IPCServer
from geodebot.engine.session import TurnResult
from geodebot.engine.tools.spec import Approver


async def echo(session: str, text: str, approver: Approver) -> TurnResult:
    if text == "explode":
        raise RuntimeError("handler bug")
    return TurnResult(session, "t-1", "completed", f"echo: {text}")


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[IPCServer]:
    srv = IPCServer(tmp_path / "g.sock", echo)
    await srv.start()
    yield srv
    await srv.close()


async def raw_exchange(path: Path, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path), limit=MAX_FRAME_BYTES * 2)
    writer.write(payload)
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), timeout=10)
    writer.close()
    await writer.wait_closed()
    return line


async def test_turn_round_trip_and_socket_mode(tmp_path: Path, server: IPCServer) -> None:
    path = tmp_path / "g.sock"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    async with IPCClient(path) as client:
        assert await client.request({"op": "ping"}) == {"op": "pong"}
        answer = await client.turn("s", "hello")
    assert answer["text"] == "echo: hello"
    assert answer["outcome"] == "completed"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"not json\n", "frame is not JSON"),
        (b"[1, 2]\n", "frame is not a JSON object"),
        (b'{"op": "explode"}\n', "unknown op 'explode'"),
        (b'{"op": "turn", "session": "", "text": "x"}\n', "session must be a non-empty string"),
        (b'{"op": "turn", "session": "s", "text": 5}\n', "text must be a non-empty string"),
        (b"\xff\xfe\n", "frame is not JSON"),
    ],
)
async def test_bad_frames_get_a_clear_error(
    tmp_path: Path, server: IPCServer, payload: bytes, message: str
) -> None:
    line = await raw_exchange(tmp_path / "g.sock", payload)
    assert message in line.decode()


async def test_oversized_frame_is_refused_and_server_survives(
    tmp_path: Path, server: IPCServer
) -> None:
    path = tmp_path / "g.sock"
    line = await raw_exchange(path, b'{"op":"turn","text":"' + b"x" * (MAX_FRAME_BYTES + 10))
    assert b"frame too large" in line
    async with IPCClient(path) as client:
        assert (await client.turn("s", "still here"))["text"] == "echo: still here"


async def test_stale_socket_is_replaced_but_a_live_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    first = IPCServer(path, echo)
    await first.start()
    with pytest.raises(IPCError, match="already listening"):
        await IPCServer(path, echo).start()
    await first.close()
    # A socket file left behind by a crash (nobody listening) is cleaned up.
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(path))
    leftover.close()
    second = IPCServer(path, echo)
    await second.start()
    await second.close()
    assert not path.exists()


async def test_client_without_daemon(tmp_path: Path) -> None:
    with pytest.raises(IPCError, match="no geodebot daemon"):
        async with IPCClient(tmp_path / "absent.sock"):
            pass


async def test_a_failing_handler_still_answers(tmp_path: Path, server: IPCServer) -> None:
    async with IPCClient(tmp_path / "g.sock") as client:
        answer = await client.turn("s", "explode")
        assert answer == {"op": "error", "message": "the turn failed inside geodebot"}
        assert (await client.turn("s", "again"))["text"] == "echo: again"
