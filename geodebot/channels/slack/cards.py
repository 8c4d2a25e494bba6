"""Approval cards on Slack: the card as Block Kit, its sending and editing, and the answer to
a press of one of its buttons.

A card is a section block (the card's lines, escaped; the untrusted summary in a code
block, where Slack applies no formatting) and an actions block with an Approve and a Deny
button, whose values are the press payloads. A press arrives as a ``block_actions``
interaction. Slack shows the presser an error unless it is acked within 3 s, and it never
redelivers one, so the envelope is acked at once and the press is decided afterwards, in a
task of its own; an answer that did not count goes to the presser alone, as an ephemeral
message. The outcome shows on the card when the core edits it (the buttons go then).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from slack_sdk.errors import SlackClientError

from geodebot.channels.base import (
    ApprovalCard,
    Destination,
    Press,
    SentPart,
    parse_press_data,
    press_data,
)
from geodebot.channels.slack.send import call, escape, reply_thread, to_channel_error
from geodebot.channels.slack.state import SlackState

# One logger for the whole adapter, under the name its operators know it by.
log = logging.getLogger("geodebot.channels.slack")

APPROVE_ACTION, DENY_ACTION = "geodebot_approve", "geodebot_deny"
NOT_VALID = "This button is not valid."
SECTION_CHARS = 3000  # Slack refuses a section block whose text is longer
PRESS_FAILED = "That did not work; please try again."


@dataclass(frozen=True, slots=True)
class Presser:
    """Who pressed a button, and where a private answer to them goes."""

    channel: str
    user: str
    thread: str | None  # the card's thread: an ephemeral answer shows next to the card


def presser_of(body: Mapping[str, Any]) -> Presser | None:
    """The presser of a ``block_actions`` payload, or None when it names no user or channel."""
    container, message = _member(body, "container"), _member(body, "message")
    user_id = _member(body, "user").get("id")
    channel_id = _member(body, "channel").get("id") or container.get("channel_id")
    if not (isinstance(user_id, str) and user_id and isinstance(channel_id, str) and channel_id):
        return None
    thread = container.get("thread_ts") or message.get("thread_ts")
    return Presser(channel_id, user_id, thread if isinstance(thread, str) and thread else None)


def _member(body: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = body.get(key)
    return value if isinstance(value, Mapping) else {}


def to_press(body: Mapping[str, Any]) -> Press | None:
    """A ``block_actions`` payload as a Press, or None for a button that is not a card's."""
    presser = presser_of(body)
    actions = body.get("actions")
    action = actions[0] if isinstance(actions, list) and actions else None
    if presser is None or not isinstance(action, Mapping):
        return None
    value = action.get("value")
    parsed = parse_press_data(value) if isinstance(value, str) else None
    if parsed is None:
        return None
    approval_id, approve = parsed
    # The value decides, but only on the button that says the same: a layout mix-up must not
    # turn a press on Deny into an approval.
    if action.get("action_id") != (APPROVE_ACTION if approve else DENY_ACTION):
        return None
    ts = _member(body, "container").get("message_ts") or _member(body, "message").get("ts")
    return Press(
        platform="slack",
        channel=presser.channel,
        user=presser.user,
        approval_id=approval_id,
        approve=approve,
        message_id=ts if isinstance(ts, str) else "",
    )


def card_blocks(card: ApprovalCard) -> list[dict[str, Any]]:
    """The card as Block Kit blocks: its text, and the two buttons while it is undecided."""
    # verbatim: no auto-linking of URLs, channel names or mentions in what the model wrote.
    section = {"type": "mrkdwn", "text": card_mrkdwn(card), "verbatim": True}
    blocks: list[dict[str, Any]] = [{"type": "section", "text": section}]
    if card.outcome is None:
        buttons = [
            _button(APPROVE_ACTION, "Approve", press_data(card.approval_id, True), "primary"),
            _button(DENY_ACTION, "Deny", press_data(card.approval_id, False), "danger"),
        ]
        blocks.append({"type": "actions", "block_id": "geodebot_card", "elements": buttons})
    return blocks


