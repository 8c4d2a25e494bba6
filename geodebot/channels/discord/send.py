"""Sending to Discord: messages, their edits and deletions, the lookup of a sent message by
its nonce, typing, and discord.py's errors as :class:`ChannelError` / :class:`SendUnknown`.

* Sending. ``Messageable.send`` has no ``enforce_nonce`` keyword: discord.py sends
  ``enforce_nonce: true`` with every nonce. The nonce hashes the part key, so a resend of a
  part within Discord's window returns the first message. discord.py sleeps through 429s
  (one wait is capped by ``max_ratelimit_timeout``, beyond that ``RateLimited``) and retries
  500/502/504 itself; ``SEND_TIMEOUT_S`` bounds the whole call.
* Streamed previews. A part with ``edit_of`` edits that message (its content only: a
  preview carries no components) instead of sending a new one; a repeated edit is harmless,
  so it needs no nonce. If Discord says the message is gone (10008, deleted by someone), the
  part is sent as a new message under its own nonce: the final answer must arrive, once. A
  ``plain`` part is a preview of an answer still arriving: sent as is (our markdown is
  Discord's, so there is nothing to convert) as a reply that pings nobody, not even the
  asker: the final answer edits it later, and an edit notifies nobody. A preview over the
  limit is refused before any request, like any part: cutting it instead would repeat the
  same 2000 characters in an edit per interval for the rest of a long answer.
* Slash commands. The first part answering one fills in its deferred response (an edit of
  ``@original``), once the interaction was acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import aiohttp
import discord
from discord.http import Route

from geodebot.channels.base import (
    ChannelError,
    Destination,
    OutboundFile,
    OutboundPart,
    SendUnknown,
    SentPart,
)
from geodebot.channels.discord.state import DiscordState

# One logger for the whole adapter, under the name its operators know it by.
log = logging.getLogger("geodebot.channels.discord")

MAX_CHARS = 2000
SEND_TIMEOUT_S = 90.0
NONCE_WINDOW_S = 120.0  # Discord dedups nonces for "a few minutes": stay well inside
FIND_SENT_LOOKBACK = 50
INTERACTION_TTL_S = 14 * 60.0  # interaction tokens live 15 minutes
NET_ERRORS = (discord.DiscordException, aiohttp.ClientError, OSError, TimeoutError)
_UNKNOWN_MESSAGE = 10008  # Discord's JSON error code for a message that no longer exists
_TOO_LARGE = 40005  # Discord's JSON error code for an upload over the limit (HTTP 413)
_T = TypeVar("_T")


def nonce_for(key: str) -> str:
    """24 hex chars (Discord allows 25), stable for the part key."""
    return hashlib.blake2b(key.encode(), digest_size=12).hexdigest()


def reply_reference(
    part: OutboundPart, interactions: Mapping[str, object]
) -> discord.MessageReference | None:
    """The message the part answers, for its first part (an interaction is no message)."""
    dest = part.destination
    if not dest.reply_to or part.index != 0 or dest.reply_to in interactions:
        return None
    return discord.MessageReference(
        message_id=int(dest.reply_to),
        channel_id=int(dest.thread or dest.channel),
        fail_if_not_exists=False,
    )


class DiscordSender:
    """Messages out; ``upload`` sends a part that carries a file."""

    def __init__(
        self,
        state: DiscordState,
        *,
        upload: Callable[[OutboundPart, OutboundFile], Awaitable[SentPart]],
    ) -> None:
        self._state = state
        self._upload = upload

    async def _interaction_token(self, part: OutboundPart) -> str | None:
        """The token whose deferred response this part should fill in, if any."""
        entry = self._state.interactions.get(part.destination.reply_to or "")
        if part.index != 0 or entry is None or time.monotonic() - entry[1] >= INTERACTION_TTL_S:
            return None
        if part.file is not None:  # goes to the channel; the answer fills in the response
            return None
        with contextlib.suppress(TimeoutError):
            if await asyncio.wait_for(asyncio.shield(entry[2]), 10):
                return entry[0]
        return None  # never acknowledged: answer as a plain message

    async def send(self, part: OutboundPart) -> SentPart:
        if len(part.text) > MAX_CHARS:
            raise ChannelError(f"part is {len(part.text)} chars, over {MAX_CHARS}", permanent=True)
        now = time.monotonic()
        self._state.attempted = {
            k: v for k, v in self._state.attempted.items() if now - v < NONCE_WINDOW_S
        }
        self._state.attempted.setdefault(part.key, now)
        sent = await bounded(self._send(part))
        self._state.counters["sent"] += 1
        return sent

    async def _send(self, part: OutboundPart) -> SentPart:
        if part.file is not None:  # never an edit, never an interaction's response
            return await self._upload(part, part.file)
        if part.edit_of is not None and await self._edited(part, part.edit_of):
            return SentPart(part.edit_of)
        dest, token = part.destination, await self._interaction_token(part)
        if token is not None and self._state.client is not None:
            # Editing the deferred response is idempotent, which a webhook followup is not.
            path = "/webhooks/{webhook_id}/{webhook_token}/messages/@original"
            route = Route(
                "PATCH", path, webhook_id=self._state.client.application_id, webhook_token=token
            )
            body = {"content": part.text, "allowed_mentions": {"parse": []}}
            return SentPart(str((await self._state.client.http.request(route, json=body))["id"]))
        target = await self._state.messageable(dest.thread or dest.channel)
        reference = reply_reference(part, self._state.interactions)
        message = await target.send(
            part.text,
            nonce=nonce_for(part.key),
            reference=reference,
            allowed_mentions=discord.AllowedMentions.none(),
            # The one ping a reply is allowed; a preview pings nobody.
            mention_author=reference is not None and not part.plain,
        )
        return SentPart(str(message.id))

    async def _edited(self, part: OutboundPart, message_id: str) -> bool:
        """Edit our message ``message_id`` to the part's text; False if it no longer exists."""
        if self._state.client is None:
            raise ChannelError("discord channel is not started")
        dest = part.destination
        target = self._state.client.get_partial_messageable(int(dest.thread or dest.channel))
        try:
            await target.get_partial_message(int(message_id)).edit(
                content=part.text, allowed_mentions=discord.AllowedMentions.none()
            )
        except discord.NotFound as exc:
            if exc.code != _UNKNOWN_MESSAGE:
                raise
            log.info("discord: message %s is gone; part %s goes as a new one", message_id, part.key)
            return False
        return True

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        """Our message carrying the part's nonce in recent history, else an idempotent resend.

        Discord returns ``nonce`` on fetched messages only for a while after creation, so
        history can miss it. A resend under the same nonce is deduplicated by Discord within
        its window, so it is done only while this process knows the first attempt is recent;
        otherwise None, and the outbox's blind-resend budget decides.
        """
        if await self._interaction_token(part) is not None:
            return await self.send(part)
        nonce, me = nonce_for(part.key), self._state.bot_id()
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                target = await self._state.messageable(
                    part.destination.thread or part.destination.channel
                )
                async for message in target.history(limit=FIND_SENT_LOOKBACK):
                    if message.author.id == me and str(message.nonce) == nonce:
                        return SentPart(str(message.id))
        except Exception as exc:
            raise translate(exc) from exc
        first = self._state.attempted.get(part.key)
        if first is not None and time.monotonic() - first < NONCE_WINDOW_S:
            log.info("discord: part %s not in history; resending under its nonce", part.key)
            return await self.send(part)
        return None

    async def delete(self, destination: Destination, message_id: str) -> None:
        await bounded(self._delete(destination, message_id))

    async def _delete(self, destination: Destination, message_id: str) -> None:
        if self._state.client is None:
            raise ChannelError("discord channel is not started")
        target = self._state.client.get_partial_messageable(
            int(destination.thread or destination.channel)
        )
        await target.get_partial_message(int(message_id)).delete()

    async def typing(self, destination: Destination) -> None:
        with contextlib.suppress(*NET_ERRORS, ChannelError):
            async with asyncio.timeout(10):
                await (
                    await self._state.messageable(destination.thread or destination.channel)
                ).typing()


