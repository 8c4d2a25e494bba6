"""Telegram adapter: python-telegram-bot's ``Bot`` with a polling loop of our own.

Not ``Application``/``Updater``: their updater asks for the next batch (which confirms the
previous one to Telegram) before the handlers ran, so a crash loses messages. Here an update is
confirmed only after the sink committed it: the next ``getUpdates`` offset moves past it then,
and the offset is persisted so a restart resumes right after the last committed update.
Anything not committed is simply delivered again by Telegram. A press of an approval card's
button (a callback query) goes the same way: handed to the press sink, answered, then confirmed.

Webhook mode (``webhook_url`` set) replaces the poller: Telegram POSTs each update to the
channel's own server (telegram_webhook.py), which answers 200 only once the update went the
same way as a polled one (committed, or a press handled), so Telegram delivers again what was
not. The channel registers its address with setWebhook when it starts. Going back to
polling removes the webhook first (deleteWebhook), since Telegram refuses getUpdates while one
is set.

Taking in later (``ingest_later=True``, for a replica while another one takes in): ``start``
only initializes the bot (getMe), so it can send, edit, upload, download and answer presses;
in webhook mode it listens too (every replica behind the proxy commits what it is sent).
Nothing is registered, removed or polled until :meth:`TelegramChannel.start_ingest`: the
poller (one per token) or setWebhook, and the commands, are one replica's at a time.

Files: a message's photo or document becomes an :class:`InboundFile` carrying its file_id;
nothing is fetched until ``download`` (getFile, then the file URL under ``file_base_url``,
read with a cap). That URL holds the bot token in its path: it is built here, fetched, and
never put in a log line or an error text. Uploads go by sendPhoto (small images) or
sendDocument.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import mimetypes
import os
import random
import re
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from telegram import (
    Bot,
    BotCommand,
    CallbackQuery,
    InlineKeyboardButton,
    InlineKeyboardMarkup,
    InputFile,
    LinkPreviewOptions,
    Message,
    MessageEntity,
    ReplyParameters,
    Update,
    User,
)
from telegram import error as tg
from telegram.constants import CallbackQueryLimit, ChatAction, ChatType, MessageLimit, ParseMode
from telegram.request import BaseRequest, RequestData
from telegram.request._requestparameter import RequestParameter  # what Bot._post builds

from geodebot.channels.base import (
    CHAT_COMMANDS,
    SENDING_ONLY,
    TELEGRAM_PHOTO_LIMIT,
    UPLOAD_LIMITS,
    ApprovalCard,
    ChannelError,
    ChannelStatus,
    CursorStore,
    Destination,
    FileTooLarge,
    Inbound,
    InboundFile,
    InboundSink,
    OutboundFile,
    OutboundPart,
    Platform,
    Press,
    PressSink,
    SendUnknown,
    SentPart,
    parse_press_data,
    press_data,
)
from geodebot.channels.render import render_for
from geodebot.channels.telegram_request import AiohttpRequest, never_sent
from geodebot.config.schema import TelegramConfig
from geodebot.logs.redact import Redactor
from geodebot.store.records import StoreError

if TYPE_CHECKING:
    from geodebot.channels.telegram_webhook import WebhookServer

# PTB 22 warns (PTBDeprecationWarning) whenever an int-valued period is read, and RetryAfter's
# own constructor reads one: every 429 warned. Opting in to the timedelta values PTB 23 will
# use anyway silences that; only this adapter reads PTB objects.
os.environ.setdefault("PTB_TIMEDELTA", "true")

log = logging.getLogger(__name__)

CURSOR_NAME = "telegram:offset"
# Channel posts count as messages; edits would re-run a turn for an old message. Callback
# queries are presses of an approval card's buttons.
ALLOWED_UPDATES: tuple[str, ...] = ("message", "channel_post", "callback_query")
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0
_RAW_TIMEOUT_S = 15.0
_STOP_GRACE_S = 5.0
# Telegram picks a random next update_id after a week without updates; an offset that old may
# lie above the new ids, and passing it would confirm (drop) them unseen.
_CURSOR_MAX_AGE_S = 6 * 86_400
_ENTITY_ERROR = "can't parse entities"
_NOT_MODIFIED = "message is not modified"
# What Telegram answers an edit of a message that is gone (deleted by someone) or that it
# will not change any more: the part then goes out as a new message, so it is not lost.
_EDIT_GONE = ("message to edit not found", "message_id_invalid", "message can't be edited")
_NO_LINK_PREVIEW = LinkPreviewOptions(is_disabled=True)
# sendPhoto takes these; Telegram recompresses them to JPEG. Anything else goes as a document.
_PHOTO_TYPES = frozenset({"image/jpeg", "image/png", "image/webp"})
# What sendPhoto answers an image it will not take as a photo (too long and thin, say); the
# file then goes as a document, which Telegram takes as it is.
_NOT_A_PHOTO = ("photo_invalid_dimensions", "image_process_failed", "photo_ext_invalid")
# The cloud Bot API's getFile answer for a file over its 20 MB download limit.
_TOO_BIG = "file is too big"
# A slow upload's answer comes once Telegram stored the file; be patient with it.
_UPLOAD_READ_TIMEOUT_S = 60.0
_NOT_VALID = "This button is not valid."
_TRY_AGAIN = "That did not work; please try again."
_HTML_TAG = re.compile(
    r"</?(?:b|strong|i|em|u|ins|s|strike|del|span|tg-spoiler|a|code|pre|blockquote|tg-emoji)"
    r"(?:\s[^<>]*)?>",
    re.IGNORECASE,
)


def to_inbound(update: Update, bot_user: User) -> Inbound | None:
    """The update as geodebot sees it; None for anything with neither text nor a file
    (stickers, joins). A file's message has its caption as text, maybe empty."""
    message = update.message or update.channel_post
    if message is None:
        return None
    text = message.text or message.caption or ""
    files = files_of(message)
    if not text and not files:
        return None
    thread = message.message_thread_id if message.is_topic_message else None
    # Anonymous admins and channels: from_user is a placeholder bot, the chat is the sender.
    chat, author = message.sender_chat, message.from_user
    if chat is not None:
        user, user_name, is_bot = str(chat.id), chat.username or chat.title, False
    elif author is not None:
        user, user_name, is_bot = str(author.id), author.username or author.full_name, author.is_bot
    else:
        return None
    return Inbound(
        platform="telegram",
        event_id=str(update.update_id),
        channel=str(message.chat.id),
        thread=None if thread is None else str(thread),
        user=user,
        text=text,
        message_id=str(message.message_id),
        user_name=user_name or "",
        is_bot=is_bot,
        is_self=chat is None and author is not None and author.id == bot_user.id,
        mentions_bot=_mentions(message, bot_user),
        is_dm=message.chat.type == ChatType.PRIVATE,
        ts=message.date.timestamp(),
        files=files,
    )


