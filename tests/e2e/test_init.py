"""`geodebot init` as a real process against the fakes: flags and the environment (``--yes``),
and a person at a terminal (a pseudo-terminal: prompts, secrets read without echo). What it
writes must pass `geodebot check`; a bad token writes nothing; nothing is overwritten unasked.
"""

from __future__ import annotations

import asyncio
import os
import pty
import select
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from geodebot.config.schema import load_config
from tests.support.config import TEST_KEY
from tests.support.fakes.discord_server import FakeDiscord
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram

ROOT = Path(__file__).resolve().parents[2]
SECRET_NAMES = (
    "ANTHROPIC_API_KEY",
    "TELEGRAM_BOT_TOKEN",
    "SLACK_BOT_TOKEN",
    "SLACK_APP_TOKEN",
    "DISCORD_BOT_TOKEN",
)


@dataclass
class Fakes:
    telegram: FakeTelegram
    slack: FakeSlack
    discord: FakeDiscord
    llm: FakeLLMServer

    def secrets(self) -> dict[str, str]:
        return {
            "ANTHROPIC_API_KEY": TEST_KEY,
            "TELEGRAM_BOT_TOKEN": self.telegram.token,
            "SLACK_BOT_TOKEN": self.slack.bot_token,
            "SLACK_APP_TOKEN": self.slack.app_token,
            "DISCORD_BOT_TOKEN": self.discord.token,
        }

    def env(self, **secrets: str) -> dict[str, str]:
        """The environment without any of the secrets init asks for, plus ``secrets``."""
        env = {k: v for k, v in os.environ.items() if k not in SECRET_NAMES}
        env.pop("GEODEBOT_CONFIG", None)
        env["PYTHONPATH"] = str(ROOT)
        return {**env, **secrets}

    def urls(self) -> list[str]:
        return [
            "--base-url",
            self.llm.url,
            "--telegram-api-url",
            self.telegram.api_base_url,
            "--slack-api-url",
            self.slack.api_base_url,
            "--discord-api-url",
            self.discord.api_base_url,
        ]


@pytest.fixture
async def fakes(llm_server: FakeLLMServer) -> AsyncIterator[Fakes]:
    async with FakeTelegram() as telegram, FakeSlack() as slack, FakeDiscord() as discord:
        yield Fakes(telegram, slack, discord, llm_server)


async def geodebot(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "geodebot",
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line)
    return {name: value for name, value in pairs}


async def test_flags_and_the_environment_make_a_config_that_check_accepts(
    tmp_path: Path, fakes: Fakes
) -> None:
    config, env_file = tmp_path / "geodebot.toml", tmp_path / "geodebot.env"
    code, out, err = await geodebot(
        fakes.env(**fakes.secrets()),
        "init", "--yes", "--config", str(config), "--provider", "anthropic",
        "--model", "init-model", "--telegram", "--slack", "--discord", *fakes.urls(),
        "--state-dir", str(tmp_path / "var"),
    )  # fmt: skip
    assert code == 0, out + err
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert read_env_file(env_file) == fakes.secrets()
    text = config.read_text()
    for secret in fakes.secrets().values():
        assert secret not in text
        assert secret not in out + err
    assert f"set -a && . {env_file} && set +a && make run CONFIG={config}" in out
    assert f"geodebot chat --config {config}" in out
    assert f"geodebot pairing approve PLATFORM CODE --config {config}" in out
    # Strangers who write to the bot get a pairing code; a pairing grants no tools.
    written = load_config(config)
    assert written.pairing.enabled
    assert written.pairing.tools == ()
    assert written.bindings == ()
    # Each part was checked live, without a token spent on the model.
    assert any(method.lower() == "getme" for method, _ in fakes.telegram.requests)
    assert fakes.slack.calls_to("auth.test")
    assert fakes.llm.requests == []
    # What it wrote serves: check passes with the env file's secrets and nothing else.
    code, table, err = await geodebot(
        fakes.env(**read_env_file(env_file)), "check", "--config", str(config)
    )
    assert code == 0, table + err
    for what in ("model anthropic init-model", "telegram getMe", "slack auth.test"):
        assert any(line.startswith(what) and " ok " in line for line in table.splitlines())


async def test_a_bad_token_names_its_platform_and_writes_nothing(
    tmp_path: Path, fakes: Fakes
) -> None:
    secrets = {**fakes.secrets(), "TELEGRAM_BOT_TOKEN": "123456:not-the-bots-token"}
    config = tmp_path / "geodebot.toml"
    code, out, err = await geodebot(
        fakes.env(**secrets),
        "init", "--yes", "--config", str(config), "--provider", "anthropic",
        "--model", "init-model", "--telegram", *fakes.urls(),
    )  # fmt: skip
    assert code == 1
    [line] = err.strip().splitlines()
    assert line.startswith("geodebot init: telegram getMe failed:"), line
    assert "check TELEGRAM_BOT_TOKEN" in line
    assert "Nothing was written" in line
    assert "not-the-bots-token" not in out + err
    assert list(tmp_path.iterdir()) == []


