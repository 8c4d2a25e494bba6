"""What the roles of one Telegram adapter share: the settings, the Bot and its three request
pools, who the bot is, the counters and the connection status, plus the request helpers every
role posts through (addressing a chat, reading a new message's id)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta

from telegram import Bot, LinkPreviewOptions, ReplyParameters, User
from telegram import error as tg
from telegram.request import BaseRequest, RequestData
from telegram.request._requestparameter import RequestParameter  # what Bot._post builds

from geodebot.channels.base import ChannelError, CursorStore, Destination, PressSink, SentPart
from geodebot.channels.telegram.request import AiohttpRequest
from geodebot.config.schema import TelegramConfig
from geodebot.logs.redact import Redactor

# PTB 22 warns (PTBDeprecationWarning) whenever an int-valued period is read, and RetryAfter's
# own constructor reads one: every 429 warned. Opting in to the timedelta values PTB 23 will
# use anyway silences that; only this adapter reads PTB objects.
os.environ.setdefault("PTB_TIMEDELTA", "true")

log = logging.getLogger(__name__)

ENTITY_ERROR = "can't parse entities"
NOT_MODIFIED = "message is not modified"
NO_LINK_PREVIEW = LinkPreviewOptions(is_disabled=True)
# What status() reports, all from zero at construction.
COUNTERS = (
    "received", "delivered", "skipped", "sink_errors", "poll_errors", "sent",
    "send_errors", "plain_fallbacks", "presses", "press_errors", "downloads",
    "download_errors", "uploads",
)  # fmt: skip


class TelegramState:
    """One adapter's shared state; each role object holds the same instance."""

    def __init__(
        self,
        config: TelegramConfig,
        token: str,
        *,
        cursor_store: CursorStore | None,
        webhook_secret: str | None,
    ) -> None:
        self.config = config
        self.cursors = cursor_store
        self.redactor = Redactor([token, *([webhook_secret] if webhook_secret else [])])
        self.webhook_secret = webhook_secret or ""
        # One connection for the long poll; PTB adds poll_timeout_s to its read timeout.
        self.poll_request = AiohttpRequest(connection_pool_size=1, connect_timeout=10.0)
        # A slow answer to sendMessage becomes an unknown outcome, so be patient with it.
        self.request = AiohttpRequest(
            connection_pool_size=8, read_timeout=20.0, connect_timeout=10.0
        )
        # Downloads of users' files, apart so a large one never holds up a reply.
        self.download_request = AiohttpRequest(
            connection_pool_size=4, read_timeout=30.0, connect_timeout=10.0
        )
        self.bot = Bot(
            token,
            base_url=config.api_base_url,
            # PTB appends the token, as to base_url: the file URLs carry it.
            base_file_url=config.file_base_url,
            get_updates_request=self.poll_request,
            request=self.request,
        )
        self.me: User | None = None
        self.presses: PressSink | None = None
        self.stopping = False
        self.connected = False
        self.detail = "not started"
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    @property
    def requests(self) -> tuple[AiohttpRequest, ...]:
        return (self.poll_request, self.request, self.download_request)

    @property
    def bot_username(self) -> str | None:
        return None if self.me is None else self.me.username

    def safe(self, exc: BaseException | None) -> str:
        """The error's text with the token and the webhook secret taken out."""
        return self.redactor.redact(str(exc))

    async def post_message(
        self, method: str, fields: Mapping[str, object], read_timeout: float | None = None
    ) -> SentPart:
        """Post a message-making method through PTB's request layer; the new message's id."""
        data = RequestData([RequestParameter.from_input(k, v) for k, v in fields.items()])
        result = await self.request.post(
            f"{self.bot.base_url}/{method}",
            data,
            read_timeout=BaseRequest.DEFAULT_NONE if read_timeout is None else read_timeout,
        )
        message_id = result.get("message_id") if isinstance(result, dict) else None
        if not isinstance(message_id, int):
            # Telegram said ok, so the message is posted; sending it again would repeat it.
            log.warning("telegram: %s answered without a message id: %.200r", method, result)
            return SentPart("")
        return SentPart(str(message_id))


def retry_seconds(exc: tg.RetryAfter) -> float:
    value = exc.retry_after
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def chat_id(channel: str) -> int | str:
    try:
        return int(channel)
    except ValueError:
        return channel  # "@channelusername"


def addressed(dest: Destination) -> dict[str, object]:
    """A send's chat, topic and reply fields; a reply to a message gone is sent anyway."""
    try:
        thread = int(dest.thread) if dest.thread else None
        reply = int(dest.reply_to) if dest.reply_to else None
    except ValueError:
        raise ChannelError(f"telegram: not a message id: {dest}", permanent=True) from None
    fields: dict[str, object] = {"chat_id": chat_id(dest.channel)}
    if thread is not None:
        fields["message_thread_id"] = thread
    if reply is not None:
        fields["reply_parameters"] = ReplyParameters(reply, allow_sending_without_reply=True)
    return fields
