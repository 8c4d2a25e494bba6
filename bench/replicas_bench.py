"""Closed-loop throughput with 1, 2 and 3 replicas of ``geodebot serve`` on one PostgreSQL.

Every replica serves: each session's turns run on the replica holding its lease
(replicas/leases.py), and a message that another replica took in is picked up by the holder
(replicas/pickup.py). Three replicas run on one database of a PostgreSQL server this script starts
in a temp directory with the server's durable defaults (``Cluster.start(durable=True)``).
Telegram runs in webhook mode behind the fake Bot API's round-robin balancer
(``FakeTelegram.webhook_targets``); Slack spreads events over the replicas' Socket Mode
connections, as Slack does. Measuring ``n`` replicas, both balancers send to the first ``n``
only, with a group of chats of its own whose sessions were taken during a warm-up by the
replica that took each one's first message in; the other replicas stay up, idle.

For each platform, each model (zero latency; ``--delay``, 50 ms by default, to see what
sharing buys when turns take time: each replica runs at most ``CAP`` turns at once) and each
replica count:

* throughput: the group's chats in a closed loop (each sends its next message once the last
  was answered, as ``bench/telegram_bench.py``'s ``closed_loop``), replies per second in a
  window after a ramp; the replica counts take turns (``--slots``, who goes first reversed
  every slot) so a change of the machine's speed meets every count alike;
* CPU per reply: user + system CPU (from /proc) of all replicas over the runs, divided by
  their replies; PostgreSQL's (the postmaster and its children) and this process's (the fakes
  and the driver) alike, as they share the machine's cores with the replicas;
* spread: the group's session leases per holder (``SELECT holder, count(*) FROM leases``);
* Telegram: each webhook POST's time until the replica answered (its inbox row committed);
  the fake POSTs one update at a time, so 1 / their mean bounds the replies per second.

And the fake's own webhook delivery into a bare aiohttp server answering 200 at once.
Figures only (no targets). Run from the repo root:
``.venv/bin/python bench/replicas_bench.py [--quick]`` (about 2 minutes; the full run 6-7).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import psycopg
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from telegram_bench import (
    ANSWER,
    CAP,
    KEY,
    KEY_ENV,
    LOOP_CHAT_BASE,
    SLACK_APP_ENV,
    SLACK_BOT_ENV,
    TOKEN_ENV,
    TURN_TIMEOUT_S,
    USER,
    cpu_seconds,
    step,
    stop_daemon,
)

from tests.support.daemon import MODELS_MARK, DaemonProcess
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Item, Reply
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.ports import free_port
from tests.support.postgres import Cluster

SECRET_ENV = "BENCH_TELEGRAM_WEBHOOK_SECRET"
SECRET = "bench-webhook_secret-0123456789"
HOOK_PATH = "/telegram/hook-bench"
LISTENING = "receiving webhooks"
SLACK_USER = "U0BENCH001"
SLACK_CHANNEL_BASE = "C0BENCH"
SLACK_TS = itertools.count(1)  # each message's own (Slack's message id)
COUNTS = (1, 2, 3)
TELEGRAM = "telegram webhooks"
SLACK = "slack, spread"
PLATFORMS = (TELEGRAM, SLACK)


@dataclass
class Sizes:
    chats: int
    ramp_s: float
    window_s: float
    delay_s: float
    slots: int
    fake_updates: int


@dataclass
class Run:
    """One closed-loop run of a set of replicas."""

    mps: float
    replies: int
    cpu_replicas_s: float
    cpu_postgres_s: float
    cpu_driver_s: float
    post_s: list[float] = field(default_factory=list)


@dataclass
class Figures:
    """One platform's runs with one replica count."""

    replicas: int
    runs: dict[str, list[Run]] = field(default_factory=lambda: defaultdict(list))
    spread: list[list[int]] = field(default_factory=list)


