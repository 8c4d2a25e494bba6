"""Approval cards and streamed replies on Slack, end to end: ``geodebot serve`` as a real process
against FakeSlack (Web API + Socket Mode) and the fake model server.

One daemon serves every test of this file (tests/support/chat_e2e_slack.py); each test talks
in a channel bound to a session of its own. The crash tests SIGKILL it and start it again on
the same state directory, and the tests after them go on with that one. Whatever a test says
happened "exactly once" is checked again after the daemon stopped (SIGTERM drains the
outbox), so a late duplicate cannot slip in after the test's own assertion.
"""

from __future__ import annotations

import calendar
import itertools
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from geodebot.channels.base import parse_press_data
from geodebot.channels.slack.cards import APPROVE_ACTION, DENY_ACTION
from tests.support.chat_e2e_slack import (
    ALICE,
    BOB,
    WAITING,
    ChatWorld,
    Scene,
    SceneModel,
    is_final,
    result_text,
    tool_results,
    unescape,
)
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.slack_server import FakeSlack, Posted
from tests.support.slack_world import TimedCalls

pytestmark = pytest.mark.asyncio(loop_scope="module")

APPROVED_TEXT = "The file is edited."
LATE_TEXT = "Edited, once Alice said so."
DENIED_TEXT = "Understood: the file was left alone."
EXPIRED_TEXT = "Nobody approved; nothing changed."
RESUMED_TEXT = "Edited once, after the restart."
# geodebot's own line under an answer whose call was not run (the model may not say so).
NOT_RUN = "\n\n(Not allowed here, so not run: `edit_file`.)"
APPROVE = Scene("approve", "C0CHAT001", Reply(APPROVED_TEXT))
NOT_APPROVER = Scene("not-approver", "C0CHAT002", Reply(LATE_TEXT))
DENY = Scene("deny", "C0CHAT003", Reply(DENIED_TEXT))
EXPIRE = Scene("expire", "C0CHAT004", Reply(EXPIRED_TEXT), approval_timeout_s=5)
CRASH_CARD = Scene("crash-card", "C0CHAT005", Reply(RESUMED_TEXT))
# A streamed answer: markdown whose link, entity and brackets Slack's markup must carry.
ANSWER = (
    "**Deploy finished**: all 12 hosts are on release 4.2, and the checks passed. Read "
    "[the log](https://example.com/log?run=7&step=2) for _details_; nothing needs <you> now."
)
ANSWER_MRKDWN = (
    "*Deploy finished*: all 12 hosts are on release 4.2, and the checks passed. Read "
    "<https://example.com/log?run=7&amp;step=2|the log> for _details_; "
    "nothing needs &lt;you&gt; now."
)
INTERVAL_S = 0.2  # [daemon] stream_edit_interval_s
RETRY_AFTER_S = 0.5  # the edits' 429s in the storm
STREAMED_REPLY = Reply(ANSWER, chunks=20, chunk_delay_s=0.1)
STREAMED = Scene("streamed", "C0CHAT006", STREAMED_REPLY, tool=False)
CRASH_STREAM = Scene("crash-stream", "C0CHAT007", STREAMED_REPLY, tool=False)
STORM = Scene("storm", "C0CHAT008", STREAMED_REPLY, tool=False)
SCENES = (APPROVE, NOT_APPROVER, DENY, EXPIRE, CRASH_CARD, STREAMED, CRASH_STREAM, STORM)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChatWorld]:
    async with FakeSlack() as slack, FakeLLMServer() as llm:
        model = SceneModel()
        model.scenes = {scene.name: scene for scene in SCENES}
        llm.responder = model
        slack.calls = TimedCalls()
        world = ChatWorld(slack, llm, model, tmp_path_factory.mktemp("chat-slack"), SCENES)
        world.write_config()
        await world.start()
        try:
            yield world
        finally:
            assert world.daemon is not None
            code = await world.daemon.stop()
            for daemon in world.daemons:
                await daemon.kill()  # one a failed test left behind
        assert code == 0, world.daemon.text()[-3000:]
        for check in world.afterwards:
            check()
        world.assert_clean_logs()


