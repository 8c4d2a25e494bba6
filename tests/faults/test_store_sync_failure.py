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

from tests.support.fakes.llm_server import Reply
from tests.support.telegram_world import TelegramWorld, shut_down

FAILING_SYNC = Path(__file__).resolve().parent.parent / "support" / "failing_sync"


async def test_a_failed_sync_of_the_log_stops_the_daemon_and_the_restart_answers_once(
    tg: TelegramWorld,
) -> None:
    trigger = tg.tmp_path / "disk-fails"
    tg.env["PYTHONPATH"] = ":".join(filter(None, [str(FAILING_SYNC), tg.env.get("PYTHONPATH")]))
    tg.env["GEODEBOT_TEST_FAILING_SYNC"] = str(trigger)
    tg.llm.script(Reply("before the disk failed"), Reply("after the restart"))
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

    trigger.unlink()
    restarted = await tg.start()
    try:
        assert await tg.replies(2) == ["before the disk failed", "after the restart"]
        await tg.telegram.wait_for_confirmed(second + 1, timeout=10)
        await asyncio.sleep(0.5)  # nothing more arrives
        assert tg.texts() == ["before the disk failed", "after the restart"]
        assert len(tg.llm.requests) == 2
    finally:
        await shut_down(restarted)
