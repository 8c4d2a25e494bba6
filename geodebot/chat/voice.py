"""Voice: audio a user sends becomes text for the turn (a stage of chat/attachments.py),
what of it was heard is shown to the sender, and answers may be spoken too.

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

Speech out: a binding's ``voice_replies`` says which answers are spoken too (``always``, or
``when_spoken_to``: answers to voice notes). The reply row then carries the answer as it is
to be spoken (plain, cut at ``max_speech_chars``), committed with the reply; the outbox sends
it as one more part after the text (:class:`Speaking` makes the audio once, stored by content
hash and recorded on the row, so a part sent again never asks the service again).
"""

from __future__ import annotations

import asyncio
import mimetypes
import re
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from geodebot.channels.base import InboundFile
from geodebot.config.schema import BindingConfig, VoiceConfig
from geodebot.engine.llm.audio import SPEECH_MEDIA_TYPE, AudioError, Heard, Speaker, Transcriber
from geodebot.engine.llm.types import human_size
from geodebot.engine.spend import AudioBudget, BudgetExhausted, SpendScope
from geodebot.store.files import FileStore
from geodebot.store.protocol import InboxOutboxStore
from geodebot.store.records import AttachedFile, OutboxRow, Speech, StoredFile, StoreError

__all__ = [
    "Account",
    "Hearing",
    "Speaking",
    "VoiceUnavailable",
    "clock",
    "heard_line",
    "is_audio",
    "sniff_audio",
    "spoken_text",
    "transcript_block_text",
]

_AUDIO_SUFFIXES = frozenset(
    {".ogg", ".oga", ".opus", ".mp3", ".m4a", ".mp4", ".aac", ".wav", ".webm", ".flac"}
)
# The container's extension, as audio services know them.
_EXTENSIONS = {
    "audio/ogg": ".ogg",
    "audio/wav": ".wav",
    "audio/flac": ".flac",
    "audio/mpeg": ".mp3",
    "audio/mp4": ".m4a",
    "audio/webm": ".webm",
}
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
    """Voice notes to text, for the bindings whose ``voice`` is on; each transcription under
    the spend budget (``budget``) as a model call is."""

    def __init__(
        self, transcriber: Transcriber, config: VoiceConfig, budget: AudioBudget | None = None
    ) -> None:
        self._transcriber = transcriber
        self._config = config
        self._budget = budget

    async def _transcribe(
        self, data: bytes, name: str, media_type: str, seconds: float, account: Account | None
    ) -> Heard:
        def work() -> Coroutine[Any, Any, Heard]:
            return self._transcriber.transcribe(
                data, name=name, media_type=media_type, seconds=seconds
            )

        if self._budget is None or account is None:
            return await work()
        return await self._budget.call(
            work,
            model=self._config.transcribe_model,
            scope=SpendScope(binding=account.binding),
            session_id=account.session_id,
            turn_id=account.turn_id,
            # An unannounced length may be as long as any the platform lets through.
            seconds=seconds or self._config.max_seconds,
            used_seconds=lambda heard: heard.seconds or seconds,
        )

    def refused_before(self, described: InboundFile, limit: int, max_mb: float) -> str | None:
        """Why the note is refused on what the platform said (None: download it)."""
        most = self._config.max_seconds
        if described.duration > most:
            kind = _kind(described.voice)
            return f"a {kind} of {clock(described.duration)}, over the limit of {clock(most)}"
        if described.size > limit:
            return f"{human_size(described.size)}, over this chat's limit of {max_mb:g} MB"
        return None

    async def hear(
        self, name: str, described: InboundFile, data: bytes, account: Account | None = None
    ) -> AttachedFile:
        """The note transcribed, or refused with why; VoiceUnavailable when the service is
        down or over its limit (nothing is recorded then, so a replay transcribes it).
        ``account``: whose budgets it counts against (None: none, as in a test)."""
        size = len(data)
        actual = sniff_audio(data)
        if actual is None:
            return AttachedFile(
                name, described.media_type, size, refusal="its content is not audio I can read"
            )
        # Sent as what the bytes are, named to match: services tell the format by the
        # file's extension (OpenAI takes .ogg, not Telegram's .oga), and what a platform
        # announces may not be what it serves (a Slack clip comes as an MP4 transcode).
        media_type = actual
        upload = f"{PurePosixPath(name).stem or 'voice'}{_EXTENSIONS[actual]}"
        try:
            heard = await self._transcribe(data, upload, media_type, described.duration, account)
        except BudgetExhausted as exc:
            return AttachedFile(name, media_type, size, refusal=f"not transcribed: {exc}")
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


