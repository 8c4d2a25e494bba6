"""Per-turn CPU against history length: ``geodebot serve`` with long channel sessions.

The daemon runs as a subprocess against the Telegram fake and a zero-latency fake model (as in
``bench/telegram_bench.py``), with ``--chats`` bound chats (50) driven in closed loops: each
chat sends its next message when the reply to the previous one arrived. What is measured is
the daemon's own CPU time (user + system, all threads, from ``/proc``) over a phase divided
by the replies it sent in that phase, plus a short settle after the last reply so the tail
of the work (the outbox marking sends done) is counted too.

How the history is built: the sessions' earlier turns are written into the daemon's SQLite
file while the daemon is stopped, through the store's own append path
(``SQLiteStore.checkpoint``, the call a turn's checkpoint makes), as user/assistant pairs of
text messages shaped like a real turn's (a question of about 40 characters, an answer of
about 120). Everything the daemon then does per turn is the real path: Telegram update,
gate, inbox, session, context, model request, reply, outbox.

Phases, each with its RSS at the end:

1. short: the histories hold about ``SHORT - 2 - turns`` messages; after a process warm-up on
   a few separate short chats, each session's first turn (cold, info only), then ``--turns``
   turns per chat (warm): the baseline, at about ``SHORT`` (60) messages per session;
2. restart: the daemon is stopped, the same sessions are extended to about
   ``LONG - 2 - turns`` messages, the daemon started again and warmed up on the separate
   chats; then each session's first turn after the restart (cold);
3. long: ``--turns`` turns per chat (warm), at about ``LONG`` (540) messages per session.

Targets: warm CPU per turn at ~540 messages <= 1.5x the figure at ~60, and the first turn
of a session after a restart <= 3x the warm figure at the same length.

Run from the repo root: ``.venv/bin/python bench/long_sessions.py [--quick]``. Exits 1 on FAIL.
MB here is 10^6 bytes (VmRSS is reported in KiB).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from telegram_bench import (
    ANSWER,
    LOOP_CHAT_BASE,
    TURN_TIMEOUT_S,
    cpu_seconds,
    geodebot_config,
    geodebot_env,
    one_turn,
    print_table,
    rss_mb,
    stop_daemon,
)

from geodebot.engine.llm.types import Message
from geodebot.engine.modes import Mode
from geodebot.store.records import NewMessage
from geodebot.store.sqlite import SQLiteStore
from tests.support.daemon import MODELS_MARK, DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram

SHORT = 60  # messages per session, mean over the measured turns
LONG = 540
WARM_CHAT_BASE = -300_000  # short chats that warm a fresh process up (imports, connections)
WARM_CHATS = 4
WARM_TURNS = 5
SETTLE_S = 0.5
SEED_CHUNK = 200  # messages per seeding checkpoint

# Targets.
LONG_RATIO_MAX = 1.5
COLD_RATIO_MAX = 3.0


@dataclass
class Sizes:
    chats: int
    turns: int  # measured warm turns per chat and phase


@dataclass
class Phase:
    label: str
    messages: float  # mean messages per session over the phase's turns
    cpu_ms: float
    replies: int
    rss_mb: float


@dataclass
class Figures:
    phases: dict[str, Phase] = field(default_factory=dict)


def session_id(chat: int) -> str:
    return f"s{abs(chat)}"  # as geodebot_config binds it


def _question(i: int) -> str:
    return f"question {i}: how is the deployment of service {i % 17} going?"


def _answer(i: int) -> str:
    return (
        f"Answer {i}: the deployment of service {i % 17} finished; two checks passed, "
        "one is still running and should be done within the hour."
    )


async def seed(db: Path, chats: Sequence[int], upto: int) -> None:
    """Extend each chat's session with seeded turns until it holds ``upto`` messages, through
    the store's own checkpoint (see the module's docstring)."""
    async with SQLiteStore(db) as store:
        for chat in chats:
            sid = session_id(chat)
            row = await store.ensure_session(sid, Mode.DAEMON.value)
            have = row.next_seq - 1
            pending: list[NewMessage] = []
            for n in range(have, upto):
                turn = n // 2
                if n % 2 == 0:
                    message = Message.user_text(_question(turn))
                else:
                    message = Message.assistant_text(_answer(turn))
                pending.append(NewMessage(message.role, message.to_json(), f"seed-{turn}"))
                if len(pending) >= SEED_CHUNK:
                    await store.checkpoint(sid, messages=pending)
                    pending = []
            if pending:
                await store.checkpoint(sid, messages=pending)


def sent_total(telegram: FakeTelegram) -> int:
    return sum(len(v) for v in telegram.sent.values())


async def turns_per_chat(telegram: FakeTelegram, chats: Sequence[int], n: int, tag: str) -> None:
    async def chat_loop(chat: int) -> None:
        for i in range(n):
            await one_turn(telegram, chat, f"{tag} {i}")

    await asyncio.gather(*(chat_loop(c) for c in chats))


async def measure(
    label: str,
    pid: int,
    telegram: FakeTelegram,
    chats: Sequence[int],
    n: int,
    messages: float,
) -> Phase:
    """CPU per reply of ``n`` turns per chat, all chats in closed loops at once."""
    started = time.perf_counter()
    print(f"  .. {label}: {n} turn(s) x {len(chats)} chats", end="", flush=True)
    sent = sent_total(telegram)
    used = cpu_seconds(pid)
    await turns_per_chat(telegram, chats, n, label)
    await asyncio.sleep(SETTLE_S)
    cpu = cpu_seconds(pid) - used
    replies = sent_total(telegram) - sent
    phase = Phase(label, messages, cpu * 1000 / max(1, replies), replies, rss_mb(pid))
    print(
        f" ({time.perf_counter() - started:.1f} s): {phase.cpu_ms:.2f} ms CPU per turn, "
        f"RSS {phase.rss_mb:.1f} MB",
        flush=True,
    )
    return phase


async def start(config: Path, telegram: FakeTelegram) -> DaemonProcess:
    daemon = DaemonProcess(config, geodebot_env(telegram))
    await daemon.start(timeout_s=60)
    await daemon.wait_for_line(MODELS_MARK, 120)
    return daemon


async def run(sizes: Sizes) -> tuple[Figures, list[str]]:
    chats = [LOOP_CHAT_BASE - i for i in range(sizes.chats)]
    warm = [WARM_CHAT_BASE - i for i in range(WARM_CHATS)]
    figures = Figures()
    log: list[str] = []
    k = sizes.turns
    # A cold turn adds 2 messages, then k warm turns 2 each: the mean over the warm turns is
    # the seeded length + 2 + k.
    short_seed, long_seed = SHORT - 2 - k, LONG - 2 - k
    with tempfile.TemporaryDirectory(prefix="geodebot-long-") as tmp:
        async with FakeLLMServer(record=False) as llm, FakeTelegram() as telegram:
            llm.default = Reply(ANSWER)
            config = geodebot_config(Path(tmp) / "long.toml", telegram, llm, [*chats, *warm])
            db = Path(tmp) / "long-var" / "geodebot.db"
            for label, seeded in (("short", short_seed), ("long", long_seed)):
                began = time.perf_counter()
                await seed(db, chats, seeded)
                print(
                    f"  .. seeded {len(chats)} sessions to {seeded} messages "
                    f"({time.perf_counter() - began:.1f} s)",
                    flush=True,
                )
                daemon = await start(config, telegram)
                try:
                    assert daemon.proc is not None
                    pid = daemon.proc.pid
                    # A fresh process's first turns load code and open connections: done on
                    # other chats, so the cold figure is about the sessions' history.
                    await turns_per_chat(telegram, warm, WARM_TURNS, "warm-up")
                    await asyncio.sleep(SETTLE_S)
                    cold = await measure(f"{label}, cold", pid, telegram, chats, 1, seeded + 1)
                    hot = await measure(f"{label}, warm", pid, telegram, chats, k, seeded + 2 + k)
                    figures.phases[f"{label}-cold"] = cold
                    figures.phases[label] = hot
                except TimeoutError:
                    # A chat got no reply: never expected. Keep what tells why.
                    await stop_daemon(daemon)
                    kept = Path(tempfile.mkdtemp(prefix="geodebot-long-stall-"))
                    shutil.copytree(db.parent, kept / "var")
                    print(
                        f"\n  !! a reply waited more than {TURN_TIMEOUT_S:g} s in the {label} "
                        f"phase; the daemon's state is kept in {kept}, its last log lines:",
                        flush=True,
                    )
                    for line in daemon.log[-60:]:
                        print(f"     {line}")
                    raise
                finally:
                    await stop_daemon(daemon)
                    log += daemon.log
    return figures, log


def report(figures: Figures) -> bool:
    p = figures.phases
    short, long_, cold, short_cold = p["short"], p["long"], p["long-cold"], p["short-cold"]
    rows: list[tuple[str, str, str, str, bool | None]] = []
    for phase in (short_cold, short, cold, long_):
        rows.append(
            (
                f"CPU per turn, {phase.label}, ~{phase.messages:.0f} messages (ms)",
                f"{phase.cpu_ms:.2f}",
                f"{phase.replies} turns, RSS {phase.rss_mb:.1f} MB at the end",
                "(info)",
                None,
            )
        )
    long_ratio = long_.cpu_ms / short.cpu_ms
    rows.append(
        (
            f"long / short, warm (~{long_.messages:.0f} vs ~{short.messages:.0f} messages)",
            f"{long_ratio:.2f}x",
            "",
            f"<= {LONG_RATIO_MAX}x",
            long_ratio <= LONG_RATIO_MAX,
        )
    )
    cold_ratio = cold.cpu_ms / long_.cpu_ms
    rows.append(
        (
            "cold / warm, first turn after a restart, long history",
            f"{cold_ratio:.2f}x",
            "",
            f"<= {COLD_RATIO_MAX}x",
            cold_ratio <= COLD_RATIO_MAX,
        )
    )
    rows.append(
        (
            "cold / warm, first turn of the process, short history",
            f"{short_cold.cpu_ms / short.cpu_ms:.2f}x",
            "",
            "(info)",
            None,
        )
    )
    return print_table(("figure", "value", "note", "target", "result"), rows)


def parse(argv: list[str] | None) -> Sizes:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer measured turns (~1 minute)")
    parser.add_argument("--chats", type=int, default=50)
    parser.add_argument("--turns", type=int, default=12, help="measured warm turns per chat")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns = 4
    return Sizes(chats=args.chats, turns=args.turns)


async def amain(sizes: Sizes) -> int:
    started = time.perf_counter()
    figures, log = await run(sizes)
    ok = report(figures)
    problems = [line for line in log if "Traceback" in line or " ERROR " in line]
    if problems:
        print(f"\ngeodebot logged {len(problems)} error line(s); first: {problems[0]}")
        ok = False
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
        f"sizes: {sizes.chats} chats, {sizes.turns} measured turns per chat and phase, "
        f"histories of ~{SHORT} and ~{LONG} messages"
    )
    return asyncio.run(amain(sizes))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
