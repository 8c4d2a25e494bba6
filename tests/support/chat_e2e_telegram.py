"""``geodebot serve`` on the fake Telegram Bot API with approvers and streamed answers, for
tests/e2e/test_chat_telegram.py: the config, a model that answers each chat's prompt round by
round, and what a test reads off the chat (cards, a message's versions, the notes written).

The tool that needs approval is the fake MCP server's ``write_note``
(tests/support/fakes/mcp_tools_server.py), declared ``write``/``mutate`` in the config: it
appends its text to ``$NOTES_FILE``, so a test counts its runs. ``geodebot serve`` builds its
own tool registry; an MCP server is how a tool of the tests gets into it unpatched.

For files (tests/e2e/test_files_telegram.py) the daemon downloads from the fake's
``file_base_url``; :class:`FilesModel` finds a turn by any text of its newest user message
(a caption, followed by the files' blocks and notes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geodebot.channels.base import parse_press_data
from geodebot.config.schema import DB_FILE
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, CONTROL_ANSWER, answer_controls
from tests.support.daemon import CONNECTED_MARK, DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer, Item, last_prompt, user_texts
from tests.support.fakes.telegram_server import (
    ApiError,
    FakeTelegram,
    SentMessage,
    html_visible,
    shown_content,
)
from tests.support.tools import marker_lines

ROOT = Path(__file__).resolve().parents[2]
TOKEN_ENV = "CHAT_E2E_TELEGRAM_TOKEN"
WRITE_NOTE = "mcp__fake__write_note"
ALICE, BOB, CAROL = 4242, 5151, 6262  # Alice asks; Bob and Carol may approve
SEND_FILE = "send_file"
APPROVERS = (BOB, CAROL)
STREAM_INTERVAL_S = 0.2


class CardKillingTelegram(FakeTelegram):
    """The fake Bot API, able to SIGKILL the daemon the moment it posted a card: the card is
    in the chat, but the answer with its message id never reaches the daemon."""

    def __init__(self) -> None:
        super().__init__()
        self.kill_at_card: int | None = None  # the daemon's pid, for the next card

    async def _m_sendmessage(self, params: dict[str, Any]) -> Any:
        result = await super()._m_sendmessage(params)
        if self.kill_at_card is not None and params.get("reply_markup"):
            os.kill(self.kill_at_card, signal.SIGKILL)
            self.kill_at_card = None
        return result


# What Telegram answers a message to a user who blocked the bot.
BLOCKED = "Forbidden: bot was blocked by the user"


class RefusingTelegram(CardKillingTelegram):
    """The fake Bot API refusing every message to the chats in ``blocked`` for good, as
    Telegram does once a user blocked the bot."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked: set[int] = set()

    async def _m_sendmessage(self, params: dict[str, Any]) -> Any:
        if int(params["chat_id"]) in self.blocked:
            raise ApiError(403, BLOCKED)
        return await super()._m_sendmessage(params)


@dataclass(frozen=True)
class Chat:
    """A bound chat (its own session); ``keys`` are further TOML lines of its binding."""

    id: int
    keys: str = ""
    stream: bool = True
    approvers: tuple[int, ...] = APPROVERS
    tools: tuple[str, ...] = (WRITE_NOTE,)

    def toml(self) -> str:
        approvers = ", ".join(f'"{a}"' for a in self.approvers)
        tools = ", ".join(f'"{t}"' for t in self.tools)
        return (
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{self.id}"\n'
            f'session = "chat{-self.id}"\nallowed_users = ["{ALICE}", "{BOB}"]\n'
            f"tools = [{tools}]\napprovers = [{approvers}]\n"
            f"stream = {'true' if self.stream else 'false'}\n{self.keys}"
        )