# -- CPU ------------------------------------------------------------------------------------
def postgres_pids(cluster: Cluster) -> list[int]:
    """The postmaster and its children (the backends, the checkpointer, the WAL writer...)."""
    master = int((cluster.data / "postmaster.pid").read_text().split()[0])
    pids = [master]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == master:
            pids.append(int(entry.name))
    return pids


def cpu_by_pid(pids: Sequence[int]) -> dict[int, float]:
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile
            found[pid] = cpu_seconds(pid)
    return found


def cpu_since(before: dict[int, float], pids: Sequence[int]) -> float:
    """CPU used since ``before`` by ``pids``: a process that started meanwhile counts whole."""
    now = cpu_by_pid(pids)
    return sum(used - before.get(pid, 0.0) for pid, used in now.items())


# -- traffic ------------------------------------------------------------------------------
class TimedTelegram(FakeTelegram):
    """The fake Bot API, timing each webhook POST (sent until answered): with one POST at a
    time, the inverse of their mean bounds the replies per second."""

    def __init__(self) -> None:
        super().__init__()
        self.post_s: list[float] = []

    async def _post_update(
        self, session: aiohttp.ClientSession, webhook: Mapping[str, Any], update: dict[str, Any]
    ) -> int:
        start = time.perf_counter()
        try:
            return await super()._post_update(session, webhook, update)
        finally:
            self.post_s.append(time.perf_counter() - start)


class Traffic(Protocol):
    """One platform's closed loop: its chats, a turn (a message, then its reply), replies."""

    chats: list[str]

    async def turn(self, chat: str, text: str) -> None: ...

    def replies(self) -> int: ...


class TelegramTraffic:
    def __init__(self, telegram: TimedTelegram, chats: list[str]) -> None:
        self.telegram = telegram
        self.chats = chats

    async def turn(self, chat: str, text: str) -> None:
        want = len(self.telegram.sent[int(chat)]) + 1
        self.telegram.push_message(int(chat), text, user_id=USER)
        await self.telegram.wait_for_sent(int(chat), want, timeout=TURN_TIMEOUT_S)

    def replies(self) -> int:
        return sum(len(v) for v in self.telegram.sent.values())


class SlackTraffic:
    def __init__(self, slack: FakeSlack, chats: list[str]) -> None:
        self.slack = slack
        self.chats = chats

    async def turn(self, chat: str, text: str) -> None:
        want = len(self.slack.posted[chat]) + 1
        ts = f"{1_800_000_000 + next(SLACK_TS)}.000100"
        await self.slack.push_event(FakeSlack.message_event(chat, SLACK_USER, text, ts=ts))
        await self.slack.wait_until(
            lambda: len(self.slack.posted[chat]) >= want, timeout=TURN_TIMEOUT_S
        )

    def replies(self) -> int:
        return sum(len(v) for v in self.slack.posted.values())


async def closed_loop(traffic: Traffic, ramp_s: float, window_s: float) -> float:
    """Replies per second inside [ramp, ramp + window], each chat sending its next message
    once the last was answered; every chat drains before returning."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    lo, hi = t0 + ramp_s, t0 + ramp_s + window_s
    done: list[float] = []

    async def chat_loop(chat: str) -> None:
        i = 0
        while loop.time() < hi:
            await traffic.turn(chat, f"load {i}")
            done.append(loop.time())
            i += 1

    await asyncio.gather(*(chat_loop(c) for c in traffic.chats))
    return sum(1 for t in done if lo <= t <= hi) / window_s


# -- replicas -------------------------------------------------------------------------------
class BalancedSlack(FakeSlack):
    """The fake Slack spreading events over the first ``targets`` open Socket Mode
    connections only (0: every one, as Slack does): the replicas behind them serve."""

    targets = 0

    def _socket_for_next(self) -> web.WebSocketResponse:
        if not self.targets:
            return super()._socket_for_next()
        sockets = [w for w in self._sockets if not w.closed][: self.targets]
        self._turn += 1
        return sockets[self._turn % len(sockets)]


@dataclass
class Group:
    """The chats that measure ``n`` replicas: their sessions are taken by the first ``n``
    replicas, the ones the balancers send this group's messages to."""

    n: int
    telegram: list[str]
    slack: list[str]

    @staticmethod
    def of(n: int, chats: int) -> Group:
        return Group(
            n,
            telegram=[str(LOOP_CHAT_BASE - 1000 * n - i) for i in range(chats)],
            slack=[f"{SLACK_CHANNEL_BASE}{n}{i:03d}" for i in range(chats)],
        )

    def session(self, platform_: str, chat: str) -> str:
        index = self.telegram.index(chat) if platform_ == "telegram" else self.slack.index(chat)
        return f"{platform_[:2]}{self.n}-{index}"


