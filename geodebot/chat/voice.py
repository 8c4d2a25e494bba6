"""Voice notes in: audio a user sends becomes text for the turn (a stage of
chat/attachments.py), and what of it was heard is shown to the sender.

A voice note (or an attached audio file) on a binding that hears is checked cheapest first:
its announced length against ``[voice] max_seconds`` and its size against the chat's limit
(both before any download), then the bytes (they must be audio of a kind the services take),
then it is transcribed. The transcript goes into the user's message marked as one
(``[voice note, 0:12] …``) and is recorded on the inbox row with the message's other files,
in one commit, so a turn resumed after a crash transcribes nothing again.

A note refused gets one short reply naming the reason; a message that held nothing else
(no text, nothing else passed on) gets no turn at all. A transcription service that is down
or over its limit, once the SDK's retries are spent, is :class:`VoiceUnavailable`: the
sender is told, and the message is kept as a dead letter for ``geodebot deadletters replay``
(it was never transcribed, so the replay transcribes it then).
"""

from __future__ import annotations

import mimetypes
from pathlib import PurePosixPath

from geodebot.channels.base import InboundFile
from geodebot.config.schema import VoiceConfig
from geodebot.engine.audio import AudioError, Heard, Transcriber
from geodebot.engine.llm.types import human_size
from geodebot.store.records import AttachedFile

__all__ = [
    "Hearing",
    "VoiceUnavailable",
    "clock",
    "heard_line",
    "is_audio",
    "sniff_audio",
    "transcript_block_text",
]

_AUDIO_SUFFIXES = frozenset(
    {".ogg", ".oga", ".opus", ".mp3", ".m4a", ".mp4", ".aac", ".wav", ".webm", ".flac"}
)
# The transcript shown back to the sender is cut here (the model gets all of it).
HEARD_SHOWN_CHARS = 300


class VoiceUnavailable(Exception):
    """The transcription service is down or over its limit, after the SDK's retries."""


def is_audio(file: InboundFile) -> bool:
    """Whether the platform says the file is audio (by type, or by the name's extension)."""
    declared = file.media_type.split(";")[0].strip().lower()
    if declared.startswith("audio/") or file.voice:
        return True
    if declared in ("", "application/octet-stream", "video/ogg", "video/webm"):
        suffix = PurePosixPath(file.name).suffix.lower()
        guessed = (mimetypes.guess_type(file.name)[0] or "").lower()
        return suffix in _AUDIO_SUFFIXES or guessed.startswith("audio/")
    return False


def sniff_audio(data: bytes) -> str | None:
    """The audio container the bytes show (as a media type), None for anything else."""
    if data.startswith(b"OggS"):
        return "audio/ogg"
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "audio/wav"
    if data.startswith(b"fLaC"):
        return "audio/flac"
    if data.startswith(b"ID3") or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "audio/mpeg"
    if data[4:8] == b"ftyp":
        return "audio/mp4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "audio/webm"
    return None


def clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` past an hour)."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _kind(voice: bool) -> str:
    return "voice note" if voice else "audio file"


def transcript_block_text(attached: AttachedFile) -> str:
    """How a transcript enters the user's message: marked as one, with its length."""
    head = f"[{_kind(attached.voice)}"
    if not attached.voice:
        head += f" {attached.name}"
    if attached.seconds:
        head += f", {clock(attached.seconds)}"
    return f"{head}] {attached.transcript}"


def heard_line(attached: tuple[AttachedFile, ...]) -> str:
    """What the sender is shown of what was heard (empty when nothing was)."""
    heard = [a.transcript for a in attached if a.transcript]
    if not heard:
        return ""
    text = " ".join(heard).replace("\n", " ")
    if len(text) > HEARD_SHOWN_CHARS:
        text = text[: HEARD_SHOWN_CHARS - 1] + "…"
    # Plain quotes, not markup: shown as is in a preview and in the rendered answer alike.
    return f"🎙 “{text}”"


class Hearing:
    """Voice notes to text, for the bindings whose ``voice`` is on."""

    def __init__(self, transcriber: Transcriber, config: VoiceConfig) -> None:
        self._transcriber = transcriber
        self._config = config

    def refused_before(self, described: InboundFile, limit: int, max_mb: float) -> str | None:
        """Why the note is refused on what the platform said (None: download it)."""
        most = self._config.max_seconds
        if described.duration > most:
            kind = _kind(described.voice)
            return f"a {kind} of {clock(described.duration)}, over the limit of {clock(most)}"
        if described.size > limit:
            return f"{human_size(described.size)}, over this chat's limit of {max_mb:g} MB"
        return None

    async def hear(self, name: str, described: InboundFile, data: bytes) -> AttachedFile:
        """The note transcribed, or refused with why; VoiceUnavailable when the service is
        down or over its limit (nothing is recorded then, so a replay transcribes it)."""
        size = len(data)
        actual = sniff_audio(data)
        if actual is None:
            return AttachedFile(
                name, described.media_type, size, refusal="its content is not audio I can read"
            )
        # The platform's type where it names audio (Opus in OGG, say), else the bytes'.
        declared = described.media_type.split(";")[0].strip().lower()
        media_type = declared if declared.startswith("audio/") else actual
        try:
            heard: Heard = await self._transcriber.transcribe(
                data, name=name, media_type=media_type, seconds=described.duration
            )
        except AudioError as exc:
            if not exc.permanent:
                raise VoiceUnavailable(str(exc)) from exc
            why = f"it could not be transcribed: {exc}"
            return AttachedFile(name, media_type, size, refusal=why)
        if not heard.text:
            return AttachedFile(name, media_type, size, refusal="nothing in it could be made out")
        return AttachedFile(
            name,
            media_type,
            size,
            transcript=heard.text,
            seconds=heard.seconds or described.duration,
            voice=described.voice,
        )
