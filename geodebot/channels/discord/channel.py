"""The Discord adapter as geodebot's :class:`Channel`: builds the role objects around one
shared state and hands each call to the role that does it."""

from __future__ import annotations

from collections.abc import Sequence

from geodebot.channels.base import (
    SENDING_ONLY,
    ChannelStatus,
    CursorStore,
    OutboundPart,
    Platform,
    SentPart,
)
from geodebot.channels.discord.cards import DiscordCards
from geodebot.channels.discord.files import DiscordFiles
from geodebot.channels.discord.ingest import DiscordIngest
from geodebot.channels.discord.send import DiscordSender
from geodebot.channels.discord.state import DiscordState
from geodebot.channels.roles import RoleChannel
from geodebot.config.schema import DiscordConfig


class DiscordChannel(RoleChannel):
    _ingest: DiscordIngest
    _sender: DiscordSender
    _cards: DiscordCards
    _files: DiscordFiles

    def __init__(
        self,
        config: DiscordConfig,
        token: str,
        *,
        bound_channels: Sequence[str] = (),
        cursor_store: CursorStore | None = None,
        ingest_later: bool = False,
    ) -> None:
        """``ingest_later``: ``start`` only logs in; see the ``ingest`` module's doc."""
        self._state = DiscordState(
            config, token, bound_channels=bound_channels, cursor_store=cursor_store
        )
        self._files = DiscordFiles(self._state)
        self._sender = DiscordSender(self._state, upload=self._files.upload)
        self._cards = DiscordCards(self._state)
        self._ingest = DiscordIngest(
            self._state, on_press=self._cards.on_press, ingest_later=ingest_later
        )

    @property
    def platform(self) -> Platform:
        return "discord"

    @property
    def ingesting(self) -> bool:
        """The gateway is this channel's (connected once, and kept by discord.py)."""
        return self._state.ingesting

    async def start_ingest(self) -> None:
        """Mark first runs, connect the gateway, wait for READY, register slash commands."""
        await self._ingest.start_ingest()

    async def send(self, part: OutboundPart) -> SentPart:
        return await self._sender.send(part)

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        return await self._sender.find_sent(part)

    def status(self) -> ChannelStatus:
        state = self._state
        client = state.client
        up = client is not None and not client.is_closed()
        if state.ingesting or state.runner is not None:
            connected = up and client is not None and client.is_ready()
            detail = state.last_error
        else:  # logged in over REST only
            connected = up and client is not None and client.user is not None
            detail = state.last_error or (SENDING_ONLY if connected else "")
        return ChannelStatus("discord", connected, detail, dict(state.counters))
