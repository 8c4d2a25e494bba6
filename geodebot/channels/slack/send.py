"""Sending to Slack: posts, edits and deletions of messages, the lookup of a sent message by
its part's key, and Slack's errors as :class:`ChannelError` / :class:`SendUnknown`.

Sending: the client has no retry handlers; the outbox decides about retries, and a blind SDK
retry after a timeout could post a message twice. Every message carries the part's key as
message metadata, which ``find_sent`` looks for after an unknown outcome.

Streamed replies: a part with ``edit_of`` edits that message (``chat.update``) instead of
posting one. chat.update's ``parse`` defaults to ``client``, unlike chat.postMessage's, and an
edit without it overwrites the message's own setting, so every edit says ``none``: else the
links of the final answer would be escaped into text. A message that is gone (a person
deleted the preview) cannot be edited; the part is then posted as a new message, after a
look for an earlier such post of it, so that it still arrives exactly once. A ``plain`` part
(a preview of an answer still arriving) is sent as text with &, < and > escaped, no blocks:
what the model wrote so far shows as written, never as a mention or a link.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping
from typing import Any

import aiohttp
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from geodebot.channels.base import (
    ChannelError,
    Destination,
    OutboundPart,
    SendUnknown,
    SentPart,
)
from geodebot.channels.slack.inbound import as_float
from geodebot.channels.slack.state import SlackState

# One logger for the whole adapter, under the name its operators know it by.
log = logging.getLogger("geodebot.channels.slack")

METADATA_EVENT_TYPE = "geodebot_outbox"
# fmt: off
_PERMANENT_ERRORS = frozenset({
    "channel_not_found", "not_in_channel", "is_archived", "msg_too_long", "no_text",
    "invalid_auth", "not_authed", "account_inactive", "token_revoked", "token_expired",
    "missing_scope", "no_permission", "restricted_action", "restricted_action_read_only_channel",
    "restricted_action_thread_only_channel", "restricted_action_non_threadable_channel",
    "cannot_reply_to_message", "invalid_metadata_format", "invalid_metadata_schema",
    "metadata_too_large", "team_access_not_granted", "ekm_access_denied", "invalid_arguments",
    "invalid_blocks", "invalid_blocks_format", "message_not_found", "cant_update_message",
    "edit_window_closed",
})
# fmt: on
# chat.update's answers for a message that is no longer there: deleted messages get either
# (a message we edit is always our own, so cant_update_message means it is gone too).
_GONE_ERRORS = frozenset({"message_not_found", "cant_update_message"})
# Slack documents these as "some aspect of the operation may have succeeded".
_MAYBE_DONE_ERRORS = frozenset({"internal_error", "fatal_error"})
_HISTORY_PAGES, _HISTORY_LIMIT = 2, 100
# Replies come oldest first, so the newest reply of a long thread is on the last page.
_REPLIES_PAGES, _REPLIES_LIMIT = 10, 200


async def call(
    state: SlackState, what: str, request: Awaitable[AsyncSlackResponse]
) -> AsyncSlackResponse:
    """One request that posts or changes a message, with Slack's errors as ours."""
    try:
        response = await request
    except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
        state.counters["send_errors"] += 1
        raise to_channel_error(exc, what) from exc
    state.counters["sent"] += 1
    return response


