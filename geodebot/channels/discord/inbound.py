"""Discord messages and slash commands as geodebot's :class:`Inbound`, without any I/O.

Threads are threads of their parent (``channel`` = parent id, ``thread`` = thread id), like
Slack: a binding on a channel covers its threads. Replies go to the thread. A message's
attachments become ``Inbound.files`` (ref = the attachment URL).

Voice: a voice message recorded in the app is a message flagged IS_VOICE_MESSAGE (1 << 13)
with one OGG/Opus attachment that carries ``duration_secs`` and a ``waveform``; its file is
``voice=True`` with that duration. An attached audio file keeps ``voice=False`` and has a
duration only if Discord gave one. discord.py passes ``duration_secs`` through unchecked, so
anything but a positive finite number counts as unknown (0), and the voice stage then sees
no announced length rather than a wrong one.
"""

from __future__ import annotations

import math

import discord

from geodebot.channels.base import CHAT_COMMANDS, Inbound, InboundFile


def place(channel: object) -> tuple[str, str | None]:
    """The (channel, thread) a Discord channel object stands for."""
    if isinstance(channel, discord.Thread) and channel.parent_id is not None:
        return str(channel.parent_id), str(channel.id)
    return str(getattr(channel, "id", "")), None


def to_inbound(message: discord.Message, bot_user_id: int | None) -> Inbound | None:
    """A user-visible chat message as an Inbound; system messages (joins, pins) are None."""
    if message.type not in (discord.MessageType.default, discord.MessageType.reply):
        return None
    channel, thread = place(message.channel)
    author = message.author
    return Inbound(
        platform="discord",
        event_id=str(message.id),
        channel=channel,
        thread=thread,
        user=str(author.id),
        text=message.content or "",
        message_id=str(message.id),
        user_name=author.name,
        # A webhook's author is no account, and Discord need not mark it as a bot; a webhook
        # (another integration relaying, or a bot posting through one) is never a person.
        is_bot=author.bot or author.system or message.webhook_id is not None,
        is_self=author.id == bot_user_id,
        mentions_bot=any(u.id == bot_user_id for u in message.mentions),
        is_dm=isinstance(message.channel, discord.DMChannel),
        ts=message.created_at.timestamp(),
        files=tuple(to_file(a, voice_message=message.flags.voice) for a in message.attachments),
    )


def to_file(attachment: discord.Attachment, *, voice_message: bool = False) -> InboundFile:
    """An attachment as an InboundFile; ``voice_message``: its message is flagged as one."""
    kind = attachment.content_type or ""
    audio = kind.lower().startswith("audio/") or attachment.is_voice_message()
    return InboundFile(
        attachment.url,
        attachment.filename,
        kind,
        attachment.size or 0,
        duration=seconds(attachment.duration),
        voice=voice_message and audio,
    )


def seconds(value: object) -> float:
    """A duration Discord announced, in seconds; 0.0 for none, or one that is no length."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    length = float(value)
    return length if math.isfinite(length) and length > 0 else 0.0


def interaction_to_inbound(interaction: discord.Interaction) -> Inbound | None:
    """A slash command from CHAT_COMMANDS as the text ``/name``; anything else is None."""
    name = dict(interaction.data or {}).get("name")
    slash = interaction.type == discord.InteractionType.application_command
    if not slash or not any(c.name == name for c in CHAT_COMMANDS):
        return None
    channel, thread = place(interaction.channel)
    return Inbound(
        platform="discord",
        event_id=str(interaction.id),
        channel=channel or str(interaction.channel_id),
        thread=thread,
        user=str(interaction.user.id),
        text=f"/{name}",
        message_id=str(interaction.id),
        user_name=interaction.user.name,
        mentions_bot=True,  # a slash command is addressed to this bot by construction
        is_dm=interaction.guild_id is None,
        ts=interaction.created_at.timestamp(),
    )
