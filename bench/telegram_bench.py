"""Telegram turn latency, throughput and memory: ``geodebot serve`` vs a bare PTB bot.

Both systems run as subprocesses against the same in-process fakes (``tests.support.fakes``): the
Telegram Bot API fake and the Anthropic fake answering every request at once (or after a fixed
delay for the concurrency figure). The reference (``bench/reference_bot.py``) is
python-telegram-bot polling plus one ``AsyncAnthropic.messages.create`` per message: no
persistence, no gate. Both use a 1 s long poll and 8 turns at once at most.

Figures (same run, same machine). The two systems that are compared run side by side, each
against its own Telegram fake, and are driven one at a time, in turns (who goes first swaps
every round), so a change in the machine's speed, which drifts within a run and between runs,
meets both alike. Measured one system after the other, the same code's latency ratio read
anywhere from 1.1x to 2.1x.

* sequential latency, one chat: push a message, wait until the reply is in ``FakeTelegram.sent``;
  p50 / p99 over ``--seq`` turns after ``--warmup`` turns, the two systems' turns alternating,
  with a pause of ``SEQ_PAUSE_S`` after each reply so neither system's work after a reply
  (recording it, the next poll) falls into the other's turn;
* throughput: 50 chats in a closed loop (next message when the previous reply arrived); replies
  that arrive inside a window after ``--ramp`` s of ramp-up, per second, averaged over
  ``THROUGHPUT_SLOTS`` windows per system that share ``--window`` s, the systems taking turns;
* VmRSS idle after start and after the throughput run; for geodebot also idle RSS with all
  three channels enabled (the Slack and Discord fakes too), against the SDK floor measured in
  the same run (``bench/sdk_floor.py``: a process that imports the same SDK modules and
  nothing else; the target is on the difference, what geodebot's own code and state cost) and
  the time from starting the process to the daemon's READY (every channel connected), with
  10,000 extra bindings (a fresh daemon) vs 3 bindings, and RSS growth over 500 turns in 50
  sessions;
* concurrency: the model answers after 1 s, 50 chats, cap 8: achieved rate / (8 per second);
* CPU per message: each process's user + system CPU time (all threads, from /proc) over its
  throughput windows divided by the replies it sent.

Run from the repo root: ``.venv/bin/python bench/telegram_bench.py [--quick]``. Exits 1 on FAIL.
MB here is 10^6 bytes (VmRSS is reported in KiB).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.daemon import CONNECTED_MARK, MODELS_MARK, DaemonProcess
from tests.support.fakes.discord_server import FakeDiscord
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram

KEY_ENV = "BENCH_ANTHROPIC_KEY"
KEY = "sk-bench-0123456789abcdef"
TOKEN_ENV = "BENCH_TELEGRAM_TOKEN"
SLACK_BOT_ENV = "BENCH_SLACK_BOT"
SLACK_APP_ENV = "BENCH_SLACK_APP"
DISCORD_TOKEN_ENV = "BENCH_DISCORD"
USER = 4242
LATENCY_CHAT = -100_000
LOOP_CHAT_BASE = -100_100  # the closed-loop chats are LOOP_CHAT_BASE - i
EXTRA_CHAT_BASE = -2_000_000  # bindings that only cost memory
CAP = 8  # geodebot max_concurrent_sessions; PTB concurrent_updates of the reference
MODEL_DELAY_S = 1.0
ANSWER = "ok, done"
TURN_TIMEOUT_S = 30.0
SEQ_PAUSE_S = 0.005
THROUGHPUT_SLOTS = 4

# Lines every geodebot binding gets (``--no-stream``: its answers are not streamed).
BINDING_EXTRA: list[str] = []

# Targets.
LATENCY_RATIO_MAX = 1.3
# The tail: sequential p99 against the reference's p99 in the same run.
TAIL_RATIO_MAX = 2.0
THROUGHPUT_RATIO_MIN = 0.8
# geodebot's own share of its idle RSS with all three channels: over the SDK floor
# (bench/sdk_floor.py, the same SDK modules imported and nothing else), measured in the same run.
RSS_OVER_SDKS_MAX_MB = 5.0
SESSIONS_DELTA_MAX_MB = 20.0
TURNS_GROWTH_MAX_MB = 10.0
CONCURRENCY_MIN = 0.9
READY_MAX_S = 2.0


@dataclass
class Sizes:
    warmup: int
    seq: int
    chats: int
    ramp_s: float
    window_s: float
    growth_per_chat: int
    extra_bindings: int
    conc_ramp_s: float
    conc_window_s: float
    concurrency: bool


@dataclass
class Figures:
    name: str
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    mps: float = float("nan")
    rss_idle_mb: float = float("nan")
    rss_after_mb: float = float("nan")
    conc_mps: float = float("nan")
    cpu_ms: float = float("nan")  # process CPU time per reply during the throughput run
    extra: dict[str, float] = field(default_factory=dict)


# -- processes ------------------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle_rss(pid: int, settle_s: float = 1.5) -> float:
    """RSS after the process had ``settle_s`` to finish its start-up work."""
    await asyncio.sleep(settle_s)
    return rss_mb(pid)


class ReferenceBot:
    """``bench/reference_bot.py`` as a subprocess; ready once its first getUpdates arrived."""

    def __init__(self, telegram: FakeTelegram, llm_url: str) -> None:
        self.argv = [
            sys.executable,
            str(ROOT / "bench" / "reference_bot.py"),
            "--api-base-url",
            telegram.api_base_url,
            "--token",
            telegram.token,
            "--llm-url",
            llm_url,
            "--concurrent-updates",
            str(CAP),
        ]
        self.telegram = telegram
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr = b""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, timeout_s: float = 30.0) -> ReferenceBot:
        env = dict(os.environ, REFERENCE_API_KEY=KEY)
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=ROOT,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        await self.telegram.wait_for_request("getUpdates", 1, timeout=timeout_s)
        return self

    async def stop(self, timeout_s: float = 15.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                _, self.stderr = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def stop_daemon(daemon: DaemonProcess) -> None:
    if daemon.proc is None or daemon.proc.returncode is not None:
        return
    try:
        await daemon.stop()
    except TimeoutError:
        await daemon.kill()


def geodebot_config(
    path: Path, telegram: FakeTelegram, llm: FakeLLMServer, chats: Sequence[int], extra: int = 0
) -> Path:
    lines = [
        "[daemon]",
        f'state_dir = "{path.parent / (path.stem + "-var")}"',
        f"max_concurrent_sessions = {CAP}",
        # One sender drives the whole load: flood control would measure itself, not the path.
        "user_rate_per_min = 0",
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
    bound = [*chats, *(EXTRA_CHAT_BASE - i for i in range(extra))]
    for chat in bound:
        lines += [
            "[[bindings]]",
            'platform = "telegram"',
            f'channel = "{chat}"',
            f'session = "s{abs(chat)}"',
            f'allowed_users = ["{USER}"]',
            "tools = []",
            *BINDING_EXTRA,
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def geodebot_env(telegram: FakeTelegram) -> dict[str, str]:
    return dict(os.environ, **{TOKEN_ENV: telegram.token, KEY_ENV: KEY})


# -- load -----------------------------------------------------------------------------------
async def one_turn(telegram: FakeTelegram, chat: int, text: str) -> float:
    """Push one message and wait for its reply; seconds from push to reply observed."""
    want = len(telegram.sent[chat]) + 1
    start = time.perf_counter()
    telegram.push_message(chat, text, user_id=USER)
    await telegram.wait_for_sent(chat, want, timeout=TURN_TIMEOUT_S)
    return time.perf_counter() - start


async def alternating(
    systems: Sequence[FakeTelegram], warmup: int, n: int
) -> list[tuple[float, float]]:
    """Sequential latency of several systems in one stretch of time: their turns alternate,
    the order reversed every round; (p50, p99) in ms for each."""
    samples: list[list[float]] = [[] for _ in systems]
    for i in range(warmup + n):
        order = list(enumerate(systems))
        for index, telegram in order if i % 2 == 0 else order[::-1]:
            took = await one_turn(telegram, LATENCY_CHAT, f"question {i}")
            if i >= warmup:
                samples[index].append(took)
            await asyncio.sleep(SEQ_PAUSE_S)
    return [percentiles(s) for s in samples]


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    p50 = statistics.median(samples)
    p99 = samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))]
    return p50 * 1000, p99 * 1000


async def closed_loop(
    telegram: FakeTelegram, chats: Sequence[int], ramp_s: float, window_s: float
) -> float:
    """Replies per second inside [ramp, ramp + window]; every chat drains before returning."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    lo, hi = t0 + ramp_s, t0 + ramp_s + window_s
    done: list[float] = []

    async def chat_loop(chat: int) -> None:
        i = 0
        while loop.time() < hi:
            await one_turn(telegram, chat, f"load {i}")
            done.append(loop.time())
            i += 1

    await asyncio.gather(*(chat_loop(c) for c in chats))
    return sum(1 for t in done if lo <= t <= hi) / window_s


