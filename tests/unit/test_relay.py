"""Thread Relay's rules, each on its own: the tools' handlers on a real SQLite store, with
the call context a chat's turn gives them (tests/unit/test_relay_pipeline.py runs them
through the tool authority pipeline and the loop)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from geodebot.config.schema import BindingConfig, RelayConfig
from geodebot.engine.ledger import EvidenceLedger
from geodebot.engine.llm.types import Message, TextBlock, ToolResultBlock, ToolUseBlock
from geodebot.engine.modes import Mode
from geodebot.engine.tools.spec import ToolCallContext, ToolError, ToolSpec
from geodebot.logs.redact import Redactor
from geodebot.relay.contracts import (
    CONTRACTS,
    ThreadDeliveryReceiptV1,
    ThreadLocatorV1,
    content_sha256,
    schemas,
)
from geodebot.relay.tools import ThreadRelay
from geodebot.store.records import InboxRow, NewMessage, OutboxRow
from geodebot.store.sqlite import SQLiteStore

ALICE, BOB = "4242", "5151"


def bindings() -> list[BindingConfig]:
    raw: list[dict[str, Any]] = [
        {"platform": "telegram", "channel": "-1", "session": "ops-a", "project": "ops"},
        {"platform": "telegram", "channel": "-2", "session": "ops-b", "project": "ops"},
        {
            "platform": "slack",
            "channel": "C9",
            "session": "ops-s",
            "project": "ops",
            "scope": "thread",
        },
        {"platform": "discord", "channel": "77", "session": "ops-d", "project": "ops"},
        {"platform": "telegram", "channel": "-3", "session": "other-a", "project": "other"},
        {"platform": "telegram", "channel": "-4", "session": "alone"},
    ]
    return [BindingConfig(allowed_users=("*",), **b) for b in raw]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Rig:
    def __init__(self, store: SQLiteStore, tmp_path: Path) -> None:
        self.store = store
        self.clock = Clock()
        self.ledger_path = tmp_path / "ledger.jsonl"
        self.ledger = EvidenceLedger(self.ledger_path, Redactor())
        self.delivered: list[tuple[OutboxRow, InboxRow]] = []
        self.relay = self.make(RelayConfig())

    def make(self, config: RelayConfig, adapters: frozenset[str] | None = None) -> ThreadRelay:
        relay = ThreadRelay(
            self.store,
            bindings(),
            config,
            adapters=adapters if adapters is not None else frozenset({"telegram", "slack"}),
            model="anthropic/model-under-test-1",
            ledger=self.ledger,
            clock=self.clock,
        )
        relay.connect(lambda post, message: self.delivered.append((post, message)))
        return relay

    def spec(self, name: str, relay: ThreadRelay | None = None) -> ToolSpec:
        return next(s for s in (relay or self.relay).specs() if s.name == name)

    async def call(
        self,
        name: str,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
        relay: ThreadRelay | None = None,
    ) -> dict[str, Any]:
        spec = self.spec(name, relay)
        assert spec.arguments_schema.problems(arguments) == []
        return dict(json.loads(await spec.handler(arguments, ctx)))  # type: ignore[arg-type]

    async def refused(
        self,
        name: str,
        arguments: Mapping[str, Any],
        ctx: ToolCallContext,
        relay: ThreadRelay | None = None,
    ) -> str:
        with pytest.raises(ToolError) as caught:
            await self.call(name, arguments, ctx, relay)
        return str(caught.value)

    async def said(self, session: str, user: str, text: str) -> InboxRow:
        """A platform message ``user`` wrote in ``session``'s chat, answered."""
        binding = next(b for b in bindings() if b.session == session.split("/")[0])
        row, _ = await self.store.inbox_add(
            platform=binding.platform,
            event_id=f"ev-{session}-{text}-{user}",
            session_id=session,
            channel=binding.channel,
            thread=None,
            user=user,
            text=text,
            message_id="m1",
        )
        await self.store.ensure_session(session, "daemon")
        await self.store.checkpoint(
            session,
            messages=[
                NewMessage("user", Message.user_text(text).to_json(), row.turn_id),
                NewMessage("assistant", Message.assistant_text("noted").to_json(), row.turn_id),
            ],
        )
        await self.store.inbox_finish(row.id, "done")
        return row


