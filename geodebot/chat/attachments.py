"""Files users send with a message: checked, fetched through their platform, kept once.

The channel only describes a message's files (``Inbound.files``); they are committed with
the message, so the platform is acknowledged without waiting for a download. When the
message's turn starts, each file is checked in order, cheapest first, and refused at the
first check it fails:

1. the binding takes files at all (``attachments``);
2. the size the platform announced is within ``max_attachment_mb`` (refused: no download);
3. the type the platform announced, or the name's extension, is one the model can be shown:
   PNG, JPEG, GIF and WebP images, PDFs, text;
4. the download, capped at the limit (the channel stops reading past it);
5. the bytes themselves are what they claim (a PNG's signature, valid UTF-8 text, ...), and
   within what the model takes for that kind (images up to 5 MB, text up to 200 KB).

Audio on a binding that hears is a voice note instead: chat/voice.py checks and transcribes
it, and its transcript goes into the message.

What passed is stored once by content hash (store/files.py) and goes into the user's message
as a :class:`FileBlock`, a reference; what was refused goes in as a one-line note, so the
model knows what it was not shown and why. The outcome is recorded on the inbox row with the
sender's notice of refusals in one commit, so a turn resumed after a crash downloads
nothing again and repeats no notice.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from geodebot.channels.base import Channel, ChannelError, Files, FileTooLarge, InboundFile
from geodebot.chat.bindings import binding_key
from geodebot.chat.replies import files_refused, reply_to
from geodebot.chat.voice import Account, Hearing, heard_line, is_audio, transcript_block_text
from geodebot.config.schema import BindingConfig
from geodebot.engine.attachments import IMAGE_TYPES, PDF_TYPE, SHOWN_LIMITS, TEXT_TYPE
from geodebot.engine.llm.types import Block, FileBlock, TextBlock, human_size
from geodebot.store.files import FileStore
from geodebot.store.protocol import InboxOutboxStore
from geodebot.store.records import AttachedFile, InboxRow, OutboxRow

__all__ = ["Attachments", "Taken", "safe_name", "sniff"]

log = logging.getLogger(__name__)

# One download may take this long; a platform that stalls longer refuses the file, not the
# message.
DOWNLOAD_TIMEOUT_S = 120.0
# A download refused for a passing reason (a 429, a server error) is tried this often in all,
# pausing as the platform asks, at most this long.
DOWNLOAD_ATTEMPTS = 3
DOWNLOAD_PAUSE_MAX_S = 10.0
_MAX_NAME_CHARS = 120
_UNSAFE = re.compile(r"[\x00-\x1f\x7f\[\]]+")
# Declared types that say nothing: the name's extension and then the bytes decide.
_UNKNOWN_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream"})
_TEXT_TYPES = frozenset(
    {
        "application/json",
        "application/xml",
        "application/yaml",
        "application/x-yaml",
        "application/toml",
        "application/x-ndjson",
        "application/x-sh",
        "application/javascript",
        "application/sql",
        "application/csv",
    }
)
_TEXT_SUFFIXES = frozenset(
    (
        *(".txt", ".log", ".md", ".markdown", ".csv", ".tsv", ".json", ".jsonl", ".ndjson"),
        *(".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf", ".xml", ".html", ".htm", ".env"),
        *(".py", ".sh", ".js", ".ts", ".go", ".rs", ".java", ".c", ".h", ".cpp", ".rb", ".sql"),
        *(".diff", ".patch", ".service", ".timer"),
    )
)


def safe_name(name: str) -> str:
    """A sender's file name as it may be shown: no control characters or brackets (it goes
    into notes the model reads), bounded in length, never empty."""
    cleaned = _UNSAFE.sub(" ", name).strip() or "file"
    if len(cleaned) > _MAX_NAME_CHARS:
        cleaned = cleaned[: _MAX_NAME_CHARS - 1] + "…"
    return cleaned


def _accepted_type(media_type: str, name: str) -> bool:
    """Whether what the platform announced could be something the model is shown."""
    declared = media_type.split(";")[0].strip().lower()
    if declared in _UNKNOWN_TYPES:
        if PurePosixPath(name).suffix.lower() in _TEXT_SUFFIXES:
            return True
        guessed = (mimetypes.guess_type(name)[0] or "").lower()
        return guessed not in _UNKNOWN_TYPES and _accepted_type(guessed, "")
    return (
        declared in IMAGE_TYPES
        or declared == PDF_TYPE
        or declared.startswith("text/")
        or declared in _TEXT_TYPES
    )


def sniff(data: bytes) -> str | None:
    """The type the bytes show, among those the model is shown; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data.startswith(b"%PDF-"):
        return PDF_TYPE
    if b"\x00" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return TEXT_TYPE


