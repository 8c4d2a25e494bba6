"""Approval cards on the Slack adapter against FakeSlack: Block Kit buttons posted with the real
slack_sdk, presses delivered as Socket Mode ``block_actions`` interactions through slack-bolt."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from geodebot.channels.base import (
    ApprovalCard,
    ChannelError,
    Destination,
    Inbound,
    Press,
    PressAnswer,
    SendUnknown,
    press_data,
    utc_minute,
)
from geodebot.channels.slack import SlackChannel
from geodebot.channels.slack.cards import SECTION_CHARS
from geodebot.config.schema import SlackConfig
from tests.support.fakes.slack_server import Ephemeral, FakeSlack, Fault

CHANNEL = "C0CHAN001"
ALICE = "UALICE001"
BOB = "UBOB00001"
THREAD = "1700000000.000100"
# Model output: Slack markup, a broadcast, a fence and an entity, all to be shown as written.
SUMMARY = '{"cmd": "echo <b>hi</b> *x* _y_ ~z~ <!here> & ``` `q` &amp;"}'
EXPIRES = 1_900_000_000.0

CARD = ApprovalCard(
    approval_id="ap0123456789abcdef",
    tool="shell_run",
    safety="dangerous",
    summary=SUMMARY,
    approvers=(ALICE, "4242"),
    expires_at=EXPIRES,
)


class Inbox:
    """The InboundSink: what the adapter committed as chat messages."""

    def __init__(self) -> None:
        self.inbound: list[Inbound] = []
        self._arrived = asyncio.Condition()

    async def __call__(self, inbound: Inbound) -> None:
        async with self._arrived:
            self.inbound.append(inbound)
            self._arrived.notify_all()

    async def wait_for(self, count: int) -> list[Inbound]:
        async with asyncio.timeout(5), self._arrived:
            await self._arrived.wait_for(lambda: len(self.inbound) >= count)
        return self.inbound


class Presses:
    """The PressSink: records each press and answers from ``answers`` (or raises), can be held."""

    def __init__(self) -> None:
        self.pressed: list[Press] = []
        self.answers: deque[PressAnswer | Exception] = deque()
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self._arrived = asyncio.Condition()

    async def __call__(self, press: Press) -> PressAnswer:
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        async with self._arrived:
            self.pressed.append(press)
            self._arrived.notify_all()
        answer = self.answers.popleft() if self.answers else PressAnswer(False, "unexpected")
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def wait_for(self, count: int) -> list[Press]:
        async with asyncio.timeout(5), self._arrived:
            await self._arrived.wait_for(lambda: len(self.pressed) >= count)
        return self.pressed


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as srv:
        yield srv


@pytest.fixture
def inbox() -> Inbox:
    return Inbox()


@pytest.fixture
def presses() -> Presses:
    return Presses()


def make_channel(fake: FakeSlack) -> SlackChannel:
    config = SlackConfig(api_base_url=fake.api_base_url)
    return SlackChannel(
        config,
        bot_token=fake.bot_token,
        app_token=fake.app_token,
        ping_interval_s=2.0,
        request_timeout_s=1.0,
    )


@pytest.fixture
async def channel(fake: FakeSlack, inbox: Inbox, presses: Presses) -> AsyncIterator[SlackChannel]:
    ch = make_channel(fake)
    await ch.start(inbox, presses)
    yield ch
    await ch.stop()


def unescape(text: str) -> str:
    """Slack's three entities back to characters: what a reader of the message sees."""
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def section_text(fake: FakeSlack, ts: str) -> str:
    message = fake.message(CHANNEL, ts)
    assert message is not None
    [section] = [b for b in message["blocks"] if b["type"] == "section"]
    assert section["text"]["type"] == "mrkdwn"
    text: str = section["text"]["text"]
    return text


async def post_card(channel: SlackChannel, **dest: Any) -> str:
    return (await channel.send_card(Destination("slack", CHANNEL, **dest), CARD)).message_id