def replica_config(
    path: Path,
    telegram: FakeTelegram,
    slack: FakeSlack,
    llm: FakeLLMServer,
    url: str,
    listen: str,
    groups: Sequence[Group],
) -> Path:
    lines = [
        "[daemon]",
        f'state_dir = "{path.parent / (path.stem + "-var")}"',
        f'replica_id = "{path.stem}"',
        f"max_concurrent_sessions = {CAP}",
        # One sender drives the whole load: flood control would measure itself, not the path.
        "user_rate_per_min = 0",
        "shutdown_grace_s = 2",
        "[store]",
        f'url = "{url}"',
        "[model]",
        'provider = "anthropic"',
        'name = "bench-model"',
        f'base_url = "{llm.url}"',
        f'api_key_env = "{KEY_ENV}"',
        "max_retries = 0",
        "[channels.telegram]",
        f'token_env = "{TOKEN_ENV}"',
        f'api_base_url = "{telegram.api_base_url}"',
        # The balancer's address (the fake's webhook_targets stand in for it): every replica
        # listens behind it, the leader registers it.
        f'webhook_url = "http://127.0.0.1:1{HOOK_PATH}"',
        f'webhook_listen = "{listen}"',
        f'webhook_secret_env = "{SECRET_ENV}"',
        "[channels.slack]",
        f'bot_token_env = "{SLACK_BOT_ENV}"',
        f'app_token_env = "{SLACK_APP_ENV}"',
        f'api_base_url = "{slack.api_base_url}"',
    ]
    for group in groups:
        bound = [("telegram", c, str(USER)) for c in group.telegram]
        bound += [("slack", c, SLACK_USER) for c in group.slack]
        for platform_, channel, user in bound:
            lines += [
                "[[bindings]]",
                f'platform = "{platform_}"',
                f'channel = "{channel}"',
                f'session = "{group.session(platform_, channel)}"',
                f'allowed_users = ["{user}"]',
                "tools = []",
                # One message per reply on both platforms: the figure is turns, not edits.
                "stream = false",
            ]
    path.write_text("\n".join(lines) + "\n")
    return path


def spread(url: str, prefix: str) -> list[int]:
    """Session leases per holder for the sessions named ``prefix``..., most first."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT holder, count(*) FROM leases WHERE name LIKE %s GROUP BY holder",
            (f"session:{prefix}%",),
        ).fetchall()
    return sorted((int(r[1]) for r in rows), reverse=True)


@dataclass
class Replicas:
    """``max(COUNTS)`` replicas on one database, behind the fakes' balancers."""

    url: str
    telegram: TimedTelegram
    slack: BalancedSlack
    listens: list[str]
    daemons: list[DaemonProcess] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return [d.proc.pid for d in self.daemons if d.proc is not None]

    def serving(self, n: int) -> None:
        """The balancers send to the first ``n`` replicas only."""
        self.telegram.webhook_targets = self.listens[:n]
        self.slack.targets = n

    def traffic(self, name: str, group: Group) -> Traffic:
        if name == TELEGRAM:
            return TelegramTraffic(self.telegram, group.telegram)
        return SlackTraffic(self.slack, group.slack)


