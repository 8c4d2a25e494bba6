"""Approval cards on Discord: the card as a message with two buttons, its sending and editing,
and the answer to a press of one of its buttons.

A card is a message with one action row of two buttons whose custom_id is
``press_data(...)``; its text is escaped (the summary is the model's words). A press is a
component interaction, decided by the press sink against the durable request, so it still
works after a restart, which a view kept in memory would not. The view that builds the
buttons is therefore stopped before it is sent: discord.py's view store never holds it (nor
grows by one view per card) and, holding none, answers no press itself, so each press gets
exactly one response. Discord drops an interaction not answered within 3 s: a sink slower
than ``PRESS_ANSWER_S`` gets a deferred update first, and a not counted answer then comes as
an ephemeral followup.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import discord
from discord.http import Route

from geodebot.channels.base import (
    ApprovalCard,
    ChannelError,
    Destination,
    Press,
    PressAnswer,
    PressSink,
    SentPart,
    parse_press_data,
    press_data,
)
from geodebot.channels.discord.inbound import place
from geodebot.channels.discord.send import MAX_CHARS, NET_ERRORS, bounded, nonce_for
from geodebot.channels.discord.state import DiscordState

# One logger for the whole adapter, under the name its operators know it by.
log = logging.getLogger("geodebot.channels.discord")

PRESS_ANSWER_S = 2.5  # Discord drops an interaction not answered within 3 s
CALLBACK = "/interactions/{interaction_id}/{interaction_token}/callback"
_NOT_VALID = "This button is not valid."
_RETRY = "That did not work; please try again."
_EPHEMERAL = 64  # message flag: only the presser sees it
# Discord renders a backslash before any ASCII punctuation as that character alone, so
# escaping more than strictly needed loses nothing. "<" covers mentions, channels,
# timestamps, custom emoji and <url> links; "[" masked links; the rest inline styles.
_MARKUP = re.compile(r"([\\*_~|`<@\[])")
# Block syntax counts only at the start of a line: quotes, headings, subtext, lists.
_LINE_MARKUP = re.compile(r"^(\s*)([>#+-])", re.MULTILINE)
_NUMBERED = re.compile(r"^(\s*\d+)\.", re.MULTILINE)


def escape_markup(text: str) -> str:
    """``text`` shown literally by Discord, whatever markup it carries."""
    text = _LINE_MARKUP.sub(r"\1\\\2", _MARKUP.sub(r"\\\1", text))
    return _NUMBERED.sub(r"\1\\.", text)


def card_text(card: ApprovalCard) -> str:
    """The card as message content: its head in bold, every line escaped, within MAX_CHARS
    (the longest line after the head gives way)."""
    head, *rest = [escape_markup(line) for line in card.lines()]
    lines = [f"**{head}**", *rest]
    excess = sum(map(len, lines)) + len(lines) - 1 - MAX_CHARS
    if excess > 0 and len(lines) > 1:
        longest = max(range(1, len(lines)), key=lambda n: len(lines[n]))
        cut = lines[longest][: max(0, len(lines[longest]) - excess - 1)]
        if (len(cut) - len(cut.rstrip("\\"))) % 2:  # never leave half an escape behind
            cut = cut[:-1]
        lines[longest] = cut + "…"
    return "\n".join(lines)


def card_view(card: ApprovalCard) -> discord.ui.View | None:
    """Approve and Deny (neither the default) while the card is open; None once decided."""
    if card.outcome is not None:
        return None
    view = discord.ui.View(timeout=None)
    for label, style, approve in (
        ("Approve", discord.ButtonStyle.success, True),
        ("Deny", discord.ButtonStyle.danger, False),
    ):
        custom_id = press_data(card.approval_id, approve)
        view.add_item(discord.ui.Button(label=label, style=style, custom_id=custom_id))
    view.stop()  # never stored in discord.py's view store (see the module docstring)
    return view


def private(text: str) -> dict[str, Any]:
    """An ephemeral interaction response: only the presser sees it."""
    data = {"content": text, "flags": _EPHEMERAL, "allowed_mentions": {"parse": []}}
    return {"type": 4, "data": data}


def press_of(interaction: discord.Interaction) -> Press | None:
    """A press of one of our cards' buttons as a Press; None when it is not one."""
    parsed = parse_press_data(str(dict(interaction.data or {}).get("custom_id", "")))
    user = getattr(interaction.user, "id", None)  # MISSING when Discord sent no user
    if parsed is None or user is None:
        return None
    channel, _ = place(interaction.channel)
    message = interaction.message
    return Press(
        platform="discord",
        channel=channel or str(interaction.channel_id),
        user=str(user),
        approval_id=parsed[0],
        approve=parsed[1],
        message_id=str(message.id) if message is not None else "",
    )


