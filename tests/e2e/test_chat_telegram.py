"""Approval cards and streamed answers through ``geodebot serve`` on Telegram: the real daemon
process, python-telegram-bot against the fake Bot API, the anthropic SDK against the fake
model server, and a tool that needs approval from a real MCP server.

One daemon serves every test of this file, each test in a chat (and session) of its own; the
crash tests kill it and start it again on the same state directory. See
tests/support/chat_e2e_telegram.py for the world and its model.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
import pytest_asyncio

from tests.support.chat_e2e_telegram import (
    ALICE,
    BOB,
    CAROL,
    STREAM_INTERVAL_S,
    WRITE_NOTE,
    CardKillingTelegram,
    Chat,
    ChatWorld,
    answers,
    ever_showed,
    json_arguments,
)
from tests.support.config import TEST_KEY
from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import (
    CallbackAnswer,
    SentMessage,
    html_visible,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

APPROVE, REFUSE, DENY, EXPIRE, RESUME = -5001, -5002, -5003, -5004, -5005
STREAM, MIDSTREAM, STORM, REPOST = -5006, -5007, -5008, -5009
CHATS = (
    Chat(APPROVE),
    Chat(REFUSE),
    Chat(DENY),
    Chat(EXPIRE, "approval_timeout_s = 5\n"),
    Chat(RESUME),
    Chat(STREAM),
    Chat(MIDSTREAM),
    Chat(STORM),
    Chat(REPOST),
)
ONLY_APPROVERS = f"Only {BOB}, {CAROL} may decide this."
NOT_RUN = f"\n\n(Not allowed here, so not run: <code>{WRITE_NOTE}</code>.)"
# Twenty chunks a tenth of a second apart: two seconds of answer, ten edit intervals.
PLAN = "The **plan**, step by step: " + " ".join(f"step{i}" for i in range(1, 13))
PLAN += ". Run `deploy --now` after that."
PLAN_HTML = (
    "The <b>plan</b>, step by step: "
    + " ".join(f"step{i}" for i in range(1, 13))
    + ". Run <code>deploy --now</code> after that."
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChatWorld]:
    async with CardKillingTelegram() as telegram, FakeLLMServer() as llm:
        world = ChatWorld(telegram, llm, tmp_path_factory.mktemp("chat-telegram"), CHATS)
        await world.start()
        try:
            yield world
        finally:
            assert world.daemon is not None
            code = await world.daemon.stop()
            logged = world.logged()
            assert code == 0, logged[-3000:]
            assert "Traceback" not in logged, logged[-3000:]
            assert telegram.token not in logged
            assert TEST_KEY not in logged


@pytest_asyncio.fixture(loop_scope="module")
async def world(shared: ChatWorld) -> ChatWorld:
    # A test that failed after killing the daemon leaves none: the next one gets a fresh one.
    if not shared.running():
        await shared.start()
    return shared


def ask_to_note(world: ChatWorld, chat: int, note: str, answer: str) -> str:
    """Alice asks in ``chat``; the model calls write_note(``note``), then says ``answer``.
    The prompt, to look the turn's model calls up by."""
    prompt = f"asked in {chat}:"  # one turn per chat
    call = Call(WRITE_NOTE, {"text": note}, id=f"toolu_{-chat}")
    world.model.script(prompt, Reply(tool_calls=[call]), Reply(answer))
    world.ask(chat, f"{prompt} please note {note!r}")
    return prompt


def question_id(world: ChatWorld, chat: int) -> int:
    """The message id of the first message a user sent to ``chat``."""
    pushed = [u["message"] for u in world.telegram.pushed.values() if "message" in u]
    return min(int(m["message_id"]) for m in pushed if m["chat"]["id"] == chat)


def expiry(line: str) -> float:
    stamp = datetime.strptime(line, "Expires: %Y-%m-%d %H:%M UTC").replace(tzinfo=UTC)
    return stamp.timestamp()


def is_preview(world: ChatWorld, message: SentMessage) -> bool:
    """A streamed preview: begun as plain text (which the final answer may replace)."""
    first = world.telegram.history(message.chat_id, message.message_id)[0]
    return first.parse_mode is None