async def fixed_turns(telegram: FakeTelegram, chats: Sequence[int], per_chat: int) -> None:
    async def chat_loop(chat: int) -> None:
        for i in range(per_chat):
            await one_turn(telegram, chat, f"turn {i}")

    await asyncio.gather(*(chat_loop(c) for c in chats))


async def step(label: str, action: Callable[[], Awaitable[object]]) -> None:
    start = time.perf_counter()
    print(f"  .. {label}", end="", flush=True)
    await action()
    print(f" ({time.perf_counter() - start:.1f} s)", flush=True)


# -- systems --------------------------------------------------------------------------------
@dataclass
class System:
    """One of the two systems measured side by side."""

    telegram: FakeTelegram
    pid: int
    fig: Figures


async def measure_pair(
    geo: System, ref: System, llm: FakeLLMServer, sizes: Sizes, chats: list[int]
) -> None:
    """The figures that compare the two systems, both running all along: one is driven at a
    time, in turns, so a change in the machine's speed meets both alike (measured one system
    after the other, the same code read anywhere from 1.1x to 2.1x on latency)."""
    await asyncio.sleep(1.5)  # start-up work done
    for system in (geo, ref):
        system.fig.rss_idle_mb = rss_mb(system.pid)

    async def latency() -> None:
        pairs = await alternating([geo.telegram, ref.telegram], sizes.warmup, sizes.seq)
        for system, (p50, p99) in zip((geo, ref), pairs, strict=True):
            system.fig.p50_ms, system.fig.p99_ms = p50, p99

    await step("sequential latency, turns alternating", latency)
    before = rss_mb(geo.pid)
    turns = sizes.growth_per_chat * len(chats)

    async def growth() -> None:
        await fixed_turns(geo.telegram, chats, sizes.growth_per_chat)
        await asyncio.sleep(1.0)

    await step(f"geodebot: {turns} turns in {len(chats)} sessions", growth)
    geo.fig.extra.update(rss_before_turns=before, rss_after_turns=rss_mb(geo.pid), turns=turns)
    await step(
        f"throughput, {THROUGHPUT_SLOTS} windows each, alternating",
        lambda: alternating_throughput((geo, ref), chats, sizes),
    )
    await asyncio.sleep(1.0)
    for system in (geo, ref):
        system.fig.rss_after_mb = rss_mb(system.pid)
    if not sizes.concurrency:
        return
    llm.default = Delay(MODEL_DELAY_S, Reply(ANSWER))
    try:
        for system in (geo, ref):

            async def concurrency(system: System = system) -> None:
                system.fig.conc_mps = await closed_loop(
                    system.telegram, chats, sizes.conc_ramp_s, sizes.conc_window_s
                )

            label = f"{system.fig.name}: concurrency, model delay {MODEL_DELAY_S:g} s"
            await step(label, concurrency)
    finally:
        llm.default = Reply(ANSWER)


