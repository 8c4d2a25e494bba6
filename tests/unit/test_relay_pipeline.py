"""Thread Relay through the tool authority pipeline and the loop, the model being the fake
server: agent-written text goes only with the asker's own approval, a send is its own
receipt, and a relayed notify is recorded without a model call."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec
from geodebot.engine.tools.spec import ApprovalRequest
from geodebot.store.records import ApprovalRecord
from tests.support.app import open_app
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply

ALICE, BOB = "4242", "5151"
RELAY = ["thread_status", "thread_send"]
BINDINGS = [
    {
        "platform": "telegram",
        "channel": "-1",
        "session": "ops-a",
        "project": "ops",
        "allowed_users": ["*"],
        "tools": RELAY,
    },
    {"platform": "telegram", "channel": "-2", "session": "ops-b", "project": "ops"},
]
PROPOSED = "agent_proposed_user_approved"


class Desk:
    """A chat's approval desk that decides each request as a person would, and keeps them."""

    def __init__(self, app: App, approve: bool) -> None:
        self._store = app.services.store
        self._approve = approve
        self.asked: list[ApprovalRecord] = []

    @property
    def approvers(self) -> tuple[str, ...]:
        return ()

    @property
    def timeout_s(self) -> float:
        return 60.0

    async def settle(self, request: ApprovalRecord) -> ApprovalRecord:
        self.asked.append(request)
        decided, counted = await self._store.approval_decide(
            request.id, self._approve, by=request.approvers[0], via="chat"
        )
        assert counted
        assert decided is not None
        return decided


class Terminal:
    def __init__(self) -> None:
        self.asked: list[ApprovalRequest] = []

    async def approve(self, request: ApprovalRequest) -> bool:
        self.asked.append(request)
        return True


