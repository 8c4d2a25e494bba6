"""/healthz and /metrics of `geodebot serve`: per-component health, Prometheus counters that
follow real traffic, a bearer token when configured, and loopback unless allowed."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from geodebot.config.schema import ConfigError, parse_config
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess, geodebot_status
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.ports import free_port

GROUP, UNBOUND, ALICE = -1001, -1999, 4242
TOKEN = "health-bearer-token-0123456789"


@pytest.mark.parametrize(
    ("daemon", "problem"),
    [
        ({"http": "0.0.0.0:8787"}, "daemon.http: 0.0.0.0 is not a loopback address"),
        ({"http": "10.1.2.3:80", "allow_remote": True}, "daemon.http_token_env is required"),
        ({"http": "8787"}, "is not host:port"),
        ({"http": "127.0.0.1:99999"}, "is not host:port"),
    ],
)
def test_an_exposed_or_malformed_address_is_a_config_error(
    daemon: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"daemon": daemon})
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_loopback_and_allowed_remote_addresses_are_accepted() -> None:
    assert parse_config({"daemon": {"http": "[::1]:8787"}}).daemon.http == "[::1]:8787"
    remote = {"http": "0.0.0.0:9100", "allow_remote": True, "http_token_env": "T"}
    assert parse_config({"daemon": remote}).daemon.allow_remote


@dataclass
class Served:
    daemon: DaemonProcess
    telegram: FakeTelegram
    llm: FakeLLMServer
    base: str
    session: aiohttp.ClientSession
    config: Path

    async def get(self, path: str, token: str | None = TOKEN) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.get(self.base + path, headers=headers) as response:
            return response.status, await response.text()

    async def health(self) -> tuple[int, dict[str, Any]]:
        async with self.session.get(
            self.base + "/healthz", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as response:
            body: dict[str, Any] = await response.json()
            return response.status, body

    async def until_health(self, status: int, timeout: float = 15.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                code, body = await self.health()
                if code == status:
                    return body
                await asyncio.sleep(0.05)


@pytest.fixture
async def served(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[Served]:
    port = free_port()
    async with FakeTelegram() as telegram, aiohttp.ClientSession() as session:
        config = tmp_path / "config.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nhttp = "127.0.0.1:{port}"\n'
            'http_token_env = "HEALTH_TOKEN"\n'
            f'[model]\nprovider = "anthropic"\nname = "health-model"\n'
            f'base_url = "{llm_server.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            '[tools]\nipc_tools = ["get_time"]\n'
            f'[channels.telegram]\ntoken_env = "HEALTH_TG_TOKEN"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{GROUP}"\nsession = "ops"\n'
            f'allowed_users = ["{ALICE}"]\n'
            '[[jobs]]\nid = "nightly"\ncron = "0 3 * * *"\nprompt = "digest"\n'
            'deliver_to = "ops"\n'
        )
        env = dict(os.environ, HEALTH_TG_TOKEN=telegram.token, HEALTH_TOKEN=TOKEN)
        env[TEST_KEY_ENV] = TEST_KEY
        daemon = DaemonProcess(config, env)
        await daemon.start()
        try:
            base = f"http://127.0.0.1:{port}"
            yield Served(daemon, telegram, llm_server, base, session, config)
        finally:
            assert await daemon.stop() == 0


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (labels in any order)."""
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if found == labels:
            return float(match.group(3))
    raise AssertionError(f"{name}{labels} not in:\n{text}")


async def test_health_and_metrics_follow_traffic(served: Served) -> None:
    assert (await served.get("/healthz", token=None))[0] == 401
    assert (await served.get("/metrics", token="wrong"))[0] == 401
    assert (await served.get("/livez", token=None))[0] == 401

    body = await served.until_health(200)
    components = body["components"]
    assert components["store"]["ok"] is True
    assert components["channels"]["telegram"]["ok"] is True
    assert components["computer_use"] == {"ok": True, "enabled": False}
    assert components["scheduler"] == {"ok": True, "jobs": 1}
    assert components["model"]["last_ok"] is None

    served.llm.script(Reply("all good"))
    served.telegram.push_message(GROUP, "status?", user_id=ALICE)
    last = served.telegram.push_message(UNBOUND, "anyone?", user_id=ALICE)
    await served.telegram.wait_for_sent(GROUP, 1, timeout=20)
    await served.telegram.wait_for_confirmed(last + 1, timeout=10)

    code, text = await served.get("/metrics")
    assert code == 200
    assert metric(text, "geodebot_messages_total", event="accepted") == 1
    assert metric(text, "geodebot_messages_total", event="dropped:unbound") == 1
    assert metric(text, "geodebot_turns_total", outcome="completed") == 1
    model = {"provider": "anthropic", "model": "health-model"}
    assert metric(text, "geodebot_model_latency_seconds_count", **model) == 1
    assert metric(text, "geodebot_model_tokens_total", **model, direction="output") > 0
    assert metric(text, "geodebot_channel_connected", platform="telegram") == 1
    assert metric(text, "geodebot_channel_events_total", platform="telegram", event="sent") == 1
    assert metric(text, "geodebot_turns_running") == 0
    assert metric(text, "geodebot_queue_depth") == 0
    await asyncio.sleep(0.2)  # the reply row is marked sent right after the send
    code, text = await served.get("/metrics")
    assert metric(text, "geodebot_outbox_rows", status="sent") == 1
    assert metric(text, "process_resident_memory_bytes") > 10_000_000
    assert "# TYPE geodebot_job_fires_total counter" in text

    body = await served.until_health(200)
    assert body["components"]["model"]["last_ok"] is not None
    assert TOKEN not in served.daemon.text()


async def test_a_lost_platform_connection_turns_health_503_until_it_is_back(
    served: Served,
) -> None:
    await served.until_health(200)
    served.telegram.fail_next("getUpdates", 502, "Bad Gateway")
    down = await served.until_health(503)
    assert down["status"] == "unhealthy"
    telegram = down["components"]["channels"]["telegram"]
    assert telegram["ok"] is False
    assert "Bad Gateway" in telegram["detail"]
    # Nothing a restart would mend: the liveness probe stays green.
    assert await served.get("/livez") == (200, '{"status": "ok"}')
    await served.until_health(200)


async def test_status_asks_the_running_daemon(served: Served) -> None:
    await served.until_health(200)
    code, out, err = await geodebot_status(served.config, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ready"] is True
    assert report["channels"] == {"telegram": {"connected": True, "detail": ""}}
    assert (report["turns_running"], report["queued"]) == (0, 0)
    assert report["computer_use"]["enabled"] is False
    [job] = report["jobs"]
    assert (job["id"], job["last"]) == ("nightly", "never fired")
    assert job["next"].startswith("20")
    process = report["process"]
    assert process["rss_bytes"] > 20e6
    assert process["open_fds"] > 3
    assert process["threads"] >= 2  # the loop and the store's thread
    assert process["asyncio_tasks"] >= 1
    assert report["context_cache"]["max_bytes"] == 32_000_000
    assert 0 <= report["context_cache"]["bytes"] <= report["context_cache"]["max_bytes"]
    code, out, err = await geodebot_status(served.config)
    assert code == 0, err
    assert "ready" in out
    assert "telegram: connected" in out
    assert "computer use: off" in out
    assert "job nightly: next 20" in out
    assert re.search(r"process: RSS \d+\.\d MB, \d+ open files, \d+ threads, \d+ tasks", out)


async def test_status_without_a_daemon_says_so(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "var"}"\n')
    code, _, err = await geodebot_status(config)
    assert code == 1
    assert "no geodebot daemon is listening" in err