def files_of(message: Message) -> tuple[InboundFile, ...]:
    """The file a message carries, described as Telegram does (a message holds one at most;
    an album is a message per item). A photo comes in several sizes: the largest is taken.
    Audio, video and voice notes come as documents; a sticker is no file to pass on."""
    if message.photo:
        photo = max(message.photo, key=lambda p: (p.width * p.height, p.file_size or 0))
        name = f"photo-{photo.file_unique_id}.jpg"  # Telegram stores every photo as JPEG
        return (InboundFile(photo.file_id, name, "image/jpeg", photo.file_size or 0),)
    if message.document is not None:  # an animation (GIF) comes as a document too
        document = message.document
        return (
            InboundFile(
                document.file_id,
                document.file_name or "document",
                document.mime_type or "",
                document.file_size or 0,
            ),
        )
    media = message.audio or message.video or message.voice or message.video_note
    if media is None:
        return ()
    kind = type(media).__name__.lower()  # audio, video, voice, videonote
    media_type = str(getattr(media, "mime_type", None) or "")
    name = getattr(media, "file_name", None) or (
        f"{kind}-{media.file_unique_id}{mimetypes.guess_extension(media_type) or ''}"
    )
    return (InboundFile(media.file_id, str(name), media_type, media.file_size or 0),)


def _mentions(message: Message, bot_user: User) -> bool:
    entities: Mapping[MessageEntity, str] = (
        message.parse_entities() if message.text else message.parse_caption_entities()
    )
    at_name = "@" + (bot_user.username or "").lower()
    for entity, fragment in entities.items():
        fragment = fragment.lower()
        if entity.type == MessageEntity.MENTION and fragment == at_name != "@":
            return True
        if entity.type == MessageEntity.TEXT_MENTION and entity.user == bot_user:
            return True  # PTB compares users by id
        if (
            entity.type == MessageEntity.BOT_COMMAND
            and fragment.endswith(at_name)
            and at_name != "@"
        ):
            return True
    reply = message.reply_to_message
    if reply is None or reply.from_user is None or reply.from_user.id != bot_user.id:
        return False
    # In a forum topic Telegram sets reply_to_message to the topic's creation message even
    # when nobody replied; in a topic the bot opened that would make every message a mention.
    return not (message.is_topic_message and reply.message_id == message.message_thread_id)


def html_to_plain(text: str) -> str:
    """Telegram HTML as plain text: known tags dropped, entities decoded, anything else kept."""
    return html.unescape(_HTML_TAG.sub("", text))


def card_html(card: ApprovalCard) -> str:
    """The card as Telegram HTML: the head in bold, every line escaped, so the summary (the
    model's words) shows literally and can never be rejected as bad entities."""
    head, *rest = _card_lines(card)
    escaped = [html.escape(line, quote=False) for line in rest]
    return "\n".join([f"<b>{html.escape(head, quote=False)}</b>", *escaped])


def _card_lines(card: ApprovalCard) -> list[str]:
    """The card's lines, each clipped to an equal share of the message limit if together
    they would not fit: a card over the limit would never be posted at all."""
    lines = card.lines()
    if sum(_utf16(line) + 1 for line in lines) <= MessageLimit.MAX_TEXT_LENGTH:
        return lines
    share = MessageLimit.MAX_TEXT_LENGTH // len(lines) - 1
    return [_clip(line, share) for line in lines]


def card_markup(card: ApprovalCard) -> InlineKeyboardMarkup | None:
    """Approve and Deny for an open card; none once it has an outcome. An edit without a
    keyboard removes the buttons (PTB drops an empty keyboard from the request anyway)."""
    if card.outcome is not None:
        return None
    approve = InlineKeyboardButton("Approve", callback_data=press_data(card.approval_id, True))
    deny = InlineKeyboardButton("Deny", callback_data=press_data(card.approval_id, False))
    return InlineKeyboardMarkup(((approve, deny),))


def _utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def _clip(text: str, units: int) -> str:
    """At most ``units`` UTF-16 code units (Telegram's measure), marked where cut."""
    if _utf16(text) <= units:
        return text
    cut = text[: max(units - 1, 0)]
    while _utf16(cut) > units - 1:
        cut = cut[:-1]
    return cut + "\u2026"