async def alternating_throughput(
    systems: Sequence[System], chats: Sequence[int], sizes: Sizes
) -> None:
    """Each system's closed-loop rate over ``THROUGHPUT_SLOTS`` windows taken in turns (who
    goes first swaps every round), and its CPU per reply over them."""
    window = sizes.window_s / THROUGHPUT_SLOTS
    rates: list[list[float]] = [[] for _ in systems]
    cpu = [0.0 for _ in systems]
    replies = [0 for _ in systems]
    for slot in range(THROUGHPUT_SLOTS):
        order = list(enumerate(systems))
        for index, system in order if slot % 2 == 0 else order[::-1]:
            sent = sum(len(v) for v in system.telegram.sent.values())
            used = cpu_seconds(system.pid)
            rates[index].append(await closed_loop(system.telegram, chats, sizes.ramp_s, window))
            cpu[index] += cpu_seconds(system.pid) - used
            replies[index] += sum(len(v) for v in system.telegram.sent.values()) - sent
    for index, system in enumerate(systems):
        system.fig.mps = statistics.fmean(rates[index])
        system.fig.cpu_ms = cpu[index] * 1000 / max(1, replies[index])


async def run_pair(
    tmp: Path, llm: FakeLLMServer, sizes: Sizes, chats: list[int]
) -> tuple[Figures, Figures, list[str]]:
    """The daemon and the reference bot side by side, each against its own Telegram fake."""
    async with FakeTelegram() as ours, FakeTelegram() as theirs:
        config = geodebot_config(tmp / "main.toml", ours, llm, [LATENCY_CHAT, *chats])
        daemon = DaemonProcess(config, geodebot_env(ours))
        bot = ReferenceBot(theirs, llm.url)
        try:
            await daemon.start(timeout_s=60)
            await daemon.wait_for_line(MODELS_MARK, 120)
            await bot.start()
            assert daemon.proc is not None
            geo = System(ours, daemon.proc.pid, Figures("geodebot"))
            ref = System(theirs, bot.pid, Figures("reference"))
            await measure_pair(geo, ref, llm, sizes, chats)
        finally:
            await stop_daemon(daemon)
            await bot.stop()
    return geo.fig, ref.fig, daemon.log


