"""A scripted fake of OpenAI's audio API speaking real HTTP, for tests that run the real SDK.

Voice notes are transcribed, and replies spoken, through ``openai.AsyncOpenAI``; this server
stands in for api.openai.com so those paths run end to end, the SDK's own multipart encoding
and error mapping included::

    async with FakeAudioServer(key="k") as srv:
        srv.script_transcript("water the plants", duration=2.5)
        client = openai.AsyncOpenAI(base_url=srv.url, api_key="k", max_retries=0)
        text = await client.audio.transcriptions.create(
            model="whisper-1", file=("note.ogg", data, "audio/ogg"), language="en"
        )
        assert text.text == "water the plants"
        assert srv.transcriptions[0].sha256 == hashlib.sha256(data).hexdigest()

What of the wire format it speaks (as openai-python 3.x sends it):

* ``POST /v1/audio/transcriptions``: ``multipart/form-data`` with a ``file`` part (filename
  and content type kept) and the form fields ``model``, ``language``, ``prompt``,
  ``response_format`` and ``temperature`` (others are kept in ``fields``). Answers by
  ``response_format``: ``json`` (the default) ``{"text", "usage": {"type": "duration",
  "seconds"}}``; ``verbose_json`` ``{"task": "transcribe", "language", "duration", "text",
  "segments": [], "usage"}``; ``text``, ``srt`` and ``vtt`` as plain text. The duration is the
  scripted one, else the upload's if it is a WAV the stdlib ``wave`` module reads (from its
  header), else 1 s; ``usage.seconds`` is it rounded up to a whole second, as billed. The
  upload is read streamed, hashed and counted, never kept: a record holds its ``size`` and
  ``sha256``. Over ``max_upload`` bytes (25 MiB, OpenAI's limit) is a 413; no file, no model
  or an unknown ``response_format`` a 400.
* ``POST /v1/audio/speech``: a JSON body ``{model, input, voice, response_format?, speed?,
  instructions?}``; the answer is real audio (``tests/support/audio.py``, made once per
  format) of the ``response_format``: ``mp3`` (the default) ``audio/mpeg``, ``opus``
  ``audio/ogg``, ``aac`` ``audio/aac``, ``flac`` ``audio/flac``, ``wav`` ``audio/wav``,
  ``pcm`` ``audio/pcm``. An OGG here holds Vorbis, not Opus, and ``aac`` is WAV bytes: the
  audio module's ``speech_audio`` says why. An ``input`` over 4096 characters, a missing
  field, an unknown format or a ``speed`` outside 0.25..4 is a 400. ``stream_format`` is
  ignored (the audio comes whole).
* Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, which the
  SDK maps to its exceptions (401 AuthenticationError, 429 RateLimitError, 5xx
  InternalServerError, 413 a plain APIStatusError).

Behaviour:

* ``key``: when set, a request whose ``Authorization`` is not ``Bearer <key>`` gets 401
  ``invalid_api_key``; when None any request is let in.
* ``script_transcript(text, duration=None)`` queues transcripts, FIFO, consumed only by a
  transcription that succeeds; with the queue empty the text is ``(transcript of <filename>)``.
* ``fail_next(status, times=1, retry_after=None, message=None, endpoint=None)``: the next
  ``times`` requests (of ``endpoint``, ``"transcriptions"`` or ``"speech"``; None: either) get
  ``status`` in the error shape, with a ``retry-after`` header when ``retry_after`` is given.
  Rules queue: the first that matches a request is used.
* ``down()`` makes every request a 503 until ``up()``.
* ``hold()`` returns an ``asyncio.Event``: requests wait, after being recorded, until the test
  sets it (``release()`` does too; ``held`` counts the waiting). ``delay(seconds)`` makes
  every request wait that long first (``delay(0)`` ends it). A held request whose client
  goes away, or that is still held when the server stops, is answered 503. Both apply
  before a request's answer is decided, so a held request sees a later ``down()`` or
  ``fail_next()``.
* Every request is recorded once its body is read, in ``requests`` (arrival order) and in
  ``transcriptions`` or ``speeches``; ``status`` is filled in when it is answered.
  ``wait_for_requests(n)`` waits for ``n`` arrivals (for a held one, say).

Self-contained but for ``tests.support.audio`` (aiohttp and the standard library otherwise).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import itertools
import json
import math
import time
import wave
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Self, TypeAlias

from aiohttp import BodyPartReader, hdrs, web

from tests.support.audio import SPEECH_FORMATS, speech_audio
from tests.support.fakes.loopback import LoopbackServer

Endpoint: TypeAlias = Literal["transcriptions", "speech"]

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
SPEECH_PATH = "/v1/audio/speech"
MAX_UPLOAD = 25 * 1024 * 1024  # OpenAI's limit on an audio upload
MAX_SPEECH_INPUT = 4096  # characters
TRANSCRIPT_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
SPEECH_CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
assert set(SPEECH_CONTENT_TYPES) == set(SPEECH_FORMATS)

_CHUNK = 256 * 1024
_WAV_PREFIX = 64 * 1024  # enough of an upload to read a WAV header from
_FIELD_LIMIT = 1024 * 1024  # a form field (not the file) or the speech JSON body
_POLL_S = 0.05
# verbose_json names the language, as OpenAI does, whatever code was sent.
_LANGUAGES = {
    "de": "german",
    "en": "english",
    "es": "spanish",
    "fr": "french",
    "it": "italian",
    "ja": "japanese",
    "nl": "dutch",
    "pt": "portuguese",
    "ru": "russian",
    "zh": "chinese",
}


@dataclass
class Transcription:
    """One request to the transcription endpoint; form fields are None when not sent."""

    model: str | None
    language: str | None
    response_format: str | None
    filename: str | None
    content_type: str | None
    size: int  # bytes of the file part; 0 when there was none
    sha256: str  # of the file part (of nothing when there was none)
    headers: dict[str, str]  # lower-cased names
    prompt: str | None = None
    temperature: float | None = None
    fields: dict[str, str] = field(default_factory=dict)  # every form field but the file
    has_file: bool = False
    status: int | None = None  # what it was answered; None until then
    text: str | None = None  # the transcript answered, when it succeeded
    at: float = field(default_factory=time.monotonic)


@dataclass
class Speech:
    """One request to the speech endpoint; fields are None when not sent."""

    model: str | None
    voice: str | None  # a custom voice's id for {"id": ...}
    input: str | None
    response_format: str | None
    headers: dict[str, str]  # lower-cased names
    speed: float | None = None
    instructions: str | None = None
    body: Any = None  # the parsed JSON; None when it was not JSON
    status: int | None = None
    at: float = field(default_factory=time.monotonic)


Record: TypeAlias = Transcription | Speech


@dataclass(frozen=True)
class ApiError:
    """An answer in OpenAI's error shape."""

    status: int
    message: str
    kind: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class _Failure:
    error: ApiError
    remaining: int
    endpoint: Endpoint | None


