"""A reply part sent by a replica after its session went to another (paused, or cut off,
between its lease check and the request): the new holder may have sent the part itself, and
then the late message is a second copy, deleted once the holder's record shows it
(chat/outbox.py, ``_settle_copy``). The real SQLite store and leases; MemoryChannel as chat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from geodebot.channels.base import Destination, OutboundPart
from geodebot.chat.outbox import OutboxSender, part_key
from geodebot.replicas.leases import SessionLeases
from geodebot.replicas.owner import LeasedOwner
from geodebot.store.records import Fenced, NewOutbound
from geodebot.store.sqlite import SQLiteStore
from geodebot.testing import MemoryChannel


@pytest.mark.parametrize("holder", ["resent it", "found this one", "gave the row up"])
async def test_a_part_sent_after_the_session_was_lost_is_deleted_only_if_the_holder_resent_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holder: str
) -> None:
    async with SQLiteStore(tmp_path / "db.sqlite") as store:
        leases = SessionLeases(store, "r1", ttl_s=30)
        assert await leases.hold("s1") is not None
        chat = MemoryChannel("telegram")
        outbox = OutboxSender(store, {"telegram": chat}, owner=LeasedOwner(store, leases))
        row, _ = await store.inbox_add(
            platform="telegram", event_id="e1", session_id="s1", channel="c1", thread=None,
            user="u1", text="hi", message_id="m1",
        )  # fmt: skip
        reply = NewOutbound("s1", "telegram", "c1", None, "m1", "the answer")
        _, out = await store.inbox_finish(row.id, "done", reply=reply)
        assert out is not None
        record = store.outbox_part_sent
        refused: list[str] = []

        async def lost_meanwhile(outbox_id: int, index: int, message_id: str, **kw: Any) -> Any:
            if not refused:
                refused.append(message_id)
                raise Fenced("writes of 'r1' under lease 'session:s1' (epoch 1) refused")
            return await record(outbox_id, index, message_id, **kw)

        monkeypatch.setattr(store, "outbox_part_sent", lost_meanwhile)
        with pytest.raises(Fenced):
            await outbox.deliver(out)
        assert refused == ["1"]  # sent, then its record refused
        # The new holder, meanwhile (its own process; its writes under its own lease).
        if holder == "resent it":
            dest = Destination("telegram", "c1", None, "m1")
            copy = await chat.send(OutboundPart(dest, "the answer", part_key(out.id, 0)))
            await record(out.id, 0, copy.message_id, last=True)
        elif holder == "found this one":
            await record(out.id, 0, "1", last=True)
        else:
            await store.outbox_finish(out.id, "failed", error="delivery outcome unknown")
        await outbox.stop(0)
    if holder == "resent it":
        assert chat.deleted == ["1"]
        assert chat.messages == {"2": "the answer"}
    else:
        assert chat.deleted == []
        assert chat.messages == {"1": "the answer"}
