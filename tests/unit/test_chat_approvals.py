"""Approvals in the chat, without a platform SDK: card, presses, decision, resumed turn.

The chat side is geodebot.testing.MemoryChannel (cards and presses included); the model is the
real anthropic SDK against the fake model server; the store, engine and tools are the real
app's. Each platform's own buttons are tested through its SDK in tests/e2e.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App
from geodebot.channels.base import ApprovalCard, Inbound, Press, PressAnswer
from geodebot.chat.approvals import NOT_VALID, ChatApprovals
from geodebot.chat.ownership import LocalOwner, SessionOwner
from geodebot.chat.pipeline import ChatHooks
from geodebot.chat.replies import STORE_FAILURE_TEXT
from geodebot.chat.router import ChatRouter
from geodebot.engine.lanes import Grace
from geodebot.testing import MemoryChannel
from tests.support.app import open_app
from tests.support.chat import chat_pipeline
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.tools import marker_lines
from tests.support.waiting import until

ids = itertools.count(5000)
APPROVER = "4242"
SESSION = "tg:ops"


def message(text: str, *, user: str = "u1") -> Inbound:
    n = next(ids)
    return Inbound("telegram", str(n), "c1", None, user, text, f"m{n}")


def binding(**extra: Any) -> dict[str, Any]:
    return {
        "platform": "telegram",
        "channel": "c1",
        "session": SESSION,
        "allowed_users": ["*"],
        "tools": ["write_marker", "get_time"],
        "approvers": [APPROVER, "77"],
        **extra,
    }


class Clock:
    """Wall time, or later: ``skip`` makes every pending card expire without waiting."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@dataclass
class World:
    app: App
    chat: MemoryChannel
    approvals: ChatApprovals
    router: ChatRouter
    llm: FakeLLMServer
    marker: Path

    async def card(self, pending: bool = True) -> tuple[str, ApprovalCard]:
        async with asyncio.timeout(20):
            return await self.chat.wait_card(lambda c: (c.outcome is None) == pending)

    async def replies(self, n: int) -> list[str]:
        async with asyncio.timeout(20):
            return await self.chat.wait_sent(n)


class LeaseLost(LocalOwner):
    """A replica whose sessions' leases it can no longer vouch for: nothing may go out."""

    def holds(self, session_id: str) -> bool:
        return False


@asynccontextmanager
async def world(
    tmp_path: Path,
    llm: FakeLLMServer,
    *,
    chat: MemoryChannel | None = None,
    clock: Callable[[], float] | None = None,
    owner: SessionOwner | None = None,
    **extra: Any,
) -> AsyncIterator[World]:
    config = with_sections(make_config(tmp_path, llm), bindings=[binding(**extra)])
    chat = chat if chat is not None else MemoryChannel("telegram")
    marker = tmp_path / "marker"
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, marker)
        chat_path = chat_pipeline(
            app,
            {"telegram": chat},
            owner=owner,
            hooks=ChatHooks(clock=clock) if clock else None,
            streams=False,
            sends_grace=Grace(5.0),
        )
        await chat.start(chat_path.router.accept, chat_path.approvals.press)
        await stack.enter_async_context(chat_path)
        yield World(app, chat, chat_path.approvals, chat_path.router, llm, marker)


def asks_to_write(llm: FakeLLMServer, text: str = "deploy") -> None:
    llm.script(Reply(tool_calls=[Call("write_marker", {"text": text}, id="w1")]), Reply("over"))


def tool_result_seen(llm: FakeLLMServer) -> str:
    """What the model was told of its write_marker call (the last request's tool result)."""
    for item in reversed(llm.requests[-1].json["messages"][-1]["content"]):
        if item.get("type") == "tool_result":
            content = item["content"]
            return content if isinstance(content, str) else content[0]["text"]
    raise AssertionError("no tool result in the last request")


