"""Voice notes through ``geodebot serve`` on Telegram: python-telegram-bot against the fake
Bot API (a voice message, getFile, the file URL), the openai SDK's audio client against the
fake OpenAI audio server (a multipart upload in, JSON out), the anthropic SDK against the
fake model server.

A voice note becomes a turn whose model request holds the transcript, marked as one; the
sender sees what was heard (the answer's first line; the first preview when streamed). A note
too long, too large or not audio gets one reply naming the reason and no model call, and
nothing is downloaded for the first two; with the transcription service down the sender is
told, the message waits as a dead letter, and its replay transcribes it once. A SIGKILL
after the transcription and before the answer: the restarted daemon answers it, with one
transcription in all.

One daemon serves the file (restarted where a test kills it), each test in a chat of its own.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from geodebot.chat.replies import VOICE_UNAVAILABLE_TEXT
from tests.support.audio import cached_note
from tests.support.chat_e2e_telegram import ALICE, Chat, ChatWorld, FilesModel, serving
from tests.support.cli import geodebot
from tests.support.fakes.audio_server import FakeAudioServer
from tests.support.fakes.llm_server import (
    Delay,
    FakeLLMServer,
    Reply,
    held_once,
)
from tests.support.fakes.telegram_server import FakeTelegram, SentMessage, html_visible
from tests.support.waiting import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

AUDIO_KEY, AUDIO_KEY_ENV = "e2e-audio-key-5f1c", "E2E_AUDIO_KEY"
HEARD, STREAMED, REFUSED, DOWN, KILLED = -5201, -5202, -5203, -5204, -5205
SPOKEN, ALWAYS = -5206, -5207
SPEAKS = {SPOKEN: 'voice_replies = "when_spoken_to"\n', ALWAYS: 'voice_replies = "always"\n'}
CHATS = tuple(
    Chat(chat, stream=chat == STREAMED, approvers=(), tools=(), keys=SPEAKS.get(chat, ""))
    for chat in (HEARD, STREAMED, REFUSED, DOWN, KILLED, SPOKEN, ALWAYS)
)
MAX_SPEECH = 120
MB = 1000 * 1000


class VoiceWorld(ChatWorld):
    """The chat world with ``[voice]`` on the fake audio server, and a voice note to send."""

    audio: FakeAudioServer

    def voice(self, chat: int, data: bytes, **file: Any) -> int:
        """Alice sends a voice note (``file``: push_file's arguments); the update."""
        return self.telegram.push_file(chat, data, user_id=ALICE, voice=True, **file)

    def visible(self, chat: int) -> list[str]:
        return [html_visible(m.text) for m in self.messages(chat)]


def voice_table(audio: FakeAudioServer) -> str:
    return (
        f'[voice]\ntranscribe_url = "{audio.url}/audio/transcriptions"\n'
        f'api_key_env = "{AUDIO_KEY_ENV}"\nmax_seconds = 300\nmax_retries = 1\n'
        f'speech_url = "{audio.url}"\nspeech_voice = "nova"\n'
        f"max_speech_chars = {MAX_SPEECH}\n"
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VoiceWorld]:
    async with (
        FakeTelegram() as telegram,
        FakeLLMServer() as llm,
        FakeAudioServer(key=AUDIO_KEY) as audio,
    ):
        root = tmp_path_factory.mktemp("voice-telegram")
        world = VoiceWorld(
            telegram,
            llm,
            root,
            CHATS,
            model=FilesModel(),
            extra_config=voice_table(audio),
            extra_env={AUDIO_KEY_ENV: AUDIO_KEY},
        )
        world.audio = audio
        async with serving(world):
            yield world


@pytest_asyncio.fixture(loop_scope="module")
async def world(shared: VoiceWorld) -> VoiceWorld:
    if not shared.running():
        await shared.start()
    return shared


@pytest.fixture
def model(world: VoiceWorld) -> FilesModel:
    assert isinstance(world.model, FilesModel)
    return world.model


@pytest.fixture(scope="module")
def note() -> bytes:
    """A real voice note: espeak-ng's speech in an OGG file."""
    return cached_note().read_bytes()


def texts_of(blocks: list[dict[str, Any]]) -> list[str]:
    return [b["text"] for b in blocks if b.get("type") == "text"]


async def test_a_voice_note_becomes_a_turn_whose_request_holds_the_transcript(
    world: VoiceWorld, model: FilesModel, note: bytes
) -> None:
    world.audio.script_transcript("please restart the web server", duration=12)
    model.script("please restart the web server", Reply("Restarting it now."))
    world.voice(HEARD, note, duration=12)
    answer = await world.showing(HEARD, "Restarting it now.", part=True)

    # What was heard is the answer's first line.
    assert html_visible(answer.text).splitlines()[0] == "🎙 “please restart the web server”"
    [block] = texts_of(model.blocks("please restart the web server"))
    assert block == "[voice note, 0:12] please restart the web server"
    [asked] = world.audio.transcriptions
    assert (asked.model, asked.content_type, asked.size) == ("whisper-1", "audio/ogg", len(note))
    assert (asked.filename or "").startswith("voice-")
    assert asked.headers.get("authorization") == f"Bearer {AUDIO_KEY}"
    # One message from the bot: the answer (no notice: nothing was refused).
    assert len(world.messages(HEARD)) == 1
    # geodebot usage counts the seconds transcribed, by the binding.
    config = str(world.root / "config.toml")
    rc, out, err = await geodebot("usage", "--by", "binding", "--json", "--config", config)
    assert rc == 0, err
    rows = {row["key"]: row for row in map(json.loads, out.splitlines())}
    assert rows[f"telegram:{HEARD}"]["audio_seconds"] == 12.0


async def test_a_streamed_answer_shows_what_was_heard_in_its_first_preview(
    world: VoiceWorld, model: FilesModel, note: bytes
) -> None:
    world.audio.script_transcript("how full is the disk", duration=3)
    # Held a little, so the preview is up before the answer.
    model.script("how full is the disk", Delay(1.0, Reply("Disk is 41% full.")))
    world.voice(STREAMED, note, duration=3)
    answer = await world.showing(STREAMED, "Disk is 41% full.", part=True)
    versions = world.telegram.history(STREAMED, answer.message_id)
    assert len(versions) >= 2, versions
    assert versions[0].text == "🎙 “how full is the disk”"
    assert html_visible(versions[-1].text).startswith("🎙 “how full is the disk”\n\n")


def downloaded(world: VoiceWorld, update_id: int) -> int:
    return world.telegram.downloads.get(world.telegram.pushed_files[update_id].file_id, 0)


async def test_too_long_too_large_and_not_audio_each_get_one_reply_and_no_model_call(
    world: VoiceWorld, note: bytes
) -> None:
    asked_before = len(world.llm.requests)
    heard_before = len(world.audio.transcriptions)
    too_long = world.voice(REFUSED, note, duration=400)
    too_large = world.voice(REFUSED, note, duration=5, size=30 * MB)
    not_audio = world.voice(REFUSED, b"this is no audio at all " * 40, duration=5)
    # Messages of a chat are answered in order: the control's answer comes after theirs.
    messages = await world.control(REFUSED)

    notices = [html_visible(m.text) for m in messages[:-1]]
    assert len(notices) == 3, notices
    assert "a voice note of 6:40, over the limit of 5:00" in notices[0]
    assert "30.0 MB, over this chat's limit of 20 MB" in notices[1]
    assert "its content is not audio I can read" in notices[2]
    # Only the control reached the model; nothing reached the transcription service.
    assert len(world.llm.requests) == asked_before + 1
    assert len(world.audio.transcriptions) == heard_before
    # Refused on what Telegram announced, before any download.
    assert (downloaded(world, too_long), downloaded(world, too_large)) == (0, 0)
    assert downloaded(world, not_audio) == 1


async def test_with_the_service_down_the_note_waits_as_a_dead_letter_until_replayed(
    world: VoiceWorld, model: FilesModel, note: bytes
) -> None:
    before = len(world.audio.transcriptions)
    world.audio.down()
    try:
        world.voice(DOWN, note, duration=4)
        told = await world.showing(DOWN, VOICE_UNAVAILABLE_TEXT, part=True)
        assert html_visible(told.text) == VOICE_UNAVAILABLE_TEXT
        config = str(world.root / "config.toml")
        rc, out, err = await geodebot("deadletters", "list", "--config", config, env=world.env())
        assert rc == 0, err
        assert "voice_unavailable" in out
    finally:
        world.audio.up()
    refused = world.audio.transcriptions[before:]
    # The first try and the SDK's one retry, both answered 503.
    assert [t.status for t in refused] == [503, 503]

    [dead] = [line for line in out.splitlines() if "voice_unavailable" in line]
    letter = next(word for word in dead.split() if word.startswith("in-"))
    world.audio.script_transcript("is the backup done", duration=4)
    model.script("is the backup done", Reply("The backup finished at 03:12."))
    rc, _, err = await geodebot(
        "deadletters", "replay", letter, "--config", config, env=world.env()
    )
    assert rc == 0, err
    await world.showing(DOWN, "The backup finished at 03:12.", part=True)
    assert [t.status for t in world.audio.transcriptions[before:]] == [503, 503, 200]


async def test_a_kill_after_the_transcription_answers_on_restart_with_one_transcription(
    world: VoiceWorld, model: FilesModel, note: bytes
) -> None:
    prompt = "rotate the logs please"
    before = len(world.audio.transcriptions)
    world.audio.script_transcript(prompt, duration=6)
    with held_once(world.llm, prompt, Reply("Logs rotated.")) as seen:
        world.voice(KILLED, note, duration=6)
        # The turn asked the model, so the transcript was recorded before it (one commit
        # with the message's files, then the turn): kill it there.
        await until(lambda: len(seen) == 1, "the turn's model request")
        await world.kill()
        await world.start()
        await world.showing(KILLED, "Logs rotated.", part=True)
    assert len(seen) == 2
    assert json.dumps(seen[0]["messages"][-1]) == json.dumps(seen[1]["messages"][-1])
    # Transcribed once: the restart found the transcript on the inbox row.
    assert [t.text for t in world.audio.transcriptions[before:]] == [prompt]
    answers: list[SentMessage] = [
        m for m in world.messages(KILLED) if "Logs rotated." in html_visible(m.text)
    ]
    assert len(answers) == 1


async def test_when_spoken_to_a_voice_note_is_answered_in_speech_after_the_text(
    world: VoiceWorld, model: FilesModel, note: bytes
) -> None:
    spoken_before = len(world.audio.speeches)
    world.audio.script_transcript("what time is the deploy", duration=2)
    model.script("what time is the deploy", Reply("The deploy is at **noon**."))
    world.voice(SPOKEN, note, duration=2)
    await world.telegram.wait_until(lambda: world.telegram.uploads_to(SPOKEN), 30)
    # The text first, then the voice message, each once.
    [text, voice] = world.telegram.sent[SPOKEN]
    assert html_visible(text.text).endswith("The deploy is at noon.")
    [upload] = world.telegram.uploads_to(SPOKEN)
    assert (upload.kind, upload.message_id) == ("voice", voice.message_id)
    assert upload.data.startswith(b"OggS")
    assert upload.caption == ""  # all of it was spoken
    [asked] = world.audio.speeches[spoken_before:]
    # Spoken as plain text: no markup read out.
    assert (asked.input, asked.voice, asked.response_format) == (
        "The deploy is at noon.",
        "nova",
        "opus",
    )

    # A typed message in the same chat: text only.
    model.script("and the rollback plan?", Reply("Revert the tag."))
    world.ask(SPOKEN, "and the rollback plan?")
    await world.showing(SPOKEN, "Revert the tag.")
    await world.control(SPOKEN)
    assert len(world.telegram.uploads_to(SPOKEN)) == 1
    assert len(world.audio.speeches) == spoken_before + 1


async def test_always_speaks_a_typed_answer_and_says_when_it_was_cut(
    world: VoiceWorld, model: FilesModel
) -> None:
    spoken_before = len(world.audio.speeches)
    long = " ".join(f"Step {n} is done." for n in range(1, 30))
    model.script("report the steps", Reply(long))
    world.ask(ALWAYS, "report the steps")
    await world.telegram.wait_until(lambda: world.telegram.uploads_to(ALWAYS), 30)
    [upload] = world.telegram.uploads_to(ALWAYS)
    assert upload.caption == f"(spoken: the first {MAX_SPEECH} characters of the answer)"
    [asked] = world.audio.speeches[spoken_before:]
    assert len(asked.input) <= MAX_SPEECH
    assert long.startswith(asked.input)
    assert asked.input.endswith("is done.")