def _retry_seconds(exc: tg.RetryAfter) -> float:
    value = exc.retry_after
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _decided(press: Press) -> str:
    return "Approved." if press.approve else "Denied."


def _addressed(dest: Destination) -> dict[str, object]:
    """A send's chat, topic and reply fields; a reply to a message gone is sent anyway."""
    try:
        thread = int(dest.thread) if dest.thread else None
        reply = int(dest.reply_to) if dest.reply_to else None
    except ValueError:
        raise ChannelError(f"telegram: not a message id: {dest}", permanent=True) from None
    fields: dict[str, object] = {"chat_id": _chat_id(dest.channel)}
    if thread is not None:
        fields["message_thread_id"] = thread
    if reply is not None:
        fields["reply_parameters"] = ReplyParameters(reply, allow_sending_without_reply=True)
    return fields


def _caption(part: OutboundPart) -> tuple[str, str | None]:
    """The part's text as a caption and its parse mode. A caption holds 1024 characters, not
    a message's 4096: a longer one goes as plain text, cut, since HTML cut anywhere would be
    refused (and the file must still arrive)."""
    if not part.text:
        return "", None
    parse_mode = None if part.plain else ParseMode.HTML
    visible = part.text if part.plain else html_to_plain(part.text)
    if _utf16(visible) <= MessageLimit.CAPTION_LENGTH:
        return part.text, parse_mode
    return _clip(visible, MessageLimit.CAPTION_LENGTH), None


def _fetch_error(status: int, body: str) -> ChannelError:
    """A file download's error status as a ChannelError."""
    text = f"telegram: download failed: HTTP {status} {body[:200]}".rstrip()
    if status in (404, 410):
        return ChannelError(f"{text} (the file is gone)", permanent=True)
    if status == 429 or status >= 500:
        return ChannelError(text)
    return ChannelError(text, permanent=True)  # refused: asking again gets the same


def _chat_id(channel: str) -> int | str:
    try:
        return int(channel)
    except ValueError:
        return channel  # "@channelusername"


