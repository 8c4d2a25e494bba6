"""Stored bindings kept current in a daemon's index (chat/stored_bindings.py), on both stores:
an approval or a removal made through another store object (another process, another
replica) is in force in the index soon after; on PostgreSQL at once, by its wake-up, long
before the next poll; a stored binding that does not validate is left out and said."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from geodebot.chat.bindings import BindingIndex
from geodebot.chat.pairing import NOTICE_EVERY_S, PairingDecisions, format_code, new_code
from geodebot.chat.stored_bindings import StoredBindings
from geodebot.config.schema import BindingConfig, PairingConfig
from geodebot.store.protocol import Store
from geodebot.store.records import PairingAsk
from tests.support.postgres import Place
from tests.support.waiting import until

CONFIGURED = BindingConfig.model_validate(
    {"platform": "telegram", "channel": "-1", "session": "ops", "allowed_users": ["1"]}
)


@pytest.fixture
async def stores(place: Place) -> AsyncIterator[tuple[Store, Store]]:
    async with place.store() as daemon, place.store() as operator:  # type: ignore[attr-defined]
        yield daemon, operator


def asking(user: str) -> PairingAsk:
    return PairingAsk(
        platform="telegram",
        channel=user,
        thread=None,
        user=user,
        user_name="",
        is_dm=True,
        first_text="hi",
        event_id=f"e-{user}",
        message_id="1",
        code=new_code(),
        ttl_s=3600,
        max_pending=10,
        notice_every_s=NOTICE_EVERY_S,
        session_id=f"pairing:telegram:{user}",
        say_code=lambda code, expires: code,
        say_waiting=lambda code, expires: code,
    )


async def test_an_approval_and_a_removal_elsewhere_reach_the_index(
    place: Place, stores: tuple[Store, Store]
) -> None:
    daemon, operator = stores
    index = BindingIndex([CONFIGURED])
    changes: list[int] = []
    # On PostgreSQL the poll is too slow to be what finds the change: the wake-up is.
    poll_s = 60.0 if place.kind == "postgres" else 0.05
    async with StoredBindings(daemon, index, poll_s=poll_s, on_change=lambda: changes.append(1)):
        assert changes == [1]
        asked = await daemon.pairing_request(asking("500"))
        assert asked.pairing is not None
        decisions = PairingDecisions(operator, PairingConfig(enabled=True, tools=("get_time",)))
        await decisions.approve("telegram", format_code(asked.pairing.code), by="ops", via="test")
        await until(lambda: index.find("telegram", "500") is not None, "the approval", timeout=5)
        paired = index.find("telegram", "500")
        assert paired is not None
        assert (paired.session, paired.allowed_users, paired.tools) == (
            "dm:telegram:500",
            ("500",),
            ("get_time",),
        )
        assert index.origin("telegram:500") == "stored"
        assert index.find("telegram", "-1") is CONFIGURED
        await decisions.remove_binding("telegram:500", by="ops", via="test")
        await until(lambda: index.find("telegram", "500") is None, "the removal", timeout=5)
        assert len(changes) == 3


async def test_a_stored_binding_that_does_not_validate_is_left_out_and_said(
    place: Place, stores: tuple[Store, Store], caplog: pytest.LogCaptureFixture
) -> None:
    daemon, operator = stores
    asked = await daemon.pairing_request(asking("600"))
    assert asked.pairing is not None

    def broken(record: object) -> tuple[dict[str, object], None]:
        return {"platform": "telegram", "channel": "600", "session": "", "tools": []}, None

    await operator.pairing_approve("telegram", asked.pairing.code, grant=broken, by="ops")
    index = BindingIndex([CONFIGURED])
    with caplog.at_level(logging.ERROR):
        async with StoredBindings(daemon, index, poll_s=60):
            assert index.find("telegram", "600") is None
            assert index.all() == (CONFIGURED,)
    assert "stored binding telegram:600: session" in caplog.text
