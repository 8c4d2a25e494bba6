"""Sending to Telegram: text parts (HTML, with a plain-text fallback), edits of a streamed
preview, deletes and the typing notice, and what an SDK error means for a retry
(:class:`ChannelError` or :class:`SendUnknown`). The Bot API has no way to look a sent
message up, so there is no lookup here."""

from __future__ import annotations

import logging

from telegram import InlineKeyboardMarkup
from telegram import error as tg
from telegram.constants import ChatAction, ParseMode

from geodebot.channels.base import (
    ChannelError,
    Destination,
    OutboundPart,
    SendUnknown,
    SentPart,
)
from geodebot.channels.telegram.files import TelegramFiles
from geodebot.channels.telegram.inbound import html_to_plain
from geodebot.channels.telegram.request import never_sent
from geodebot.channels.telegram.state import (
    ENTITY_ERROR,
    NO_LINK_PREVIEW,
    NOT_MODIFIED,
    TelegramState,
    addressed,
    chat_id,
    retry_seconds,
)

log = logging.getLogger(__name__)

# What Telegram answers an edit of a message that is gone (deleted by someone) or that it
# will not change any more: the part then goes out as a new message, so it is not lost.
EDIT_GONE = ("message to edit not found", "message_id_invalid", "message can't be edited")


class TelegramSender:
    """Posts, edits and deletes messages; a part with a file goes to the uploads."""

    def __init__(self, state: TelegramState, files: TelegramFiles) -> None:
        self._state = state
        self._files = files

    async def send(self, part: OutboundPart) -> SentPart:
        """Send the part, or edit ``part.edit_of`` to it (a streamed preview it replaces)."""
        try:
            if part.file is not None:
                sent = await self._files.upload(part, part.file)
            elif part.edit_of is not None:
                sent = await self._edit_or_send(part, part.edit_of)
            else:
                sent = await self._send_part(part)
        except tg.TelegramError as exc:
            self._state.counters["send_errors"] += 1
            raise send_error(self._state, exc) from exc
        except ChannelError:
            self._state.counters["send_errors"] += 1
            raise
        self._state.counters["sent"] += 1
        return sent

    async def _send_part(self, part: OutboundPart) -> SentPart:
        if part.plain:
            # A preview: its text is cut anywhere, so markup in it means nothing yet.
            return await self.send_text(part.destination, part.text, None, link_preview=False)
        try:
            return await self.send_text(part.destination, part.text, ParseMode.HTML)
        except tg.BadRequest as exc:
            # PTB capitalises Telegram's "can't parse entities", hence lower().
            if ENTITY_ERROR not in str(exc).lower():
                raise
            log.warning("telegram: part %s rejected as HTML (%s); sent as plain", part.key, exc)
            self._state.counters["plain_fallbacks"] += 1
            return await self.send_text(part.destination, html_to_plain(part.text), None)

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
            if NOT_MODIFIED in reason:
                return SentPart(edit_of)
            if not any(gone in reason for gone in EDIT_GONE):
                raise
            log.info(
                "telegram: part %s: message %s cannot be edited (%s); sent anew",
                part.key,
                edit_of,
                self._state.safe(exc),
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
            if ENTITY_ERROR not in str(exc).lower():
                raise
            log.warning("telegram: part %s rejected as HTML (%s); edited as plain", part.key, exc)
            self._state.counters["plain_fallbacks"] += 1
            await self._edit_text(part, message_id, html_to_plain(part.text), None)

    async def _edit_text(
        self, part: OutboundPart, message_id: int, text: str, parse_mode: str | None
    ) -> None:
        await self._state.bot.edit_message_text(
            text,
            chat_id=chat_id(part.destination.channel),
            message_id=message_id,
            parse_mode=parse_mode,
            link_preview_options=NO_LINK_PREVIEW if part.plain else None,
        )

    async def send_text(
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
        fields = addressed(dest)
        fields["text"] = text
        if parse_mode is not None:
            fields["parse_mode"] = parse_mode
        if reply_markup is not None:
            fields["reply_markup"] = reply_markup
        if not link_preview:
            fields["link_preview_options"] = NO_LINK_PREVIEW
        return await self._state.post_message("sendMessage", fields)

    async def delete(self, destination: Destination, message_id: str) -> None:
        try:
            await self._state.bot.delete_message(chat_id(destination.channel), int(message_id))
        except ValueError:
            raise ChannelError(
                f"telegram: not a message id: {message_id!r}", permanent=True
            ) from None
        except tg.TelegramError as exc:
            self._state.counters["send_errors"] += 1
            raise send_error(self._state, exc) from exc

    async def typing(self, destination: Destination) -> None:
        try:
            await self._state.bot.send_chat_action(
                chat_id(destination.channel),
                ChatAction.TYPING,
                message_thread_id=int(destination.thread) if destination.thread else None,
            )
        except (tg.TelegramError, ValueError) as exc:
            log.debug("telegram: typing failed: %s", self._state.safe(exc))


def send_error(state: TelegramState, exc: tg.TelegramError) -> ChannelError:
    """What the error says for a retry: permanent, retry (maybe after a while), or unknown."""
    text = f"telegram: {state.safe(exc)}"
    if isinstance(exc, tg.RetryAfter):
        return ChannelError(text, retry_after=retry_seconds(exc))
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