def section(slack: FakeSlack, card: Posted) -> str:
    """The card's section text as a reader sees it."""
    message = slack.message(card.channel, card.ts)
    assert message is not None
    [block] = [b for b in message["blocks"] if b["type"] == "section"]
    return unescape(block["text"]["text"])


def approval_id(slack: FakeSlack, card: Posted) -> str:
    [value] = {b["value"] for b in slack.buttons(card.channel, card.ts) if b["style"] == "primary"}
    parsed = parse_press_data(value)
    assert parsed is not None
    return parsed[0]


def public_changes(slack: FakeSlack, channel: str) -> int:
    """Web API calls that add or change what everyone in ``channel`` sees."""
    return sum(
        1
        for c in slack.calls
        if c.method in ("chat.postMessage", "chat.update") and c.args.get("channel") == channel
    )


async def press(world: ChatWorld, card: Posted, user: str, button: dict[str, Any]) -> None:
    """``user`` presses ``button`` of the card, as shown when it was posted (a client that
    has not redrawn an edited card still shows it)."""
    await world.slack.push_action(
        card.channel,
        card.ts,
        user,
        action_id=button["action_id"],
        value=button["value"],
        timeout=15,
    )


async def private_answer(world: ChatWorld, seen: int) -> str:
    """The one ephemeral message after the first ``seen``, as "<user>: <text>"."""
    ephemeral = await world.slack.wait_for_ephemeral(seen + 1, timeout=15)
    [answer] = ephemeral[seen:]
    return f"{answer.user}: {unescape(answer.text)}"


def only_answer(world: ChatWorld, scene: Scene, thread: str, text: str) -> None:
    """In the thread: the card, and one other message, whose text is the answer."""
    answers = world.answers(scene, thread)
    assert [(p.text, is_final(p)) for p in answers] == [(text, True)], [p.texts for p in answers]
    assert len(world.cards(scene, thread)) == 1
    assert len(world.posts(scene)) == 2  # nothing outside the thread either


def the_result(world: ChatWorld, scene: Scene) -> tuple[bool, str]:
    """The tool_result the model got last in the scene: (is_error, its text)."""
    [result] = tool_results(world.model.requests[scene.name][-1])
    return bool(result.get("is_error")), result_text(result)


# -- 1. an approver approves ------------------------------------------------------------------
async def test_an_approvers_press_runs_the_call_once_and_the_answer_arrives_once(
    world: ChatWorld,
) -> None:
    scene, slack = APPROVE, world.slack
    asked = time.time()
    thread = await world.ask(scene, "please edit the notes")
    card = await world.waiting(scene, thread)

    # Two buttons, Approve and Deny; neither is preselected, nor does one confirm for the other.
    approve, _ = buttons = slack.buttons(scene.channel, card.ts)
    assert [(b["action_id"], b["text"]["text"]) for b in buttons] == [
        (APPROVE_ACTION, "Approve"),
        (DENY_ACTION, "Deny"),
    ]
    assert not any({"confirm", "focus_on_load", "url"} & b.keys() for b in buttons)
    shown = section(slack, card)
    assert "Approval needed: edit_file (write)" in shown
    assert f'"path":"{scene.file}"' in shown  # the arguments
    assert f"May decide: {ALICE}" in shown
    expires = re.search(r"Expires: (\d{4}-\d\d-\d\d \d\d:\d\d) UTC", shown)
    assert expires is not None, shown
    expires_at = calendar.timegm(time.strptime(expires[1], "%Y-%m-%d %H:%M"))
    assert asked + 900 - 60 <= expires_at <= time.time() + 900  # approval_timeout_s default
    assert world.runs(scene) == []  # nothing runs before the press

    await press(world, card, ALICE, approve)
    await world.answer(scene, thread, APPROVED_TEXT)
    await world.until(lambda: "Approved by" in card.text, "the card's outcome")

    assert world.runs(scene) == ["ran approve"]
    assert slack.buttons(scene.channel, card.ts) == []
    assert re.search(rf"Approved by {ALICE}, [\d: -]+ UTC$", section(slack, card))
    assert not [e for e in slack.ephemeral if e.channel == scene.channel]  # a counted press
    only_answer(world, scene, thread, APPROVED_TEXT)
    # The model got the call's result.
    failed, text = the_result(world, scene)
    assert not failed
    assert f"edited {scene.file}" in text

    def again() -> None:
        assert world.runs(scene) == ["ran approve"]
        only_answer(world, scene, thread, APPROVED_TEXT)

    world.afterwards.append(again)


