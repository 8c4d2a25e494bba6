"""Fixtures of the fault suite: a Telegram daemon world, and the Slack one of the e2e tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import TEST_KEY, TEST_KEY_ENV
from tests.fakes.llm_server import FakeLLMServer
from tests.faults.telegram_world import TOKEN_ENV, StampedTelegram, TelegramWorld

# The Slack world of the end-to-end tests, shared rather than copied.
from tests.test_e2e_slack import rig  # noqa: F401


@pytest.fixture
async def tg(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[TelegramWorld]:
    async with StampedTelegram() as telegram:
        env = dict(os.environ, **{TOKEN_ENV: telegram.token, TEST_KEY_ENV: TEST_KEY})
        env.pop("GEODEBOT_CONFIG", None)
        world = TelegramWorld(telegram, llm_server, tmp_path, env)
        try:
            yield world
        finally:  # a test that failed early leaves no daemon behind
            for daemon in world.daemons:
                await daemon.kill()