def card_mrkdwn(card: ApprovalCard) -> str:
    """The card's lines as a section's mrkdwn, within Slack's limit for one (else the whole
    card is refused): a summary that escaping made too long is shortened."""
    shown = card.summary
    text = _mrkdwn_lines(card)
    while len(text) > SECTION_CHARS and shown:
        shown = shown[: len(shown) // 2]
        text = _mrkdwn_lines(replace(card, summary=shown + "…"))
    return text[:SECTION_CHARS]


def _mrkdwn_lines(card: ApprovalCard) -> str:
    # lines() writes the summary as "Arguments: ..."; that line shows it as code instead.
    summary_line = f"Arguments: {card.summary}"
    return "\n".join(
        f"Arguments:\n{_code_block(card.summary)}" if line == summary_line else escape(line)
        for line in card.lines()
    )


def card_text(card: ApprovalCard) -> str:
    """The card's fallback text, shown in notifications and by clients without blocks."""
    return "\n".join(escape(line) for line in card.lines())


def _button(action_id: str, label: str, value: str, style: str) -> dict[str, Any]:
    text = {"type": "plain_text", "text": label, "emoji": False}
    return {"type": "button", "action_id": action_id, "text": text, "value": value, "style": style}


def _code_block(text: str) -> str:
    # Slack has no longer fences: a ``` inside gets zero-width spaces or it would end the block.
    text = re.sub(r"`{3,}", lambda m: "\u200b".join(m[0]), text)
    return f"```\n{escape(text)}\n```"


class SlackCards:
    """Sends and edits approval cards, and answers the presses of their buttons."""

    def __init__(self, state: SlackState) -> None:
        self._state = state

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        client = self._state.require_client()
        response = await call(
            self._state,
            "chat.postMessage",
            client.chat_postMessage(
                channel=destination.channel,
                text=card_text(card),
                blocks=card_blocks(card),
                thread_ts=reply_thread(destination),
            ),
        )
        return SentPart(str(response["ts"]))

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        client = self._state.require_client()
        # The blocks replace the message's blocks as a whole, so an outcome's card has no
        # actions block left: its buttons are gone for everyone.
        await call(
            self._state,
            "chat.update",
            client.chat_update(
                channel=destination.channel,
                ts=message_id,
                text=card_text(card),
                blocks=card_blocks(card),
                parse="none",  # as posted (see the send module's docstring)
            ),
        )

    def answer_later(self, body: dict[str, Any]) -> None:
        """Decide a press, already acked, in a task of its own (see _answer_press)."""
        task = asyncio.create_task(self._answer_press(body))
        # Kept until done: the loop holds tasks weakly, and stop() waits for these too.
        self._state.inflight.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._state.inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._state.counters["press_errors"] += 1
            log.error("slack: a button press was not answered", exc_info=task.exception())

    async def _answer_press(self, body: dict[str, Any]) -> None:
        """Decide a press and answer the presser; nothing here reaches the receive loop."""
        self._state.counters["presses"] += 1
        presser = presser_of(body)
        if presser is None:
            self._state.counters["ignored"] += 1
            log.warning("slack: a button press without a user or channel was dropped")
            return
        text = await self._decide(to_press(body))
        if text is not None:
            await self._tell(presser, text)

    async def _decide(self, press: Press | None) -> str | None:
        """What the presser is told privately; None when the press counted (the card's edit
        shows it to everyone)."""
        if press is None or self._state.presses is None:
            return NOT_VALID
        if self._state.stopping:
            return PRESS_FAILED
        try:
            answer = await self._state.presses(press)
        except Exception:
            # The press sink is not supposed to raise: this is its one catch-all.
            self._state.counters["press_errors"] += 1
            log.exception("slack: the press on approval %s failed", press.approval_id)
            return PRESS_FAILED
        return None if answer.counted else answer.text

    async def _tell(self, presser: Presser, text: str) -> None:
        client = self._state.client
        if client is None:
            return
        try:
            await client.chat_postEphemeral(
                channel=presser.channel,
                user=presser.user,
                text=escape(text),
                thread_ts=presser.thread,
            )
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            # Nothing to retry for: the presser may press again.
            self._state.counters["press_errors"] += 1
            log.warning(
                "slack: the answer to a press was not sent: %s",
                to_channel_error(exc, "chat.postEphemeral"),
            )
