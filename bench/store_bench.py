"""The daemon on PostgreSQL against the daemon on SQLite, and replicas on one database.

Two ``geodebot serve`` processes run side by side against the same fake model, each with its
own Telegram fake (as in ``bench/telegram_bench.py``): one on SQLite in its state directory,
one on a PostgreSQL server this script starts in a temp directory with the server's durable
defaults (fsync and synchronous commit on, as an operator would run it). Measured in turns,
so a change in the machine's speed meets both alike:

* sequential latency (p50, p99) of one chat: what PostgreSQL's round trips add to a turn;
* closed-loop throughput over ``--chats`` chats and the daemon's CPU per reply;
* the same throughput with two more replicas on the database (members: every Telegram
  message reaches the leader, whose poller takes the chats' sessions; replicas/daemon_lease.py,
  replicas/leases.py), and what an idle member costs;
* failover: SIGKILL the replica running a turn (and the leader, if that is another one),
  time until a survivor leads and until it has answered the message the killed one was
  working on. The turn's replica is the holder of its session's lease: not always the
  leader that took the message in (an idle session goes to its home replica).

Figures only (no targets: the issue asks what PostgreSQL adds, not a bound).
Run from the repo root: ``.venv/bin/python bench/store_bench.py [--quick]``.
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
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from telegram_bench import (
    ANSWER,
    LATENCY_CHAT,
    LOOP_CHAT_BASE,
    THROUGHPUT_SLOTS,
    Figures,
    Sizes,
    System,
    alternating,
    alternating_throughput,
    cpu_seconds,
    geodebot_config,
    geodebot_env,
    print_table,
    step,
    stop_daemon,
)

from geodebot.replicas.daemon_lease import LEAD_MARK, MEMBER_MARK
from tests.support.daemon import MODELS_MARK, DaemonProcess
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.postgres import Cluster

LEASE_TTL_S = 5
STANDBY_IDLE_S = 10.0


def with_store(config: Path, url: str, replica: str) -> Path:
    """``config`` on PostgreSQL: the URL, this replica's id and a short lease."""
    text = config.read_text().replace("[daemon]\n", f'[daemon]\nreplica_id = "{replica}"\n', 1)
    config.write_text(text + f'[store]\nurl = "{url}"\nlease_ttl_s = {LEASE_TTL_S}\n')
    return config


async def standby(
    tmp: Path, telegram: FakeTelegram, llm: FakeLLMServer, url: str, name: str
) -> DaemonProcess:
    config = geodebot_config(tmp / f"{name}.toml", telegram, llm, [LATENCY_CHAT])
    daemon = DaemonProcess(with_store(config, url, name), geodebot_env(telegram))
    await daemon.start(timeout_s=60)
    await daemon.wait_for_line(MEMBER_MARK, 60)
    return daemon


async def failover(
    replicas: dict[str, DaemonProcess],
    telegram: FakeTelegram,
    llm: FakeLLMServer,
    url: str,
) -> tuple[float, float]:
    """SIGKILL the replica running a turn (the holder of its session's lease; with the
    leader too, if another replica runs it: the session may have gone to its home after
    the leader let it go idle) while the model works on it; seconds until a surviving
    replica leads, and until the message is answered."""
    llm.script(Delay(60, Reply("lost with the killed replica")))
    asked = llm.request_count  # (the fake records no requests here: counted instead)
    want = len(telegram.sent[LATENCY_CHAT]) + 1
    telegram.push_message(LATENCY_CHAT, "during the failover", user_id=4242)
    await llm.wait_for_requests(asked + 1)
    assert llm.pending == 0  # the running turn's call has the delay, not the next one
    with psycopg.connect(url, autocommit=True) as conn:
        session = f"session:s{abs(LATENCY_CHAT)}"
        held = conn.execute("SELECT holder FROM leases WHERE name = %s", (session,)).fetchone()
        lead = conn.execute("SELECT holder FROM leases WHERE name = 'daemon'").fetchone()
    killed_names = {str(held[0]), str(lead[0])} if held and lead else set()
    assert killed_names, "the turn's session or the daemon's lease has no holder"
    killed = time.perf_counter()
    for name in sorted(killed_names):
        await replicas[name].kill()
    left = [d for name, d in replicas.items() if name not in killed_names]
    waits = [asyncio.ensure_future(d.wait_for_line(LEAD_MARK, 120)) for d in left]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    leading_after = time.perf_counter() - killed
    for w in waits:
        w.cancel()
    await asyncio.gather(*waits, return_exceptions=True)
    await telegram.wait_for_sent(LATENCY_CHAT, want, timeout=120)
    return leading_after, time.perf_counter() - killed


