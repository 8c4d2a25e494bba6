"""The fake OpenAI audio server, driven through the real openai SDK, and the audio helpers
that make its (and the tests') real audio files."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.support import audio
from tests.support.audio import (
    AudioToolMissing,
    audio_type,
    cached_note,
    duration_s,
    padded_ogg,
    silence_wav,
    sized_wav,
    spoken_wav,
    to_ogg,
)
from tests.support.fakes.audio_server import MAX_UPLOAD, FakeAudioServer

KEY = "k"


@pytest.fixture
async def server() -> AsyncIterator[FakeAudioServer]:
    async with FakeAudioServer(key=KEY) as srv:
        yield srv


@pytest.fixture
async def client(server: FakeAudioServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0) as oai:
        yield oai


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_transcription_answers_the_scripted_text_and_records_the_upload(
    server: FakeAudioServer, client: openai.AsyncOpenAI
) -> None:
    data = cached_note().read_bytes()
    server.script_transcript("water the plants", duration=2.5)

    result = await client.audio.transcriptions.create(
        model="whisper-1", file=("note.ogg", data, "audio/ogg"), language="en"
    )

    assert result.text == "water the plants"
    assert result.usage is not None
    assert result.usage.type == "duration"
    assert result.usage.seconds == 3  # billed by the whole second, rounded up
    [seen] = server.transcriptions
    assert server.requests == [seen]
    assert (seen.model, seen.language, seen.response_format) == ("whisper-1", "en", None)
    assert (seen.filename, seen.content_type) == ("note.ogg", "audio/ogg")
    assert (seen.size, seen.sha256) == (len(data), _sha(data))
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert (seen.status, seen.text) == (200, "water the plants")
    assert server.pending == 0


async def test_transcripts_queue_in_order_then_default_to_the_filename(
    server: FakeAudioServer, client: openai.AsyncOpenAI
) -> None:
    wav = cached_note(kind="wav")
    server.script_transcript("first").script_transcript("second")
    texts = []
    for name in ("a.wav", "b.wav", "c.wav"):
        result = await client.audio.transcriptions.create(
            model="whisper-1", file=(name, wav.read_bytes(), "audio/wav")
        )
        texts.append(result.text)
        assert result.usage is not None
        assert result.usage.type == "duration"
        # No scripted duration: the WAV header's, rounded up.
        assert result.usage.seconds == math.ceil(duration_s(wav))
    assert texts == ["first", "second", "(transcript of c.wav)"]


async def test_verbose_json_and_text_formats(
    server: FakeAudioServer, client: openai.AsyncOpenAI
) -> None:
    data = cached_note().read_bytes()
    server.script_transcript("a verbose note", duration=4.25).script_transcript("plain")

    verbose = await client.audio.transcriptions.create(
        model="whisper-1",
        file=("note.ogg", data, "audio/ogg"),
        language="en",
        response_format="verbose_json",
        prompt="gardening",
        temperature=0.2,
    )
    text = await client.audio.transcriptions.create(
        model="whisper-1", file=("note.ogg", data, "audio/ogg"), response_format="text"
    )

    assert (verbose.text, verbose.duration, verbose.language) == ("a verbose note", 4.25, "english")
    assert verbose.segments == []
    assert text == "plain\n"
    first, second = server.transcriptions
    assert (first.response_format, first.prompt, first.temperature) == (
        "verbose_json",
        "gardening",
        0.2,
    )
    assert second.response_format == "text"


@pytest.mark.parametrize(
    ("fmt", "content_type", "magic", "soxi_type"),
    [
        ("opus", "audio/ogg", b"OggS", audio.ogg_codec()),
        ("mp3", "audio/mpeg", b"\xff", "mp3"),
        ("wav", "audio/wav", b"RIFF", "wav"),
        ("flac", "audio/flac", b"fLaC", "flac"),
    ],
)
async def test_speech_answers_real_audio_of_the_format(
    server: FakeAudioServer,
    client: openai.AsyncOpenAI,
    tmp_path: Path,
    fmt: str,
    content_type: str,
    magic: bytes,
    soxi_type: str,
) -> None:
    if fmt == "mp3" and not audio.can_write("mp3"):
        magic, soxi_type = b"RIFF", "wav"  # the fake's fallback: WAV bytes

    response = await client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input="hello",
        response_format=fmt,  # type: ignore[arg-type]
    )

    body = response.content
    assert body.startswith(magic)
    if soxi_type == "mp3":  # an MPEG frame sync, or an ID3 tag before it
        assert body[1] & 0xE0 == 0xE0 or body.startswith(b"ID3")
    if soxi_type == "wav":
        assert body[8:12] == b"WAVE"
    assert response.response.headers["content-type"] == content_type
    saved = tmp_path / f"speech.{soxi_type}"
    saved.write_bytes(body)
    assert audio_type(saved) == soxi_type
    assert duration_s(saved) > 0.5
    [seen] = server.speeches
    assert (seen.model, seen.voice, seen.input, seen.response_format) == (
        "tts-1",
        "alloy",
        "hello",
        fmt,
    )
    assert (seen.status, seen.headers["authorization"]) == (200, f"Bearer {KEY}")


async def test_speech_defaults_to_mp3_and_rejects_long_input(
    server: FakeAudioServer, client: openai.AsyncOpenAI
) -> None:
    response = await client.audio.speech.create(model="tts-1", voice="nova", input="x" * 4096)
    # audio/mpeg even where sox has no MP3 encoder and the bytes are WAV.
    assert response.response.headers["content-type"] == "audio/mpeg"
    assert server.speeches[0].response_format is None

    with pytest.raises(openai.BadRequestError) as caught:
        await client.audio.speech.create(model="tts-1", voice="nova", input="x" * 4097)

    assert caught.value.code == "string_too_long"
    assert [s.status for s in server.speeches] == [200, 400]


async def test_wrong_key_is_an_authentication_error(server: FakeAudioServer) -> None:
    async with openai.AsyncOpenAI(base_url=server.url, api_key="nope", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as caught:
            await wrong.audio.speech.create(model="tts-1", voice="alloy", input="hi")
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert caught.value.type == "invalid_request_error"
    assert server.speeches[0].status == 401


async def test_scripted_failures_then_recovery(
    server: FakeAudioServer, client: openai.AsyncOpenAI
) -> None:
    data = cached_note().read_bytes()
    server.fail_next(429, retry_after=7)
    server.fail_next(500, endpoint="speech")

    with pytest.raises(openai.RateLimitError) as limited:
        await client.audio.transcriptions.create(model="whisper-1", file=("n.ogg", data))
    assert limited.value.response.headers["retry-after"] == "7"
    assert limited.value.code == "rate_limit_exceeded"
    # The speech failure does not touch transcriptions, and a failure consumes no transcript.
    server.script_transcript("kept")
    ok = await client.audio.transcriptions.create(model="whisper-1", file=("n.ogg", data))
    assert ok.text == "kept"
    with pytest.raises(openai.InternalServerError):
        await client.audio.speech.create(model="tts-1", voice="alloy", input="hi")

    server.down()
    with pytest.raises(openai.InternalServerError) as unavailable:
        await client.audio.transcriptions.create(model="whisper-1", file=("n.ogg", data))
    assert unavailable.value.status_code == 503
    with pytest.raises(openai.InternalServerError):
        await client.audio.speech.create(model="tts-1", voice="alloy", input="hi")
    server.up()
    await client.audio.speech.create(model="tts-1", voice="alloy", input="hi")

    assert [r.status for r in server.requests] == [429, 200, 500, 503, 503, 200]


async def test_large_notes_are_hashed_not_kept_and_oversized_ones_are_413(
    server: FakeAudioServer, client: openai.AsyncOpenAI
) -> None:
    twenty = cached_note(20 * 1024 * 1024).read_bytes()
    ok = await client.audio.transcriptions.create(
        model="whisper-1", file=("big.ogg", twenty, "audio/ogg")
    )
    assert ok.text == "(transcript of big.ogg)"

    oversized = cached_note(MAX_UPLOAD + 2, kind="wav").read_bytes()
    with pytest.raises(openai.APIStatusError) as caught:
        await client.audio.transcriptions.create(
            model="whisper-1", file=("huge.wav", oversized, "audio/wav")
        )

    assert caught.value.status_code == 413
    big, huge = server.transcriptions
    assert (big.size, big.sha256, big.status) == (len(twenty), _sha(twenty), 200)
    assert (huge.size, huge.sha256, huge.status) == (len(oversized), _sha(oversized), 413)
    assert not any(isinstance(v, bytes) for v in vars(big).values())


async def test_upload_limit_is_inclusive() -> None:
    data = cached_note().read_bytes()
    for limit, status in ((len(data), 200), (len(data) - 1, 413)):
        async with (
            FakeAudioServer(max_upload=limit) as srv,
            openai.AsyncOpenAI(base_url=srv.url, api_key=KEY, max_retries=0) as oai,
        ):
            with contextlib.suppress(openai.APIStatusError):
                await oai.audio.transcriptions.create(model="whisper-1", file=("n.ogg", data))
            assert [t.status for t in srv.transcriptions] == [status]


async def test_hold_keeps_a_request_open_until_released(
    server: FakeAudioServer, client: openai.AsyncOpenAI
) -> None:
    data = cached_note().read_bytes()
    gate = server.hold()
    call = asyncio.create_task(
        client.audio.transcriptions.create(model="whisper-1", file=("n.ogg", data))
    )
    async with asyncio.timeout(5):
        await server.wait_for_requests(1)
    await asyncio.sleep(0.1)
    assert not call.done()
    assert server.held == 1
    assert server.transcriptions[0].status is None

    gate.set()
    async with asyncio.timeout(5):
        result = await call
    assert result.text == "(transcript of n.ogg)"
    assert server.held == 0


async def test_delay_holds_every_answer(
    server: FakeAudioServer, client: openai.AsyncOpenAI
) -> None:
    server.delay(0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await client.audio.speech.create(model="tts-1", voice="alloy", input="hi")
    assert loop.time() - started >= 0.3


async def test_malformed_requests_are_400_in_openai_shape(server: FakeAudioServer) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        no_file = aiohttp.FormData({"model": "whisper-1"}, default_to_multipart=True)
        async with http.post(f"{server.url}/audio/transcriptions", data=no_file, headers=auth) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "file"
        no_model = aiohttp.FormData()
        no_model.add_field("file", b"RIFF", filename="n.wav", content_type="audio/wav")
        async with http.post(
            f"{server.url}/audio/transcriptions", data=no_model, headers=auth
        ) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "model")
        async with http.post(f"{server.url}/audio/speech", json={"model": "tts-1"}) as r:
            assert r.status == 401  # the key is checked first
            assert (await r.json())["error"]["code"] == "invalid_api_key"


def test_audio_helpers_make_real_files(tmp_path: Path) -> None:
    wav = spoken_wav("hello from the test suite", tmp_path / "hello.wav")
    header = wav.read_bytes()[:12]
    assert header[:4] == b"RIFF"
    assert header[8:] == b"WAVE"
    assert audio_type(wav) == "wav"
    assert 0.8 < duration_s(wav) < 4.0

    ogg = to_ogg(wav, tmp_path / "hello.ogg")
    assert ogg.read_bytes()[:4] == b"OggS"
    assert audio_type(ogg) == audio.ogg_codec()
    assert abs(duration_s(ogg) - duration_s(wav)) < 0.1

    silent = silence_wav(1.5, tmp_path / "silent.wav")
    assert duration_s(silent) == pytest.approx(1.5)

    tone = sized_wav(16_044, tmp_path / "tone.wav")
    assert tone.stat().st_size == 16_044
    assert duration_s(tone) == pytest.approx(16_000 / 8000)
    with pytest.raises(ValueError, match="even"):
        sized_wav(16_045, tmp_path / "odd.wav")

    padded = padded_ogg(300_001, tmp_path / "padded.ogg")
    assert padded.stat().st_size == 300_001
    assert padded.read_bytes()[:4] == b"OggS"
    assert 0.5 < duration_s(padded) < 4.0


def test_a_missing_tool_names_its_debian_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(AudioToolMissing, match=r"Debian package espeak-ng"):
        spoken_wav("hi", tmp_path / "hi.wav")
    with pytest.raises(AudioToolMissing, match=r"Debian package sox"):
        duration_s(tmp_path / "hi.wav")