_FENCE = re.compile(r"```.*?(```|$)", re.DOTALL)
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_MARKS = re.compile(r"(\*\*|__|~~|`|^#{1,6}\s+|^>\s?|^\s*[-*+]\s+)", re.MULTILINE)
_SPACES = re.compile(r"[ \t]+")


@dataclass(frozen=True, slots=True)
class Account:
    """Whose budgets an audio call counts against: the session and turn it serves, and the
    binding's key (``platform:channel``)."""

    session_id: str
    binding: str
    turn_id: str | None = None


def spoken_text(markdown: str, most: int) -> Speech | None:
    """An answer as it is to be spoken: code blocks left out, markup and link targets taken
    off, cut at a sentence (or word) end within ``most`` characters; None if nothing is left
    to say."""
    text = _FENCE.sub(" (code left out) ", markdown)
    text = _LINK.sub(r"\1", text)
    text = _MARKS.sub("", text)
    text = "\n".join(_SPACES.sub(" ", line).strip() for line in text.splitlines()).strip()
    if not text:
        return None
    if len(text) <= most:
        return Speech(text)
    head = text[:most]
    end = max(head.rfind(". "), head.rfind("! "), head.rfind("? "), head.rfind("\n"))
    if end < most // 2:
        end = head.rfind(" ")
    return Speech(head[: end + 1 if end > 0 else most].strip(), cut=True)


def cut_note(speech: Speech, most: int) -> str:
    """The voice message's caption: what of the answer it holds, when not all."""
    return f"(spoken: the first {most} characters of the answer)" if speech.cut else ""


class Speaking:
    """Answers spoken: which ones, and their audio, made once per reply row."""

    def __init__(
        self,
        speaker: Speaker,
        files: FileStore,
        store: InboxOutboxStore,
        config: VoiceConfig,
        budget: AudioBudget | None = None,
    ) -> None:
        self._speaker = speaker
        self._files = files
        self._store = store
        self._budget = budget
        self._model = config.speech_model
        self.max_chars = config.max_speech_chars

    def speech(self, binding: BindingConfig, *, spoken_to: bool, answer: str) -> Speech | None:
        """What of ``answer`` is spoken for ``binding`` (None: it is not)."""
        wanted = binding.voice_replies == "always" or (
            binding.voice_replies == "when_spoken_to" and spoken_to
        )
        return spoken_text(answer, self.max_chars) if wanted else None

    async def audio(self, row: OutboxRow) -> tuple[OutboxRow, StoredFile, Speech]:
        """The row's speech as a stored file: made now, stored and recorded, unless it was
        made before; the row as recorded, the file, what it says. Raises AudioError (the
        service failed) or StoreError."""
        speech = row.speech
        if speech is None:
            raise ValueError(f"outbox row {row.id} has nothing to speak")
        if row.spoken is None:
            # The store's copy may be newer (made by an earlier pass over a row read before
            # it): the service is asked only when no audio is recorded.
            current = await self._store.get_outbox(row.id)
            row = current if current is not None else row
        if row.spoken is None:
            data = await self._speak(row, speech.text)
            stored = await asyncio.to_thread(
                self._files.put, data, name=f"answer-{row.id}.ogg", media_type=SPEECH_MEDIA_TYPE
            )
            row = await self._store.outbox_spoken(row.id, stored)
        if row.spoken is None:
            raise StoreError(f"outbox row {row.id}: its speech was not recorded")
        return row, row.spoken, speech

    async def _speak(self, row: OutboxRow, text: str) -> bytes:
        """The speech service's audio, under the spend budget (a refusal is an AudioError
        that asking again does not change)."""
        if self._budget is None:
            return await self._speaker.speak(text)
        try:
            return await self._budget.call(
                lambda: self._speaker.speak(text),
                model=self._model,
                scope=SpendScope(binding=f"{row.platform}:{row.channel}"),
                session_id=row.session_id,
                chars=len(text),
            )
        except BudgetExhausted as exc:
            raise AudioError(str(exc), permanent=True) from exc