async def daemon_idle_rss(
    tmp: Path, llm: FakeLLMServer, chats: list[int], extra: int, stem: str
) -> tuple[float, float]:
    """(idle RSS, seconds to ready) of a fresh daemon with ``chats`` + ``extra`` bindings."""
    async with FakeTelegram() as telegram:
        config = geodebot_config(tmp / f"{stem}.toml", telegram, llm, chats, extra)
        return await fresh_daemon_idle(DaemonProcess(config, geodebot_env(telegram)))


async def fresh_daemon_idle(daemon: DaemonProcess) -> tuple[float, float]:
    """(idle RSS, seconds to ready) of ``daemon``, stopped afterwards."""
    try:
        start = time.perf_counter()
        await daemon.start(timeout_s=120)
        await daemon.wait_for_line(CONNECTED_MARK, 120)
        ready_s = time.perf_counter() - start
        # Idle means after the model SDK loaded too, which it does right after READY.
        await daemon.wait_for_line(MODELS_MARK, 120)
        assert daemon.proc is not None
        return await idle_rss(daemon.proc.pid, settle_s=2.0), ready_s
    finally:
        await stop_daemon(daemon)


async def idle_rss_all_channels(tmp: Path, llm: FakeLLMServer) -> tuple[float, float]:
    """Idle RSS and time to ready with Telegram, Slack and Discord all enabled."""
    async with FakeTelegram() as telegram, FakeSlack() as slack, FakeDiscord() as discord:
        config = geodebot_config(tmp / "all.toml", telegram, llm, [LATENCY_CHAT])
        config.write_text(
            config.read_text()
            + "[channels.slack]\n"
            + f'bot_token_env = "{SLACK_BOT_ENV}"\napp_token_env = "{SLACK_APP_ENV}"\n'
            + f'api_base_url = "{slack.api_base_url}"\n'
            + f'[channels.discord]\ntoken_env = "{DISCORD_TOKEN_ENV}"\n'
            + f'api_base_url = "{discord.api_base_url}"\ngateway_url = "{discord.gateway_url}"\n'
        )
        env = dict(
            geodebot_env(telegram),
            **{
                SLACK_BOT_ENV: slack.bot_token,
                SLACK_APP_ENV: slack.app_token,
                DISCORD_TOKEN_ENV: discord.token,
            },
        )
        return await fresh_daemon_idle(DaemonProcess(config, env))


async def fresh_daemons(
    tmp: Path, llm: FakeLLMServer, sizes: Sizes, chats: list[int]
) -> dict[str, float]:
    """geodebot's own figures from fresh daemons: idle RSS and time to ready."""
    rss_all, ready_all = await idle_rss_all_channels(tmp, llm)
    print(
        f"  .. geodebot: all three channels idle {rss_all:.1f} MB (ready in {ready_all:.1f} s)",
        flush=True,
    )
    rss_sdks, modules = await sdk_floor_rss()
    print(f"  .. the same SDKs imported alone: {rss_sdks:.1f} MB ({modules} modules)", flush=True)
    small = [LATENCY_CHAT, chats[0], chats[1]]
    rss3, ready3 = await daemon_idle_rss(tmp, llm, small, 0, "three")
    print(f"  .. geodebot: 3 bindings idle {rss3:.1f} MB (ready in {ready3:.1f} s)", flush=True)
    rss_many, ready_many = await daemon_idle_rss(tmp, llm, small, sizes.extra_bindings, "many")
    print(
        f"  .. geodebot: {3 + sizes.extra_bindings} bindings idle {rss_many:.1f} MB "
        f"(ready in {ready_many:.1f} s)",
        flush=True,
    )
    return {
        "rss3": rss3,
        "rss_many": rss_many,
        "rss_all": rss_all,
        "rss_sdks": rss_sdks,
        "ready_all": ready_all,
    }