# -- 2. a press that does not count -----------------------------------------------------------
async def test_a_non_approvers_press_is_answered_privately_and_changes_nothing(
    world: ChatWorld,
) -> None:
    scene, slack = NOT_APPROVER, world.slack
    thread = await world.ask(scene, "edit the notes, please", user=BOB)
    card = await world.waiting(scene, thread)
    request = approval_id(slack, card)
    approve, deny = buttons = slack.buttons(scene.channel, card.ts)
    public = public_changes(slack, scene.channel)

    # BOB may talk to the bot, not approve: he is told so privately, next to the card.
    seen = len(slack.ephemeral)
    await press(world, card, BOB, approve)
    assert await private_answer(world, seen) == f"{BOB}: Only {ALICE} may decide this."
    assert slack.ephemeral[-1].thread_ts == thread
    assert world.approval_status(request) == "pending"
    assert (card.edits, slack.buttons(scene.channel, card.ts)) == (0, buttons)
    assert public_changes(slack, scene.channel) == public
    assert world.runs(scene) == []

    # Still pending: the approver's press decides it.
    await press(world, card, ALICE, approve)
    await world.answer(scene, thread, LATE_TEXT)
    await world.until(lambda: "Approved by" in card.text, "the card's outcome")
    assert world.runs(scene) == ["ran not-approver"]
    decided = (card.edits, list(card.texts), len(world.model.requests[scene.name]))
    public = public_changes(slack, scene.channel)

    # Presses after the decision (ALICE changing her mind, BOB trying) change nothing.
    seen = len(slack.ephemeral)
    await press(world, card, ALICE, deny)
    said = await private_answer(world, seen)
    assert said.startswith(f"{ALICE}: This was decided already: Approved by {ALICE}, "), said
    await press(world, card, BOB, approve)
    assert await private_answer(world, seen + 1) == f"{BOB}: Only {ALICE} may decide this."
    assert world.approval_status(request) == "approved"
    assert (card.edits, card.texts, len(world.model.requests[scene.name])) == decided
    assert public_changes(slack, scene.channel) == public
    assert world.runs(scene) == ["ran not-approver"]
    only_answer(world, scene, thread, LATE_TEXT)
    world.afterwards.append(lambda: only_answer(world, scene, thread, LATE_TEXT))


# -- 3. deny, and no decision in time ---------------------------------------------------------
async def test_a_denied_call_does_not_run_and_the_model_is_told(world: ChatWorld) -> None:
    scene, slack = DENY, world.slack
    thread = await world.ask(scene, "edit the notes")
    card = await world.waiting(scene, thread)
    _, deny = slack.buttons(scene.channel, card.ts)
    await press(world, card, ALICE, deny)
    await world.answer(scene, thread, DENIED_TEXT + NOT_RUN)
    await world.until(lambda: "Denied by" in card.text, "the card's outcome")

    assert world.runs(scene) == []
    assert re.search(rf"Denied by {ALICE}, [\d: -]+ UTC: not run$", section(slack, card))
    assert slack.buttons(scene.channel, card.ts) == []
    assert the_result(world, scene) == (True, f"refused: {ALICE} denied edit_file; it was not run")
    only_answer(world, scene, thread, DENIED_TEXT + NOT_RUN)
    world.afterwards.append(lambda: only_answer(world, scene, thread, DENIED_TEXT + NOT_RUN))


