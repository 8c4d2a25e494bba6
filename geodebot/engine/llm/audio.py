"""Audio services as ports: a :class:`Transcriber` turns a voice note into text, a
:class:`Speaker` an answer into speech (OGG/Opus, what Telegram's sendVoice takes as is).

The adapter is the ``openai`` SDK's audio client against any OpenAI-compatible server
(``/v1/audio/transcriptions`` and ``/v1/audio/speech``: OpenAI, Groq, faster-whisper-server,
LocalAI). The SDK's own retries serve a 429 or a 5xx (``max_retries``, honouring
``retry-after``); what is still failing after them is an :class:`AudioError`, ``permanent``
when asking again gets the same answer (the service refused the audio), else passing (the
service is down or over its limit), which the caller keeps the message for.

With ``local_model_dir`` a faster-whisper model on this machine transcribes instead (the
``faster-whisper`` extra); it is loaded from that directory only, never downloaded.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from geodebot.config.schema import VoiceConfig
from geodebot.engine.llm.common import retry_after

__all__ = [
    "LOCAL_EXTRA",
    "AudioError",
    "Heard",
    "LocalWhisper",
    "OpenAIAudio",
    "Speaker",
    "Transcriber",
    "build_audio",
    "local_model_problem",
    "model_dir_problem",
]

log = logging.getLogger(__name__)

LOCAL_EXTRA = "faster-whisper"
# What a faster-whisper (CTranslate2) model directory holds.
_MODEL_FILES = ("model.bin", "config.json")
SPEECH_MEDIA_TYPE = "audio/ogg"


class AudioError(Exception):
    """An audio service gave no result. ``permanent``: it refused this input (asking again
    gets the same); otherwise it is down or over its limit for now."""

    def __init__(
        self, message: str, *, permanent: bool = False, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Heard:
    """What a transcription gave: the text, and the seconds of audio it was billed for (the
    service's count where it gives one, else the length the platform announced)."""

    text: str
    seconds: float


class Transcriber(Protocol):
    async def transcribe(
        self, data: bytes, *, name: str, media_type: str, seconds: float
    ) -> Heard: ...

    async def aclose(self) -> None: ...


class Speaker(Protocol):
    async def speak(self, text: str) -> bytes:
        """The text spoken, as OGG/Opus bytes."""
        ...

    async def aclose(self) -> None: ...


def _api_error(service: str, exc: Exception) -> AudioError:
    """An ``openai`` SDK exception as an AudioError (the SDK retried what it retries)."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        status = exc.response.status_code
        detail = _message(exc)
        text = f"the {service} service answered HTTP {status}" + (f": {detail}" if detail else "")
        if status == 429 or status >= 500 or status == 408:
            return AudioError(text, retry_after=retry_after(exc.response.headers))
        return AudioError(text, permanent=True)
    if isinstance(exc, openai.APITimeoutError):
        return AudioError(f"the {service} service did not answer in time")
    if isinstance(exc, openai.APIConnectionError):
        return AudioError(f"the {service} service cannot be reached")
    return AudioError(f"the {service} service failed: {type(exc).__name__}")


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping) and isinstance(inner.get("message"), str):
            return str(inner["message"])[:200]
    return ""


class OpenAIAudio:
    """Transcription and speech through one OpenAI-compatible server's audio endpoints."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        model: str,
        language: str | None = None,
        voice: str = "alloy",
        timeout_s: float = 120.0,
        max_retries: int = 2,
    ) -> None:
        import openai

        # A local server takes any key; the SDK insists on one.
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key or "none",
            timeout=timeout_s,
            max_retries=max_retries,
        )
        self._model = model
        self._language = language
        self._voice = voice

    async def transcribe(self, data: bytes, *, name: str, media_type: str, seconds: float) -> Heard:
        import openai

        extra: dict[str, Any] = {}
        if self._language is not None:
            extra["language"] = self._language
        try:
            # As a file over the bytes (no copy): the SDK then sends it in chunks, each
            # written once the last drained. Given the bytes themselves it writes them whole
            # to the socket, whose send buffer copies what does not go at once (twice, on
            # 3.11), so a note would be held about twice more while it goes.
            result = await self._client.audio.transcriptions.create(
                model=self._model,
                file=(name, io.BytesIO(data), media_type or "application/octet-stream"),
                response_format="json",
                **extra,
            )
        except openai.OpenAIError as exc:
            raise _api_error("transcription", exc) from None
        text = getattr(result, "text", None)
        if not isinstance(text, str):
            raise AudioError("the transcription service answered without a text")
        usage = getattr(result, "usage", None)
        billed = getattr(usage, "seconds", None) if getattr(usage, "type", "") == "duration" else 0
        return Heard(text.strip(), float(billed) if isinstance(billed, int | float) else seconds)

    async def speak(self, text: str) -> bytes:
        import openai

        try:
            response = await self._client.audio.speech.create(
                model=self._model,
                voice=self._voice,
                input=text,
                response_format="opus",  # OGG/Opus: what sendVoice takes as it is
            )
        except openai.OpenAIError as exc:
            raise _api_error("speech", exc) from None
        data = response.content
        if not data.startswith(b"OggS"):
            raise AudioError("the speech service did not answer with OGG/Opus audio")
        return data

    async def aclose(self) -> None:
        await self._client.close()


