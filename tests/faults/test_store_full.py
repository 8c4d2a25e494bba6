"""A full disk under a live daemon: the store and the ledger cannot write for a while.

The fault is real, not injected into our code: the daemon's file size limit
(``RLIMIT_FSIZE``, set from outside with ``prlimit``) is lowered to one byte, so every write
to the database, its WAL and the ledger fails with EFBIG, as on a full disk, until it is
raised again. Python ignores SIGXFSZ, so the process lives on; its log goes to a pipe."""

from __future__ import annotations

import asyncio
import resource

from tests.support.control import CONTROL_ANSWER
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import Delay, Reply
from tests.support.telegram_world import TelegramWorld, shut_down


def disk_full(daemon: DaemonProcess, full: bool) -> None:
    assert daemon.proc is not None
    soft = 1 if full else resource.RLIM_INFINITY
    resource.prlimit(daemon.proc.pid, resource.RLIMIT_FSIZE, (soft, resource.RLIM_INFINITY))


async def test_full_disk_mid_turn_and_mid_send_loses_and_repeats_nothing(
    tg: TelegramWorld,
) -> None:
    tg.llm.script(
        Delay(1.0, Reply("an answer the disk has no room for")),
        Reply("answer to the message sent while the disk was full"),
        Reply("sent as the disk filled up"),
        Reply("business as usual"),
    )
    daemon = await tg.start()

    def fill_on_send(method: str) -> None:
        # Telegram took the message; the daemon cannot record that it did.
        if method == "sendmessage":
            tg.telegram.before_answer = None
            disk_full(daemon, True)

    try:
        # 1. The disk fills while the model thinks: the turn cannot save its answer.
        first = tg.ask("first question")
        await tg.telegram.wait_for_confirmed(first + 1, timeout=20)
        async with asyncio.timeout(20):
            await tg.llm.wait_for_requests(1)
        disk_full(daemon, True)
        # Arrives while the disk is full: it cannot be committed, so it is not confirmed.
        second = tg.ask("sent while the disk is full")
        # The turn finds no room for its answer. The new message's commit fails, and fails
        # again when Telegram hands it over once more: the poller asked for it again, so it
        # had not confirmed it.
        await daemon.wait_for_line("turn finished: store_error", timeout_s=20)
        refused = f"update {second} not committed"
        async with asyncio.timeout(20):
            while True:
                if sum(refused in line for line in daemon.log) >= 2:
                    break
                await asyncio.sleep(0.02)
        assert tg.telegram.confirmed_offset <= second
        assert len(tg.llm.requests) == 1
        assert tg.texts() == []
        disk_full(daemon, False)
        await tg.replies(2, limit_s=45)
        await tg.telegram.wait_for_confirmed(second + 1, timeout=10)

        # 2. The disk fills as a reply is taken by Telegram: it is neither lost nor resent.
        tg.telegram.before_answer = fill_on_send
        tg.ask("third question")
        await tg.replies(3)
        await asyncio.sleep(2.0)
        disk_full(daemon, False)

        tg.ask("and now?")
        await tg.replies(4)
        await tg.control()
    finally:
        if daemon.proc is not None and daemon.proc.returncode is None:
            disk_full(daemon, False)
        await shut_down(daemon)
    failed, answered, sent_once, normal, control = tg.texts()
    assert control == CONTROL_ANSWER
    assert "could not save this conversation" in failed
    assert answered == "answer to the message sent while the disk was full"
    assert sent_once == "sent as the disk filled up"
    assert normal == "business as usual"
    assert len(tg.llm.requests) == 4 + 1  # and the control's
    # The record of the sent part was tried again at growing pauses, not in a tight loop.
    retries = [line for line in daemon.log if "sent, but not recorded yet" in line]
    assert 1 <= len(retries) <= 10
