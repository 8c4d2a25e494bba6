"""Approval cards on Telegram: the card as HTML with Approve and Deny buttons, its edits,
and the presses of those buttons (callback queries), each handed to the press sink and
answered exactly once."""

from __future__ import annotations

import html
import logging

from telegram import CallbackQuery, InlineKeyboardButton, InlineKeyboardMarkup
from telegram import error as tg
from telegram.constants import CallbackQueryLimit, MessageLimit, ParseMode

from geodebot.channels.base import (
    ApprovalCard,
    ChannelError,
    Destination,
    Press,
    SentPart,
    parse_press_data,
    press_data,
)
from geodebot.channels.telegram.inbound import clip, utf16
from geodebot.channels.telegram.send import TelegramSender, send_error
from geodebot.channels.telegram.state import NOT_MODIFIED, TelegramState, chat_id

log = logging.getLogger(__name__)

NOT_VALID = "This button is not valid."
TRY_AGAIN = "That did not work; please try again."


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
    if sum(utf16(line) + 1 for line in lines) <= MessageLimit.MAX_TEXT_LENGTH:
        return lines
    share = MessageLimit.MAX_TEXT_LENGTH // len(lines) - 1
    return [clip(line, share) for line in lines]


def card_markup(card: ApprovalCard) -> InlineKeyboardMarkup | None:
    """Approve and Deny for an open card; none once it has an outcome. An edit without a
    keyboard removes the buttons (PTB drops an empty keyboard from the request anyway)."""
    if card.outcome is not None:
        return None
    approve = InlineKeyboardButton("Approve", callback_data=press_data(card.approval_id, True))
    deny = InlineKeyboardButton("Deny", callback_data=press_data(card.approval_id, False))
    return InlineKeyboardMarkup(((approve, deny),))


def _decided(press: Press) -> str:
    return "Approved." if press.approve else "Denied."


class TelegramCards:
    """Sends and edits approval cards, and answers the presses of their buttons."""

    def __init__(self, state: TelegramState, sender: TelegramSender) -> None:
        self._state = state
        self._sender = sender

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        try:
            sent = await self._sender.send_text(
                destination, card_html(card), ParseMode.HTML, card_markup(card)
            )
        except tg.TelegramError as exc:
            self._state.counters["send_errors"] += 1
            raise send_error(self._state, exc) from exc
        self._state.counters["sent"] += 1
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
            await self._state.bot.edit_message_text(
                card_html(card),
                chat_id=chat_id(destination.channel),
                message_id=message,
                parse_mode=ParseMode.HTML,
                reply_markup=card_markup(card),
            )
        except tg.TelegramError as exc:
            if isinstance(exc, tg.BadRequest) and NOT_MODIFIED in str(exc).lower():
                return  # a repeated edit (a retry, say): the card already shows this
            self._state.counters["send_errors"] += 1
            raise send_error(self._state, exc) from exc

    async def press(self, update_id: int, query: CallbackQuery) -> None:
        """Hand a card's button press to the press sink and answer the presser: exactly one
        answerCallbackQuery per query, or Telegram shows the presser a spinner."""
        self._state.counters["presses"] += 1
        press = self._press_of(query)
        if press is None or self._state.presses is None:
            await self._answer(update_id, query, NOT_VALID, alert=True)
            return
        try:
            answer = await self._state.presses(press)
        except Exception:
            # The sink is not meant to raise; the presser may simply press again.
            self._state.counters["press_errors"] += 1
            log.exception("telegram: the press in update %s was not handled", update_id)
            await self._answer(update_id, query, TRY_AGAIN, alert=True)
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
            await self._state.bot.answer_callback_query(
                query.id, clip(text, limit), show_alert=alert
            )
        except tg.TelegramError as exc:
            # The press itself was handled; only the presser's notice is lost (Telegram lets
            # the query expire), so it is not worth a redelivery.
            log.warning(
                "telegram: cannot answer the press in update %s: %s",
                update_id,
                self._state.safe(exc),
            )
