"""Fixtures of the fault suite: a Telegram daemon world. The Slack one, ``rig``, is shared with
the end-to-end tests (tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.telegram_world import TOKEN_ENV, StampedTelegram, TelegramWorld


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
