"""Approval cards and streamed replies on Discord, through ``geodebot serve``: the real daemon
process, discord.py against the fake Discord (REST + gateway), the anthropic SDK against the
fake model server, a real MCP server for the tool that needs approval.

One daemon serves every test of this file (tests that SIGKILL it start it again on the same
state dir); each test talks in a channel and session of its own (tests/support/chat_e2e_discord.py).
"""

from __future__ import annotations

import calendar
import itertools
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from geodebot.channels.base import parse_press_data
from geodebot.channels.render import render_for
from geodebot.chat.stream import MIN_INTERVAL_S
from tests.support.chat_e2e_discord import (
    ALICE,
    APPROVER,
    APPROVER_2,
    CHANNELS,
    EDIT_INTERVAL_S,
    EXPIRE_S,
    TOKEN,
    TOOL,
    ChatGuild,
    ChatWorld,
    literal,
    tool_results,
)
from tests.support.config import TEST_KEY
from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.discord_server import EPHEMERAL, Json, Revision
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply
from tests.support.tools import marker_lines

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEFERRED_UPDATE, EPHEMERAL_MESSAGE = 6, 4  # interaction response types
NOT_RUN = f"\n\n(Not allowed here, so not run: `{TOOL}`.)"
MAY_DECIDE = f"Only {APPROVER}, {APPROVER_2} may decide this."


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChatWorld]:
    tmp = tmp_path_factory.mktemp("chat-discord")
    async with ChatGuild(token=TOKEN) as discord, FakeLLMServer() as llm:
        world = ChatWorld.create(tmp, discord, llm)
        await world.start()
        try:
            yield world
        finally:
            for daemon in world.daemons[:-1]:
                await daemon.kill()  # reaped already: each was SIGKILLed by its test
            code = await world.daemon.stop()
            text = world.daemon.text()
            assert code == 0, text[-3000:]
            assert "Traceback" not in text
            assert TOKEN not in text
            assert TEST_KEY not in text


def runs(world: ChatWorld, text: str) -> int:
    """How often the tool ran with ``text``."""
    return marker_lines(world.notes).count(text)


def asks_to_write(world: ChatWorld, prompt: str, text: str, answer: str) -> str:
    call = Call(TOOL, {"text": text}, id=f"toolu_{len(world.model.scripts)}")
    return world.model.add(prompt, Reply(tool_calls=[call]), Reply(answer))


async def waiting(world: ChatWorld, channel: str) -> tuple[Json, Json]:
    """The channel's pending card and the preview that shows the call waiting, once both are
    up (so nothing else is posted while a test looks at them)."""
    card = await world.open_card(channel)
    await world.until(lambda: bool(world.answers(channel)), f"the progress line in {channel}")
    [preview] = world.answers(channel)
    # What the turn waits for, once the card is up (a progress line may come first).
    await world.until(
        lambda: (
            world.discord.message(preview["id"])["content"] == f"(waiting for approval of {TOOL})"
        ),
        f"the preview in {channel} saying the call waits for approval",
    )
    return card, world.discord.message(preview["id"])


def card_lines(world: ChatWorld, card: Json) -> list[str]:
    return literal(world.discord.message(card["id"])["content"]).splitlines()


async def decided(world: ChatWorld, card: Json, outcome: str) -> list[str]:
    """The card's lines once it shows ``outcome`` (its buttons gone)."""
    await world.until(
        lambda: any(line.startswith(outcome) for line in card_lines(world, card)),
        f"the card showing {outcome!r}",
    )
    assert world.discord.message(card["id"])["components"] == []
    return card_lines(world, card)


async def final_answers(world: ChatWorld, channel: str, answer: str) -> list[Json]:
    """Every message of the bot in ``channel`` that is no card, once ``answer`` is among them
    and a control message after it was answered too (so no second copy is still to come)."""
    await world.until(
        lambda: any(m["content"] == answer for m in world.answers(channel)),
        f"the answer in {channel}",
    )
    await world.control(channel)
    return world.answers(channel)