async def test_a_request_nobody_decides_expires_like_a_denial(world: ChatWorld) -> None:
    scene, slack = EXPIRE, world.slack
    thread = await world.ask(scene, "edit the notes")
    card = await world.waiting(scene, thread)
    approve, _ = slack.buttons(scene.channel, card.ts)
    # approval_timeout_s = 5: the answer comes once the request expired, without a press.
    await world.answer(scene, thread, EXPIRED_TEXT + NOT_RUN)
    await world.until(lambda: "Expired" in card.text, "the card's outcome")

    assert world.runs(scene) == []
    assert re.search(
        r"Expired, [\d: -]+ UTC: nobody decided in time, not run$", section(slack, card)
    )
    assert slack.buttons(scene.channel, card.ts) == []
    failed, text = the_result(world, scene)
    assert failed
    assert text == "refused: nobody approved edit_file before the request expired; it was not run"
    # A late press is told so, privately, and runs nothing.
    seen = len(slack.ephemeral)
    await press(world, card, ALICE, approve)
    said = await private_answer(world, seen)
    assert said == f"{ALICE}: This request expired; the call was not run."
    assert world.runs(scene) == []
    only_answer(world, scene, thread, EXPIRED_TEXT + NOT_RUN)
    world.afterwards.append(lambda: only_answer(world, scene, thread, EXPIRED_TEXT + NOT_RUN))


# -- 4. a crash while the card waits ----------------------------------------------------------
async def test_after_a_kill_the_same_card_decides_and_the_call_runs_once(
    world: ChatWorld,
) -> None:
    scene, slack = CRASH_CARD, world.slack
    thread = await world.ask(scene, "edit the notes")
    card = await world.waiting(scene, thread)
    request = approval_id(slack, card)
    approve, _ = slack.buttons(scene.channel, card.ts)
    [preview] = world.answers(scene, thread)
    shown = len(preview.texts)
    # (Killed once the card's place is stored: before that, a restart posts it again.)
    daemon = await world.kill_and_restart()
    await daemon.wait_for_line("answering 1 message(s) accepted before the restart")
    # The resumed turn shows its wait again, as it goes back to waiting on the same card.
    await world.until(
        lambda: len(preview.texts) > shown and preview.text == WAITING,
        lambda: f"the resumed turn's wait; shown: {world.shown(scene, thread)}",
    )
    await slack.wait_for_connections(len(world.daemons))
    assert world.approval_status(request) == "pending"

    await press(world, card, ALICE, approve)
    await world.answer(scene, thread, RESUMED_TEXT)
    await world.until(lambda: "Approved by" in card.text, "the card's outcome")
    assert world.runs(scene) == ["ran crash-card"]
    # The same card: none posted by the resumed turn, which did not ask the model again
    # either (its call was saved before the kill).
    assert world.cards(scene) == [card]
    assert len(world.model.requests[scene.name]) == 2
    only_answer(world, scene, thread, RESUMED_TEXT)
    failed, text = the_result(world, scene)
    assert not failed
    assert f"edited {scene.file}" in text

    def again() -> None:
        assert world.runs(scene) == ["ran crash-card"]
        only_answer(world, scene, thread, RESUMED_TEXT)

    world.afterwards.append(again)


# -- 5. a streamed answer ---------------------------------------------------------------------
def previews_of(message: Posted) -> list[str]:
    """What the message showed before its final text, as a reader saw it."""
    return [unescape(text) for text in message.texts[:-1]]


def only_message(world: ChatWorld, scene: Scene) -> Posted:
    """The one message the scene's channel got, showing the complete answer."""
    [message] = world.posts(scene)
    assert message.text == ANSWER_MRKDWN, message.texts
    assert is_final(message)
    assert message.blocks is None
    return message