class SlackSender:
    """Messages out: post, edit, delete and look up; file parts go to the files role."""

    def __init__(self, state: SlackState) -> None:
        self._state = state

    async def send(self, part: OutboundPart) -> SentPart:
        """A text part: an edit of ``edit_of`` when there is one and it still exists, else a
        post (unless an earlier attempt already posted it)."""
        if part.edit_of is not None:
            if await self._edit(part, part.edit_of):
                return SentPart(part.edit_of)
            # An outcome unknown earlier may have posted it already: found, it is not posted
            # again (the outbox repeats an edit without looking, as an edit is harmless).
            found = await self.find_sent(part)
            if found is not None:
                return found
        return await self._post(part)

    async def _post(self, part: OutboundPart) -> SentPart:
        client = self._state.require_client()
        dest = part.destination
        response = await call(
            self._state,
            "chat.postMessage",
            client.chat_postMessage(
                channel=dest.channel,
                text=_part_text(part),
                thread_ts=reply_thread(dest),
                # Left on for a plain part too: its message becomes the final answer by an
                # edit, and chat.update has no way to switch mrkdwn back on.
                mrkdwn=True,
                metadata=_part_metadata(part),
            ),
        )
        return SentPart(str(response["ts"]))

    async def _edit(self, part: OutboundPart, ts: str) -> bool:
        """Edit message ``ts`` to the part; False when Slack says the message is gone."""
        client = self._state.require_client()
        try:
            await call(
                self._state,
                "chat.update",
                client.chat_update(
                    channel=part.destination.channel,
                    ts=ts,
                    text=_part_text(part),
                    parse="none",
                    # The message now carries this part's key: find_sent finds it by that.
                    metadata=_part_metadata(part),
                ),
            )
        except ChannelError as exc:
            cause = exc.__cause__
            if isinstance(cause, SlackApiError) and error_code(cause) in _GONE_ERRORS:
                self._state.counters["edits_gone"] += 1
                log.info("slack: message %s is gone; part %s is posted anew", ts, part.key)
                return False
            raise
        self._state.counters["edited"] += 1
        return True

    async def delete(self, destination: Destination, message_id: str) -> None:
        client = self._state.require_client()
        try:
            await client.chat_delete(channel=destination.channel, ts=message_id)
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            self._state.counters["send_errors"] += 1
            raise to_channel_error(exc, "chat.delete") from exc

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        if part.file is not None:
            # completeUploadExternal takes no metadata, and nothing else in a share may carry
            # the key without showing it to the chat.
            raise NotImplementedError("Slack cannot look up a shared file by its key")
        client = self._state.require_client()
        dest = part.destination
        thread = reply_thread(dest)
        pages, limit = (
            (_REPLIES_PAGES, _REPLIES_LIMIT) if thread else (_HISTORY_PAGES, _HISTORY_LIMIT)
        )
        cursor: str | None = None
        try:
            for _ in range(pages):
                if thread:
                    response = await client.conversations_replies(
                        channel=dest.channel,
                        ts=thread,
                        include_all_metadata=True,
                        limit=limit,
                        cursor=cursor,
                    )
                else:
                    response = await client.conversations_history(
                        channel=dest.channel, include_all_metadata=True, limit=limit, cursor=cursor
                    )
                for message in response.get("messages") or []:
                    if self._carries_key(message, part.key):
                        return SentPart(str(message["ts"]))
                cursor = (response.get("response_metadata") or {}).get("next_cursor")
                if not cursor:
                    break
        except SlackApiError as exc:
            if error_code(exc) == "thread_not_found":
                return None
            raise to_channel_error(exc, "find_sent") from exc
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            raise to_channel_error(exc, "find_sent") from exc
        return None

    def _carries_key(self, message: Mapping[str, Any], key: str) -> bool:
        sender = message.get("bot_id")
        if sender is not None and self._state.bot_id is not None and sender != self._state.bot_id:
            return False  # metadata is app-written, but only ours counts
        metadata = message.get("metadata")
        if not isinstance(metadata, Mapping) or metadata.get("event_type") != METADATA_EVENT_TYPE:
            return False
        payload = metadata.get("event_payload")
        return isinstance(payload, Mapping) and payload.get("key") == key

    async def typing(self, destination: Destination) -> None:
        # Slack offers bots no typing indicator outside RTM (retired, and not Socket Mode);
        # assistant.threads.setStatus needs the AI-app feature and an assistant thread.
        return None


def _part_text(part: OutboundPart) -> str:
    # A plain part is not rendered: escaping alone keeps its text from being parsed.
    return escape(part.text) if part.plain else part.text


def _part_metadata(part: OutboundPart) -> dict[str, Any]:
    return {"event_type": METADATA_EVENT_TYPE, "event_payload": {"key": part.key}}


def escape(text: str) -> str:
    """&, < and > as Slack wants them in any text it parses (else ``<!here>`` pings)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def reply_thread(dest: Destination) -> str | None:
    """Replies go into the thread of the message they answer, except top-level DM messages.

    Slack DM channel ids start with D; a DM is a one-to-one chat where a thread per answer
    only hides the reply.
    """
    if dest.thread:
        return dest.thread
    if dest.reply_to and not dest.channel.startswith("D"):
        return dest.reply_to
    return None


def error_code(exc: SlackApiError) -> str:
    data = getattr(exc.response, "data", None)
    return str(data.get("error") or "") if isinstance(data, dict) else ""


def to_channel_error(exc: BaseException, what: str) -> ChannelError:
    if isinstance(exc, SlackApiError):
        resp = exc.response
        status = int(getattr(resp, "status_code", None) or getattr(resp, "status", 0) or 0)
        code = error_code(exc)
        message = f"Slack {what}: {code or 'HTTP ' + str(status)}"
        if status == 429 or code == "ratelimited":
            headers = getattr(resp, "headers", None) or {}
            retry_after = as_float(headers.get("Retry-After"), default=1.0)
            return ChannelError(message, retry_after=retry_after)
        if code in _MAYBE_DONE_ERRORS or (status >= 500 and not code):
            return SendUnknown(message)
        return ChannelError(message, permanent=code in _PERMANENT_ERRORS)
    if isinstance(exc, aiohttp.ClientConnectorError):
        # No connection was made, so nothing reached Slack.
        return ChannelError(f"Slack {what}: cannot connect: {exc}")
    if isinstance(exc, aiohttp.ClientError | TimeoutError):
        return SendUnknown(f"Slack {what}: {type(exc).__name__}: {exc}")
    return ChannelError(f"Slack {what}: {type(exc).__name__}: {exc}", permanent=True)