async def test_nothing_is_overwritten_without_force_and_a_missing_secret_is_named(
    tmp_path: Path, fakes: Fakes
) -> None:
    config = tmp_path / "geodebot.toml"
    config.write_text("# the operator's own\n")
    args = ["init", "--yes", "--config", str(config), "--provider", "anthropic",
            "--model", "init-model", "--no-check"]  # fmt: skip
    code, _, err = await geodebot(fakes.env(ANTHROPIC_API_KEY=TEST_KEY), *args)
    assert code == 1
    assert f"{config} exists; --force overwrites it" in err
    assert config.read_text() == "# the operator's own\n"
    # Still refused, before the missing Telegram token is looked for.
    code, _, err = await geodebot(fakes.env(ANTHROPIC_API_KEY=TEST_KEY), *args, "--telegram")
    assert code == 1
    assert f"{config} exists; --force overwrites it" in err
    assert "TELEGRAM_BOT_TOKEN" not in err
    code, _, err = await geodebot(fakes.env(), *args, "--force")
    assert code == 1
    assert "ANTHROPIC_API_KEY (the anthropic API key) is not set in the environment" in err
    assert config.read_text() == "# the operator's own\n"
    code, out, err = await geodebot(fakes.env(ANTHROPIC_API_KEY=TEST_KEY), *args, "--force")
    assert code == 0, out + err
    assert 'api_key_env = "ANTHROPIC_API_KEY"' in config.read_text()


class Terminal:
    """``geodebot init`` on a pseudo-terminal, driven as a person would: wait for a prompt,
    type an answer. Blocking, so it runs in a thread while the fakes serve."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes geodebot
            os.execve(sys.executable, [sys.executable, "-m", "geodebot", *argv], env)
        self.seen = b""

    def expect(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} on the terminal; it shows:\n{self.text()}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"ended before {text!r}:\n{self.text()}")
                self.seen += chunk

    def type(self, line: str) -> None:
        os.write(self.fd, line.encode() + b"\r")

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while select.select([self.fd], [], [], 0)[0]:
                    try:
                        chunk = os.read(self.fd, 4096)
                    except OSError:
                        break
                    if not chunk:
                        break
                    self.seen += chunk
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"init did not end:\n{self.text()}")

    def text(self) -> str:
        return self.seen.decode(errors="replace")


async def test_a_person_at_a_terminal_is_asked_and_secrets_are_not_echoed(
    tmp_path: Path, fakes: Fakes
) -> None:
    config = tmp_path / "geodebot.toml"
    argv = ["init", "--config", str(config), "--base-url", fakes.llm.url,
            "--telegram-api-url", fakes.telegram.api_base_url]  # fmt: skip
    secrets = fakes.secrets()

    def person() -> tuple[int, str]:
        term = Terminal(argv, fakes.env())
        term.expect("Model provider (anthropic, openai, openai-compatible) [anthropic]: ")
        term.type("")
        term.expect("Model [claude-sonnet-4-5]: ")
        term.type("init-model")
        term.expect("Use Telegram? (y/n) [y]: ")
        term.type("")
        term.expect("Use Slack? (y/n) [n]: ")
        term.type("")
        term.expect("Use Discord? (y/n) [n]: ")
        term.type("n")
        term.expect("ANTHROPIC_API_KEY, the anthropic API key: ")
        term.type(secrets["ANTHROPIC_API_KEY"])
        term.expect("TELEGRAM_BOT_TOKEN, the bot token from @BotFather: ")
        term.type(secrets["TELEGRAM_BOT_TOKEN"])
        return term.wait(), term.text()

    code, shown = await asyncio.to_thread(person)
    assert code == 0, shown
    assert "ok  telegram getMe" in shown
    assert f"Wrote {config}" in shown
    # Typed without echo: neither secret ever reached the screen.
    assert secrets["ANTHROPIC_API_KEY"] not in shown
    assert secrets["TELEGRAM_BOT_TOKEN"] not in shown
    written = read_env_file(tmp_path / "geodebot.env")
    assert written == {
        "ANTHROPIC_API_KEY": secrets["ANTHROPIC_API_KEY"],
        "TELEGRAM_BOT_TOKEN": secrets["TELEGRAM_BOT_TOKEN"],
    }
    assert "[channels.slack]" not in config.read_text()
