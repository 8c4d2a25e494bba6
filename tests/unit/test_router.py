"""The delivery path without a platform SDK: gate, inbox, lanes, turns, outbox.

The chat side is geodebot.testing.MemoryChannel (a port fake); the model side is the real
anthropic SDK against the fake model server.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App
from geodebot.channels.base import ChannelError, Inbound, SendUnknown
from geodebot.chat.outbox import OutboxSender
from geodebot.chat.pipeline import ChatHooks
from geodebot.chat.router import ChatRouter
from geodebot.config.schema import BindingConfig
from geodebot.engine.session import Observer
from geodebot.store.protocol import Store
from geodebot.store.records import ApprovalRecord, InboxRow, NewOutbound, OutboxRow
from geodebot.testing import MemoryChannel
from tests.support.app import open_app
from tests.support.chat import chat_pipeline
from tests.support.config import make_config, with_sections
from tests.support.control import (
    CONTROL,
    CONTROL_ANSWER,
    answer_controls,
    asks_control,
    until_answered,
)
from tests.support.disk import Disk
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply

ids = itertools.count(1000)


def message(text: str, *, channel: str = "c1", user: str = "u1", **extra: Any) -> Inbound:
    n = next(ids)
    fields: dict[str, Any] = {
        "platform": "telegram",
        "event_id": str(n),
        "channel": channel,
        "thread": None,
        "user": user,
        "text": text,
        "message_id": f"m{n}",
    }
    fields.update(extra)
    return Inbound(**fields)


BINDINGS = [
    {"platform": "telegram", "channel": "c1", "session": "s1", "allowed_users": ["u1"]},
    {"platform": "telegram", "channel": "c2", "session": "s2", "allowed_users": ["*"]},
    {
        "platform": "telegram",
        "channel": "c3",
        "session": "s3",
        "allowed_users": ["*"],
        "require_mention": True,
    },
]


@dataclass
class Harness:
    app: App
    router: ChatRouter
    router_bindings: list[BindingConfig]
    outbox: OutboxSender
    chat: MemoryChannel
    llm: FakeLLMServer
    concurrency: list[int]

    async def replies(self, n: int, channel: str | None = None) -> list[str]:
        async with asyncio.timeout(20):
            return await self.chat.wait_sent(n, channel)

    async def control(self) -> list[str]:
        """A control message in c1 (tests/support/control.py) and its answer; then every text
        sent so far."""
        answer_controls(self.llm)
        await self.chat.deliver(message(CONTROL))
        return await until_answered(self.chat.texts)


@asynccontextmanager
async def harness(
    tmp_path: Path,
    llm: FakeLLMServer,
    *,
    daemon: Mapping[str, Any] | None = None,
    limit: int = 50,
    typing_after_s: float = 0.5,
    also: Observer | None = None,
) -> AsyncIterator[Harness]:
    config = with_sections(
        make_config(tmp_path, llm),
        bindings=BINDINGS,
        daemon={"state_dir": str(tmp_path / "var"), **(daemon or {})},
    )
    running = 0
    peaks: list[int] = [0]

    def observe(event: str, data: Mapping[str, Any]) -> None:
        nonlocal running
        if event == "turn_started":
            running += 1
            peaks[0] = max(peaks[0], running)
        elif event == "turn_finished":
            running -= 1
        if also is not None:
            also(event, data)

    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker", observers=(observe,))
        # The first turn would otherwise wait for the SDK import, and seem slow.
        await app.load_models()
        chat = MemoryChannel("telegram", limit=limit)
        chat_path = chat_pipeline(
            app,
            {"telegram": chat},
            hooks=ChatHooks(typing=chat.typing, typing_after_s=typing_after_s, sleep=_fast_sleep),
            streams=False,
            max_chars={"telegram": 500},
        )
        await chat.start(chat_path.router.accept, chat_path.approvals.press)
        async with chat_path:
            yield Harness(
                app, chat_path.router, config.bindings, chat_path.outbox, chat, llm, peaks
            )


async def _fast_sleep(seconds: float) -> None:
    # Retry-After is honoured, scaled down so the suite stays quick.
    await asyncio.sleep(min(seconds, 0.05))


async def answered(
    store: Store, text: str, *, begin_first_part: bool = False
) -> tuple[InboxRow, OutboxRow]:
    """An event of chat c1 finished with a reply written to the outbox, nothing sent yet."""
    row, _ = await store.inbox_add(
        platform="telegram", event_id="e1", session_id="s1", channel="c1", thread=None,
        user="u1", text="hi", message_id="m1",
    )  # fmt: skip
    reply = NewOutbound("s1", "telegram", "c1", None, "m1", text)
    _, out = await store.inbox_finish(
        row.id, "done", reply=reply, begin_first_part=begin_first_part
    )
    assert out is not None
    return row, out


async def test_bound_message_is_answered_in_its_chat(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("hello back"))
    async with harness(tmp_path, llm_server) as h:
        inbound = message("hello")
        await h.chat.deliver(inbound)
        assert await h.replies(1) == ["hello back"]
        part = h.chat.sent[0]
        assert (part.destination.channel, part.destination.reply_to) == ("c1", inbound.message_id)
        # The answer came at once: no typing indicator was worth a request.
        assert h.chat.typing_calls == []


async def test_the_reply_is_sent_before_the_turns_own_bookkeeping(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # The commit that ends the turn hands the reply over, and the sender runs before the
    # turn's log line and observers: the answer is not kept waiting for them.
    llm_server.script(Reply("first out"), Reply("second out"))
    sent_when_finished: list[int] = []
    chat: list[MemoryChannel] = []
    both = asyncio.Event()

    def finished(event: str, data: Mapping[str, Any]) -> None:
        if event == "turn_finished":
            sent_when_finished.append(len(chat[0].sent))
            if len(sent_when_finished) == 2:
                both.set()

    async with harness(tmp_path, llm_server, also=finished) as h:
        chat.append(h.chat)
        await h.chat.deliver(message("one"))
        assert await h.replies(1) == ["first out"]
        await h.chat.deliver(message("two"))
        assert await h.replies(2) == ["first out", "second out"]
        async with asyncio.timeout(5):
            await both.wait()
    assert sent_when_finished == [1, 2]
    # Handed over once: nothing more arrives after the turn's own hand-over would have come.
    assert [p.text for p in h.chat.sent] == ["first out", "second out"]


async def test_a_slow_turn_shows_typing_in_its_chat(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Delay(0.4, Reply("thought about it")))
    async with harness(tmp_path, llm_server, typing_after_s=0.05) as h:
        await h.chat.deliver(message("hello"))
        assert await h.replies(1) == ["thought about it"]
        assert [d.channel for d in h.chat.typing_calls] == ["c1"]


@pytest.mark.parametrize(
    ("inbound", "reason"),
    [
        (message("hi", channel="unbound"), "unbound"),
        (message("hi", user="stranger"), "user_not_allowed"),
        (message("hi", is_self=True, is_bot=True), "self"),
        (message("hi", channel="c2", is_bot=True), "bot"),
        (message("hi", channel="c3"), "no_mention"),
    ],
    ids=["unbound", "stranger", "self", "other-bot", "no-mention"],
)
async def test_gate_drops_without_a_model_call(
    tmp_path: Path, llm_server: FakeLLMServer, inbound: Inbound, reason: str
) -> None:
    async with harness(tmp_path, llm_server) as h:
        await h.chat.deliver(inbound)
        assert h.router.counters[f"dropped:{reason}"] == 1
        assert sum((await h.app.services.store.inbox_counts()).values()) == 0
        await h.control()
    assert [asks_control(r) for r in llm_server.requests] == [True]
    assert h.chat.texts() == [CONTROL_ANSWER]


async def test_mention_and_dm_pass_the_mention_rule(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("yes?")
    async with harness(tmp_path, llm_server) as h:
        await h.chat.deliver(message("@bot hi", channel="c3", mentions_bot=True))
        assert await h.replies(1) == ["yes?"]


async def test_redelivered_event_is_answered_once(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("once")
    async with harness(tmp_path, llm_server) as h:
        inbound = message("hi")
        await h.chat.deliver(inbound)
        await h.chat.deliver(inbound)
        await h.replies(1)
        assert await h.control() == ["once", CONTROL_ANSWER]
        assert h.router.counters["duplicate"] == 1
    assert [asks_control(r) for r in llm_server.requests] == [False, True]


async def test_the_ack_waits_for_the_inbox_sync_and_the_turn_does_not(
    tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm_server.script(Reply("synced"))
    async with harness(tmp_path, llm_server) as h:
        disk = Disk(monkeypatch)
        disk.go.clear()
        # What the channel does: acknowledge the platform once this returns.
        accepting = asyncio.create_task(h.chat.deliver(message("hello")))
        async with asyncio.timeout(10):
            await disk.sync_started()
            # The turn has reached the model while the message's sync is on its way.
            await llm_server.wait_for_requests(1)
        assert not accepting.done()
        assert h.chat.sent == []  # nor is anything sent before a sync covers it
        disk.go.set()
        async with asyncio.timeout(10):
            await accepting
        assert await h.replies(1) == ["synced"]
        assert disk.synced
        assert all(path.endswith("-wal") for path in disk.synced)


async def test_queued_messages_are_answered_in_order(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Delay(0.5, Reply("first")), Reply("second"), Reply("third"))
    async with harness(tmp_path, llm_server) as h:
        for text in ("one", "two", "three"):
            await h.chat.deliver(message(text))
        assert await h.replies(3) == ["first", "second", "third"]
    asked = [r.json["messages"][-1]["content"][-1]["text"] for r in llm_server.requests]
    assert asked == ["one", "two", "three"]


async def test_sessions_run_concurrently_up_to_the_cap(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Delay(0.4, Reply("done"))
    async with harness(tmp_path, llm_server, daemon={"max_concurrent_sessions": 2}) as h:
        bindings = [("c1", "u1"), ("c2", "anyone")]
        for channel, user in bindings * 2:
            await h.chat.deliver(message("go", channel=channel, user=user))
        await h.replies(4)
    assert h.concurrency[0] == 2


async def test_full_session_queue_answers_busy(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    llm_server.default = Delay(0.5, Reply("slow"))
    async with harness(tmp_path, llm_server, daemon={"session_queue": 1}, limit=4096) as h:
        for text in ("a", "b", "c"):
            await h.chat.deliver(message(text))
        texts = await h.replies(3)
        assert await h.control() == [*texts, CONTROL_ANSWER]
    assert sum("still working" in t for t in texts) == 1
    assert texts.count("slow") == 2
    assert len(h.chat.texts()) == 4


async def test_too_long_message_gets_a_refusal_and_no_model_call(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    async with harness(tmp_path, llm_server, limit=4096) as h:
        await h.chat.deliver(message("x" * 501))
        texts = await h.replies(1)
    assert "limit here is 500" in "".join(texts)
    assert llm_server.requests == []


async def test_chat_commands(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    llm_server.script(Reply("remember 42"), Delay(30, Reply("never")))
    async with harness(tmp_path, llm_server, limit=4096) as h:
        await h.chat.deliver(message("/help"))
        assert "/status" in "".join(await h.replies(1))
        await h.chat.deliver(message("note 42"))
        await h.replies(2)
        await h.chat.deliver(message("/status"))
        status = "".join(await h.replies(3))
        assert "Session: s1" in status
        assert "model-under-test-1" in status
        assert "Computer use: off" in status
        # The one model call so far: 10 input and 5 output tokens, no limit on this chat.
        assert "Tokens today (UTC day): 15\n" in status
        await h.chat.deliver(message("/reset"))
        assert "fresh context" in "".join(await h.replies(4))
        assert await h.app.services.store.load_context("s1") == []
        await h.chat.deliver(message("long job"))
        await asyncio.sleep(0.3)
        await h.app.services.store.set_switch(
            "computer_use", True, by="ops-admin", expires_at=4102444800.0, reason="test"
        )
        await h.chat.deliver(message("/status"))
        busy = (await h.replies(5))[-1]
        assert "Computer use: on (until 2100-01-01 00:00 UTC, by ops-admin)" in busy
        assert "Turn running: yes; queued: 0" in busy
        assert re.search(r"Daemon: 1 of at most \d+ turns running; 0 messages queued", busy)
        await h.chat.deliver(message("/stop"))
        texts = await h.replies(7)
    assert "Stopping the running turn." in "".join(texts)
    assert "Stopped, as asked." in "".join(texts)


async def test_rate_limited_send_is_retried_and_arrives_once(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("after the pause"))
    async with harness(tmp_path, llm_server) as h:
        h.chat.fail_next(ChannelError("429", retry_after=1.0))
        await h.chat.deliver(message("hi"))
        assert await h.replies(1) == ["after the pause"]
        await h.control()
        assert h.chat.texts() == ["after the pause", CONTROL_ANSWER]


async def test_unknown_send_outcome_is_reconciled_not_resent(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("exactly once"))
    async with harness(tmp_path, llm_server) as h:
        h.chat.fail_next(SendUnknown("timed out"))
        await h.chat.deliver(message("hi"))
        await h.replies(1)
        h.outbox.kick()
        await h.outbox._schedule()  # what the kick runs, awaited: the row is queued again
        await h.control()  # queued behind it, in the same chat
        rows = await h.app.services.store.outbox_pending()
    assert h.chat.texts() == ["exactly once", CONTROL_ANSWER]
    # The control's own row may not be marked sent yet; the reconciled one is.
    assert [r for r in rows if r.text != CONTROL_ANSWER] == []


async def test_a_reply_is_begun_by_the_commit_that_writes_it(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("one begin"))
    async with harness(tmp_path, llm_server) as h:
        await h.chat.deliver(message("hi"))
        assert await h.replies(1) == ["one begin"]
        # Delivered after the first row is done with, marked sent included.
        assert await h.control() == ["one begin", CONTROL_ANSWER]
        row = await h.app.services.store.get_outbox(1)
    assert row is not None
    assert (row.status, row.attempts, row.blind_resends) == ("sent", 1, 0)


async def test_a_turn_without_tools_ends_in_one_commit_with_its_reply(
    tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The user's message, the answer, the session's state and the inbox row's reply go to
    # the store together, in the commit that ends the turn, and nothing before it.
    llm_server.script(Reply("in one go"))
    async with harness(tmp_path, llm_server) as h:
        store = h.app.services.store
        calls: list[str] = []
        for name in ("checkpoint", "checkpoint_ending", "inbox_finish"):
            method = getattr(store, name)

            async def counted(*args: Any, _name: str = name, _m: Any = method, **kw: Any) -> Any:
                calls.append(_name)
                return await _m(*args, **kw)

            monkeypatch.setattr(store, name, counted)
        await h.chat.deliver(message("hi"))
        assert await h.replies(1) == ["in one go"]
        context = await store.load_context("s1")
        row = await store.get_inbox(1)
    assert calls == ["checkpoint_ending"]
    assert [(r.role, r.turn_id) for r in context] == [
        ("user", "t-inbox-1"),
        ("assistant", "t-inbox-1"),
    ]
    assert row is not None
    assert (row.status, row.detail) == ("done", "completed")


@pytest.mark.parametrize("lookups", [True, False])
async def test_a_scan_between_the_commit_of_a_reply_and_its_handover_leaves_it_to_the_turn(
    tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: pytest.MonkeyPatch, lookups: bool
) -> None:
    # The turn's last commit writes the reply with its part 0 begun; a pass over pending rows
    # that reads it before the turn hands it over must not take it: taken from a scan, the
    # begun part is an open outcome, looked up or sent again blind (a second copy on a
    # platform that cannot be asked). And the one from a turn that never handed it over
    # (failed after the commit) is still sent, by the next pass.
    llm_server.script(Reply("just the one"))
    async with harness(tmp_path, llm_server) as h:
        h.chat.lookups_supported = lookups
        store = h.app.services.store
        real = store.checkpoint_ending
        scanned: list[bool] = []

        async def then_a_scan(*args: Any, **kw: Any) -> Any:
            ended = await real(*args, **kw)
            await h.outbox._schedule()
            # Known to the sender now only if the scan took it: the turn has not handed it over.
            scanned.append(bool(h.outbox._known))
            return ended

        monkeypatch.setattr(store, "checkpoint_ending", then_a_scan)
        await h.chat.deliver(message("hi"))
        assert await h.replies(1) == ["just the one"]
        await h.control()
        answer = await store.get_outbox(1)
        assert scanned == [False, False]  # the answer, then the control message's
        assert answer is not None
        assert (answer.status, answer.attempts, answer.blind_resends) == ("sent", 1, 0)
        row, _ = await store.inbox_add(
            platform="telegram", event_id="e-left", session_id="s1", channel="c1", thread=None,
            user="u1", text="hi", message_id="m-left",
        )  # fmt: skip
        with h.outbox.handing_over(row.id):
            reply = NewOutbound("s1", "telegram", "c1", None, "m-left", "never handed over")
            _, left = await store.inbox_finish(row.id, "done", reply=reply, begin_first_part=True)
            assert left is not None
            await h.outbox._schedule()
            assert left.id not in h.outbox._known
        await h.outbox._schedule()
        assert await h.replies(3) == ["just the one", CONTROL_ANSWER, "never handed over"]


async def test_a_row_finished_by_another_delivery_does_not_hold_up_its_chat(
    tmp_path: Path, llm_server: FakeLLMServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Were a row ever delivered twice, the second delivery's record finds it finished: not a
    # store failure to wait out (the chat's later replies would wait behind it for good).
    async with harness(tmp_path, llm_server) as h:
        _, out = await answered(h.app.services.store, "twice", begin_first_part=True)
        h.outbox.submit(out, first_part_begun=True)
        assert await h.replies(1) == ["twice"]
        for _ in range(500):  # until the delivery is over and the row forgotten
            if out.id not in h.outbox._known:
                break
            await asyncio.sleep(0.01)
        h.outbox.submit(out, first_part_begun=True)  # the same row, handed over again
        assert await h.replies(2) == ["twice", "twice"]
        assert await h.control() == ["twice", "twice", CONTROL_ANSWER]
        final = await h.app.services.store.get_outbox(out.id)
    assert final is not None
    assert (final.status, final.attempts) == ("sent", 1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "sent as" in errors[0]
    assert "it is already 'sent'" in errors[0]


async def test_a_finished_row_is_not_recorded_again(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # A stop that comes as the turn's last commit lands finds the row finished: the stop's
    # own answer cannot be written, and is not tried again and again.
    async with harness(tmp_path, llm_server) as h:
        store = h.app.services.store
        row, _ = await answered(store, "answer")
        async with asyncio.timeout(5):
            await h.router._record(row, "failed", "Stopped, as asked.", detail="stopped")
        after = await store.get_inbox(row.id)
    assert after is not None
    assert after.status == "done"


@pytest.mark.parametrize("scans", [1, 2])
async def test_a_scan_that_read_a_row_before_its_delivery_finished_leaves_it_alone(
    tmp_path: Path,
    llm_server: FakeLLMServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    scans: int,
) -> None:
    # Reads do not share the writes' queue: a scan of pending rows can come back after the
    # row it read as pending was sent. Queued again, its sent part would look like an open
    # outcome (a failed begin, a lookup, a blind resend) and hold up the chat. Two scans can
    # be out at once (a stop scans while the sender's own pass does).
    async with harness(tmp_path, llm_server) as h:
        store = h.app.services.store
        _, out = await answered(store, "just once")
        real = store.outbox_pending
        read, release = asyncio.Event(), asyncio.Event()

        held = 0

        async def slow(**kw: Any) -> Any:
            nonlocal held
            rows = await real(**kw)
            if any(r.id == out.id for r in rows):
                held += 1
                if held == scans:
                    read.set()
                await release.wait()
            return rows

        monkeypatch.setattr(store, "outbox_pending", slow)
        h.outbox.kick()
        second = asyncio.create_task(h.outbox._schedule()) if scans == 2 else None
        async with asyncio.timeout(5):
            await read.wait()
        h.outbox.submit(out)  # delivered meanwhile, as the router hands a reply over
        assert await h.replies(1) == ["just once"]
        for _ in range(500):  # until the delivery is over and the row forgotten
            if not h.outbox.pending_destinations() and out.id not in h.outbox._known:
                break
            await asyncio.sleep(0.01)
        assert out.id not in h.outbox._known
        release.set()
        if second is not None:
            await second
        await h.control()
        final = await store.get_outbox(out.id)
    assert h.chat.texts() == ["just once", CONTROL_ANSWER]
    assert final is not None
    assert (final.status, final.attempts, final.blind_resends) == ("sent", 1, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_reply_handed_over_as_its_chats_delivery_ends_is_sent_at_once(
    tmp_path: Path, llm_server: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The chat's delivery task has sent its last row and ended, but its end is not yet
    # handled (a done callback waits its turn on the loop) when the next turn hands its reply
    # over. That reply must start a delivery of its own: left in the ending task's queue, it
    # is dropped from it, then waits for a later pass (seconds), which takes its begun part
    # for an open outcome and resends it blind, after replies written later.
    async with harness(tmp_path, llm_server) as h:
        store = h.app.services.store
        rows = []
        for n in (1, 2):
            row, _ = await store.inbox_add(
                platform="telegram", event_id=f"e{n}", session_id="s1", channel="c1",
                thread=None, user="u1", text="hi", message_id=f"m{n}",
            )  # fmt: skip
            rows.append(row)
        first_reply = NewOutbound("s1", "telegram", "c1", None, "m1", "first")
        _, first = await store.inbox_finish(
            rows[0].id, "done", reply=first_reply, begin_first_part=True
        )
        assert first is not None
        real = store.outbox_part_sent
        handed: list[int] = []

        async def then_the_next_reply(*args: Any, **kw: Any) -> Any:
            done = await real(*args, **kw)
            if not handed:
                # Runs after this step ends the delivery task, before the task's callbacks.
                delivery = asyncio.current_task()
                assert delivery is not None
                asyncio.get_running_loop().call_soon(hand_over_second, delivery)
            return done

        def hand_over_second(delivery: asyncio.Task[Any]) -> None:
            handed.append(1 if delivery.done() else 0)
            h.outbox.submit(second, first_part_begun=True)

        monkeypatch.setattr(store, "outbox_part_sent", then_the_next_reply)
        second_reply = NewOutbound("s1", "telegram", "c1", None, "m2", "second")
        with h.outbox.handing_over(rows[1].id):  # its turn is not over: passes leave it
            _, second = await store.inbox_finish(
                rows[1].id, "done", reply=second_reply, begin_first_part=True
            )
            assert second is not None
            h.outbox.submit(first, first_part_begun=True)
            assert await h.replies(2) == ["first", "second"]
        assert handed == [1]  # the race this test is about did happen
        final = await store.get_outbox(second.id)
    assert final is not None
    assert (final.status, final.attempts, final.blind_resends) == ("sent", 1, 0)


@pytest.mark.parametrize("lookups", [True, False])
async def test_a_begun_part_left_by_a_crash_counts_as_perhaps_sent(
    tmp_path: Path, llm_server: FakeLLMServer, lookups: bool
) -> None:
    # The process died between the commit that wrote and began the reply and its send.
    async with harness(tmp_path, llm_server) as h:
        store = h.app.services.store
        # Before the row is there: the outbox's first scan may come any time after it is.
        h.chat.lookups_supported = lookups
        _, out = await answered(store, "after the crash", begin_first_part=True)
        h.outbox.kick()  # a restart's scan finds it; it was never handed over in this life
        assert await h.replies(1) == ["after the crash"]
        await h.control()
        final = await store.get_outbox(out.id)
    assert h.chat.texts() == ["after the crash", CONTROL_ANSWER]
    assert final is not None
    assert final.status == "sent"
    # Not found by a lookup: sent again, knowing it had not arrived. Not looked up: sent
    # again blind, which only one resend may be.
    assert final.blind_resends == (0 if lookups else 1)


async def test_a_part_a_lookup_did_not_find_is_sent_after_a_second_crash_too(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    # Two processes died in turn between beginning the part and sending it; the second had
    # resent it as blind (counted so before lookups were trusted). The platform says it
    # never arrived, so it is sent, not given up as an open outcome.
    async with harness(tmp_path, llm_server) as h:
        store = h.app.services.store
        _, out = await answered(store, "after two crashes", begin_first_part=True)
        await store.outbox_note_blind_resend(out.id)
        await store.outbox_begin_part(out.id, 0)
        h.outbox.kick()
        assert await h.replies(1) == ["after two crashes"]
        await h.control()
        final = await store.get_outbox(out.id)
    assert h.chat.texts() == ["after two crashes", CONTROL_ANSWER]
    assert final is not None
    assert (final.status, final.attempts) == ("sent", 3)


async def test_unknown_outcome_without_lookup_is_resent_at_most_once(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("maybe twice"))
    async with harness(tmp_path, llm_server) as h:
        h.chat.lookups_supported = False
        h.chat.fail_next(SendUnknown("timed out"), SendUnknown("timed out again"))
        await h.chat.deliver(message("hi"))
        await h.replies(2)
        for _ in range(3):
            await h.outbox._schedule()  # what a kick runs, awaited: a pass over pending rows
        await h.control()
        counts = await h.app.services.store.outbox_counts()
    assert h.chat.texts() == ["maybe twice", "maybe twice", CONTROL_ANSWER]
    assert counts.get("failed") == 1


async def test_long_reply_arrives_split_complete_and_in_order(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    answer = "".join(f"{i:04d}" for i in range(60))
    llm_server.script(Reply(answer))
    async with harness(tmp_path, llm_server) as h:
        await h.chat.deliver(message("long please"))
        parts = await h.replies(5)
    assert all(len(p) <= 50 for p in parts)
    assert "".join(parts) == answer


async def test_unanswered_messages_are_answered_after_a_restart(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("answered after restart")
    async with harness(tmp_path, llm_server) as h:
        store = h.app.services.store
        # What a crash leaves: a committed event whose turn never finished.
        row, _ = await store.inbox_add(
            platform="telegram",
            event_id="crash-1",
            session_id="s1",
            channel="c1",
            thread=None,
            user="u1",
            text="are you there?",
            message_id="m-crash",
        )
        await store.inbox_start(row.id)
        assert await h.router.recover() == 1
        assert await h.replies(1) == ["answered after restart"]


async def test_a_row_handed_over_twice_runs_one_turn(
    tmp_path: Path, llm_server: FakeLLMServer, caplog: pytest.LogCaptureFixture
) -> None:
    # The dead-letter feed and recover() both find a row replayed while the daemon starts.
    llm_server.default = Reply("answered once")
    async with harness(tmp_path, llm_server) as h:
        store = h.app.services.store
        row, _ = await store.inbox_add(
            platform="telegram", event_id="twice-1", session_id="s1", channel="c1",
            thread=None, user="u1", text="hello?", message_id="m-twice",
        )  # fmt: skip
        assert await h.router.recover() == 1
        assert h.router.take(row)
        assert await h.replies(1) == ["answered once"]
        await h.router.drain(5)
        assert await store.inbox_unfinished() == []
    assert len(llm_server.requests) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_command_after_a_mention_is_still_a_command(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    async with harness(tmp_path, llm_server, limit=4096) as h:
        await h.chat.deliver(message("<@U0BOT> /help", channel="c3", mentions_bot=True))
        assert "/status" in (await h.replies(1))[0]
    assert llm_server.requests == []


async def test_status_lists_the_calls_waiting_for_approval(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    async with harness(tmp_path, llm_server, limit=4096) as h:
        store = h.app.services.store
        await store.ensure_session("s1", "daemon")
        for call, (tool, expires) in enumerate((("write_file", 4102444800.0), ("edit_file", 0.0))):
            await store.approval_open(
                ApprovalRecord(
                    id=f"a{call}",
                    session_id="s1",
                    turn_id="t-inbox-1",
                    call_id=f"c{call}",
                    tool=tool,
                    safety="write",
                    call_sha256="ab" * 32,
                    summary="{}",
                    origin="telegram:c1",
                    approvers=("4242", "5151"),
                    status="pending",
                    created_at=1.0,
                    expires_at=expires,
                )
            )
        await store.approval_decide("a1", False, by="4242", via="chat")  # expires it
        await h.chat.deliver(message("/status"))
        status = "".join(await h.replies(1))
    assert (
        "Waiting for approval: write_file (write), asked of 4242, 5151, until 2100-01-01 00:00 UTC"
        in status
    )
    assert "edit_file" not in status
