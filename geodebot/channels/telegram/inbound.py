"""Telegram's updates read as geodebot's :class:`Inbound`, and the text measures Telegram
uses (HTML shown as plain text, lengths in UTF-16 code units). Pure: no I/O."""

from __future__ import annotations

import datetime as dt
import html
import mimetypes
import re
from collections.abc import Mapping

from telegram import Message, MessageEntity, Update, User
from telegram.constants import ChatType

from geodebot.channels.base import Inbound, InboundFile

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
    # Only what is heard has a length that matters ([voice] max_seconds).
    audible = kind in ("audio", "voice")
    media_type = str(getattr(media, "mime_type", None) or "")
    if kind == "voice" and not media_type:
        media_type = "audio/ogg"  # what Telegram records voice notes as (Opus)
    name = getattr(media, "file_name", None) or (
        f"{kind}-{media.file_unique_id}{mimetypes.guess_extension(media_type) or ''}"
    )
    return (
        InboundFile(
            media.file_id,
            str(name),
            media_type,
            media.file_size or 0,
            # The timedelta PTB keeps: its ``duration`` property warns of a change of type
            # unless PTB_TIMEDELTA is set in the environment.
            duration=_seconds(getattr(media, "_duration", None)) if audible else 0.0,
            voice=kind == "voice",
        ),
    )


def _seconds(value: object) -> float:
    """A media duration as Telegram sent it (whole seconds; PTB may hold a timedelta)."""
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return 0.0


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


def utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def clip(text: str, units: int) -> str:
    """At most ``units`` UTF-16 code units (Telegram's measure), marked where cut."""
    if utf16(text) <= units:
        return text
    cut = text[: max(units - 1, 0)]
    while utf16(cut) > units - 1:
        cut = cut[:-1]
    return cut + "\u2026"
