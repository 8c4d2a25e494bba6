"""Files on Telegram: downloads of what users sent (getFile, then the file URL under
``file_base_url``, read with a cap) and uploads (sendPhoto for small images, sendVoice for a
spoken answer, sendDocument for the rest). The file URL holds the bot token in its path: it
is built here, fetched, and never put in a log line or an error text."""

from __future__ import annotations

import logging
import urllib.parse

from telegram import InputFile
from telegram import error as tg
from telegram.constants import MessageLimit, ParseMode
from telegram.request import RequestData
from telegram.request._requestparameter import RequestParameter  # what Bot._post builds

from geodebot.channels.base import (
    TELEGRAM_PHOTO_LIMIT,
    UPLOAD_LIMITS,
    ChannelError,
    FileTooLarge,
    InboundFile,
    OutboundFile,
    OutboundPart,
    SentPart,
)
from geodebot.channels.telegram.inbound import clip, html_to_plain, utf16
from geodebot.channels.telegram.state import (
    ENTITY_ERROR,
    TelegramState,
    addressed,
    retry_seconds,
)

log = logging.getLogger(__name__)

# sendPhoto takes these; Telegram recompresses them to JPEG. Anything else goes as a document.
PHOTO_TYPES = frozenset({"image/jpeg", "image/png", "image/webp"})
# What sendPhoto answers an image it will not take as a photo (too long and thin, say); the
# file then goes as a document, which Telegram takes as it is.
NOT_A_PHOTO = ("photo_invalid_dimensions", "image_process_failed", "photo_ext_invalid")
# The cloud Bot API's getFile answer for a file over its 20 MB download limit.
TOO_BIG = "file is too big"
_METHODS = {"photo": "sendPhoto", "document": "sendDocument", "voice": "sendVoice"}
# A slow upload's answer comes once Telegram stored the file; be patient with it.
UPLOAD_READ_TIMEOUT_S = 60.0


def caption_of(part: OutboundPart) -> tuple[str, str | None]:
    """The part's text as a caption and its parse mode. A caption holds 1024 characters, not
    a message's 4096: a longer one goes as plain text, cut, since HTML cut anywhere would be
    refused (and the file must still arrive)."""
    if not part.text:
        return "", None
    parse_mode = None if part.plain else ParseMode.HTML
    visible = part.text if part.plain else html_to_plain(part.text)
    if utf16(visible) <= MessageLimit.CAPTION_LENGTH:
        return part.text, parse_mode
    return clip(visible, MessageLimit.CAPTION_LENGTH), None


def fetch_error(status: int, body: str) -> ChannelError:
    """A file download's error status as a ChannelError."""
    text = f"telegram: download failed: HTTP {status} {body[:200]}".rstrip()
    if status in (404, 410):
        return ChannelError(f"{text} (the file is gone)", permanent=True)
    if status == 429 or status >= 500:
        return ChannelError(text)
    return ChannelError(text, permanent=True)  # refused: asking again gets the same


