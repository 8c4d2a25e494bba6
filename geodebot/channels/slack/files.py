"""Files on Slack: downloads of the files people share, and uploads of the bot's.

Files in: ``download`` fetches a file's private URL with the bot token, which goes only to
Slack's own file host (``https://files.slack.com``) or to the configured API host; a
redirect must stay on those hosts too. Slack answers a token that may not read the file with
its HTML sign-in page and status 200, so an HTML answer for a file that is not HTML is an
error, not the file.

Files out: the external upload, in its three steps (files.getUploadURLExternal, a POST of
the bytes to the upload URL, files.completeUploadExternal), done here step by step rather
than through the SDK's ``files_upload_v2``: the bytes stream from disk instead of being read
whole, and only the last step can have shared anything, so only its failures can be of
unknown outcome (a file uploaded but never completed is never shown). Nothing in a shared
file carries the part's key, so ``find_sent`` cannot look a file part up.

No step takes a media type: Slack types an uploaded file by its name and bytes (the
``filetype`` and ``mimetype`` of the file it lists), so ``OutboundFile.media_type`` goes
nowhere and the name's extension is what counts. A spoken answer (``OutboundFile.voice``,
e.g. ``answer.ogg``) is therefore uploaded like any other file, as an audio file: Slack
documents no way for an app to post an in-app audio clip. ``snippet_type`` is the syntax of
a text snippet and has nothing to do with audio.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
import yarl
from slack_sdk.errors import SlackClientError

from geodebot.channels.base import (
    ChannelError,
    InboundFile,
    OutboundFile,
    OutboundPart,
    SendUnknown,
    SentPart,
)
from geodebot.channels.download import platform_host, read_capped
from geodebot.channels.slack.inbound import as_float
from geodebot.channels.slack.send import call, reply_thread, to_channel_error
from geodebot.channels.slack.state import SlackState

# Slack's file host: url_private(_download) points there, and only there (or at the configured
# API host) does the bot token go.
FILES_HOST = "files.slack.com"
_MAX_REDIRECTS = 3


class SlackFiles:
    """Downloads the files of inbound messages and uploads the files of outbound parts."""

    def __init__(self, state: SlackState) -> None:
        self._state = state

    async def upload(self, part: OutboundPart, file: OutboundFile) -> SentPart:
        """Upload ``file`` and share it in the part's chat with the part's text as its comment.

        Until the last step nothing is shown to anyone, so a failure before it is a plain
        ChannelError (worth retrying unless permanent) and never an unknown outcome.
        """
        client, session = self._state.require_client(), self._state.require_session()
        dest = part.destination
        try:
            length = file.path.stat().st_size
        except OSError as exc:
            raise ChannelError(
                f"Slack upload: cannot read the file: {exc}", permanent=True
            ) from exc
        try:
            ticket = await client.files_getUploadURLExternal(filename=file.name, length=length)
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            self._state.counters["send_errors"] += 1
            raise _not_sent(to_channel_error(exc, "files.getUploadURLExternal")) from exc
        file_id, upload_url = ticket.get("file_id"), ticket.get("upload_url")
        if not isinstance(file_id, str) or not isinstance(upload_url, str):
            self._state.counters["send_errors"] += 1
            raise ChannelError("Slack files.getUploadURLExternal: no upload URL in the answer")
        await self._post_bytes(session, upload_url, file, length)
        response = await call(
            self._state,
            "files.completeUploadExternal",
            client.files_completeUploadExternal(
                files=[{"id": file_id, "title": file.name}],
                channel_id=dest.channel,
                thread_ts=reply_thread(dest),
                initial_comment=part.text or None,
            ),
        )
        self._state.counters["uploads"] += 1
        return SentPart(_share_ts(response.get("files"), dest.channel) or file_id)

    async def _post_bytes(
        self, session: aiohttp.ClientSession, url: str, file: OutboundFile, length: int
    ) -> None:
        """Step two of an upload: the bytes, streamed from disk, to the URL Slack gave."""
        # The whole request may take long for a large file; each read may not.
        each = self._state.request_timeout
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=each, sock_read=each)
        try:
            body = file.path.open("rb")
        except OSError as exc:
            self._state.counters["send_errors"] += 1
            raise ChannelError(
                f"Slack upload: cannot read the file: {exc}", permanent=True
            ) from exc
        headers = {"Content-Type": "application/octet-stream"}
        try:
            with body:
                async with session.post(url, data=body, headers=headers, timeout=timeout) as resp:
                    status = resp.status
                    retry_after = resp.headers.get("Retry-After")
                    await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._state.counters["send_errors"] += 1
            raise ChannelError(f"Slack file upload: {type(exc).__name__}: {exc}") from exc
        if status == 200:
            return
        self._state.counters["send_errors"] += 1
        message = f"Slack file upload: HTTP {status}"
        if status == 429:
            raise ChannelError(message, retry_after=as_float(retry_after, default=1.0))
        raise ChannelError(message, permanent=400 <= status < 500 and status != 408)

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        session = self._state.require_session()
        api = yarl.URL(self._state.config.api_base_url)
        try:
            url = yarl.URL(file.ref)
        except (TypeError, ValueError) as exc:
            raise ChannelError("Slack file download: not a URL", permanent=True) from exc
        # The token travels in a header, never in the URL, so the URL may be logged.
        auth = {"Authorization": f"Bearer {self._state.bot_token}"}
        each = self._state.request_timeout
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=each, sock_read=each)
        try:
            for _ in range(_MAX_REDIRECTS + 1):
                if not file_host_allowed(url, api):
                    self._state.counters["download_errors"] += 1
                    raise ChannelError(
                        f"Slack file download: {url.host or url} is not Slack's file host",
                        permanent=True,
                    )
                async with session.get(
                    url, headers=auth, allow_redirects=False, timeout=timeout
                ) as resp:
                    location = resp.headers.get("Location")
                    if resp.status in (301, 302, 303, 307, 308) and location:
                        url = url.join(yarl.URL(location))
                        continue
                    data = await self._read_file(resp, file, max_bytes)
                    self._state.counters["downloads"] += 1
                    return data
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._state.counters["download_errors"] += 1
            raise ChannelError(f"Slack file download: {type(exc).__name__}: {exc}") from exc
        self._state.counters["download_errors"] += 1
        raise ChannelError("Slack file download: too many redirects", permanent=True)

    async def _read_file(
        self, resp: aiohttp.ClientResponse, file: InboundFile, max_bytes: int
    ) -> bytes:
        """The body of a file's answer, read no further than ``max_bytes``."""
        status = resp.status
        if status != 200:
            self._state.counters["download_errors"] += 1
            message = f"Slack file download: HTTP {status}"
            if status == 429:
                retry_after = as_float(resp.headers.get("Retry-After"), default=1.0)
                raise ChannelError(message, retry_after=retry_after)
            raise ChannelError(message, permanent=status < 500 and status != 408)
        if resp.content_type == "text/html" and not file.media_type.startswith("text/html"):
            self._state.counters["download_errors"] += 1
            raise ChannelError(
                "Slack file download: Slack answered with a web page, not the file"
                " (does the bot token have the files:read scope?)",
                permanent=True,
            )
        return await read_capped(resp, max_bytes)


def file_host_allowed(url: yarl.URL, api_base: yarl.URL) -> bool:
    """Whether the bot token may go to ``url``: Slack's file host over https, or the host of
    the configured API (the same scheme, host and port: a proxy or a test's fake)."""
    return platform_host(url, (FILES_HOST,), api_base)


def _share_ts(files: object, channel: str) -> str | None:
    """The ts of the message that shared the (one) uploaded file in ``channel``, when the
    answer already lists it (Slack shares asynchronously, so it may not)."""
    if not isinstance(files, list) or not files or not isinstance(files[0], Mapping):
        return None
    shares = files[0].get("shares")
    if not isinstance(shares, Mapping):
        return None
    for scope in ("public", "private"):
        in_scope = shares.get(scope)
        places = in_scope.get(channel) if isinstance(in_scope, Mapping) else None
        if isinstance(places, list) and places and isinstance(places[0], Mapping):
            ts = places[0].get("ts")
            if isinstance(ts, str) and ts:
                return ts
    return None


def _not_sent(error: ChannelError) -> ChannelError:
    """An error of a step before anything was shown: never an unknown outcome."""
    if not isinstance(error, SendUnknown):
        return error
    return ChannelError(str(error), retry_after=error.retry_after, permanent=error.permanent)
