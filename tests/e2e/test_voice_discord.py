"""Voice notes through ``geodebot serve`` on Discord: discord.py against the fake Discord (a
voice message flagged IS_VOICE_MESSAGE, its attachment on the fake CDN, uploads as multipart
message creates), the openai SDK's audio client against the fake OpenAI audio server, the
anthropic SDK against the fake model server.

A voice message becomes a turn whose model request holds the transcript, marked as one, and
the sender sees what was heard (the answer's first line); with ``voice_replies =
"when_spoken_to"`` the answer is uploaded as speech too, after its text, and a typed message
is answered in text only. A note too long, too large or not audio gets one reply naming the
reason and no model call, and nothing is downloaded for the first two; with the
transcription service down the sender is told, the message waits as a dead letter, and its
replay transcribes it once. A SIGKILL after the transcription and before the answer: the
restarted daemon answers it, with one transcription in all.

Discord acknowledges nothing the daemon takes in: a test waits on what the daemon posts, and
shows that nothing more is to come with a control message answered after it (a channel's
messages are answered in order). One daemon serves the file (restarted where a test kills
it), each test in a channel and session of its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import pytest_asyncio

from geodebot.chat.replies import VOICE_UNAVAILABLE_TEXT
from tests.support.audio import cached_note
from tests.support.chat_e2e_discord import (
    ALICE,
    EDIT_INTERVAL_S,
    TOKEN,
    TOKEN_ENV,
    ChatGuild,
    ChatWorld,
    ModelByAnyText,
    literal,
    user_blocks,
)
from tests.support.cli import geodebot
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL_ANSWER, answer_controls
from tests.support.fakes.audio_server import FakeAudioServer
from tests.support.fakes.discord_server import Json
from tests.support.fakes.llm_server import FakeLLMServer, Reply, held_once
from tests.support.waiting import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

AUDIO_KEY, AUDIO_KEY_ENV = "e2e-audio-key-9d2e", "E2E_AUDIO_KEY"
# A text channel (and session) per test: name -> channel id.
VOICE_CHANNELS: dict[str, str] = {
    name: str(900000000000000300 + n)
    for n, name in enumerate(("heard", "spoken", "refused", "down", "killed"))
}
SPEAKS = frozenset({"spoken"})  # the channels whose binding has voice_replies
MAX_SPEECH = 120
MB = 1000 * 1000


class VoiceGuild(ChatGuild):
    """The fake Discord with a guild text channel per voice test."""

    extra_channels: ClassVar[Mapping[str, str]] = {
        cid: name for name, cid in VOICE_CHANNELS.items()
    }


def write_voice_config(
    tmp: Path, discord: VoiceGuild, llm: FakeLLMServer, audio: FakeAudioServer
) -> Path:
    config = tmp / "config.toml"
    bindings = "".join(
        f'[[bindings]]\nplatform = "discord"\nchannel = "{cid}"\nsession = "{name}"\n'
        f'allowed_users = ["{ALICE}"]\nstream = false\n'
        + ('voice_replies = "when_spoken_to"\n' if name in SPEAKS else "")
        for name, cid in VOICE_CHANNELS.items()
    )
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp / "var"}"\nlog_level = "info"\n'
        "max_concurrent_sessions = 8\nuser_rate_per_min = 0\nshutdown_grace_s = 5\n"
        f"stream_edit_interval_s = {EDIT_INTERVAL_S:g}\n"
        f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm.url}"\n'
        f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
        f'[tools]\nworkspace = "{tmp / "ws"}"\n'
        f'[channels.discord]\ntoken_env = "{TOKEN_ENV}"\n'
        f'api_base_url = "{discord.api_base_url}"\ngateway_url = "{discord.gateway_url}"\n'
        f'[voice]\ntranscribe_url = "{audio.url}/audio/transcriptions"\n'
        f'api_key_env = "{AUDIO_KEY_ENV}"\nmax_seconds = 300\nmax_retries = 1\n'
        f'speech_url = "{audio.url}"\nspeech_voice = "nova"\n'
        f"max_speech_chars = {MAX_SPEECH}\n" + bindings
    )
    return config


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[ChatWorld, FakeAudioServer]]:
    tmp = tmp_path_factory.mktemp("voice-discord")
    async with (
        VoiceGuild(token=TOKEN) as discord,
        FakeLLMServer() as llm,
        FakeAudioServer(key=AUDIO_KEY) as audio,
    ):
        model = ModelByAnyText()
        llm.responder = model
        answer_controls(llm)
        (tmp / "ws").mkdir()
        env = dict(os.environ) | {
            TOKEN_ENV: TOKEN,
            TEST_KEY_ENV: TEST_KEY,
            AUDIO_KEY_ENV: AUDIO_KEY,
        }
        config = write_voice_config(tmp, discord, llm, audio)
        world = ChatWorld(discord, llm, model, config, tmp / "notes", tmp / "var", env)
        await world.start()
        try:
            yield world, audio
        finally:
            code = await world.daemon.stop()
            logged = "\n".join(d.text() for d in world.daemons)
            assert code == 0, logged[-3000:]
            assert "Traceback" not in logged, logged[-3000:]
            assert TOKEN not in logged
            assert TEST_KEY not in logged
            assert AUDIO_KEY not in logged
            # Attachment URLs are signed: the CDN never saw the bot's token, nor any other.
            assert set(discord.cdn_authorization) <= {None}


@pytest.fixture
def world(shared: tuple[ChatWorld, FakeAudioServer]) -> ChatWorld:
    return shared[0]


@pytest.fixture
def audio(shared: tuple[ChatWorld, FakeAudioServer]) -> FakeAudioServer:
    return shared[1]


@pytest.fixture(scope="module")
def note() -> bytes:
    """A real voice note: espeak-ng's speech in an OGG file."""
    return cached_note().read_bytes()


