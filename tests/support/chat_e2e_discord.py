"""The Discord world of tests/e2e/test_chat_discord.py: ``geodebot serve`` as a real process,
discord.py against a fake guild with one text channel per scenario, the anthropic SDK against
the fake model server (answering by prompt, so scenarios do not share a script), and a tool
that needs approval.

The tool is the fake MCP server's ``write_note`` (``mcp__fake__write_note``), declared
``write``: a ``geodebot serve`` process loads its tools from the config, not from a test's
registry, and this one leaves a line in ``$NOTES_FILE`` per run, so a test can count runs
with :func:`tests.support.tools.marker_lines`.

The files world of tests/e2e/test_files_discord.py (:meth:`ChatWorld.create_files`) is the
same daemon and fakes with its own channels (:data:`FILE_CHANNELS`), ``send_file`` listed
and preapproved, and a model that matches a prompt in any text block of the newest user
message (the caption comes first there, then the files' blocks and notes).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from geodebot.config.schema import DB_FILE
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, CONTROL_ANSWER, answer_controls
from tests.support.daemon import DaemonProcess
from tests.support.fakes.discord_server import FakeDiscord, Json
from tests.support.fakes.llm_server import FakeLLMServer, Item, Reply, last_prompt, user_texts
from tests.support.mcp import FAKE as FAKE_MCP

TOKEN = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GfAkEx.chat-e2e-discord-token-0123456789abcdef"
TOKEN_ENV = "CHAT_E2E_DISCORD_TOKEN"
TOOL = "mcp__fake__write_note"
ALICE = "700000000000000001"  # asks; may not approve
APPROVER, APPROVER_2 = "700000000000000042", "700000000000000043"
# A text channel (and session) per scenario: name -> channel id. The fake's own channel is
# not bound.
CHANNELS: dict[str, str] = {
    name: str(900000000000000100 + n)
    for n, name in enumerate(
        ("approve", "stranger", "deny", "expire", "restart", "stream", "crash", "storm")
    )
}
# The files world's channels (and sessions): name -> channel id.
FILE_CHANNELS: dict[str, str] = {
    name: str(900000000000000200 + n)
    for n, name in enumerate(("files-in", "oversize", "send-file"))
}
SEND_FILE = "send_file"
MAX_ATTACHMENT_MB = 20  # the bindings' max_attachment_mb (the default)
EXPIRE_S = 5.0  # approval_timeout_s of the "expire" channel (the least allowed)
EDIT_INTERVAL_S = 0.2  # [daemon] stream_edit_interval_s (the least allowed)


class ChatGuild(FakeDiscord):
    """The fake Discord with a guild text channel per scenario."""

    extra_channels: ClassVar[Mapping[str, str]] = {cid: name for name, cid in CHANNELS.items()}

    def _in_guild(self, channel_id: str) -> bool:
        return channel_id in self.extra_channels or super()._in_guild(channel_id)

    def _guild(self) -> Json:
        guild = super()._guild()
        ops = guild["channels"][0]
        extra = [ops | {"id": cid, "name": name} for cid, name in self.extra_channels.items()]
        return guild | {"channels": [ops, *extra]}


class FilesGuild(ChatGuild):
    """The fake Discord with a guild text channel per files scenario."""

    extra_channels: ClassVar[Mapping[str, str]] = {cid: name for name, cid in FILE_CHANNELS.items()}


class ModelByPrompt:
    """The fake model's responder: per prompt, what each round of its turn answers.

    A round is counted by the assistant messages after the newest user text, so a turn
    resumed after a restart gets the answer of the round it is in."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[Item]] = {}

    def add(self, prompt: str, *rounds: Item) -> str:
        self.scripts[prompt] = list(rounds)
        return prompt

    def __call__(self, body: dict[str, Any]) -> Item | None:
        text, rounds = last_prompt(body)
        if not text:
            return None
        for prompt, script in self.scripts.items():
            if prompt in text:
                return script[rounds] if rounds < len(script) else Reply("(no such round)")
        return None


class ModelByAnyText(ModelByPrompt):
    """:class:`ModelByPrompt` matching the prompt in any text block of the newest user
    message: with files, its last text block may be a note about a file, not the caption."""

    def __call__(self, body: dict[str, Any]) -> Item | None:
        texts, rounds = user_texts(body)
        for prompt, script in self.scripts.items():
            if any(prompt in text for text in texts):
                return script[rounds] if rounds < len(script) else Reply("(no such round)")
        return None


def user_blocks(body: Mapping[str, Any], prompt: str) -> list[Json]:
    """The content blocks of the user message of a model request that carries ``prompt``."""
    for message in body.get("messages") or []:
        content = message["content"]
        if message["role"] != "user" or not isinstance(content, list):
            continue
        if any(prompt in str(b.get("text", "")) for b in content):
            return list(content)
    return []


