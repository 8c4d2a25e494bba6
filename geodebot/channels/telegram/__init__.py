"""Telegram through python-telegram-bot's ``Bot``, with a polling loop (or a webhook) of our own.

One module per role, composed by :class:`TelegramChannel`: ``inbound`` reads updates into
geodebot's types, ``ingest`` takes them in (polling, with the offset ``cursor``, or the
``webhook`` server) and confirms them once the sink committed them, ``send`` posts, edits and
deletes messages, ``cards`` sends approval cards and answers their buttons, ``files``
downloads and uploads files; ``state`` is what they share and ``request`` is PTB's network
layer on aiohttp.
"""

from __future__ import annotations

from geodebot.channels.telegram.channel import TelegramChannel

__all__ = ["TelegramChannel"]