@dataclass(frozen=True, slots=True)
class Taken:
    """What a message's files came to: the blocks they add to its user message, the notice
    of refusals (an outbox row to send) if this call wrote one, what was heard of its voice
    notes (shown to the sender), and whether nothing is left to answer (no text, and its
    voice notes could not be heard: the notice is the whole answer)."""

    blocks: tuple[Block, ...]
    notice: OutboxRow | None
    heard: str = ""
    unheard: bool = False


class Attachments:
    def __init__(
        self,
        store: InboxOutboxStore,
        files: FileStore,
        channels: Mapping[str, Channel],
        *,
        hearing: Hearing | None = None,
    ) -> None:
        self._store = store
        self._files = files
        # The platforms users can send files through.
        self._channels = {name: c for name, c in channels.items() if isinstance(c, Files)}
        # Voice notes to text (chat/voice.py); None: [voice] cannot transcribe.
        self._hearing = hearing

    def hears(self, binding: BindingConfig) -> bool:
        return self._hearing is not None and binding.voice is not False

    async def blocks(
        self, row: InboxRow, binding: BindingConfig
    ) -> tuple[tuple[Block, ...], OutboxRow | None]:
        """The blocks the row's files add to its user message, and the notice of refusals
        (an outbox row to send) if this call wrote one."""
        taken = await self.take(row, binding)
        return taken.blocks, taken.notice

    async def take(self, row: InboxRow, binding: BindingConfig) -> Taken:
        """What the row's files come to (see :class:`Taken`), checked and recorded once.
        Raises VoiceUnavailable, recording nothing, while the transcription service is down."""
        if not row.files:
            return Taken((), None)
        notice = None
        attached = row.attached
        if attached is None:
            checked = [await self._check(raw, row, binding) for raw in row.files]
            refused = [(a.name, a.refusal) for a in checked if a.refusal]
            text = files_refused(refused) if refused else None
            recorded, notice = await self._store.inbox_attached(
                row.id, checked, reply_to(row, text, kind="notice") if text else None
            )
            attached = recorded.attached if recorded.attached is not None else tuple(checked)
        unheard = (
            not row.text.strip()
            and all(a.refusal for a in attached)
            and any(_audio(raw) and self.hears(binding) for raw in row.files)
        )
        return Taken(tuple(_block(a) for a in attached), notice, heard_line(attached), unheard)

    async def _check(
        self, raw: Mapping[str, Any], row: InboxRow, binding: BindingConfig
    ) -> AttachedFile:
        try:
            described = InboundFile.from_json(raw)
        except (KeyError, TypeError, ValueError):
            return AttachedFile("file", "", 0, refusal="its description was unreadable")
        name = safe_name(described.name)
        if self._hearing is not None and self.hears(binding) and is_audio(described):
            return await self._hear(self._hearing, name, described, row, binding)
        why = _refused_before(described, binding)
        if why is None:
            fetched = await self._fetch(described, row, binding)
            if isinstance(fetched, str):
                why = fetched
            else:
                return await self._keep(name, fetched)
        return AttachedFile(name, described.media_type, described.size, refusal=why)

    async def _hear(
        self,
        hearing: Hearing,
        name: str,
        described: InboundFile,
        row: InboxRow,
        binding: BindingConfig,
    ) -> AttachedFile:
        why = hearing.refused_before(described, _limit(binding), binding.max_attachment_mb)
        if why is None:
            fetched = await self._fetch(described, row, binding)
            if not isinstance(fetched, str):
                account = Account(row.session_id, binding_key(binding), row.turn_id)
                return await hearing.hear(name, described, fetched, account)
            why = fetched
        return AttachedFile(
            name, described.media_type, described.size, refusal=why, voice=described.voice
        )

    async def _fetch(
        self, described: InboundFile, row: InboxRow, binding: BindingConfig
    ) -> bytes | str:
        """The file's bytes, or why there are none."""
        channel = self._channels.get(row.platform)
        if channel is None:
            return "its platform is not connected"
        limit = _limit(binding)
        attempt = 0
        while True:
            attempt += 1
            try:
                async with asyncio.timeout(DOWNLOAD_TIMEOUT_S):
                    data = await channel.download(described, limit)
            except FileTooLarge as exc:
                return _too_large(exc.size, binding)
            except TimeoutError:
                return "the download took too long"
            except ChannelError as exc:
                log.warning(
                    "inbox row %s: download of a file failed (attempt %s): %s", row.id, attempt, exc
                )
                if exc.permanent or attempt == DOWNLOAD_ATTEMPTS:
                    return "the platform did not hand it over"
                # A rate limit or a server error: worth one more try, soon.
                await asyncio.sleep(min(exc.retry_after or float(attempt), DOWNLOAD_PAUSE_MAX_S))
                continue
            except Exception:
                # An adapter's bug must cost the file, not the message it came with.
                log.exception("inbox row %s: download of a file failed unexpectedly", row.id)
                return "the platform did not hand it over"
            return _too_large(len(data), binding) if len(data) > limit else data

    async def _keep(self, name: str, data: bytes) -> AttachedFile:
        """Store the bytes if they are what the model can be shown (checked on the bytes,
        whatever the platform said)."""
        actual = sniff(data)
        if actual is None:
            return AttachedFile(
                name, "", len(data), refusal="its content is not an image, a PDF or text"
            )
        most = SHOWN_LIMITS[actual]
        if len(data) > most:
            why = f"{human_size(len(data))}, over the model's limit of {human_size(most)}"
            return AttachedFile(name, actual, len(data), refusal=why)
        stored = await asyncio.to_thread(self._files.put, data, name=name, media_type=actual)
        return AttachedFile(name, actual, len(data), stored)


