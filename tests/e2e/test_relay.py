"""Thread Relay end to end: ``geodebot serve`` as a real process on the fake Telegram Bot API
and the fake Slack at once, the anthropic SDK against the fake model server, whose scripted
model makes the thread_* calls.

One daemon serves every test of this file (tests/support/relay_world.py): two Telegram chats
and a Slack channel of project ``ops``, a Telegram chat of project ``other``. Each test has
prompts and idempotency keys of its own, and reads a target in the same script before it
sends there, so the tests do not depend on each other's messages. What a test asserts about
a chat is asserted after a control message there was answered (tests/support/control.py):
whatever the test caused has arrived by then. The last test SIGKILLs the daemon and starts it
again on the same state directory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from geodebot.channels.slack.cards import DENY_ACTION
from tests.support.cli import geodebot
from tests.support.config import TEST_KEY
from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.llm_server import Reply
from tests.support.fakes.slack_server import Posted
from tests.support.fakes.telegram_server import CallbackAnswer, FakeTelegram, SentMessage
from tests.support.relay_world import (
    ALICE,
    BOB,
    ENVELOPE_TTL_S,
    OTHER,
    RELAYED_MARK,
    SLACK,
    SLACK_C,
    TG_A,
    TG_B,
    TG_X,
    A,
    B,
    GatedLLM,
    Held,
    KillingSlack,
    RelayWorld,
    Result,
    attributed,
    calls,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

FROM_A = f"telegram:{TG_A}"  # where thread ops-a is, as an attributed post names it
FROM_SLACK = f"slack:{SLACK_C}"
AGENT = "agent_proposed_user_approved"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RelayWorld]:
    async with FakeTelegram() as telegram, KillingSlack() as slack, GatedLLM() as llm:
        world = RelayWorld(telegram, slack, llm, tmp_path_factory.mktemp("relay"))
        await world.start()
        try:
            yield world
        finally:
            if world.running():
                assert world.daemon is not None
                code = await world.daemon.stop()
                assert code == 0, world.logged()[-3000:]
            logged = world.logged()
            assert "Traceback" not in logged, logged[-3000:]
            for secret in (telegram.token, slack.bot_token, slack.app_token, TEST_KEY):
                assert secret not in logged


@pytest_asyncio.fixture(loop_scope="module")
async def world(shared: RelayWorld) -> RelayWorld:
    # A test that failed after killing the daemon leaves none: the next one gets a fresh one.
    if not shared.running():
        await shared.start()
    return shared


# -- the calls the model makes ----------------------------------------------------------------
def status(thread: str) -> tuple[str, dict[str, Any]]:
    return "thread_status", {"thread": thread}


def read(thread: str) -> tuple[str, dict[str, Any]]:
    return "thread_read", {"thread": thread}


def send(
    thread: str, text: str, key: str, *, intent: str = "notify", mode: str = "user_authored"
) -> tuple[str, dict[str, Any]]:
    arguments = {"thread": thread, "text": text, "mode": mode, "intent": intent}
    return "thread_send", {**arguments, "idempotency_key": key}


def delivered(result: Result) -> dict[str, Any]:
    """The receipt of a delivered send's result."""
    assert not result.is_error, result.text
    receipt = result.receipt
    assert receipt["state"] == "delivered", receipt
    return receipt


def refused(result: Result, state: str = "refused") -> dict[str, Any]:
    """The receipt a refused send's tool error carries."""
    assert result.is_error, result.text
    receipt = result.receipt
    assert receipt["state"] == state, receipt
    return receipt


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def posts_of(texts: list[str], text: str) -> int:
    return sum(1 for t in texts if t == text)


async def press(telegram: FakeTelegram, card: SentMessage, label: str, user: int) -> CallbackAnswer:
    """``user`` presses ``label`` on ``card``."""
    [data] = [data for shown, data in card.buttons if shown == label]
    query = telegram.push_callback_query(card.chat_id, card.message_id, data, user_id=user)
    return await telegram.wait_for_callback_answer(query, timeout=20)


def cards(world: RelayWorld, chat: int) -> list[SentMessage]:
    """The approval cards posted in a Telegram chat."""
    return [m for m in world.telegram.sent[chat] if m.buttons]


def slack_cards(world: RelayWorld) -> list[Posted]:
    """The approval cards posted in the Slack channel."""
    return [p for p in world.slack_posts() if p.blocks]