@pytest.fixture
async def app(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[App]:
    config = with_sections(
        make_config(tmp_path, llm_server),
        bindings=BINDINGS,
        channels={"telegram": {"token_env": "UNUSED_TOKEN"}},
        relay={"terminal_project": "ops"},
    )
    async with AsyncExitStack() as stack:
        yield await open_app(config, stack, tmp_path / "marker")


def script(server: FakeLLMServer, send: dict[str, Any]) -> None:
    server.script(
        Reply(tool_calls=[Call("thread_status", {"thread": "ops-b"})]),
        Reply(tool_calls=[Call("thread_send", send)]),
        Reply("done"),
    )


def proposed(text: str = "The fix is out.") -> dict[str, Any]:
    return {
        "thread": "ops-b",
        "text": text,
        "mode": PROPOSED,
        "intent": "notify",
        "idempotency_key": "fix-out",
    }


def last_result(server: FakeLLMServer) -> dict[str, Any]:
    content = server.requests[-1].json["messages"][-1]["content"]
    [result] = [b for b in content if b.get("type") == "tool_result"]
    return dict(result)


def chat_spec(desk: Desk | None, user: str | None = ALICE) -> SessionSpec:
    return SessionSpec("ops-a", tools=tuple(RELAY), desk=desk, origin="telegram:-1", user=user)


async def test_agent_written_text_goes_after_the_askers_own_approval(
    app: App, llm_server: FakeLLMServer
) -> None:
    desk = Desk(app, approve=True)
    script(llm_server, proposed())
    result = await app.run_turn(Mode.DAEMON, chat_spec(desk), "tell ops-b the fix is out")
    assert result.ok, result
    # One request, to the person who asked and nobody else, showing the whole text.
    [request] = desk.asked
    assert tuple(request.approvers) == (ALICE,)
    assert "The fix is out." in request.summary
    receipt = json.loads(last_result(llm_server)["content"])["receipt"]
    assert receipt["state"] == "delivered"
    deliveries = await app.services.store.relay_list(session_id="ops-a")
    assert [(d.mode, d.state) for d in deliveries] == [(PROPOSED, "delivered")]
    # The relay's delivery is the call's receipt: the pipeline admitted none of its own.
    assert await app.services.store.list_receipts(session_id="ops-a") == []


async def test_denied_agent_text_is_not_sent(app: App, llm_server: FakeLLMServer) -> None:
    desk = Desk(app, approve=False)
    script(llm_server, proposed())
    result = await app.run_turn(Mode.DAEMON, chat_spec(desk), "tell ops-b the fix is out")
    assert result.ok, result
    assert len(desk.asked) == 1
    block = last_result(llm_server)
    assert block["is_error"] is True
    assert f"{ALICE} denied thread_send" in json.dumps(block)
    assert await app.services.store.relay_list() == []
    assert await app.services.store.inbox_activity("ops-b") == (None, 0)


@pytest.mark.parametrize(
    ("desk", "user"), [(False, None), (True, None)], ids=["job", "chat-without-sender"]
)
async def test_agent_text_cannot_go_where_nobody_can_approve(
    app: App, llm_server: FakeLLMServer, desk: bool, user: str | None
) -> None:
    # Even a pre-authorisation of thread_send does not stand in for the asker.
    spec = SessionSpec(
        "ops-a",
        tools=tuple(RELAY),
        preapproved=("thread_send",),
        desk=Desk(app, approve=True) if desk else None,
        origin="telegram:-1",
        user=user,
    )
    script(llm_server, proposed())
    result = await app.run_turn(Mode.DAEMON, spec, "tell ops-b the fix is out")
    assert result.ok, result
    block = last_result(llm_server)
    assert block["is_error"] is True
    assert "nobody is there to give it" in json.dumps(block)
    assert await app.services.store.relay_list() == []


async def test_agent_text_too_long_to_show_whole_is_refused_unasked(
    app: App, llm_server: FakeLLMServer
) -> None:
    desk = Desk(app, approve=True)
    script(llm_server, proposed("word " * 400))
    result = await app.run_turn(Mode.DAEMON, chat_spec(desk), "tell ops-b a long story")
    assert result.ok, result
    assert desk.asked == []
    assert "must see it whole" in json.dumps(last_result(llm_server))
    assert await app.services.store.relay_list() == []


async def test_the_terminal_user_approves_at_the_terminal(
    app: App, llm_server: FakeLLMServer
) -> None:
    terminal = Terminal()
    script(llm_server, proposed())
    spec = SessionSpec("ipc:me", tools=tuple(RELAY), approver=terminal, user="terminal")
    result = await app.run_turn(Mode.IPC, spec, "tell ops-b the fix is out")
    assert result.ok, result
    [asked] = terminal.asked
    assert asked.tool == "thread_send"
    assert asked.arguments["text"] == "The fix is out."
    [delivery] = await app.services.store.relay_list()
    assert delivery.state == "delivered"
    assert delivery.user == "terminal"


async def test_a_relayed_notify_is_recorded_without_a_model_call(
    app: App, llm_server: FakeLLMServer
) -> None:
    spec = SessionSpec("ops-b", origin="telegram:-2", user=ALICE, forwarded=1)
    recorded = await app.run_turn(
        Mode.DAEMON, spec, "[Relayed] the fix is out", turn_id="t-r1", record_only=True
    )
    assert recorded.ok
    assert llm_server.requests == []
    # The next turn there sees it in its history, before its own message.
    llm_server.script(Reply("noted"))
    answered = await app.run_turn(Mode.DAEMON, spec, "what happened?")
    assert answered.text == "noted"
    texts = [
        block["text"]
        for message in llm_server.requests[0].json["messages"]
        for block in message["content"]
        if block.get("type") == "text"
    ]
    assert texts == ["[Relayed] the fix is out", "what happened?"]


async def test_a_turn_answering_a_relayed_ask_never_shows_the_asker_a_card(
    app: App, llm_server: FakeLLMServer
) -> None:
    desk = Desk(app, approve=True)
    spec = SessionSpec(
        "ops-a", tools=tuple(RELAY), desk=desk, origin="telegram:-1", user=BOB, forwarded=1
    )
    script(llm_server, proposed())
    result = await app.run_turn(Mode.DAEMON, spec, "[Relayed ...] tell ops-b")
    assert result.ok, result
    assert desk.asked == []
    assert "forwarding depth" in json.dumps(last_result(llm_server))
    # Refused by the relay itself, so the attempt has its receipt like any refused send.
    [refused] = await app.services.store.relay_list()
    assert refused.state == "refused"
    assert refused.mode == PROPOSED
    assert await app.services.store.inbox_activity("ops-b") == (None, 0)
