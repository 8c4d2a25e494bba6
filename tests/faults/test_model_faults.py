"""Model faults on a live daemon: a hung provider past the client timeout and 529 overloaded.

Each is retried (``model.max_retries = 1``); a retry that works ends in the answer, one that
does not ends in a clear failure reply. Either way the next message is answered normally and
every accepted message gets exactly one reply."""

from __future__ import annotations

import asyncio

from tests.fakes.llm_server import Error, Hang, Reply
from tests.faults.telegram_world import TelegramWorld, shut_down

RETRYING = "max_retries = 1\nmax_retry_wait_s = 1\nrequest_timeout_s = 1\n"


async def test_hung_model_is_retried_then_reported_and_the_next_message_answered(
    tg: TelegramWorld,
) -> None:
    tg.llm.script(
        Hang(), Reply("answer after one timeout"),  # a retry that works
        Hang(), Hang(),  # two timeouts: the retries are used up
        Reply("back to normal"),
    )  # fmt: skip
    daemon = await tg.start(model=RETRYING)
    try:
        tg.ask("first")
        await tg.replies(1)
        tg.ask("second")
        await tg.replies(2)
        tg.ask("third")
        await tg.replies(3)
        await asyncio.sleep(0.5)
    finally:
        await shut_down(daemon)
    first, second, third = tg.texts()
    assert first == "answer after one timeout"
    assert "model provider is unavailable right now" in second
    assert "timed out" in second.lower()
    assert third == "back to normal"
    assert len(tg.llm.requests) == 5  # each timeout was retried once, nothing more
    assert tg.llm.pending == 0


async def test_overloaded_model_is_retried_then_reported_and_the_next_message_answered(
    tg: TelegramWorld,
) -> None:
    tg.llm.script(
        Error.overloaded(), Reply("answer after one 529"),
        Error.overloaded(), Error.overloaded(),
        Reply("back to normal"),
    )  # fmt: skip
    daemon = await tg.start(model=RETRYING)
    try:
        for n, text in enumerate(("first", "second", "third"), start=1):
            tg.ask(text)
            await tg.replies(n)
        await asyncio.sleep(0.5)
    finally:
        await shut_down(daemon)
    first, second, third = tg.texts()
    assert first == "answer after one 529"
    assert "model provider is unavailable right now" in second
    assert "overloaded" in second.lower()
    assert third == "back to normal"
    assert len(tg.llm.requests) == 5
