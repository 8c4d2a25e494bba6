"""Slack's event and slash command payloads as geodebot's :class:`Inbound`: pure
translation, no I/O.

``message`` and ``app_mention``: a mention in a channel the bot is in arrives twice, as two
events with different ids but the same (channel, ts); both read the same here, and the
ingest lets only the first through.

Files in: a message event with ``files`` (subtype ``file_share``, or none) lists each file
with its private URL; ``to_inbound`` keeps the URL as the file's ref and downloads nothing.

Audio: an audio clip recorded in Slack's app is a file with ``subtype: "slack_audio"``,
``duration_ms`` and ``media_display_type: "audio"`` (a video clip is ``slack_video``). None
of the three is on Slack's documented file object (api.slack.com/types/file); they are what
Slack sends for clips in events and files.info answers, so they are read warily: a clip is
``voice``, and any audio file carries the length Slack announced when it is a plausible
number. An uploaded audio file is audio by its ``mimetype`` (``audio/...``) and usually has
no ``duration_ms``. A clip's ``mimetype`` is what was recorded (``audio/webm``,
``audio/mp4``), and its download URL has been seen to point at Slack's own transcode (an
``..._audio.mp4``) instead: whoever decodes a clip goes by its bytes, not by the type.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from geodebot.channels.base import CHAT_COMMANDS, Inbound, InboundFile

# Subtypes that are a person (or bot) saying something; edits, deletions, joins and the
# like are acked and dropped.
_CONVERSATIONAL_SUBTYPES = frozenset(
    {"bot_message", "thread_broadcast", "file_share", "me_message"}
)
COMMAND_NAMES = frozenset(c.name for c in CHAT_COMMANDS)
# Files Slack lists without their content: deleted ones, and ones beyond a free workspace's
# history limit.
_CONTENTLESS_MODES = frozenset({"tombstone", "hidden_by_limit"})
# The file subtype of an audio clip recorded in Slack (a voice note).
_AUDIO_CLIP = "slack_audio"


def to_inbound(
    body: Mapping[str, Any], bot_user_id: str, bot_id: str | None = None
) -> Inbound | None:
    """An Events API ``event_callback`` body as an Inbound, or None for events we do not act on."""
    event = body.get("event")
    if not isinstance(event, Mapping) or event.get("type") not in ("message", "app_mention"):
        return None
    subtype = event.get("subtype")
    if (subtype is not None and subtype not in _CONVERSATIONAL_SUBTYPES) or event.get("hidden"):
        return None
    channel, ts = event.get("channel"), event.get("ts")
    if not channel or not ts or not _strings(event, "channel", "ts", "text", "thread_ts"):
        return None
    if not _strings(event, "user", "bot_id"):
        return None  # a sender we cannot name is not let through as "nobody"
    text = str(event.get("text") or "")
    sender_bot = event.get("bot_id")
    user = str(event.get("user") or sender_bot or "")
    profile = event.get("user_profile")
    name = ""
    if isinstance(profile, Mapping):
        name = str(profile.get("display_name") or profile.get("real_name") or "")
    mention = f"<@{bot_user_id}>"
    return Inbound(
        platform="slack",
        event_id=str(body.get("event_id") or f"{channel}:{ts}"),
        channel=str(channel),
        thread=str(event["thread_ts"]) if event.get("thread_ts") else None,
        user=user,
        text=text,
        message_id=str(ts),
        user_name=name or str(event.get("username") or ""),
        is_bot=bool(sender_bot) or subtype == "bot_message",
        is_self=(bool(bot_user_id) and user == bot_user_id)
        or (bot_id is not None and sender_bot == bot_id),
        mentions_bot=event.get("type") == "app_mention"
        or mention in text
        or f"<@{bot_user_id}|" in text,
        is_dm=event.get("channel_type") == "im",
        ts=as_float(ts),
        files=files_of(event),
    )


def files_of(event: Mapping[str, Any]) -> tuple[InboundFile, ...]:
    """The downloadable files of a message event, as Slack describes them: the ref is the
    private download URL (else the private URL); a file without either, or deleted, or
    hidden by a workspace limit, is left out."""
    files = event.get("files")
    if not isinstance(files, list):
        return ()
    found: list[InboundFile] = []
    for item in files:
        if not isinstance(item, Mapping) or item.get("mode") in _CONTENTLESS_MODES:
            continue
        url = item.get("url_private_download") or item.get("url_private")
        if not isinstance(url, str) or not url:
            continue
        name = next(
            (v for k in ("name", "title", "id") if isinstance(v := item.get(k), str) and v),
            "file",
        )
        media_type = item.get("mimetype")
        media_type = media_type if isinstance(media_type, str) else ""
        size = item.get("size")
        voice = item.get("subtype") == _AUDIO_CLIP
        audio = (
            voice
            or media_type.lower().startswith("audio/")
            or item.get("media_display_type") == "audio"
        )
        found.append(
            InboundFile(
                ref=url,
                name=name,
                media_type=media_type,
                size=size
                if isinstance(size, int) and not isinstance(size, bool) and size > 0
                else 0,
                duration=_seconds(item.get("duration_ms")) if audio else 0.0,
                voice=voice,
            )
        )
    return tuple(found)


def _seconds(duration_ms: object) -> float:
    """A file's ``duration_ms`` in seconds, or 0 (unknown) for anything but a positive,
    finite number: a string, a bool, a negative or an overflowing value says nothing."""
    if isinstance(duration_ms, bool) or not isinstance(duration_ms, int | float):
        return 0.0
    try:
        seconds = duration_ms / 1000
    except OverflowError:  # an int too large for a float
        return 0.0
    return seconds if math.isfinite(seconds) and seconds > 0 else 0.0


def _strings(event: Mapping[str, Any], *keys: str) -> bool:
    """Whether each of ``keys`` is absent or a string: a broken payload (a list for a ts, an
    object for the text) is dropped, not turned into text by str()."""
    return all(isinstance(event.get(key), str | None) for key in keys)


def command_to_inbound(body: Mapping[str, Any]) -> Inbound | None:
    """A slash command payload as an Inbound addressed to the bot, or None for one not ours.

    The commands (``/help``, ``/status``, ``/stop``, ``/reset``) are declared in the Slack app's
    manifest; Socket Mode delivers them like events. A command has no message to reply to, so
    the answer goes to the channel, and its ``trigger_id`` is the event id.
    """
    name = str(body.get("command") or "").lstrip("/")
    channel, user, trigger = body.get("channel_id"), body.get("user_id"), body.get("trigger_id")
    if name not in COMMAND_NAMES or not channel or not user or not trigger:
        return None
    text = f"/{name} {body.get('text') or ''}".strip()
    return Inbound(
        platform="slack",
        event_id=f"command:{trigger}",
        channel=str(channel),
        thread=None,
        user=str(user),
        text=text,
        message_id="",
        user_name=str(body.get("user_name") or ""),
        mentions_bot=True,
        is_dm=str(channel).startswith("D"),
    )


def as_float(value: object, default: float = 0.0) -> float:
    """``value`` as a number (a ts, a Retry-After header), or ``default`` when it is none."""
    try:
        return float(str(value))
    except ValueError:
        return default
