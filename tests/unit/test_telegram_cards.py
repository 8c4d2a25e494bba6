"""Approval cards on the Telegram adapter: buttons out, presses in, against the fake Bot API."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from telegram import Bot, InlineKeyboardButton, InlineKeyboardMarkup
from telegram import error as tg

from geodebot.channels.base import (
    ApprovalCard,
    ChannelError,
    Destination,
    Inbound,
    Press,
    PressAnswer,
    PressSink,
    SendUnknown,
    press_data,
    utc_minute,
)
from geodebot.channels.telegram import TelegramChannel
from geodebot.channels.telegram.cursor import CURSOR_NAME
from geodebot.config.schema import TelegramConfig
from tests.support.fakes.telegram_server import CallbackAnswer, FakeTelegram, html_visible

GROUP = -1001234
APPROVER, STRANGER = 4242, 77
NOT_VALID = "This button is not valid."
TRY_AGAIN = "That did not work; please try again."
OpenChannel = Callable[..., Awaitable[TelegramChannel]]

CARD = ApprovalCard(
    approval_id="r7Kx2pQ9mZ",
    tool="write_file",
    safety="effectful",
    # Model output: markup characters must arrive as written, not as formatting.
    summary='path="notes/<b>plan</b>.md" text="*x* & _y_ </i>"',
    approvers=(str(APPROVER), "5151"),
    expires_at=1_900_000_000.0,
)


class Inbox:
    """The InboundSink: records every message it is handed."""

    def __init__(self) -> None:
        self.items: list[Inbound] = []
        self._changed = asyncio.Event()

    async def __call__(self, inbound: Inbound) -> None:
        self.items.append(inbound)
        self._changed.set()

    async def wait(self, n: int, within: float = 5.0) -> list[Inbound]:
        async with asyncio.timeout(within):
            while len(self.items) < n:
                self._changed.clear()
                await self._changed.wait()
        return self.items


class Presses:
    """The PressSink: records each press and answers with the next scripted answer (an
    exception is raised instead); ``gate`` (when set) holds it open."""

    def __init__(self, *answers: PressAnswer | Exception) -> None:
        self.got: list[Press] = []
        self.answers = list(answers)
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def __call__(self, press: Press) -> PressAnswer:
        self.got.append(press)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


class MemoryCursors:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    async def get_cursor(self, name: str) -> str | None:
        return self.values.get(name)

    async def set_cursor(self, name: str, value: str) -> None:
        self.values[name] = value

    def offset(self) -> int | None:
        raw = self.values.get(CURSOR_NAME)
        return None if raw is None else int(json.loads(raw)["offset"])


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as server:
        yield server


@pytest.fixture
async def open_channel(fake: FakeTelegram) -> AsyncIterator[OpenChannel]:
    opened: list[TelegramChannel] = []

    async def _open(
        inbox: Inbox, presses: PressSink | None = None, cursors: MemoryCursors | None = None
    ) -> TelegramChannel:
        config = TelegramConfig(api_base_url=fake.api_base_url, poll_timeout_s=2)
        channel = TelegramChannel(config, fake.token, cursor_store=cursors)
        opened.append(channel)
        await channel.start(inbox, presses)
        return channel

    yield _open
    for channel in opened:
        await channel.stop()


def group() -> Destination:
    return Destination("telegram", str(GROUP))


async def post_card(channel: TelegramChannel) -> int:
    sent = await channel.send_card(group(), CARD)
    return int(sent.message_id)


async def test_a_card_has_approve_and_deny_and_shows_the_summary_literally(
    fake: FakeTelegram, open_channel: OpenChannel
):
    channel = await open_channel(Inbox())
    fake.push_message(GROUP, "question", user_id=APPROVER, chat_type="supergroup")  # message 1
    dest = Destination("telegram", str(GROUP), thread="7", reply_to="1")
    sent = await channel.send_card(dest, CARD)
    [message] = await fake.wait_for_sent(GROUP, 1)
    assert sent.message_id == str(message.message_id) == "2"
    assert message.reply_markup == {
        "inline_keyboard": [
            [
                {"text": "Approve", "callback_data": press_data(CARD.approval_id, True)},
                {"text": "Deny", "callback_data": press_data(CARD.approval_id, False)},
            ]
        ]
    }
    assert (message.thread_id, message.reply_to_message_id) == (7, 1)
    assert message.parse_mode == "HTML"
    visible = html_visible(message.text)
    assert visible == "\n".join(CARD.lines())
    assert "write_file (effectful)" in visible
    assert 'path="notes/<b>plan</b>.md" text="*x* & _y_ </i>"' in visible
    assert "May decide: 4242, 5151" in visible
    assert "Expires: " + utc_minute(CARD.expires_at) in visible
    assert channel.status().counters["sent"] == 1


async def test_a_card_too_long_for_one_message_is_clipped_not_refused(
    fake: FakeTelegram, open_channel: OpenChannel
):
    channel = await open_channel(Inbox())
    huge = dataclasses.replace(CARD, summary="<&>" * 3000)
    await channel.send_card(group(), huge)
    [message] = await fake.wait_for_sent(GROUP, 1)
    visible = html_visible(message.text)
    assert visible.startswith("Approval needed: write_file (effectful)\nArguments: <&><&>")
    assert "\u2026\nMay decide: 4242, 5151\nExpires: " in visible
    assert len(message.buttons) == 2


async def test_editing_a_decided_card_shows_the_outcome_and_removes_the_buttons(
    fake: FakeTelegram, open_channel: OpenChannel
):
    channel = await open_channel(Inbox())
    message_id = await post_card(channel)
    decided = dataclasses.replace(CARD, outcome="Approved by 4242.")
    await channel.edit_card(group(), str(message_id), decided)
    shown = await fake.wait_for_edit(GROUP, message_id)
    assert html_visible(shown.text) == "\n".join(decided.lines())
    assert html_visible(shown.text).endswith("\nApproved by 4242.")
    assert "Expires:" not in shown.text
    assert shown.buttons == []
    # Telegram refuses an edit that changes nothing; for a card that is not a failure.
    await channel.edit_card(group(), str(message_id), decided)
    assert fake.count("editMessageText") == 2
    assert len(fake.edits) == 1
    with pytest.raises(ChannelError) as missing:
        await channel.edit_card(group(), "999", decided)
    assert missing.value.permanent
    assert "message to edit not found" in str(missing.value).lower()


async def test_a_press_reaches_the_sink_and_its_answer_only_the_presser(
    fake: FakeTelegram, open_channel: OpenChannel
):
    inbox = Inbox()
    presses = Presses(
        PressAnswer(False, "Only 4242 may decide this."),
        PressAnswer(True, "Approved by 4242."),
        PressAnswer(False, "x" * 500),
    )
    channel = await open_channel(inbox, presses)
    polls = [p for m, p in fake.requests if m == "getupdates"]
    assert "callback_query" in polls[0]["allowed_updates"]
    message_id = await post_card(channel)

    refused = fake.press_button(GROUP, message_id, "Deny", user_id=STRANGER)
    assert await fake.wait_for_callback_answer(refused) == CallbackAnswer(
        refused, "Only 4242 may decide this.", True
    )
    assert presses.got == [
        Press("telegram", str(GROUP), str(STRANGER), CARD.approval_id, False, str(message_id))
    ]
    counted = fake.press_button(GROUP, message_id, "Approve", user_id=APPROVER)
    assert await fake.wait_for_callback_answer(counted) == CallbackAnswer(
        counted, "Approved.", False
    )
    assert presses.got[1] == dataclasses.replace(presses.got[0], user=str(APPROVER), approve=True)
    # Telegram caps an answer at 200 characters; a longer one would be refused outright.
    long = fake.press_button(GROUP, message_id, "Deny", user_id=STRANGER)
    answer = await fake.wait_for_callback_answer(long)
    assert answer.show_alert
    assert answer.text is not None
    assert len(answer.text) == 200
    assert answer.text.endswith("x\u2026")

    # A chat message after the presses: once it arrived, a press sent to the inbox would have.
    fake.push_message(GROUP, "after the presses", user_id=APPROVER)
    assert [i.text for i in await inbox.wait(1)] == ["after the presses"]
    await fake.wait_for_confirmed(max(fake.pushed) + 1)
    assert fake.count("sendMessage") == 1  # the card: nothing was said in the chat
    assert fake.edits == []
    assert fake.count("answerCallbackQuery") == 3
    assert channel.status().counters["presses"] == 3


@pytest.mark.parametrize("data", ["xyz", "gb:q:abc", "gb:a:", "gb:a:" + "k" * 41])
async def test_a_button_that_is_not_ours_is_answered_as_not_valid(
    fake: FakeTelegram, open_channel: OpenChannel, data: str
):
    presses = Presses()
    channel = await open_channel(Inbox(), presses)
    message_id = await post_card(channel)
    query = fake.push_callback_query(GROUP, message_id, data, user_id=APPROVER)
    assert await fake.wait_for_callback_answer(query) == CallbackAnswer(query, NOT_VALID, True)
    assert presses.got == []


async def test_a_press_on_a_message_the_bot_cannot_see_is_not_valid(
    fake: FakeTelegram, open_channel: OpenChannel
):
    presses = Presses()
    channel = await open_channel(Inbox(), presses)
    message_id = await post_card(channel)
    data = press_data(CARD.approval_id, True)
    query = fake.push_callback_query(GROUP, message_id, data, user_id=APPROVER, inaccessible=True)
    assert await fake.wait_for_callback_answer(query) == CallbackAnswer(query, NOT_VALID, True)
    assert presses.got == []


async def test_without_a_press_sink_every_press_is_not_valid(
    fake: FakeTelegram, open_channel: OpenChannel
):
    inbox = Inbox()
    channel = await open_channel(inbox)
    message_id = await post_card(channel)
    query = fake.press_button(GROUP, message_id, "Approve", user_id=APPROVER)
    assert await fake.wait_for_callback_answer(query) == CallbackAnswer(query, NOT_VALID, True)
    fake.push_message(GROUP, "still here", user_id=APPROVER)
    assert [i.text for i in await inbox.wait(1)] == ["still here"]


async def test_a_failing_press_sink_gets_a_retry_answer_and_receiving_goes_on(
    fake: FakeTelegram, open_channel: OpenChannel, caplog: pytest.LogCaptureFixture
):
    inbox = Inbox()
    presses = Presses(RuntimeError("store unavailable"), PressAnswer(True, "Denied by 4242."))
    channel = await open_channel(inbox, presses)
    message_id = await post_card(channel)
    failed = fake.press_button(GROUP, message_id, "Approve", user_id=APPROVER)
    assert await fake.wait_for_callback_answer(failed) == CallbackAnswer(failed, TRY_AGAIN, True)
    assert any("was not handled" in r.getMessage() for r in caplog.records)
    fake.push_message(GROUP, "hello", user_id=APPROVER)
    assert [i.text for i in await inbox.wait(1)] == ["hello"]
    again = fake.press_button(GROUP, message_id, "Deny", user_id=APPROVER)
    assert await fake.wait_for_callback_answer(again) == CallbackAnswer(again, "Denied.", False)
    counters = channel.status().counters
    assert (counters["presses"], counters["press_errors"]) == (2, 1)
    assert channel.status().connected


async def test_a_press_is_confirmed_only_once_it_was_answered(
    fake: FakeTelegram, open_channel: OpenChannel
):
    presses, cursors = Presses(PressAnswer(True, "Approved by 4242.")), MemoryCursors()
    presses.gate = asyncio.Event()
    channel = await open_channel(Inbox(), presses, cursors)
    message_id = await post_card(channel)
    query = fake.press_button(GROUP, message_id, "Approve", user_id=APPROVER)
    update_id = max(fake.pushed)
    await presses.entered.wait()
    polls = fake.count("getUpdates")
    # A round trip through the adapter and the fake while the sink holds the press: a poller
    # that went on without waiting for it would have asked for (and confirmed) more by now.
    await channel.send_card(group(), CARD)
    assert fake.count("getUpdates") == polls
    assert fake.confirmed_offset <= update_id
    assert cursors.offset() is None
    presses.gate.set()
    assert (await fake.wait_for_callback_answer(query)).text == "Approved."
    await fake.wait_for_confirmed(update_id + 1)
    assert cursors.offset() == update_id + 1
    # The getUpdates that confirmed it came only after the presser had the answer.
    calls = [
        name
        for name, params in fake.requests
        if name == "answercallbackquery"
        or (name == "getupdates" and int(params.get("offset") or 0) > update_id)
    ]
    assert calls[0] == "answercallbackquery"


async def test_card_errors_are_classified_like_sends(fake: FakeTelegram, open_channel: OpenChannel):
    channel = await open_channel(Inbox())
    fake.fail_next("sendMessage", 429, "Too Many Requests: retry after 7", retry_after=7)
    with pytest.raises(ChannelError) as limited:
        await channel.send_card(group(), CARD)
    assert limited.value.retry_after == 7.0
    assert not isinstance(limited.value, SendUnknown)
    assert not limited.value.permanent
    fake.fail_next("sendMessage", 403, "Forbidden: bot was kicked from the supergroup chat")
    with pytest.raises(ChannelError) as kicked:
        await channel.send_card(group(), CARD)
    assert kicked.value.permanent
    fake.fail_next("editMessageText", 429, "Too Many Requests: retry after 3", retry_after=3)
    with pytest.raises(ChannelError) as edit_limited:
        await channel.edit_card(group(), "1", dataclasses.replace(CARD, outcome="Expired."))
    assert edit_limited.value.retry_after == 3.0
    assert fake.sent[GROUP] == []
    assert channel.status().counters["send_errors"] == 3


async def test_the_fake_refuses_what_telegram_refuses(fake: FakeTelegram):
    """The fake's own rules the tests above rely on, through PTB's Bot as any client."""
    button = InlineKeyboardButton("Go", callback_data="x" * 65)
    async with Bot(fake.token, base_url=fake.api_base_url) as bot:
        with pytest.raises(tg.BadRequest, match=r"(?i)button_data_invalid"):
            await bot.send_message(GROUP, "card", reply_markup=InlineKeyboardMarkup([[button]]))
        sent = await bot.send_message(GROUP, "card")
        query = fake.push_callback_query(GROUP, sent.message_id, "gb:a:r1", user_id=APPROVER)
        assert await bot.answer_callback_query(query, "Approved.")
        for query_id in (query, "12345"):  # answered already; never issued
            with pytest.raises(tg.BadRequest, match=r"(?i)query is too old"):
                await bot.answer_callback_query(query_id, "again")
        assert fake.callback_answers == {query: CallbackAnswer(query, "Approved.", False)}


async def test_a_message_of_the_bot_is_deleted_and_a_missing_one_is_a_permanent_error(
    fake: FakeTelegram, open_channel: OpenChannel
):
    # What a replica that lost its session does with a preview it could not record.
    channel = await open_channel(Inbox())
    message_id = await post_card(channel)
    await channel.delete(group(), str(message_id))
    assert fake.deleted == [(GROUP, message_id)]
    with pytest.raises(ChannelError) as missing:
        await channel.delete(group(), str(message_id))
    assert missing.value.permanent
    assert "message to delete not found" in str(missing.value).lower()
