"""Voice notes through ``geodebot serve`` on Slack: slack_sdk against the fake Web API and
Socket Mode (an audio clip shared in a message, its private URL fetched with the bot token,
an answer's audio uploaded by the external upload), the openai SDK's audio client against the
fake OpenAI audio server, the anthropic SDK against the fake model server.

An audio clip recorded in Slack becomes a turn whose model request holds the transcript,
marked as one; the sender sees what was heard (the answer's first line). Where the binding
speaks ``when_spoken_to``, the answer to a clip is uploaded as speech after its text, and a
typed message gets text only. A clip too long gets one reply naming the reason, no model call
and no download; with the transcription service down the sender is told, the message waits
as a dead letter, and its replay transcribes it once. A SIGKILL after the transcription and
before the answer: the restarted daemon answers it, with one transcription in all.

One daemon serves the file (restarted where a test kills it), each test in a channel of its
own. What a test says happened "exactly once" or "never" is checked again after the daemon
stopped (SIGTERM drains the outbox).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from geodebot.chat.replies import VOICE_UNAVAILABLE_TEXT
from tests.support.audio import cached_note
from tests.support.chat_e2e_slack import is_final, unescape
from tests.support.chat_e2e_telegram import FilesModel
from tests.support.cli import geodebot
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.control import CONTROL, CONTROL_ANSWER, answer_controls
from tests.support.daemon import MODELS_MARK, DaemonProcess
from tests.support.fakes.audio_server import FakeAudioServer
from tests.support.fakes.llm_server import FakeLLMServer, Reply, held_once
from tests.support.fakes.slack_server import FakeSlack, Posted, Upload
from tests.support.slack_world import new_ts
from tests.support.waiting import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

BOT_TOKEN_ENV, APP_TOKEN_ENV = "E2E_VOICE_SLACK_BOT", "E2E_VOICE_SLACK_APP"
AUDIO_KEY, AUDIO_KEY_ENV = "e2e-audio-key-9d3a", "E2E_VOICE_SLACK_AUDIO_KEY"
ALICE = "UALICE001"
HEARD, SPOKEN, REFUSED, DOWN, KILLED = (
    "C0VHEARD1",
    "C0VSPOKE1",
    "C0VREFUS1",
    "C0VDOWN01",
    "C0VKILLD1",
)
# Each channel's further binding keys.
CHANNELS = {
    HEARD: "",
    SPOKEN: 'voice_replies = "when_spoken_to"\n',
    REFUSED: "",
    DOWN: "",
    KILLED: "",
}
MAX_SPEECH = 120


@dataclass
class VoiceWorld:
    """``geodebot serve`` on FakeSlack, the fake model and the fake audio server, with
    ``[voice]`` on the latter and one binding (and session) per channel."""

    slack: FakeSlack
    llm: FakeLLMServer
    audio: FakeAudioServer
    root: Path
    model: FilesModel = field(default_factory=FilesModel)
    daemon: DaemonProcess | None = None
    daemons: list[DaemonProcess] = field(default_factory=list)
    afterwards: list[Callable[[], object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.llm.responder = self.model
        answer_controls(self.llm)

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    def write_config(self) -> Path:
        bindings = "".join(
            f'[[bindings]]\nplatform = "slack"\nchannel = "{channel}"\n'
            f'session = "voice-{channel.lower()}"\nallowed_users = ["{ALICE}"]\n'
            f"stream = false\n{keys}"
            for channel, keys in CHANNELS.items()
        )
        self.config.write_text(
            f'[daemon]\nstate_dir = "{self.root / "var"}"\nshutdown_grace_s = 5\n'
            "user_rate_per_min = 0\n"
            f'[model]\nprovider = "anthropic"\nname = "e2e-voice-model"\n'
            f'base_url = "{self.llm.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            f'[tools]\nworkspace = "{self.root / "ws"}"\n'
            f'[channels.slack]\nbot_token_env = "{BOT_TOKEN_ENV}"\n'
            f'app_token_env = "{APP_TOKEN_ENV}"\napi_base_url = "{self.slack.api_base_url}"\n'
            f'[voice]\ntranscribe_url = "{self.audio.url}/audio/transcriptions"\n'
            f'api_key_env = "{AUDIO_KEY_ENV}"\nmax_seconds = 300\nmax_retries = 1\n'
            f'speech_url = "{self.audio.url}"\nmax_speech_chars = {MAX_SPEECH}\n' + bindings
        )
        return self.config

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                TEST_KEY_ENV: TEST_KEY,
                BOT_TOKEN_ENV: self.slack.bot_token,
                APP_TOKEN_ENV: self.slack.app_token,
                AUDIO_KEY_ENV: AUDIO_KEY,
            }
        )
        env.pop("GEODEBOT_CONFIG", None)
        return env

    async def start(self) -> DaemonProcess:
        """A daemon on the world's state directory (the same one after a kill), once its
        socket is open and its model SDK loaded."""
        daemon = DaemonProcess(self.write_config(), self.env)
        self.daemons.append(daemon)
        self.daemon = await daemon.start()
        await daemon.wait_for_line(MODELS_MARK, timeout_s=30)
        return daemon

    async def kill(self) -> None:
        assert self.daemon is not None
        await self.daemon.kill()

    def running(self) -> bool:
        proc = None if self.daemon is None else self.daemon.proc
        return proc is not None and proc.returncode is None

    async def cli(self, *args: str) -> tuple[int, str, str]:
        return await geodebot(*args, "--config", str(self.config), env=self.env)

    # -- talking ----------------------------------------------------------------------------
    async def _push(self, event: dict[str, Any]) -> None:
        envelope = await self.slack.push_event(event)
        await self.slack.wait_for_ack(envelope, timeout=15)

    async def voice(self, channel: str, clip: dict[str, Any]) -> str:
        """Alice shares an audio clip (from ``add_audio_clip``) with no text, as Slack sends a
        recorded clip; the message's ts once the daemon acked it."""
        ts = new_ts()
        await self._push(FakeSlack.file_message_event(channel, ALICE, "", [clip], ts=ts))
        return ts

    async def ask(self, channel: str, text: str) -> str:
        ts = new_ts()
        await self._push(FakeSlack.message_event(channel, ALICE, text, ts=ts))
        return ts

    def posts(self, channel: str, thread: str | None = None) -> list[Posted]:
        posts = self.slack.posted.get(channel, [])
        return [p for p in posts if thread is None or p.thread_ts == thread]

    def uploads(self, channel: str) -> list[Upload]:
        return [u for u in self.slack.uploads if u.channel == channel]

    def shown(self, channel: str) -> list[str]:
        return [unescape(p.text) for p in self.posts(channel)]

    async def posted(self, channel: str, thread: str, text: str) -> Posted:
        """Until a final message (a reply's part, not a preview) of the thread shows ``text``
        somewhere: the first that does."""

        def found() -> list[Posted]:
            return [
                p for p in self.posts(channel, thread) if is_final(p) and text in unescape(p.text)
            ]

        def seen() -> str:
            tail = "\n".join(self.daemon.log[-30:]) if self.daemon is not None else ""
            return f"{text!r} in {channel}; it shows {self.shown(channel)}\n{tail}"

        await until(lambda: bool(found()), seen, timeout=30)
        return found()[0]

    async def control(self, channel: str) -> list[Posted]:
        """A control message in the channel (tests/support/control.py), answered: every turn
        of the channel's session before it has run. Every post of the channel then."""
        thread = await self.ask(channel, CONTROL)
        await self.posted(channel, thread, CONTROL_ANSWER)
        return self.posts(channel)

    def logged(self) -> str:
        return "\n".join(daemon.text() for daemon in self.daemons)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VoiceWorld]:
    async with (
        FakeSlack() as slack,
        FakeLLMServer() as llm,
        FakeAudioServer(key=AUDIO_KEY) as audio,
    ):
        world = VoiceWorld(slack, llm, audio, tmp_path_factory.mktemp("voice-slack"))
        await world.start()
        try:
            yield world
        finally:
            code = 0
            if world.running():
                assert world.daemon is not None
                code = await world.daemon.stop()
            for daemon in world.daemons:
                await daemon.kill()  # one a failed test left behind
        logged = world.logged()
        assert code == 0, logged[-3000:]
        for check in world.afterwards:
            check()
        assert "Traceback" not in logged, logged[-3000:]
        for secret in (slack.bot_token, slack.app_token, TEST_KEY, AUDIO_KEY):
            assert secret not in logged


