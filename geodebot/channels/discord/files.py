"""Files on Discord: downloads of the attachments people send, and uploads of the bot's.

* Files in. Attachment URLs are signed and the CDN takes no token, so ``download`` sends
  none: it fetches only https URLs on Discord's CDN hosts (or on the configured API's own
  scheme, host and port: a local proxy or a test fake), follows no redirect, and stops at
  the cap (the declared size, Content-Length, or the bytes as they arrive). discord.py's own
  session is private to its ``HTTPClient``, so downloads go through one session of the
  adapter's, opened on first use.
* Files out. A part with ``file`` is one multipart message create (``payload_json`` and
  ``files[0]``, discord.py's ``send(file=...)``), caption, nonce and reply reference as for
  text; discord.py re-reads the file for each of its own retries. Its outcome is looked up
  by nonce like any part's. Discord answers an upload over the limit with 413/40005.
* Spoken answers. A file with ``voice=True`` (OGG/Opus) goes the same way, as an audio
  attachment named ``*.ogg``: discord.py sends every file as application/octet-stream and
  Discord types the attachment by its name, so the name is what makes it audio/ogg. It is
  not sent as Discord's own voice message (IS_VOICE_MESSAGE): that needs the attachment's
  ``duration_secs`` and ``waveform`` (the Opus audio decoded to amplitudes), a message with
  no content (the caption would be a second message, outside the part's one nonce) and the
  SEND_VOICE_MESSAGES permission, and discord.py's ``send`` can set neither the flag nor
  those attachment fields. A plain attachment plays inline in every client all the same.
"""

from __future__ import annotations

import asyncio

import aiohttp
import discord
import yarl

from geodebot.channels.base import (
    ChannelError,
    FileTooLarge,
    InboundFile,
    OutboundFile,
    OutboundPart,
    SentPart,
)
from geodebot.channels.discord.send import nonce_for, reply_reference
from geodebot.channels.discord.state import DiscordState
from geodebot.channels.download import platform_host, read_capped

# Where attachment URLs point: the CDN and its media proxy (``url`` and ``proxy_url``).
CDN_HOSTS = frozenset({"cdn.discordapp.com", "media.discordapp.net"})
DOWNLOAD_TIMEOUT_S = 300.0  # a whole download, 20 MB over a slow link included


class DiscordFiles:
    """Attachments in, and parts with a file out."""

    def __init__(self, state: DiscordState) -> None:
        self._state = state

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        """The attachment's bytes from Discord's CDN, without a token (the URL is signed)."""
        url = self._download_url(file)
        if file.size > max_bytes:
            raise FileTooLarge(max_bytes, file.size)
        if self._state.client is None:
            raise ChannelError("discord channel is not started")
        if self._state.downloads is None:
            self._state.downloads = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=60),
            )
        try:
            async with (
                asyncio.timeout(DOWNLOAD_TIMEOUT_S),
                self._state.downloads.get(url, allow_redirects=False) as response,
            ):
                if response.status != 200:
                    raise download_refused(file, response)
                body = await read_capped(response, max_bytes)
        except (FileTooLarge, ChannelError):
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # Not the exception's text: aiohttp's may carry the signed URL.
            raise ChannelError(
                f"discord: download of {file.name} failed: {type(exc).__name__}"
            ) from exc
        self._state.counters["downloaded"] += 1
        return body

    def _download_url(self, file: InboundFile) -> yarl.URL:
        """The attachment's URL, exactly as Discord gave it, if it is Discord's to serve."""
        try:
            url = yarl.URL(file.ref, encoded=True)
            allowed = platform_host(url, CDN_HOSTS, yarl.URL(self._state.config.api_base_url))
        except (TypeError, ValueError) as exc:
            raise ChannelError(f"discord: {file.name}: not a URL", permanent=True) from exc
        if not allowed:
            host = str(url.host or "")[:100]
            raise ChannelError(f"discord: {file.name}: {host!r} is not Discord's", permanent=True)
        return url

    async def upload(self, part: OutboundPart, file: OutboundFile) -> SentPart:
        target = await self._state.messageable(part.destination.thread or part.destination.channel)
        reference = reply_reference(part, self._state.interactions)
        name = voice_name(file.name) if file.voice else file.name
        try:
            upload = discord.File(file.path, filename=name)
        except OSError as exc:  # gone from the file store: a resend would not find it either
            raise ChannelError(
                f"discord: {file.name} cannot be read: {exc}", permanent=True
            ) from exc
        try:
            message = await target.send(
                content=part.text or None,
                file=upload,
                nonce=nonce_for(part.key),
                reference=reference,
                allowed_mentions=discord.AllowedMentions.none(),
                mention_author=reference is not None,
            )
        finally:
            upload.close()  # send closes it too, unless it failed before the request
        return SentPart(str(message.id))


def voice_name(name: str) -> str:
    """The upload name of a spoken answer: its own if it ends in ``.ogg``, else with that
    suffix (``answer.ogg`` for none), so that Discord types it audio/ogg."""
    stem = name.strip().rstrip(".")
    if stem.lower().endswith(".ogg"):
        return stem
    base, dot, suffix = stem.rpartition(".")
    if dot and base and suffix.lower() in {"opus", "oga"}:
        stem = base
    return f"{stem or 'answer'}.ogg"


def download_refused(file: InboundFile, response: aiohttp.ClientResponse) -> ChannelError:
    status = response.status
    what = f"discord: download of {file.name} answered {status}"
    if status == 429 or status >= 500:
        retry = response.headers.get("Retry-After")
        try:
            after = float(retry) if retry else None
        except ValueError:
            after = None
        return ChannelError(what, retry_after=after if status == 429 else None)
    # Expired or unknown (404), forbidden, a redirect we do not follow: asking again is the same.
    return ChannelError(what, permanent=True)