def voice(world: ChatWorld, channel: str, data: bytes, **push: Any) -> str:
    """Alice records a voice message in ``channel`` (``push``: push_voice_message's
    arguments); its message id."""
    return world.discord.push_voice_message(VOICE_CHANNELS[channel], data, author_id=ALICE, **push)


def shown(world: ChatWorld, channel: str) -> list[str]:
    """What the bot's messages in ``channel`` show now, oldest first."""
    return [literal(str(m["content"] or "")) for m in world.answers(VOICE_CHANNELS[channel])]


async def showing(world: ChatWorld, channel: str, text: str) -> str:
    """Until one of the bot's messages in ``channel`` shows ``text``; the first that does."""
    await world.until(
        lambda: any(text in t for t in shown(world, channel)),
        f"{text!r} in {channel}; it holds {shown(world, channel)}",
        within=30,
    )
    return next(t for t in shown(world, channel) if text in t)


async def settled(world: ChatWorld, channel: str) -> list[str]:
    """What the bot's messages in ``channel`` show once a control message sent now was
    answered (so nothing its earlier messages cause is still to come), the control's answer
    left off."""
    await world.control(VOICE_CHANNELS[channel])
    texts = shown(world, channel)
    assert texts[-1] == CONTROL_ANSWER
    return texts[:-1]


def blocks_of(world: ChatWorld, prompt: str) -> list[Json]:
    """The user message's blocks in the first model request of the turn for ``prompt``."""
    requests = world.requests_for(prompt)
    assert requests, f"no model request carries {prompt!r}"
    return user_blocks(requests[0], prompt)


def texts_of(blocks: list[Json]) -> list[str]:
    return [b["text"] for b in blocks if b.get("type") == "text"]


def attachment_of(world: ChatWorld, message_id: str) -> str:
    """The id of the voice message's one attachment."""
    [attached] = world.discord.message(message_id)["attachments"]
    return str(attached["id"])