async def sdk_floor_rss() -> tuple[float, int]:
    """(idle RSS, modules loaded) of ``bench/sdk_floor.py``: the SDKs without geodebot."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "bench" / "sdk_floor.py"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        if not line.startswith(b"ready"):
            raise RuntimeError(f"bench/sdk_floor.py did not start: {line!r}")
        return await idle_rss(proc.pid, settle_s=1.0), int(line.split()[1])
    finally:
        proc.stdin.close()
        await proc.wait()


# -- report ---------------------------------------------------------------------------------
def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def report(geo: Figures, ref: Figures, sizes: Sizes) -> bool:
    rows: list[tuple[str, str, str, str, str, bool | None]] = []
    lat_ratio = geo.p50_ms / ref.p50_ms
    rows.append(
        (
            "sequential p50 (ms)",
            f"{geo.p50_ms:.1f}",
            f"{ref.p50_ms:.1f}",
            f"{lat_ratio:.2f}x",
            f"<= {LATENCY_RATIO_MAX}x ref",
            lat_ratio <= LATENCY_RATIO_MAX,
        )
    )
    tail_ratio = geo.p99_ms / ref.p99_ms
    rows.append(
        (
            "sequential p99 (ms)",
            f"{geo.p99_ms:.1f}",
            f"{ref.p99_ms:.1f}",
            f"{tail_ratio:.2f}x",
            f"<= {TAIL_RATIO_MAX}x ref",
            tail_ratio <= TAIL_RATIO_MAX,
        )
    )
    tp_ratio = geo.mps / ref.mps
    rows.append(
        (
            f"throughput, {sizes.chats} chats (msg/s)",
            f"{geo.mps:.1f}",
            f"{ref.mps:.1f}",
            f"{tp_ratio:.2f}x",
            f">= {THROUGHPUT_RATIO_MIN}x ref",
            tp_ratio >= THROUGHPUT_RATIO_MIN,
        )
    )
    rows.append(
        (
            "CPU per message at throughput (ms)",
            f"{geo.cpu_ms:.2f}",
            f"{ref.cpu_ms:.2f}",
            f"{geo.cpu_ms / ref.cpu_ms:.2f}x",
            "(info)",
            None,
        )
    )
    rows.append(
        (
            f"RSS idle, Telegram, {sizes.chats + 1} bindings (MB)",
            f"{geo.rss_idle_mb:.1f}",
            f"{ref.rss_idle_mb:.1f}",
            f"{geo.rss_idle_mb / ref.rss_idle_mb:.2f}x",
            "(info)",
            None,
        )
    )
    rss_all, rss_sdks = geo.extra["rss_all"], geo.extra["rss_sdks"]
    rows.append(
        (
            "RSS idle, all three channels (MB)",
            f"{rss_all:.1f}",
            f"{rss_sdks:.1f} SDKs",
            f"{rss_all - rss_sdks:+.1f}",
            f"<= SDKs +{RSS_OVER_SDKS_MAX_MB:g}",
            rss_all - rss_sdks <= RSS_OVER_SDKS_MAX_MB,
        )
    )
    ready_all = geo.extra["ready_all"]
    rows.append(
        (
            "start to READY, all three channels (s)",
            f"{ready_all:.2f}",
            "-",
            "-",
            f"<= {READY_MAX_S:g} s",
            ready_all <= READY_MAX_S,
        )
    )
    rows.append(
        (
            "RSS after throughput (MB)",
            f"{geo.rss_after_mb:.1f}",
            f"{ref.rss_after_mb:.1f}",
            f"{geo.rss_after_mb / ref.rss_after_mb:.2f}x",
            "(info)",
            None,
        )
    )
    rss3, rss_many = geo.extra["rss3"], geo.extra["rss_many"]
    rows.append(("RSS idle, 3 bindings (MB)", f"{rss3:.1f}", "-", "-", "(info)", None))
    delta = rss_many - rss3
    rows.append(
        (
            f"RSS +{sizes.extra_bindings:,} bound sessions (MB)",
            f"{delta:+.1f}",
            "-",
            "-",
            f"<= +{SESSIONS_DELTA_MAX_MB:g} MB",
            delta <= SESSIONS_DELTA_MAX_MB,
        )
    )
    growth = geo.extra["rss_after_turns"] - geo.extra["rss_before_turns"]
    rows.append(
        (
            f"RSS growth, {int(geo.extra['turns'])} turns / {sizes.chats} sessions (MB)",
            f"{growth:+.1f}",
            "-",
            "-",
            f"<= +{TURNS_GROWTH_MAX_MB:g} MB",
            growth <= TURNS_GROWTH_MAX_MB,
        )
    )
    if sizes.concurrency:
        bound = CAP / MODEL_DELAY_S
        frac_geo, frac_ref = geo.conc_mps / bound, ref.conc_mps / bound
        rows.append(
            (
                f"concurrency: msg/s / ({CAP}/{MODEL_DELAY_S:g} s)",
                f"{geo.conc_mps:.2f} ({frac_geo:.0%})",
                f"{ref.conc_mps:.2f} ({frac_ref:.0%})",
                f"{geo.conc_mps / ref.conc_mps:.2f}x",
                f">= {CONCURRENCY_MIN:.0%} of cap",
                frac_geo >= CONCURRENCY_MIN,
            )
        )
    return print_table(("figure", "geodebot", "reference", "ratio", "target", "result"), rows)


def print_table(header: tuple[str, ...], rows: Sequence[tuple[Any, ...]]) -> bool:
    """The figures as an aligned table, each row's last field (True, False or None for
    information only) shown as its verdict; whether no row failed."""
    table = [header, *((*row[:-1], verdict(row[-1])) for row in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print()
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return all(row[-1] is not False for row in rows)


def parse(argv: list[str] | None) -> Sizes:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about 1 minute)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seq", type=int, default=200, help="measured sequential turns")
    parser.add_argument("--chats", type=int, default=50)
    parser.add_argument("--ramp", type=float, default=1.0, help="throughput ramp-up, s")
    parser.add_argument("--window", type=float, default=10.0, help="throughput window, s")
    parser.add_argument("--growth-per-chat", type=int, default=10, help="turns per chat")
    parser.add_argument("--extra-bindings", type=int, default=10_000)
    parser.add_argument("--no-concurrency", action="store_true")
    parser.add_argument(
        "--no-stream", action="store_true", help="geodebot's bindings do not stream answers"
    )
    args = parser.parse_args(argv)
    if args.no_stream:
        BINDING_EXTRA.append("stream = false")
    if args.quick:
        args.warmup, args.seq, args.window, args.growth_per_chat = 5, 50, 4.0, 2
    return Sizes(
        warmup=args.warmup,
        seq=args.seq,
        chats=args.chats,
        ramp_s=args.ramp,
        window_s=args.window,
        growth_per_chat=args.growth_per_chat,
        extra_bindings=args.extra_bindings,
        # Model answers come in synchronised batches of CAP every ~1 s: a window that starts
        # half-way between two batches and lasts whole seconds counts whole batches only.
        conc_ramp_s=1.5,
        conc_window_s=3.0 if args.quick else 5.0,
        concurrency=not args.no_concurrency,
    )


async def amain(sizes: Sizes) -> int:
    chats = [LOOP_CHAT_BASE - i for i in range(sizes.chats)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="geodebot-bench-") as tmp:
        async with FakeLLMServer(record=False) as llm:
            llm.default = Reply(ANSWER)
            fresh = await fresh_daemons(Path(tmp), llm, sizes, chats)
            geo, ref, log = await run_pair(Path(tmp), llm, sizes, chats)
            geo.extra.update(fresh)
    ok = report(geo, ref, sizes)
    problems = [line for line in log if "Traceback" in line or " ERROR " in line]
    if problems:
        print(f"\ngeodebot logged {len(problems)} error line(s); first: {problems[0]}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s; overall: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    sizes = parse(argv)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.release()}"
    )
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"sizes: warm-up {sizes.warmup}, sequential {sizes.seq}, {sizes.chats} chats, "
        f"throughput window {sizes.window_s:g} s after {sizes.ramp_s:g} s, "
        f"growth {sizes.growth_per_chat}/chat, +{sizes.extra_bindings} bindings, cap {CAP}"
    )
    return asyncio.run(amain(sizes))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