@pytest_asyncio.fixture(loop_scope="module")
async def world(shared: VoiceWorld) -> VoiceWorld:
    if not shared.running():
        await shared.start()
    return shared


@pytest.fixture(scope="module")
def note() -> bytes:
    """A real voice note: espeak-ng's speech in an OGG file."""
    return cached_note().read_bytes()


def texts_of(blocks: list[dict[str, Any]]) -> list[str]:
    return [b["text"] for b in blocks if b.get("type") == "text"]


async def test_an_audio_clip_becomes_a_turn_whose_request_holds_the_transcript(
    world: VoiceWorld, note: bytes
) -> None:
    before = len(world.audio.transcriptions)
    world.audio.script_transcript("please restart the web server", duration=12)
    world.model.script("please restart the web server", Reply("Restarting it now."))
    clip = world.slack.add_audio_clip(note, 12_000)
    thread = await world.voice(HEARD, clip)
    answer = await world.posted(HEARD, thread, "Restarting it now.")

    # What was heard is the answer's first line.
    assert unescape(answer.text).splitlines()[0] == "🎙 “please restart the web server”"
    [block] = texts_of(world.model.blocks("please restart the web server"))
    assert block == "[voice note, 0:12] please restart the web server"
    [asked] = world.audio.transcriptions[before:]
    assert (asked.model, asked.size, asked.status) == ("whisper-1", len(note), 200)
    assert asked.headers.get("authorization") == f"Bearer {AUDIO_KEY}"
    # Fetched once, with the bot token; one message from the bot: the answer (no notice).
    assert world.slack.downloads_of(clip) == 1
    assert len(world.posts(HEARD)) == 1

    def once() -> None:
        assert world.slack.downloads_of(clip) == 1
        assert len(world.posts(HEARD)) == 1

    world.afterwards.append(once)