async def start_replicas(
    cluster: Cluster,
    tmp: Path,
    llm: FakeLLMServer,
    groups: Sequence[Group],
    stack: contextlib.AsyncExitStack,
) -> Replicas:
    """The replicas, one after the other (the first leads: it registers the webhook; the
    Slack connections are in the replicas' order), each listening with its models loaded;
    stopped when ``stack`` closes."""
    telegram = await stack.enter_async_context(TimedTelegram())
    slack = await stack.enter_async_context(BalancedSlack(spread=True))
    count = max(COUNTS)
    replicas = Replicas(
        cluster.new_database(migrated=True),
        telegram,
        slack,
        [f"127.0.0.1:{free_port()}" for _ in range(count)],
    )
    stack.push_async_callback(lambda: asyncio.gather(*(stop_daemon(d) for d in replicas.daemons)))
    env = dict(os.environ, **{TOKEN_ENV: telegram.token, KEY_ENV: KEY, SECRET_ENV: SECRET})
    env.update({SLACK_BOT_ENV: slack.bot_token, SLACK_APP_ENV: slack.app_token})
    env.pop("GEODEBOT_CONFIG", None)
    for i, listen in enumerate(replicas.listens):
        config = replica_config(
            tmp / f"r{i + 1}.toml", telegram, slack, llm, replicas.url, listen, groups
        )
        daemon = DaemonProcess(config, env)
        replicas.daemons.append(daemon)
        await daemon.start(timeout_s=120)
        await daemon.wait_for_line(LISTENING, 60)
        await slack.wait_until(lambda i=i: slack.open_sockets > i, timeout=60)  # type: ignore[misc]
        await daemon.wait_for_line(MODELS_MARK, 120)
    await telegram.wait_until(lambda: telegram.webhook is not None, timeout=30)
    return replicas


async def warm_up(replicas: Replicas, groups: Sequence[Group]) -> None:
    """One turn in every chat of each group, sent to the group's replicas: each session is
    taken (and stays) where its first message came in, as after a while in service."""
    for group in groups:
        replicas.serving(group.n)
        await asyncio.gather(
            *(
                traffic.turn(chat, "hello")
                for traffic in (replicas.traffic(name, group) for name in PLATFORMS)
                for chat in traffic.chats
            )
        )


async def measure(
    replicas: Replicas,
    groups: Sequence[Group],
    name: str,
    model: str,
    cluster: Cluster,
    sizes: Sizes,
    figs: dict[int, dict[str, Figures]],
) -> None:
    """Each replica count's closed loop on one platform, in ``sizes.slots`` turns (who goes
    first reverses every slot), so a change of the machine's speed meets every count alike."""
    for slot in range(sizes.slots):
        for group in groups if slot % 2 == 0 else groups[::-1]:
            replicas.serving(group.n)
            replicas.telegram.post_s.clear()
            traffic = replicas.traffic(name, group)
            run = await measured(traffic, replicas.pids, cluster, sizes)
            if name == TELEGRAM:
                run.post_s = list(replicas.telegram.post_s)
            figs[group.n][name].runs[model].append(run)


async def measured(traffic: Traffic, pids: list[int], cluster: Cluster, sizes: Sizes) -> Run:
    sent = traffic.replies()
    used = cpu_by_pid(pids)
    pg = cpu_by_pid(postgres_pids(cluster))
    mine = cpu_seconds(os.getpid())
    mps = await closed_loop(traffic, sizes.ramp_s, sizes.window_s / sizes.slots)
    return Run(
        mps=mps,
        replies=traffic.replies() - sent,
        cpu_replicas_s=cpu_since(used, pids),
        cpu_postgres_s=cpu_since(pg, postgres_pids(cluster)),
        cpu_driver_s=cpu_seconds(os.getpid()) - mine,
    )


