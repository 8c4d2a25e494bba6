"""The channel factory's lean SDK imports, and the supervisor that starts the channels."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from geodebot.channels.base import Destination, Inbound, OutboundPart
from geodebot.channels.factory import ChannelSupervisor, _without
from geodebot.channels.telegram import TelegramChannel
from geodebot.config.schema import TelegramConfig
from tests.support.fakes.telegram_server import FakeTelegram


def test_without_hides_a_module_inside_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "geodebot_probe_extra.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "geodebot_probe_extra", raising=False)
    with _without(("geodebot_probe_extra",)), pytest.raises(ImportError):
        importlib.import_module("geodebot_probe_extra")
    assert "geodebot_probe_extra" not in sys.modules  # the marker is gone again
    module = importlib.import_module("geodebot_probe_extra")
    assert module.VALUE == 1
    # One already imported stays usable inside.
    with _without(("geodebot_probe_extra",)):
        assert importlib.import_module("geodebot_probe_extra") is module
    assert sys.modules["geodebot_probe_extra"] is module


def test_without_hides_submodules_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    package = tmp_path / "geodebot_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "inner.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with _without(("geodebot_probe_pkg",)), pytest.raises(ImportError):
        importlib.import_module("geodebot_probe_pkg.inner")
    assert importlib.import_module("geodebot_probe_pkg.inner").VALUE == 2


async def test_the_supervisor_retries_taking_in_until_it_succeeds() -> None:
    got: list[Inbound] = []

    async def sink(inbound: Inbound) -> None:
        got.append(inbound)

    async with FakeTelegram() as fake:
        config = TelegramConfig(api_base_url=fake.api_base_url, poll_timeout_s=2)
        channel = TelegramChannel(config, fake.token, ingest_later=True)
        async with ChannelSupervisor({"telegram": channel}, sink) as supervisor:
            await supervisor.start(first_attempt_s=10)
            assert supervisor.ready["telegram"].is_set()
            assert not channel.ingesting
            fake.fail_next("deleteWebhook", 502, "Bad Gateway")
            await supervisor.start_ingest(first_attempt_s=10)
            assert supervisor.ingesting["telegram"].is_set()
            assert channel.ingesting
            # Only the taking in was tried again: the channel was not started anew.
            assert (fake.count("deleteWebhook"), fake.count("getMe")) == (2, 1)
            update = fake.push_message(-1001, "hello", user_id=42)
            await fake.wait_until(lambda: [i.event_id for i in got] == [str(update)])
            destination = Destination("telegram", "-1001")
            await channel.send(OutboundPart(destination, "still sends", key="k-0"))
            await fake.wait_for_sent(-1001, 1)
        assert not channel.ingesting
