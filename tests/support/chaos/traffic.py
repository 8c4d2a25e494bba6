"""The chaos run's users: the messages pushed on the fakes whether or not a daemon is up (the
fakes redeliver what was never acknowledged, as the platforms do), and the drain that waits
until everything sent was acknowledged and answered."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial

from tests.support.chaos.plan import ChaosPlan, Outgoing
from tests.support.chaos.stores import ChaosStore, drain_state
from tests.support.chaos.world import USER_DISCORD, USER_SLACK, USER_TG, Fakes, Sent
from tests.support.fakes.slack_server import FakeSlack

_INBOX_EVENTS = "SELECT platform, event_id FROM inbox"


@dataclass
class Traffic:
    plan: ChaosPlan
    fakes: Fakes
    store: ChaosStore
    pushed: int = 0
    progress: asyncio.Condition = field(default_factory=asyncio.Condition)

    def _pushed_past(self, index: int) -> bool:
        return self.pushed > index

    async def sent_past(self, index: int) -> None:
        """Until message ``index`` (0-based) was sent."""
        async with self.progress:
            await self.progress.wait_for(partial(self._pushed_past, index))

    async def send_all(self, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            await asyncio.sleep(out.pause_s)
            await self._send(out)
            async with self.progress:
                self.pushed += 1
                self.progress.notify_all()

    async def _send(self, out: Outgoing) -> None:
        marker = f"CHX{out.index:05d}"
        text = f"{marker} please log to {out.chat.session}.log"
        chat, fakes = out.chat, self.fakes
        if chat.platform == "telegram":
            update_id = fakes.telegram.push_message(int(chat.channel), text, user_id=USER_TG)
            message_id = fakes.telegram.pushed[update_id]["message"]["message_id"]
            event_id, reply_to, envelope = str(update_id), str(message_id), ""
        elif chat.platform == "slack":
            ts = f"{1_700_000_000 + out.index}.000100"
            event = FakeSlack.message_event(chat.channel, USER_SLACK, text, ts=ts)
            event_id, reply_to = f"EvCHX{out.index:05d}", ts
            envelope = await fakes.slack.push_event(event, event_id=event_id)
        else:
            event_id = fakes.discord.push_message(chat.channel, text, author_id=USER_DISCORD)
            reply_to, envelope = event_id, ""
        sent = Sent(out.index, marker, chat, event_id, reply_to, time.monotonic(), envelope)
        fakes.sent.append(sent)

    async def drain(self) -> bool:
        """Until every message is acknowledged and answered and the outbox is empty, then
        ``settle_s`` more; False if that did not happen within ``drain_timeout_s``."""
        deadline = time.monotonic() + self.plan.drain_timeout_s
        while time.monotonic() < deadline:
            if await self._quiet():
                await asyncio.sleep(self.plan.settle_s)
                if await self._quiet():
                    return True
            await asyncio.sleep(0.25)
        return False

    def waiting_for(self) -> list[str]:
        """What the drain still waited for when it gave up: the messages never acknowledged
        or never committed, and the store's cursors, to find where they stopped."""
        fakes, lines = self.fakes, []
        committed = {(str(p), str(e)) for p, e in self.store.rows(_INBOX_EVENTS)}
        for s in fakes.sent:
            if s.chat.platform == "telegram":
                acked = int(s.event_id) < fakes.telegram.confirmed_offset
            elif s.chat.platform == "slack":
                acked = fakes.slack.acked(s.envelope)
            else:
                acked = (s.chat.platform, s.event_id) in committed
            if not acked:
                lines.append(f"{s.marker} {s.chat.platform} {s.event_id} not acknowledged")
        cursors = self.store.rows("SELECT name, value FROM cursors ORDER BY name")
        lines.append(f"cursors: {cursors}")
        d = fakes.discord
        lines.append(f"discord gateway: {d.identify_count} identify, {d.resume_count} resume")
        return lines

    async def _quiet(self) -> bool:
        fakes = self.fakes
        telegram = [int(s.event_id) for s in fakes.sent if s.chat.platform == "telegram"]
        if telegram and fakes.telegram.confirmed_offset <= max(telegram):
            return False
        slack = [s.envelope for s in fakes.sent if s.chat.platform == "slack"]
        if not all(fakes.slack.acked(e) for e in slack):
            return False
        discord = {s.event_id for s in fakes.sent if s.chat.platform == "discord"}
        busy, seen = await asyncio.to_thread(drain_state, self.store)
        return busy == 0 and discord <= seen