async def test_an_approver_approves_and_the_call_runs_once(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    asks_to_write(llm_server)
    async with world(tmp_path, llm_server) as w:
        await w.chat.deliver(message("please deploy"))
        card_id, card = await w.card()
        # What the approver reads before pressing: tool, safety, arguments, who, until when.
        assert (card.tool, card.safety, card.approvers) == ("write_marker", "write", ("4242", "77"))
        assert '"text":"deploy"' in card.summary.replace(" ", "")
        assert marker_lines(w.marker) == []
        answer = await w.chat.press(card_id, APPROVER)
        assert answer.counted
        assert answer.text == "Approved."
        assert await w.replies(1) == ["over"]
        _, decided = await w.card(pending=False)
        assert decided.outcome is not None
        assert decided.outcome.startswith("Approved by 4242")
        # A second press, by anyone, changes nothing.
        again = await w.chat.press(card_id, "77", approve=False)
        assert not again.counted
        assert "decided already" in again.text
        events = await w.app.services.store.timeline(SESSION)
        receipts = await w.app.services.store.list_receipts(session_id=SESSION)
    assert marker_lines(w.marker) == ["write_marker:deploy"]
    kinds = [e.kind for e in events]
    assert kinds.count("approval_requested") == 1
    assert kinds.count("approval_decided") == 1
    decided_event = next(e.data for e in events if e.kind == "approval_decided")
    assert (decided_event["by"], decided_event["via"], decided_event["status"]) == (
        APPROVER,
        "chat",
        "approved",
    )
    assert decided_event["approval"] == card.approval_id
    assert [r.approval_id for r in receipts] == [card.approval_id]
    assert len(w.chat.cards) == 1
    call = next(e.data for e in events if e.kind == "tool_call")
    assert (call["approval"], call["decided_by"], call["approved"]) == (
        card.approval_id,
        APPROVER,
        True,
    )
    ledger = w.app.config.ledger_path.read_text()
    assert f'"approved_by": "{APPROVER}"' in ledger or f'"approved_by":"{APPROVER}"' in ledger


async def test_a_non_approver_press_changes_nothing_and_a_denial_is_told_to_the_model(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    asks_to_write(llm_server)
    async with world(tmp_path, llm_server) as w:
        await w.chat.deliver(message("please deploy"))
        card_id, card = await w.card()
        stranger = await w.chat.press(card_id, "u1")
        assert not stranger.counted
        assert stranger.text == "Only 4242, 77 may decide this."
        request = await w.app.services.store.get_approval(card.approval_id)
        assert request is not None
        assert request.status == "pending"
        assert w.chat.cards[card_id].outcome is None
        assert w.chat.texts() == []
        answer = await w.chat.press(card_id, "77", approve=False)
        assert answer.counted
        assert answer.text == "Denied."
        assert await w.replies(1) == ["over\n\n(Not allowed here, so not run: `write_marker`.)"]
        _, decided = await w.card(pending=False)
        events = await w.app.services.store.timeline(SESSION)
    assert marker_lines(w.marker) == []
    assert "77 denied write_marker" in tool_result_seen(llm_server)
    call = next(e.data for e in events if e.kind == "tool_call")
    assert (call["approval"], call["decided_by"], call["reason"]) == (
        card.approval_id,
        "77",
        "approval_denied",
    )
    assert decided.outcome is not None
    assert decided.outcome.startswith("Denied by 77")


async def test_forged_and_foreign_presses_do_nothing(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    asks_to_write(llm_server)
    async with world(tmp_path, llm_server) as w:
        await w.chat.deliver(message("please deploy"))
        card_id, card = await w.card()
        presses = w.chat.presses
        assert presses is not None
        forged = await presses(Press("telegram", "c1", APPROVER, "not-an-id", True, card_id))
        # The right id from another chat (or platform) is not this card's press either.
        foreign = await w.chat.press(card_id, APPROVER, channel="c9")
        other = await presses(Press("slack", "c1", APPROVER, card.approval_id, True, card_id))
        assert [forged, foreign, other] == [PressAnswer(False, NOT_VALID)] * 3
        request = await w.app.services.store.get_approval(card.approval_id)
        assert request is not None
        assert request.status == "pending"
        await w.chat.press(card_id, APPROVER)
        assert await w.replies(1) == ["over"]
    assert marker_lines(w.marker) == ["write_marker:deploy"]


async def test_an_unanswered_card_expires_as_a_denial_the_model_is_told(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    asks_to_write(llm_server)
    clock = Clock()
    async with world(tmp_path, llm_server, clock=clock) as w:
        await w.chat.deliver(message("please deploy"))
        card_id, card = await w.card()
        clock.offset = 10_000.0
        w.approvals.decided(card.approval_id)  # wakes the waiting turn, which finds it late
        assert await w.replies(1) == ["over\n\n(Not allowed here, so not run: `write_marker`.)"]
        _, expired = await w.card(pending=False)
        late = await w.chat.press(card_id, APPROVER)
    assert marker_lines(w.marker) == []
    assert "expired" in tool_result_seen(llm_server)
    assert expired.outcome is not None
    assert expired.outcome.startswith("Expired")
    assert not late.counted
    assert "expired" in late.text


async def test_the_turn_budget_does_not_run_out_on_a_person(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    asks_to_write(llm_server)
    async with world(tmp_path, llm_server, time_budget_s=1.0) as w:
        await w.chat.deliver(message("please deploy"))
        card_id, _ = await w.card()
        # Longer than the whole turn's budget: the wait is outside it.
        await asyncio.sleep(1.5)
        await w.chat.press(card_id, APPROVER)
        assert await w.replies(1) == ["over"]
    assert marker_lines(w.marker) == ["write_marker:deploy"]


async def test_a_pending_card_survives_a_restart_and_a_later_press_resumes_the_turn(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    asks_to_write(llm_server)
    chat = MemoryChannel("telegram")
    async with world(tmp_path, llm_server, chat=chat) as w:
        await w.chat.deliver(message("please deploy"))
        card_id, card = await w.card()
        # The daemon stops while the card waits: the waiting turn does not hold up the
        # shutdown for its grace, and its request stays pending (the inbox row running).
        async with asyncio.timeout(5):
            await w.router.drain(60)
        still = await w.app.services.store.get_approval(card.approval_id)
        assert still is not None
        assert still.status == "pending"
    assert marker_lines(tmp_path / "marker") == []
    async with world(tmp_path, llm_server, chat=chat) as w:
        assert await w.router.recover() == 1
        pending = await w.app.services.store.approvals_pending(session_id=SESSION)
        assert [p.id for p in pending] == [card.approval_id]
        answer = await w.chat.press(card_id, APPROVER)
        assert answer.counted
        assert await w.replies(1) == ["over"]
    # The same card, not a second one; the call ran once; the model was asked once more.
    assert list(chat.cards) == [card_id]
    assert marker_lines(tmp_path / "marker") == ["write_marker:deploy"]
    assert len(llm_server.requests) == 2


async def test_a_preapproved_tool_needs_no_card_and_a_binding_without_approvers_refuses(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    asks_to_write(llm_server, "pre")
    asks_to_write(llm_server, "nobody")
    chat = MemoryChannel("telegram")
    async with world(tmp_path, llm_server, chat=chat, preapproved=["write_marker"]) as w:
        await w.chat.deliver(message("go"))
        assert await w.replies(1) == ["over"]
    async with world(tmp_path, llm_server, chat=chat, approvers=[]) as w:
        await w.chat.deliver(message("go"))
        assert (await w.replies(2))[1].startswith("over\n\n(Not allowed here")
    # Neither asked anybody: the first ran unattended, the second was refused.
    assert chat.cards == {}
    assert marker_lines(tmp_path / "marker") == ["write_marker:pre"]
    assert "nobody can approve" in tool_result_seen(llm_server)


@pytest.mark.parametrize("approvers", [["*"], [""]])
def test_approvers_are_named_people(approvers: list[str]) -> None:
    from geodebot.config.schema import ConfigError, parse_config

    with pytest.raises(ConfigError):
        parse_config({"bindings": [binding(approvers=approvers)]})


async def test_stop_while_a_card_waits_expires_the_request(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    asks_to_write(llm_server)
    async with world(tmp_path, llm_server) as w:
        await w.chat.deliver(message("please deploy"))
        card_id, card = await w.card()
        await w.chat.deliver(message("/stop"))
        _, ended = await w.card(pending=False)
        late = await w.chat.press(card_id, APPROVER)
        request = await w.app.services.store.get_approval(card.approval_id)
    assert ended.outcome is not None
    assert ended.outcome.startswith("Expired")
    assert not late.counted
    assert request is not None
    assert request.status == "expired"
    assert marker_lines(w.marker) == []


async def test_a_replica_that_lost_its_lease_shows_no_card_and_runs_nothing(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # The session's lease (replicas/leases.py) is no longer valid: the card would be a platform
    # message outside the outbox, which the replica that took the session over shows itself;
    # the turn's failure is recorded (the store is not fenced here) and its reply is left in
    # the outbox for that replica to send.
    asks_to_write(llm_server)
    async with world(tmp_path, llm_server, owner=LeaseLost()) as w:
        await w.chat.deliver(message("please deploy"))
        store = w.app.services.store
        await until(store.outbox_pending, "the turn's reply in the outbox")
        assert [row.text for row in await store.outbox_pending()] == [STORE_FAILURE_TEXT]
        [request] = await store.approvals_pending(session_id=SESSION)
        assert request.card.get("state") == "posting"  # for the next holder to post
    assert w.chat.sent == []
    assert not w.chat.cards
    assert marker_lines(w.marker) == []
