"""The Telegram adapter as geodebot's :class:`Channel`: builds the role objects around one
shared state and hands each call to the role that does it."""

from __future__ import annotations

from geodebot.channels.base import (
    ChannelStatus,
    CursorStore,
    OutboundPart,
    Platform,
    SentPart,
)
from geodebot.channels.roles import RoleChannel
from geodebot.channels.telegram.cards import TelegramCards
from geodebot.channels.telegram.files import TelegramFiles
from geodebot.channels.telegram.ingest import TelegramIngest
from geodebot.channels.telegram.send import TelegramSender
from geodebot.channels.telegram.state import TelegramState
from geodebot.config.schema import TelegramConfig


class TelegramChannel(RoleChannel):
    """The Telegram adapter. It has no ``find_sent``: the Bot API cannot look a sent
    message up, so callers that check for :class:`Lookups` leave it be."""

    _ingest: TelegramIngest
    _sender: TelegramSender
    _cards: TelegramCards
    _files: TelegramFiles

    def __init__(
        self,
        config: TelegramConfig,
        token: str,
        *,
        cursor_store: CursorStore | None = None,
        webhook_secret: str | None = None,
        ingest_later: bool = False,
    ) -> None:
        """``webhook_secret`` is required with ``config.webhook_url``; ``ingest_later``:
        ``start`` leaves polling, setWebhook, deleteWebhook and setMyCommands to
        :meth:`start_ingest` (see geodebot.channels.telegram.ingest)."""
        if config.webhook_url is not None and not webhook_secret:
            raise ValueError("a webhook needs its secret token")
        self._state = TelegramState(
            config, token, cursor_store=cursor_store, webhook_secret=webhook_secret
        )
        self._files = TelegramFiles(self._state)
        self._sender = TelegramSender(self._state, self._files)
        self._cards = TelegramCards(self._state, self._sender)
        self._ingest = TelegramIngest(
            self._state, on_press=self._cards.press, ingest_later=ingest_later
        )

    @property
    def platform(self) -> Platform:
        return "telegram"

    @property
    def bot_username(self) -> str | None:
        return self._state.bot_username

    @property
    def ingesting(self) -> bool:
        """Polling, or registered as the webhook's address (not only listening)."""
        return self._ingest.ingesting

    @property
    def webhook_port(self) -> int:
        """The port the webhook server listens on (webhook_listen's, or the one port 0 got)."""
        webhook = self._ingest.webhook
        return 0 if webhook is None else webhook.port

    async def start_ingest(self) -> None:
        """Poll (or register the webhook) and register the commands."""
        await self._ingest.start_ingest()

    async def send(self, part: OutboundPart) -> SentPart:
        """Send the part, or edit ``part.edit_of`` to it (a streamed preview it replaces)."""
        return await self._sender.send(part)

    def status(self) -> ChannelStatus:
        state = self._state
        counters = dict(state.counters)
        webhook = self._ingest.webhook
        if webhook is not None:
            counters.update({f"webhook_{k}": v for k, v in webhook.counters.items()})
        return ChannelStatus("telegram", state.connected, state.detail, counters)