def tool_results(body: Mapping[str, Any]) -> list[str]:
    """The text of every tool_result block of a model request, oldest first."""
    found = []
    for message in body.get("messages") or []:
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block.get("type") == "tool_result":
                content = block["content"]
                texts = [content] if isinstance(content, str) else [c["text"] for c in content]
                found.append("".join(texts))
    return found


def literal(text: str) -> str:
    """What Discord shows for ``text``: a backslash before ASCII punctuation is dropped."""
    return re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text)


def write_config(tmp: Path, discord: FakeDiscord, llm: FakeLLMServer, *, stream: bool) -> Path:
    config = tmp / "config.toml"
    bindings = "".join(
        f'[[bindings]]\nplatform = "discord"\nchannel = "{cid}"\nsession = "{name}"\n'
        f'allowed_users = ["{ALICE}"]\ntools = ["{TOOL}"]\n'
        f'approvers = ["{APPROVER}", "{APPROVER_2}"]\nstream = {str(stream).lower()}\n'
        + (f"approval_timeout_s = {EXPIRE_S:g}\n" if name == "expire" else "")
        for name, cid in CHANNELS.items()
    )
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp / "var"}"\nlog_level = "info"\n'
        "max_concurrent_sessions = 8\nuser_rate_per_min = 0\nshutdown_grace_s = 5\n"
        f"stream_edit_interval_s = {EDIT_INTERVAL_S:g}\n"
        f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm.url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
        f'[tools]\nworkspace = "{tmp / "ws"}"\nipc_tools = ["get_time"]\n'
        f'[[mcp.servers]]\nname = "fake"\ncommand = ["{sys.executable}", "{FAKE_MCP}"]\n'
        'env = ["NOTES_FILE"]\n'
        '[mcp.servers.tools.write_note]\nsafety = "write"\neffect = "mutate"\n'
        f'[channels.discord]\ntoken_env = "{TOKEN_ENV}"\n'
        f'api_base_url = "{discord.api_base_url}"\ngateway_url = "{discord.gateway_url}"\n'
        + bindings
    )
    return config


def write_files_config(tmp: Path, discord: FakeDiscord, llm: FakeLLMServer) -> Path:
    config = tmp / "config.toml"
    bindings = "".join(
        f'[[bindings]]\nplatform = "discord"\nchannel = "{cid}"\nsession = "{name}"\n'
        f'allowed_users = ["{ALICE}"]\ntools = ["{SEND_FILE}"]\n'
        f'preapproved = ["{SEND_FILE}"]\nmax_attachment_mb = {MAX_ATTACHMENT_MB}\n'
        for name, cid in FILE_CHANNELS.items()
    )
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp / "var"}"\nlog_level = "info"\n'
        "max_concurrent_sessions = 8\nuser_rate_per_min = 0\nshutdown_grace_s = 5\n"
        f"stream_edit_interval_s = {EDIT_INTERVAL_S:g}\n"
        f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm.url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
        f'[tools]\nworkspace = "{tmp / "ws"}"\nipc_tools = ["get_time"]\n'
        f'[channels.discord]\ntoken_env = "{TOKEN_ENV}"\n'
        f'api_base_url = "{discord.api_base_url}"\ngateway_url = "{discord.gateway_url}"\n'
        + bindings
    )
    return config


