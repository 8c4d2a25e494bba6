"""Approval cards on the Discord adapter: buttons out, presses in, against FakeDiscord."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from geodebot.channels.base import (
    ApprovalCard,
    ChannelError,
    Destination,
    Press,
    PressAnswer,
    SendUnknown,
    press_data,
)
from geodebot.channels.discord import DiscordChannel
from tests.support.fakes.discord_server import EPHEMERAL, FakeDiscord
from tests.unit.test_discord_channel import DM, TOKEN, USER, Cursors, Sink, make_channel, until

APPROVER = "4242"
SUMMARY = "<b>rm -rf /srv</b> *x* _y_ `z` ~~s~~ ||p|| [link](http://e.x) @everyone\n# big"
NOT_VALID = "This button is not valid."
RETRY = "That did not work; please try again."


def literal(text: str) -> str:
    """What Discord shows for ``text``: a backslash before ASCII punctuation is dropped."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text)


class Presses:
    def __init__(self) -> None:
        self.got: list[Press] = []
        self.answer = PressAnswer(True, "Approved.")
        self.fail = False

    async def __call__(self, press: Press) -> PressAnswer:
        self.got.append(press)
        if self.fail:
            raise RuntimeError("approvals store unavailable")
        return self.answer


@pytest.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(token=TOKEN) as server:
        yield server


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
def presses() -> Presses:
    return Presses()


@pytest.fixture
async def chan(fake: FakeDiscord, sink: Sink, presses: Presses) -> AsyncIterator[DiscordChannel]:
    channel = make_channel(fake, Cursors())
    await channel.start(sink, presses)
    try:
        yield channel
    finally:
        await channel.stop()


