"""Reloading the config without a restart: ``geodebot serve`` on the fake Bot API, sent
SIGHUP after its config file was changed.

A new binding is answered at once, a binding taken out is no longer answered, and
``geodebot status`` shows the new file's hash; a file that does not validate is refused
whole, the old config stays in force, and the log says which key is wrong; what only a
restart changes is named in the log and keeps its old value."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, answer_controls, asks_control, until_answered
from tests.support.daemon import DaemonProcess, geodebot_status
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.waiting import until

FIRST, SECOND = -1001, -1002
ALICE = 4242


def binding(chat: int, session: str) -> str:
    return (
        f'[[bindings]]\nplatform = "telegram"\nchannel = "{chat}"\nsession = "{session}"\n'
        f'allowed_users = ["{ALICE}"]\n'
    )


@dataclass
class World:
    telegram: FakeTelegram
    llm: FakeLLMServer
    config: Path
    head: str
    env: dict[str, str]

    def write(self, *tables: str, poll_timeout_s: int = 1) -> str:
        """The config with ``tables`` after the fixed part; its sha256."""
        text = self.head.replace("poll_timeout_s = 1", f"poll_timeout_s = {poll_timeout_s}")
        text += "".join(tables)
        self.config.write_text(text)
        return hashlib.sha256(text.encode()).hexdigest()

    def texts(self, chat: int) -> list[str]:
        return [m.text for m in self.telegram.sent[chat]]

    async def control(self, chat: int = FIRST) -> list[str]:
        answer_controls(self.llm)
        self.telegram.push_message(chat, CONTROL, user_id=ALICE)
        return await until_answered(lambda: self.texts(chat))


async def reloaded(daemon: DaemonProcess, text: str) -> None:
    """SIGHUP, then until the log has one more line with ``text``."""
    before = sum(text in line for line in daemon.log)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    await until(lambda: sum(text in line for line in daemon.log) > before, f"{text!r} logged")


async def status(config: Path) -> dict[str, object]:
    code, out, err = await geodebot_status(config, "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert isinstance(answer, dict)
    return answer


@pytest.fixture
async def world(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[World]:
    async with FakeTelegram() as telegram:
        head = (
            f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nuser_rate_per_min = 0\n'
            f'[model]\nprovider = "anthropic"\nname = "e2e-model"\n'
            f'base_url = "{llm_server.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            f'[channels.telegram]\ntoken_env = "E2E_TELEGRAM_TOKEN"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
        )
        env = dict(os.environ, E2E_TELEGRAM_TOKEN=telegram.token)
        env[TEST_KEY_ENV] = TEST_KEY
        yield World(telegram, llm_server, tmp_path / "config.toml", head, env)


async def test_a_binding_added_by_a_reload_is_answered_and_one_taken_out_is_not(
    world: World,
) -> None:
    first_hash = world.write(binding(FIRST, "first"))
    daemon = await DaemonProcess(world.config, world.env).start()
    try:
        before = await status(world.config)
        assert before["config"] == {
            "path": str(world.config.resolve()),
            "sha256": first_hash,
            "loaded_at": before["config"]["loaded_at"],  # type: ignore[index]
        }
        world.telegram.push_message(SECOND, "anyone?", user_id=ALICE)
        await world.control()
        assert world.texts(SECOND) == []

        second_hash = world.write(binding(FIRST, "first"), binding(SECOND, "second"))
        await reloaded(daemon, "config reloaded")
        world.llm.script(Reply("second is bound now"))
        world.telegram.push_message(SECOND, "and now?", user_id=ALICE)
        await world.telegram.wait_for_sent(SECOND, 1, timeout=20)
        assert world.texts(SECOND) == ["second is bound now"]
        after = await status(world.config)
        assert after["config"]["sha256"] == second_hash  # type: ignore[index]
        assert after["config"]["loaded_at"] > before["config"]["loaded_at"]  # type: ignore[index]
        assert after["bindings"] == {"config": 2, "stored": 0, "shadowed": 0}

        # Taken out again, with a change only a restart applies: named, and not applied.
        world.write(binding(FIRST, "first"), poll_timeout_s=2)
        await reloaded(daemon, "config reloaded")
        assert "channels.telegram.poll_timeout_s changed; it takes effect after a restart" in (
            daemon.text()
        )
        world.telegram.push_message(SECOND, "still there?", user_id=ALICE)
        await world.control()
        assert world.texts(SECOND) == ["second is bound now"]
    finally:
        assert await daemon.stop() == 0
    asked = [r for r in world.llm.requests if not asks_control(r)]
    assert len(asked) == 1
    assert "Traceback" not in daemon.text()


async def test_a_config_that_does_not_validate_is_refused_whole_and_the_old_one_stays(
    world: World,
) -> None:
    first_hash = world.write(binding(FIRST, "first"))
    daemon = await DaemonProcess(world.config, world.env).start()
    try:
        # A new binding beside a wrong key: neither is applied.
        world.write(
            binding(FIRST, "first"), binding(SECOND, "second"), "[pairing]\nenabld = true\n"
        )
        await reloaded(daemon, "config reload refused")
        assert "config reload refused, the config in force stays: pairing.enabld: unknown key" in (
            daemon.text()
        )
        # Not TOML at all: refused too.
        world.config.write_text(world.head + "[[bindings]\n")
        await reloaded(daemon, "config reload refused")
        assert "invalid TOML" in daemon.text()
        world.telegram.push_message(SECOND, "anyone?", user_id=ALICE)
        answered = await world.control()
        assert answered[-1].startswith("control answer")
        assert world.texts(SECOND) == []
        # (status reads the file for the socket's place: the first file again, not reloaded)
        assert world.write(binding(FIRST, "first")) == first_hash
        after = await status(world.config)
        assert after["config"]["sha256"] == first_hash  # type: ignore[index]
    finally:
        assert await daemon.stop() == 0
    assert "Traceback" not in daemon.text()