async def test_an_approvers_press_runs_the_call_once_and_the_answer_arrives_once(
    world: ChatWorld,
) -> None:
    channel = CHANNELS["approve"]
    prompt = asks_to_write(world, "please deploy build 7", "deploy 7", "Build 7 is deployed.")
    asked_at = time.time()
    asked = world.say(channel, prompt)
    card, preview = await waiting(world, channel)
    head, arguments, who, expires = card_lines(world, card)
    assert head == f"**Approval needed: {TOOL} (write)**"
    assert arguments.startswith("Arguments: {")
    assert '"deploy 7"' in arguments
    assert who == f"May decide: {APPROVER}, {APPROVER_2}"
    until = calendar.timegm(time.strptime(expires, "Expires: %Y-%m-%d %H:%M UTC"))
    assert asked_at + 900 - 60 <= until <= time.time() + 900  # the binding's default 15 min
    [row] = card["components"]
    # Two buttons, neither the default (Discord has none; neither is the primary style).
    assert [(b["label"], b["style"]) for b in row["components"]] == [("Approve", 3), ("Deny", 4)]
    presses = [parse_press_data(b["custom_id"]) for b in row["components"]]
    approval = presses[0][0] if presses[0] is not None else ""
    assert presses == [(approval, True), (approval, False)]
    assert runs(world, "deploy 7") == 0

    answer = await world.press(card, approve=True, user=APPROVER)
    assert answer["type"] == DEFERRED_UPDATE
    lines = await decided(world, card, f"Approved by {APPROVER}")
    assert lines[:3] == [head, arguments, who]  # the outcome in place of the expiry
    answers = await final_answers(world, channel, "Build 7 is deployed.")

    assert runs(world, "deploy 7") == 1
    # The answer replaced the progress line: one message, a reply to the question.
    assert [(m["id"], m["content"]) for m in answers[:-1]] == [
        (preview["id"], "Build 7 is deployed.")
    ]
    assert answers[0]["message_reference"]["message_id"] == asked
    assert answers[-1]["content"] == CONTROL_ANSWER
    assert len(world.cards(channel)) == 1
    first, then = world.requests_for(prompt)
    assert "deploy 7" in tool_results(then)[-1]
    assert not tool_results(first)


async def test_a_non_approvers_press_is_answered_privately_and_changes_nothing(
    world: ChatWorld,
) -> None:
    channel = CHANNELS["stranger"]
    prompt = asks_to_write(world, "please deploy build 8", "deploy 8", "Build 8 is deployed.")
    world.say(channel, prompt)
    card, _ = await waiting(world, channel)
    before = [dict(m) for m in world.bot_messages(channel)]

    # The asker is allowed to talk here, but not to approve.
    answer = await world.press(card, approve=True, user=ALICE)
    assert answer["type"] == EPHEMERAL_MESSAGE
    assert answer["flags"] & EPHEMERAL
    assert answer["data"]["content"] == MAY_DECIDE
    assert answer["data"]["allowed_mentions"]["parse"] == []
    # Still pending, as /status (answered at once, not queued behind the turn) tells.
    world.say(channel, "/status")
    await world.until(
        lambda: len(world.bot_messages(channel)) == len(before) + 1, "the /status answer"
    )
    *same, status = world.bot_messages(channel)
    assert same == before  # card and progress line as they were: nothing edited
    assert (
        f"Waiting for approval: {TOOL} (write), asked of {APPROVER}, {APPROVER_2}"
        in (status["content"])
    )
    assert MAY_DECIDE not in status["content"]
    assert runs(world, "deploy 8") == 0

    assert (await world.press(card, approve=True, user=APPROVER_2))["type"] == DEFERRED_UPDATE
    lines = await decided(world, card, f"Approved by {APPROVER_2}")
    await final_answers(world, channel, "Build 8 is deployed.")
    # A second press after the decision, even by an approver, is told so and does nothing.
    late = await world.press(card, approve=False, user=APPROVER)
    assert late["type"] == EPHEMERAL_MESSAGE
    assert late["flags"] & EPHEMERAL
    assert literal(late["data"]["content"]).startswith(
        f"This was decided already: Approved by {APPROVER_2}"
    )
    await world.control(channel)
    assert card_lines(world, card) == lines
    assert runs(world, "deploy 8") == 1
    contents = [m["content"] for m in world.answers(channel)]
    assert contents.count("Build 8 is deployed.") == 1
    assert contents.count(CONTROL_ANSWER) == 2
    assert not world.discord.followups  # nothing about a press was ever posted