async def test_a_voice_message_becomes_a_turn_whose_request_holds_the_transcript(
    world: ChatWorld, audio: FakeAudioServer, note: bytes
) -> None:
    before = len(audio.transcriptions)
    audio.script_transcript("please restart the web server", duration=12)
    world.model.add("please restart the web server", Reply("Restarting it now."))
    sent = voice(world, "heard", note, duration_secs=12)
    answer = await showing(world, "heard", "Restarting it now.")

    # What was heard is the answer's first line.
    assert answer.splitlines()[0] == "🎙 “please restart the web server”"
    assert answer.endswith("Restarting it now.")
    [block] = texts_of(blocks_of(world, "please restart the web server"))
    assert block == "[voice note, 0:12] please restart the web server"
    [asked] = audio.transcriptions[before:]
    assert (asked.model, asked.content_type, asked.size) == ("whisper-1", "audio/ogg", len(note))
    assert (asked.filename or "").startswith("voice-")
    assert asked.headers.get("authorization") == f"Bearer {AUDIO_KEY}"
    assert asked.status == 200
    assert world.discord.downloads[attachment_of(world, sent)] == 1
    # One message from the bot: the answer (no notice: nothing was refused), as a reply.
    assert await settled(world, "heard") == [answer]
    [posted, _control] = world.discord.posted[VOICE_CHANNELS["heard"]]
    assert (posted["message_reference"] or {}).get("message_id") == sent
    assert len(audio.transcriptions) == before + 1


async def test_when_spoken_to_a_voice_message_is_answered_in_speech_after_the_text(
    world: ChatWorld, audio: FakeAudioServer, note: bytes
) -> None:
    channel, discord = VOICE_CHANNELS["spoken"], world.discord
    spoken_before = len(audio.speeches)
    audio.script_transcript("what time is the deploy", duration=2)
    world.model.add("what time is the deploy", Reply("The deploy is at **noon**."))
    voice(world, "spoken", note, duration_secs=2)

    def uploads() -> list[Any]:
        return [u for u in discord.uploads if u.channel_id == channel]

    await world.until(lambda: bool(uploads()), "the spoken answer's upload", within=30)
    # The text first, then the speech, each once.
    [text, speech] = discord.posted[channel]
    assert literal(text["content"]).endswith("The deploy is at **noon**.")
    assert not text["attachments"]
    [upload] = uploads()
    assert upload.message_id == speech["id"]
    assert int(text["id"]) < int(speech["id"])
    assert upload.name.endswith(".ogg")
    assert (upload.content_type, upload.size) == ("audio/ogg", len(upload.data))
    assert upload.data.startswith(b"OggS")
    assert not upload.content  # all of it was spoken: no caption
    [asked] = audio.speeches[spoken_before:]
    # Spoken as plain text: no markup read out.
    assert (asked.input, asked.voice, asked.response_format) == (
        "The deploy is at noon.",
        "nova",
        "opus",
    )
    assert asked.headers.get("authorization") == f"Bearer {AUDIO_KEY}"

    # A typed message in the same channel: text only.
    world.model.add("and the rollback plan?", Reply("Revert the tag."))
    world.say(channel, "and the rollback plan?")
    await showing(world, "spoken", "Revert the tag.")
    texts = await settled(world, "spoken")
    assert [t for t in texts if "Revert the tag." in t] == ["Revert the tag."]
    assert len(uploads()) == 1
    assert len(audio.speeches) == spoken_before + 1


