"""Send faults on a live daemon: 5xx and 429 storms on the platform's send method.

A 429 says the message was not taken: the chat pauses for Retry-After and sends it then. A
Bot API error answer (ok=false, 5xx) says the method failed: it is retried with backoff.
Either way the reply arrives exactly once and the next message is answered normally."""

from __future__ import annotations

import itertools

from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.llm_server import Reply
from tests.support.slack_world import OPS, Rig, TimedCalls, assert_clean_log
from tests.support.telegram_world import TelegramWorld, shut_down

# How long the first pause after a 5xx lasts at least (outbox: 2 s less 20 % jitter).
FIRST_BACKOFF_S = 1.5


async def test_telegram_5xx_and_429_storms_send_each_reply_once(tg: TelegramWorld) -> None:
    tg.llm.script(Reply("through the 5xx storm"), Reply("worth the wait"), Reply("calm again"))
    tg.telegram.fail_next("sendMessage", 500, "Internal Server Error", times=2)
    daemon = await tg.start()
    try:
        tg.ask("hello?")
        await tg.replies(1)
        tg.telegram.fail_next("sendMessage", 429, "Too Many Requests: retry after 1", 1, times=3)
        tg.ask("again?")
        await tg.replies(2)
        tg.ask("still there?")
        await tg.replies(3)
        await tg.control()
    finally:
        await shut_down(daemon)
    assert tg.texts() == ["through the 5xx storm", "worth the wait", "calm again", CONTROL_ANSWER]
    attempts = tg.telegram.times("sendMessage")
    # Two 5xx, the reply; three 429s, the reply; the next reply; the control's.
    assert len(attempts) == 9
    assert attempts[1] - attempts[0] >= FIRST_BACKOFF_S  # backoff after a 5xx
    assert attempts[2] > attempts[1]
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts[3:7])]
    assert all(gap >= 0.95 for gap in gaps), gaps  # Retry-After: 1


async def test_slack_5xx_then_429s_send_the_reply_once(rig: Rig) -> None:
    rig.llm.script(Reply("through the storm"), Reply("calm again"))
    rig.slack.fail("chat.postMessage", status=503, error="service_unavailable")
    rig.slack.fail("chat.postMessage", status=429, error="ratelimited", retry_after=1, times=2)
    daemon = await rig.start()

    message, _ = await rig.send(OPS, "hello?")
    [reply] = await rig.wait_posts(OPS, 1)
    assert (reply.text, reply.thread_ts) == ("through the storm", message["ts"])
    later, _ = await rig.send(OPS, "still there?")
    await rig.wait_posts(OPS, 2)

    assert await daemon.stop() == 0
    assert [(p.text, p.thread_ts) for p in rig.posts(OPS)] == [
        ("through the storm", message["ts"]),
        ("calm again", later["ts"]),
    ]
    assert isinstance(rig.slack.calls, TimedCalls)
    attempts = rig.slack.calls.times_of("chat.postMessage")
    assert len(attempts) == 5  # a 5xx, two 429s, the reply, the next reply
    assert attempts[1] - attempts[0] >= FIRST_BACKOFF_S
    assert attempts[2] - attempts[1] >= 0.95  # Retry-After: 1
    assert attempts[3] - attempts[2] >= 0.95
    assert_clean_log(daemon, rig.slack)