def card(approval_id: str = "apv0123456789abcdef", **changes: object) -> ApprovalCard:
    base = ApprovalCard(
        approval_id=approval_id,
        tool="write_file",
        safety="effectful",
        summary=SUMMARY,
        approvers=(APPROVER, "4343"),
        expires_at=1_900_000_000.0,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def here(fake: FakeDiscord, **where: str) -> Destination:
    return Destination("discord", fake.channel_id, **where)


async def test_card_is_escaped_text_and_two_buttons(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    sent = await chan.send_card(here(fake), card())
    [posted] = fake.posted[fake.channel_id]
    assert sent.message_id == posted["id"]
    [row] = posted["components"]
    assert row["type"] == 1
    buttons = [(b["type"], b["style"], b["label"], b["custom_id"]) for b in row["components"]]
    assert buttons == [
        (2, 3, "Approve", press_data("apv0123456789abcdef", True)),
        (2, 4, "Deny", press_data("apv0123456789abcdef", False)),
    ]
    content = posted["content"]
    assert literal(content).splitlines() == [
        "**Approval needed: write_file (effectful)**",
        *"\n".join(card().lines()[1:]).splitlines(),
    ]
    assert "Arguments: <b>rm -rf /srv</b> *x* _y_" in literal(content)
    assert "May decide: 4242, 4343" in content
    assert "Expires: 2030-03-17 17:46 UTC" in content
    # Every markup character of the model's summary reaches Discord escaped, so it shows as is.
    for raw in ("\\<b>", "\\*x\\*", "\\_y\\_", "\\`z\\`", "\\~\\~s", "\\|\\|p", "\\[link]"):
        assert raw in content
    assert "\\@everyone" in content
    assert "\n\\# big" in content  # a heading at a line start, too
    assert posted["allowed_mentions"]["parse"] == []
    assert posted["flags"] & 4  # SUPPRESS_EMBEDS: the summary's link unfurls nothing


async def test_decided_card_shows_the_outcome_without_buttons(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    sent = await chan.send_card(here(fake), card())
    await chan.edit_card(here(fake), sent.message_id, card(outcome="Approved by 4242"))
    shown = fake.message(sent.message_id)
    assert shown["components"] == []
    assert literal(shown["content"]).endswith("\nApproved by 4242")
    assert "Expires" not in shown["content"]
    assert "\\<b>" in shown["content"]
    [edit] = fake.edits
    assert edit["body"]["components"] == []
    assert len(fake.posted[fake.channel_id]) == 1  # edited in place, nothing new posted


async def test_edit_of_an_unknown_card_is_a_permanent_error(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    with pytest.raises(ChannelError) as gone:
        await chan.edit_card(here(fake), "123456789012345678", card(outcome="Denied"))
    assert gone.value.permanent


async def test_press_not_counted_is_answered_privately(
    fake: FakeDiscord, chan: DiscordChannel, presses: Presses, sink: Sink
) -> None:
    sent = await chan.send_card(here(fake), card())
    presses.answer = PressAnswer(False, "Only 4242 may decide this.")
    iid = fake.push_press(sent.message_id, press_data("apv0123456789abcdef", True), user_id=USER)
    answer = await fake.wait_callback(iid)
    assert presses.got == [
        Press("discord", fake.channel_id, USER, "apv0123456789abcdef", True, sent.message_id)
    ]
    assert answer["type"] == 4
    assert answer["flags"] == EPHEMERAL
    assert answer["data"]["content"] == "Only 4242 may decide this."
    assert [p["id"] for p in fake.posted[fake.channel_id]] == [sent.message_id]
    assert not fake.followups[iid]
    assert fake.message(sent.message_id)["components"]  # nothing changed for anyone else
    # The card itself came back over the gateway; the press is no chat message.
    assert all(i.is_self for i in sink.got)
    assert iid not in [i.event_id for i in sink.got]


async def test_counted_press_is_acknowledged(
    fake: FakeDiscord, chan: DiscordChannel, presses: Presses
) -> None:
    sent = await chan.send_card(here(fake), card())
    iid = fake.push_press(
        sent.message_id, press_data("apv0123456789abcdef", False), user_id=APPROVER
    )
    answer = await fake.wait_callback(iid)
    assert answer == {"type": 6, "data": None, "flags": 0}  # deferred update: no new message
    [press] = presses.got
    assert (press.user, press.approve, press.message_id) == (APPROVER, False, sent.message_id)
    assert fake.callbacks == [(iid, 6)]
    assert [p["id"] for p in fake.posted[fake.channel_id]] == [sent.message_id]


async def test_press_in_a_thread_and_in_a_dm(
    fake: FakeDiscord, chan: DiscordChannel, presses: Presses
) -> None:
    in_thread = await chan.send_card(here(fake, thread=fake.thread_id), card("apvthread"))
    assert fake.posted[fake.thread_id][0]["id"] == in_thread.message_id
    first = fake.push_press(in_thread.message_id, press_data("apvthread", True), user_id=USER)
    await fake.wait_callback(first)
    in_dm = await chan.send_card(Destination("discord", DM), card("apvdm"))
    second = fake.push_press(in_dm.message_id, press_data("apvdm", True), user_id=APPROVER)
    await fake.wait_callback(second)
    # A thread's card belongs to its parent channel, like the thread's messages do.
    assert [(p.channel, p.user, p.message_id) for p in presses.got] == [
        (fake.channel_id, USER, in_thread.message_id),
        (DM, APPROVER, in_dm.message_id),
    ]


@pytest.mark.parametrize("custom_id", ["xyz", "gb:q:abc", "gb:a:", "gb:a:" + "x" * 41])
async def test_button_that_is_not_ours_is_not_valid(
    fake: FakeDiscord, chan: DiscordChannel, presses: Presses, custom_id: str
) -> None:
    sent = await chan.send_card(here(fake), card())
    iid = fake.push_press(sent.message_id, custom_id, user_id=USER)
    answer = await fake.wait_callback(iid)
    assert (answer["type"], answer["flags"]) == (4, EPHEMERAL)
    assert answer["data"]["content"] == NOT_VALID
    assert not presses.got


async def test_without_a_press_sink_every_button_is_not_valid(
    fake: FakeDiscord, sink: Sink
) -> None:
    channel = make_channel(fake, Cursors())
    await channel.start(sink)
    try:
        sent = await channel.send_card(here(fake), card())
        iid = fake.push_press(
            sent.message_id, press_data("apv0123456789abcdef", True), user_id=USER
        )
        answer = await fake.wait_callback(iid)
    finally:
        await channel.stop()
    assert answer["data"]["content"] == NOT_VALID
    assert answer["flags"] == EPHEMERAL


async def test_failing_press_sink_asks_to_retry_and_the_adapter_goes_on(
    fake: FakeDiscord,
    chan: DiscordChannel,
    presses: Presses,
    sink: Sink,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent = await chan.send_card(here(fake), card())
    presses.fail = True
    iid = fake.push_press(sent.message_id, press_data("apv0123456789abcdef", True), user_id=USER)
    answer = await fake.wait_callback(iid)
    assert (answer["type"], answer["flags"]) == (4, EPHEMERAL)
    assert answer["data"]["content"] == RETRY
    assert "approvals store unavailable" in caplog.text
    after = fake.push_message(fake.channel_id, "still listening?", author_id=USER)
    await until(lambda: after in sink.ids())
    presses.fail = False
    again = fake.push_press(sent.message_id, press_data("apv0123456789abcdef", True), user_id=USER)
    assert (await fake.wait_callback(again))["type"] == 6
    assert len(presses.got) == 2


async def test_slow_press_sink_is_deferred_then_answered_by_followup(
    fake: FakeDiscord, sink: Sink
) -> None:
    pressed: list[str] = []

    async def slow(press: Press) -> PressAnswer:
        # Decides only once the adapter has acknowledged the press (Discord's 3 s window).
        await fake.wait_callback(pressed[0], within=10)
        return PressAnswer(False, "This request has expired.")

    channel = make_channel(fake, Cursors())
    await channel.start(sink, slow)
    try:
        sent = await channel.send_card(here(fake), card())
        pressed.append(fake.push_press(sent.message_id, press_data("apv1", True), user_id=USER))
        followup = await fake.wait_followup(pressed[0], within=10)
    finally:
        await channel.stop()
    assert fake.responses[pressed[0]]["type"] == 6
    assert followup["content"] == "This request has expired."
    assert followup["flags"] == EPHEMERAL
    assert [p["id"] for p in fake.posted[fake.channel_id]] == [sent.message_id]


async def test_each_press_gets_exactly_one_response(
    fake: FakeDiscord, chan: DiscordChannel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    sent = await chan.send_card(here(fake), card())
    ids = [
        fake.push_press(
            sent.message_id, press_data("apv0123456789abcdef", n % 2 == 0), user_id=USER
        )
        for n in range(3)
    ]
    for iid in ids:
        await fake.wait_callback(iid)
    await until(lambda: len(fake.callbacks) == 3)
    assert sorted(i for i, _ in fake.callbacks) == sorted(ids)
    # A second answer to any of them would be refused by the fake and logged by the adapter.
    assert "already been acknowledged" not in caplog.text
    assert "not answered" not in caplog.text


async def test_fake_refuses_a_second_response(fake: FakeDiscord, chan: DiscordChannel) -> None:
    sent = await chan.send_card(here(fake), card())
    iid = fake.push_press(sent.message_id, "xyz", user_id=USER)
    await fake.wait_callback(iid)
    token = next(t for t, (i, _) in fake._interactions.items() if i == iid)
    url = f"{fake.api_base_url}/interactions/{iid}/{token}/callback"
    async with aiohttp.ClientSession() as http, http.post(url, json={"type": 6}) as resp:
        assert resp.status == 400
        assert (await resp.json())["code"] == 40060
    assert fake.responses[iid]["type"] == 4


ErrorCase = Callable[[FakeDiscord], None]


@pytest.mark.parametrize(
    ("arrange", "check"),
    [
        (
            lambda f: f.fail_next_post(429, retry_after=45),
            lambda e: e.retry_after == 45 and not e.permanent,
        ),
        (lambda f: f.fail_next_post(403), lambda e: e.permanent and e.retry_after is None),
        (lambda f: f.fail_next_post(503), lambda e: not e.permanent and e.retry_after is None),
    ],
    ids=["rate-limited", "forbidden", "unwell"],
)
async def test_card_send_errors_map_like_send(
    fake: FakeDiscord,
    chan: DiscordChannel,
    arrange: ErrorCase,
    check: Callable[[ChannelError], bool],
) -> None:
    arrange(fake)
    with pytest.raises(ChannelError) as failed:
        await chan.send_card(here(fake), card())
    assert not isinstance(failed.value, SendUnknown)
    assert check(failed.value)
    assert not fake.posted[fake.channel_id]


async def test_card_lost_on_the_way_back_is_not_posted_twice(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    fake.fail_next_post(0, created=True)
    with pytest.raises(SendUnknown):
        await chan.send_card(here(fake), card())
    again = await chan.send_card(here(fake), card())
    [posted] = fake.posted[fake.channel_id]
    assert again.message_id == posted["id"]


async def test_overlong_summary_is_cut_to_the_limit(
    fake: FakeDiscord, chan: DiscordChannel
) -> None:
    await chan.send_card(here(fake), card(summary="*" * 3000))
    [posted] = fake.posted[fake.channel_id]
    assert len(posted["content"]) <= 2000
    assert posted["content"].endswith("…\nMay decide: 4242, 4343\nExpires: 2030-03-17 17:46 UTC")
    [escapes] = re.findall(r"(\\*)…", posted["content"])
    assert len(escapes) % 2 == 0  # no half an escape left in front of the cut


async def test_a_message_of_the_bot_is_deleted(fake: FakeDiscord, chan: DiscordChannel) -> None:
    # What a replica that lost its session does with a preview it could not record.
    sent = await chan.send_card(here(fake), card())
    await chan.delete(here(fake), sent.message_id)
    assert fake.deleted == [sent.message_id]
    assert all(m["id"] != sent.message_id for m in fake.history[fake.channel_id])
    with pytest.raises(ChannelError) as gone:
        await chan.delete(here(fake), sent.message_id)
    assert gone.value.permanent
