"""`geodebot check` against the fakes: every platform's identity call, the model lookup, an MCP
server, secrets present or not; a table, exit 1 on any problem, and no secret printed."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.fakes.discord_server import FakeDiscord
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Fakes:
    telegram: FakeTelegram
    slack: FakeSlack
    discord: FakeDiscord
    llm: FakeLLMServer

    def env(self, **override: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.update(
            {
                TEST_KEY_ENV: TEST_KEY,
                "CHK_TELEGRAM": self.telegram.token,
                "CHK_SLACK_BOT": self.slack.bot_token,
                "CHK_SLACK_APP": self.slack.app_token,
                "CHK_DISCORD": self.discord.token,
            }
        )
        env.update(override)
        return {k: v for k, v in env.items() if v}

    def secrets(self) -> list[str]:
        return [
            TEST_KEY,
            self.telegram.token,
            self.slack.bot_token,
            self.slack.app_token,
            self.discord.token,
        ]


@pytest.fixture
async def fakes(llm_server: FakeLLMServer) -> AsyncIterator[Fakes]:
    async with FakeTelegram() as telegram, FakeSlack() as slack, FakeDiscord() as discord:
        yield Fakes(telegram, slack, discord, llm_server)


def write_config(tmp_path: Path, fakes: Fakes, *, mcp_command: str = "") -> Path:
    command = mcp_command or f"[{sys.executable!r}, '-m', 'tests.support.fakes.mcp_tools_server']"
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "var"}"\n'
        f'[model]\nprovider = "anthropic"\nname = "check-model"\nbase_url = "{fakes.llm.url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\n'
        f'[tools]\nworkspace = "{tmp_path / "ws"}"\nipc_tools = []\nheadless_tools = []\n'
        f'[channels.telegram]\ntoken_env = "CHK_TELEGRAM"\n'
        f'api_base_url = "{fakes.telegram.api_base_url}"\n'
        f'[channels.slack]\nbot_token_env = "CHK_SLACK_BOT"\napp_token_env = "CHK_SLACK_APP"\n'
        f'api_base_url = "{fakes.slack.api_base_url}"\n'
        f'[channels.discord]\ntoken_env = "CHK_DISCORD"\n'
        f'api_base_url = "{fakes.discord.api_base_url}"\n'
        f'gateway_url = "{fakes.discord.gateway_url}"\n'
        "[[mcp.servers]]\n"
        'name = "tools"\n'
        f"command = {command}\n"
        'env = ["PYTHONPATH"]\n'
        "[mcp.servers.tools.echo]\n"
        'safety = "read"\n'
        'effect = "none"\n'
    )
    return config


async def check(config: Path, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "geodebot",
        "check",
        "--config",
        str(config),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def row(table: str, what: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(what + " "))


async def test_everything_answers(tmp_path: Path, fakes: Fakes) -> None:
    code, out, err = await check(write_config(tmp_path, fakes), fakes.env())
    assert code == 0, out + err
    assert "FAIL" not in out
    assert "Fake check-model" in row(out, "model anthropic check-model")
    assert "@" in row(out, "telegram getMe")
    assert "geodebot in Fake Team" in row(out, "slack auth.test")
    assert "ok" in row(out, "discord users/@me")
    assert "1 declared tools offered" in row(out, "mcp tools")
    assert "present" in row(out, "secret CHK_SLACK_APP")
    assert fakes.slack.calls_to("auth.test")
    assert fakes.slack.open_sockets == 0  # the Socket Mode URL is not dialled
    assert fakes.llm.requests == []  # no tokens spent
    for secret in fakes.secrets():
        assert secret not in out + err


async def test_each_problem_is_a_failed_row_and_exit_1(tmp_path: Path, fakes: Fakes) -> None:
    fakes.llm.models = {"some-other-model"}
    config = write_config(tmp_path, fakes, mcp_command="['/nonexistent/mcp-server']")
    env = fakes.env(CHK_DISCORD="", CHK_TELEGRAM="123456:not-the-token")
    code, out, err = await check(config, env)
    assert code == 1, out + err
    assert "FAIL" in row(out, "secret CHK_DISCORD")
    assert "discord users/@me" not in out  # nothing to try without its token
    assert "FAIL" in row(out, "model anthropic check-model")
    assert "not_found" in row(out, "model anthropic check-model")
    assert "FAIL" in row(out, "telegram getMe")
    assert "FAIL" in row(out, "mcp tools")
    assert "ok" in row(out, "slack auth.test")
    for secret in [*fakes.secrets(), "123456:not-the-token"]:
        assert secret not in out + err
