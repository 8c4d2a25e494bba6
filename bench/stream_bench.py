"""Streamed replies on Telegram, Slack and Discord: time to the first visible characters, and
the edit rate per chat against each platform's limit.

For each platform in turn, ``geodebot serve`` runs as a subprocess against that platform's
in-process fake (``bench/stream_platforms.py``: the tests' fakes, timing each request that
posts or edits a bot message) and the Anthropic fake, which streams its answer (SSE) after a
fixed first-token delay. The platforms are measured one after the other, each with a daemon of
its own, so none of them shares the machine with another's load.

Figures per platform (same run, same machine):

* first visible: one chat, ``--seq`` messages one after the other; from pushing a message to
  the first message of its answer in the chat (the streamed preview), p50 / p99, minus the
  model's first-token delay. The same answer without streaming (a binding with
  ``stream = false``) shows only when it is complete: its figure is the baseline.
  Target: the preview within 1 s of the model's first token.
* edit rate under load: ``--chats`` chats at once, each streaming an answer for
  ``LOAD_STREAM_S`` (longer than any platform's limit window) that fills the platform's
  preview; per chat, the requests that show it (the preview's post, its edits, the final
  answer's edit). Two figures against the platform's limit (``RateLimit``, counting the
  requests that limit counts): the most in any window of the limit's length, the final
  answer's request included, and the preview requests per second while the preview is
  streamed (from its first request to its last), the mean over the chats and the highest.
  Targets: the previews within the limit's rate; in any window at most the limit's count,
  plus the final answer's request where the limit is a rate that tolerates a short burst
  (Telegram, Slack) but not where it is a hard bucket (Discord: 5 edits per 5 s, the final
  one too). And nothing lost: every chat's answer arrives whole, in one message.

Run from the repo root:
``.venv/bin/python bench/stream_bench.py [--quick] [--platform telegram|slack|discord|all]``.
Exits 1 on FAIL.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from stream_platforms import PLATFORMS, ChatPlatform, RateLimit, preview_chars
from telegram_bench import KEY, KEY_ENV, step, stop_daemon

from tests.support.daemon import CONNECTED_MARK, MODELS_MARK, DaemonProcess
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply

FIRST_TOKEN_S = 0.5
INTERVAL_S = 1.0  # [daemon] stream_edit_interval_s
TURN_TIMEOUT_S = 60.0
POLL_S = 0.01
SETTLE_S = 1.0
# The load: every chat's answer starts after LOAD_FIRST_TOKEN_S and streams for LOAD_STREAM_S
# in LOAD_CHUNKS deltas.
LOAD_FIRST_TOKEN_S = 0.2
LOAD_STREAM_S = 8.0
LOAD_CHUNKS = 200
# The chats of each platform: the streamed one, the one that is not, then the load's.
STREAMED, PLAIN, LOAD = 0, 1, 2

# Targets.
FIRST_VISIBLE_MAX_S = 1.0


class Stalled(Exception):
    """A turn's answer did not arrive in time: the figures cannot be taken."""


@dataclass(frozen=True)
class Row:
    platform: str
    figure: str
    value: str
    target: str
    ok: bool | None  # None: information, no target


@dataclass(frozen=True)
class Sizes:
    seq: int
    chats: int


def answer(words: int) -> str:
    return " ".join(f"word{i}" for i in range(words)) + "."


def longest_answer(chars: int) -> str:
    """The answer of the most words within ``chars`` characters."""
    words = 1
    while len(answer(words + 1)) <= chars:
        words += 1
    return answer(words)


