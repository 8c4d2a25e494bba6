"""The world of tests/e2e/test_relay.py: one ``geodebot serve`` process on FakeTelegram and
FakeSlack at once, with a FakeLLMServer (anthropic protocol), and Thread Relay between the
chats.

Bindings: two Telegram chats (:data:`TG_A`, :data:`TG_B`) and a Slack channel
(:data:`SLACK_C`) in project ``ops``, and a Telegram chat (:data:`TG_X`) in project
``other``; each lists the four thread tools. Replies are not streamed, so every answer is one
message and the chats are easy to count.

The model is :class:`RelayModel`: it answers a control message (tests/support/control.py)
with the control's answer, and anything else by a script per prompt, round by round (round 0
the first call of the turn, 1 after the first tool results, ...), like ``ChatModel`` of
tests/support/chat_e2e_telegram.py. A prompt is scripted twice over: for a turn on a person's
message (:meth:`RelayModel.script`) and for a turn on a relayed ``ask`` that carries the same
text (:meth:`RelayModel.script_relayed`, told apart by :data:`RELAYED_MARK`).

:class:`Held` is a model answer held back until the test opens its gate (a turn held busy, a
send held after its read): :class:`GatedLLM` serves it. :class:`KillingSlack` SIGKILLs the
daemon the moment it posts a message that starts with a given text: the post is in the
channel, and the daemon never hears that it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from geodebot.config.schema import DB_FILE
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, CONTROL_ANSWER
from tests.support.daemon import CONNECTED_MARK, DaemonProcess
from tests.support.fakes.llm_server import (
    Call,
    Delay,
    Dialect,
    FakeLLMServer,
    Item,
    Reply,
    last_prompt,
)
from tests.support.fakes.slack_server import FakeSlack, Posted
from tests.support.fakes.telegram_server import FakeTelegram, SentMessage, html_visible
from tests.support.slack_world import new_ts

ROOT = Path(__file__).resolve().parents[2]
TOKEN_ENV = "RELAY_E2E_TELEGRAM_TOKEN"
BOT_TOKEN_ENV = "RELAY_E2E_SLACK_BOT"
APP_TOKEN_ENV = "RELAY_E2E_SLACK_APP"

ALICE, BOB = 4242, 5151  # Telegram users of the ops chats
SLACK_USER = "URELAYU01"  # who talks in the Slack channel
TG_A, TG_B, TG_X = -7101, -7102, -7109
SLACK_C = "C0RELAY01"
A, B, SLACK, OTHER = "ops-a", "ops-b", "ops-slack", "other-x"
THREAD_TOOLS = ("thread_list", "thread_status", "thread_read", "thread_send")
# [relay] envelope_ttl_s of the shared daemon: short, so that an expired read takes one
# wait of this long (test_relay.py's expiry test), and long enough for every other test's
# read to stay good until its send (a card pressed, a message answered in between).
ENVELOPE_TTL_S = 3.0
# The first line of the message a relayed "ask" starts its turn with.
RELAYED_MARK = "[Relayed from thread "
HOLD_LIMIT_S = 30.0


def attributed(source: str, where: str, user: str, text: str) -> str:
    """The post a delivery makes in its target chat."""
    return f"From #{source} ({where}), by @{user}:\n\n{text}"


# -- the model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held(Delay):
    """``then``, once ``gate`` is set (or after ``seconds`` at most, so nothing hangs)."""

    seconds: float = HOLD_LIMIT_S
    then: Item = field(default_factory=lambda: Reply("(held)"))
    gate: asyncio.Event = field(default_factory=asyncio.Event, compare=False)


class GatedLLM(FakeLLMServer):
    """A FakeLLMServer that serves :class:`Held` answers."""

    async def _render(
        self, request: web.Request, dialect: Dialect, body: dict[str, Any], item: Item
    ) -> web.StreamResponse:
        if isinstance(item, Held):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(item.gate.wait(), item.seconds)
            item = item.then
        return await super()._render(request, dialect, body, item)


@dataclass(frozen=True)
class Result:
    """A tool result as the model received it."""

    text: str
    is_error: bool

    def json(self) -> dict[str, Any]:
        try:
            parsed = json.loads(self.text)
        except ValueError:
            raise AssertionError(f"the tool result is not JSON: {self.text!r}") from None
        assert isinstance(parsed, dict), self.text
        return parsed

    @property
    def receipt(self) -> dict[str, Any]:
        receipt = self.json()["receipt"]
        assert isinstance(receipt, dict)
        return receipt


def tool_results(body: dict[str, Any]) -> list[Result]:
    """The tool results the request's newest message carries, in the calls' order."""
    content = body["messages"][-1]["content"]
    if isinstance(content, str):
        return []
    out = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "tool_result":
            continue
        raw = block.get("content")
        text = raw if isinstance(raw, str) else "".join(p.get("text", "") for p in raw or [])
        out.append(Result(text, bool(block.get("is_error"))))
    return out


def calls(tag: str, *made: tuple[str, dict[str, Any]]) -> Reply:
    """A model answer making the tool calls ``made`` (name, arguments) in one batch. Their ids
    are named after ``tag`` (unique per round of a script), so they stay the same if the
    answer is asked for again (after a restart)."""
    return Reply(
        tool_calls=[
            Call(name, arguments, id=f"toolu_{tag}_{i}") for i, (name, arguments) in enumerate(made)
        ]
    )


class RelayModel:
    """The fake model's responder; see the module's docstring. Every request is kept by its
    script in ``asked``, with the round it was in."""

    def __init__(self) -> None:
        self._scripts: dict[tuple[bool, str], Sequence[Item]] = {}
        self.asked: dict[tuple[bool, str], list[tuple[int, dict[str, Any]]]] = {}
        self.newest: list[str] = []  # the newest user text of every request, in order

    def script(self, prompt: str, *rounds: Item) -> None:
        """Answers for a turn on a person's message that contains ``prompt``."""
        self._scripts[(False, prompt)] = rounds
        self.asked[(False, prompt)] = []

    def script_relayed(self, prompt: str, *rounds: Item) -> None:
        """Answers for a turn on a relayed ``ask`` whose text contains ``prompt``."""
        self._scripts[(True, prompt)] = rounds
        self.asked[(True, prompt)] = []

    def __call__(self, body: dict[str, Any]) -> Item | None:
        text, rounds = last_prompt(body)
        self.newest.append(text)
        if rounds == 0 and text.strip().endswith(CONTROL):
            # Only the control itself: a read's result may quote a control in another thread
            # (tests/support/control.py's answer_controls would answer that request too).
            return Reply(CONTROL_ANSWER)
        relayed = text.startswith(RELAYED_MARK)
        for (for_relayed, prompt), items in self._scripts.items():
            if for_relayed == relayed and prompt in text:
                self.asked[(relayed, prompt)].append((rounds, body))
                return items[min(rounds, len(items) - 1)]
        return None

    def rounds(self, prompt: str, *, relayed: bool = False) -> list[int]:
        return [r for r, _ in self.asked.get((relayed, prompt), [])]

    def request(self, prompt: str, round_: int, *, relayed: bool = False) -> dict[str, Any]:
        """The first request of the prompt's turn in round ``round_``."""
        for r, body in self.asked.get((relayed, prompt), []):
            if r == round_:
                return body
        raise AssertionError(f"no request of {prompt!r} (relayed={relayed}) in round {round_}")

    def results(self, prompt: str, round_: int, *, relayed: bool = False) -> list[Result]:
        """The tool results the turn's request of round ``round_`` carried (those of the
        calls of round ``round_ - 1``)."""
        return tool_results(self.request(prompt, round_, relayed=relayed))

    async def until_round(
        self, prompt: str, round_: int, *, relayed: bool = False, timeout: float = 30.0
    ) -> None:
        async with asyncio.timeout(timeout):
            while True:
                # The server tells nobody; its requests are looked at until one is there.
                if round_ in self.rounds(prompt, relayed=relayed):
                    return
                await asyncio.sleep(0.02)


