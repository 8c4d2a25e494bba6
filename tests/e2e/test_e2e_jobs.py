"""Scheduled jobs end to end: ``geodebot serve`` as a real process, python-telegram-bot against
the fake Bot API, the anthropic SDK against the fake model server, the CLI against the store."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from geodebot.config.schema import DB_FILE
from geodebot.store.records import FireRecord
from geodebot.store.sqlite import SQLiteStore
from tests.support.cli import geodebot
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.waiting import fires_when

GROUP, ALICE = -1001, 4242


@dataclass
class JobWorld:
    telegram: FakeTelegram
    llm: FakeLLMServer
    tmp: Path
    env: dict[str, str]

    def config(self, jobs: str) -> Path:
        path = self.tmp / "config.toml"
        path.write_text(
            f'[daemon]\nstate_dir = "{self.tmp / "var"}"\n'
            f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{self.llm.url}"\n'
            f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            '[tools]\nipc_tools = ["get_time"]\n'
            f'[channels.telegram]\ntoken_env = "E2E_TELEGRAM_TOKEN"\n'
            f'api_base_url = "{self.telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{GROUP}"\nsession = "ops"\n'
            f'allowed_users = ["{ALICE}"]\n' + jobs
        )
        return path

    async def history(self, job_id: str) -> list[FireRecord]:
        async with SQLiteStore(self.tmp / "var" / DB_FILE) as store:
            return list(reversed(await store.fire_history(job_id)))

    async def wait_history(
        self, job_id: str, predicate: Callable[[list[FireRecord]], bool]
    ) -> list[FireRecord]:
        # The daemon's outcome is visible only in its store, which this process reads.
        return await fires_when(self.tmp / "var" / DB_FILE, job_id, predicate)


@pytest.fixture
async def jobs_world(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[JobWorld]:
    async with FakeTelegram() as telegram:
        env = dict(os.environ, E2E_TELEGRAM_TOKEN=telegram.token)
        env[TEST_KEY_ENV] = TEST_KEY
        yield JobWorld(telegram, llm_server, tmp_path, env)


def job_table(job_id: str, schedule: str, extra: str = "") -> str:
    return f'[[jobs]]\nid = "{job_id}"\n{schedule}\nprompt = "Report."\ndeliver_to = "ops"\n{extra}'


async def test_job_result_arrives_in_the_bound_chat_status_shows_it_cli_reaches_it(
    jobs_world: JobWorld,
) -> None:
    jobs_world.llm.default = Reply("Nightly report: **all green**")
    config = jobs_world.config(job_table("report", 'every = "1s"'))
    daemon = await DaemonProcess(config, jobs_world.env).start()
    try:
        sent = await jobs_world.telegram.wait_for_sent(GROUP, 1, timeout=20)
        rows = await jobs_world.wait_history("report", lambda r: any(f.outcome == "ok" for f in r))
        # A job added and fired with the CLI reaches the running daemon without a restart.
        code, _, err = await geodebot(
            "jobs", "add", "adhoc", "--every", "1h", "--prompt", "Go.", "--deliver-to", "ops",
            "--config", str(config),
        )  # fmt: skip
        assert code == 0, err
        code, _, err = await geodebot("jobs", "run", "adhoc", "--config", str(config))
        assert code == 0, err
        adhoc = await jobs_world.wait_history("adhoc", lambda r: any(f.final for f in r))
        jobs_world.telegram.push_message(GROUP, "/status", user_id=ALICE)
        await jobs_world.telegram.wait_for_sent(
            GROUP, len(jobs_world.telegram.sent[GROUP]) + 1, timeout=20
        )
    finally:
        assert await daemon.stop() == 0
    assert [(f.cause, f.outcome) for f in adhoc] == [("manual", "ok")]
    assert "Nightly report: <b>all green</b>" in sent[0].text
    assert sent[0].reply_to_message_id is None
    assert rows[0].outcome in ("ok", "delivering")
    status = next(m.text for m in jobs_world.telegram.sent[GROUP] if "Jobs posting here" in m.text)
    assert "report: next " in status
    assert "adhoc: next " in status
    assert "last manual" not in status
    assert "last " in status
    assert "Traceback" not in daemon.text()
    assert jobs_world.telegram.token not in daemon.text()


async def test_restart_across_a_fire_catches_up_once_with_latest(jobs_world: JobWorld) -> None:
    jobs_world.llm.default = Reply("done")
    config = jobs_world.config(job_table("tick", 'every = "1s"', 'catch_up = "latest"\n'))
    daemon = await DaemonProcess(config, jobs_world.env).start()
    try:
        await jobs_world.wait_history("tick", lambda r: any(f.outcome == "ok" for f in r))
    finally:
        assert await daemon.stop() == 0
    stopped_at = time.time()
    # Down across at least two fire times whatever the second start-up takes (it can take
    # less than a second): two of them fall within this wait alone.
    await asyncio.sleep(2.1)
    daemon = await DaemonProcess(config, jobs_world.env).start()
    try:
        rows = await jobs_world.wait_history(
            "tick", lambda r: any(f.cause == "catch-up" and f.outcome == "ok" for f in r)
        )
    finally:
        assert await daemon.stop() == 0
    catch_up = [f for f in rows if f.cause == "catch-up"]
    runs = [f for f in catch_up if f.outcome != "skipped-missed"]
    assert len(runs) == 1
    assert runs[0].scheduled_ms / 1000 > stopped_at
    # The earlier missed fires are said to be missed, in one row.
    missed = [f for f in catch_up if f.outcome == "skipped-missed"]
    assert len(missed) == 1
    assert "catch_up = latest runs only the newest" in missed[0].reason
    assert missed[0].scheduled_ms < runs[0].scheduled_ms
