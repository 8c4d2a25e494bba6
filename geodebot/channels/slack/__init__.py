"""Slack over Socket Mode: slack-bolt's AsyncApp behind slack_sdk's aiohttp Socket Mode client.

One module per role, composed by :class:`SlackChannel`: ``inbound`` reads events into
geodebot's types, ``ingest`` takes them in and acknowledges them, ``send`` posts, edits and
looks up messages, ``cards`` sends approval cards and answers their buttons, ``files``
downloads and uploads files; ``state`` is what they share.
"""

from __future__ import annotations

from geodebot.channels.slack.channel import SlackChannel

__all__ = ["SlackChannel"]
