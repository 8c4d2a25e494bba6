"""The chaos run's world: the three platform fakes, a model that reacts to what it is sent,
the daemon's config, and the messages as the driver sent them.

The model (:class:`ChaosModel`) answers every request from its content, so any number of
sessions can run at once: a user message carrying a marker (``CHX00042``) gets a tool call
that appends ``<marker> <call id>`` to the file the message names, through the built-in
``edit_file`` tool (the file ends in :data:`END`, replaced by the new line and END again, so
every run of the tool leaves one more line); a tool result gets ``done <marker>``. The job's
prompt is handled the same way with the marker ``JOB<n>``, n counting the job's prompts in its
session.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tests.support.config import TEST_KEY_ENV
from tests.support.fakes.discord_server import FakeDiscord, Json
from tests.support.fakes.llm_server import Call, Delay, Item, Reply
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram

Platform = Literal["telegram", "slack", "discord"]
PLATFORMS: tuple[Platform, ...] = ("telegram", "slack", "discord")
END = "@@END@@"
MARKER = re.compile(r"\b(CHX\d{5})\b")
LOG_FILE = re.compile(r"log to ([\w.-]+\.log)")
JOB_ID = "tick"
JOB_PROMPT = "Chaos job: log to job.log"
JOB_FILE = "job.log"
JOB_SESSION = "tg-1"  # the job posts in the first Telegram chat
DISCORD_TOKEN = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GfAkEx.chaos-discord-token-0123456789abcdef"
USER_TG, USER_SLACK, USER_DISCORD = 4242, "UALICE001", "700000000000000001"
TOKEN_ENVS = {
    "telegram": "CHAOS_TELEGRAM_TOKEN",
    "slack_bot": "CHAOS_SLACK_BOT_TOKEN",
    "slack_app": "CHAOS_SLACK_APP_TOKEN",
    "discord": "CHAOS_DISCORD_TOKEN",
}


@dataclass(frozen=True)
class Chat:
    """One binding: a chat on a platform, bound to its own session."""

    platform: Platform
    channel: str
    session: str


def chats(per_platform: int) -> list[Chat]:
    found: list[Chat] = []
    for n in range(1, per_platform + 1):
        found.append(Chat("telegram", str(-1000 - n), f"tg-{n}"))
        found.append(Chat("slack", f"C0CHAOS{n:02d}", f"sl-{n}"))
        found.append(Chat("discord", str(900_000_000_000_000_100 + n), f"dc-{n}"))
    return found


class ChaosGuild(FakeDiscord):
    """The fake Discord with one guild text channel per bound Discord chat."""

    def __init__(self, channel_ids: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = {cid: f"chaos-{i}" for i, cid in enumerate(channel_ids)}

    def _in_guild(self, channel_id: str) -> bool:
        return channel_id in self.extra or super()._in_guild(channel_id)

    def _guild(self) -> Json:
        guild = super()._guild()
        ops = guild["channels"][0]
        extra = [ops | {"id": cid, "name": name} for cid, name in self.extra.items()]
        return guild | {"channels": [ops, *extra]}


@dataclass
class Sent:
    """One message the driver sent, and how the platform knows it."""

    index: int
    marker: str
    chat: Chat
    event_id: str  # the inbox's event id: Telegram update_id, Slack event_id, Discord id
    message_id: str  # what a reply refers to: message_id, ts, message id
    at: float
    envelope: str = ""  # Slack: the first envelope's id, whose ack counts for every retry


class ChaosModel:
    """The fake model's responder: see the module docstring."""

    def __init__(self, seed: int, max_delay_s: float = 0.15) -> None:
        self._rng = random.Random(seed)
        self._ids = itertools.count(1)
        self._max_delay_s = max_delay_s
        self.calls_proposed: dict[str, list[str]] = {}  # marker -> tool call ids proposed

    def __call__(self, body: dict[str, Any]) -> Item:
        messages = body.get("messages") or []
        if not messages:
            return Reply("nothing to do")
        texts, results = _blocks(messages[-1])
        reply = self._on_text(messages, texts) or self._on_results(results)
        delay = self._rng.uniform(0.0, self._max_delay_s)
        return Delay(delay, reply or Reply("nothing to do"))

    def _on_text(self, messages: list[dict[str, Any]], texts: list[str]) -> Reply | None:
        joined = "\n".join(texts)
        found, path = MARKER.search(joined), LOG_FILE.search(joined)
        if path is None:
            return None
        if found is not None:
            marker = found.group(1)
        elif JOB_PROMPT in joined:
            prompts = sum(1 for m in messages if m.get("role") == "user" and JOB_PROMPT in _text(m))
            marker = f"JOB{prompts:04d}"
        else:
            return None
        call_id = f"toolu_{marker}_{next(self._ids)}"
        self.calls_proposed.setdefault(marker, []).append(call_id)
        arguments = {
            "path": path.group(1),
            "old_text": END,
            "new_text": f"{marker} {call_id}\n{END}",
        }
        return Reply(tool_calls=[Call("edit_file", arguments, id=call_id)])

    def _on_results(self, results: list[str]) -> Reply | None:
        for tool_use_id in results:
            parts = tool_use_id.split("_")
            if len(parts) == 3 and parts[0] == "toolu":
                return Reply(f"done {parts[1]}")
        return None