async def test_when_spoken_to_a_clip_is_answered_in_speech_after_the_text(
    world: VoiceWorld, note: bytes
) -> None:
    spoken_before = len(world.audio.speeches)
    world.audio.script_transcript("what time is the deploy", duration=2)
    world.model.script("what time is the deploy", Reply("The deploy is at **noon**."))
    thread = await world.voice(SPOKEN, world.slack.add_audio_clip(note, 2_000))
    await until(lambda: bool(world.uploads(SPOKEN)), "the spoken answer's upload", timeout=30)

    # The text first, then the speech as a file share, each once, both in the clip's thread.
    [text, voice] = world.posts(SPOKEN)
    assert is_final(text)
    assert text.files is None
    assert unescape(text.text).endswith("The deploy is at *noon*.")
    [upload] = world.uploads(SPOKEN)
    assert (upload.ts, upload.thread_ts, voice.thread_ts) == (voice.ts, thread, thread)
    assert float(text.ts) < float(voice.ts)
    assert re.fullmatch(r"answer-\d+\.ogg", upload.name), upload.name
    assert (upload.filetype, upload.mimetype) == ("ogg", "audio/ogg")
    assert upload.data.startswith(b"OggS")
    assert upload.initial_comment is None  # all of it was spoken: no caption
    [asked] = world.audio.speeches[spoken_before:]
    # Spoken as plain text: no markup read out.
    assert (asked.input, asked.response_format, asked.status) == (
        "The deploy is at noon.",
        "opus",
        200,
    )
    assert asked.headers.get("authorization") == f"Bearer {AUDIO_KEY}"

    # A typed message in the same channel: text only.
    world.model.script("and the rollback plan?", Reply("Revert the tag."))
    typed = await world.ask(SPOKEN, "and the rollback plan?")
    await world.posted(SPOKEN, typed, "Revert the tag.")
    await world.control(SPOKEN)
    assert len(world.uploads(SPOKEN)) == 1
    assert len(world.audio.speeches) == spoken_before + 1

    def text_only() -> None:
        assert len(world.uploads(SPOKEN)) == 1
        assert [p.files is not None for p in world.posts(SPOKEN, typed)] == [False]
        assert len(world.audio.speeches) == spoken_before + 1

    world.afterwards.append(text_only)