# -- 1. reads -----------------------------------------------------------------------------------
async def test_list_shows_the_projects_threads_and_read_shows_the_targets_messages(
    world: RelayWorld,
) -> None:
    question = "[t1-history] is the db migration done?"
    world.model.script(question, Reply("Yes: the migration finished at 10:02."))
    world.say(TG_B, question, user=BOB)
    await world.tg_showing(TG_B, "Yes: the migration finished at 10:02.")

    prompt = "[t1-read] what did B say about the migration?"
    world.model.script(
        prompt,
        calls("t1r0", ("thread_list", {})),
        calls("t1r1", read(B)),
        Reply("B says the migration finished at 10:02."),
    )
    world.say(TG_A, prompt)
    await world.tg_showing(TG_A, "B says the migration finished at 10:02.")

    [listed] = world.model.results(prompt, 1)
    assert not listed.is_error, listed.text
    threads = listed.json()
    assert threads["project"] == "ops"
    rows = {row["thread"]: row for row in threads["threads"]}
    assert set(rows) == {A, B, SLACK}  # not the "other" project's chat
    assert OTHER not in listed.text
    assert rows[A]["this_thread"] is True
    assert rows[B]["this_thread"] is False
    assert (rows[B]["adapter"], rows[B]["where"]) == ("telegram", f"telegram:{TG_B}")
    assert (rows[SLACK]["adapter"], rows[SLACK]["where"]) == ("slack", FROM_SLACK)

    [shown] = world.model.results(prompt, 2)
    assert not shown.is_error, shown.text
    view = shown.json()
    assert view["locator"]["thread"]["session_id"] == B
    assert view["locator"]["project"] == "ops"
    assert view["state"] == "idle"
    said = [(m["role"], m["text"]) for m in view["messages"]]
    assert ("assistant", "Yes: the migration finished at 10:02.") in said
    [asked_at] = [i for i, (role, text) in enumerate(said) if role == "user" and question in text]
    assert said[asked_at + 1] == ("assistant", "Yes: the migration finished at 10:02.")
    # The read is what a later send is checked against: its revision is the target's.
    [(next_seq,)] = world.stored("SELECT next_seq FROM sessions WHERE id = ?", B)
    assert view["revision"] == next_seq - 1
    [(revision,)] = world.stored(
        "SELECT revision FROM relay_reads WHERE source_session = ? AND target_session = ?", A, B
    )
    assert revision == view["revision"]


# -- 2. notify ----------------------------------------------------------------------------------
async def test_a_notify_is_posted_once_in_each_target_and_recorded_without_a_model_call(
    world: RelayWorld,
) -> None:
    text = "[t2-notify] the deploy of v7 is done"
    world.model.script(
        text,
        calls("t2r0", status(B), status(SLACK)),
        calls("t2r1", send(B, text, "t2-b"), send(SLACK, text, "t2-slack")),
        Reply("Posted it in both threads."),
    )
    world.say(TG_A, text)
    await world.tg_showing(TG_A, "Posted it in both threads.")

    to_b, to_slack = world.model.results(text, 2)
    receipts = delivered(to_b), delivered(to_slack)
    for receipt, target in zip(receipts, (B, SLACK), strict=True):
        assert receipt["action"] == "notify"
        assert receipt["target"]["thread"]["session_id"] == target
        assert receipt["content_sha256"] == sha256(text)
        assert text not in json.dumps(receipt)  # a checksum, never the text
    post = attributed(A, FROM_A, str(ALICE), text)
    await world.tg_showing(TG_B, post)
    await world.slack_showing(post)
    await world.until_taken(A)

    # Recorded in each target: the inbox row finished without an answer, the message in the
    # session's history.
    for receipt, target in zip(receipts, (B, SLACK), strict=True):
        inbox = receipt["references"]["target_inbox"]
        [(status_, detail, relay_id, intent)] = world.stored(
            "SELECT status, detail, relay_id, relay_intent FROM inbox WHERE id = ?", inbox
        )
        assert (status_, relay_id, intent) == ("done", receipt["id"], "notify"), detail
        users = [c for role, c in world.history(target) if role == "user" and text in c]
        assert len(users) == 1
        assert RELAYED_MARK in users[0]
    # Nobody asked the model about it.
    assert world.model.rounds(text, relayed=True) == []
    assert [t for t in world.model.newest if RELAYED_MARK in t and text in t] == []

    b_texts = await world.tg_control(TG_B)
    slack_texts = await world.slack_control()
    assert posts_of(b_texts, post) == 1
    assert posts_of(slack_texts, post) == 1
    assert b_texts[b_texts.index(post) + 1 :] == [CONTROL_ANSWER]
    assert slack_texts[slack_texts.index(post) + 1 :] == [CONTROL_ANSWER]
    # The target's next turn has the relayed message in its history.
    control_request = json.dumps(world.llm.requests[-1].json)
    assert text in control_request