# -- posting and editing ----------------------------------------------------------------------
async def test_send_card_posts_the_text_and_two_buttons(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    sent = await channel.send_card(Destination("slack", CHANNEL, reply_to=THREAD), CARD)
    [posted] = fake.posted[CHANNEL]
    assert sent.message_id == posted.ts
    assert posted.thread_ts == THREAD
    buttons = fake.buttons(CHANNEL, posted.ts)
    assert [(b["action_id"], b["text"], b["value"], b["style"]) for b in buttons] == [
        (
            "geodebot_approve",
            {"type": "plain_text", "text": "Approve", "emoji": False},
            press_data(CARD.approval_id, True),
            "primary",
        ),
        (
            "geodebot_deny",
            {"type": "plain_text", "text": "Deny", "emoji": False},
            press_data(CARD.approval_id, False),
            "danger",
        ),
    ]
    text = section_text(fake, posted.ts)
    # Escaped for Slack: no raw <, so no tag, link or broadcast is made of the summary ...
    assert "<" not in text
    assert ">" not in text
    # ... and in a code block, where *x* _y_ ~z~ are not formatting: it reads as written.
    shown = unescape(text)
    # (A ``` inside would end the block early, so zero-width spaces break it up.)
    fenced = SUMMARY.replace("```", "`\u200b`\u200b`")
    assert f"Arguments:\n```\n{fenced}\n```" in shown
    assert "Approval needed: shell_run (dangerous)" in shown
    assert f"May decide: {ALICE}, 4242" in shown
    assert f"Expires: {utc_minute(EXPIRES)}" in shown
    # The fallback text (notifications) says the same in plain lines.
    assert unescape(posted.text).splitlines() == CARD.lines()


async def test_edit_card_shows_the_outcome_and_removes_the_buttons(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    ts = await post_card(channel)
    outcome = f"Approved by {ALICE}, {utc_minute(EXPIRES - 60)}"
    await channel.edit_card(Destination("slack", CHANNEL), ts, replace(CARD, outcome=outcome))
    [posted] = fake.posted[CHANNEL]
    assert posted.edits == 1
    assert fake.buttons(CHANNEL, ts) == []
    message = fake.message(CHANNEL, ts)
    assert message is not None
    assert [b["type"] for b in message["blocks"]] == ["section"]
    shown = unescape(section_text(fake, ts))
    assert shown.endswith(outcome)
    assert "Expires:" not in shown
    assert unescape(posted.text).splitlines()[-1] == outcome


async def test_editing_a_missing_card_is_a_permanent_error(channel: SlackChannel) -> None:
    card = replace(CARD, outcome="Expired")
    with pytest.raises(ChannelError) as info:
        await channel.edit_card(Destination("slack", CHANNEL), "1700000099.000100", card)
    assert info.value.permanent


async def test_a_long_escaped_summary_still_fits_a_section(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    card = replace(CARD, summary="<&>" * 400)  # 1200 characters, over 5000 once escaped
    sent = await channel.send_card(Destination("slack", CHANNEL), card)
    text = section_text(fake, sent.message_id)
    assert len(text) <= SECTION_CHARS
    assert unescape(text).startswith("Approval needed: shell_run")
    assert f"Expires: {utc_minute(EXPIRES)}" in unescape(text)
    assert len(fake.buttons(CHANNEL, sent.message_id)) == 2


@pytest.mark.parametrize(
    ("fault", "retry_after", "permanent", "unknown"),
    [
        (Fault("ratelimited", status=429, retry_after=7), 7.0, False, False),
        (Fault("channel_not_found"), None, True, False),
        (Fault(drop=True), None, False, True),
    ],
    ids=["rate-limited", "not-found", "dropped"],
)
async def test_send_card_errors_map_like_send(
    fake: FakeSlack,
    channel: SlackChannel,
    fault: Fault,
    retry_after: float | None,
    permanent: bool,
    unknown: bool,
) -> None:
    fake.fail("chat.postMessage", fault)
    with pytest.raises(ChannelError) as info:
        await post_card(channel)
    assert info.value.retry_after == retry_after
    assert info.value.permanent is permanent
    assert isinstance(info.value, SendUnknown) is unknown
    assert len(fake.calls_to("chat.postMessage")) == 1  # the SDK did not retry by itself
    assert fake.posted[CHANNEL] == []


async def test_edit_card_on_a_rate_limit_carries_retry_after(
    fake: FakeSlack, channel: SlackChannel
) -> None:
    ts = await post_card(channel)
    fake.fail("chat.update", status=429, error="ratelimited", retry_after=3)
    with pytest.raises(ChannelError) as info:
        await channel.edit_card(Destination("slack", CHANNEL), ts, replace(CARD, outcome="x"))
    assert info.value.retry_after == 3.0
    assert len(fake.buttons(CHANNEL, ts)) == 2  # unchanged


# -- presses ----------------------------------------------------------------------------------
async def test_a_press_reaches_the_sink_and_a_refusal_only_the_presser(
    fake: FakeSlack, channel: SlackChannel, presses: Presses, inbox: Inbox
) -> None:
    ts = await post_card(channel, thread=THREAD)
    presses.answers.append(PressAnswer(False, "Only 4242 may decide this."))
    await fake.push_action(CHANNEL, ts, BOB, action_id="geodebot_approve")
    [ephemeral] = await fake.wait_for_ephemeral(1)
    assert ephemeral == Ephemeral(CHANNEL, BOB, "Only 4242 may decide this.", THREAD)
    assert presses.pressed == [Press("slack", CHANNEL, BOB, CARD.approval_id, True, ts)]
    # Nothing public: no post besides the card, no edit, and no chat message for the inbox.
    assert [p.ts for p in fake.posted[CHANNEL]] == [ts]
    assert fake.calls_to("chat.update") == []
    assert inbox.inbound == []


async def test_a_counted_press_is_acked_without_a_private_answer(
    fake: FakeSlack, channel: SlackChannel, presses: Presses
) -> None:
    ts = await post_card(channel)
    presses.answers.extend([PressAnswer(True, "Denied."), PressAnswer(False, "Already denied.")])
    await fake.push_action(CHANNEL, ts, ALICE, action_id="geodebot_deny")
    await presses.wait_for(1)
    # A second press is the control: its refusal is the only private answer.
    await fake.push_action(CHANNEL, ts, "4242", action_id="geodebot_approve")
    [ephemeral] = await fake.wait_for_ephemeral(1)
    assert (ephemeral.user, ephemeral.text) == ("4242", "Already denied.")
    first, second = presses.pressed
    assert first == Press("slack", CHANNEL, ALICE, CARD.approval_id, False, ts)
    assert (second.user, second.approve) == ("4242", True)
    assert [p.ts for p in fake.posted[CHANNEL]] == [ts]


async def test_a_press_is_acked_before_it_is_decided(
    fake: FakeSlack, channel: SlackChannel, presses: Presses
) -> None:
    ts = await post_card(channel)
    presses.gate = asyncio.Event()
    presses.answers.append(PressAnswer(False, "Only 4242 may decide this."))
    # push_action returns once the envelope is acked; the decision is still held open.
    await fake.push_action(CHANNEL, ts, BOB, action_id="geodebot_approve")
    async with asyncio.timeout(5):
        await presses.entered.wait()
    assert presses.pressed == []
    presses.gate.set()
    [ephemeral] = await fake.wait_for_ephemeral(1)
    assert ephemeral.user == BOB


@pytest.mark.parametrize(
    ("action_id", "value"),
    [
        ("geodebot_approve", "xyz"),
        ("geodebot_approve", "gb:q:abc"),
        ("geodebot_approve", "gb:a:"),
        # A payload that says deny, on the Approve button: neither is taken.
        ("geodebot_approve", press_data(CARD.approval_id, False)),
    ],
    ids=["foreign", "unknown-choice", "no-id", "mismatched"],
)
async def test_a_press_that_is_not_ours_is_answered_not_valid(
    fake: FakeSlack, channel: SlackChannel, presses: Presses, action_id: str, value: str
) -> None:
    ts = await post_card(channel)
    await fake.push_action(CHANNEL, ts, BOB, action_id=action_id, value=value)
    [ephemeral] = await fake.wait_for_ephemeral(1)
    assert (ephemeral.user, ephemeral.text) == (BOB, "This button is not valid.")
    assert presses.pressed == []
    assert not presses.entered.is_set()


async def test_without_a_press_sink_a_press_is_answered_not_valid(
    fake: FakeSlack, inbox: Inbox
) -> None:
    ch = make_channel(fake)
    await ch.start(inbox)
    try:
        ts = await post_card(ch)
        await fake.push_action(CHANNEL, ts, ALICE, action_id="geodebot_approve")
        [ephemeral] = await fake.wait_for_ephemeral(1)
        assert (ephemeral.user, ephemeral.text) == (ALICE, "This button is not valid.")
        assert inbox.inbound == []
    finally:
        await ch.stop()


async def test_a_failing_press_sink_is_answered_and_receiving_goes_on(
    fake: FakeSlack,
    channel: SlackChannel,
    presses: Presses,
    inbox: Inbox,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ts = await post_card(channel)
    presses.answers.extend([RuntimeError("store is gone"), PressAnswer(False, "Not yet.")])
    await fake.push_action(CHANNEL, ts, ALICE, action_id="geodebot_approve")
    [ephemeral] = await fake.wait_for_ephemeral(1)
    assert (ephemeral.user, ephemeral.text) == (ALICE, "That did not work; please try again.")
    assert any(r.levelno >= logging.ERROR and r.exc_info for r in caplog.records)
    # The adapter keeps receiving: a chat message and a further press both go through.
    envelope = await fake.push_event(fake.message_event(CHANNEL, BOB, "still there?"))
    await fake.wait_for_ack(envelope)
    [message] = await inbox.wait_for(1)
    assert message.text == "still there?"
    await fake.push_action(CHANNEL, ts, ALICE, action_id="geodebot_deny")
    assert [e.text for e in await fake.wait_for_ephemeral(2)][1] == "Not yet."
    assert channel.status().counters["press_errors"] == 1


async def test_a_message_of_the_bot_is_deleted(fake: FakeSlack, channel: SlackChannel) -> None:
    # What a replica that lost its session does with a preview it could not record.
    ts = await post_card(channel)
    await channel.delete(Destination("slack", CHANNEL), ts)
    [posted] = fake.posted[CHANNEL]
    assert posted.deleted
    assert fake.message(CHANNEL, ts) is None
    with pytest.raises(ChannelError, match="message_not_found"):
        await channel.delete(Destination("slack", CHANNEL), ts)