class DiscordCards:
    """Approval cards out, and the answers to their buttons."""

    def __init__(self, state: DiscordState) -> None:
        self._state = state

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        return await bounded(self._send_card(destination, card))

    async def _send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        target = await self._state.messageable(destination.thread or destination.channel)
        message = await target.send(
            card_text(card),
            view=card_view(card),
            # A resend after an unknown outcome returns the first card, not a second one.
            nonce=nonce_for(f"card:{card.approval_id}"),
            allowed_mentions=discord.AllowedMentions.none(),
            suppress_embeds=True,  # a link in the summary must not unfurl a preview
        )
        return SentPart(str(message.id))

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        await bounded(self._edit_card(destination, message_id, card))

    async def _edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        if self._state.client is None:
            raise ChannelError("discord channel is not started")
        target = self._state.client.get_partial_messageable(
            int(destination.thread or destination.channel)
        )
        # view=None sends an empty components list: the buttons go.
        await target.get_partial_message(int(message_id)).edit(
            content=card_text(card),
            view=card_view(card),
            allowed_mentions=discord.AllowedMentions.none(),
        )

    async def on_press(self, interaction: discord.Interaction) -> None:
        """A card's button: decided by the press sink, answered to the presser alone."""
        press = press_of(interaction)
        if press is None or self._state.presses is None:
            await self._respond(interaction, private(_NOT_VALID))
            return
        self._state.counters["presses"] += 1
        task = asyncio.current_task()
        if task is not None:  # discord.py's event task: stop() must be able to end it
            self._state.tasks.add(task)
        decided = asyncio.ensure_future(self._decide(self._state.presses, press))
        try:
            done, _ = await asyncio.wait({decided}, timeout=PRESS_ANSWER_S)
            if decided in done:
                answer = decided.result()
                await self._respond(
                    interaction, {"type": 6} if answer.counted else private(answer.text)
                )
                return
            # Past Discord's window the interaction would fail for the presser: acknowledge
            # now, tell them later if the press did not count.
            await self._respond(interaction, {"type": 6})
            answer = await decided
            if not answer.counted:
                await self._follow_up(interaction, answer.text)
        finally:
            decided.cancel()  # done by now, unless stop() ended this task
            if task is not None:
                self._state.tasks.discard(task)

    @staticmethod
    async def _decide(presses: PressSink, press: Press) -> PressAnswer:
        try:
            return await presses(press)
        except Exception:
            log.exception("discord: press on approval %s not decided", press.approval_id)
            return PressAnswer(False, _RETRY)

    async def _respond(self, interaction: discord.Interaction, body: dict[str, Any]) -> None:
        """The interaction's one response; a failure is logged, the gateway goes on."""
        if self._state.client is None:
            return
        route = Route(
            "POST", CALLBACK, interaction_id=interaction.id, interaction_token=interaction.token
        )
        try:
            await self._state.client.http.request(route, json=body)
        except NET_ERRORS as exc:
            log.warning("discord: press %s not answered: %s", interaction.id, exc)

    async def _follow_up(self, interaction: discord.Interaction, text: str) -> None:
        if self._state.client is None:
            return
        path = "/webhooks/{webhook_id}/{webhook_token}"
        route = Route(
            "POST", path, webhook_id=interaction.application_id, webhook_token=interaction.token
        )
        try:
            await self._state.client.http.request(route, json=private(text)["data"])
        except NET_ERRORS as exc:
            log.warning("discord: press %s answer not sent: %s", interaction.id, exc)
