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

One daemon holds both kinds of session: ``--chats`` sessions seeded to about
``SHORT - 4 - turns`` messages and as many to about ``LONG - 4 - turns``. After a warm-up on a
few separate short chats:

1. cold: each long session's first turn in the process (its history read from the store, as
   after a restart), followed at once by every long session's second turn (warm): the cold /
   warm ratio is of these two, taken moments apart; then each short session's first turn
   (info), and a second one, so both kinds have had two turns;
2. warm: ``--turns`` rounds of one turn per chat, the short and the long sessions taking
   turns within each round and the order swapped every round (as the message bench
   alternates its two systems), so a drift of the machine's speed meets both alike; measured
   one phase after the other, the same code's ratio read anywhere from 0.9x to 1.6x. The
   baseline is the short sessions' figure, at about ``SHORT`` (60) messages; the long ones'
   is at about ``LONG`` (540);
3. restarts: the daemon is stopped and started again ``--restarts`` times, and each time,
   after the warm-up, the long sessions' first and second turns are measured as in 1. The
   cold / warm ratio is of all the cold turns' CPU against all the second turns' (one pair
   of 50-turn samples read anywhere from 1.6x to 3.5x in one run).

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
LONG_CHAT_BASE = -200_100  # the long sessions' chats (the short ones: LOOP_CHAT_BASE - i)
WARM_CHAT_BASE = -300_000  # short chats that warm a fresh process up (imports, connections)
WARM_CHATS = 4
WARM_TURNS = 5
SETTLE_S = 0.5
# After each group's turns in a warm round: the tail of their work (the outbox marking sends
# done) is counted to them, not to the next group.
ROUND_SETTLE_S = 0.1
SEED_CHUNK = 200  # messages per seeding checkpoint

# Targets.
LONG_RATIO_MAX = 1.5
COLD_RATIO_MAX = 3.0


@dataclass
class Sizes:
    chats: int
    turns: int  # measured warm turns per chat and phase
    restarts: int  # further cold / second pairs, each after a restart


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


async def cpu_of(
    pid: int, telegram: FakeTelegram, chats: Sequence[int], n: int, tag: str, settle_s: float
) -> tuple[float, int]:
    """(daemon CPU seconds, replies) of ``n`` turns per chat, all chats in closed loops at
    once, and ``settle_s`` after (the tail of their work counted to them)."""
    sent, used = sent_total(telegram), cpu_seconds(pid)
    await turns_per_chat(telegram, chats, n, tag)
    await asyncio.sleep(settle_s)
    return cpu_seconds(pid) - used, sent_total(telegram) - sent


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
    cpu, replies = await cpu_of(pid, telegram, chats, n, label, SETTLE_S)
    phase = Phase(label, messages, cpu * 1000 / max(1, replies), replies, rss_mb(pid))
    print(
        f" ({time.perf_counter() - started:.1f} s): {phase.cpu_ms:.2f} ms CPU per turn, "
        f"RSS {phase.rss_mb:.1f} MB",
        flush=True,
    )
    return phase


async def alternating(
    pid: int,
    telegram: FakeTelegram,
    groups: dict[str, tuple[Sequence[int], float]],
    rounds: int,
) -> dict[str, Phase]:
    """CPU per reply of each group (label: chats, mean messages) over ``rounds`` rounds of
    one turn per chat, the groups taking turns within each round and the order swapped every
    round, so a drift of the machine's speed meets every group alike."""
    started = time.perf_counter()
    print(f"  .. warm: {rounds} round(s) of a turn per chat, alternating", end="", flush=True)
    cpu = dict.fromkeys(groups, 0.0)
    replies = dict.fromkeys(groups, 0)
    rss: dict[str, float] = {}
    for r in range(rounds):
        order = list(groups) if r % 2 == 0 else list(groups)[::-1]
        for label in order:
            used, sent = await cpu_of(
                pid, telegram, groups[label][0], 1, f"{label} {r}", ROUND_SETTLE_S
            )
            cpu[label] += used
            replies[label] += sent
            rss[label] = rss_mb(pid)
    print(f" ({time.perf_counter() - started:.1f} s)", flush=True)
    phases = {}
    for label, (_, messages) in groups.items():
        phase = Phase(
            f"{label}, warm", messages, cpu[label] * 1000 / max(1, replies[label]),
            replies[label], rss[label],
        )  # fmt: skip
        print(f"  .. {phase.label}: {phase.cpu_ms:.2f} ms CPU per turn", flush=True)
        phases[label] = phase
    return phases


def pooled(label: str, phases: Sequence[Phase]) -> Phase:
    """One phase of several samples: CPU per reply over all their replies."""
    replies = sum(p.replies for p in phases)
    cpu_ms = sum(p.cpu_ms * p.replies for p in phases)
    messages = sum(p.messages * p.replies for p in phases)
    return Phase(label, messages / max(1, replies), cpu_ms / max(1, replies), replies,
                 phases[-1].rss_mb)  # fmt: skip


