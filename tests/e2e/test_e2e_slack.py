"""``geodebot serve`` end to end: a real daemon process against FakeSlack and FakeLLMServer.

Both fakes run in the test's event loop; the daemon is a subprocess (tests/support/daemon.py)
reading a config written to tmp_path, so everything between the Socket Mode websocket and the
model's HTTP API is the production code path: adapter, gate, inbox, lanes, turn, outbox.

Whenever a test says "exactly once", it checks again after the daemon has stopped (SIGTERM
drains the outbox), so a late duplicate cannot slip in after the assertion.
"""

from __future__ import annotations

import re
import time

from geodebot.config.schema import DB_FILE
from geodebot.store.sqlite import SQLiteStore
from tests.support.fakes.llm_server import Delay, Reply
from tests.support.fakes.slack_server import FakeSlack
from tests.support.slack_world import (
    ALICE,
    BOB,
    DEV,
    MALLORY,
    OPS,
    OPS2,
    QUIET,
    UNBOUND,
    Rig,
    TimedCalls,
    assert_clean_log,
    eventually,
    log_events,
    new_ts,
)


# -- 1. answered in place ---------------------------------------------------------------------
async def test_bound_messages_are_answered_once_in_their_thread(rig: Rig) -> None:
    rig.llm.script(Reply("ops answer"), Reply("dev top answer"), Reply("dev thread answer"))
    daemon = await rig.start()

    ops_msg, ops_envelope = await rig.send(OPS, "what is the load?")
    [ops_reply] = await rig.wait_posts(OPS, 1)
    # Channel scope: the answer goes into a thread under the message it answers.
    assert (ops_reply.text, ops_reply.thread_ts) == ("ops answer", ops_msg["ts"])
    assert rig.slack.acked(ops_envelope)

    top, _ = await rig.send(DEV, "top-level in dev")
    await rig.wait_posts(DEV, 1)
    root = "1699999999.000500"
    _, thread_envelope = await rig.send(DEV, "inside a thread", user=BOB, thread_ts=root)
    dev_top, dev_thread = await rig.wait_posts(DEV, 2)
    assert (dev_top.text, dev_top.thread_ts) == ("dev top answer", top["ts"])
    assert (dev_thread.text, dev_thread.thread_ts) == ("dev thread answer", root)
    assert rig.slack.acked(thread_envelope)
    assert rig.llm.user_texts(2)[-1].endswith("inside a thread")
    # The thread is a session of its own: it does not see the top-level exchange.
    assert not any("top-level in dev" in t for t in rig.llm.user_texts(2))

    assert await daemon.stop() == 0
    assert [p.text for p in rig.posts(OPS)] == ["ops answer"]
    assert [p.text for p in rig.posts(DEV)] == ["dev top answer", "dev thread answer"]
    assert len(rig.llm.requests) == 3
    assert len(rig.slack.calls_to("chat.postMessage")) == 3
    assert_clean_log(daemon, rig.slack)

    store = SQLiteStore(rig.state_dir / DB_FILE)
    await store.open()
    try:
        sessions = {s.id for s in await store.list_sessions()}
    finally:
        await store.close()
    assert {"ops", "dev", f"dev/{root}"} <= sessions


# -- 2. the gate ------------------------------------------------------------------------------
async def test_gated_messages_reach_no_model_and_get_no_answer(rig: Rig) -> None:
    rig.llm.script(Reply("control answer"))
    daemon = await rig.start()
    slack = rig.slack

    await rig.send(UNBOUND, "nobody bound this channel")
    await rig.send(DEV, "let me in", user=MALLORY)
    await rig.send(OPS, "my own answer", user=slack.bot_user_id, bot_id=slack.bot_id)
    await rig.send(OPS, "beep boop", user="UOTHERBOT", bot_id="BOTHER001")
    await rig.send(QUIET, "talking among ourselves")
    # Each was acked, i.e. the gate has decided on it: none reached the model.
    assert rig.llm.requests == []
    assert rig.all_posts() == []

    # A control message in the same daemon is answered, so the silence above means something.
    # It queues behind anything the gate let through; nothing was.
    control, _ = await rig.send(QUIET, f"<@{slack.bot_user_id}> are you there?")
    [answer] = await rig.wait_posts(QUIET, 1)
    assert (answer.text, answer.thread_ts) == ("control answer", control["ts"])

    assert await daemon.stop() == 0
    assert len(rig.llm.requests) == 1
    assert rig.llm.user_texts(0)[-1].endswith("are you there?")
    assert [p.text for p in rig.all_posts()] == ["control answer"]
    assert_clean_log(daemon, slack)


