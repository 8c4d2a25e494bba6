"""Several ``geodebot serve`` replicas on one PostgreSQL database, all serving: each runs the
turns of the sessions it holds (replicas/leases.py), and the leader, which holds the daemon's
lease, also polls Telegram. When a replica is killed or paused, the others take over its
sessions and the leadership and answer what it left, once; a paused one that comes back
commits and sends nothing.

Real processes, python-telegram-bot against the fake Bot API (one token: only the leader
polls it), slack-bolt against the fake Slack, which spreads events over every open Socket
Mode connection as Slack does, the anthropic SDK against the fake model. The leases live
3 s, the shortest the config allows, so a takeover comes within a few seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psycopg
import pytest
import pytest_asyncio

from geodebot.replicas.daemon_lease import LEAD_MARK
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import READY_MARK, DaemonProcess
from tests.support.fakes.llm_server import Delay, FakeLLMServer, Reply
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.ports import free_port
from tests.support.postgres import Cluster, inbox_by_pickup

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT, ALICE = -2001, 4242
SLACK_CHANNEL, SLACK_USER = "C0REPLICAS", "U0ALICE01"
SLACK_TS = itertools.count(1)
TTL_S = 3
# A takeover: the lease's time to live, a member's next look, and the new leader's start.
TAKEOVER_S = TTL_S + 30
Peer = tuple[str, str, bool]  # id, role, silent


@dataclass
class World:
    telegram: FakeTelegram
    slack: FakeSlack
    llm: FakeLLMServer
    url: str
    tmp: Path
    env: dict[str, str]
    daemons: dict[str, DaemonProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def http(self, replica: str) -> str:
        return f"127.0.0.1:{self.ports.setdefault(replica, free_port())}"

    async def get(self, replica: str, path: str) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://{self.http(replica)}{path}") as response,
        ):
            return response.status, await response.text()

    def config(self, replica: str) -> Path:
        path = self.tmp / f"{replica}.toml"
        path.write_text(
            f'[daemon]\nstate_dir = "{self.tmp / replica}"\nreplica_id = "{replica}"\n'
            f'shutdown_grace_s = 2\nhttp = "{self.http(replica)}"\n'
            f'[store]\nurl = "{self.url}"\nlease_ttl_s = {TTL_S}\n'
            f'[model]\nprovider = "anthropic"\nname = "replica-model"\n'
            f'base_url = "{self.llm.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            '[channels.telegram]\ntoken_env = "E2E_TELEGRAM_TOKEN"\n'
            f'api_base_url = "{self.telegram.api_base_url}"\npoll_timeout_s = 1\n'
            '[channels.slack]\nbot_token_env = "E2E_SLACK_BOT"\napp_token_env = "E2E_SLACK_APP"\n'
            f'api_base_url = "{self.slack.api_base_url}"\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{CHAT}"\nsession = "staff"\n'
            f'allowed_users = ["{ALICE}"]\n'
            f'[[bindings]]\nplatform = "slack"\nchannel = "{SLACK_CHANNEL}"\nsession = "ops"\n'
            f'allowed_users = ["{SLACK_USER}"]\nstream = false\n'
        )
        return path

    async def start(self, replica: str) -> DaemonProcess:
        daemon = DaemonProcess(self.config(replica), self.env)
        self.daemons[replica] = daemon
        return await daemon.start(mark=READY_MARK)

    def texts(self) -> list[str]:
        return [m.text for m in self.telegram.sent[CHAT]]

    async def peers(self, replica: str, until: Callable[[list[Peer]], bool]) -> list[Peer]:
        """The other replicas as ``replica``'s /healthz lists them (id, role, silent), once
        ``until`` holds: each says it is there every quarter of the lease's time to live."""
        async with asyncio.timeout(TAKEOVER_S):
            while True:
                status, body = await self.get(replica, "/healthz")
                assert status == 200, body
                listed = json.loads(body)["components"]["replica"]["peers"]
                peers = [(p["id"], p["role"], p["silent"]) for p in listed]
                if until(peers):
                    return peers
                await asyncio.sleep(0.2)

    async def slack_message(self, text: str) -> str:
        """A user's message in the bound Slack channel, once a replica acknowledged it;
        its ts (what the reply's thread is)."""
        ts = f"{1_800_000_000 + next(SLACK_TS)}.000100"
        event = FakeSlack.message_event(SLACK_CHANNEL, SLACK_USER, text, ts=ts)
        envelope = await self.slack.push_event(event)
        await self.slack.wait_for_ack(envelope, timeout=30)
        return ts

    async def slack_replies(self, asked: list[str]) -> None:
        """Until each message in ``asked`` has its one reply in its thread; then a moment
        more, in which no second one may come."""

        def threads() -> list[str | None]:
            return [p.thread_ts for p in self.slack.posted[SLACK_CHANNEL]]

        await self.slack.wait_until(lambda: set(asked) <= set(threads()), TAKEOVER_S)
        await asyncio.sleep(1)
        assert sorted(t for t in threads() if t in asked) == sorted(asked)
        assert len(threads()) == len(asked), threads()

    def slack_rows(self) -> dict[tuple[str | None, str], int]:
        return inbox_by_pickup(self.url, "slack")

    def holder(self, lease: str = "daemon") -> tuple[str, int]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT holder, epoch FROM leases WHERE name = %s", (lease,)
            ).fetchone()
        assert row is not None
        return row[0], row[1]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(
    tmp_path_factory: pytest.TempPathFactory, postgres_cluster: Cluster
) -> AsyncIterator[World]:
    tmp = tmp_path_factory.mktemp("replicas")
    # Slack redelivers what no connection acknowledged, as the real one does.
    slack = FakeSlack(spread=True, redeliver_after_s=5.0, max_redeliveries=30)
    async with FakeTelegram() as telegram, slack, FakeLLMServer() as llm:
        llm.default = Reply("answered")
        env = dict(os.environ, E2E_TELEGRAM_TOKEN=telegram.token)
        env.update(E2E_SLACK_BOT=slack.bot_token, E2E_SLACK_APP=slack.app_token)
        env[TEST_KEY_ENV] = TEST_KEY
        env.pop("GEODEBOT_CONFIG", None)
        url = postgres_cluster.new_database(migrated=True)
        world = World(telegram, slack, llm, url, tmp, env)
        try:
            yield world
        finally:
            for daemon in world.daemons.values():
                if daemon.proc is not None and daemon.proc.returncode is None:
                    daemon.proc.send_signal(signal.SIGCONT)
                await daemon.kill()