async def cold_and_second(
    pid: int, telegram: FakeTelegram, warm: Sequence[int], long_: Sequence[int], seeded: float
) -> tuple[Phase, Phase]:
    """A fresh process: warmed up on other chats (its first turns load code and open
    connections, so the cold figure is about the sessions' history), then each long
    session's first turn, its history read from the store, and at once its second turn."""
    await turns_per_chat(telegram, warm, WARM_TURNS, "warm-up")
    await asyncio.sleep(SETTLE_S)
    cold = await measure("long, cold", pid, telegram, long_, 1, seeded + 1)
    second = await measure("long, second turn", pid, telegram, long_, 1, seeded + 3)
    return cold, second


async def start(config: Path, telegram: FakeTelegram) -> DaemonProcess:
    daemon = DaemonProcess(config, geodebot_env(telegram))
    await daemon.start(timeout_s=60)
    await daemon.wait_for_line(MODELS_MARK, 120)
    return daemon


async def run(sizes: Sizes) -> tuple[Figures, list[str]]:
    short = [LOOP_CHAT_BASE - i for i in range(sizes.chats)]
    long_ = [LONG_CHAT_BASE - i for i in range(sizes.chats)]
    warm = [WARM_CHAT_BASE - i for i in range(WARM_CHATS)]
    figures = Figures()
    k = sizes.turns
    # Two turns before the warm rounds add 4 messages, then k warm turns 2 each: the mean
    # over the warm turns is the seeded length + 4 + k.
    short_seed, long_seed = SHORT - 4 - k, LONG - 4 - k
    earlier_logs: list[str] = []  # of the daemons stopped for a restart
    with tempfile.TemporaryDirectory(prefix="geodebot-long-") as tmp:
        async with FakeLLMServer(record=False) as llm, FakeTelegram() as telegram:
            llm.default = Reply(ANSWER)
            chats = [*short, *long_, *warm]
            config = geodebot_config(Path(tmp) / "long.toml", telegram, llm, chats)
            db = Path(tmp) / "long-var" / "geodebot.db"
            for group, seeded in ((short, short_seed), (long_, long_seed)):
                began = time.perf_counter()
                await seed(db, group, seeded)
                print(
                    f"  .. seeded {len(group)} sessions to {seeded} messages "
                    f"({time.perf_counter() - began:.1f} s)",
                    flush=True,
                )
            daemon = await start(config, telegram)
            try:
                assert daemon.proc is not None
                pid = daemon.proc.pid
                cold, second = await cold_and_second(pid, telegram, warm, long_, long_seed)
                colds, seconds = [cold], [second]
                short_cold = await measure("short, cold", pid, telegram, short, 1, short_seed + 1)
                # The long sessions had a turn more: as many again for the short ones.
                await turns_per_chat(telegram, short, 1, "even")
                groups = {
                    "short": (short, short_seed + 4 + k),
                    "long": (long_, long_seed + 4 + k),
                }
                figures.phases.update(await alternating(pid, telegram, groups, k))
                figures.phases["short-cold"] = short_cold
                seeded = long_seed + 4 + 2 * k
                for _ in range(sizes.restarts):
                    await stop_daemon(daemon)
                    earlier_logs.extend(daemon.log)
                    print("  .. restarted", flush=True)
                    daemon = await start(config, telegram)
                    assert daemon.proc is not None
                    cold, second = await cold_and_second(
                        daemon.proc.pid, telegram, warm, long_, seeded
                    )
                    colds.append(cold)
                    seconds.append(second)
                    seeded += 4
                if len(colds) > 1:
                    pairs = zip(colds, seconds, strict=True)
                    each = ", ".join(f"{c.cpu_ms / s.cpu_ms:.2f}x" for c, s in pairs)
                    print(f"  .. cold / second of each process: {each}", flush=True)
                figures.phases["long-cold"] = pooled("long, cold", colds)
                figures.phases["long-second"] = pooled("long, second turn", seconds)
            except TimeoutError:
                # A chat got no reply: never expected. Keep what tells why.
                await stop_daemon(daemon)
                kept = Path(tempfile.mkdtemp(prefix="geodebot-long-stall-"))
                shutil.copytree(db.parent, kept / "var")
                print(
                    f"\n  !! a reply waited more than {TURN_TIMEOUT_S:g} s; the daemon's "
                    f"state is kept in {kept}, its last log lines:",
                    flush=True,
                )
                for line in daemon.log[-60:]:
                    print(f"     {line}")
                raise
            finally:
                await stop_daemon(daemon)
    return figures, [*earlier_logs, *daemon.log]


def report(figures: Figures) -> bool:
    p = figures.phases
    short, long_, cold, short_cold = p["short"], p["long"], p["long-cold"], p["short-cold"]
    second = p["long-second"]
    rows: list[tuple[str, str, str, str, bool | None]] = []
    for phase in (short_cold, short, cold, second, long_):
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
    cold_ratio = cold.cpu_ms / second.cpu_ms
    rows.append(
        (
            "cold / warm, first turn after a restart / second, long history",
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
    parser.add_argument(
        "--restarts", type=int, default=3, help="further cold / second pairs after restarts"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.restarts = 4, 1
    return Sizes(chats=args.chats, turns=args.turns, restarts=args.restarts)


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