# -- 3. long answers --------------------------------------------------------------------------
async def test_long_answer_arrives_split_complete_and_in_order(rig: Rig) -> None:
    lines = [f"line {n:04d} of the report, plain words only" for n in range(240)]
    answer = "\n".join(lines)
    assert len(answer) >= 10_000
    rig.llm.script(Reply(answer))
    daemon = await rig.start()

    message, _ = await rig.send(OPS, "the full report please")
    await eventually(
        lambda: any(re.search(r"line 0239\b", p.text) for p in rig.posts(OPS)),
        "the last part of the answer",
        log=daemon,
    )
    assert await daemon.stop() == 0

    parts = rig.posts(OPS)
    assert len(parts) >= 3
    assert all(len(p.text) <= 4000 for p in parts), [len(p.text) for p in parts]
    assert all(p.thread_ts == message["ts"] for p in parts)
    joined = "\n".join(p.text for p in parts)
    assert "".join(joined.split()) == "".join(answer.split())
    assert [int(n) for n in re.findall(r"line (\d{4})", joined)] == list(range(240))
    assert len(rig.llm.requests) == 1
    assert_clean_log(daemon, rig.slack)


# -- 4. rate limit ----------------------------------------------------------------------------
async def test_rate_limited_post_is_sent_once_after_retry_after(rig: Rig) -> None:
    rig.llm.script(Reply("after the pause"))
    rig.slack.fail("chat.postMessage", status=429, error="ratelimited", retry_after=1)
    daemon = await rig.start()

    message, _ = await rig.send(OPS, "hello?")
    [reply] = await rig.wait_posts(OPS, 1)
    assert (reply.text, reply.thread_ts) == ("after the pause", message["ts"])

    assert await daemon.stop() == 0
    assert len(rig.posts(OPS)) == 1
    assert isinstance(rig.slack.calls, TimedCalls)
    limited, sent = rig.slack.calls.times_of("chat.postMessage")
    assert sent - limited >= 0.95  # Retry-After: 1
    assert_clean_log(daemon, rig.slack)


# -- 5. crash mid-turn ------------------------------------------------------------------------
async def test_kill_mid_turn_answers_once_after_restart_and_ignores_redelivery(rig: Rig) -> None:
    rig.llm.script(Delay(5.0, Reply("lost with the process")), Reply("answer after restart"))
    first = await rig.start()
    event, envelope = await rig.send(OPS, "survive this", event_id="Ev0CRASH01")
    assert rig.slack.acked(envelope)  # committed: Slack will not send it again by itself
    await rig.wait_requests(1)
    await first.kill()
    assert rig.posts(OPS) == []

    second = await rig.start()
    [reply] = await rig.wait_posts(OPS, 1)
    assert (reply.text, reply.thread_ts) == ("answer after restart", event["ts"])
    assert len(rig.llm.requests) == 2

    # Slack redelivers the same event (its ack was lost, say): acked, not answered again.
    again = await rig.slack.push_event(event, event_id="Ev0CRASH01", retry_attempt=1)
    await rig.slack.wait_for_ack(again, timeout=15)
    # A later message of the same session queues behind anything the redelivery started.
    rig.llm.script(Reply("next answer"))
    later, _ = await rig.send(OPS, "and now?")
    await rig.wait_posts(OPS, 2)

    assert await second.stop() == 0
    posts = rig.posts(OPS)
    assert [(p.text, p.thread_ts) for p in posts] == [
        ("answer after restart", event["ts"]),
        ("next answer", later["ts"]),
    ]
    assert len(rig.llm.requests) == 3
    assert rig.llm.user_texts(2)[-1].endswith("and now?")
    assert_clean_log(second, rig.slack)


# -- 6. one session: in order -----------------------------------------------------------------
async def test_one_session_answers_in_order_including_messages_sent_mid_turn(rig: Rig) -> None:
    rig.llm.script(Delay(1.5, Reply("answer A")), Reply("answer B"), Reply("answer C"))
    daemon = await rig.start()

    a, _ = await rig.send(OPS, "message A")
    await rig.wait_requests(1)
    b, _ = await rig.send(OPS, "message B")
    c, _ = await rig.send(OPS, "message C")
    assert rig.llm.answered == []  # B and C arrived while A's turn was still running

    posts = await rig.wait_posts(OPS, 3)
    assert [(p.text, p.thread_ts) for p in posts] == [
        ("answer A", a["ts"]),
        ("answer B", b["ts"]),
        ("answer C", c["ts"]),
    ]
    # One at a time: each turn began only after the previous one was answered ...
    assert rig.llm.started[1] >= rig.llm.answered[0]
    assert rig.llm.started[2] >= rig.llm.answered[1]
    # ... and each saw the ones before it (same session).
    assert rig.llm.user_texts(1)[-1].endswith("message B")
    assert rig.llm.user_texts(2)[-1].endswith("message C")
    assert any("message A" in t for t in rig.llm.user_texts(2))

    assert await daemon.stop() == 0
    assert len(rig.posts(OPS)) == 3
    assert len(rig.llm.requests) == 3
    assert_clean_log(daemon, rig.slack)