async def test_a_denied_call_does_not_run_and_the_model_is_told(world: ChatWorld) -> None:
    channel = CHANNELS["deny"]
    prompt = asks_to_write(world, "please deploy build 9", "deploy 9", "Build 9 was not deployed.")
    world.say(channel, prompt)
    card, preview = await waiting(world, channel)
    assert (await world.press(card, approve=False, user=APPROVER_2))["type"] == DEFERRED_UPDATE
    lines = await decided(world, card, f"Denied by {APPROVER_2}")
    assert lines[-1].endswith(": not run")
    answers = await final_answers(world, channel, "Build 9 was not deployed." + NOT_RUN)
    assert [m["id"] for m in answers[:-1]] == [preview["id"]]
    assert runs(world, "deploy 9") == 0
    told = tool_results(world.requests_for(prompt)[-1])[-1]
    assert f"{APPROVER_2} denied {TOOL}" in told


async def test_an_unanswered_card_expires_as_a_denial(world: ChatWorld) -> None:
    channel = CHANNELS["expire"]
    prompt = asks_to_write(world, "please deploy build 10", "deploy 10", "Build 10 waits.")
    asked_at = time.monotonic()
    world.say(channel, prompt)
    card, preview = await waiting(world, channel)
    lines = await decided(world, card, "Expired")
    assert time.monotonic() - asked_at >= EXPIRE_S
    assert lines[-1].endswith("nobody decided in time, not run")
    answers = await final_answers(world, channel, "Build 10 waits." + NOT_RUN)
    assert [m["id"] for m in answers[:-1]] == [preview["id"]]
    assert runs(world, "deploy 10") == 0
    assert "expired" in tool_results(world.requests_for(prompt)[-1])[-1]
    late = await world.press(card, approve=True, user=APPROVER)
    assert late["type"] == EPHEMERAL_MESSAGE
    assert late["data"]["content"] == "This request expired; the call was not run."
    assert runs(world, "deploy 10") == 0


async def test_a_card_pending_at_a_sigkill_is_decided_after_the_restart(
    world: ChatWorld,
) -> None:
    channel = CHANNELS["restart"]
    prompt = asks_to_write(world, "please deploy build 11", "deploy 11", "Build 11 is deployed.")
    asked = world.say(channel, prompt)
    card, preview = await waiting(world, channel)
    await world.until_true(lambda: world.preview_recorded(asked), "the progress line recorded")
    await world.kill_and_restart()

    assert (await world.press(card, approve=True, user=APPROVER))["type"] == DEFERRED_UPDATE
    await decided(world, card, f"Approved by {APPROVER}")
    answers = await final_answers(world, channel, "Build 11 is deployed.")
    assert [c["id"] for c in world.cards(channel)] == [card["id"]]  # no second card
    assert runs(world, "deploy 11") == 1
    assert [(m["id"], m["content"]) for m in answers[:-1]] == [
        (preview["id"], "Build 11 is deployed.")
    ]
    # The resumed turn asked the model once more, for the round after the call.
    first, then = world.requests_for(prompt)
    assert not tool_results(first)
    assert "deploy 11" in tool_results(then)[-1]


# -- streamed answers ---------------------------------------------------------------------
def report(title: str) -> str:
    """An answer whose Discord rendering differs from its source: a heading Discord cannot
    show (####) becomes bold, a mass mention is defused."""
    return (
        f"#### {title}\n\nAll 12 hosts run **v2.4**; the canary stayed green for an hour. "
        "Rollback is `deploy --undo`. Tell @here when the window closes.\n\n"
        "- api: ok\n- workers: ok\n- cron: ok"
    )