def chat(session: str = "ops-a", user: str = ALICE, **changes: Any) -> ToolCallContext:
    binding = next(b for b in bindings() if b.session == session.split("/")[0])
    ctx = ToolCallContext(
        session,
        "t-inbox-1",
        Mode.DAEMON,
        origin=f"{binding.platform}:{binding.channel}",
        user=user,
    )
    return replace(ctx, **changes)


def send(thread: str = "ops-b", text: str = "deploy is done", **changes: Any) -> dict[str, Any]:
    return {
        "thread": thread,
        "text": text,
        "mode": "user_authored",
        "intent": "notify",
        "idempotency_key": "k-1",
        **changes,
    }


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with SQLiteStore(tmp_path / "state.db") as store:
        rig = Rig(store, tmp_path)
        try:
            yield rig
        finally:
            rig.ledger.close()


def receipt_of(error_text: str) -> dict[str, Any]:
    return dict(json.loads(error_text)["receipt"])


# -- the contracts -------------------------------------------------------------------------
def test_the_four_contracts_export_versioned_json_schemas() -> None:
    exported = schemas()
    assert set(exported) == {
        "ThreadLocatorV1",
        "ThreadReadProjectionV1",
        "ThreadMessageEnvelopeV1",
        "ThreadDeliveryReceiptV1",
    }
    for name, schema in exported.items():
        assert schema["properties"]["schema_version"]["const"] == 1, name
        assert schema["additionalProperties"] is False, name
    # The receipt carries a checksum of the message, never a field for its text.
    assert "text" not in exported["ThreadDeliveryReceiptV1"]["properties"]
    assert "content_sha256" in exported["ThreadDeliveryReceiptV1"]["required"]
    assert len(CONTRACTS) == 4


def test_contracts_refuse_unknown_fields_and_other_versions() -> None:
    locator = {
        "adapter": "telegram",
        "project": "ops",
        "thread": {"session_id": "ops-a", "thread_key": "telegram:-1"},
        "access_scope": "read",
        "capability_revision": "0123456789abcdef",
    }
    assert ThreadLocatorV1.model_validate(locator).schema_version == 1
    with pytest.raises(ValidationError):
        ThreadLocatorV1.model_validate({**locator, "secret": "x"})
    with pytest.raises(ValidationError):
        ThreadLocatorV1.model_validate({**locator, "schema_version": 2})
    with pytest.raises(ValidationError):
        ThreadDeliveryReceiptV1.model_validate(
            {
                "id": "d",
                "source": None,
                "target": None,
                "action": "notify",
                "state": "delivered",
                "at": 1.0,
                "references": {"envelope_id": "e", "idempotency_key": "k"},
                "capability_revision": "c",
                "content_sha256": "not a digest",
            }
        )


# -- reads ---------------------------------------------------------------------------------
async def test_thread_list_shows_the_callers_project_only(rig: Rig) -> None:
    await rig.store.ensure_session("ops-s/1700.1", "daemon")
    await rig.store.ensure_session("other-s/1", "daemon")
    listed = await rig.call("thread_list", {}, chat())
    assert listed["project"] == "ops"
    threads = {t["thread"]: t for t in listed["threads"]}
    assert set(threads) == {"ops-a", "ops-b", "ops-s", "ops-s/1700.1", "ops-d"}
    assert threads["ops-a"]["this_thread"] is True
    assert threads["ops-s/1700.1"]["where"] == "slack:C9/1700.1"
    # A binding without a project is a project of its own.
    alone = await rig.call("thread_list", {}, chat("alone"))
    assert [t["thread"] for t in alone["threads"]] == ["alone"]