async def press(world: ChatWorld, card: SentMessage, label: str, user: int) -> CallbackAnswer:
    """``user`` presses ``label`` on ``card`` as it was posted: after a decision that is a
    client still showing the buttons (Telegram takes the press all the same)."""
    [data] = [data for text, data in card.buttons if text == label]
    query = world.telegram.push_callback_query(card.chat_id, card.message_id, data, user_id=user)
    return await world.telegram.wait_for_callback_answer(query, timeout=20)


def assert_one_answer(
    world: ChatWorld, chat: int, answer: str, messages: list[SentMessage]
) -> SentMessage:
    """The answer (Telegram HTML) arrived once: one message shows it, no other ever did, no
    streamed preview was left behind, and the control's answer came after it. That message."""
    [shown] = answers(messages, answer)
    assert ever_showed(world.telegram, chat, answer) == [shown.message_id]
    assert [m for m in messages if m.parse_mode is None and m != shown] == []
    assert messages[-1].text == CONTROL_ANSWER
    return shown


# -- approvals ------------------------------------------------------------------------------
async def test_an_approvers_press_runs_the_call_once_and_the_answer_arrives_once(
    world: ChatWorld,
) -> None:
    asked_at = datetime.now(UTC).timestamp()
    prompt = ask_to_note(world, APPROVE, "v2 deployed", "Noted: **v2** is out.")
    card = await world.card(APPROVE)
    # Two buttons side by side; Telegram has no default button, and neither is preselected.
    assert card.reply_markup == {
        "inline_keyboard": [
            [
                {"text": "Approve", "callback_data": card.buttons[0][1]},
                {"text": "Deny", "callback_data": card.buttons[1][1]},
            ]
        ]
    }
    assert card.buttons[0][1] != card.buttons[1][1]
    assert card.reply_to_message_id == question_id(world, APPROVE)
    head, arguments, approvers, expires = html_visible(card.text).splitlines()
    assert head == f"Approval needed: {WRITE_NOTE} (write)"
    assert json_arguments(arguments) == {"text": "v2 deployed"}
    assert approvers == f"May decide: {BOB}, {CAROL}"
    # The binding's default approval_timeout_s, 900 s, shown to the minute.
    assert asked_at + 900 - 60 <= expiry(expires) <= datetime.now(UTC).timestamp() + 900
    assert world.notes_written("v2 deployed") == 0

    approved = await press(world, card, "Approve", BOB)
    assert (approved.text, approved.show_alert) == ("Approved.", False)
    await world.showing(APPROVE, "Noted: <b>v2</b> is out.")
    outcome = await world.card_outcome(APPROVE, card.message_id)
    assert outcome[:3] == [head, arguments, approvers]
    assert outcome[3].startswith(f"Approved by {BOB}, ")
    messages = await world.control(APPROVE)
    assert_one_answer(world, APPROVE, "Noted: <b>v2</b> is out.", messages)
    assert len(world.cards(APPROVE)) == 1
    assert world.notes_written("v2 deployed") == 1
    assert world.model.rounds(prompt) == [0, 1]


async def test_a_press_by_anyone_else_is_answered_privately_and_changes_nothing(
    world: ChatWorld,
) -> None:
    ask_to_note(world, REFUSE, "rolled back", "Rollback noted.")
    card = await world.card(REFUSE)
    sent_before = {m.message_id for m in world.telegram.sent[REFUSE]}
    # Alice asked, but only Bob and Carol decide; an outsider's press is no different.
    for user in (ALICE, 666):
        answer = await press(world, card, "Approve", user)
        assert (answer.text, answer.show_alert) == (ONLY_APPROVERS, True)
    world.ask(REFUSE, "/status")
    status = await world.showing(REFUSE, "Waiting for approval: ", part=True)
    waiting = f"Waiting for approval: {WRITE_NOTE} (write), asked of {BOB}, {CAROL}, until "
    assert waiting in html_visible(status.text)
    # Nothing was said in the chat but the status (and the turn's own preview, if it began);
    # the card reads as it was sent.
    new = [m for m in world.messages(REFUSE) if m.message_id not in sent_before]
    assert [m for m in new if m != status and not is_preview(world, m)] == []
    assert world.telegram.history(REFUSE, card.message_id) == [card]
    assert world.notes_written("rolled back") == 0

    assert (await press(world, card, "Approve", BOB)).text == "Approved."
    await world.showing(REFUSE, "Rollback noted.")
    outcome = await world.card_outcome(REFUSE, card.message_id)
    decided = world.telegram.history(REFUSE, card.message_id)
    # A second press after the decision, by the other approver: told so, nothing changes.
    late = await press(world, card, "Deny", CAROL)
    assert late.show_alert
    assert late.text is not None
    assert late.text.startswith(f"This was decided already: Approved by {BOB}, ")
    messages = await world.control(REFUSE)
    assert world.telegram.history(REFUSE, card.message_id) == decided
    assert outcome[-1].startswith(f"Approved by {BOB}, ")
    assert_one_answer(world, REFUSE, "Rollback noted.", messages)
    assert world.notes_written("rolled back") == 1


