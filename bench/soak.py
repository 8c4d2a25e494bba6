"""Soak: many turns through ``geodebot serve``; memory, descriptors and tasks must level off.

The daemon runs as a subprocess against the Telegram fake and a zero-latency fake model (as in
``bench/telegram_bench.py``). The driver sends rounds of turns over ``--chats`` bound chats
(each chat waits for its reply before its next message), lets the daemon go quiet after each
round, and samples the daemon: VmRSS and open file descriptors from ``/proc``, threads and
asyncio tasks from ``geodebot status`` (the IPC ``status`` op).

It prints the series and the RSS slope over the second half of the run (least squares, KB
per turn), whole and without the context cache's bytes. The context cache keeps the recent
sessions' histories decoded, up to its bound (engine/context_cache.py: 32 MB, which holds 50
busy sessions of about 540 messages): while it fills, RSS grows with the histories by design,
and the run's 50 sessions of up to 800 messages stay under the bound. Its measure is checked
against what tracemalloc sees (tests/unit/test_context_cache.py), so what RSS does beside it
is what would show a leak. Targets (issue: soak): RSS without the context cache grows less
than 1 KB per turn, and the cache stays within its bound; descriptors, threads and tasks
flat: never above, in the second half, the highest count of the first half (open files: give
or take two, the keep-alive connections' coming and going).

Run from the repo root: ``.venv/bin/python bench/soak.py [--turns 20000] [--every 1000]``.
Exits 1 on FAIL. KB and MB here are 10^3 and 10^6 bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from telegram_bench import (
    ANSWER,
    LOOP_CHAT_BASE,
    geodebot_config,
    geodebot_env,
    one_turn,
    rss_mb,
    stop_daemon,
)

from geodebot.channels.ipc import IPCClient
from geodebot.config.schema import SOCKET_FILE
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram

SLOPE_MAX_KB_PER_TURN = 1.0
FDS_SLACK = 2
# The store's write-ahead log: started again from its beginning after each checkpoint, and
# cut back to this when a burst left it larger (store/sqlite.py, journal_size_limit).
LOG_MAX_MB = 32 * 1024 * 1024 / 1e6


@dataclass
class Sample:
    turns: int
    seconds: float
    rss_mb: float
    fds: int
    threads: int | None
    tasks: int | None
    # The context cache's bytes (its own measure, not RSS): bounded, it grows until full.
    cache_mb: float | None = None
    cache_max_mb: float | None = None
    # The SQLite store's write-ahead log file.
    log_mb: float = 0.0


def slope_kb_per_turn(samples: list[Sample], *, cache: bool = True) -> float:
    """Least-squares slope of RSS against turns, KB per turn; without ``cache``, of RSS less
    the context cache's bytes."""
    xs = [s.turns for s in samples]
    ys = [(s.rss_mb - (0 if cache else s.cache_mb or 0)) * 1000 for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def log_mb(state: Path) -> float:
    return sum(p.stat().st_size for p in state.rglob("*.db-wal")) / 1e6


async def sample(pid: int, socket: Path, turns: int, started: float) -> Sample:
    async with IPCClient(socket) as client:
        status = await client.request({"op": "status"})
    process = status.get("process") or {}
    return Sample(
        turns=turns,
        seconds=time.perf_counter() - started,
        rss_mb=rss_mb(pid),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=process.get("threads"),
        tasks=process.get("asyncio_tasks"),
        cache_mb=cache["bytes"] / 1e6 if (cache := status.get("context_cache")) else None,
        cache_max_mb=cache["max_bytes"] / 1e6 if cache else None,
    )


async def run(turns: int, every: int, chats: int) -> list[Sample]:
    chat_ids = [LOOP_CHAT_BASE - i for i in range(chats)]
    per_chat = max(1, every // chats)
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="geodebot-soak-") as tmp:
        async with FakeLLMServer(record=False) as llm, FakeTelegram() as telegram:
            llm.default = Reply(ANSWER)
            config = geodebot_config(Path(tmp) / "soak.toml", telegram, llm, chat_ids)
            daemon = DaemonProcess(config, geodebot_env(telegram))
            await daemon.start(timeout_s=60)
            assert daemon.proc is not None
            pid, socket = daemon.proc.pid, Path(tmp) / "soak-var" / SOCKET_FILE
            started, done = time.perf_counter(), 0
            try:
                while done < turns:

                    async def chat_round(chat: int, base: int = done) -> None:
                        for i in range(per_chat):
                            await one_turn(telegram, chat, f"soak {base + i}")

                    await asyncio.gather(*(chat_round(c) for c in chat_ids))
                    done += per_chat * chats
                    await asyncio.sleep(0.5)  # let deliveries and bookkeeping settle
                    samples.append(await sample(pid, socket, done, started))
                    last = samples[-1]
                    last.log_mb = log_mb(Path(tmp))
                    print(
                        f"  {last.turns:>7,} turns  {last.seconds:7.1f} s  "
                        f"RSS {last.rss_mb:7.2f} MB  fds {last.fds:4d}  "
                        f"threads {last.threads}  tasks {last.tasks}  "
                        f"context cache {last.cache_mb or 0:6.2f} MB  "
                        f"store log {last.log_mb:6.2f} MB",
                        flush=True,
                    )
            finally:
                await stop_daemon(daemon)
            errors = [line for line in daemon.log if "Traceback" in line or '"error"' in line]
            if errors:
                print(f"  daemon logged {len(errors)} error line(s); first: {errors[0]}")
    return samples


def report(samples: list[Sample]) -> bool:
    half = len(samples) // 2
    first, second = samples[:half] or samples, samples[half:]
    whole, outside = slope_kb_per_turn(second), slope_kb_per_turn(second, cache=False)
    start, end = samples[0], samples[-1]
    print()
    print(
        f"RSS: {start.rss_mb:.2f} MB after {start.turns:,} turns, {end.rss_mb:.2f} MB after "
        f"{end.turns:,}; slope over the last {len(second)} samples {whole:+.3f} KB/turn"
    )
    if end.cache_mb is None or end.cache_max_mb is None:
        print("context cache: not reported by the daemon: FAIL")
        ok = False
    else:
        ok = outside < SLOPE_MAX_KB_PER_TURN
        print(
            f"RSS without the context cache: slope {outside:+.3f} KB/turn "
            f"(target < {SLOPE_MAX_KB_PER_TURN:g}): {'PASS' if ok else 'FAIL'}"
        )
        held = max(s.cache_mb or 0 for s in samples)
        within = held <= end.cache_max_mb
        ok = ok and within
        print(
            f"context cache: at most {held:.2f} MB held, bound {end.cache_max_mb:.2f} MB: "
            f"{'PASS' if within else 'FAIL'}"
        )
    largest_log = max(s.log_mb for s in samples)
    log_ok = largest_log <= LOG_MAX_MB
    ok = ok and log_ok
    print(
        f"store log (SQLite WAL): at most {largest_log:.2f} MB "
        f"(target <= {LOG_MAX_MB:.1f}): {'PASS' if log_ok else 'FAIL'}"
    )
    # Flat: the second half never goes above the first half's highest count, give or take
    # the slack. Open files move by one or two with the keep-alive connections to the fakes
    # (31 to 32 within a run is common), and three samples a half, as the short run takes,
    # need not catch the highest; a leak climbs past that and keeps climbing.
    for name, get, slack in (
        ("open fds", lambda s: s.fds, FDS_SLACK),
        ("threads", lambda s: s.threads, 0),
        ("asyncio tasks", lambda s: s.tasks, 0),
    ):
        before = [get(s) for s in first]
        after = [get(s) for s in second]
        if None in before or None in after:
            print(f"{name}: not reported by the daemon: FAIL")
            ok = False
            continue
        flat = max(after) <= max(before) + slack
        ok = ok and flat
        allowed = f" (+{slack} allowed)" if slack else ""
        print(
            f"{name}: first half {min(before)}..{max(before)}, second half "  # type: ignore[type-var]  # figures of one kind per name
            f"{min(after)}..{max(after)}{allowed}: {'PASS' if flat else 'FAIL'}"  # type: ignore[type-var]  # figures of one kind per name
        )
    rate = end.turns / end.seconds
    print(
        f"\n{end.turns:,} turns in {end.seconds:.0f} s ({rate:.0f} turns/s); overall: "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=1_000, help="turns per sample")
    parser.add_argument("--chats", type=int, default=50)
    args = parser.parse_args(argv)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {platform.system()} {platform.release()}"
    )
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    samples = asyncio.run(run(args.turns, args.every, args.chats))
    return 0 if report(samples) else 1


if __name__ == "__main__":
    raise SystemExit(main())
