"""Fixtures shared by every test directory; the helpers live in ``tests/support/``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.slack_server import FakeSlack
from tests.support.slack_world import Rig, TimedCalls, TimedLLM


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