# -- 3. ask -------------------------------------------------------------------------------------
async def test_an_ask_is_posted_in_slack_and_answered_there_once(world: RelayWorld) -> None:
    text = "[t3-ask] which version runs in staging?"
    world.model.script(
        text,
        calls("t3r0", status(SLACK)),
        calls("t3r1", send(SLACK, text, "t3-k", intent="ask")),
        Reply("I asked the Slack thread."),
    )
    world.model.script_relayed(text, Reply("Staging runs v7.1."))
    world.say(TG_A, text)
    await world.tg_showing(TG_A, "I asked the Slack thread.")
    [result] = world.model.results(text, 2)
    receipt = delivered(result)
    assert receipt["action"] == "ask"

    post = attributed(A, FROM_A, str(ALICE), text)
    await world.slack_showing("Staging runs v7.1.")
    texts = await world.slack_control()
    assert posts_of(texts, post) == 1
    assert posts_of(texts, "Staging runs v7.1.") == 1
    assert texts.index(post) < texts.index("Staging runs v7.1.")
    assert texts[texts.index("Staging runs v7.1.") + 1 :] == [CONTROL_ANSWER]

    # The target's turn ran on the relayed message, once.
    assert world.model.rounds(text, relayed=True) == [0]
    [asked] = [t for t in world.model.newest if t.startswith(RELAYED_MARK) and text in t]
    head, _, body = asked.partition("\n")
    assert head.startswith(f"{RELAYED_MARK}{A} ({FROM_A}) by {ALICE}; ask; envelope env-")
    assert body == text
    [(status_, relay_intent)] = world.stored(
        "SELECT status, relay_intent FROM inbox WHERE relay_id = ?", receipt["id"]
    )
    assert (status_, relay_intent) == ("done", "ask")
    # The source chat got its own answer, and no post of the relay.
    assert post not in world.tg_texts(TG_A)


# -- 4. stale -----------------------------------------------------------------------------------
async def test_a_message_in_the_target_between_read_and_send_makes_the_send_stale(
    world: RelayWorld,
) -> None:
    text = "[t4-stale] the cache was flushed"
    send_round = Held(then=calls("t4r1", send(B, text, "t4-k")))
    world.model.script(
        text, calls("t4r0", read(B)), send_round, Reply("B changed meanwhile; not sent.")
    )
    world.say(TG_A, text)
    await world.model.until_round(text, 1)  # read, and the send held back
    interjection = "[t4-interject] who is on call tonight?"
    world.model.script(interjection, Reply("Carol is on call."))
    world.say(TG_B, interjection, user=BOB)
    await world.tg_showing(TG_B, "Carol is on call.")
    send_round.gate.set()
    await world.tg_showing(TG_A, "B changed meanwhile; not sent.")

    [result] = world.model.results(text, 2)
    receipt = refused(result, "stale")
    assert "changed since it was read" in receipt["reason"], receipt
    stored = world.delivery(receipt["id"])
    assert (stored["state"], stored["idem_key"], stored["inbox_id"]) == ("stale", None, None)

    texts = await world.tg_control(TG_B)
    assert [t for t in texts if text in t] == []
    # The text is in no inbox but that of the person's own message in A.
    assert world.stored("SELECT session_id FROM inbox WHERE text LIKE ?", f"%{text}%") == [(A,)]