def local_model_problem(model_dir: Path) -> str | None:
    """Why a local model cannot transcribe here: the extra missing, or ``model_dir`` holding
    no model (None: it can, as far as that goes)."""
    if importlib.util.find_spec("faster_whisper") is None:
        return _MISSING_EXTRA
    return model_dir_problem(model_dir)


def model_dir_problem(model_dir: Path) -> str | None:
    """Why ``model_dir`` holds no faster-whisper model (None: its files are there)."""
    if not model_dir.is_dir():
        return f"{model_dir} is not a directory"
    missing = [name for name in _MODEL_FILES if not (model_dir / name).is_file()]
    if missing:
        return f"{model_dir} holds no faster-whisper model (missing {', '.join(missing)})"
    return None


_MISSING_EXTRA = (
    f"local transcription needs the {LOCAL_EXTRA} extra: pip install 'geodebot[{LOCAL_EXTRA}]'"
)


class LocalWhisper:
    """Transcription on this machine with faster-whisper, from a model directory only."""

    def __init__(self, model_dir: Path, language: str | None = None) -> None:
        self._dir = model_dir
        self._language = language
        self._model: Any = None
        self._lock = asyncio.Lock()

    async def transcribe(self, data: bytes, *, name: str, media_type: str, seconds: float) -> Heard:
        async with self._lock:  # one at a time: the model takes the machine's cores
            return await asyncio.to_thread(self._run, data, seconds)

    def _run(self, data: bytes, seconds: float) -> Heard:
        if self._model is None:
            problem = local_model_problem(self._dir)
            if problem is not None:
                raise AudioError(problem, permanent=True)
            import faster_whisper  # type: ignore[import-not-found,unused-ignore]

            self._model = faster_whisper.WhisperModel(
                str(self._dir), device="cpu", compute_type="int8", local_files_only=True
            )
        segments, info = self._model.transcribe(io.BytesIO(data), language=self._language)
        text = " ".join(segment.text.strip() for segment in segments)
        return Heard(text.strip(), float(getattr(info, "duration", seconds) or seconds))

    async def aclose(self) -> None:
        self._model = None


def build_audio(
    voice: VoiceConfig | None,
    secret: Callable[[str], str | None],
    local_dir: Path | None = None,
) -> tuple[Transcriber | None, Speaker | None]:
    """The services ``[voice]`` configures (None for each it does not); ``secret`` reads
    the key ``api_key_env`` names, ``local_dir`` is local_model_dir as a path to use."""
    if voice is None:
        return None, None
    key = secret(voice.api_key_env) if voice.api_key_env else None

    def service(url: str, model: str) -> OpenAIAudio:
        return OpenAIAudio(
            url,
            key,
            model=model,
            language=voice.language,
            voice=voice.speech_voice,
            timeout_s=voice.request_timeout_s,
            max_retries=voice.max_retries,
        )

    transcriber: Transcriber | None = None
    if local_dir is not None:
        transcriber = LocalWhisper(local_dir, voice.language)
    elif voice.transcribe_url is not None:
        transcriber = service(voice.transcribe_url, voice.transcribe_model)
    speaker = None if voice.speech_url is None else service(voice.speech_url, voice.speech_model)
    return transcriber, speaker
