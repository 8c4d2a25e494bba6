"""The Slack adapter as geodebot's :class:`Channel`: builds the role objects around one shared
state and hands each call to the role that does it."""

from __future__ import annotations

from geodebot.channels.base import (
    ChannelStatus,
    OutboundPart,
    Platform,
    SentPart,
)
from geodebot.channels.roles import RoleChannel
from geodebot.channels.slack.cards import SlackCards
from geodebot.channels.slack.files import SlackFiles
from geodebot.channels.slack.ingest import SlackIngest
from geodebot.channels.slack.send import SlackSender
from geodebot.channels.slack.state import SlackState
from geodebot.config.schema import SlackConfig


class SlackChannel(RoleChannel):
    """The Slack adapter; tokens are resolved by the caller (``config.*_env`` name them)."""

    _ingest: SlackIngest
    _sender: SlackSender
    _cards: SlackCards
    _files: SlackFiles

    def __init__(
        self,
        config: SlackConfig,
        *,
        bot_token: str,
        app_token: str,
        ping_interval_s: float = 10.0,
        request_timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        stop_grace_s: float = 2.0,
    ) -> None:
        self._state = SlackState(
            config, bot_token=bot_token, app_token=app_token, request_timeout_s=request_timeout_s
        )
        self._sender = SlackSender(self._state)
        self._cards = SlackCards(self._state)
        self._files = SlackFiles(self._state)
        self._ingest = SlackIngest(
            self._state,
            on_press=self._cards.answer_later,
            ping_interval_s=ping_interval_s,
            connect_timeout_s=connect_timeout_s,
            stop_grace_s=stop_grace_s,
        )

    @property
    def platform(self) -> Platform:
        return "slack"

    @property
    def bot_user_id(self) -> str:
        return self._state.bot_user_id

    @property
    def ingesting(self) -> bool:
        """Whenever started: Slack spreads events over every replica's connection."""
        return self._ingest.ingesting

    async def start_ingest(self) -> None:
        """Nothing to add: ``start`` already opened the Socket Mode connection."""

    async def send(self, part: OutboundPart) -> SentPart:
        if part.file is not None:
            return await self._files.upload(part, part.file)
        return await self._sender.send(part)

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        return await self._sender.find_sent(part)

    def status(self) -> ChannelStatus:
        state = self._state
        detail = f"bot {state.bot_user_id}" if state.bot_user_id else "not started"
        return ChannelStatus("slack", self._ingest.connected, detail, dict(state.counters))