# -- 5. expired ---------------------------------------------------------------------------------
async def test_a_send_on_a_read_older_than_the_envelope_ttl_is_expired(world: RelayWorld) -> None:
    # The shared daemon's envelope_ttl_s is short (ENVELOPE_TTL_S): the send round is held
    # until the read is past it. The one wait of the file that is a time, not an event: an
    # expiry is nothing but time passing. It ends at the instant the status itself names.
    text = "[t5-expired] the backup ran late"
    send_round = Held(then=calls("t5r1", send(B, text, "t5-k")))
    world.model.script(text, calls("t5r0", status(B)), send_round, Reply("Too late to send."))
    world.say(TG_A, text)
    await world.model.until_round(text, 1)
    [seen] = world.model.results(text, 1)
    valid_until = float(seen.json()["send_valid_until"])
    assert valid_until - time.time() <= ENVELOPE_TTL_S
    await asyncio.sleep(max(0.0, valid_until - time.time()) + 0.3)
    send_round.gate.set()
    await world.tg_showing(TG_A, "Too late to send.")

    [result] = world.model.results(text, 2)
    receipt = refused(result, "expired")
    assert "too old" in receipt["reason"]
    texts = await world.tg_control(TG_B)
    assert [t for t in texts if text in t] == []


# -- 6. idempotency -----------------------------------------------------------------------------
async def test_a_repeated_key_returns_the_first_receipt_and_posts_once(world: RelayWorld) -> None:
    text = "[t6-idem] maintenance window starts at 22:00"
    world.model.script(
        text,
        calls("t6r0", status(B)),
        calls("t6r1", send(B, text, "t6-k")),
        calls("t6r2", send(B, text, "t6-k")),
        Reply("Sent once."),
    )
    world.say(TG_A, text)
    await world.tg_showing(TG_A, "Sent once.")

    [first] = world.model.results(text, 2)
    [again] = world.model.results(text, 3)
    receipt = delivered(first)
    assert not again.is_error, again.text
    assert again.receipt == receipt
    assert "nothing was sent again" in again.json().get("note", ""), again.text

    post = attributed(A, FROM_A, str(ALICE), text)
    await world.tg_showing(TG_B, post)
    await world.until_taken(A)
    texts = await world.tg_control(TG_B)
    assert posts_of(texts, post) == 1
    rows = world.stored(
        "SELECT id FROM relay_deliveries WHERE source_session = ? AND idem_key = ?", A, "t6-k"
    )
    assert rows == [(receipt["id"],)]
    assert len(world.stored("SELECT id FROM inbox WHERE relay_id = ?", receipt["id"])) == 1


# -- 7. depth -----------------------------------------------------------------------------------
async def test_a_turn_answering_a_relayed_ask_may_not_relay_further(world: RelayWorld) -> None:
    text = "[t7-depth] please pass this back to A"
    world.model.script(
        text,
        calls("t7r0", status(SLACK)),
        calls("t7r1", send(SLACK, text, "t7-k", intent="ask")),
        Reply("Asked Slack."),
    )
    back = "[t7-back] Slack answers A"
    world.model.script_relayed(
        text,
        calls("t7s0", status(A)),
        calls("t7s1", send(A, back, "t7-back", intent="notify")),
        Reply("I may not relay this further."),
    )
    world.say(TG_A, text)
    await world.tg_showing(TG_A, "Asked Slack.")
    delivered(world.model.results(text, 2)[0])
    await world.slack_showing("I may not relay this further.")

    [seen] = world.model.results(text, 1, relayed=True)
    assert not seen.is_error, seen.text
    [result] = world.model.results(text, 2, relayed=True)
    receipt = refused(result)
    assert "forwarding depth" in receipt["reason"]
    stored = world.delivery(receipt["id"])
    assert (stored["source_session"], stored["target_session"]) == (SLACK, A)
    assert (stored["state"], stored["outbox_id"]) == ("refused", None)

    texts = await world.tg_control(TG_A)
    assert [t for t in texts if t.startswith(f"From #{SLACK}") or back in t] == []
    relayed_to_a = world.stored(
        "SELECT text FROM inbox WHERE session_id = ? AND relay_id IS NOT NULL", A
    )
    assert relayed_to_a == []
    slack_texts = await world.slack_control()
    assert posts_of(slack_texts, "I may not relay this further.") == 1