async def test_a_read_shows_user_and_assistant_text_only_bounded_with_a_cursor(
    rig: Rig,
) -> None:
    await rig.store.ensure_session("ops-b", "daemon")
    call = ToolUseBlock("tu1", "get_time", {})
    history = [Message.user_text(f"question {i}") for i in range(5)]
    history.insert(2, Message("assistant", (TextBlock("checking"), call)))
    history.insert(3, Message("user", (ToolResultBlock("tu1", "12:00"),)))
    await rig.store.checkpoint(
        "ops-b", messages=[NewMessage(m.role, m.to_json(), "t1") for m in history]
    )
    relay = rig.make(RelayConfig(max_read_messages=3))
    read = await rig.call("thread_read", {"thread": "ops-b"}, chat(), relay)
    assert [m["text"] for m in read["messages"]] == ["question 2", "question 3", "question 4"]
    assert read["revision"] == 7
    assert read["state"] == "idle"
    assert read["cursor"] == f"before:{read['messages'][0]['seq']}"
    older = await rig.call(
        "thread_read", {"thread": "ops-b", "cursor": read["cursor"]}, chat(), relay
    )
    assert [m["text"] for m in older["messages"]] == ["question 0", "question 1", "checking"]
    assert {(e["kind"]) for e in older["excluded"]} == {"tool_call", "tool_result"}
    assert "12:00" not in json.dumps(older)
    assert older["cursor"] is None
    bad = await rig.refused("thread_read", {"thread": "ops-b", "cursor": "before:x"}, chat())
    assert "cursor" in bad
    # Characters are bounded too: the last message shown is cut, and says so.
    short = rig.make(RelayConfig(max_read_chars=200))
    await rig.store.checkpoint(
        "ops-b", messages=[NewMessage("user", Message.user_text("y" * 500).to_json(), "t2")]
    )
    cut = await rig.call("thread_read", {"thread": "ops-b"}, chat(), short)
    assert [len(m["text"]) for m in cut["messages"]] == [200]
    assert cut["messages"][0]["truncated"] is True


async def test_another_projects_thread_does_not_exist_for_the_caller(rig: Rig) -> None:
    for name in ("thread_read", "thread_status"):
        text = await rig.refused(name, {"thread": "other-a"}, chat())
        assert text == "there is no thread 'other-a' in project 'ops'"
        assert await rig.refused(name, {"thread": "nowhere"}, chat()) == (
            "there is no thread 'nowhere' in project 'ops'"
        )
    refused = receipt_of(await rig.refused("thread_send", send("other-a"), chat()))
    assert refused["state"] == "refused"
    assert "no thread 'other-a'" in refused["reason"]
    assert refused["target"] is None
    assert rig.delivered == []
    assert await rig.store.inbox_activity("other-a") == (None, 0)
    # Nothing is written into another project's thread, not even its timeline.
    assert await rig.store.timeline("other-a") == []
    assert await rig.store.get_session("nowhere") is None


async def test_nobody_to_act_for_gets_a_tool_error(rig: Rig) -> None:
    job = ToolCallContext("job-x", "t1", Mode.DAEMON)
    assert "acts for nobody" in await rig.refused("thread_list", {}, job)
    headless = ToolCallContext("run-x", "t1", Mode.HEADLESS, user=ALICE)
    assert "acts for nobody" in await rig.refused("thread_send", send(), headless)
    terminal = ToolCallContext("ipc:me", "t1", Mode.IPC, user="terminal")
    assert "terminal_project" in await rig.refused("thread_list", {}, terminal)


# -- a send --------------------------------------------------------------------------------
async def test_a_notify_is_delivered_once_with_a_receipt_that_holds_no_text(rig: Rig) -> None:
    row = await rig.said("ops-a", ALICE, "deploy is done")
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    result = await rig.call("thread_send", send(), chat())
    receipt = result["receipt"]
    assert receipt["state"] == "delivered"
    assert receipt["references"]["message_ref"] == f"inbox:{row.id}"
    assert receipt["content_sha256"] == content_sha256("deploy is done")
    ThreadDeliveryReceiptV1.model_validate(receipt)
    assert "deploy is done" not in json.dumps(receipt)
    [(post, message)] = rig.delivered
    assert post.channel == "-2"
    assert post.platform == "telegram"
    assert post.kind == "relay"
    assert post.text == "From #ops-a (telegram:-1), by @4242:\n\ndeploy is done"
    assert message.session_id == "ops-b"
    assert message.relay_intent == "notify"
    assert message.relay_id == receipt["id"]
    assert message.event_id == f"relay:{receipt['id']}"
    assert message.text.endswith("\ndeploy is done")
    assert receipt["references"]["target_inbox"] == message.id
    assert receipt["references"]["target_outbox"] == post.id
    stored = await rig.store.relay_get(receipt["id"])
    assert stored is not None
    assert stored.idem_key == "k-1"
    # The envelope is kept for the record, without the text.
    assert "text" not in stored.envelope
    assert stored.envelope["expected_revision"] == 0
    assert stored.envelope["depth"] == 0
    assert stored.envelope["idempotency_key"] == "k-1"
    # Both timelines have it; the evidence ledger has its checksum, never the text.
    sent = [e for e in await rig.store.timeline("ops-a") if e.kind == "relay_sent"]
    got = [e for e in await rig.store.timeline("ops-b") if e.kind == "relay_received"]
    assert [e.data["delivery"] for e in sent] == [receipt["id"]]
    assert [e.data["delivery"] for e in got] == [receipt["id"]]
    rig.ledger.close()
    ledger = rig.ledger_path.read_text()
    assert receipt["id"] in ledger
    assert "deploy is done" not in ledger