def _refused_before(described: InboundFile, binding: BindingConfig) -> str | None:
    """Why the file is refused on what the platform said, before any download; None: fetch."""
    if not binding.attachments:
        return "this chat does not take files"
    size, media_type = described.size, described.media_type
    if size > _limit(binding):
        return _too_large(size, binding)
    if not _accepted_type(media_type, described.name):
        shown = media_type or PurePosixPath(described.name).suffix or "unknown"
        return f"its type ({shown}) is not one I take: images, PDFs and text files"
    kind_limit = SHOWN_LIMITS.get(media_type.split(";")[0].strip().lower())
    if kind_limit is not None and size > kind_limit:
        return f"{human_size(size)}, over the model's limit of {human_size(kind_limit)}"
    return None


def _limit(binding: BindingConfig) -> int:
    return int(binding.max_attachment_mb * 1000 * 1000)


def _too_large(size: int | None, binding: BindingConfig) -> str:
    shown = human_size(size) if size else "Larger"
    return f"{shown}, over this chat's limit of {binding.max_attachment_mb:g} MB"


def _audio(raw: Mapping[str, Any]) -> bool:
    try:
        return is_audio(InboundFile.from_json(raw))
    except (KeyError, TypeError, ValueError):
        return False


def _block(attached: AttachedFile) -> Block:
    if attached.transcript:
        return TextBlock(transcript_block_text(attached))
    if attached.file is not None:
        f = attached.file
        return FileBlock(f.sha256, f.media_type, f.name, f.size)
    size = f", {human_size(attached.size)}" if attached.size else ""
    kind = attached.media_type or "unknown type"
    return TextBlock(
        f"[the user sent {attached.name} ({kind}{size}); not passed on: {attached.refusal}]"
    )
