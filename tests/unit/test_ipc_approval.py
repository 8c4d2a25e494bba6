"""IPC approvals: the terminal user answers yes or no through the socket."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.daemon import ipc_handler
from geodebot.channels.ipc import IPCClient
from tests.support.app import open_app
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.tools import marker_lines


@pytest.mark.parametrize("approve", [True, False], ids=["yes", "no"])
async def test_terminal_user_answers_an_approval_request(
    tmp_path: Path, llm_server: FakeLLMServer, approve: bool
) -> None:
    marker = tmp_path / "marker"
    config = with_sections(
        make_config(tmp_path, llm_server), tools={"ipc_tools": ["write_marker", "get_time"]}
    )
    llm_server.script(
        Reply(tool_calls=[Call("write_marker", {"text": "asked"}, id="c1")]), Reply("over")
    )
    asked: list[dict[str, Any]] = []

    async def answer(request: dict[str, Any]) -> bool:
        asked.append(request)
        return approve

    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, marker)
        server = ipc_handler(app)
        await server.start()
        stack.push_async_callback(server.close)
        async with IPCClient(app.config.socket_path) as client:
            reply = await asyncio.wait_for(client.turn("ipc:t", "write it", answer), 30)
        events = await app.services.store.timeline("ipc:t")
    assert reply["op"] == "reply"
    assert reply["text"] == "over"
    assert [(r["tool"], r["arguments"], r["safety"]) for r in asked] == [
        ("write_marker", {"text": "asked"}, "write")
    ]
    calls = [e.data for e in events if e.kind == "tool_call"]
    if approve:
        assert marker_lines(marker) == ["write_marker:asked"]
        assert calls[0]["approved"] is True
    else:
        assert marker_lines(marker) == []
        assert calls[0]["reason"] == "approval_denied"


async def test_unanswered_approval_times_out_as_no(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    marker = tmp_path / "marker"
    config = with_sections(
        make_config(tmp_path, llm_server),
        tools={"ipc_tools": ["write_marker"], "approval_timeout_s": 0.5},
    )
    llm_server.script(Reply(tool_calls=[Call("write_marker", {"text": "x"})]), Reply("gave up"))

    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, marker)
        server = ipc_handler(app)
        await server.start()
        stack.push_async_callback(server.close)
        async with IPCClient(app.config.socket_path) as client:
            await client.send({"op": "turn", "session": "ipc:t", "text": "go"})
            request = await asyncio.wait_for(client.receive(), 30)
            assert request["op"] == "approval_request"
            reply = await asyncio.wait_for(client.receive(), 30)
            # A late answer to an expired request is an error, never a yes.
            await client.send({"op": "approval", "id": request["id"], "approved": True})
            late = await asyncio.wait_for(client.receive(), 30)
    assert reply["op"] == "reply"
    assert reply["text"] == "gave up"
    assert late == {"op": "error", "message": "no such approval request"}
    assert marker_lines(marker) == []