async def test_every_replica_serves_and_a_killed_ones_work_is_taken_over(world: World) -> None:
    await world.start("alpha")
    beta = await world.start("beta")
    assert world.holder() == ("alpha", 1)
    assert await world.peers("alpha", lambda peers: bool(peers)) == [("beta", "member", False)]
    world.telegram.push_message(CHAT, "first", user_id=ALICE)
    await world.telegram.wait_for_sent(CHAT, 1, timeout=30)
    # The leader polls Telegram; the chat's session goes to its home replica, alpha, whoever
    # alpha knows of by then: "staff" ranks alpha first, then beta, then gamma (home() in
    # replicas/leases.py), so the turns below run where this test kills or pauses.
    first, _ = world.holder("session:staff")
    assert first == "alpha"
    # The leader is killed while the model works on the next message.
    world.llm.script(Delay(30, Reply("lost with alpha")))
    asked = len(world.llm.requests)
    world.telegram.push_message(CHAT, "second", user_id=ALICE)
    await world.llm.wait_for_requests(asked + 1)
    await world.daemons["alpha"].kill()
    await beta.wait_for_line(LEAD_MARK, timeout_s=TAKEOVER_S)
    await world.telegram.wait_for_sent(CHAT, 2, timeout=TAKEOVER_S)
    assert world.texts() == ["answered", "answered"]
    assert world.holder() == ("beta", 2)
    # Taken over from alpha.
    assert world.holder("session:staff") == ("beta", 2)
    status, body = await world.get("beta", "/healthz")
    assert status == 200
    replica = json.loads(body)["components"]["replica"]
    lease = replica["lease"]
    assert (lease["holder"], lease["epoch"], lease["leading"]) == ("beta", 2, True)
    assert replica["sessions"]["held"] == 1
    _, metrics = await world.get("beta", "/metrics")
    assert "geodebot_replica_leading 1.0" in metrics
    assert "geodebot_lease_takeovers_total 1.0" in metrics
    # The killed replica could not say it was going: it is listed, as silent, and beta
    # says it leads now.
    assert await world.peers("beta", lambda peers: all(silent for *_, silent in peers)) == [
        ("alpha", "leader", True)
    ]
    # Nothing more comes: the killed replica's turn is answered once, by beta.
    await asyncio.sleep(1)
    assert len(world.texts()) == 2