# -- the platforms ----------------------------------------------------------------------------
class KillingSlack(FakeSlack):
    """FakeSlack that SIGKILLs the daemon as it posts a message starting with a given text:
    the message is stored, and its answer never reaches the daemon."""

    def __init__(self) -> None:
        super().__init__()
        self.kill_at_post: tuple[int, str] | None = None  # (the daemon's pid, text prefix)

    def _m_chat_postMessage(self, args: dict[str, Any]) -> web.Response:
        response = super()._m_chat_postMessage(args)
        armed = self.kill_at_post
        if armed is not None and str(args.get("text") or "").startswith(armed[1]):
            self.kill_at_post = None
            os.kill(armed[0], signal.SIGKILL)
        return response


# -- the world ------------------------------------------------------------------------------
@dataclass
class RelayWorld:
    telegram: FakeTelegram
    slack: KillingSlack
    llm: GatedLLM
    root: Path
    model: RelayModel = field(default_factory=RelayModel)
    daemon: DaemonProcess | None = None
    daemons: list[DaemonProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.llm.responder = self.model

    @property
    def db(self) -> Path:
        return self.root / "var" / DB_FILE

    @property
    def config_path(self) -> Path:
        return self.root / "config.toml"

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.update({TOKEN_ENV: self.telegram.token, TEST_KEY_ENV: TEST_KEY})
        env.update({BOT_TOKEN_ENV: self.slack.bot_token, APP_TOKEN_ENV: self.slack.app_token})
        env.pop("GEODEBOT_CONFIG", None)
        return env

    def write_config(self) -> Path:
        tools = ", ".join(f'"{t}"' for t in THREAD_TOOLS)

        def binding(platform: str, channel: str, session: str, project: str, users: str) -> str:
            return (
                f'\n[[bindings]]\nplatform = "{platform}"\nchannel = "{channel}"\n'
                f'session = "{session}"\nproject = "{project}"\nallowed_users = [{users}]\n'
                f"tools = [{tools}]\nstream = false\n"
            )

        people = f'"{ALICE}", "{BOB}"'
        self.config_path.write_text(
            f'[daemon]\nstate_dir = "{self.root / "var"}"\nshutdown_grace_s = 5\n'
            "user_rate_per_min = 0\n"
            f'[model]\nprovider = "anthropic"\nname = "relay-e2e-model"\n'
            f'base_url = "{self.llm.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            "request_timeout_s = 60\n"
            f'[tools]\nipc_tools = ["get_time"]\nworkspace = "{self.root / "ws"}"\n'
            f"[relay]\nenvelope_ttl_s = {ENVELOPE_TTL_S}\n"
            f'[channels.telegram]\ntoken_env = "{TOKEN_ENV}"\n'
            f'api_base_url = "{self.telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f'[channels.slack]\nbot_token_env = "{BOT_TOKEN_ENV}"\n'
            f'app_token_env = "{APP_TOKEN_ENV}"\napi_base_url = "{self.slack.api_base_url}"\n'
            + binding("telegram", str(TG_A), A, "ops", people)
            + binding("telegram", str(TG_B), B, "ops", people)
            + binding("slack", SLACK_C, SLACK, "ops", f'"{SLACK_USER}"')
            + binding("telegram", str(TG_X), OTHER, "other", people)
        )
        return self.config_path

    async def start(self) -> DaemonProcess:
        """A daemon on the world's state directory (the same one after a kill), once every
        channel is connected."""
        daemon = DaemonProcess(self.write_config(), self.env())
        self.daemons.append(daemon)
        self.daemon = await daemon.start()
        await daemon.wait_for_line(CONNECTED_MARK, timeout_s=30)
        return daemon

    def running(self) -> bool:
        proc = None if self.daemon is None else self.daemon.proc
        return proc is not None and proc.returncode is None

    def kill_at_slack_post(self, prefix: str) -> None:
        """SIGKILL the daemon as it posts a Slack message starting with ``prefix``."""
        assert self.daemon is not None
        assert self.daemon.proc is not None
        self.slack.kill_at_post = (self.daemon.proc.pid, prefix)

    def logged(self) -> str:
        return "\n".join(daemon.text() for daemon in self.daemons)

    # -- talking ----------------------------------------------------------------------------
    def say(self, chat: int, text: str, *, user: int = ALICE) -> int:
        """A person writes in a Telegram chat; the update id."""
        return self.telegram.push_message(chat, text, user_id=user)

    async def say_slack(self, text: str, *, user: str = SLACK_USER) -> str:
        """A person writes in the Slack channel; its ts once the daemon acknowledged it."""
        ts = new_ts()
        event = FakeSlack.message_event(SLACK_C, user, text, ts=ts)
        envelope = await self.slack.push_event(event)
        await self.slack.wait_for_ack(envelope, timeout=15)
        return ts

    # -- what the chats show ----------------------------------------------------------------
    def tg(self, chat: int) -> list[SentMessage]:
        """The bot's messages in a Telegram chat, each as it reads now."""
        return [self.telegram.shown(chat, m.message_id) for m in self.telegram.sent[chat]]

    def tg_texts(self, chat: int) -> list[str]:
        """What the bot's messages in the chat show (visible text)."""
        return [html_visible(m.text) if m.parse_mode == "HTML" else m.text for m in self.tg(chat)]

    def slack_posts(self) -> list[Posted]:
        return list(self.slack.posted.get(SLACK_C, []))

    def slack_texts(self) -> list[str]:
        return [_unescape(p.text) for p in self.slack_posts()]

    async def until(
        self, check: Callable[[], object], what: str | Callable[[], str], timeout: float = 30.0
    ) -> None:
        """Until ``check()`` holds; else fails saying ``what`` and the daemon's last lines."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    # The store and the fakes' records are looked at until ``check`` holds
                    # (the store tells nobody; a few checks span several fakes).
                    if check():
                        return
                    await asyncio.sleep(0.02)
        except TimeoutError:
            tail = "\n".join(self.daemon.log[-40:]) if self.daemon is not None else ""
            said = what() if callable(what) else what
            raise AssertionError(f"timed out waiting for {said}\n{tail}") from None

    async def tg_showing(
        self, chat: int, text: str, timeout: float = 30.0, *, part: bool = False
    ) -> None:
        """Until one of the bot's messages in the chat shows ``text`` (with ``part``: shows
        it somewhere)."""
        await self.until(
            lambda: any(text in t if part else text == t for t in self.tg_texts(chat)),
            lambda: f"{text!r} in chat {chat}, which shows {self.tg_texts(chat)}",
            timeout,
        )

    async def slack_showing(self, text: str, timeout: float = 30.0) -> None:
        await self.until(
            lambda: text in self.slack_texts(),
            lambda: f"{text!r} in Slack, which shows {self.slack_texts()}",
            timeout,
        )

    async def tg_control(self, chat: int) -> list[str]:
        """A control message in the Telegram chat, and its answer (tests/support/control.py):
        whatever the chat's earlier messages cause has arrived by then. The chat's texts."""
        before = self.tg_texts(chat).count(CONTROL_ANSWER)
        self.say(chat, CONTROL)
        await self.until(
            lambda: self.tg_texts(chat).count(CONTROL_ANSWER) > before,
            f"the control's answer in chat {chat}",
        )
        return self.tg_texts(chat)

    async def slack_control(self) -> list[str]:
        """A control message in the Slack channel, and its answer. The channel's texts."""
        before = self.slack_texts().count(CONTROL_ANSWER)
        await self.say_slack(CONTROL)
        await self.until(
            lambda: self.slack_texts().count(CONTROL_ANSWER) > before,
            "the control's answer in Slack",
        )
        return self.slack_texts()

    # -- the store --------------------------------------------------------------------------
    def stored(self, sql: str, *params: object) -> list[tuple[Any, ...]]:
        """Rows of a read-only query on the daemon's store (WAL: beside the running daemon)."""
        uri = f"file:{self.db}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
            return db.execute(sql, params).fetchall()

    def delivery(self, delivery_id: str) -> dict[str, Any]:
        """A relay_deliveries row by id, as a dict of its columns."""
        uri = f"file:{self.db}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
            db.row_factory = sqlite3.Row
            row = db.execute("SELECT * FROM relay_deliveries WHERE id = ?", (delivery_id,))
            found = row.fetchone()
        assert found is not None, f"no relay delivery {delivery_id}"
        return dict(found)

    def in_flight(self, source: str) -> int:
        """Deliveries from ``source`` the target has not taken yet (as the relay counts)."""
        [(count,)] = self.stored(
            "SELECT COUNT(*) FROM relay_deliveries AS d "
            "LEFT JOIN inbox AS i ON i.id = d.inbox_id "
            "LEFT JOIN outbox AS o ON o.id = d.outbox_id "
            "WHERE d.source_session = ? AND d.state = 'delivered' "
            "AND (i.status IN ('pending', 'running') OR o.status = 'pending')",
            source,
        )
        return int(count)

    async def until_taken(self, source: str, timeout: float = 30.0) -> None:
        """Until every delivery from ``source`` was taken: recorded or answered, and posted."""
        await self.until(
            lambda: self.in_flight(source) == 0, f"the deliveries of {source} taken", timeout
        )

    def history(self, session: str) -> list[tuple[str, str]]:
        """(role, content JSON) of the session's stored messages, in order."""
        rows = self.stored(
            "SELECT role, content FROM messages WHERE session_id = ? ORDER BY seq", session
        )
        return [(str(role), str(content)) for role, content in rows]


def _unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