@dataclass
class ChatWorld:
    discord: ChatGuild
    llm: FakeLLMServer
    model: ModelByPrompt
    config: Path
    notes: Path
    state_dir: Path
    env: dict[str, str]
    daemons: list[DaemonProcess] = field(default_factory=list)

    @classmethod
    def create(
        cls, tmp: Path, discord: ChatGuild, llm: FakeLLMServer, *, stream: bool = True
    ) -> ChatWorld:
        model = ModelByPrompt()
        llm.responder = model
        answer_controls(llm)
        notes = tmp / "notes"
        env = dict(os.environ, **{TOKEN_ENV: TOKEN, TEST_KEY_ENV: TEST_KEY})
        env["NOTES_FILE"] = str(notes)
        config = write_config(tmp, discord, llm, stream=stream)
        return cls(discord, llm, model, config, notes, tmp / "var", env)

    @classmethod
    def create_files(cls, tmp: Path, discord: FilesGuild, llm: FakeLLMServer) -> ChatWorld:
        """The files world: FILE_CHANNELS bound, ``send_file`` preapproved, the workspace
        at ``tmp / "ws"``."""
        model = ModelByAnyText()
        llm.responder = model
        answer_controls(llm)
        (tmp / "ws").mkdir()
        env = dict(os.environ, **{TOKEN_ENV: TOKEN, TEST_KEY_ENV: TEST_KEY})
        config = write_files_config(tmp, discord, llm)
        return cls(discord, llm, model, config, tmp / "notes", tmp / "var", env)

    @property
    def workspace(self) -> Path:
        return self.config.parent / "ws"

    @property
    def daemon(self) -> DaemonProcess:
        return self.daemons[-1]

    async def start(self) -> DaemonProcess:
        """A daemon on the world's state dir; waits until the channels are connected."""
        self.daemons.append(DaemonProcess(self.config, self.env))
        await self.daemon.start()
        await self.daemon.wait_for_line("ready: every enabled channel is connected", 30)
        return self.daemon

    async def kill_and_restart(self) -> DaemonProcess:
        await self.daemon.kill()
        return await self.start()

    # -- the chat ---------------------------------------------------------------------------
    def say(self, channel: str, text: str, *, user: str = ALICE) -> str:
        return self.discord.push_message(channel, text, author_id=user)

    def bot_messages(self, channel: str) -> list[Json]:
        """The bot's messages in ``channel`` as they are now (edits applied), oldest first."""
        bot = self.discord.bot_id
        return [m for m in self.discord.history[channel] if m["author"]["id"] == bot]

    def answers(self, channel: str) -> list[Json]:
        """The bot's messages that are no approval card."""
        return [m for m in self.bot_messages(channel) if not _is_card(m)]

    def cards(self, channel: str) -> list[Json]:
        return [m for m in self.bot_messages(channel) if _is_card(m)]

    async def until(self, predicate: Callable[[], bool], what: str, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        while not predicate():
            if time.monotonic() > deadline:
                tail = "\n".join(self.daemon.log[-40:])
                raise AssertionError(f"not reached within {within:g} s: {what}\n{tail}")
            await asyncio.sleep(0.02)

    async def open_card(self, channel: str) -> Json:
        """The channel's one card as first posted (a copy: the fake edits its own)."""
        await self.until(lambda: bool(self.cards(channel)), f"a card in {channel}")
        [card] = self.cards(channel)
        return copy.deepcopy(card)

    async def press(self, card: Json, *, approve: bool, user: str) -> Json:
        """``user`` presses Approve (or Deny) on ``card``; the interaction's response."""
        label = "Approve" if approve else "Deny"
        # The buttons as first shown: a press may come after they are gone (a stale client).
        [row] = card["components"]
        [button] = [b for b in row["components"] if b["label"] == label]
        iid = self.discord.push_press(card["id"], button["custom_id"], user_id=user)
        return await self.discord.wait_callback(iid, within=10)

    async def control(self, channel: str) -> None:
        """A control message in ``channel`` (tests/support/control.py), once answered: what
        the channel's earlier messages cause has all arrived by then."""

        def controls() -> int:
            return [m["content"] for m in self.answers(channel)].count(CONTROL_ANSWER)

        seen = controls()
        self.say(channel, CONTROL)
        await self.until(lambda: controls() > seen, f"the control answer in {channel}")

    async def until_true(
        self, probe: Callable[[], Awaitable[bool]], what: str, within: float = 20.0
    ) -> None:
        """:meth:`until` for a probe that has to wait for something itself."""
        deadline = time.monotonic() + within
        while not await probe():
            if time.monotonic() > deadline:
                tail = "\n".join(self.daemon.log[-40:])
                raise AssertionError(f"not reached within {within:g} s: {what}\n{tail}")
            await asyncio.sleep(0.05)

    async def preview_recorded(self, message_id: str) -> bool:
        """Whether the daemon's store holds the preview of the turn answering ``message_id``
        (read-only, beside the running daemon): from then on a restart edits that preview."""
        return await asyncio.to_thread(self._preview_of, message_id)

    def _preview_of(self, message_id: str) -> bool:
        # The daemon's own connection writes meanwhile (WAL): a reader waits for no lock.
        db = sqlite3.connect(f"file:{self.state_dir / DB_FILE}?mode=ro", uri=True, timeout=1)
        try:
            row = db.execute(
                "SELECT preview FROM inbox WHERE message_id = ?", (message_id,)
            ).fetchone()
        finally:
            db.close()
        return row is not None and bool(row[0])

    def requests_for(self, prompt: str) -> list[dict[str, Any]]:
        """The model requests of the turn answering ``prompt``, in order."""
        return [
            r.json
            for r in self.llm.requests
            if isinstance(r.json, dict)
            and prompt in json.dumps(r.json.get("messages") or [])
            and CONTROL not in json.dumps(r.json.get("messages") or [])
        ]


def _is_card(message: Json) -> bool:
    return literal(str(message.get("content") or "")).startswith("**Approval needed:")