class ChatModel:
    """The fake model's responder: a prompt's turn gets its script's item for the round it is
    in (round 0 the first call, 1 after the first tool results, ...), so chats may interleave
    and a turn asked again after a restart gets the same answer again. Every request is kept
    by prompt in ``asked``."""

    def __init__(self) -> None:
        self._scripts: dict[str, Sequence[Item]] = {}
        self.asked: dict[str, list[tuple[int, dict[str, Any]]]] = {}

    def script(self, prompt: str, *rounds: Item) -> None:
        self._scripts[prompt] = rounds
        self.asked[prompt] = []

    def __call__(self, body: dict[str, Any]) -> Item | None:
        text, rounds = last_prompt(body)
        for prompt, items in self._scripts.items():
            if prompt in text:
                self.asked[prompt].append((rounds, body))
                return items[min(rounds, len(items) - 1)]
        return None

    def rounds(self, prompt: str) -> list[int]:
        """The round of each model call the prompt's turn made, in order."""
        return [rounds for rounds, _ in self.asked[prompt]]

    def tool_result(self, prompt: str) -> str:
        """The tool result the prompt's turn's last model request carries."""
        _, body = self.asked[prompt][-1]
        content = body["messages"][-1]["content"]
        results = [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
        if not results:
            raise AssertionError(f"the last request of {prompt!r} carries no tool result")
        [result] = results
        if isinstance(result["content"], str):
            return str(result["content"])
        return "".join(part.get("text", "") for part in result["content"])


class FilesModel(ChatModel):
    """A :class:`ChatModel` that finds a prompt in any text block of the newest user message,
    not only the last: a message's files follow its caption there, a refused one as a text
    note."""

    def __call__(self, body: dict[str, Any]) -> Item | None:
        texts, rounds = user_texts(body)
        for prompt, items in self._scripts.items():
            if any(prompt in text for text in texts):
                self.asked[prompt].append((rounds, body))
                return items[min(rounds, len(items) - 1)]
        return None

    def blocks(self, prompt: str) -> list[dict[str, Any]]:
        """The content blocks of the user message that asked ``prompt`` (its first request)."""
        _, body = self.asked[prompt][0]
        for message in reversed(body["messages"]):
            content = message["content"]
            if message["role"] != "user" or isinstance(content, str):
                continue
            if any(prompt in b.get("text", "") for b in content if b.get("type") == "text"):
                return list(content)
        raise AssertionError(f"no user message of {prompt!r} with blocks")


@dataclass
class ChatWorld:
    telegram: FakeTelegram
    llm: FakeLLMServer
    root: Path
    chats: Sequence[Chat]
    model: ChatModel = field(default_factory=ChatModel)
    daemon: DaemonProcess | None = None
    daemons: list[DaemonProcess] = field(default_factory=list)
    # More of the config file (a [memory] or [voice] table), after the bindings.
    extra_config: str = ""
    # More environment for the daemon (a [voice] key, say), and secrets its log must not hold.
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.llm.responder = self.model
        answer_controls(self.llm)

    @property
    def notes(self) -> Path:
        return self.root / "notes.txt"

    def notes_written(self, text: str) -> int:
        """How often write_note ran with ``text``."""
        return marker_lines(self.notes).count(text)

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT), NOTES_FILE=str(self.notes))
        env.update({TOKEN_ENV: self.telegram.token, TEST_KEY_ENV: TEST_KEY})
        env.update(self.extra_env)
        return env

    def write_config(self) -> Path:
        path = self.root / "config.toml"
        path.write_text(
            f'[daemon]\nstate_dir = "{self.root / "var"}"\nshutdown_grace_s = 5\n'
            f"user_rate_per_min = 0\nstream_edit_interval_s = {STREAM_INTERVAL_S}\n"
            f'[model]\nprovider = "anthropic"\nname = "chat-e2e-model"\n'
            f'base_url = "{self.llm.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            f'[tools]\nipc_tools = ["get_time"]\nworkspace = "{self.root / "ws"}"\n'
            '[[mcp.servers]]\nname = "fake"\n'
            f"command = [{sys.executable!r}, '-m', 'tests.support.fakes.mcp_tools_server']\n"
            'env = ["PYTHONPATH", "NOTES_FILE"]\n'
            '[mcp.servers.tools.write_note]\nsafety = "write"\neffect = "mutate"\n'
            f'[channels.telegram]\ntoken_env = "{TOKEN_ENV}"\n'
            f'api_base_url = "{self.telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f'file_base_url = "{self.telegram.file_base_url}"\n'
            + "".join(chat.toml() for chat in self.chats)
            + self.extra_config
        )
        return path

    async def start(self) -> DaemonProcess:
        """A daemon on this world's state directory, once it polls Telegram."""
        daemon = DaemonProcess(self.write_config(), self.env())
        self.daemons.append(daemon)
        self.daemon = await daemon.start()
        await daemon.wait_for_line(CONNECTED_MARK, timeout_s=30)
        return daemon

    async def kill(self) -> None:
        assert self.daemon is not None
        await self.daemon.kill()

    def kill_at_next_card(self) -> None:
        """SIGKILL the daemon as it posts its next card, before it learns the card's id."""
        assert isinstance(self.telegram, CardKillingTelegram)
        assert self.daemon is not None
        assert self.daemon.proc is not None
        self.telegram.kill_at_card = self.daemon.proc.pid

    def running(self) -> bool:
        proc = None if self.daemon is None else self.daemon.proc
        return proc is not None and proc.returncode is None

    def ask(self, chat: int, text: str, *, user: int = ALICE) -> int:
        return self.telegram.push_message(chat, text, user_id=user)

    def send(self, chat: int, data: bytes, caption: str, **file: Any) -> int:
        """Alice sends a file with a caption (``file``: push_file's arguments); the update."""
        return self.telegram.push_file(chat, data, user_id=ALICE, caption=caption, **file)

    @property
    def workspace(self) -> Path:
        """The daemon's workspace (``[tools] workspace``), where send_file finds files."""
        path = self.root / "ws"
        path.mkdir(exist_ok=True)
        return path

    def messages(self, chat: int) -> list[SentMessage]:
        """The bot's messages in the chat, each as it reads now."""
        return [self.telegram.shown(chat, m.message_id) for m in self.telegram.sent[chat]]

    def cards(self, chat: int) -> list[SentMessage]:
        """Every approval card posted in the chat (a card is sent with its buttons)."""
        return [m for m in self.telegram.sent[chat] if m.buttons]

    async def card(self, chat: int, timeout: float = 30.0) -> SentMessage:
        """Until the chat has an approval card; the first, as it reads now."""
        await self.telegram.wait_until(lambda: self.cards(chat), timeout)
        return self.telegram.shown(chat, self.cards(chat)[0].message_id)

    async def card_recorded(self, card: SentMessage, timeout: float = 30.0) -> None:
        """Until the daemon's store holds the card's message id with its request, as a
        restarted daemon finds it. (Killed before that, the daemon cannot know the card is
        up, and posts it again: the Bot API has no way to look a sent message up.)"""
        parsed = parse_press_data(card.buttons[0][1])
        assert parsed is not None
        approval_id = parsed[0]
        async with asyncio.timeout(timeout):
            while True:
                # The store tells nobody; it is looked at until it holds the id.
                if self._stored_card(approval_id).get("message_id") == str(card.message_id):
                    return
                await asyncio.sleep(0.02)

    def _stored_card(self, approval_id: str) -> dict[str, Any]:
        # Read-only beside the running daemon (the store is in WAL mode).
        uri = f"file:{self.root / 'var' / DB_FILE}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
            row = db.execute(
                "SELECT card FROM approval_requests WHERE id = ?", (approval_id,)
            ).fetchone()
        card = json.loads(row[0]) if row else {}
        return card if isinstance(card, dict) else {}

    async def card_outcome(self, chat: int, message_id: int, timeout: float = 30.0) -> list[str]:
        """Until the card was edited to its outcome; its visible lines then."""

        def decided() -> bool:
            return not self.telegram.shown(chat, message_id).buttons

        await self.telegram.wait_until(decided, timeout)
        return html_visible(self.telegram.shown(chat, message_id).text).splitlines()

    async def showing(
        self, chat: int, text: str, timeout: float = 30.0, *, part: bool = False
    ) -> SentMessage:
        """Until one of the bot's messages in the chat shows ``text`` (Telegram HTML, as the
        final answer is sent; with ``part``, shows it somewhere); the first that does."""

        def found() -> list[SentMessage]:
            if part:
                return [m for m in self.messages(chat) if text in m.shows[0]]
            return [m for m in self.messages(chat) if m.shows == shown_content(text, "HTML")]

        await self.telegram.wait_until(found, timeout)
        return found()[0]

    async def control(self, chat: int, timeout: float = 30.0) -> list[SentMessage]:
        """A control message in the chat and its answer (tests/support/control.py): once it
        is there, whatever the chat's earlier messages would cause has arrived too. Every
        message of the bot in the chat then, the control's answer last."""
        self.ask(chat, CONTROL)
        await self.showing(chat, CONTROL_ANSWER, timeout)
        return self.messages(chat)

    def logged(self) -> str:
        return "\n".join(daemon.text() for daemon in self.daemons)


