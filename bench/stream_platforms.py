"""The three chat platforms as ``bench/stream_bench.py`` drives them: a fake per platform that
notes when each request showing a bot message arrived, the platform's part of the config,
and the platform's own rate limit on those requests.

Each fake is the one the tests use (``tests.support.fakes``), subclassed only to time the
requests: on arrival, before they are handled, so a request the platform refuses still
counts, as it would against a real limit. Chats are named by strings on every platform.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Self

from aiohttp import web
from telegram_bench import DISCORD_TOKEN_ENV, SLACK_APP_ENV, SLACK_BOT_ENV, TOKEN_ENV, USER

from geodebot.channels.render import LIMITS
from geodebot.chat.stream import PREVIEW_ROOM
from tests.support.fakes.discord_server import FakeDiscord, Json
from tests.support.fakes.slack_server import FakeSlack
from tests.support.fakes.telegram_server import FakeTelegram


@dataclass(frozen=True)
class Shown:
    """A request that posts or edits one of the bot's messages."""

    at: float  # time.monotonic() when the fake received it
    edit: bool


@dataclass(frozen=True)
class RateLimit:
    """A platform's limit on the requests that show an answer, as the platform states it."""

    requests: int  # at most this many ...
    window_s: float  # ... in any window this long,
    per: str  # per chat or per channel,
    counted: str  # of these requests;
    edits_only: bool  # a new message does not count (its route has a limit of its own)
    # The final answer's request may come on top: a limit stated as a rate that tolerates
    # short bursts lets it through, a hard bucket does not (0).
    final_extra: int
    stated: str

    @property
    def per_s(self) -> float:
        return self.requests / self.window_s

    def counts(self, request: Shown) -> bool:
        return request.edit or not self.edits_only


class Requests:
    """Per chat, every request that showed a bot message, in the order they arrived."""

    def __init__(self) -> None:
        self.by_chat: defaultdict[str, list[Shown]] = defaultdict(list)

    def note(self, chat: object, *, edit: bool) -> None:
        self.by_chat[str(chat)].append(Shown(time.monotonic(), edit))


class ChatPlatform(Protocol):
    """One platform under the bench: its fake running (an async context manager), a chat
    for each role, the lines that connect the daemon to the fake, and what the chats show."""

    name: str
    limit: RateLimit
    user: str  # the one sender, allowed on every binding
    requests: Requests

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    def chat(self, index: int) -> str:
        """The ``index``-th chat of the bench (0 up to the count it was made for)."""
        ...

    def config(self) -> list[str]: ...

    def env(self) -> dict[str, str]: ...

    async def push(self, chat: str, text: str) -> None:
        """The user writes ``text`` in ``chat``."""
        ...

    def texts(self, chat: str) -> list[str]:
        """What each of the bot's messages in ``chat`` reads now, oldest first."""
        ...


def preview_chars(platform: str) -> int:
    """The longest answer a platform's preview shows whole (the rest of the platform's
    message limit is room the preview keeps for a progress line)."""
    return LIMITS[platform] - PREVIEW_ROOM


# -- Telegram ---------------------------------------------------------------------------------
class TimedTelegram(FakeTelegram):
    def __init__(self) -> None:
        super().__init__()
        self.shows = Requests()

    async def _m_sendmessage(self, params: dict[str, Any]) -> Any:
        self.shows.note(int(params["chat_id"]), edit=False)
        return await super()._m_sendmessage(params)

    async def _m_editmessagetext(self, params: dict[str, Any]) -> Any:
        self.shows.note(int(params.get("chat_id", 0)), edit=True)
        return await super()._m_editmessagetext(params)


class TelegramChats:
    name = "telegram"
    limit = RateLimit(
        1, 1.0, "chat", "messages and edits", False, 1, "about 1 message per second per chat"
    )
    user = str(USER)
    CHAT_BASE = -300_000

    def __init__(self, chats: int) -> None:
        self.fake = TimedTelegram()
        self.requests = self.fake.shows

    async def __aenter__(self) -> Self:
        await self.fake.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.fake.close()

    def chat(self, index: int) -> str:
        return str(self.CHAT_BASE - index)

    def config(self) -> list[str]:
        return [
            "[channels.telegram]",
            f'token_env = "{TOKEN_ENV}"',
            f'api_base_url = "{self.fake.api_base_url}"',
            "poll_timeout_s = 1",
        ]

    def env(self) -> dict[str, str]:
        return {TOKEN_ENV: self.fake.token}

    async def push(self, chat: str, text: str) -> None:
        self.fake.push_message(int(chat), text, user_id=int(self.user))

    def texts(self, chat: str) -> list[str]:
        sent = self.fake.sent[int(chat)]
        return [self.fake.shown(int(chat), m.message_id).shows[0] for m in sent]


