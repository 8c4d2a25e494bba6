"""Discord: one ``discord.Client`` behind geodebot's :class:`Channel` port.

One module per role, composed by :class:`DiscordChannel`: ``inbound`` reads messages and
interactions into geodebot's types, ``client`` is discord.py's client pointed at the
configured endpoints, ``ingest`` takes messages in over the gateway and catches up on missed
ones, ``send`` sends, edits, deletes and looks up messages, ``cards`` sends approval cards
and answers their buttons, ``files`` downloads and uploads files; ``state`` is what they
share.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    # discord.py imports audioop for voice (deprecated since 3.11); we never use voice. Every
    # module of this package imports discord.py after this one has, so the warning stays here.
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord  # noqa: F401

from geodebot.channels.discord.channel import DiscordChannel

__all__ = ["DiscordChannel"]
