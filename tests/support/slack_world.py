"""The Slack world of the end-to-end tests: ``geodebot serve`` as a real process against
FakeSlack and a FakeLLMServer that notes when each request began and was answered.

:class:`Rig` starts daemons on a config it writes, sends messages as users and waits for the
daemon's posts; the ``rig`` fixture (``tests/conftest.py``) makes one per test.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import MODELS_MARK, DaemonProcess
from tests.support.fakes.llm_server import Dialect, FakeLLMServer, Item
from tests.support.fakes.slack_server import Call, FakeSlack, Posted

BOT_TOKEN_ENV = "GEODEBOT_E2E_SLACK_BOT_TOKEN"
APP_TOKEN_ENV = "GEODEBOT_E2E_SLACK_APP_TOKEN"

OPS = "C0OPS0001"  # channel scope, anyone
OPS2 = "C0OPS0002"  # channel scope, anyone: a second session
DEV = "C0DEV0001"  # thread scope, only ALICE and BOB
QUIET = "C0QUIET01"  # channel scope, anyone, mention required
UNBOUND = "C0NOBIND1"

ALICE = "UALICE001"
BOB = "UBOB00001"
MALLORY = "UMALLORY1"

BINDINGS = f"""
[[bindings]]
platform = "slack"
channel = "{OPS}"
session = "ops"
allowed_users = ["*"]

[[bindings]]
platform = "slack"
channel = "{OPS2}"
session = "ops2"
allowed_users = ["*"]

[[bindings]]
platform = "slack"
channel = "{DEV}"
session = "dev"
scope = "thread"
allowed_users = ["{ALICE}", "{BOB}"]

[[bindings]]
platform = "slack"
channel = "{QUIET}"
session = "quiet"
allowed_users = ["*"]
require_mention = true
"""

_ts_counter = itertools.count(1)


def new_ts() -> str:
    """A Slack-shaped message ts, unique in the run (the adapter keys claims on it)."""
    return f"{1_700_000_000 + next(_ts_counter)}.000100"


async def eventually(
    check: Callable[[], bool], what: str, *, limit_s: float = 30.0, log: DaemonProcess | None = None
) -> None:
    """Poll ``check`` until it holds (for state that the fakes offer no waiter for)."""
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            tail = "\n".join(log.log[-40:]) if log is not None else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        await asyncio.sleep(0.02)


class TimedLLM(FakeLLMServer):
    """FakeLLMServer that notes when each request began and when its answer went out."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[float] = []
        self.answered: list[float] = []

    async def _render(
        self, request: web.Request, dialect: Dialect, body: dict[str, Any], item: Item
    ) -> web.StreamResponse:
        self.started.append(time.monotonic())
        try:
            return await super()._render(request, dialect, body, item)
        finally:
            self.answered.append(time.monotonic())

    def user_texts(self, index: int) -> list[str]:
        """The user turns' text of request ``index``, oldest first."""
        texts: list[str] = []
        for message in self.requests[index].json["messages"]:
            if message["role"] != "user":
                continue
            content = message["content"]
            if isinstance(content, str):
                texts.append(content)
            else:
                texts += [b.get("text", "") for b in content if b.get("type") == "text"]
        return texts


class TimedCalls(list[Call]):
    """FakeSlack.calls that also records when each Web API call arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    def append(self, call: Call) -> None:
        self.at.append(time.monotonic())
        super().append(call)

    def times_of(self, method: str) -> list[float]:
        return [t for c, t in zip(self, self.at, strict=True) if c.method == method]


@dataclass
class Rig:
    slack: FakeSlack
    llm: TimedLLM
    tmp_path: Path
    daemons: list[DaemonProcess] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)  # carries TEST_KEY_ENV (conftest's autouse fixture)
        env[BOT_TOKEN_ENV] = self.slack.bot_token
        env[APP_TOKEN_ENV] = self.slack.app_token
        env.pop("GEODEBOT_CONFIG", None)
        return env

    @property
    def state_dir(self) -> Path:
        return self.tmp_path / "var"

    def write_config(
        self, *, grace_s: float = 10.0, max_sessions: int = 4, log_level: str = "info"
    ) -> Path:
        path = self.tmp_path / "config.toml"
        path.write_text(
            f"""
[daemon]
state_dir = "{self.state_dir}"
log_level = "{log_level}"
max_concurrent_sessions = {max_sessions}
shutdown_grace_s = {grace_s}

[model]
provider = "anthropic"
name = "e2e-model-1"
base_url = "{self.llm.url}"
api_key_env = "{TEST_KEY_ENV}"
max_retries = 0
request_timeout_s = 30

[channels.slack]
bot_token_env = "{BOT_TOKEN_ENV}"
app_token_env = "{APP_TOKEN_ENV}"
api_base_url = "{self.slack.api_base_url}"
{BINDINGS}"""
        )
        return path

    async def start(self, **config: Any) -> DaemonProcess:
        """A daemon, once its model SDK has loaded too. Until then a turn waits a second or
        more for its first model call, and with the reply streamed (the default), that wait
        alone gets a preview posted before the answer: a test's fault for the reply's post
        would hit the preview instead."""
        daemon = DaemonProcess(self.write_config(**config), self.env)
        self.daemons.append(daemon)
        await daemon.start()
        await daemon.wait_for_line(MODELS_MARK)
        return daemon

    async def send(self, channel: str, text: str, **kw: Any) -> tuple[dict[str, Any], str]:
        """Post a message as a user (default ALICE) and wait until the daemon acked it."""
        event_id = kw.pop("event_id", None)
        user = kw.pop("user", ALICE)
        event = FakeSlack.message_event(channel, user, text, ts=kw.pop("ts", new_ts()), **kw)
        envelope = await self.slack.push_event(event, event_id=event_id)
        await self.slack.wait_for_ack(envelope, timeout=15)
        return event, envelope

    def posts(self, channel: str) -> list[Posted]:
        return list(self.slack.posted.get(channel, []))

    def all_posts(self) -> list[Posted]:
        return [p for posts in self.slack.posted.values() for p in posts]

    async def wait_posts(self, channel: str, count: int, *, limit_s: float = 30.0) -> list[Posted]:
        await eventually(
            lambda: len(self.posts(channel)) >= count,
            f"{count} post(s) in {channel}",
            limit_s=limit_s,
            log=self.daemons[-1] if self.daemons else None,
        )
        return self.posts(channel)

    async def wait_requests(self, count: int, limit_s: float = 30.0) -> None:
        async with asyncio.timeout(limit_s):
            await self.llm.wait_for_requests(count)


def assert_clean_log(daemon: DaemonProcess, slack: FakeSlack) -> None:
    text = daemon.text()
    assert "Traceback" not in text, text
    for secret in (slack.bot_token, slack.app_token, TEST_KEY):
        assert secret not in text


def log_events(daemon: DaemonProcess) -> Iterator[dict[str, Any]]:
    for line in daemon.log:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            yield row