async def test_a_repeated_key_delivers_once_and_answers_with_the_first_receipt(
    rig: Rig,
) -> None:
    await rig.said("ops-a", ALICE, "deploy is done")
    await rig.said("ops-a", ALICE, "something else")
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    first = await rig.call("thread_send", send(), chat())
    again = await rig.call("thread_send", send(), chat())
    other = await rig.call("thread_send", send(text="something else"), chat())
    assert again["receipt"] == first["receipt"] == other["receipt"]
    assert "nothing was sent again" in again["note"]
    assert len(rig.delivered) == 1
    assert len(await rig.store.relay_list(session_id="ops-a")) == 1


async def test_user_authored_text_must_be_the_callers_own_message_here(rig: Rig) -> None:
    await rig.said("ops-a", BOB, "bob's words")
    await rig.said("ops-b", ALICE, "alice elsewhere")
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    for text in ("bob's words", "alice elsewhere", "deploy is"):
        refused = receipt_of(await rig.refused("thread_send", send(text=text), chat()))
        assert refused["state"] == "refused"
        assert "exactly a message the user wrote" in refused["reason"]
    assert rig.delivered == []
    # Refusals are recorded without their key: the key can be used once the cause is gone.
    await rig.said("ops-a", ALICE, "deploy is")
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    assert (await rig.call("thread_send", send(text="deploy is"), chat()))["receipt"][
        "state"
    ] == "delivered"


async def test_a_send_needs_a_read_and_a_current_one(rig: Rig) -> None:
    await rig.said("ops-a", ALICE, "deploy is done")
    first = receipt_of(await rig.refused("thread_send", send(), chat()))
    assert first["state"] == "refused"
    assert "read the thread first" in first["reason"]
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    # The target moved on since the read: stale, and nothing changes there.
    await rig.said("ops-b", BOB, "meanwhile")
    stale = receipt_of(await rig.refused("thread_send", send(), chat()))
    assert stale["state"] == "stale"
    assert "revision" in stale["reason"]
    # Both threads' timelines have the refusal; the target's history does not.
    for session in ("ops-a", "ops-b"):
        refusals = [e for e in await rig.store.timeline(session) if e.kind == "relay_refused"]
        assert refusals[-1].data["delivery"] == stale["id"]
        assert refusals[-1].data["state"] == "stale"
    await rig.call("thread_read", {"thread": "ops-b"}, chat())
    # The read is too old: the envelope expired.
    rig.clock.now += RelayConfig().envelope_ttl_s + 1
    expired = receipt_of(await rig.refused("thread_send", send(), chat()))
    assert expired["state"] == "expired"
    assert rig.delivered == []
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    assert (await rig.call("thread_send", send(), chat()))["receipt"]["state"] == "delivered"


async def test_an_active_turn_needs_its_exact_id(rig: Rig) -> None:
    await rig.said("ops-a", ALICE, "deploy is done")
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    busy, _ = await rig.store.inbox_add(
        platform="telegram",
        event_id="busy",
        session_id="ops-b",
        channel="-2",
        thread=None,
        user=BOB,
        text="long job",
        message_id="m9",
    )
    await rig.store.inbox_start(busy.id)
    stale = receipt_of(await rig.refused("thread_send", send(), chat()))
    assert stale["state"] == "stale"
    assert busy.turn_id in stale["reason"]
    status = await rig.call("thread_status", {"thread": "ops-b"}, chat())
    assert status["active_turn"] == busy.turn_id
    assert status["state"] == "running"
    delivered = await rig.call("thread_send", send(), chat())
    assert delivered["receipt"]["state"] == "delivered"