class TelegramFiles:
    """Uploads and downloads through the adapter's shared Bot."""

    def __init__(self, state: TelegramState) -> None:
        self._state = state

    async def upload(self, part: OutboundPart, file: OutboundFile) -> SentPart:
        """Upload the file with the part's text as its caption: a small image as a photo
        (shown inline), anything else as a document under its own name."""
        if file.size > UPLOAD_LIMITS["telegram"]:
            raise ChannelError(
                f"telegram: {file.name} is {file.size} bytes, over the Bot API's upload "
                f"limit of {UPLOAD_LIMITS['telegram']}",
                permanent=True,
            )
        if file.voice:
            # A spoken answer (OGG/Opus): a voice message, played in the chat.
            return await self._upload_captioned(part, file, "voice")
        if file.media_type in PHOTO_TYPES and file.size <= TELEGRAM_PHOTO_LIMIT:
            try:
                return await self._upload_captioned(part, file, "photo")
            except tg.BadRequest as exc:
                if not any(reason in str(exc).lower() for reason in NOT_A_PHOTO):
                    raise
                # Refused outright, so nothing was posted: the document is no duplicate.
                log.info(
                    "telegram: part %s not taken as a photo (%s); sent as a file",
                    part.key,
                    self._state.safe(exc),
                )
        return await self._upload_captioned(part, file, "document")

    async def _upload_captioned(
        self, part: OutboundPart, file: OutboundFile, kind: str
    ) -> SentPart:
        """The upload with the part's text as caption, in HTML as text parts are; a caption
        Telegram cannot parse goes again as plain text, as text parts do."""
        caption, parse_mode = caption_of(part)
        try:
            return await self._upload(part, file, kind, caption, parse_mode)
        except tg.BadRequest as exc:
            if parse_mode is None or ENTITY_ERROR not in str(exc).lower():
                raise
            log.warning(
                "telegram: caption of part %s rejected as HTML (%s); sent as plain", part.key, exc
            )
            self._state.counters["plain_fallbacks"] += 1
            return await self._upload(part, file, kind, html_to_plain(caption), None)

    async def _upload(
        self,
        part: OutboundPart,
        file: OutboundFile,
        kind: str,
        caption: str,
        parse_mode: str | None,
    ) -> SentPart:
        fields = addressed(part.destination)
        if caption:
            fields["caption"] = caption
            if parse_mode is not None:
                fields["parse_mode"] = parse_mode
        try:
            handle = file.path.open("rb")
        except OSError as exc:
            raise ChannelError(
                f"telegram: cannot read {file.name} to upload: {exc.strerror}", permanent=True
            ) from None
        with handle:
            # Streamed from the file, not read whole into memory first.
            upload = InputFile(handle, filename=file.name, read_file_handle=False)
            if file.media_type:
                upload.mimetype = file.media_type
            fields[kind] = upload
            method = _METHODS[kind]
            sent = await self._state.post_message(method, fields, UPLOAD_READ_TIMEOUT_S)
        self._state.counters["uploads"] += 1
        return sent

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        """getFile, then the file from ``file_base_url``, at most ``max_bytes`` of it."""
        if file.size > max_bytes:
            raise FileTooLarge(max_bytes, file.size)
        try:
            data = RequestData([RequestParameter.from_input("file_id", file.ref)])
            info = await self._state.request.post(f"{self._state.bot.base_url}/getFile", data)
        except tg.TelegramError as exc:
            self._state.counters["download_errors"] += 1
            raise self._get_file_error(exc) from exc
        info = info if isinstance(info, dict) else {}
        size = info.get("file_size")
        if isinstance(size, int) and size > max_bytes:
            raise FileTooLarge(max_bytes, size)
        url = self._file_url(info.get("file_path"))
        try:
            status, body = await self._state.download_request.fetch(url, max_bytes)
        except tg.TelegramError as exc:
            self._state.counters["download_errors"] += 1
            raise ChannelError(f"telegram: download failed: {self._state.safe(exc)}") from exc
        if status != 200:
            self._state.counters["download_errors"] += 1
            raise fetch_error(status, self._state.redactor.redact(body.decode("utf-8", "replace")))
        self._state.counters["downloads"] += 1
        return body

    def _file_url(self, path: object) -> str:
        """The download URL of getFile's ``file_path``, always under ``file_base_url``: a
        path that would leave it (absolute, ``..``) is refused, so the token in the URL
        only ever goes to the Bot API's own file server."""
        if not isinstance(path, str) or not path:
            raise ChannelError("telegram: the file has no download path", permanent=True)
        if (
            path.startswith("/")
            or "\\" in path
            or any(segment in ("", ".", "..") for segment in path.split("/"))
        ):
            # An absolute path is a local Bot API server's (--local): a file on its disk,
            # not served over HTTP.
            raise ChannelError(
                f"telegram: refused the file path {path[:80]!r}: not under the file URL",
                permanent=True,
            )
        return f"{self._state.bot.base_file_url}/{urllib.parse.quote(path, safe='/')}"

    def _get_file_error(self, exc: tg.TelegramError) -> ChannelError:
        text = f"telegram: getFile failed: {self._state.safe(exc)}"
        if isinstance(exc, tg.RetryAfter):
            return ChannelError(text, retry_after=retry_seconds(exc))
        if isinstance(exc, tg.BadRequest) and TOO_BIG in str(exc).lower():
            # The cloud Bot API serves files up to 20 MB; only a local server serves more.
            return ChannelError(
                "telegram: the file is over the Bot API's 20 MB download limit", permanent=True
            )
        # Forbidden, or a file_id that is wrong or no longer served.
        return ChannelError(text, permanent=isinstance(exc, tg.Forbidden | tg.BadRequest))