def config(path: Path, platform: ChatPlatform, llm: FakeLLMServer, chats: int) -> Path:
    lines = [
        "[daemon]",
        f'state_dir = "{path.parent / (platform.name + "-var")}"',
        "max_concurrent_sessions = 64",
        # One sender drives the whole load: flood control would measure itself, not the path.
        "user_rate_per_min = 0",
        f"stream_edit_interval_s = {INTERVAL_S}",
        "[model]",
        'provider = "anthropic"',
        'name = "bench-model"',
        f'base_url = "{llm.url}"',
        f'api_key_env = "{KEY_ENV}"',
        "max_retries = 0",
        *platform.config(),
    ]
    for index in range(chats):
        lines += [
            "[[bindings]]",
            f'platform = "{platform.name}"',
            f'channel = "{platform.chat(index)}"',
            f'session = "s{index}"',
            f'allowed_users = ["{platform.user}"]',
            f"stream = {'false' if index == PLAIN else 'true'}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def until(check: Callable[[], bool], within: float) -> bool:
    """Poll ``check`` (not every fake offers a waiter for what it stores) until it holds;
    False if it did not within ``within`` seconds. The figures come from the times the fakes
    noted, so the poll's own delay is in none of them."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True


def arrived(platform: ChatPlatform, chat: str, before: int, text: str) -> bool:
    """Whether the bot's messages in ``chat`` after the first ``before`` read ``text``."""
    parts = [part.strip() for part in platform.texts(chat)[before:]]
    return bool(parts) and " ".join(parts) == text


async def first_visible(
    platform: ChatPlatform, llm: FakeLLMServer, chat: str, n: int, text: str, *, streamed: bool
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
        requests = platform.requests.by_chat[chat]
        seen, shown = len(requests), len(platform.texts(chat))
        start = time.monotonic()
        await platform.push(chat, "go")

        def whole(shown: int = shown) -> bool:
            return arrived(platform, chat, shown, text)

        if not await until(whole, TURN_TIMEOUT_S):
            raise Stalled(f"no whole answer in chat {chat} within {TURN_TIMEOUT_S:g} s")
        first = next(r for r in requests[seen:] if not r.edit)
        samples.append(first.at - start - FIRST_TOKEN_S)
    return samples


def most_in_window(times: list[float], window: float) -> int:
    best = 0
    for i, t in enumerate(times):
        best = max(best, bisect.bisect_right(times, t + window - 1e-6) - i)
    return best


@dataclass(frozen=True)
class Load:
    most: int  # counted requests in any window of the limit's length, the final one's too
    most_previews: int  # the same without the final answer's request
    mean_rate: float  # counted preview requests per second while previewing, over the chats
    top_rate: float  # ... in the chat where it was highest
    whole: int  # chats whose answer arrived whole, in one message


async def edit_rate(
    platform: ChatPlatform, llm: FakeLLMServer, chats: list[str], text: str
) -> Load:
    """Every chat streams ``text`` at once; the requests each chat got, against the limit."""
    gap = LOAD_STREAM_S / LOAD_CHUNKS
    llm.default = Delay(LOAD_FIRST_TOKEN_S, Reply(text, chunks=LOAD_CHUNKS, chunk_delay_s=gap))
    seen = {chat: len(platform.requests.by_chat[chat]) for chat in chats}
    shown = {chat: len(platform.texts(chat)) for chat in chats}
    for chat in chats:
        await platform.push(chat, "go")

    def done(chat: str) -> bool:
        return arrived(platform, chat, shown[chat], text)

    # A chat that stalls counts as not whole; its figures still say what it got.
    await until(lambda: all(done(chat) for chat in chats), TURN_TIMEOUT_S * 2)
    # A preview may read the whole answer before the final answer's edit comes: wait for it.
    await asyncio.sleep(SETTLE_S)
    llm.default = None
    limit = platform.limit
    most = most_previews = whole = 0
    rates = []
    for chat in chats:
        requests = platform.requests.by_chat[chat][seen[chat] :]
        # The final answer's request is the turn's last: a preview under way is waited for.
        counted = [r.at for r in requests if limit.counts(r)]
        previews = [r.at for r in requests[:-1] if limit.counts(r)]
        most = max(most, most_in_window(counted, limit.window_s))
        most_previews = max(most_previews, most_in_window(previews, limit.window_s))
        if len(previews) > 1:
            rates.append((len(previews) - 1) / max(previews[-1] - previews[0], 1e-9))
        whole += done(chat) and len(platform.texts(chat)) - shown[chat] == 1
    return Load(
        most,
        most_previews,
        statistics.fmean(rates) if rates else 0.0,
        max(rates, default=0.0),
        whole,
    )


async def measure(platform: ChatPlatform, llm: FakeLLMServer, sizes: Sizes) -> list[Row]:
    """The figures of one platform, its daemon running."""
    name, limit = platform.name, platform.limit
    chat = platform.chat
    short, long_ = answer(60), longest_answer(preview_chars(name))
    streamed: list[float] = []
    plain: list[float] = []

    async def sequential() -> None:
        await first_visible(platform, llm, chat(STREAMED), 1, short, streamed=True)  # warm-up
        streamed.extend(
            await first_visible(platform, llm, chat(STREAMED), sizes.seq, short, streamed=True)
        )
        plain.extend(
            await first_visible(platform, llm, chat(PLAIN), sizes.seq, short, streamed=False)
        )

    await step(f"{name}: first visible, {sizes.seq} turns streamed and {sizes.seq} not", sequential)
    loads: list[Load] = []

    async def load() -> None:
        chats = [chat(LOAD + i) for i in range(sizes.chats)]
        loads.append(await edit_rate(platform, llm, chats, long_))

    await step(
        f"{name}: {sizes.chats} {limit.per}s at once, answers of {len(long_)} characters "
        f"over {LOAD_STREAM_S:g} s",
        load,
    )
    [figures] = loads
    p50, p99 = percentile(streamed, 0.5), percentile(streamed, 0.99)
    allowed = limit.requests + limit.final_extra
    extra = f" ({limit.requests} + the final)" if limit.final_extra else " (the final counts)"
    return [
        Row(
            name,
            "first visible after the first token, p50 / p99",
            f"{p50 * 1000:.0f} / {p99 * 1000:.0f} ms",
            f"p99 <= {FIRST_VISIBLE_MAX_S * 1000:.0f} ms",
            p99 <= FIRST_VISIBLE_MAX_S,
        ),
        Row(
            name,
            "  not streamed: the same answer shows after, p50",
            f"{percentile(plain, 0.5) * 1000:.0f} ms",
            "(baseline)",
            None,
        ),
        Row(
            name,
            f"most {limit.counted} per {limit.per} in any {limit.window_s:g} s",
            f"{figures.most} (previews {figures.most_previews})",
            f"<= {allowed}{extra}",
            figures.most <= allowed,
        ),
        Row(
            name,
            f"preview {limit.counted} per {limit.per} per s, mean (highest)",
            f"{figures.mean_rate:.2f} ({figures.top_rate:.2f})",
            f"<= {limit.per_s:g}/s",
            # To the precision printed: the arrival times carry the machine's jitter.
            round(figures.top_rate, 2) <= limit.per_s,
        ),
        Row(
            name,
            "answers whole in one message",
            f"{figures.whole}/{sizes.chats}",
            "all",
            figures.whole == sizes.chats,
        ),
    ]


async def run_platform(
    name: str, llm: FakeLLMServer, sizes: Sizes, tmp: Path
) -> tuple[list[Row], RateLimit]:
    """One platform's fake and daemon, started, measured and stopped."""
    platform = PLATFORMS[name](LOAD + sizes.chats)
    async with platform:
        path = config(tmp / f"{name}.toml", platform, llm, LOAD + sizes.chats)
        env = dict(os.environ, **{KEY_ENV: KEY}, **platform.env())
        daemon = DaemonProcess(path, env)
        try:
            await daemon.start(timeout_s=60)
            await daemon.wait_for_line(CONNECTED_MARK, 60)
            await daemon.wait_for_line(MODELS_MARK, 120)
            rows = await measure(platform, llm, sizes)
        except (Stalled, RuntimeError, TimeoutError) as exc:
            print(f"\n  {name}: {str(exc) or type(exc).__name__}; the daemon's last lines:")
            print("\n".join(f"    {line}" for line in daemon.log[-10:]))
            rows = [Row(name, "the measurement", "did not finish", "finishes", False)]
        finally:
            await stop_daemon(daemon)
    problems = [line for line in daemon.log if "Traceback" in line or " ERROR " in line]
    if problems:
        print(f"  {name}: geodebot logged {len(problems)} error line(s); first: {problems[0]}")
    return rows, platform.limit


def report(rows: list[Row], limits: dict[str, RateLimit]) -> bool:
    header = ("platform", "figure", "value", "target", "result")
    cells = [(r.platform, r.figure, r.value, r.target, verdict(r.ok)) for r in rows]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    print()
    for i, row in enumerate([header, *cells]):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("\nlimits:")
    for name, limit in limits.items():
        print(f"  {name}: {limit.stated}; counted here: {limit.counted}")
    return all(r.ok is not False for r in rows)


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "FAIL")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns, fewer chats")
    parser.add_argument("--seq", type=int, default=None, help="sequential turns per platform")
    parser.add_argument("--chats", type=int, default=None, help="chats at once, per platform")
    parser.add_argument(
        "--platform", choices=[*PLATFORMS, "all"], default="all", help="default: all"
    )
    args = parser.parse_args()
    sizes = Sizes(
        seq=args.seq or (5 if args.quick else 20), chats=args.chats or (10 if args.quick else 30)
    )
    names = list(PLATFORMS) if args.platform == "all" else [args.platform]
    print(
        f"machine: {os.cpu_count()} cores; first token after {FIRST_TOKEN_S:g} s; "
        f"stream_edit_interval_s = {INTERVAL_S:g}; platforms: {', '.join(names)}"
    )
    started = time.perf_counter()
    rows: list[Row] = []
    limits: dict[str, RateLimit] = {}
    with tempfile.TemporaryDirectory(prefix="geodebot-stream-") as tmp:
        async with FakeLLMServer(record=False) as llm:
            for name in names:
                found, limits[name] = await run_platform(name, llm, sizes, Path(tmp))
                rows += found
    ok = report(rows, limits)
    print(f"\ntotal {time.perf_counter() - started:.0f} s; overall: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