def _blocks(message: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(texts, tool_use_ids of tool results) of one request message."""
    content = message.get("content")
    if isinstance(content, str):
        return [content], []
    texts: list[str] = []
    results: list[str] = []
    for block in content or []:
        if block.get("type") == "text":
            texts.append(str(block.get("text", "")))
        elif block.get("type") == "tool_result":
            results.append(str(block.get("tool_use_id", "")))
    return texts, results


def _text(message: dict[str, Any]) -> str:
    return "\n".join(_blocks(message)[0])


@dataclass
class Fakes:
    telegram: FakeTelegram
    slack: FakeSlack
    discord: ChaosGuild
    llm_url: str
    sent: list[Sent] = field(default_factory=list)

    def env(self, base: dict[str, str], api_key: str) -> dict[str, str]:
        env = dict(base)
        env.pop("GEODEBOT_CONFIG", None)
        env.pop("STATE_DIRECTORY", None)
        env.pop("CREDENTIALS_DIRECTORY", None)
        env[TEST_KEY_ENV] = api_key
        env[TOKEN_ENVS["telegram"]] = self.telegram.token
        env[TOKEN_ENVS["slack_bot"]] = self.slack.bot_token
        env[TOKEN_ENVS["slack_app"]] = self.slack.app_token
        env[TOKEN_ENVS["discord"]] = DISCORD_TOKEN
        return env


@dataclass(frozen=True)
class ReplicaSetup:
    """What sets one replica's config apart: its name, and the database all of them share."""

    replica_id: str
    store_url: str
    lease_ttl_s: float


def prepare_workspace(workspace: Path, bound: list[Chat]) -> Path:
    """The tool's files, each holding only :data:`END`; once per run, shared by every
    replica as a shared volume would be."""
    workspace.mkdir(parents=True, exist_ok=True)
    for name in [f"{c.session}.log" for c in bound] + [JOB_FILE]:
        (workspace / name).write_text(END + "\n")
    return workspace


def write_config(
    path: Path,
    fakes: Fakes,
    bound: list[Chat],
    job_every_s: int,
    *,
    replica: ReplicaSetup | None = None,
    workspace: Path | None = None,
) -> Path:
    """The daemon's config at ``path``, its state in ``var`` beside it. Without ``replica``:
    one daemon on SQLite, and the workspace beside it prepared here. With it: one replica of
    several on PostgreSQL, the workspace (``workspace``, prepared once by the caller) shared."""
    state = path.parent / "var"
    if workspace is None:
        workspace = prepare_workspace(path.parent / "workspace", bound)
    lines = ["[daemon]"]
    if replica is not None:
        lines.append(f'replica_id = "{replica.replica_id}"')
    lines += [
        f'state_dir = "{state}"',
        "max_concurrent_sessions = 6",
        "session_queue = 500",
        "shutdown_grace_s = 5",
        # One sender per platform sends hundreds of messages here: flood control would drop
        # them by design, and the run is about crashes, not floods (tests/e2e/test_abuse_*.py).
        "user_rate_per_min = 0",
    ]
    if replica is not None:
        lines += [
            "[store]",
            f'url = "{replica.store_url}"',
            f"lease_ttl_s = {replica.lease_ttl_s:g}",
        ]
    lines += [
        "[model]",
        'provider = "anthropic"',
        'name = "chaos-model"',
        f'base_url = "{fakes.llm_url}"',
        f'api_key_env = "{TEST_KEY_ENV}"',
        "max_retries = 0",
        "request_timeout_s = 30",
        "[tools]",
        f'workspace = "{workspace}"',
        'ipc_tools = ["get_time"]',
        "[channels.telegram]",
        f'token_env = "{TOKEN_ENVS["telegram"]}"',
        f'api_base_url = "{fakes.telegram.api_base_url}"',
        "poll_timeout_s = 1",
        "[channels.slack]",
        f'bot_token_env = "{TOKEN_ENVS["slack_bot"]}"',
        f'app_token_env = "{TOKEN_ENVS["slack_app"]}"',
        f'api_base_url = "{fakes.slack.api_base_url}"',
        "[channels.discord]",
        f'token_env = "{TOKEN_ENVS["discord"]}"',
        f'api_base_url = "{fakes.discord.api_base_url}"',
        f'gateway_url = "{fakes.discord.gateway_url}"',
    ]
    for chat in bound:
        lines += [
            "[[bindings]]",
            f'platform = "{chat.platform}"',
            f'channel = "{chat.channel}"',
            f'session = "{chat.session}"',
            'allowed_users = ["*"]',
            'tools = ["edit_file"]',
            'preapproved = ["edit_file"]',
            "time_budget_s = 60",
        ]
    lines += [
        "[[jobs]]",
        f'id = "{JOB_ID}"',
        f'every = "{job_every_s}s"',
        f'prompt = "{JOB_PROMPT}"',
        f'deliver_to = "{JOB_SESSION}"',
        'tools = ["edit_file"]',
        'catch_up = "latest"',
        "time_budget_s = 60",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path