# -- the fake alone -------------------------------------------------------------------------
async def fake_delivery(updates: int) -> tuple[float, float]:
    """The fake's webhook delivery into a bare server that answers 200 at once: (updates
    per second, this process's CPU per update in ms; the fake and the server share it)."""
    received = 0

    async def hook(request: web.Request) -> web.Response:
        nonlocal received
        await request.read()
        received += 1
        return web.Response(text="")

    app = web.Application()
    app.router.add_post(HOOK_PATH, hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with FakeTelegram() as telegram, aiohttp.ClientSession() as session:
            method = f"{telegram.api_base_url}{telegram.token}/setWebhook"
            hook_url = f"http://127.0.0.1:{port}{HOOK_PATH}"
            async with session.post(method, json={"url": hook_url}) as response:
                assert response.status == 200, await response.text()
            mine = cpu_seconds(os.getpid())
            start = time.perf_counter()
            for i in range(updates):
                telegram.push_message(LOOP_CHAT_BASE, f"update {i}", user_id=USER)
            await telegram.wait_until(lambda: received >= updates, timeout=120)
            took = time.perf_counter() - start
            return updates / took, (cpu_seconds(os.getpid()) - mine) * 1000 / updates
    finally:
        await runner.cleanup()


# -- report ---------------------------------------------------------------------------------
def report(name: str, figs: list[Figures], sizes: Sizes) -> None:
    """One platform's table: a row per model and replica count."""
    base = {label: statistics.fmean(r.mps for r in runs) for label, runs in figs[0].runs.items()}
    timed = any(r.post_s for fig in figs for runs in fig.runs.values() for r in runs)
    rows: list[tuple[str, ...]] = []
    models = (("zero", "zero"), ("delay", f"{sizes.delay_s * 1000:g} ms"))
    for label, model in models:
        for fig in figs:
            runs = fig.runs[label]
            mps = statistics.fmean(r.mps for r in runs)
            replies = max(1, sum(r.replies for r in runs))
            row = [
                model,
                str(fig.replicas),
                f"{mps:.1f}",
                f"{mps / base[label]:.2f}x",
                *(
                    f"{sum(cpu) * 1000 / replies:.1f}"
                    for cpu in (
                        [r.cpu_replicas_s for r in runs],
                        [r.cpu_postgres_s for r in runs],
                        [r.cpu_driver_s for r in runs],
                    )
                ),
            ]
            if timed:
                posts = sorted(t for r in runs for t in r.post_s)
                mean = statistics.fmean(posts) if posts else float("nan")
                row += [
                    f"{1000 * statistics.median(posts):.1f}" if posts else "-",
                    f"{1 / mean:.0f}" if posts else "-",
                ]
            row.append(" | ".join("/".join(map(str, s)) for s in fig.spread))
            rows.append(tuple(row))
    header = [
        "model",
        "replicas",
        "replies/s",
        "vs 1",
        "CPU/reply ms: replicas",
        "postgres",
        "fakes+driver",
    ]
    if timed:
        header += ["POST p50 ms", "1/mean POST /s"]
    header.append("sessions per replica")
    print(f"\n{name}: {sizes.chats} chats in a closed loop")
    table(tuple(header), rows)


def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for i, row in enumerate((header, *rows)):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def parse(argv: list[str] | None) -> Sizes:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about 2 minutes)")
    parser.add_argument("--chats", type=int, default=None, help="chats per replica count")
    parser.add_argument("--ramp", type=float, default=None, help="throughput ramp-up, s")
    parser.add_argument(
        "--window", type=float, default=None, help="throughput window, s, shared by the slots"
    )
    parser.add_argument("--slots", type=int, default=None, help="turns each set takes")
    parser.add_argument("--delay", type=float, default=0.05, help="model delay, s")
    args = parser.parse_args(argv)
    quick = args.quick
    return Sizes(
        chats=args.chats if args.chats is not None else (24 if quick else 50),
        ramp_s=args.ramp if args.ramp is not None else 1.0,
        window_s=args.window if args.window is not None else (3.0 if quick else 12.0),
        delay_s=args.delay,
        slots=args.slots if args.slots is not None else (1 if quick else 4),
        fake_updates=1000 if quick else 3000,
    )


