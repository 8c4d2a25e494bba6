"""IPC approvals: the terminal user answers yes or no through the socket."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.daemon import ipc_handler
from geodebot.channels.ipc import IPCClient
from geodebot.chat.ownership import LocalOwner
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec
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
        server = ipc_handler(app, LocalOwner())
        await server.start()
        stack.push_async_callback(server.close)
        async with IPCClient(app.config.socket_path) as client:
            reply = await asyncio.wait_for(client.turn("ipc:t", "write it", answer), 30)
        events = await app.services.store.timeline("ipc:t")
        receipts = await app.services.store.list_receipts(session_id="ipc:t")
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
    # The request and the decision are durable, bound to the exact call, on the timeline.
    asked_events = [e.data for e in events if e.kind.startswith("approval_")]
    assert [(e["status"], e.get("by"), e.get("via")) for e in asked_events] == [
        ("pending", None, None),
        ("approved" if approve else "denied", "terminal", "chat"),
    ]
    assert asked_events[0]["call_sha256"] == asked_events[1]["call_sha256"]
    assert len(str(asked_events[0]["call_sha256"])) == 64
    # A denied call names the decision that refused it, and who made it.
    assert calls[0]["approval"] == asked_events[0]["approval"]
    assert calls[0]["decided_by"] == "terminal"
    # The effect's receipt names the decision it ran under; a denied call has no receipt.
    assert [r.approval_id for r in receipts] == ([asked_events[0]["approval"]] if approve else [])


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
        server = ipc_handler(app, LocalOwner())
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
        events = await app.services.store.timeline("ipc:t")
        pending = await app.services.store.approvals_pending()
    assert pending == []
    assert [e.data["status"] for e in events if e.kind.startswith("approval_")] == [
        "pending",
        "expired",
    ]
    assert reply["op"] == "reply"
    assert reply["text"] == "gave up"
    assert late == {"op": "error", "message": "no such approval request"}
    assert marker_lines(marker) == []


class _Person:
    """An approver who decides when the test says so."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.decide = asyncio.Event()

    async def approve(self, request: object) -> bool:
        self.asked.set()
        await self.decide.wait()
        return True


def _approval_model(body: dict[str, Any]) -> Any:
    """Asks to write once, for the first message of a session; answers anything else."""
    messages = body["messages"]
    if "write it" in str(messages[0]) and len(messages) == 1:
        return Reply(tool_calls=[Call("write_marker", {"text": "approved"}, id="c1")])
    return Reply("done")


def _approval_config(tmp_path: Path, llm_server: FakeLLMServer) -> Any:
    return with_sections(
        make_config(tmp_path, llm_server),
        tools={"ipc_tools": ["write_marker", "get_time"]},
        daemon={"state_dir": str(tmp_path / "var"), "max_concurrent_sessions": 1},
    )


async def test_a_person_deciding_does_not_use_up_the_turns_time_budget(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    """The turn waits for its approver longer than its whole time budget and still finishes:
    the budget stands still while a person decides, and is fresh after."""
    marker = tmp_path / "marker"
    llm_server.responder = _approval_model
    person = _Person()
    async with AsyncExitStack() as stack:
        app = await open_app(_approval_config(tmp_path, llm_server), stack, marker)
        await app.load_models()
        spec = SessionSpec("ipc:waits", tools=("write_marker",), time_budget_s=1.0, approver=person)
        parked = asyncio.create_task(app.run_turn(Mode.IPC, spec, "write it"))
        async with asyncio.timeout(10):
            await person.asked.wait()
        # The person takes longer than the turn's whole budget: time passing is the
        # condition under test, so this wait is the test, not a guard.
        await asyncio.sleep(1.5)
        assert not parked.done()
        person.decide.set()
        result = await asyncio.wait_for(parked, 10)
    assert result.ok, result
    assert marker_lines(marker) == ["write_marker:approved"]


async def test_a_turn_waiting_for_a_person_leaves_its_place_to_other_sessions(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    """With one turn allowed at a time, a turn of another session runs to its end while the
    first waits for its approver, instead of queueing behind the decision."""
    marker = tmp_path / "marker"
    llm_server.responder = _approval_model
    person = _Person()
    async with AsyncExitStack() as stack:
        app = await open_app(_approval_config(tmp_path, llm_server), stack, marker)
        spec = SessionSpec("ipc:waits", tools=("write_marker",), approver=person)
        parked = asyncio.create_task(app.run_turn(Mode.IPC, spec, "write it"))
        async with asyncio.timeout(10):
            await person.asked.wait()
        other = await asyncio.wait_for(app.run_turn(Mode.IPC, SessionSpec("ipc:other"), "hi"), 10)
        assert other.ok
        assert not parked.done()
        person.decide.set()
        result = await asyncio.wait_for(parked, 10)
    assert result.ok, result
    assert marker_lines(marker) == ["write_marker:approved"]