async def test_a_denial_is_not_run_and_the_model_is_told(world: ChatWorld) -> None:
    prompt = ask_to_note(world, DENY, "hotfix", "I could not note it.")
    card = await world.card(DENY)
    denied = await press(world, card, "Deny", CAROL)
    assert (denied.text, denied.show_alert) == ("Denied.", False)
    await world.showing(DENY, "I could not note it." + NOT_RUN)
    outcome = await world.card_outcome(DENY, card.message_id)
    assert outcome[-1].startswith(f"Denied by {CAROL}, ")
    assert outcome[-1].endswith(": not run")
    assert f"{CAROL} denied {WRITE_NOTE}; it was not run" in world.model.tool_result(prompt)
    messages = await world.control(DENY)
    assert_one_answer(world, DENY, "I could not note it." + NOT_RUN, messages)
    assert world.notes_written("hotfix") == 0


async def test_an_unanswered_card_expires_as_a_denial(world: ChatWorld) -> None:
    prompt = ask_to_note(world, EXPIRE, "late change", "Nobody approved it.")
    card = await world.card(EXPIRE)
    # approval_timeout_s = 5: nobody presses, and after it the request is over.
    outcome = await world.card_outcome(EXPIRE, card.message_id, timeout=30)
    assert outcome[-1].startswith("Expired, ")
    assert outcome[-1].endswith(": nobody decided in time, not run")
    await world.showing(EXPIRE, "Nobody approved it." + NOT_RUN)
    told = world.model.tool_result(prompt)
    assert f"nobody approved {WRITE_NOTE} before the request expired; it was not run" in told
    late = await press(world, card, "Approve", BOB)
    assert (late.text, late.show_alert) == ("This request expired; the call was not run.", True)
    messages = await world.control(EXPIRE)
    assert_one_answer(world, EXPIRE, "Nobody approved it." + NOT_RUN, messages)
    assert world.notes_written("late change") == 0


async def test_a_card_pending_over_a_sigkill_is_decided_after_the_restart(
    world: ChatWorld,
) -> None:
    prompt = ask_to_note(world, RESUME, "after restart", "Noted after all.")
    card = await world.card(RESUME)
    await world.card_recorded(card)
    await world.kill()
    await world.start()
    assert (await press(world, card, "Approve", BOB)).text == "Approved."
    await world.showing(RESUME, "Noted after all.")
    outcome = await world.card_outcome(RESUME, card.message_id)
    assert outcome[-1].startswith(f"Approved by {BOB}, ")
    messages = await world.control(RESUME)
    assert_one_answer(world, RESUME, "Noted after all.", messages)
    # The same card (none posted again), the call run once, the model asked once per round.
    assert [m.message_id for m in world.cards(RESUME)] == [card.message_id]
    assert world.notes_written("after restart") == 1
    assert world.model.rounds(prompt) == [0, 1]


async def test_a_card_posted_as_the_daemon_dies_shows_the_outcome_once_pressed(
    world: ChatWorld,
) -> None:
    ask_to_note(world, REPOST, "posted twice", "Noted in the end.")
    world.kill_at_next_card()
    first = await world.card(REPOST)
    await world.kill()  # reaps it: the fake killed it as the card went up
    await world.start()
    # The daemon never learnt the first card's id (the Bot API cannot look it up), so the
    # resumed turn posts the card again; both decide the same request.
    await world.telegram.wait_until(lambda: len(world.cards(REPOST)) == 2, timeout=30)
    second = world.cards(REPOST)[1]
    assert (await press(world, first, "Approve", BOB)).text == "Approved."
    await world.showing(REPOST, "Noted in the end.")
    await world.card_outcome(REPOST, second.message_id)
    messages = await world.control(REPOST)
    assert_one_answer(world, REPOST, "Noted in the end.", messages)
    assert world.notes_written("posted twice") == 1
    # The card that was pressed must not go on offering Approve and Deny.
    pressed = world.telegram.shown(REPOST, first.message_id)
    assert pressed.buttons == [], "the pressed card still shows its buttons"
    assert html_visible(pressed.text).splitlines()[-1].startswith(f"Approved by {BOB}, ")