async def test_agent_written_text_may_not_relay_further_either(world: RelayWorld) -> None:
    # The same rule for text the model wrote: the turn answering the relayed ask acts for
    # the asker of another chat (another platform even), who cannot press a card here. The
    # send is refused for its depth; no card is shown for it.
    text = "[t7b-depth] please have Slack write to A itself"
    world.model.script(
        text,
        calls("t7br0", status(SLACK)),
        calls("t7br1", send(SLACK, text, "t7b-k", intent="ask")),
        Reply("Asked Slack to write."),
    )
    back = "[t7b-back] Slack's own words for A"
    world.model.script_relayed(
        text,
        calls("t7bs0", status(A)),
        calls("t7bs1", send(A, back, "t7b-back", intent="notify", mode=AGENT)),
        Reply("I may not write to A from here."),
    )
    world.say(TG_A, text)
    await world.tg_showing(TG_A, "Asked Slack to write.")
    answer = "I may not write to A from here."
    try:
        await world.until(
            lambda: any(answer in t for t in world.slack_texts()) or slack_cards(world),
            "the relayed turn's answer (or a card) in Slack",
        )
        assert slack_cards(world) == [], "a card asks the asker of another chat to approve"
        [result] = world.model.results(text, 2, relayed=True)
        assert result.is_error
        assert "forwarding depth" in result.text
    finally:
        # A card left pending holds the Slack session for approval_timeout_s: denied here
        # (as its addressee), so that the tests after this one find the session free.
        for card in slack_cards(world):
            if world.slack.buttons(SLACK_C, card.ts):
                await world.slack.push_action(SLACK_C, card.ts, str(ALICE), action_id=DENY_ACTION)
    texts = await world.tg_control(TG_A)
    assert [t for t in texts if back in t] == []
    sent = world.stored("SELECT state FROM relay_deliveries WHERE source_session = ?", SLACK)
    assert ("delivered",) not in sent
    # Like every refusal of a send: its receipt (state refused, with the reason), recorded
    # keyless in relay_deliveries.
    receipt = refused(result)
    assert "forwarding depth" in receipt["reason"]
    stored = world.delivery(receipt["id"])
    assert (stored["source_session"], stored["target_session"]) == (SLACK, A)
    assert (stored["state"], stored["idem_key"]) == ("refused", None)
    events = world.stored(
        "SELECT session_id, kind FROM timeline WHERE json_extract(data, '$.delivery') = ?",
        receipt["id"],
    )
    # On both threads' timelines, as every attempt on a thread of the caller's project.
    assert sorted(events) == sorted([(SLACK, "relay_refused"), (A, "relay_refused")])


# -- 8. in flight -------------------------------------------------------------------------------
async def test_a_fifth_delivery_in_flight_is_refused(world: RelayWorld) -> None:
    # B is busy: its turn is held, so what is delivered there waits in its inbox, in flight.
    hold = "[t8-hold] run the long job"
    held = Held(then=Reply("The long job is done."))
    world.model.script(hold, held)
    world.say(TG_B, hold, user=BOB)
    await world.model.until_round(hold, 0)

    text = "[t8-fanout] restart the cache on your node"
    keys = [f"t8-k{i}" for i in range(1, 6)]
    world.model.script(
        text,
        calls("t8r0", status(B)),
        calls("t8r1", *(send(B, text, key, intent="ask") for key in keys)),
        Reply("Four of five went out."),
    )
    world.model.script_relayed(text, Reply("Cache restarted here."))
    try:
        world.say(TG_A, text)
        await world.tg_showing(TG_A, "Four of five went out.")
        [seen] = world.model.results(text, 1)
        assert seen.json()["state"] == "running"
        results = world.model.results(text, 2)
        assert len(results) == 5
        # The sends of a batch run one after the other: the fifth finds four in flight.
        receipts = [delivered(r) for r in results[:4]]
        refusal = refused(results[4])
        assert "in flight" in refusal["reason"], refusal
        post = attributed(A, FROM_A, str(ALICE), text)
        await world.until(
            lambda: posts_of(world.tg_texts(TG_B), post) == 4, "four attributed posts in B"
        )
        assert world.in_flight(A) == 4
        assert world.model.rounds(text, relayed=True) == []  # B is still busy
    finally:
        held.gate.set()
    await world.tg_showing(TG_B, "The long job is done.")
    await world.until(
        lambda: world.tg_texts(TG_B).count("Cache restarted here.") == 4, "four answers in B"
    )
    await world.until_taken(A)
    texts = await world.tg_control(TG_B)
    assert posts_of(texts, post) == 4
    assert texts.count("Cache restarted here.") == 4
    stored = world.stored(
        "SELECT idem_key, state FROM relay_deliveries WHERE source_session = ? AND source_turn = "
        "(SELECT source_turn FROM relay_deliveries WHERE id = ?)",
        A,
        receipts[0]["id"],
    )
    assert sorted(s for _, s in stored) == ["delivered"] * 4 + ["refused"]
    assert len({k for k, s in stored if s == "delivered"}) == 4


