"""A disk that fails to sync the store's log under a live daemon.

After a failed fsync nobody can vouch for the pages the kernel held (it may have dropped
them), so the daemon must not go on acking and sending as if its writes were safe: it stops
at once and exits non-zero (systemd starts it again), and the restart answers what was left,
once. The fault is made in the daemon's process at the OS call (tests/support/failing_sync):
every sync of the SQLite log fails with EIO from the moment a file appears.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.support.fakes.llm_server import Delay, Item, Reply
from tests.support.telegram_world import TelegramWorld, shut_down

FAILING_SYNC = Path(__file__).resolve().parent.parent / "support" / "failing_sync"


async def test_a_failed_sync_of_the_log_stops_the_daemon_and_the_restart_answers_once(
    tg: TelegramWorld,
) -> None:
    trigger = tg.tmp_path / "disk-fails"
    tg.env["PYTHONPATH"] = ":".join(filter(None, [str(FAILING_SYNC), tg.env.get("PYTHONPATH")]))
    tg.env["GEODEBOT_TEST_FAILING_SYNC"] = str(trigger)

    def answer(body: dict[str, Any]) -> Item:
        if len(tg.llm.requests) == 1:
            return Reply("before the disk failed")
        if trigger.exists():
            # The failing daemon's turn, if it gets this far: still thinking when it stops.
            return Delay(2.0, Reply("an answer from the stopped daemon"))
        return Reply("the answer to the message in flight")

    tg.llm.responder = answer
    daemon = await tg.start()
    tg.ask("first")
    assert await tg.replies(1) == ["before the disk failed"]

    trigger.touch()
    second = tg.ask("sent as the disk fails")
    assert daemon.proc is not None
    async with asyncio.timeout(20):
        code = await daemon.proc.wait()
    text = daemon.text()
    assert code != 0, text[-3000:]
    assert "stopped serving: the store cannot make writes durable" in text, text[-3000:]
    assert "syncing the store's log to disk failed" in text
    # Its message was neither acked nor answered: Telegram still holds it.
    assert tg.telegram.confirmed_offset <= second
    assert tg.texts() == ["before the disk failed"]

    # Its turn was cut off (before its model call or while the model thought): the restart
    # runs it again, once.
    trigger.unlink()
    restarted = await tg.start()
    answered = ["before the disk failed", "the answer to the message in flight"]
    try:
        assert await tg.replies(2) == answered
        await tg.telegram.wait_for_confirmed(second + 1, timeout=10)
        await asyncio.sleep(0.5)  # nothing more arrives
        assert tg.texts() == answered
        # The first daemon's turn asked the model, or did not get that far.
        assert len(tg.llm.requests) in (2, 3)
    finally:
        await shut_down(restarted)