class TelegramChannel:
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
        :meth:`start_ingest` (see the module doc)."""
        if config.webhook_url is not None and not webhook_secret:
            raise ValueError("a webhook needs its secret token")
        self._config = config
        self._cursors = cursor_store
        self._redactor = Redactor([token, *([webhook_secret] if webhook_secret else [])])
        self._ingest_later = ingest_later
        self._started = False
        self._ingesting = False
        self._ingest_lock = asyncio.Lock()
        self._webhook_secret = webhook_secret or ""
        self._webhook: WebhookServer | None = None
        if config.webhook_url is not None and webhook_secret:
            listen = config.webhook_listen
            assert listen is not None  # the config requires it with webhook_url
            # Imported only in webhook mode: its aiohttp.web server is a megabyte of a
            # long-polling daemon's memory otherwise.
            from geodebot.channels.telegram_webhook import WebhookServer

            self._webhook = WebhookServer(
                listen,
                config.webhook_path,
                webhook_secret,
                self._webhook_update,
                stop_grace_s=_STOP_GRACE_S,
            )
        self._requests = (
            # One connection for the long poll; PTB adds poll_timeout_s to its read timeout.
            AiohttpRequest(connection_pool_size=1, connect_timeout=10.0),
            # A slow answer to sendMessage becomes an unknown outcome, so be patient with it.
            AiohttpRequest(connection_pool_size=8, read_timeout=20.0, connect_timeout=10.0),
            # Downloads of users' files, apart so a large one never holds up a reply.
            AiohttpRequest(connection_pool_size=4, read_timeout=30.0, connect_timeout=10.0),
        )
        self._bot = Bot(
            token,
            base_url=config.api_base_url,
            # PTB appends the token, as to base_url: the file URLs carry it.
            base_file_url=config.file_base_url,
            get_updates_request=self._requests[0],
            request=self._requests[1],
        )
        self._me: User | None = None
        self._sink: InboundSink | None = None
        self._presses: PressSink | None = None
        self._task: asyncio.Task[None] | None = None
        self._first_poll = asyncio.Event()
        self._offset: int | None = None
        self._stopping = False
        self._delivering = False
        self._connected = False
        self._detail = "not started"
        self._sink_failures = 0
        self._counters = dict.fromkeys(
            ("received", "delivered", "skipped", "sink_errors", "poll_errors", "sent",
             "send_errors", "plain_fallbacks", "presses", "press_errors", "downloads",
             "download_errors", "uploads"),
            0,
        )  # fmt: skip

    @property
    def platform(self) -> Platform:
        return "telegram"

    @property
    def bot_username(self) -> str | None:
        return None if self._me is None else self._me.username

    @property
    def ingesting(self) -> bool:
        """Polling, or registered as the webhook's address (not only listening)."""
        return self._ingesting

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self, sink: InboundSink, presses: PressSink | None = None) -> None:
        if self._started:
            raise RuntimeError("TelegramChannel already started")
        self._sink, self._presses, self._stopping = sink, presses, False
        self._started = True
        try:
            await self._connect()
            if self._webhook is not None:
                await self._listen(self._webhook)
            if self._ingest_later:
                self._connected, self._detail = True, self._sending_only()
                log.info("telegram: connected as @%s, %s", self.bot_username, self._detail)
                return
            await self._take_in()
        except BaseException as exc:
            await self.stop()
            if isinstance(exc, ChannelError):
                self._detail = str(exc)
            raise

    async def start_ingest(self) -> None:
        """Poll (or register the webhook) and register the commands; see the module doc."""
        async with self._ingest_lock:
            if self._ingesting:
                return
            if not self._started or self._stopping:
                raise RuntimeError("TelegramChannel not started")
            try:
                await self._take_in()
            except BaseException as exc:
                await self._stop_polling()
                if isinstance(exc, ChannelError):
                    self._detail = str(exc)
                raise

    async def _connect(self) -> None:
        try:
            await self._bot.initialize()
            self._me = self._bot.bot
        except tg.InvalidToken:
            # PTB puts the token itself into this message: never pass it on.
            raise ChannelError("telegram: the bot token was rejected", permanent=True) from None
        except tg.TelegramError as exc:
            raise ChannelError(f"telegram: cannot connect: {self._safe(exc)}") from None

    async def _take_in(self) -> None:
        if self._webhook is not None:
            await self._register_commands()
            await self._register_webhook()
        else:
            try:
                # A webhook left behind (webhook mode before) makes every getUpdates fail
                # with 409; what it had not delivered yet is kept for the poller.
                await self._bot.delete_webhook(drop_pending_updates=False)
            except tg.TelegramError as exc:
                raise ChannelError(f"telegram: cannot connect: {self._safe(exc)}") from None
            await self._register_commands()
            self._offset = await self._load_offset()
            self._task = asyncio.create_task(self._poll_loop(), name="telegram-poll")
            await self._wait_first_poll(self._task)
        self._ingesting = True
        if self._webhook is not None:
            self._connected, self._detail = True, ""

    async def _register_commands(self) -> None:
        try:
            await self._bot.set_my_commands(
                [BotCommand(c.name, c.description) for c in CHAT_COMMANDS]
            )
        except tg.TelegramError as exc:
            log.warning("telegram: could not register commands: %s", self._safe(exc))

    def _sending_only(self) -> str:
        if self._webhook is None:
            return SENDING_ONLY
        return "receiving webhooks: another replica registers them"

    async def _listen(self, server: WebhookServer) -> None:
        """Listen before registering the address: Telegram may POST at once."""
        try:
            await server.start()
        except OSError as exc:
            raise ChannelError(f"telegram: webhook server: {exc.strerror}") from None
        self._connected, self._detail = True, ""
        log.info("telegram: receiving webhooks as @%s on port %s", self.bot_username, server.port)

    async def _register_webhook(self) -> None:
        try:
            await self._bot.set_webhook(
                str(self._config.webhook_url),
                allowed_updates=ALLOWED_UPDATES,
                drop_pending_updates=False,
                secret_token=self._webhook_secret,
            )
        except tg.TelegramError as exc:
            raise ChannelError(f"telegram: setWebhook failed: {self._safe(exc)}") from None
        log.info("telegram: webhook registered as %s", self._config.webhook_url)

    async def _webhook_update(self, data: dict[str, object]) -> bool:
        """A POSTed update, handed over as a polled one is; True once it may be confirmed."""
        if self._stopping or self._me is None:
            return False  # not ready, or going: Telegram delivers it again
        try:
            update = Update.de_json(data, self._bot)
        except Exception:
            # As when polling: an update that cannot be read would come back forever.
            self._counters["skipped"] += 1
            log.exception("telegram: update %s cannot be read; skipped", data.get("update_id"))
            return True
        return await self._hand_over(update)

    @property
    def webhook_port(self) -> int:
        """The port the webhook server listens on (webhook_listen's, or the one port 0 got)."""
        return 0 if self._webhook is None else self._webhook.port

    async def _wait_first_poll(self, task: asyncio.Task[None]) -> None:
        first = asyncio.ensure_future(self._first_poll.wait())
        try:
            await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            first.cancel()
        if not self._first_poll.is_set():
            raise ChannelError("telegram: polling ended before it connected")

    async def stop(self) -> None:
        self._stopping = True
        if self._webhook is not None:
            # The webhook stays registered: Telegram keeps what comes meanwhile for the next
            # start (or another replica's listener). POSTs under way get a grace to commit.
            await self._webhook.stop()
        await self._stop_polling()
        await self._bot.shutdown()
        # Bot.shutdown skips clients it did not initialize (a send before start uses them).
        await asyncio.gather(*(request.shutdown() for request in self._requests))
        self._connected, self._detail = False, "stopped"
        self._started = self._ingesting = False

    async def _stop_polling(self) -> None:
        task, self._task = self._task, None
        self._first_poll.clear()
        if task is not None:
            # A long poll can go at once (its updates are not confirmed); a running sink gets
            # a moment to commit, so the update it holds is not delivered twice.
            if not self._delivering:
                task.cancel()
            done, _ = await asyncio.wait({task}, timeout=_STOP_GRACE_S)
            if not done:
                task.cancel()
                await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                log.error("telegram: poller failed: %s", self._safe(task.exception()))

    # -- receiving ------------------------------------------------------------------------
    async def _load_offset(self) -> int | None:
        raw = await self._cursors.get_cursor(CURSOR_NAME) if self._cursors else None
        try:
            data = json.loads(raw or "null")
            offset, saved_at = int(data["offset"]), float(data["saved_at"])
        except (ValueError, TypeError, KeyError):
            if raw:
                log.warning("telegram: ignoring unreadable poll offset %r", raw)
            return None
        if time.time() - saved_at > _CURSOR_MAX_AGE_S:
            log.info("telegram: poll offset from %.0f is too old to trust; not used", saved_at)
            return None
        return offset

    async def _save_offset(self, offset: int) -> None:
        if self._cursors is None:
            return
        value = json.dumps({"offset": offset, "saved_at": time.time()})
        try:
            await self._cursors.set_cursor(CURSOR_NAME, value)
        except StoreError as exc:
            # Only costs redelivery after a restart, which the inbox deduplicates; the store
            # says what failed (a full disk, say), a traceback would add nothing.
            log.warning("telegram: cannot save the poll offset: %s", exc)
        except Exception as exc:
            log.warning("telegram: cannot save the poll offset: %s", exc, exc_info=True)

    async def _poll_loop(self) -> None:
        backoff = _BACKOFF_FIRST_S
        while not self._stopping:
            # Short poll until one answered, so start and status learn of it at once.
            answered = self._connected and self._first_poll.is_set()
            try:
                updates = await self._bot.get_updates(
                    offset=self._offset,
                    timeout=self._config.poll_timeout_s if answered else 0,
                    allowed_updates=ALLOWED_UPDATES,
                )
            except tg.RetryAfter as exc:
                delay = self._poll_failed(exc, _retry_seconds(exc))
            except tg.InvalidToken as exc:
                delay = self._poll_failed(exc, _BACKOFF_MAX_S)
            except tg.TelegramError as exc:  # network, 5xx, 409 (another poller with our token)
                delay, backoff = self._poll_failed(exc, backoff), min(backoff * 2, _BACKOFF_MAX_S)
            except Exception as exc:
                # PTB could not parse the answer: one malformed update fails the whole batch,
                # and would come back forever. Take the batch apart and skip what cannot be read.
                log.exception("telegram: unreadable getUpdates answer")
                delay, backoff = self._poll_failed(exc, backoff), min(backoff * 2, _BACKOFF_MAX_S)
                if await self._skip_unreadable():
                    delay = 0.0
            else:
                if not answered:
                    log.info("telegram: polling as @%s", self.bot_username)
                self._connected, self._detail, backoff = True, "", _BACKOFF_FIRST_S
                self._first_poll.set()
                delay = await self._deliver(updates)
            if delay > 0 and not self._stopping:
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))

    async def _skip_unreadable(self) -> bool:
        """Fetch the pending updates raw, deliver the readable ones in order and step over
        the rest; True if the offset moved."""
        # PTB refuses getUpdates through do_api_request and would parse the batch whole
        # again, so this one request goes out as plain HTTP on the poll's connection.
        params = {"offset": self._offset, "timeout": 0, "allowed_updates": list(ALLOWED_UPDATES)}
        try:
            answer = await self._requests[0].post_json(
                f"{self._bot.base_url}/getUpdates", params, _RAW_TIMEOUT_S
            )
            raw = answer.get("result") if isinstance(answer, dict) else None
        except tg.TelegramError as exc:
            log.warning("telegram: cannot fetch the raw updates: %s", self._safe(exc))
            return False
        if not isinstance(raw, list):
            return False
        before = self._offset
        for item in raw:
            update_id = item.get("update_id") if isinstance(item, dict) else None
            if not isinstance(update_id, int):
                return self._offset != before
            try:
                update = Update.de_json(item, self._bot)
            except Exception:
                self._counters["skipped"] += 1
                log.exception("telegram: update %s cannot be read; skipped", update_id)
                self._offset = update_id + 1
                await self._save_offset(self._offset)
                continue
            if await self._deliver([update]) > 0:
                break  # the sink failed; the poll loop retries this update
        return self._offset != before

    def _poll_failed(self, exc: Exception, delay: float) -> float:
        self._counters["poll_errors"] += 1
        self._connected = False
        self._detail = f"{type(exc).__name__}: {self._safe(exc)}"
        log.warning("telegram: polling failed (%s); retrying in %.1f s", self._detail, delay)
        return delay

    async def _deliver(self, updates: Sequence[Update]) -> float:
        """Hand the batch to the sink, confirming each update only once it and every update
        before it were taken; the backoff on a failure.

        Chats are handed over side by side and each chat's updates one after the other, so
        a chat's messages keep their order while the commits of different chats share the
        store's transactions. One at a time, a busy batch waited for a sync per message.
        """
        self._delivering = True  # stop() lets the updates in hand finish
        confirmed = self._offset
        taken: set[int] = set()

        async def hand_over_in_order(chat_updates: list[Update]) -> None:
            for update in chat_updates:
                if self._stopping or not await self._hand_over(update):
                    return  # this chat's later updates come again with the failed one
                taken.add(update.update_id)

        by_chat: dict[object, list[Update]] = {}
        for update in updates:
            chat = update.effective_chat
            by_chat.setdefault(update.update_id if chat is None else chat.id, []).append(update)
        try:
            await asyncio.gather(*(hand_over_in_order(u) for u in by_chat.values()))
            for update in updates:
                if update.update_id not in taken:
                    break
                self._offset = update.update_id + 1
        finally:
            self._delivering = False
            # Once per batch: a crash before it costs only redeliveries, which the inbox
            # recognises.
            if self._offset != confirmed and self._offset is not None:
                await self._save_offset(self._offset)
        if len(taken) < len(updates) and not self._stopping:
            # The offset stays at the first update not taken: getUpdates returns it again
            # (and any taken after it, which the inbox recognises).
            self._sink_failures += 1
            return min(_BACKOFF_FIRST_S * 2.0 ** (self._sink_failures - 1), _BACKOFF_MAX_S)
        self._sink_failures = 0
        return 0.0

    async def _hand_over(self, update: Update) -> bool:
        assert self._me is not None
        assert self._sink is not None
        self._counters["received"] += 1
        if update.callback_query is not None:
            # Handled here and then confirmed like a message: a press is answered once and
            # never reaches the inbox.
            await self._press(update.update_id, update.callback_query)
            return True
        try:
            inbound = to_inbound(update, self._me)
        except Exception:
            # A malformed update would otherwise block every later one forever.
            log.exception("telegram: update %s cannot be read; skipped", update.update_id)
            inbound = None
        if inbound is None:
            self._counters["skipped"] += 1
            return True
        try:
            await self._sink(inbound)
        except StoreError as exc:
            self._counters["sink_errors"] += 1
            log.error(
                "telegram: update %s not committed (%s); it will come again", update.update_id, exc
            )
            return False
        except Exception:
            self._counters["sink_errors"] += 1
            log.exception("telegram: update %s not committed; it will come again", update.update_id)
            return False
        self._counters["delivered"] += 1
        return True

    # -- button presses -------------------------------------------------------------------
    async def _press(self, update_id: int, query: CallbackQuery) -> None:
        """Hand a card's button press to the press sink and answer the presser: exactly one
        answerCallbackQuery per query, or Telegram shows the presser a spinner."""
        self._counters["presses"] += 1
        press = self._press_of(query)
        if press is None or self._presses is None:
            await self._answer(update_id, query, _NOT_VALID, alert=True)
            return
        try:
            answer = await self._presses(press)
        except Exception:
            # The sink is not meant to raise; the presser may simply press again.
            self._counters["press_errors"] += 1
            log.exception("telegram: the press in update %s was not handled", update_id)
            await self._answer(update_id, query, _TRY_AGAIN, alert=True)
            return
        if answer.counted:
            await self._answer(update_id, query, _decided(press), alert=False)
        else:
            # An alert only the presser sees: nothing is posted in the chat.
            await self._answer(update_id, query, answer.text, alert=True)

    @staticmethod
    def _press_of(query: CallbackQuery) -> Press | None:
        """The press, if the button is one of our cards' on a message the bot can still see."""
        parsed = parse_press_data(query.data or "")
        message = query.message
        if parsed is None or message is None or not message.is_accessible:
            return None
        approval_id, approve = parsed
        return Press(
            platform="telegram",
            channel=str(message.chat.id),
            user=str(query.from_user.id),
            approval_id=approval_id,
            approve=approve,
            message_id=str(message.message_id),
        )

    async def _answer(
        self, update_id: int, query: CallbackQuery, text: str, *, alert: bool
    ) -> None:
        limit = CallbackQueryLimit.ANSWER_CALLBACK_QUERY_TEXT_LENGTH
        try:
            await self._bot.answer_callback_query(query.id, _clip(text, limit), show_alert=alert)
        except tg.TelegramError as exc:
            # The press itself was handled; only the presser's notice is lost (Telegram lets
            # the query expire), so it is not worth a redelivery.
            log.warning(
                "telegram: cannot answer the press in update %s: %s", update_id, self._safe(exc)
            )

    # -- sending --------------------------------------------------------------------------
    def render(self, markdown: str) -> list[str]:
        return render_for("telegram", markdown)

    async def send(self, part: OutboundPart) -> SentPart:
        """Send the part, or edit ``part.edit_of`` to it (a streamed preview it replaces)."""
        try:
            if part.file is not None:
                sent = await self._send_file(part, part.file)
            elif part.edit_of is not None:
                sent = await self._edit_or_send(part, part.edit_of)
            else:
                sent = await self._send_part(part)
        except tg.TelegramError as exc:
            self._counters["send_errors"] += 1
            raise self._send_error(exc) from exc
        except ChannelError:
            self._counters["send_errors"] += 1
            raise
        self._counters["sent"] += 1
        return sent

    async def _send_part(self, part: OutboundPart) -> SentPart:
        if part.plain:
            # A preview: its text is cut anywhere, so markup in it means nothing yet.
            return await self._send_text(part.destination, part.text, None, link_preview=False)
        try:
            return await self._send_text(part.destination, part.text, ParseMode.HTML)
        except tg.BadRequest as exc:
            # PTB capitalises Telegram's "can't parse entities", hence lower().
            if _ENTITY_ERROR not in str(exc).lower():
                raise
            log.warning("telegram: part %s rejected as HTML (%s); sent as plain", part.key, exc)
            self._counters["plain_fallbacks"] += 1
            return await self._send_text(part.destination, html_to_plain(part.text), None)

    async def _edit_or_send(self, part: OutboundPart, edit_of: str) -> SentPart:
        """Edit the message to the part; a message that is gone gets the part as a new one
        (the final answer must arrive). An edit to what the message shows already (a repeat
        after a crash, say) is Telegram's "not modified": done, not an error."""
        try:
            message_id = int(edit_of)
        except ValueError:
            log.warning("telegram: part %s: %r is no message id; sent anew", part.key, edit_of)
            return await self._send_part(part)
        try:
            await self._edit_part(part, message_id)
        except tg.BadRequest as exc:
            reason = str(exc).lower()
            if _NOT_MODIFIED in reason:
                return SentPart(edit_of)
            if not any(gone in reason for gone in _EDIT_GONE):
                raise
            log.info(
                "telegram: part %s: message %s cannot be edited (%s); sent anew",
                part.key,
                edit_of,
                self._safe(exc),
            )
            return await self._send_part(part)
        return SentPart(edit_of)

    async def _edit_part(self, part: OutboundPart, message_id: int) -> None:
        if part.plain:
            await self._edit_text(part, message_id, part.text, None)
            return
        try:
            await self._edit_text(part, message_id, part.text, ParseMode.HTML)
        except tg.BadRequest as exc:
            if _ENTITY_ERROR not in str(exc).lower():
                raise
            log.warning("telegram: part %s rejected as HTML (%s); edited as plain", part.key, exc)
            self._counters["plain_fallbacks"] += 1
            await self._edit_text(part, message_id, html_to_plain(part.text), None)

    async def _edit_text(
        self, part: OutboundPart, message_id: int, text: str, parse_mode: str | None
    ) -> None:
        await self._bot.edit_message_text(
            text,
            chat_id=_chat_id(part.destination.channel),
            message_id=message_id,
            parse_mode=parse_mode,
            link_preview_options=_NO_LINK_PREVIEW if part.plain else None,
        )

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        try:
            sent = await self._send_text(
                destination, card_html(card), ParseMode.HTML, card_markup(card)
            )
        except tg.TelegramError as exc:
            self._counters["send_errors"] += 1
            raise self._send_error(exc) from exc
        self._counters["sent"] += 1
        return sent

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        try:
            message = int(message_id)
        except ValueError:
            raise ChannelError(
                f"telegram: not a message id: {message_id!r}", permanent=True
            ) from None
        try:
            await self._bot.edit_message_text(
                card_html(card),
                chat_id=_chat_id(destination.channel),
                message_id=message,
                parse_mode=ParseMode.HTML,
                reply_markup=card_markup(card),
            )
        except tg.TelegramError as exc:
            if isinstance(exc, tg.BadRequest) and _NOT_MODIFIED in str(exc).lower():
                return  # a repeated edit (a retry, say): the card already shows this
            self._counters["send_errors"] += 1
            raise self._send_error(exc) from exc

    async def _send_text(
        self,
        dest: Destination,
        text: str,
        parse_mode: str | None,
        reply_markup: InlineKeyboardMarkup | None = None,
        *,
        link_preview: bool = True,
    ) -> SentPart:
        """sendMessage through PTB's request layer (its form encoding, status handling and
        error classes), reading only the new message's id from the answer.

        ``Bot.send_message`` would build a whole ``Message`` (chat, sender, entities) from the
        answer only for its id to be read: the largest single CPU cost of a reply.
        """
        fields = _addressed(dest)
        fields["text"] = text
        if parse_mode is not None:
            fields["parse_mode"] = parse_mode
        if reply_markup is not None:
            fields["reply_markup"] = reply_markup
        if not link_preview:
            fields["link_preview_options"] = _NO_LINK_PREVIEW
        return await self._post_message("sendMessage", fields)

    async def _post_message(
        self, method: str, fields: Mapping[str, object], read_timeout: float | None = None
    ) -> SentPart:
        """Post a message-making method through PTB's request layer; the new message's id."""
        data = RequestData([RequestParameter.from_input(k, v) for k, v in fields.items()])
        result = await self._requests[1].post(
            f"{self._bot.base_url}/{method}",
            data,
            read_timeout=BaseRequest.DEFAULT_NONE if read_timeout is None else read_timeout,
        )
        message_id = result.get("message_id") if isinstance(result, dict) else None
        if not isinstance(message_id, int):
            # Telegram said ok, so the message is posted; sending it again would repeat it.
            log.warning("telegram: %s answered without a message id: %.200r", method, result)
            return SentPart("")
        return SentPart(str(message_id))

    # -- files ----------------------------------------------------------------------------
    async def _send_file(self, part: OutboundPart, file: OutboundFile) -> SentPart:
        """Upload the file with the part's text as its caption: a small image as a photo
        (shown inline), anything else as a document under its own name."""
        if file.size > UPLOAD_LIMITS["telegram"]:
            raise ChannelError(
                f"telegram: {file.name} is {file.size} bytes, over the Bot API's upload "
                f"limit of {UPLOAD_LIMITS['telegram']}",
                permanent=True,
            )
        if file.media_type in _PHOTO_TYPES and file.size <= TELEGRAM_PHOTO_LIMIT:
            try:
                return await self._upload_captioned(part, file, "photo")
            except tg.BadRequest as exc:
                if not any(reason in str(exc).lower() for reason in _NOT_A_PHOTO):
                    raise
                # Refused outright, so nothing was posted: the document is no duplicate.
                log.info(
                    "telegram: part %s not taken as a photo (%s); sent as a file",
                    part.key,
                    self._safe(exc),
                )
        return await self._upload_captioned(part, file, "document")

    async def _upload_captioned(
        self, part: OutboundPart, file: OutboundFile, kind: str
    ) -> SentPart:
        """The upload with the part's text as caption, in HTML as text parts are; a caption
        Telegram cannot parse goes again as plain text, as text parts do."""
        caption, parse_mode = _caption(part)
        try:
            return await self._upload(part, file, kind, caption, parse_mode)
        except tg.BadRequest as exc:
            if parse_mode is None or _ENTITY_ERROR not in str(exc).lower():
                raise
            log.warning(
                "telegram: caption of part %s rejected as HTML (%s); sent as plain", part.key, exc
            )
            self._counters["plain_fallbacks"] += 1
            return await self._upload(part, file, kind, html_to_plain(caption), None)

    async def _upload(
        self,
        part: OutboundPart,
        file: OutboundFile,
        kind: str,
        caption: str,
        parse_mode: str | None,
    ) -> SentPart:
        fields = _addressed(part.destination)
        if caption:
            fields["caption"] = caption
            if parse_mode is not None:
                fields["parse_mode"] = parse_mode
        try:
            handle = file.path.open("rb")
        except OSError as exc:
            raise ChannelError(
                f"telegram: cannot read {file.name} to upload: {exc.strerror}", permanent=True
            ) from None
        with handle:
            # Streamed from the file, not read whole into memory first.
            upload = InputFile(handle, filename=file.name, read_file_handle=False)
            if file.media_type:
                upload.mimetype = file.media_type
            fields[kind] = upload
            method = "sendPhoto" if kind == "photo" else "sendDocument"
            sent = await self._post_message(method, fields, _UPLOAD_READ_TIMEOUT_S)
        self._counters["uploads"] += 1
        return sent

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        """getFile, then the file from ``file_base_url``, at most ``max_bytes`` of it."""
        if file.size > max_bytes:
            raise FileTooLarge(max_bytes, file.size)
        try:
            data = RequestData([RequestParameter.from_input("file_id", file.ref)])
            info = await self._requests[1].post(f"{self._bot.base_url}/getFile", data)
        except tg.TelegramError as exc:
            self._counters["download_errors"] += 1
            raise self._get_file_error(exc) from exc
        info = info if isinstance(info, dict) else {}
        size = info.get("file_size")
        if isinstance(size, int) and size > max_bytes:
            raise FileTooLarge(max_bytes, size)
        url = self._file_url(info.get("file_path"))
        try:
            status, body = await self._requests[2].fetch(url, max_bytes)
        except tg.TelegramError as exc:
            self._counters["download_errors"] += 1
            raise ChannelError(f"telegram: download failed: {self._safe(exc)}") from exc
        if status != 200:
            self._counters["download_errors"] += 1
            raise _fetch_error(status, self._redactor.redact(body.decode("utf-8", "replace")))
        self._counters["downloads"] += 1
        return body

    def _file_url(self, path: object) -> str:
        """The download URL of getFile's ``file_path``, always under ``file_base_url``: a
        path that would leave it (absolute, ``..``) is refused, so the token in the URL
        only ever goes to the Bot API's own file server."""
        if not isinstance(path, str) or not path:
            raise ChannelError("telegram: the file has no download path", permanent=True)
        if (
            path.startswith("/")
            or "\\" in path
            or any(segment in ("", ".", "..") for segment in path.split("/"))
        ):
            # An absolute path is a local Bot API server's (--local): a file on its disk,
            # not served over HTTP.
            raise ChannelError(
                f"telegram: refused the file path {path[:80]!r}: not under the file URL",
                permanent=True,
            )
        return f"{self._bot.base_file_url}/{urllib.parse.quote(path, safe='/')}"

    def _get_file_error(self, exc: tg.TelegramError) -> ChannelError:
        text = f"telegram: getFile failed: {self._safe(exc)}"
        if isinstance(exc, tg.RetryAfter):
            return ChannelError(text, retry_after=_retry_seconds(exc))
        if isinstance(exc, tg.BadRequest) and _TOO_BIG in str(exc).lower():
            # The cloud Bot API serves files up to 20 MB; only a local server serves more.
            return ChannelError(
                "telegram: the file is over the Bot API's 20 MB download limit", permanent=True
            )
        # Forbidden, or a file_id that is wrong or no longer served.
        return ChannelError(text, permanent=isinstance(exc, tg.Forbidden | tg.BadRequest))

    def _send_error(self, exc: tg.TelegramError) -> ChannelError:
        text = f"telegram: {self._safe(exc)}"
        if isinstance(exc, tg.RetryAfter):
            return ChannelError(text, retry_after=_retry_seconds(exc))
        if isinstance(exc, tg.ChatMigrated):
            return ChannelError(f"{text} (now chat {exc.new_chat_id})", permanent=True)
        # Forbidden: blocked or removed; BadRequest: chat or thread gone, text refused.
        if isinstance(exc, tg.Forbidden | tg.BadRequest):
            return ChannelError(text, permanent=True)
        if isinstance(exc, tg.InvalidToken):
            return ChannelError(text)
        if isinstance(exc, tg.NetworkError) and never_sent(exc):
            return ChannelError(text)  # the request never left
        if (
            isinstance(exc, tg.NetworkError)
            and not isinstance(exc, tg.TimedOut)
            and exc.__cause__ is None
        ):
            # PTB chains every transport failure and unreadable answer; an unchained one is a
            # Bot API error answer (ok=false, a 5xx), which says the method failed: retry it.
            return ChannelError(text)
        # Timeouts, cut connections, garbled answers: Telegram may have posted it.
        return SendUnknown(text)

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        raise NotImplementedError("the Telegram Bot API cannot look up sent messages")

    async def delete(self, destination: Destination, message_id: str) -> None:
        try:
            await self._bot.delete_message(_chat_id(destination.channel), int(message_id))
        except ValueError:
            raise ChannelError(
                f"telegram: not a message id: {message_id!r}", permanent=True
            ) from None
        except tg.TelegramError as exc:
            self._counters["send_errors"] += 1
            raise self._send_error(exc) from exc

    async def typing(self, destination: Destination) -> None:
        try:
            await self._bot.send_chat_action(
                _chat_id(destination.channel),
                ChatAction.TYPING,
                message_thread_id=int(destination.thread) if destination.thread else None,
            )
        except (tg.TelegramError, ValueError) as exc:
            log.debug("telegram: typing failed: %s", self._safe(exc))

    def status(self) -> ChannelStatus:
        counters = dict(self._counters)
        if self._webhook is not None:
            counters.update({f"webhook_{k}": v for k, v in self._webhook.counters.items()})
        return ChannelStatus("telegram", self._connected, self._detail, counters)

    def _safe(self, exc: BaseException | None) -> str:
        return self._redactor.redact(str(exc))
