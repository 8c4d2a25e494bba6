"""Fixtures shared by every test directory; the helpers live in ``tests/support/``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.slack_server import FakeSlack
from tests.support.slack_world import Rig, TimedCalls, TimedLLM
from tests.support.telegram_world import TOKEN_ENV, StampedTelegram, TelegramWorld

# The headless browser's fixtures, ``browser`` and ``tab``; the stores' ``place`` and its
# PostgreSQL cluster.
pytest_plugins = ("tests.support.browser", "tests.support.postgres")


@pytest.fixture(autouse=True)
def _api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_KEY_ENV, TEST_KEY)
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)


@pytest.fixture
async def llm_server() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    """The Slack world of the end-to-end and fault tests (tests/support/slack_world.py)."""
    async with FakeSlack() as slack, TimedLLM() as llm:
        slack.calls = TimedCalls()
        rig = Rig(slack, llm, tmp_path)
        try:
            yield rig
        finally:
            # Before the fakes go away: a daemon a failed test left behind is killed.
            for daemon in rig.daemons:
                await daemon.kill()


@pytest.fixture
async def tg(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[TelegramWorld]:
    """The Telegram world of the fault and budget tests (tests/support/telegram_world.py)."""
    async with StampedTelegram() as telegram:
        env = dict(os.environ, **{TOKEN_ENV: telegram.token, TEST_KEY_ENV: TEST_KEY})
        env.pop("GEODEBOT_CONFIG", None)
        world = TelegramWorld(telegram, llm_server, tmp_path, env)
        try:
            yield world
        finally:  # a test that failed early leaves no daemon behind
            for daemon in world.daemons:
                await daemon.kill()