@dataclass
class _Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    content_type: str | None = None
    size: int = 0
    sha256: str = hashlib.sha256().hexdigest()
    has_file: bool = False
    wav_seconds: float | None = None
    error: ApiError | None = None


def _default_error(status: int, message: str | None) -> ApiError:
    """How OpenAI words a failure of this status."""
    if status == 401:
        return ApiError(401, message or "Incorrect API key provided.", code="invalid_api_key")
    if status == 429:
        text = message or "Rate limit reached for requests. Please try again later."
        return ApiError(429, text, "requests", "rate_limit_exceeded")
    if status == 503:
        text = message or "The engine is currently overloaded, please try again later."
        return ApiError(503, text, "server_error")
    if status >= 500:
        text = message or "The server had an error while processing your request."
        return ApiError(status, text, "server_error")
    return ApiError(status, message or f"FakeAudioServer: scripted {status}")


class FakeAudioServer(LoopbackServer):
    def __init__(
        self,
        *,
        key: str | None = None,
        max_upload: int = MAX_UPLOAD,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(host=host, port=port)
        self.key = key
        self.max_upload = max_upload
        self.requests: list[Record] = []
        self.transcriptions: list[Transcription] = []
        self.speeches: list[Speech] = []
        self.latency_s = 0.0
        self._transcripts: deque[tuple[str, float | None]] = deque()
        self._failures: list[_Failure] = []
        self._down = False
        self._gate: asyncio.Event | None = None
        self._held = 0
        self._ids = itertools.count(1)
        self._arrived = asyncio.Condition()
        self._audio_lock = asyncio.Lock()

    # -- scripting -------------------------------------------------------------------------

    def script_transcript(self, text: str, duration: float | None = None) -> Self:
        """Queue the text (and audio duration in seconds) of a coming transcription."""
        self._transcripts.append((text, duration))
        return self

    @property
    def pending(self) -> int:
        """Scripted transcripts not consumed yet."""
        return len(self._transcripts)

    def fail_next(
        self,
        status: int,
        times: int = 1,
        *,
        retry_after: float | None = None,
        message: str | None = None,
        endpoint: Endpoint | None = None,
        kind: str | None = None,
        code: str | None = None,
    ) -> Self:
        """Answer the next ``times`` requests (of ``endpoint``, or either) with ``status``.

        ``kind`` and ``code`` override the error's ``type`` and ``code`` fields, which are
        otherwise OpenAI's for that status."""
        error = _default_error(status, message)
        headers = {"retry-after": f"{retry_after:g}"} if retry_after is not None else {}
        error = ApiError(
            status, error.message, kind or error.kind, code or error.code, None, headers
        )
        self._failures.append(_Failure(error, times, endpoint))
        return self

    def down(self) -> Self:
        """Answer every request 503 until :meth:`up`."""
        self._down = True
        return self

    def up(self) -> Self:
        self._down = False
        return self

    def hold(self) -> asyncio.Event:
        """Hold every request from now until the returned event is set (the gate already
        closed, when there is one)."""
        if self._gate is None or self._gate.is_set():
            self._gate = asyncio.Event()
        return self._gate

    def release(self) -> None:
        """Let held requests (and later ones) through."""
        if self._gate is not None:
            self._gate.set()

    @property
    def held(self) -> int:
        """Requests waiting at the :meth:`hold` gate now."""
        return self._held

    def delay(self, seconds: float) -> Self:
        """Make every request wait ``seconds`` before it is answered; 0 ends it."""
        self.latency_s = max(0.0, seconds)
        return self

    async def wait_for_requests(self, count: int) -> None:
        """Wait until ``count`` requests have been recorded. No timeout of its own."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self.requests) >= count)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL ``openai.AsyncOpenAI(base_url=...)`` takes, ``/v1`` included."""
        return f"{self.root}/v1"

    def _application(self) -> web.Application:
        # The upload is streamed past aiohttp's body limit; the limit bounds the rest.
        app = web.Application(client_max_size=_FIELD_LIMIT)
        app.router.add_post(TRANSCRIPTIONS_PATH, self._transcription)
        app.router.add_post(SPEECH_PATH, self._speech)
        return app

    # -- endpoints -------------------------------------------------------------------------

    async def _transcription(self, request: web.Request) -> web.Response:
        upload = await self._read_upload(request)
        fields = upload.fields
        record = Transcription(
            model=fields.get("model"),
            language=fields.get("language"),
            response_format=fields.get("response_format"),
            filename=upload.filename,
            content_type=upload.content_type,
            size=upload.size,
            sha256=upload.sha256,
            headers=_headers(request),
            prompt=fields.get("prompt"),
            temperature=_float(fields.get("temperature")),
            fields=fields,
            has_file=upload.has_file,
        )
        self.transcriptions.append(record)
        await self._recorded(record)
        response = await self._gatekeep(request, "transcriptions")
        if response is None:
            error = upload.error or _check_transcription(record)
            response = self._error(error) if error else self._transcript(record, upload)
        record.status = response.status
        return response

    async def _speech(self, request: web.Request) -> web.Response:
        body, error = await _read_json(request)
        fields: dict[str, Any] = body if isinstance(body, dict) else {}
        voice = fields.get("voice")
        if isinstance(voice, dict):
            voice = voice.get("id")
        record = Speech(
            model=_str(fields.get("model")),
            voice=_str(voice),
            input=_str(fields.get("input")),
            response_format=_str(fields.get("response_format")),
            headers=_headers(request),
            speed=_float(fields.get("speed")),
            instructions=_str(fields.get("instructions")),
            body=body,
        )
        self.speeches.append(record)
        await self._recorded(record)
        response = await self._gatekeep(request, "speech")
        if response is None:
            error = error or _check_speech(fields)
            response = self._error(error) if error else await self._spoken(record)
        record.status = response.status
        return response

    async def _recorded(self, record: Record) -> None:
        self.requests.append(record)
        async with self._arrived:
            self._arrived.notify_all()

    async def _gatekeep(self, request: web.Request, endpoint: Endpoint) -> web.Response | None:
        """Wait as scripted, then the answer every request of ``endpoint`` gets now, if any:
        a stopped server or gone client, a missing key, the server down, a scripted failure."""
        if not await self._wait(request):
            return self._error(ApiError(503, "FakeAudioServer: request abandoned", "server_error"))
        if self.key is not None:
            auth = request.headers.get(hdrs.AUTHORIZATION)
            if auth is None:
                text = "You didn't provide an API key. Send it as Authorization: Bearer YOUR_KEY."
                return self._error(ApiError(401, text, code="invalid_api_key"))
            if auth != f"Bearer {self.key}":
                given = auth.removeprefix("Bearer ")
                text = f"Incorrect API key provided: {given[:3]}{'*' * max(len(given) - 3, 0)}."
                return self._error(ApiError(401, text, code="invalid_api_key"))
        if self._down:
            return self._error(_default_error(503, None))
        for failure in self._failures:
            if failure.remaining > 0 and failure.endpoint in (None, endpoint):
                failure.remaining -= 1
                self._failures = [f for f in self._failures if f.remaining > 0]
                return self._error(failure.error)
        return None

    async def _wait(self, request: web.Request) -> bool:
        """Sleep the scripted delay, then wait at the gate; False if the wait was cut short
        by the server stopping or the client going away."""
        deadline = time.monotonic() + self.latency_s
        while (left := deadline - time.monotonic()) > 0:
            if self._abandoned(request):
                return False
            await asyncio.sleep(min(left, _POLL_S))
        gate = self._gate
        if gate is None or gate.is_set():
            return not self._abandoned(request)
        self._held += 1
        try:
            while not gate.is_set():
                if self._abandoned(request):
                    return False
                try:
                    async with asyncio.timeout(_POLL_S):
                        await gate.wait()
                except TimeoutError:
                    pass
        finally:
            self._held -= 1
        return not self._abandoned(request)

    def _abandoned(self, request: web.Request) -> bool:
        transport = request.transport
        return self._stopping.is_set() or transport is None or transport.is_closing()

    # -- answers ---------------------------------------------------------------------------

    def _transcript(self, record: Transcription, upload: _Upload) -> web.Response:
        text, duration = (
            self._transcripts.popleft()
            if self._transcripts
            else (f"(transcript of {record.filename or 'upload'})", None)
        )
        seconds = duration if duration is not None else upload.wav_seconds or 1.0
        record.text = text
        usage = {"type": "duration", "seconds": math.ceil(seconds)}
        headers = {"x-request-id": self._request_id()}
        fmt = record.response_format or "json"
        if fmt == "json":
            return web.json_response({"text": text, "usage": usage}, headers=headers)
        if fmt == "verbose_json":
            code = record.language or "en"
            payload = {
                "task": "transcribe",
                "language": _LANGUAGES.get(code, code),
                "duration": round(seconds, 2),
                "text": text,
                "segments": [],
                "usage": usage,
            }
            return web.json_response(payload, headers=headers)
        if fmt == "srt":
            text = f"1\n00:00:00,000 --> {_timestamp(seconds, ',')}\n{text}\n\n"
        elif fmt == "vtt":
            text = f"WEBVTT\n\n00:00:00.000 --> {_timestamp(seconds, '.')}\n{text}\n\n"
        else:
            text += "\n"  # OpenAI ends a text transcript with a newline
        return web.Response(text=text, content_type="text/plain", headers=headers)

    async def _spoken(self, record: Speech) -> web.Response:
        fmt = record.response_format or "mp3"
        async with self._audio_lock:  # made once per format and session, off the loop
            audio = await asyncio.to_thread(speech_audio, fmt)
        headers = {"x-request-id": self._request_id()}
        return web.Response(body=audio, content_type=SPEECH_CONTENT_TYPES[fmt], headers=headers)

    def _error(self, error: ApiError) -> web.Response:
        inner = {
            "message": error.message,
            "type": error.kind,
            "param": error.param,
            "code": error.code,
        }
        headers = {**error.headers, "x-request-id": self._request_id()}
        return web.json_response({"error": inner}, status=error.status, headers=headers)

    def _request_id(self) -> str:
        return f"req_fake_audio_{next(self._ids)}"

    # -- reading requests ------------------------------------------------------------------

    async def _read_upload(self, request: web.Request) -> _Upload:
        """The form fields and a digest of the file, read part by part, in chunks."""
        upload = _Upload()
        if request.content_type != "multipart/form-data":
            text = "Invalid Content-Type header; expected multipart/form-data."
            upload.error = ApiError(400, text)
            return upload
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    upload.error = ApiError(400, "Nested multipart bodies are not supported.")
                    await part.release()
                elif part.name == "file" and part.filename is not None:
                    await self._read_file(part, upload)
                elif part.name:
                    upload.fields[part.name] = await part.text()
                else:
                    await part.release()
        except web.HTTPRequestEntityTooLarge:
            upload.error = ApiError(413, f"A form field is over {_FIELD_LIMIT} bytes.")
        except ValueError as exc:  # aiohttp's word for a malformed multipart body
            upload.error = ApiError(400, f"Could not parse multipart form: {exc}")
        return upload

    async def _read_file(self, part: BodyPartReader, upload: _Upload) -> None:
        digest = hashlib.sha256()
        prefix = bytearray()
        size = 0
        while chunk := await part.read_chunk(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if len(prefix) < _WAV_PREFIX:
                prefix += chunk[: _WAV_PREFIX - len(prefix)]
        upload.has_file = True
        upload.filename = part.filename
        upload.content_type = part.headers.get(hdrs.CONTENT_TYPE)
        upload.size = size
        upload.sha256 = digest.hexdigest()
        upload.wav_seconds = _wav_seconds(bytes(prefix))
        if size > self.max_upload:
            text = f"Maximum content size limit ({self.max_upload}) exceeded ({size} bytes read)"
            upload.error = ApiError(413, text, "server_error")


def _check_transcription(record: Transcription) -> ApiError | None:
    if not record.has_file:
        return ApiError(400, "Missing required parameter: 'file'.", param="file")
    if not record.model:
        return ApiError(400, "you must provide a model parameter", param="model")
    fmt = record.response_format
    if fmt is not None and fmt not in TRANSCRIPT_FORMATS:
        text = f"'{fmt}' is not one of {list(TRANSCRIPT_FORMATS)} - 'response_format'"
        return ApiError(400, text, param="response_format")
    if record.size == 0:
        return ApiError(400, "Audio file is too short. Minimum audio length is 0.1 seconds.")
    return None


def _check_speech(body: dict[str, Any]) -> ApiError | None:
    for name in ("model", "input", "voice"):
        if body.get(name) in (None, ""):
            return ApiError(400, f"Missing required parameter: '{name}'.", param=name)
    text = body["input"]
    if not isinstance(text, str):
        return ApiError(400, "Invalid type for 'input': expected a string.", param="input")
    if len(text) > MAX_SPEECH_INPUT:
        message = f"String should have at most {MAX_SPEECH_INPUT} characters"
        return ApiError(400, message, param="input", code="string_too_long")
    fmt = body.get("response_format", "mp3")
    if fmt not in SPEECH_CONTENT_TYPES:
        text = f"'{fmt}' is not one of {list(SPEECH_CONTENT_TYPES)} - 'response_format'"
        return ApiError(400, text, param="response_format")
    speed = body.get("speed", 1.0)
    if not isinstance(speed, int | float) or isinstance(speed, bool) or not 0.25 <= speed <= 4:
        return ApiError(400, f"{speed!r} is not between 0.25 and 4.0 - 'speed'", param="speed")
    return None


async def _read_json(request: web.Request) -> tuple[Any, ApiError | None]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return None, ApiError(413, f"The request body is over {_FIELD_LIMIT} bytes.")
    try:
        # Strict like the real API: NaN and Infinity are not JSON.
        body = json.loads(raw, parse_constant=_not_json)
    except ValueError:
        return None, ApiError(400, "We could not parse the JSON body of your request.")
    if not isinstance(body, dict):
        return body, ApiError(400, "The request body must be a JSON object.")
    return body, None


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _wav_seconds(prefix: bytes) -> float | None:
    """The duration a WAV header declares, from the upload's first bytes; None if not a WAV
    (or one the ``wave`` module cannot read)."""
    if not (prefix.startswith(b"RIFF") and prefix[8:12] == b"WAVE"):
        return None
    try:
        with wave.open(io.BytesIO(prefix)) as wav:
            rate = wav.getframerate()
            return wav.getnframes() / rate if rate else None
    except (wave.Error, EOFError):
        return None


def _timestamp(seconds: float, comma: str) -> str:
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    return f"{hours:02}:{minutes:02}:{secs:02}{comma}{millis:03}"


def _headers(request: web.Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items()}


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None