async def test_too_long_too_large_and_not_audio_each_get_one_reply_and_no_model_call(
    world: ChatWorld, audio: FakeAudioServer, note: bytes
) -> None:
    asked_before = len(world.llm.requests)
    heard_before = len(audio.transcriptions)
    too_long = voice(world, "refused", note, duration_secs=400)
    too_large = voice(world, "refused", note, duration_secs=5, size=30 * MB)
    not_audio = voice(world, "refused", b"this is no audio at all " * 40, duration_secs=5)
    # A channel's messages are answered in order: the control's answer comes after theirs.
    notices = await settled(world, "refused")

    assert len(notices) == 3, notices
    assert "a voice note of 6:40, over the limit of 5:00" in notices[0]
    assert "30.0 MB, over this chat's limit of 20 MB" in notices[1]
    assert "its content is not audio I can read" in notices[2]
    # Only the control reached the model; nothing reached the transcription service.
    assert len(world.llm.requests) == asked_before + 1
    assert len(audio.transcriptions) == heard_before
    # Refused on what Discord announced, before any download.
    downloads = world.discord.downloads
    assert downloads[attachment_of(world, too_long)] == 0
    assert downloads[attachment_of(world, too_large)] == 0
    assert downloads[attachment_of(world, not_audio)] == 1


async def test_with_the_service_down_the_note_waits_as_a_dead_letter_until_replayed(
    world: ChatWorld, audio: FakeAudioServer, note: bytes
) -> None:
    before = len(audio.transcriptions)
    config = str(world.config)
    audio.down()
    try:
        sent = voice(world, "down", note, duration_secs=4)
        told = await showing(world, "down", VOICE_UNAVAILABLE_TEXT)
        assert told == VOICE_UNAVAILABLE_TEXT
        rc, out, err = await geodebot("deadletters", "list", "--config", config, env=world.env)
        assert rc == 0, err
        assert "voice_unavailable" in out
    finally:
        audio.up()
    refused = audio.transcriptions[before:]
    # The first try and the SDK's one retry, both answered 503.
    assert [t.status for t in refused] == [503, 503]
    # Nothing reached the model: the notice is all the message got.
    assert not world.requests_for("is the backup done")

    [dead] = [line for line in out.splitlines() if "voice_unavailable" in line]
    letter = next(word for word in dead.split() if word.startswith("in-"))
    audio.script_transcript("is the backup done", duration=4)
    world.model.add("is the backup done", Reply("The backup finished at 03:12."))
    rc, _, err = await geodebot("deadletters", "replay", letter, "--config", config, env=world.env)
    assert rc == 0, err
    answer = await showing(world, "down", "The backup finished at 03:12.")
    assert answer.splitlines()[0] == "🎙 “is the backup done”"
    assert [t.status for t in audio.transcriptions[before:]] == [503, 503, 200]
    # The notice, then the answer, each once.
    assert await settled(world, "down") == [VOICE_UNAVAILABLE_TEXT, answer]
    assert world.discord.downloads[attachment_of(world, sent)] == 2  # once per try


async def test_a_kill_after_the_transcription_answers_on_restart_with_one_transcription(
    world: ChatWorld, audio: FakeAudioServer, note: bytes
) -> None:
    prompt = "rotate the logs please"
    before = len(audio.transcriptions)
    audio.script_transcript(prompt, duration=6)
    with held_once(world.llm, prompt, Reply("Logs rotated.")) as seen:
        sent = voice(world, "killed", note, duration_secs=6)
        # The turn asked the model, so the transcript was recorded before it (one commit
        # with the message's files, then the turn): kill it there.
        await until(lambda: len(seen) == 1, "the turn's model request")
        await world.kill_and_restart()
        await showing(world, "killed", "Logs rotated.")
    assert len(seen) == 2
    assert json.dumps(seen[0]["messages"][-1]) == json.dumps(seen[1]["messages"][-1])
    # Transcribed once, downloaded once: the restart found the transcript on the inbox row.
    assert [t.text for t in audio.transcriptions[before:]] == [prompt]
    assert world.discord.downloads[attachment_of(world, sent)] == 1
    texts = await settled(world, "killed")
    assert [t for t in texts if "Logs rotated." in t] == [f"🎙 “{prompt}”\n\nLogs rotated."]
    assert len(texts) == 1
