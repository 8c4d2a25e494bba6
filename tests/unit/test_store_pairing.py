"""Pairing requests and stored bindings (store/pairing.py), on both stores: one code per
sender while it lives, at most max_pending per platform even when many ask at once, a
redelivery asks nothing again, a code is decided once and not after it expired, an approval
stores its binding with its welcome and timeline record, and every change of the stored
bindings raises their revision."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from geodebot.chat.pairing import NOTICE_EVERY_S, new_code
from geodebot.store.pairing import PairingRefused
from geodebot.store.protocol import Store
from geodebot.store.records import NewOutbound, PairingAsk, PairingRecord
from tests.support.postgres import Place


@pytest.fixture
async def stores(place: Place) -> AsyncIterator[tuple[Store, Store]]:
    async with place.store() as one, place.store() as other:  # type: ignore[attr-defined]
        yield one, other


def ask(
    user: str, *, event: str | None = None, platform: str = "telegram", **over: Any
) -> PairingAsk:
    fields: dict[str, Any] = {
        "platform": platform,
        "channel": user,
        "thread": None,
        "user": user,
        "user_name": f"name-{user}",
        "is_dm": True,
        "first_text": "hello there",
        "event_id": event or f"ev-{user}-{new_code()}",
        "message_id": "7",
        "code": new_code(),
        "ttl_s": 3600.0,
        "max_pending": 3,
        "notice_every_s": NOTICE_EVERY_S,
        "session_id": f"pairing:{platform}:{user}",
        "say_code": lambda code, expires: f"code {code}",
        "say_waiting": lambda code, expires: f"still waiting {code}",
    }
    fields.update(over)
    return PairingAsk(**fields)


def granting(record: PairingRecord) -> tuple[dict[str, Any], NewOutbound]:
    session = f"dm:{record.platform}:{record.user}"
    data = {
        "platform": record.platform,
        "channel": record.channel,
        "session": session,
        "allowed_users": [record.user],
        "tools": [],
    }
    welcome = NewOutbound(session, record.platform, record.channel, None, None, "welcome")
    return data, welcome


async def test_a_stranger_gets_one_code_and_its_redelivery_nothing(
    stores: tuple[Store, Store],
) -> None:
    store, _ = stores
    first = ask("100", event="e1")
    answer = await store.pairing_request(first)
    assert answer.outcome == "code"
    assert answer.pairing is not None
    assert answer.pairing.code == first.code
    assert answer.outbound is not None
    assert answer.outbound.text == f"code {first.code}"
    assert answer.outbound.channel == "100"
    assert answer.outbound.reply_to == "7"
    # The same event again (a redelivery): nothing new, no second reply.
    again = await store.pairing_request(ask("100", event="e1"))
    assert (again.outcome, again.outbound) == ("quiet", None)
    # A new message within the notice interval: quiet too, and still the first code.
    later = await store.pairing_request(ask("100", event="e2"))
    assert later.outcome == "quiet"
    assert later.pairing is not None
    assert later.pairing.code == first.code
    [pending] = await store.pairings(status="pending")
    assert (pending.user, pending.first_text, pending.user_name) == (
        "100",
        "hello there",
        "name-100",
    )
    outbox = await store.outbox_pending(platform="telegram")
    assert [row.text for row in outbox] == [f"code {first.code}"]


async def test_a_waiting_sender_is_told_again_after_a_minute_with_the_same_code(
    place: Place, stores: tuple[Store, Store]
) -> None:
    store, _ = stores
    first = await store.pairing_request(ask("100", event="e1"))
    assert first.pairing is not None
    place.execute("UPDATE pairings SET noticed_at = noticed_at - ?", (NOTICE_EVERY_S + 1,))
    told = await store.pairing_request(ask("100", event="e2"))
    assert told.outcome == "waiting"
    assert told.outbound is not None
    assert told.outbound.text == f"still waiting {first.pairing.code}"
    assert (await store.pairing_request(ask("100", event="e3"))).outcome == "quiet"


async def test_many_strangers_at_once_get_at_most_max_pending_codes(
    stores: tuple[Store, Store],
) -> None:
    one, other = stores
    answers = await asyncio.gather(
        *((one if n % 2 else other).pairing_request(ask(str(1000 + n))) for n in range(20))
    )
    outcomes = sorted(a.outcome for a in answers)
    assert outcomes.count("code") == 3
    assert outcomes.count("full") == 17
    assert len(await one.pairings(status="pending")) == 3
    assert len(await one.outbox_pending()) == 3
    # Another platform has its own limit.
    assert (await one.pairing_request(ask("5", platform="slack"))).outcome == "code"


async def test_a_code_is_approved_once_with_its_binding_welcome_and_timeline(
    stores: tuple[Store, Store],
) -> None:
    store, other = stores
    asked = await store.pairing_request(ask("100"))
    assert asked.pairing is not None
    code = asked.pairing.code
    revision = await store.stored_bindings_revision()
    record, binding, welcome = await other.pairing_approve(
        "telegram", code, grant=granting, by="ops"
    )
    assert (record.status, record.decided_by, record.binding_key) == (
        "approved",
        "ops",
        "telegram:100",
    )
    assert binding.key == "telegram:100"
    assert binding.origin == f"pairing:{code}"
    assert welcome is not None
    assert welcome.text == "welcome"
    assert await store.stored_bindings_revision() == revision + 1
    [stored] = await store.stored_bindings()
    assert (stored.key, stored.data["session"], stored.created_by) == (
        "telegram:100",
        "dm:telegram:100",
        "ops",
    )
    events = await store.timeline("dm:telegram:100")
    assert [e.kind for e in events] == ["pairing_approved"]
    assert events[0].data["by"] == "ops"
    assert events[0].data["code"] == code
    with pytest.raises(PairingRefused, match="approved already"):
        await store.pairing_approve("telegram", code, grant=granting, by="ops")
    with pytest.raises(PairingRefused, match="approved already"):
        await store.pairing_deny("telegram", code, by="ops")
    with pytest.raises(PairingRefused, match="no request"):
        await store.pairing_approve("telegram", new_code(), grant=granting, by="ops")
    # The chat is bound now: its next message is for the binding.
    bound = await store.pairing_request(ask("100"))
    assert bound.outcome == "bound"
    assert bound.binding is not None
    assert bound.binding.key == "telegram:100"


async def test_an_expired_code_cannot_be_approved_and_the_sender_may_ask_again(
    place: Place, stores: tuple[Store, Store]
) -> None:
    store, _ = stores
    asked = await store.pairing_request(ask("100"))
    assert asked.pairing is not None
    place.execute("UPDATE pairings SET expires_at = expires_at - 7200")
    assert [p.state(asked.pairing.created_at + 1) for p in await store.pairings()] == ["expired"]
    assert await store.pairings(status="pending") == []
    with pytest.raises(PairingRefused, match="expired"):
        await store.pairing_approve("telegram", asked.pairing.code, grant=granting, by="ops")
    assert await store.stored_bindings() == []
    again = await store.pairing_request(ask("100"))
    assert again.outcome == "code"
    assert again.pairing is not None
    assert again.pairing.code != asked.pairing.code


async def test_a_denied_sender_gets_nothing_until_the_code_would_have_expired(
    place: Place, stores: tuple[Store, Store]
) -> None:
    store, _ = stores
    asked = await store.pairing_request(ask("100"))
    assert asked.pairing is not None
    denied = await store.pairing_deny("telegram", asked.pairing.code, by="ops")
    assert denied.status == "denied"
    place.execute("UPDATE pairings SET noticed_at = noticed_at - ?", (NOTICE_EVERY_S + 1,))
    quiet = await store.pairing_request(ask("100"))
    assert (quiet.outcome, quiet.outbound) == ("quiet", None)
    # A denied request no longer counts against max_pending.
    assert len(await store.pairings(status="pending")) == 0
    place.execute("UPDATE pairings SET expires_at = expires_at - 7200")
    assert (await store.pairing_request(ask("100"))).outcome == "code"


async def test_removing_a_stored_binding_raises_the_revision_and_is_on_the_timeline(
    stores: tuple[Store, Store],
) -> None:
    store, other = stores
    asked = await store.pairing_request(ask("100"))
    assert asked.pairing is not None
    await store.pairing_approve("telegram", asked.pairing.code, grant=granting, by="ops")
    revision = await other.stored_bindings_revision()
    removed = await other.binding_remove("telegram:100", by="ops")
    assert removed is not None
    assert removed.key == "telegram:100"
    assert await store.stored_bindings() == []
    assert await store.stored_bindings_revision() == revision + 1
    assert await other.binding_remove("telegram:100", by="ops") is None
    assert await store.stored_bindings_revision() == revision + 1
    kinds = [e.kind for e in await store.timeline("dm:telegram:100")]
    assert kinds == ["pairing_approved", "binding_removed"]