async def bounded(call: Awaitable[_T]) -> _T:
    """One platform call under SEND_TIMEOUT_S, its failure as a ChannelError."""
    try:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            return await call
    except Exception as exc:
        raise translate(exc) from exc


def translate(exc: Exception) -> ChannelError:
    if isinstance(exc, ChannelError):
        return exc
    if isinstance(exc, discord.RateLimited):
        return ChannelError(f"discord rate limit: {exc}", retry_after=exc.retry_after)
    if isinstance(exc, discord.HTTPException):
        if exc.status == 429:  # answered without Via: discord.py takes it for a Cloudflare ban
            retry = exc.response.headers.get("Retry-After")
            return ChannelError(f"discord 429: {exc}", retry_after=float(retry or 60))
        if exc.status == 413 or exc.code == _TOO_LARGE:
            return ChannelError(
                f"discord: the file is over the upload limit: {exc}", permanent=True
            )
        if 400 <= exc.status < 500:
            return ChannelError(f"discord rejected the message: {exc}", permanent=True)
        return ChannelError(f"discord server error: {exc}")
    if isinstance(exc, ValueError):  # a destination id that is no snowflake; nothing sent
        return ChannelError(f"discord: bad destination: {exc}", permanent=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ChannelError(f"discord unreachable: {exc}")  # never connected: nothing was sent
    return SendUnknown(f"discord request outcome unknown: {exc!r}")