async def test_a_clip_too_long_gets_one_reply_no_download_and_no_model_call(
    world: VoiceWorld, note: bytes
) -> None:
    asked_before = len(world.llm.requests)
    heard_before = len(world.audio.transcriptions)
    clip = world.slack.add_audio_clip(note, 400_000)
    thread = await world.voice(REFUSED, clip)
    await world.control(REFUSED)
    # The notice goes to the clip's thread, for the outbox a chat of its own: it may come
    # after the control's answer, written after it.
    await until(lambda: bool(world.posts(REFUSED, thread)), "the notice", timeout=30)

    [notice] = world.posts(REFUSED, thread)
    assert "a voice note of 6:40, over the limit of 5:00" in unescape(notice.text)
    # The channel holds the notice and the control's answer, nothing else.
    others = [p.text for p in world.posts(REFUSED) if p is not notice]
    assert others == [CONTROL_ANSWER], others
    # Only the control reached the model; nothing reached the transcription service.
    assert len(world.llm.requests) == asked_before + 1
    assert len(world.audio.transcriptions) == heard_before
    # Refused on what Slack announced, before any download.
    assert world.slack.downloads_of(clip) == 0

    def never() -> None:
        assert world.slack.downloads_of(clip) == 0
        assert len(world.posts(REFUSED, thread)) == 1

    world.afterwards.append(never)


async def test_with_the_service_down_the_clip_waits_as_a_dead_letter_until_replayed(
    world: VoiceWorld, note: bytes
) -> None:
    before = len(world.audio.transcriptions)
    world.audio.down()
    try:
        thread = await world.voice(DOWN, world.slack.add_audio_clip(note, 4_000))
        told = await world.posted(DOWN, thread, VOICE_UNAVAILABLE_TEXT)
        assert unescape(told.text) == VOICE_UNAVAILABLE_TEXT
        rc, out, err = await world.cli("deadletters", "list")
        assert rc == 0, err
        assert "voice_unavailable" in out
    finally:
        world.audio.up()
    # The first try and the SDK's one retry, both answered 503.
    assert [t.status for t in world.audio.transcriptions[before:]] == [503, 503]

    [dead] = [line for line in out.splitlines() if "voice_unavailable" in line]
    letter = next(word for word in dead.split() if word.startswith("in-"))
    world.audio.script_transcript("is the backup done", duration=4)
    world.model.script("is the backup done", Reply("The backup finished at 03:12."))
    rc, _, err = await world.cli("deadletters", "replay", letter)
    assert rc == 0, err
    answer = await world.posted(DOWN, thread, "The backup finished at 03:12.")
    assert unescape(answer.text).splitlines()[0] == "🎙 “is the backup done”"
    assert [t.status for t in world.audio.transcriptions[before:]] == [503, 503, 200]


async def test_a_kill_after_the_transcription_answers_on_restart_with_one_transcription(
    world: VoiceWorld, note: bytes
) -> None:
    prompt = "rotate the logs please"
    before = len(world.audio.transcriptions)
    world.audio.script_transcript(prompt, duration=6)
    with held_once(world.llm, prompt, Reply("Logs rotated.")) as seen:
        thread = await world.voice(KILLED, world.slack.add_audio_clip(note, 6_000))
        # The turn asked the model, so the transcript was recorded before it (one commit
        # with the message's files, then the turn): kill it there.
        await until(lambda: len(seen) == 1, "the turn's model request")
        await world.kill()
        await world.start()
        await world.posted(KILLED, thread, "Logs rotated.")
    assert len(seen) == 2
    assert json.dumps(seen[0]["messages"][-1]) == json.dumps(seen[1]["messages"][-1])
    # Transcribed once: the restart found the transcript on the inbox row.
    assert [t.text for t in world.audio.transcriptions[before:]] == [prompt]

    def answered_once() -> None:
        answers = [t for t in world.shown(KILLED) if "Logs rotated." in t]
        assert len(answers) == 1, world.shown(KILLED)

    answered_once()
    world.afterwards.append(answered_once)