# -- streamed answers -----------------------------------------------------------------------
def streamed(world: ChatWorld, chat: int, answer: str) -> str:
    prompt = f"asked in {chat}:"
    world.model.script(prompt, Reply(answer, chunks=20, chunk_delay_s=0.1))
    world.ask(chat, f"{prompt} what is the plan?")
    return prompt


async def test_a_streamed_answer_is_one_message_edited_within_the_interval(
    world: ChatWorld,
) -> None:
    streamed(world, STREAM, PLAN)
    await world.showing(STREAM, PLAN_HTML)
    messages = await world.control(STREAM)
    final = assert_one_answer(world, STREAM, PLAN_HTML, messages)
    assert len(messages) == 2  # the answer and the control's
    *previews, last = world.telegram.history(STREAM, final.message_id)
    assert (last.text, last.parse_mode) == (PLAN_HTML, "HTML")
    assert len(previews) >= 3  # sent, then edited at least twice as the answer arrived
    for preview in previews:
        # The answer so far, as plain text without a link preview: never markup cut in two.
        assert (preview.parse_mode, preview.link_preview_options) == (None, {"is_disabled": True})
        assert PLAN.startswith(preview.text)
    assert [len(p.text) for p in previews] == sorted({len(p.text) for p in previews})
    # At most one preview request per interval (the fake stamps each on arrival; a little
    # slack for the requests' own jitter).
    gaps = [b.at - a.at for a, b in itertools.pairwise(previews)]
    assert min(gaps) >= STREAM_INTERVAL_S * 0.8, gaps
    # Every edit request made one of those versions: none was refused (or made unseen).
    assert world.telegram.count("editMessageText", STREAM) == len(previews)


async def test_a_sigkill_mid_stream_still_gives_one_final_answer(world: ChatWorld) -> None:
    prompt = streamed(world, MIDSTREAM, PLAN)

    def edited_preview() -> bool:
        sent = world.telegram.sent[MIDSTREAM]
        return bool(sent) and len(world.telegram.history(MIDSTREAM, sent[0].message_id)) >= 2

    # Killed once the preview was edited: by then the daemon has recorded the preview's id
    # (each edit waits for the record of the message before it).
    await world.telegram.wait_until(edited_preview, timeout=30)
    await world.kill()
    preview = world.telegram.sent[MIDSTREAM][0]
    assert world.telegram.shown(MIDSTREAM, preview.message_id).text != PLAN_HTML
    await world.start()
    await world.showing(MIDSTREAM, PLAN_HTML)
    messages = await world.control(MIDSTREAM)
    # The preview became the answer: no second message with it.
    final = assert_one_answer(world, MIDSTREAM, PLAN_HTML, messages)
    assert final.message_id == preview.message_id
    assert len(messages) == 2
    assert world.model.rounds(prompt) == [0, 0]  # asked again from the start after the kill


async def test_a_rate_limit_storm_on_edits_skips_previews_not_the_answer(
    world: ChatWorld,
) -> None:
    # Every edit for a while is refused with Telegram's 429: the previews' and the final
    # answer's first tries too.
    world.telegram.fail_edits(4, retry_after=1)
    streamed(world, STORM, PLAN)
    await world.showing(STORM, PLAN_HTML)
    messages = await world.control(STORM)
    final = assert_one_answer(world, STORM, PLAN_HTML, messages)
    assert len(messages) == 2
    *previews, last = world.telegram.history(STORM, final.message_id)
    assert last.parse_mode == "HTML"
    assert all(PLAN.startswith(p.text) and p.parse_mode is None for p in previews)
    # The four 429s went to this chat's edits; every other edit request was made.
    assert world.telegram.count("editMessageText", STORM) == len(previews) + 4
