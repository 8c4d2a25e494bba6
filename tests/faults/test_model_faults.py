"""Model faults on a live daemon: a hung provider past the client timeout and 529 overloaded.

Each is retried (``model.max_retries = 1``); a retry that works ends in the answer, one that
does not ends in a clear failure reply. Either way the next message is answered normally and
every accepted message gets exactly one reply."""

from __future__ import annotations

from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.llm_server import Error, Hang, Reply
from tests.support.telegram_world import TelegramWorld, shut_down

RETRYING = "max_retries = 1\nmax_retry_wait_s = 1\nrequest_timeout_s = 1\n"


async def test_hung_then_overloaded_model_is_retried_reported_and_the_next_message_answered(
    tg: TelegramWorld,
) -> None:
    tg.llm.script(
        Hang(), Reply("answer after one timeout"),  # a retry that works
        Hang(), Hang(),  # two timeouts: the retries are used up
        Error.overloaded(), Reply("answer after one 529"),
        Error.overloaded(), Error.overloaded(),
        Reply("back to normal"),
    )  # fmt: skip
    daemon = await tg.start(model=RETRYING)
    try:
        for n in range(1, 6):
            tg.ask(f"question {n}")
            await tg.replies(n)
        await tg.control()
    finally:
        await shut_down(daemon)
    recovered, timed_out, recovered_529, overloaded, normal, control = tg.texts()
    assert control == CONTROL_ANSWER
    assert recovered == "answer after one timeout"
    assert "model provider is unavailable right now" in timed_out
    assert "timed out" in timed_out.lower()
    assert recovered_529 == "answer after one 529"
    assert "model provider is unavailable right now" in overloaded
    assert "overloaded" in overloaded.lower()
    assert normal == "back to normal"
    assert len(tg.llm.requests) == 9 + 1  # each failure was retried once; the control
    assert tg.llm.pending == 0