async def test_a_changed_capability_blocks_until_read_again(rig: Rig) -> None:
    await rig.said("ops-a", ALICE, "deploy is done")
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    changed = rig.make(RelayConfig(max_read_messages=5))
    refused = receipt_of(await rig.refused("thread_send", send(), chat(), changed))
    assert "capability revision" in refused["reason"]
    await rig.call("thread_status", {"thread": "ops-b"}, chat(), changed)
    assert (await rig.call("thread_send", send(), chat(), changed))["receipt"][
        "state"
    ] == "delivered"


@pytest.mark.parametrize(
    ("target", "ctx", "relay", "reason"),
    [
        ("ops-b", {"forwarded": 1}, {}, "forwarding depth"),
        ("ops-a", {}, {}, "cannot send into itself"),
        ("ops-d", {}, {}, "no other adapter is used"),
        ("ops-b", {}, {"enabled": False}, "switched off"),
    ],
    ids=["depth-2", "cycle", "adapter-down", "disabled"],
)
async def test_sends_that_may_not_happen_at_all(
    rig: Rig, target: str, ctx: dict[str, Any], relay: dict[str, Any], reason: str
) -> None:
    await rig.said("ops-a", ALICE, "deploy is done")
    instance = rig.make(RelayConfig(**relay))
    await rig.call("thread_status", {"thread": target}, chat(), instance)
    refused = receipt_of(await rig.refused("thread_send", send(target), chat(**ctx), instance))
    assert refused["state"] == "refused"
    assert reason in refused["reason"]
    assert rig.delivered == []
    stored = await rig.store.relay_get(refused["id"])
    assert stored is not None
    assert stored.idem_key is None
    assert stored.state == "refused"


async def test_at_most_four_deliveries_in_flight_even_when_sent_at_once(rig: Rig) -> None:
    for i in range(6):
        await rig.said("ops-a", ALICE, f"note {i}")
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    calls = [
        rig.spec("thread_send").handler(send(text=f"note {i}", idempotency_key=f"k{i}"), chat())
        for i in range(5)
    ]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, ToolError)]
    assert len(refused) == 1
    assert len(rig.delivered) == 4
    assert "in flight" in receipt_of(str(refused[0]))["reason"]
    assert await rig.store.relay_in_flight("ops-a") == 4
    # Once the target took one (recorded it), there is room for another.
    _, first = rig.delivered[0]
    await rig.store.inbox_finish(first.id, "done")
    await rig.store.outbox_finish(rig.delivered[0][0].id, "sent")
    sixth = await rig.call("thread_send", send(text="note 5", idempotency_key="k5"), chat())
    assert sixth["receipt"]["state"] == "delivered"


async def test_an_ask_into_a_thread_of_a_thread_binding_posts_in_that_thread(rig: Rig) -> None:
    await rig.said("ops-a", ALICE, "what broke?")
    await rig.store.ensure_session("ops-s/1700.1", "daemon")
    await rig.call("thread_status", {"thread": "ops-s/1700.1"}, chat())
    result = await rig.call(
        "thread_send", send("ops-s/1700.1", "what broke?", intent="ask"), chat()
    )
    assert result["receipt"]["action"] == "ask"
    [(post, message)] = rig.delivered
    assert (post.platform, post.channel, post.thread) == ("slack", "C9", "1700.1")
    assert (message.session_id, message.thread, message.relay_intent) == (
        "ops-s/1700.1",
        "1700.1",
        "ask",
    )


async def test_the_terminal_relays_in_its_configured_project(rig: Rig) -> None:
    relay = rig.make(RelayConfig(terminal_project="ops"))
    terminal = ToolCallContext("ipc:me", "t1", Mode.IPC, user="terminal")
    await rig.store.ensure_session("ipc:me", "ipc")
    await rig.store.checkpoint(
        "ipc:me", messages=[NewMessage("user", Message.user_text("from me").to_json(), "t0")]
    )
    await rig.call("thread_status", {"thread": "ops-b"}, terminal, relay)
    result = await rig.call("thread_send", send(text="from me"), terminal, relay)
    assert result["receipt"]["references"]["message_ref"] == "seq:1"
    assert rig.delivered[0][0].text.startswith("From #ipc:me (terminal:ipc:me), by @terminal")


