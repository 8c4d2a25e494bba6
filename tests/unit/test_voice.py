"""Voice (chat/voice.py, engine/llm/audio.py): what counts as audio, what is spoken of an
answer, the audio of a spoken answer made once per reply row on both stores, the config's
rules, and the openai SDK adapter's errors against the fake audio server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from geodebot.channels.base import InboundFile
from geodebot.chat.voice import (
    Account,
    Hearing,
    Speaking,
    VoiceUnavailable,
    clock,
    cut_note,
    is_audio,
    sniff_audio,
    spoken_text,
)
from geodebot.config.schema import BindingConfig, Config, ConfigError, VoiceConfig, load_config
from geodebot.engine.llm.audio import (
    LOCAL_EXTRA,
    AudioError,
    Heard,
    LocalWhisper,
    OpenAIAudio,
    local_model_problem,
    model_dir_problem,
)
from geodebot.engine.spend import AudioBudget, AudioPrices, SpendGate, SpendLimits
from geodebot.store.files import FileStore
from geodebot.store.protocol import Store
from geodebot.store.records import NewOutbound, Speech
from tests.support.audio import cached_note
from tests.support.fakes.audio_server import FakeAudioServer
from tests.support.postgres import Place


def test_audio_is_known_by_type_by_extension_or_as_a_voice_note() -> None:
    assert is_audio(InboundFile("r", "voice.oga", "audio/ogg"))
    assert is_audio(InboundFile("r", "memo.m4a", ""))
    assert is_audio(InboundFile("r", "clip.webm", "video/webm"))
    assert is_audio(InboundFile("r", "x", "application/octet-stream", voice=True))
    assert not is_audio(InboundFile("r", "film.mp4", "video/mp4"))
    assert not is_audio(InboundFile("r", "notes.txt", "text/plain"))


def test_audio_is_known_by_its_bytes() -> None:
    assert sniff_audio(cached_note().read_bytes()) == "audio/ogg"
    assert sniff_audio(b"RIFF\x00\x00\x00\x00WAVEfmt ") == "audio/wav"
    assert sniff_audio(b"ID3\x04\x00") == "audio/mpeg"
    assert sniff_audio(b"\x00\x00\x00\x20ftypM4A ") == "audio/mp4"
    assert sniff_audio(b"%PDF-1.4") is None
    assert sniff_audio(b"hello") is None


def test_clock() -> None:
    assert [clock(s) for s in (0, 9.4, 75, 3600 + 61)] == ["0:00", "0:09", "1:15", "1:01:01"]


def test_an_answer_is_spoken_as_plain_text_cut_at_a_sentence() -> None:
    spoken = spoken_text("**Done.** See [the log](http://x/y).\n```sh\nrm -rf /\n```\n- a", 500)
    assert spoken == Speech("Done. See the log.\n(code left out)\na")
    long = " ".join(f"Line {n} is fine." for n in range(100))
    cut = spoken_text(long, 100)
    assert cut is not None
    assert cut.cut
    assert len(cut.text) <= 100
    assert cut.text.endswith("is fine.")
    assert cut_note(cut, 100) == "(spoken: the first 100 characters of the answer)"
    assert spoken_text("```\nonly code\n```", 100) == Speech("(code left out)")
    assert spoken_text("  **  ", 100) is None


def binding(**keys: object) -> BindingConfig:
    return BindingConfig.model_validate(
        {"platform": "telegram", "channel": "1", "session": "s", **keys}
    )


def test_voice_keys_need_what_they_use_in_voice() -> None:
    base = {"bindings": [{"platform": "telegram", "channel": "1", "session": "s"}]}
    with pytest.raises(ValueError, match=r"voice_replies: needs \[voice\] speech_url"):
        Config.model_validate(
            {
                "voice": {"transcribe_url": "http://127.0.0.1:9/v1"},
                "bindings": [{**base["bindings"][0], "voice_replies": "always"}],
            }
        )
    with pytest.raises(ValueError, match=r"voice: needs \[voice\] transcribe_url"):
        Config.model_validate({"bindings": [{**base["bindings"][0], "voice": True}]})
    config = Config.model_validate(
        {"voice": {"transcribe_url": "http://h:1/v1/audio/transcriptions/"}, **base}
    )
    assert config.voice is not None
    assert config.voice.transcribe_url == "http://h:1/v1"


def test_a_bad_voice_url_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[voice]\ntranscribe_url = "ftp://x"\n')
    with pytest.raises(ConfigError, match=r"voice\.transcribe_url"):
        load_config(path)


class _Speaker:
    def __init__(self) -> None:
        self.said: list[str] = []

    async def speak(self, text: str) -> bytes:
        self.said.append(text)
        return b"OggS" + text.encode()

    async def aclose(self) -> None:
        pass


@pytest.fixture
async def store(place: Place) -> AsyncIterator[Store]:
    async with place.store() as opened:  # type: ignore[attr-defined]
        yield opened


async def test_a_spoken_answer_is_made_once_and_recorded_on_its_row(
    store: Store, tmp_path: Path
) -> None:
    speaker = _Speaker()
    voice = VoiceConfig(speech_url="http://127.0.0.1:9/v1")
    files = FileStore(tmp_path / "files")
    speaking = Speaking(speaker, files, store, voice)
    reply = NewOutbound("s", "telegram", "1", None, "7", "The answer.", speech=Speech("Answer."))
    row = await store.outbox_add(reply)
    assert (row.speech, row.spoken) == (Speech("Answer."), None)

    recorded, spoken, speech = await speaking.audio(row)
    assert speech == Speech("Answer.")
    assert recorded.spoken == spoken
    assert (spoken.media_type, spoken.size) == ("audio/ogg", len(b"OggSAnswer."))
    assert files.read(spoken.sha256) == b"OggSAnswer."
    # Asked again (a part sent again after a crash): the recorded audio, no second request.
    again, spoken_again, _ = await speaking.audio(row)
    assert again.spoken == spoken_again == spoken
    assert speaker.said == ["Answer."]
    fresh = await store.get_outbox(row.id)
    assert fresh is not None
    assert fresh.spoken == recorded.spoken


def test_which_answers_are_spoken(tmp_path: Path) -> None:
    voice = VoiceConfig(speech_url="http://127.0.0.1:9/v1", max_speech_chars=50)
    speaking = Speaking(_Speaker(), FileStore(tmp_path), None, voice)  # type: ignore[arg-type]
    never, when, always = (binding(voice_replies=v) for v in ("never", "when_spoken_to", "always"))
    assert speaking.speech(never, spoken_to=True, answer="Hi.") is None
    assert speaking.speech(when, spoken_to=False, answer="Hi.") is None
    assert speaking.speech(when, spoken_to=True, answer="Hi.") == Speech("Hi.")
    assert speaking.speech(always, spoken_to=False, answer="Hi.") == Speech("Hi.")


async def test_the_adapter_maps_the_services_answers() -> None:
    note = cached_note().read_bytes()
    async with FakeAudioServer(key="k") as server:
        url = server.url
        audio = OpenAIAudio(server.url, "k", model="whisper-1", language="en", max_retries=0)
        try:
            server.script_transcript("hello there", duration=7)
            heard = await audio.transcribe(note, name="n.ogg", media_type="audio/ogg", seconds=2)
            assert heard == Heard("hello there", 7.0)
            assert server.transcriptions[-1].language == "en"

            server.fail_next(429, retry_after=1)
            with pytest.raises(AudioError) as limited:
                await audio.transcribe(note, name="n.ogg", media_type="audio/ogg", seconds=2)
            assert not limited.value.permanent
            assert limited.value.retry_after == 1

            server.fail_next(400, message="Invalid file format.")
            with pytest.raises(AudioError, match="Invalid file format") as refused:
                await audio.transcribe(note, name="n.ogg", media_type="audio/ogg", seconds=2)
            assert refused.value.permanent

            spoken = await audio.speak("hello")
            assert spoken.startswith(b"OggS")
        finally:
            await audio.aclose()
        wrong = OpenAIAudio(server.url, "wrong", model="whisper-1", max_retries=0)
        try:
            with pytest.raises(AudioError, match="HTTP 401") as denied:
                await wrong.transcribe(note, name="n.ogg", media_type="audio/ogg", seconds=2)
            assert denied.value.permanent
        finally:
            await wrong.aclose()
    # Nobody listens there now.
    gone = OpenAIAudio(url, "k", model="whisper-1", max_retries=0)
    try:
        with pytest.raises(AudioError, match="cannot be reached") as down:
            await gone.transcribe(note, name="n.ogg", media_type="audio/ogg", seconds=2)
        assert not down.value.permanent
    finally:
        await gone.aclose()


async def test_a_service_down_is_voice_unavailable_and_a_refusal_is_a_reason() -> None:
    note = cached_note().read_bytes()
    described = InboundFile("r", "voice.oga", "audio/ogg", len(note), duration=3, voice=True)
    async with FakeAudioServer() as server:
        audio = OpenAIAudio(server.url, None, model="whisper-1", max_retries=0)
        hearing = Hearing(audio, VoiceConfig(transcribe_url=server.url))
        try:
            server.down()
            with pytest.raises(VoiceUnavailable, match="503"):
                await hearing.hear("voice.oga", described, note)
            server.up()
            server.fail_next(400, message="Audio file is too short.")
            refused = await hearing.hear("voice.oga", described, note)
            assert "Audio file is too short" in refused.refusal
            server.script_transcript("   ")
            silent = await hearing.hear("voice.oga", described, note)
            assert silent.refusal == "nothing in it could be made out"
            server.script_transcript("all good", duration=3)
            heard = await hearing.hear("voice.oga", described, note)
            assert (heard.transcript, heard.seconds, heard.voice, heard.refusal) == (
                "all good",
                3.0,
                True,
                "",
            )
            # Sent as what the bytes are, under a name the service reads the format from.
            sent = server.transcriptions[-1]
            assert (sent.filename, sent.content_type) == ("voice.ogg", "audio/ogg")
            mislabelled = InboundFile("r", "audio_message.webm", "audio/webm", len(note))
            await hearing.hear("audio_message.webm", mislabelled, note)
            sent = server.transcriptions[-1]
            assert (sent.filename, sent.content_type) == ("audio_message.ogg", "audio/ogg")
        finally:
            await audio.aclose()


def test_announced_length_and_size_are_refused_before_a_download() -> None:
    hearing = Hearing(None, VoiceConfig(transcribe_url="http://h/v1", max_seconds=60))  # type: ignore[arg-type]
    long = InboundFile("r", "v.oga", "audio/ogg", 10, duration=61, voice=True)
    assert hearing.refused_before(long, 1000, 1) == "a voice note of 1:01, over the limit of 1:00"
    big = InboundFile("r", "a.mp3", "audio/mpeg", 5000, duration=10)
    assert hearing.refused_before(big, 1000, 0.001) == "5.0 KB, over this chat's limit of 0.001 MB"
    assert hearing.refused_before(InboundFile("r", "a.mp3", "audio/mpeg", 10), 1000, 1) is None


async def test_local_transcription_without_the_extra_names_it(tmp_path: Path) -> None:
    try:
        import faster_whisper  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.fail("this test is of a machine without the faster-whisper extra")
    local = LocalWhisper(tmp_path)
    with pytest.raises(AudioError, match=f"needs the {LOCAL_EXTRA} extra") as missing:
        await local.transcribe(b"OggS", name="v.ogg", media_type="audio/ogg", seconds=1)
    assert missing.value.permanent
    assert local_model_problem(tmp_path) == missing.value.args[0]
    assert model_dir_problem(tmp_path / "nope") == f"{tmp_path / 'nope'} is not a directory"
    assert "missing model.bin, config.json" in (model_dir_problem(tmp_path) or "")
    (tmp_path / "model.bin").write_bytes(b"x")
    (tmp_path / "config.json").write_text("{}")
    assert model_dir_problem(tmp_path) is None


@pytest.mark.parametrize("limited", [False, True])
async def test_transcriptions_are_counted_and_refused_before_a_call_past_the_cap(
    store: Store, limited: bool
) -> None:
    note = cached_note().read_bytes()
    described = InboundFile("r", "voice.oga", "audio/ogg", len(note), duration=12, voice=True)
    # $0.006 a minute: a 12 s note may cost $0.0012; the cap takes one such note, not two.
    limits = SpendLimits(daily_usd=0.002 if limited else None)
    async with FakeAudioServer() as server, SpendGate(store, limits) as gate:
        audio = OpenAIAudio(server.url, None, model="whisper-1", max_retries=0)
        budget = AudioBudget(gate, AudioPrices(per_minute=0.006))
        voice = VoiceConfig(transcribe_url=server.url)
        hearing = Hearing(audio, voice, budget)
        account = Account("s", "telegram:1", "t-inbox-1")
        try:
            server.script_transcript("first", duration=10)
            first = await hearing.hear("voice.oga", described, note, account)
            assert first.transcript == "first"
            server.script_transcript("second", duration=10)
            second = await hearing.hear("voice.oga", described, note, account)
        finally:
            await audio.aclose()
    if limited:
        # Refused on its worst case before the service was asked.
        assert "daily spend budget" in second.refusal
        assert second.refusal.startswith("not transcribed: ")
        assert [t.text for t in server.transcriptions] == ["first"]
    else:
        assert second.transcript == "second"
        assert len(server.transcriptions) == 2
    [row] = await store.usage_report()
    # Settled at what the service counted (10 s each), not the worst case reserved.
    calls = 1 if limited else 2
    assert (row.calls, row.audio_seconds, row.spoken_chars) == (calls, 10.0 * calls, 0)
    assert row.cost_usd == pytest.approx(0.001 * calls)
    assert (row.input_tokens, row.output_tokens) == (0, 0)


async def test_spoken_characters_are_counted(store: Store, tmp_path: Path) -> None:
    async with SpendGate(store, SpendLimits()) as gate:
        budget = AudioBudget(gate, AudioPrices(per_mchars=15.0))
        voice = VoiceConfig(speech_url="http://127.0.0.1:9/v1")
        speaking = Speaking(_Speaker(), FileStore(tmp_path), store, voice, budget)
        reply = NewOutbound("s", "telegram", "1", None, None, "x", speech=Speech("Twelve chars"))
        await speaking.audio(await store.outbox_add(reply))
    [row] = await store.usage_report(by="binding")
    assert (row.key, row.spoken_chars, row.audio_seconds) == ("telegram:1", 12, 0.0)
    assert row.cost_usd == pytest.approx(12 * 15.0 / 1e6)


def test_check_says_a_local_model_needs_the_extra(tmp_path: Path) -> None:
    from geodebot.cli.check import _voice

    config = Config.model_validate({"voice": {"local_model_dir": str(tmp_path)}})
    [row] = _voice(config)
    assert (row.what, row.ok) == ("voice local model", False)
    assert f"needs the {LOCAL_EXTRA} extra: pip install 'geodebot[{LOCAL_EXTRA}]'" in row.detail
    assert _voice(Config.model_validate({"voice": {"transcribe_url": "http://h/v1"}})) == []


def test_the_audio_key_is_a_secret_of_the_config() -> None:
    from geodebot.config.schema import secret_names

    config = Config.model_validate({"voice": {"transcribe_url": "http://h/v1", "api_key_env": "K"}})
    assert "K" in set(secret_names(config))