def streamed(text: str) -> Reply:
    return Reply(text, chunks=20, chunk_delay_s=0.1)


async def the_one_answer(world: ChatWorld, channel: str, answer: str) -> Json:
    """The channel's single answer message, once it shows ``answer`` in Discord's markup and
    a control after it was answered too."""
    [rendered] = render_for("discord", answer)
    assert rendered != answer  # so a preview (the source as is) cannot pass for it
    answers = await final_answers(world, channel, rendered)
    assert [m["content"] for m in answers] == [rendered, CONTROL_ANSWER]
    return answers[0]


def previews(world: ChatWorld, message: Json, answer: str) -> list[Revision]:
    """The message's texts before its final one; each must be how far the answer had got."""
    *shown, final = world.discord.revisions[message["id"]]
    assert final.text == message["content"]
    for revision in shown:
        assert answer.startswith(revision.text), revision.text
    return shown


async def test_a_streamed_answer_is_one_message_edited_as_it_arrives(world: ChatWorld) -> None:
    channel = CHANNELS["stream"]
    answer = report("Rollout report")
    prompt = world.model.add("how did the rollout go?", streamed(answer))
    asked = world.say(channel, prompt)
    message = await the_one_answer(world, channel, answer)

    assert message["message_reference"]["message_id"] == asked
    shown = previews(world, message, answer)
    # A first preview and at least one edit, for a 2 s answer paced at Discord's floor.
    assert len(shown) >= 2
    assert len({r.text for r in shown}) == len(shown)  # each edit showed something new
    gaps = [b.at - a.at for a, b in itertools.pairwise(shown)]
    # Paced by the daemon at EDIT_INTERVAL_S, but never closer than Discord's 5 edits per
    # 5 s leave room for (the final edit among them); what arrives here may be a little
    # closer together than it was sent, never much.
    assert min(gaps) >= max(EDIT_INTERVAL_S, MIN_INTERVAL_S["discord"]) - 0.05, gaps
    assert len(world.discord.posted[channel]) == 2  # the answer and the control's
    [request] = world.requests_for(prompt)
    assert request["stream"] is True


async def test_a_sigkill_mid_stream_ends_in_one_answer_the_preview_edited_to_it(
    world: ChatWorld,
) -> None:
    channel = CHANNELS["crash"]
    answer = report("Incident summary")
    prompt = world.model.add("summarise the incident", streamed(answer))
    asked = world.say(channel, prompt)
    await world.until(lambda: bool(world.answers(channel)), "the first preview")
    [preview] = world.answers(channel)
    await world.until_true(lambda: world.preview_recorded(asked), "the preview recorded")
    await world.kill_and_restart()
    before_kill = len(world.discord.revisions[preview["id"]])

    message = await the_one_answer(world, channel, answer)
    assert message["id"] == preview["id"]
    assert len(previews(world, message, answer)) >= before_kill
    assert len(world.discord.posted[channel]) == 2  # the preview (now the answer), the control
    # The turn was asked again after the restart: the answer it got before was never whole.
    assert len(world.requests_for(prompt)) == 2


async def test_a_429_storm_on_edits_skips_previews_and_the_answer_arrives_once(
    world: ChatWorld,
) -> None:
    channel = CHANNELS["storm"]
    answer = report("Capacity")
    storm = 20  # discord.py tries each edit 5 times: the storm outlasts the whole stream
    world.discord.fail_edits(storm, retry_after=0.1)
    prompt = world.model.add("how much capacity is left?", streamed(answer))
    world.say(channel, prompt)
    message = await the_one_answer(world, channel, answer)

    # Only the first preview (a new message, not an edit) got through, then the answer.
    assert len(previews(world, message, answer)) == 1
    assert world.discord.limited_edits == [message["id"]] * storm
    assert len(world.discord.posted[channel]) == 2
    assert "preview skipped" in world.daemon.text()