# -- 9. another project -------------------------------------------------------------------------
async def test_another_projects_thread_cannot_be_read_or_sent_to(world: RelayWorld) -> None:
    text = "[t9-cross] tell the other team we are done"
    world.model.script(
        text,
        calls("t9r0", read(OTHER), read("no-such-thread")),
        calls("t9r1", status(OTHER), send(OTHER, text, "t9-k")),
        Reply("There is no such thread here."),
    )
    world.say(TG_A, text)
    await world.tg_showing(TG_A, "There is no such thread here.")

    other_read, none_read = world.model.results(text, 1)
    assert other_read.is_error
    assert none_read.is_error
    assert f"there is no thread {OTHER!r} in project 'ops'" in other_read.text
    # The same answer as for a thread that does not exist at all.
    assert other_read.text.replace(OTHER, "X") == none_read.text.replace("no-such-thread", "X")
    other_status, other_send = world.model.results(text, 2)
    assert other_status.is_error
    assert "there is no thread" in other_status.text
    receipt = refused(other_send)
    assert receipt["reason"] == f"there is no thread {OTHER!r} in project 'ops'"
    assert receipt["target"] is None

    reads = world.stored(
        "SELECT * FROM relay_reads WHERE source_session = ? AND target_session = ?", A, OTHER
    )
    assert reads == []
    relayed_there = world.stored(
        "SELECT id FROM inbox WHERE session_id = ? AND relay_id IS NOT NULL", OTHER
    )
    assert relayed_there == []
    [(state,)] = world.stored("SELECT state FROM relay_deliveries WHERE id = ?", receipt["id"])
    assert state == "refused"
    texts = await world.tg_control(TG_X)
    assert texts == [CONTROL_ANSWER]


# -- 10. agent-written text ---------------------------------------------------------------------
async def test_agent_written_text_goes_only_with_the_senders_own_approval(
    world: RelayWorld,
) -> None:
    prompt = "[t10-agent] let B know the release moves"
    words = "[t10-words] Heads-up: the release moves to Friday."
    proposed = send(B, words, "t10-k", mode=AGENT)
    world.model.script(
        prompt,
        calls("t10r0", status(B)),
        calls("t10r1", proposed),
        calls("t10r2", status(B)),
        calls("t10r3", proposed),
        Reply("B knows now."),
    )
    world.say(TG_A, prompt)
    post = attributed(A, FROM_A, str(ALICE), words)

    # The first card: Bob's press does not count, Alice denies.
    await world.until(lambda: len(cards(world, TG_A)) >= 1, "the first card")
    first = cards(world, TG_A)[0]
    lines = [line for line in first.text.splitlines() if line]
    assert any("thread_send" in line for line in lines), first.text
    assert words in first.text
    assert f"May decide: {ALICE}" in first.text
    not_his = await press(world.telegram, first, "Approve", BOB)
    assert (not_his.text, not_his.show_alert) == (f"Only {ALICE} may decide this.", True)
    assert (await press(world.telegram, first, "Deny", ALICE)).text == "Denied."
    await world.model.until_round(prompt, 2)
    [denied] = world.model.results(prompt, 2)
    assert denied.is_error
    assert f"{ALICE} denied thread_send; it was not run" in denied.text

    # The second card: Bob's approval does not count either; Alice approves.
    await world.until(lambda: len(cards(world, TG_A)) >= 2, "the second card")
    second = cards(world, TG_A)[1]
    not_his = await press(world.telegram, second, "Approve", BOB)
    assert (not_his.text, not_his.show_alert) == (f"Only {ALICE} may decide this.", True)
    assert post not in world.tg_texts(TG_B)
    assert (await press(world.telegram, second, "Approve", ALICE)).text == "Approved."
    # (The answer says that a call was not run: the denied one.)
    await world.tg_showing(TG_A, "B knows now.", part=True)

    [result] = world.model.results(prompt, 4)
    receipt = delivered(result)
    stored = world.delivery(receipt["id"])
    assert (stored["mode"], stored["idem_key"], stored["user_id"]) == (AGENT, "t10-k", str(ALICE))
    await world.tg_showing(TG_B, post)
    await world.until_taken(A)
    texts = await world.tg_control(TG_B)
    assert posts_of(texts, post) == 1
    sends = world.stored(
        "SELECT state FROM relay_deliveries WHERE content_sha256 = ?", sha256(words)
    )
    assert sends == [("delivered",)]