@contextlib.asynccontextmanager
async def serving(world: ChatWorld) -> AsyncIterator[ChatWorld]:
    """The world's daemon from start to stop, which must end cleanly: exit 0, and a log with
    no traceback and none of the secrets (the bot token, the model key, ``extra_env``'s)."""
    await world.start()
    try:
        yield world
    finally:
        if world.running():
            assert world.daemon is not None
            code = await world.daemon.stop()
            assert code == 0, world.logged()[-3000:]
        logged = world.logged()
        assert "Traceback" not in logged, logged[-3000:]
        for secret in (world.telegram.token, TEST_KEY, *world.extra_env.values()):
            assert secret not in logged


def answers(messages: Sequence[SentMessage], text: str) -> list[SentMessage]:
    """The messages that show ``text`` (Telegram HTML), for counting how often it arrived."""
    return [m for m in messages if m.shows == shown_content(text, "HTML")]


def ever_showed(telegram: FakeTelegram, chat: int, text: str) -> list[int]:
    """The ids of every bot message in the chat that showed ``text`` at some point."""
    content = shown_content(text, "HTML")
    return [
        m.message_id
        for m in telegram.sent[chat]
        if any(v.shows == content for v in telegram.history(chat, m.message_id))
    ]


def json_arguments(summary_line: str) -> dict[str, Any]:
    """The arguments a card's "Arguments: {...}" line shows."""
    parsed = json.loads(summary_line.removeprefix("Arguments: "))
    assert isinstance(parsed, dict)
    return parsed