async def run_sets(sizes: Sizes, figs: dict[int, dict[str, Figures]], log: list[str]) -> None:
    """The replicas on one PostgreSQL server, each platform and model measured in turns."""
    groups = [Group.of(n, sizes.chats) for n in COUNTS]
    cluster = Cluster()
    cluster.start(durable=True)
    try:
        with tempfile.TemporaryDirectory(prefix="geodebot-replicas-bench-") as tmp_name:
            tmp = Path(tmp_name)
            async with FakeLLMServer(record=False) as llm, contextlib.AsyncExitStack() as stack:
                llm.default = Reply(ANSWER)
                replicas: Replicas | None = None

                async def start() -> None:
                    nonlocal replicas
                    replicas = await start_replicas(cluster, tmp, llm, groups, stack)
                    await warm_up(replicas, groups)

                await step(f"start {max(COUNTS)} replicas, warm up", start)
                assert replicas is not None
                models: list[tuple[str, Item]] = [
                    ("zero", Reply(ANSWER)),
                    ("delay", Delay(sizes.delay_s, Reply(ANSWER))),
                ]
                for name, (model, answer) in itertools.product(PLATFORMS, models):
                    llm.default = answer

                    async def run(name: str = name, model: str = model) -> None:
                        assert replicas is not None
                        await measure(replicas, groups, name, model, cluster, sizes, figs)

                    await step(f"{name}, model {model}, {sizes.slots} slot(s) per count", run)
                llm.default = Reply(ANSWER)
                for n in COUNTS:
                    figs[n][TELEGRAM].spread.append(spread(replicas.url, f"te{n}-"))
                    figs[n][SLACK].spread.append(spread(replicas.url, f"sl{n}-"))
                await stack.aclose()
                log.extend(line for d in replicas.daemons for line in d.log)
    finally:
        cluster.stop()


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


async def amain(sizes: Sizes) -> int:
    started = time.perf_counter()
    figs = {n: {name: Figures(n) for name in PLATFORMS} for n in COUNTS}
    log: list[str] = []
    load_before = load_average()
    await run_sets(sizes, figs, log)
    load_after = load_average()
    fake = (0.0, 0.0)

    async def alone() -> None:
        nonlocal fake
        fake = await fake_delivery(sizes.fake_updates)

    await step(f"the fake's webhook delivery alone, {sizes.fake_updates} updates", alone)
    for name in PLATFORMS:
        report(name, [figs[n][name] for n in COUNTS], sizes)
    print(
        f"\nthe fake Bot API's webhook delivery alone (one POST at a time, as the fake "
        f"balancer sends them, into a server answering 200 at once): {fake[0]:.0f} updates/s, "
        f"{fake[1]:.2f} ms CPU per update in this process"
    )
    print(
        f"\n{os.cpu_count()} CPUs on this machine, shared by every replica, PostgreSQL (durable "
        "defaults, loopback) and this process (the fakes and the driver), and by whatever "
        f"else runs (load average {load_before} before the sets, {load_after} after): more "
        "replicas add processes, not cores. With a zero-latency model the rows show what "
        "coordination costs rather than what more machines would add; with a model delay the "
        f"replicas' turns overlap (at most {CAP} at once in each). All {max(COUNTS)} replicas "
        "run throughout: for 1 or 2, the balancers send to the first 1 or 2 only, the others "
        "idle (all of them counted in the CPU). Telegram: the fake POSTs one update at a "
        "time (the real Bot API opens up to 40 connections), so replies/s cannot pass 1 / the "
        "mean POST time "
        "(until the replica answered 200: its inbox row committed)."
    )
    problems = [line for line in log if "Traceback" in line or '"level": "error"' in line]
    if problems:
        print(f"\nthe replicas logged {len(problems)} error line(s); first: {problems[0]}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    sizes = parse(argv)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {platform.system()} {platform.release()}"
    )
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"sizes: {sizes.chats} chats per replica count, throughput window {sizes.window_s:g} s "
        f"({sizes.slots} slot(s), each after {sizes.ramp_s:g} s of ramp), model delay "
        f"{sizes.delay_s * 1000:g} ms, cap {CAP} turns at once per replica"
    )
    return asyncio.run(amain(sizes))


if __name__ == "__main__":
    raise SystemExit(main())