# -- 11. SIGKILL mid-delivery ---------------------------------------------------------------------
async def test_a_sigkill_as_the_post_goes_out_still_delivers_and_answers_once(
    world: RelayWorld,
) -> None:
    text = "[t11-crash] is the Slack worker healthy?"
    # The turn's answer waits for the kill: a Telegram send cut off by it could not be looked
    # up, and the outbox sends such a part once more (see chat/outbox.py), which this test is
    # not about.
    answer = Held(then=Reply("I asked Slack about the worker."))
    world.model.script(
        text,
        calls("t11r0", status(SLACK)),
        calls("t11r1", send(SLACK, text, "t11-k", intent="ask")),
        answer,
    )
    world.model.script_relayed(text, Reply("The worker is healthy."))
    post = attributed(A, FROM_A, str(ALICE), text)
    # Killed the moment Slack stores the post: the daemon never hears that it went out.
    world.kill_at_slack_post(post[:40])
    world.say(TG_A, text)
    assert world.daemon is not None
    async with asyncio.timeout(30):
        assert world.daemon.proc is not None
        await world.daemon.proc.wait()
    await world.daemon.kill()  # reaped
    assert world.daemon.proc.returncode == -signal.SIGKILL
    answer.gate.set()
    # Mid-delivery: committed, posted, and the post not yet known to be.
    assert posts_of(world.slack_texts(), post) == 1
    [(outbox_id, outbox_status)] = world.stored(
        "SELECT o.id, o.status FROM relay_deliveries AS d JOIN outbox AS o ON o.id = d.outbox_id "
        "WHERE d.source_session = ? AND d.idem_key = ?",
        A,
        "t11-k",
    )
    assert outbox_status == "pending"
    await world.start()

    await world.slack_showing("The worker is healthy.")
    await world.tg_showing(TG_A, "I asked Slack about the worker.")
    await world.until_taken(A)
    slack_texts = await world.slack_control()
    assert posts_of(slack_texts, post) == 1
    assert posts_of(slack_texts, "The worker is healthy.") == 1
    a_texts = await world.tg_control(TG_A)
    assert posts_of(a_texts, "I asked Slack about the worker.") == 1

    [(delivery_id, inbox_id)] = world.stored(
        "SELECT id, inbox_id FROM relay_deliveries WHERE source_session = ? AND idem_key = ?",
        A,
        "t11-k",
    )
    assert world.stored("SELECT id, status FROM inbox WHERE relay_id = ?", delivery_id) == [
        (inbox_id, "done")
    ]
    [(outbox_status,)] = world.stored("SELECT status FROM outbox WHERE id = ?", outbox_id)
    assert outbox_status == "sent"
    events = world.stored(
        "SELECT session_id, kind FROM timeline WHERE json_extract(data, '$.delivery') = ?",
        delivery_id,
    )
    assert sorted(events) == [(A, "relay_sent"), (SLACK, "relay_received")]
    # The source's turn got the receipt (again, if it ran the call again: the same one).
    receipts = {r.receipt["id"] for r in world.model.results(text, 2) if not r.is_error}
    assert receipts == {delivery_id}

    # The operator's view of it.
    code, out, err = await geodebot(
        "relay", "list", "--json", "--config", str(world.config_path), env=world.env()
    )
    assert code == 0, err
    listed = [json.loads(line) for line in out.splitlines() if line.strip()]
    [mine] = [row for row in listed if row["id"] == delivery_id]
    assert (mine["state"], mine["intent"], mine["idempotency_key"]) == ("delivered", "ask", "t11-k")
    assert (mine["source_session"], mine["target_session"]) == (A, SLACK)
    assert mine["receipt"]["content_sha256"] == sha256(text)
    assert text not in out
    # Newest first; refusals are listed too, keyless.
    assert listed[0]["id"] == delivery_id
    assert all(row["idempotency_key"] is None for row in listed if row["state"] != "delivered")
    code, out, err = await geodebot(
        "relay", "show", delivery_id, "--config", str(world.config_path), env=world.env()
    )
    assert code == 0, err
    shown = json.loads(out)
    assert shown["receipt"] == mine["receipt"]
    assert shown["target_inbox"] == inbox_id
    assert shown["target_outbox"] == outbox_id
    assert text not in out