# -- 7. two sessions: concurrently ------------------------------------------------------------
async def test_two_sessions_run_concurrently(rig: Rig) -> None:
    rig.llm.default = Delay(1.0, Reply("concurrent answer"))
    daemon = await rig.start(max_sessions=2)

    one = await rig.slack.push_event(FakeSlack.message_event(OPS, ALICE, "one", ts=new_ts()))
    two = await rig.slack.push_event(FakeSlack.message_event(OPS2, BOB, "two", ts=new_ts()))
    await rig.slack.wait_for_ack(one, timeout=15)
    await rig.slack.wait_for_ack(two, timeout=15)
    await rig.wait_requests(2)
    # The second session's request reached the model while the first was still unanswered.
    assert rig.all_posts() == []
    assert rig.llm.answered == []

    await rig.wait_posts(OPS, 1)
    await rig.wait_posts(OPS2, 1)
    assert rig.llm.started[1] < rig.llm.answered[0]

    assert await daemon.stop() == 0
    assert [p.text for p in rig.posts(OPS)] == ["concurrent answer"]
    assert [p.text for p in rig.posts(OPS2)] == ["concurrent answer"]
    assert len(rig.llm.requests) == 2
    assert_clean_log(daemon, rig.slack)


# -- 8. SIGTERM -------------------------------------------------------------------------------
async def test_sigterm_exits_cleanly_within_grace_and_leaks_no_token(rig: Rig) -> None:
    grace = 8.0
    rig.llm.script(Reply("first answer"), Delay(1.0, Reply("answer of the drained turn")))
    daemon = await rig.start(grace_s=grace, log_level="debug")
    await rig.send(OPS, "warm up")
    await rig.wait_posts(OPS, 1)

    # A turn is running when SIGTERM arrives; it gets the grace period to finish.
    running, _ = await rig.send(OPS, "still working?")
    await rig.wait_requests(2)
    started = time.monotonic()
    code = await daemon.stop(timeout_s=grace + 20)
    elapsed = time.monotonic() - started
    assert code == 0, daemon.text()
    assert elapsed < grace, elapsed
    assert any("shutting down" in row.get("msg", "") for row in log_events(daemon))
    assert any(row.get("level") == "debug" for row in log_events(daemon))  # really verbose
    assert_clean_log(daemon, rig.slack)
    await rig.slack.wait_for_no_sockets()
    # The drained turn's reply went out before the connection closed.
    assert [p.text for p in rig.posts(OPS)] == ["first answer", "answer of the drained turn"]

    # A restart finds nothing left to answer or send: still exactly once, no new model call.
    after = await rig.start(grace_s=grace)
    posts = await rig.wait_posts(OPS, 2)
    assert await after.stop() == 0
    assert [p.text for p in rig.posts(OPS)] == ["first answer", "answer of the drained turn"]
    assert posts[1].thread_ts == running["ts"]
    assert len(rig.llm.requests) == 2
    assert_clean_log(after, rig.slack)


# -- slash commands ---------------------------------------------------------------------------
async def test_slash_commands_are_answered_in_the_channel_without_a_model_call(rig: Rig) -> None:
    daemon = await rig.start()
    slack = rig.slack
    status = await slack.push_command("/status", channel=OPS, user=ALICE)
    await slack.wait_for_ack(status, timeout=15)
    # A command is addressed to the bot: a binding that needs a mention answers it too.
    helped = await slack.push_command("/help", channel=QUIET, user=BOB)
    await slack.wait_for_ack(helped, timeout=15)
    # The gate still applies: MALLORY is not allowed in DEV.
    denied = await slack.push_command("/reset", channel=DEV, user=MALLORY)
    await slack.wait_for_ack(denied, timeout=15)

    [ops] = await rig.wait_posts(OPS, 1)
    assert ops.thread_ts is None
    assert "Session: ops" in ops.text
    [quiet] = await rig.wait_posts(QUIET, 1)
    assert "/status" in quiet.text
    assert await daemon.stop() == 0
    assert rig.posts(DEV) == []
    assert rig.llm.requests == []
    assert_clean_log(daemon, slack)