# -- Slack ------------------------------------------------------------------------------------
class TimedSlack(FakeSlack):
    def __init__(self) -> None:
        super().__init__()
        self.shows = Requests()

    def _m_chat_postMessage(self, args: dict[str, Any]) -> web.Response:
        self.shows.note(args.get("channel"), edit=False)
        return super()._m_chat_postMessage(args)

    def _m_chat_update(self, args: dict[str, Any]) -> web.Response:
        self.shows.note(args.get("channel"), edit=True)
        return super()._m_chat_update(args)


class SlackChats:
    name = "slack"
    limit = RateLimit(
        1,
        1.0,
        "channel",
        "posts and updates",
        False,
        1,
        "chat.update about 1 per second per channel (Tier 3, and per channel)",
    )
    user = "UBENCH001"

    def __init__(self, chats: int) -> None:
        self.fake = TimedSlack()
        self.requests = self.fake.shows
        self._last_ts = 0.0

    async def __aenter__(self) -> Self:
        await self.fake.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.fake.stop()

    def chat(self, index: int) -> str:
        return f"CBENCH{index:05d}"

    def config(self) -> list[str]:
        return [
            "[channels.slack]",
            f'bot_token_env = "{SLACK_BOT_ENV}"',
            f'app_token_env = "{SLACK_APP_ENV}"',
            f'api_base_url = "{self.fake.api_base_url}"',
        ]

    def env(self) -> dict[str, str]:
        return {SLACK_BOT_ENV: self.fake.bot_token, SLACK_APP_ENV: self.fake.app_token}

    async def push(self, chat: str, text: str) -> None:
        # Slack's ts names the message (the adapter claims it): unique, and increasing.
        self._last_ts = max(time.time(), self._last_ts + 0.000_001)
        event = FakeSlack.message_event(chat, self.user, text, ts=f"{self._last_ts:.6f}")
        await self.fake.push_event(event)

    def texts(self, chat: str) -> list[str]:
        return [p.text for p in self.fake.posted.get(chat, [])]


# -- Discord ----------------------------------------------------------------------------------
class TimedDiscord(FakeDiscord):
    """The Discord fake with a guild text channel for each of ``channels``."""

    def __init__(self, channels: list[str]) -> None:
        super().__init__()
        self.shows = Requests()
        self.extra_channels = tuple(channels)

    def _in_guild(self, channel_id: str) -> bool:
        return channel_id in self.extra_channels or super()._in_guild(channel_id)

    def _guild(self) -> Json:
        guild = super()._guild()
        ops = guild["channels"][0]
        extra = [ops | {"id": cid, "name": f"bench-{cid[-5:]}"} for cid in self.extra_channels]
        return guild | {"channels": [ops, *extra]}

    async def _create_message(self, request: web.Request) -> web.StreamResponse:
        self.shows.note(request.match_info["cid"], edit=False)
        return await super()._create_message(request)

    async def _edit_message(self, request: web.Request) -> web.StreamResponse:
        self.shows.note(request.match_info["cid"], edit=True)
        return await super()._edit_message(request)


class DiscordChats:
    name = "discord"
    limit = RateLimit(
        5, 5.0, "channel", "edits", True, 0, "5 message edits per 5 s per channel (a bucket)"
    )
    user = "700000000000004242"
    CHANNEL_BASE = 910_000_000_000_000_000

    def __init__(self, chats: int) -> None:
        # Every channel is in the guild when the daemon connects: the guild lists them.
        self.fake = TimedDiscord([self.chat(i) for i in range(chats)])
        self.requests = self.fake.shows

    async def __aenter__(self) -> Self:
        await self.fake.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.fake.__aexit__(None, None, None)

    def chat(self, index: int) -> str:
        return str(self.CHANNEL_BASE + index)

    def config(self) -> list[str]:
        return [
            "[channels.discord]",
            f'token_env = "{DISCORD_TOKEN_ENV}"',
            f'api_base_url = "{self.fake.api_base_url}"',
            f'gateway_url = "{self.fake.gateway_url}"',
        ]

    def env(self) -> dict[str, str]:
        return {DISCORD_TOKEN_ENV: self.fake.token}

    async def push(self, chat: str, text: str) -> None:
        self.fake.push_message(chat, text, author_id=self.user)

    def texts(self, chat: str) -> list[str]:
        bot = self.fake.bot_id
        return [str(m["content"]) for m in self.fake.history[chat] if m["author"]["id"] == bot]


# Each made for a number of chats.
PLATFORMS: dict[str, Callable[[int], ChatPlatform]] = {
    "telegram": TelegramChats,
    "slack": SlackChats,
    "discord": DiscordChats,
}
