"""Streamed replies: time to the first visible characters, and the edit rate per chat.

``geodebot serve`` runs as a subprocess against the in-process Telegram fake and the
Anthropic fake, which streams its answer (SSE) after a fixed first-token delay.

Figures (same run, same machine):

* first visible: one chat, ``--seq`` messages one after the other; from pushing a message to
  the first message of its answer in the chat (the streamed preview), p50 / p99, minus the
  model's first-token delay. The same answer without streaming (a binding with
  ``stream = false``) shows only when it is complete: its figure is the baseline.
  Target: the preview within 1 s of the model's first token.
* edit rate under load: ``--chats`` chats at once, each streaming a long answer; for each chat
  the requests that show it (the preview's send and edits, and the final edit), the most of
  them in any ``stream_edit_interval_s`` window, and the preview's edits per second. Target:
  at most one preview request per chat per interval (the final answer's edit may share an
  interval with the last preview: two at most in any window), and nothing lost: every chat's
  last text is the whole answer, in one message.

Run from the repo root: ``.venv/bin/python bench/stream_bench.py [--quick]``. Exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram

KEY_ENV = "BENCH_ANTHROPIC_KEY"
KEY = "sk-bench-0123456789abcdef"
TOKEN_ENV = "BENCH_TELEGRAM_TOKEN"
USER = 4242
STREAM_CHAT = -300_000
PLAIN_CHAT = -300_001
LOAD_CHAT_BASE = -300_100
FIRST_TOKEN_S = 0.5
INTERVAL_S = 1.0
TURN_TIMEOUT_S = 60.0

# Targets.
FIRST_VISIBLE_MAX_S = 1.0
MAX_PER_WINDOW = 2


class TimedTelegram(FakeTelegram):
    """The Telegram fake, noting when each message was sent or edited, per chat."""

    def __init__(self) -> None:
        super().__init__()
        self.shows: defaultdict[int, list[float]] = defaultdict(list)
        self.sends: defaultdict[int, list[float]] = defaultdict(list)

    async def _m_sendmessage(self, params: dict[str, Any]) -> Any:
        result = await super()._m_sendmessage(params)
        now = time.perf_counter()
        self.shows[int(params["chat_id"])].append(now)
        self.sends[int(params["chat_id"])].append(now)
        return result

    async def _m_editmessagetext(self, params: dict[str, Any]) -> Any:
        result = await super()._m_editmessagetext(params)
        self.shows[int(params["chat_id"])].append(time.perf_counter())
        return result


def answer(words: int) -> str:
    return " ".join(f"word{i}" for i in range(words)) + "."


def config(path: Path, telegram: FakeTelegram, llm: FakeLLMServer, chats: list[int]) -> Path:
    lines = [
        "[daemon]",
        f'state_dir = "{path.parent / "var"}"',
        "max_concurrent_sessions = 64",
        "user_rate_per_min = 0",
        f"stream_edit_interval_s = {INTERVAL_S}",
        "[model]",
        'provider = "anthropic"',
        'name = "bench-model"',
        f'base_url = "{llm.url}"',
        f'api_key_env = "{KEY_ENV}"',
        "max_retries = 0",
        "[channels.telegram]",
        f'token_env = "{TOKEN_ENV}"',
        f'api_base_url = "{telegram.api_base_url}"',
        "poll_timeout_s = 1",
    ]
    for chat in chats:
        lines += [
            "[[bindings]]",
            'platform = "telegram"',
            f'channel = "{chat}"',
            f'session = "s{abs(chat)}"',
            f'allowed_users = ["{USER}"]',
            f"stream = {'false' if chat == PLAIN_CHAT else 'true'}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def first_visible(
    telegram: TimedTelegram, llm: FakeLLMServer, chat: int, n: int, text: str, *, streamed: bool
) -> list[float]:
    """Seconds from each push to its answer's first message in the chat, minus the model's
    first-token delay; each turn waits until its answer is complete."""
    samples = []
    for _ in range(n):
        # The same generation time either way: a streamed answer's deltas come 50 ms apart,
        # an answer that is not streamed comes whole when the last of them would have.
        chunks, gap = 40, 0.05
        wait = FIRST_TOKEN_S if streamed else FIRST_TOKEN_S + chunks * gap
        llm.script(Delay(wait, Reply(text, chunks=chunks, chunk_delay_s=gap)))
        want = len(telegram.sent[chat]) + 1
        start = time.perf_counter()
        telegram.push_message(chat, "go", user_id=USER)
        await telegram.wait_for_sent(chat, want, timeout=TURN_TIMEOUT_S)
        samples.append(telegram.sends[chat][want - 1] - start - FIRST_TOKEN_S)
        message = telegram.sent[chat][-1]

        def complete(message: Any = message) -> bool:
            return telegram.shown(chat, message.message_id).text.rstrip() == text

        await telegram._wait(complete, TURN_TIMEOUT_S)
    return samples


def most_in_window(times: list[float], window: float) -> int:
    best = 0
    for i, t in enumerate(times):
        best = max(best, bisect.bisect_right(times, t + window - 1e-6) - i)
    return best


async def edit_rate(
    telegram: TimedTelegram, llm: FakeLLMServer, chats: list[int], text: str, chunks: int
) -> tuple[int, float, int]:
    """(most requests in any interval over all chats, mean preview edits per second per
    chat, chats whose answer arrived whole as one message)."""
    llm.default = Delay(0.2, Reply(text, chunks=chunks, chunk_delay_s=0.03))
    before = {chat: len(telegram.shows[chat]) for chat in chats}
    sent_before = {chat: len(telegram.sent[chat]) for chat in chats}
    for chat in chats:
        telegram.push_message(chat, "go", user_id=USER)

    def done() -> bool:
        return all(
            len(telegram.sent[c]) > sent_before[c]
            and telegram.shown(c, telegram.sent[c][-1].message_id).text.rstrip() == text
            for c in chats
        )

    await telegram._wait(done, TURN_TIMEOUT_S * 2)
    llm.default = None
    worst, rates, whole = 0, [], 0
    for chat in chats:
        times = telegram.shows[chat][before[chat] :]
        worst = max(worst, most_in_window(times, INTERVAL_S))
        if len(times) > 1:
            rates.append((len(times) - 1) / max(times[-1] - times[0], 1e-9))
        whole += len(telegram.sent[chat]) - sent_before[chat] == 1
    return worst, statistics.fmean(rates) if rates else 0.0, whole


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns, fewer chats")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--chats", type=int, default=None)
    args = parser.parse_args()
    seq = args.seq or (5 if args.quick else 20)
    n_chats = args.chats or (10 if args.quick else 30)
    load_chats = [LOAD_CHAT_BASE - i for i in range(n_chats)]
    short, long_ = answer(60), answer(400)
    print(f"machine: {os.cpu_count()} cores; first token after {FIRST_TOKEN_S:g} s")
    with tempfile.TemporaryDirectory() as tmp:
        async with TimedTelegram() as telegram, FakeLLMServer(record=False) as llm:
            path = config(
                Path(tmp) / "geodebot.toml", telegram, llm, [STREAM_CHAT, PLAIN_CHAT, *load_chats]
            )
            env = dict(os.environ, **{TOKEN_ENV: telegram.token, KEY_ENV: KEY})
            daemon = await DaemonProcess(path, env).start()
            try:
                await first_visible(telegram, llm, STREAM_CHAT, 1, short, streamed=True)  # warm-up
                streamed = await first_visible(
                    telegram, llm, STREAM_CHAT, seq, short, streamed=True
                )
                plain = await first_visible(telegram, llm, PLAIN_CHAT, seq, short, streamed=False)
                worst, rate, whole = await edit_rate(telegram, llm, load_chats, long_, 120)
            finally:
                await daemon.stop()
    p50, p99 = percentile(streamed, 0.5), percentile(streamed, 0.99)
    base50 = percentile(plain, 0.5)
    print(
        f"first visible after the first token: p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
        f" (not streamed, the same answer shows {base50 * 1000:.0f} ms after it)"
    )
    print(
        f"edit rate, {n_chats} chats at once, interval {INTERVAL_S:g} s: at most {worst} "
        f"request(s) per chat in any interval, {rate:.2f} edits/s per chat on average; "
        f"{whole}/{n_chats} answers whole in one message"
    )
    ok = p99 <= FIRST_VISIBLE_MAX_S and worst <= MAX_PER_WINDOW and whole == n_chats
    print("overall:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