def test_relay_schema_prints_the_four_contracts_without_a_config(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from geodebot.cli.main import main

    monkeypatch.setenv("GEODEBOT_CONFIG", str(tmp_path / "missing.toml"))
    assert main(["relay", "schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(schemas()))


def test_an_envelope_between_other_sources_is_unsupported() -> None:
    from geodebot.relay.contracts import ThreadMessageEnvelopeV1

    locator = ThreadLocatorV1(
        adapter="telegram",
        project="ops",
        thread={"session_id": "ops-a", "thread_key": "telegram:-1"},  # type: ignore[arg-type]
        access_scope="read_send",
        capability_revision="0123456789abcdef",
    )
    envelope: dict[str, Any] = {
        "id": "env-1",
        "source": locator,
        "target": locator,
        "project": "ops",
        "user": ALICE,
        "mode": "user_authored",
        "text": "hi",
        "intent": "notify",
        "expected_revision": 0,
        "idempotency_key": "k",
        "expires_at": 1.0,
        "depth": 0,
    }
    assert ThreadMessageEnvelopeV1.model_validate(envelope).role == "user"
    foreign = locator.model_copy(update={"source_type": "otherbot"})
    with pytest.raises(ValidationError, match="'otherbot' is not supported"):
        ThreadMessageEnvelopeV1.model_validate({**envelope, "target": foreign})
    with pytest.raises(ValidationError):
        ThreadMessageEnvelopeV1.model_validate({**envelope, "depth": 2})
    with pytest.raises(ValidationError):
        ThreadMessageEnvelopeV1.model_validate({**envelope, "role": "assistant"})


async def test_a_delivery_the_store_cannot_finish_leaves_the_target_as_it_was(
    rig: Rig, tmp_path: Path
) -> None:
    import sqlite3

    await rig.said("ops-a", ALICE, "deploy is done")
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    before = await rig.store.timeline("ops-b")
    history = await rig.store.load_messages("ops-b")
    # The attributed post, written after the target's inbox row in the same transaction,
    # fails: the whole delivery must be rolled back.
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute(
            "CREATE TRIGGER no_relay_posts BEFORE INSERT ON outbox WHEN NEW.kind = 'relay' "
            "BEGIN SELECT RAISE(ABORT, 'disk says no'); END"
        )
    failed = receipt_of(await rig.refused("thread_send", send(), chat()))
    assert failed["state"] == "failed"
    assert "disk says no" in failed["reason"]
    assert rig.delivered == []
    assert await rig.store.inbox_activity("ops-b") == (None, 0)
    assert await rig.store.load_messages("ops-b") == history
    # Its timeline says what was tried, and nothing of a delivery.
    after = (await rig.store.timeline("ops-b"))[len(before) :]
    assert [(e.kind, e.data["state"]) for e in after] == [("relay_refused", "failed")]
    [recorded] = await rig.store.relay_list(session_id="ops-a")
    assert recorded.state == "failed"
    assert recorded.idem_key is None
    # Once the store takes it again, the same key delivers.
    with sqlite3.connect(tmp_path / "state.db") as db:
        db.execute("DROP TRIGGER no_relay_posts")
    assert (await rig.call("thread_send", send(), chat()))["receipt"]["state"] == "delivered"


async def test_the_records_of_ones_own_notifies_do_not_make_a_read_stale(rig: Rig) -> None:
    for text in ("one", "two", "three"):
        await rig.said("ops-a", ALICE, text)
    await rig.call("thread_status", {"thread": "ops-b"}, chat())
    await rig.call("thread_send", send(text="one", idempotency_key="k1"), chat())
    # The target records the first notify (as the router's record-only turn does), and is
    # still in that turn when the next send comes.
    _, recorded = rig.delivered[0]
    await rig.store.inbox_start(recorded.id)
    await rig.store.checkpoint(
        "ops-b",
        messages=[NewMessage("user", Message.user_text(recorded.text).to_json(), recorded.turn_id)],
    )
    second = await rig.call("thread_send", send(text="two", idempotency_key="k2"), chat())
    assert second["receipt"]["state"] == "delivered"
    await rig.store.inbox_finish(recorded.id, "done")
    # Anything else that lands there is news the read did not see.
    await rig.said("ops-b", BOB, "meanwhile")
    stale = receipt_of(
        await rig.refused("thread_send", send(text="three", idempotency_key="k3"), chat())
    )
    assert stale["state"] == "stale"