async def amain(sizes: Sizes) -> int:
    chats = [LOOP_CHAT_BASE - i for i in range(sizes.chats)]
    cluster = Cluster()
    cluster.start(durable=True)
    try:
        url = cluster.new_database(migrated=True)
        with tempfile.TemporaryDirectory(prefix="geodebot-store-bench-") as tmp_name:
            tmp = Path(tmp_name)
            async with (
                FakeLLMServer(record=False) as llm,
                FakeTelegram() as on_sqlite,
                FakeTelegram() as on_pg,
            ):
                llm.default = Reply(ANSWER)
                bound = [LATENCY_CHAT, *chats]
                lite = DaemonProcess(
                    geodebot_config(tmp / "sqlite.toml", on_sqlite, llm, bound),
                    geodebot_env(on_sqlite),
                )
                pg_config = geodebot_config(tmp / "pg-1.toml", on_pg, llm, bound)
                pg = DaemonProcess(with_store(pg_config, url, "pg-1"), geodebot_env(on_pg))
                standbys: list[DaemonProcess] = []
                try:
                    for daemon in (lite, pg):
                        await daemon.start(timeout_s=60)
                        await daemon.wait_for_line(MODELS_MARK, 120)
                    assert lite.proc is not None
                    assert pg.proc is not None
                    systems = (
                        System(on_sqlite, lite.proc.pid, Figures("sqlite")),
                        System(on_pg, pg.proc.pid, Figures("postgresql")),
                    )
                    await asyncio.sleep(1.5)

                    async def latency() -> None:
                        pairs = await alternating(
                            [s.telegram for s in systems], sizes.warmup, sizes.seq
                        )
                        for system, (p50, p99) in zip(systems, pairs, strict=True):
                            system.fig.p50_ms, system.fig.p99_ms = p50, p99

                    await step("sequential latency, turns alternating", latency)
                    await step(
                        f"throughput, {THROUGHPUT_SLOTS} windows each, alternating",
                        lambda: alternating_throughput(systems, chats, sizes),
                    )
                    for name in ("pg-2", "pg-3"):
                        standbys.append(await standby(tmp, on_pg, llm, url, name))
                    idle: list[float] = []
                    await asyncio.sleep(1.0)
                    used = [cpu_seconds(d.proc.pid) for d in standbys if d.proc is not None]
                    await asyncio.sleep(STANDBY_IDLE_S)
                    for daemon, before in zip(standbys, used, strict=True):
                        assert daemon.proc is not None
                        idle.append((cpu_seconds(daemon.proc.pid) - before) / STANDBY_IDLE_S)
                    replicated = System(on_pg, pg.proc.pid, Figures("postgresql, 3 replicas"))
                    await step(
                        "throughput with two more replicas",
                        lambda: alternating_throughput((systems[1], replicated), chats, sizes),
                    )
                    replicas = {"pg-1": pg, "pg-2": standbys[0], "pg-3": standbys[1]}
                    took = await failover(replicas, on_pg, llm, url)
                finally:
                    for daemon in (lite, pg, *standbys):
                        await stop_daemon(daemon)
    finally:
        cluster.stop()
    lite_fig, pg_fig = systems[0].fig, systems[1].fig
    rows = [
        ("sequential p50 (ms)", lite_fig.p50_ms, pg_fig.p50_ms),
        ("sequential p99 (ms)", lite_fig.p99_ms, pg_fig.p99_ms),
        (f"throughput, {sizes.chats} chats (msg/s)", lite_fig.mps, pg_fig.mps),
        ("daemon CPU per reply (ms)", lite_fig.cpu_ms, pg_fig.cpu_ms),
    ]
    table = [
        (name, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x", f"{b - a:+.1f}", None)
        for name, a, b in rows
    ]
    table.append(
        (
            "throughput, leader + 2 members (msg/s)",
            "-",
            f"{replicated.fig.mps:.1f}",
            f"{replicated.fig.mps / pg_fig.mps:.2f}x of 1 replica",
            "",
            None,
        )
    )
    table.append(
        (
            f"an idle member's CPU ({STANDBY_IDLE_S:g} s)",
            "-",
            " / ".join(f"{100 * c:.2f} %" for c in idle),
            "",
            "",
            None,
        )
    )
    table.append(
        (
            f"failover, SIGKILL of the turn's replica and the leader (lease {LEASE_TTL_S} s):"
            " leading / answered (s)",
            "-",
            f"{took[0]:.1f} / {took[1]:.1f}",
            "",
            "",
            None,
        )
    )
    print_table(("figure", "sqlite", "postgresql", "ratio", "difference", "result"), table)
    print(
        "\nPostgreSQL: the server's durable defaults, on this machine (loopback). Polled, "
        "Telegram brings every message to the leader, which takes the chats' sessions, so the "
        "members here add failover; bench/replicas_bench.py measures traffic they share."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about 1 minute)")
    parser.add_argument("--chats", type=int, default=50)
    args = parser.parse_args(argv)
    quick = args.quick
    sizes = Sizes(
        warmup=10 if quick else 20,
        seq=60 if quick else 200,
        chats=args.chats,
        ramp_s=1.0,
        window_s=4.0 if quick else 10.0,
        growth_per_chat=0,
        extra_bindings=0,
        conc_ramp_s=0.0,
        conc_window_s=0.0,
        concurrency=False,
    )
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {platform.system()} {platform.release()}"
    )
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    return asyncio.run(amain(sizes))


if __name__ == "__main__":
    raise SystemExit(main())