async def test_a_streamed_answer_is_one_message_edited_as_it_arrives(world: ChatWorld) -> None:
    scene = STREAMED
    thread = await world.ask(scene, "how did the deploy go?")
    await world.answer(scene, thread, ANSWER_MRKDWN)

    message = only_message(world, scene)
    assert message.thread_ts == thread
    previews = previews_of(message)
    # Edited several times while the answer arrived (over 2 s, in 20 pieces) ...
    assert len(previews) >= 4, message.texts
    # ... each time with more of it, as the model wrote it (plain: no markup, no link) ...
    assert all(ANSWER.startswith(text) for text in previews), previews
    assert all(len(a) < len(b) for a, b in itertools.pairwise(previews)), previews
    # ... and never sooner than the interval allows (the final edit is not a preview).
    shown = message.shown_at[: len(previews)]
    gaps = [b - a for a, b in itertools.pairwise(shown)]
    assert min(gaps) >= INTERVAL_S * 0.75, gaps
    assert len(world.model.requests[scene.name]) == 1
    world.afterwards.append(lambda: only_message(world, scene))


# -- 6. a crash mid-stream --------------------------------------------------------------------
async def test_after_a_kill_mid_stream_the_preview_becomes_the_one_answer(
    world: ChatWorld,
) -> None:
    scene = CRASH_STREAM
    thread = await world.ask(scene, "how did the deploy go?")

    def previewed() -> bool:
        # Edited once: the preview's id was stored before (its first edit waits for that).
        posts = world.posts(scene)
        return len(posts) == 1 and len(posts[0].texts) >= 2 and world.preview_of(thread) != ""

    await world.until(previewed, lambda: f"a preview, edited; shown: {world.shown(scene, thread)}")
    [preview] = world.posts(scene)
    assert world.preview_of(thread) == preview.ts
    assert preview.text != ANSWER_MRKDWN  # killed mid-stream
    await world.kill_and_restart()

    await world.answer(scene, thread, ANSWER_MRKDWN)
    assert only_message(world, scene) is preview
    # The resumed turn asked the model again and streamed into the same message.
    assert len(world.model.requests[scene.name]) == 2
    world.afterwards.append(lambda: only_message(world, scene))


# -- 7. a storm of 429s on edits --------------------------------------------------------------
async def test_previews_give_way_to_rate_limits_and_the_answer_still_arrives_once(
    world: ChatWorld,
) -> None:
    scene, slack = STORM, world.slack
    calls = slack.calls
    assert isinstance(calls, TimedCalls)
    limited = slack.edits_limited()
    slack.fail_edits(retry_after=RETRY_AFTER_S, for_s=60)  # every edit, until it ends below
    thread = await world.ask(scene, "how did the deploy go?")

    def edits(final: bool) -> list[float]:
        return [
            at
            for c, at in zip(calls, calls.at, strict=True)
            if c.method == "chat.update"
            and c.args.get("channel") == scene.channel
            and (c.args.get("text") == ANSWER_MRKDWN) is final
        ]

    # The storm lasts until the final answer was refused twice: the outbox waits and retries.
    await world.until(lambda: len(edits(final=True)) >= 2, "two refused edits of the answer")
    slack.fail_edits(0)
    await world.answer(scene, thread, ANSWER_MRKDWN)

    message = only_message(world, scene)
    # The first preview was posted (posts are not limited); every later one was refused, so
    # the message went from it straight to the answer.
    [first] = previews_of(message)
    assert ANSWER.startswith(first)
    previews, finals = edits(final=False), edits(final=True)
    assert previews, "no preview edit was even tried"
    assert slack.edits_limited() - limited == len(previews) + len(finals) - 1
    # Both waited out each Retry-After instead of trying again at once.
    for tries in (previews, finals):
        gaps = [b - a for a, b in itertools.pairwise(tries)]
        assert all(gap >= RETRY_AFTER_S * 0.8 for gap in gaps), gaps
    assert len(world.model.requests[scene.name]) == 1
    world.afterwards.append(lambda: only_message(world, scene))