async def test_a_paused_replica_that_lost_its_leases_commits_and_sends_nothing(
    world: World,
) -> None:
    beta = world.daemons["beta"]
    gamma = await world.start("gamma")
    _, epoch = world.holder("session:staff")
    # beta is paused mid-turn: its model call answers while it is stopped.
    world.llm.script(Delay(TTL_S * 2, Reply("from the paused replica")))
    asked = len(world.llm.requests)
    world.telegram.push_message(CHAT, "third", user_id=ALICE)
    await world.llm.wait_for_requests(asked + 1)
    assert beta.proc is not None
    beta.proc.send_signal(signal.SIGSTOP)
    await gamma.wait_for_line(LEAD_MARK, timeout_s=TAKEOVER_S)
    await world.telegram.wait_for_sent(CHAT, 3, timeout=TAKEOVER_S)
    assert world.holder() == ("gamma", 3)
    assert world.holder("session:staff") == ("gamma", epoch + 1)
    beta.proc.send_signal(signal.SIGCONT)
    # Back, beta finds its lease gone and stops, with a non-zero exit for systemd.
    try:
        async with asyncio.timeout(30):
            code = await beta.proc.wait()
    except TimeoutError:
        # Its log without the Telegram poller's lines, which a resumed poller repeats.
        lines = [line for line in beta.log if "geodebot.channels.telegram" not in line]
        raise AssertionError(
            "beta still runs after its SIGCONT:\n" + "\n".join(lines[-60:])
        ) from None
    assert code == 1
    assert "lost lease 'daemon'" in beta.text()
    assert "Traceback" not in beta.text()
    assert "never retrieved" not in beta.text()
    assert world.texts() == ["answered"] * 3
    assert "from the paused replica" not in world.texts()
    with psycopg.connect(world.url, autocommit=True) as conn:
        rows = conn.execute("SELECT status, COUNT(*) FROM inbox GROUP BY status").fetchall()
    assert rows == [("done", 3)]
    # Beta removed itself as it stopped; alpha, killed before, is still listed as silent.
    assert await world.peers("gamma", lambda peers: len(peers) == 1) == [("alpha", "leader", True)]
    assert await world.daemons["gamma"].stop() == 0
    with psycopg.connect(world.url, autocommit=True) as conn:
        left = conn.execute("SELECT replica_id FROM replicas ORDER BY replica_id").fetchall()
    assert left == [("alpha",)]


async def test_slack_events_spread_over_replicas_are_answered_once_by_the_sessions_holder(
    world: World,
) -> None:
    delta = await world.start("delta")
    epsilon = await world.start("epsilon")
    await epsilon.wait_for_line("slack: connected", timeout_s=30)
    await world.slack.wait_until(lambda: world.slack.open_sockets == 2, 30)
    asked = [await world.slack_message(f"spread {n}") for n in range(6)]
    await world.slack_replies(asked)
    # The events went to both connections in turn: each replica committed its share, and
    # the one holding the session answered them all.
    assert world.slack_rows() == {("delta", "done"): 3, ("epsilon", "done"): 3}
    # The member runs the scheduler too: each fire's claim decides which replica runs it.
    leader, _ = world.holder()
    member = "epsilon" if leader == "delta" else "delta"
    status, body = await world.get(member, "/healthz")
    assert json.loads(body)["components"]["scheduler"] == {"ok": True, "jobs": 0}
    assert status == 200
    holder, _ = world.holder("session:ops")
    survivor = epsilon if holder == "delta" else delta
    # The session's holder dies; its lease expires and the other replica, whose connection
    # is the only one left and takes every event in, takes the session over.
    await world.daemons[holder].kill()
    await world.slack.wait_until(lambda: world.slack.open_sockets == 1, 30)
    late = [await world.slack_message(f"after the holder died {n}") for n in range(2)]
    await world.slack_replies(asked + late)
    rows = world.slack_rows()
    assert sum(rows.values()) == 8
    assert {status for _, status in rows} == {"done"}
    assert world.holder("session:ops")[0] != holder
    assert await survivor.stop() == 0
