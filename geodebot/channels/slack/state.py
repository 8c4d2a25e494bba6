"""What the roles of one Slack adapter share: its settings, the SDK client and HTTP session
once started, who the bot is, the counters, and the work still in flight."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from slack_sdk.web.async_client import AsyncWebClient

from geodebot.channels.base import ChannelError, PressSink
from geodebot.config.schema import SlackConfig

# What status() reports, all from zero at construction.
COUNTERS = (
    "received", "delivered", "ignored", "duplicates", "sink_errors", "errors", "sent",
    "send_errors", "presses", "press_errors", "edited", "edits_gone", "downloads",
    "download_errors", "uploads",
)  # fmt: skip


class SlackState:
    """One adapter's shared state; each role object holds the same instance."""

    def __init__(
        self, config: SlackConfig, *, bot_token: str, app_token: str, request_timeout_s: float
    ) -> None:
        self.config = config
        self.bot_token = bot_token
        self.app_token = app_token
        self.request_timeout = request_timeout_s
        self.session: aiohttp.ClientSession | None = None
        self.client: AsyncWebClient | None = None
        self.presses: PressSink | None = None
        self.bot_user_id = ""
        self.bot_id: str | None = None
        # Sink calls and press answers: stop() gives them a moment before cutting them off.
        self.inflight: set[asyncio.Task[Any]] = set()
        self.stopping = False
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def open_client(self) -> AsyncWebClient:
        """The HTTP session and the Web API client; called from within the running loop."""
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.request_timeout)
        )
        self.client = AsyncWebClient(
            token=self.bot_token,
            base_url=self.config.api_base_url,
            session=self.session,
            retry_handlers=[],
        )
        return self.client

    async def close_client(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await session.close()
        self.client = None

    def require_client(self) -> AsyncWebClient:
        if self.client is None:
            raise ChannelError("Slack channel is not started")
        return self.client

    def require_session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise ChannelError("Slack channel is not started")
        return self.session
