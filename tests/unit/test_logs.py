"""Log lines: JSON off a terminal, each carrying the ids of the turn it belongs to, redacted."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest

from geodebot.logs.context import current_context, log_context
from geodebot.logs.redact import Redactor
from geodebot.logs.setup import setup_logging

SECRET = "configured-secret-value-123"


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    stream = io.StringIO()
    setup_logging("info", Redactor([SECRET]), stream=stream)
    try:
        yield stream
    finally:
        root.handlers[:], root.level = saved


def lines(stream: io.StringIO) -> list[dict[str, str]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_turn_s_ids_ride_on_every_line_and_secrets_do_not(captured: io.StringIO) -> None:
    log = logging.getLogger("geodebot.test")
    log.info("before")
    with log_context(platform="slack", session="ops"), log_context(turn="t-1", inbox=None):
        log.warning("calling https://api.telegram.org/bot123456:%s/getMe with %s", "A" * 35, SECRET)
        log.info("token xoxb-1234567890-abcdefghij and key sk-abcdefghijklmnopqrst")
    log.info("after")
    first, inside, second, last = lines(captured)
    assert "session" not in first
    assert "session" not in last
    for row in (inside, second):
        assert (row["platform"], row["session"], row["turn"]) == ("slack", "ops", "t-1")
        assert "inbox" not in row
    text = captured.getvalue()
    for leaked in (SECRET, "A" * 35, "xoxb-1234567890", "sk-abcdefghijklmnopqrst"):
        assert leaked not in text
    assert "[REDACTED]" in inside["msg"]


async def test_concurrent_turns_keep_their_own_ids(captured: io.StringIO) -> None:
    log = logging.getLogger("geodebot.test")

    async def turn(session: str) -> None:
        with log_context(session=session):
            await asyncio.sleep(0.01)
            log.info("working on %s", session)

    await asyncio.gather(*(turn(f"s{i}") for i in range(5)))
    rows = lines(captured)
    assert sorted(row["session"] for row in rows) == [f"s{i}" for i in range(5)]
    assert all(row["msg"] == f"working on {row['session']}" for row in rows)
    assert current_context() == {}
