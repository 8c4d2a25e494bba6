"""Voice on Slack: audio clips and audio files in, their length and whether they were
recorded in Slack, as the translation reads them (the adapter against FakeSlack, a clip's
download and a spoken answer's upload, is in test_slack_files.py)."""

from __future__ import annotations

from typing import Any

import pytest

from geodebot.channels.base import InboundFile
from geodebot.channels.slack.inbound import files_of, to_inbound

CHANNEL = "C0VOICE01"
ALICE = "UALICE001"
URL = "https://files.slack.com/files-pri/T1-F1/download/audio_message.webm"
# Enough of an Ogg page header to look like one; nothing here decodes it.
OGG = b"OggS\x00\x02" + bytes(range(256)) * 8


def slack_file(**over: Any) -> dict[str, Any]:
    """A Slack file object as an event lists it, with ``over`` on top."""
    return {
        "id": "F1",
        "name": "audio_message.webm",
        "title": "audio_message.webm",
        "mimetype": "audio/webm",
        "filetype": "webm",
        "size": 137_519,
        "mode": "hosted",
        "url_private": URL.replace("/download", ""),
        "url_private_download": URL,
        **over,
    }


def one(file: dict[str, Any]) -> InboundFile:
    [got] = files_of({"files": [file]})
    return got


# -- files in: the translation -------------------------------------------------------------------
def test_an_audio_clip_recorded_in_slack_is_a_voice_note_with_its_length() -> None:
    # As Slack lists a clip recorded in its app (files.info and message events alike).
    clip = slack_file(
        subtype="slack_audio",
        duration_ms=8458,
        media_display_type="audio",
        transcription={"status": "complete", "locale": "en-US"},
        audio_wave_samples=[12, 8, 8, 3],
    )
    assert one(clip) == InboundFile(
        URL, "audio_message.webm", "audio/webm", 137_519, duration=8.458, voice=True
    )
    body = {
        "event_id": "Ev1",
        "event": {
            "type": "message",
            "subtype": "file_share",
            "channel": CHANNEL,
            "user": ALICE,
            "text": "",
            "ts": "1.0",
            "files": [clip],
        },
    }
    inbound = to_inbound(body, "UBOT")
    assert inbound is not None
    assert inbound.text == ""
    assert [(f.duration, f.voice) for f in inbound.files] == [(8.458, True)]


def test_a_clip_keeps_the_type_slack_gives_it() -> None:
    clip = one(
        slack_file(
            name="audio_message.m4a", mimetype="audio/mp4", subtype="slack_audio", duration_ms=1500
        )
    )
    assert (clip.name, clip.media_type, clip.duration, clip.voice) == (
        "audio_message.m4a",
        "audio/mp4",
        1.5,
        True,
    )


@pytest.mark.parametrize("mimetype", ["audio/mpeg", "audio/ogg", "audio/mp4", "AUDIO/WEBM"])
def test_an_uploaded_audio_file_is_not_a_voice_note(mimetype: str) -> None:
    upload = slack_file(name="memo.bin", mimetype=mimetype, filetype="binary")
    assert one(upload) == InboundFile(URL, "memo.bin", mimetype, 137_519)
    assert (one(upload).duration, one(upload).voice) == (0.0, False)
    # One that announces its length carries it, and is still no voice note.
    timed = one({**upload, "duration_ms": 61_000})
    assert (timed.duration, timed.voice) == (61.0, False)


def test_slack_calling_a_file_audio_makes_it_audio() -> None:
    shown = one(slack_file(mimetype="", media_display_type="audio", duration_ms=2000))
    assert (shown.media_type, shown.duration, shown.voice) == ("", 2.0, False)


@pytest.mark.parametrize(
    "duration_ms",
    [
        "8458",
        "",
        True,
        False,
        None,
        -1,
        -0.5,
        0,
        0.0,
        float("nan"),
        float("inf"),
        10**400,
        [8458],
        {"ms": 8458},
    ],
)
def test_a_duration_that_is_not_a_positive_number_is_unknown(duration_ms: Any) -> None:
    clip = one(slack_file(subtype="slack_audio", duration_ms=duration_ms))
    assert clip.duration == 0.0
    assert clip.voice  # the clip itself still counts


def test_a_fractional_duration_is_kept() -> None:
    assert one(slack_file(subtype="slack_audio", duration_ms=250.5)).duration == 0.2505


def test_files_that_are_not_audio_stay_as_they_were() -> None:
    png = {
        "id": "F2",
        "name": "shot.png",
        "mimetype": "image/png",
        "size": 9,
        "url_private_download": URL,
    }
    assert one(png) == InboundFile(URL, "shot.png", "image/png", 9)
    # A video clip recorded in Slack announces its length too; it is not audio.
    video = one(
        {
            **png,
            "name": "clip.mp4",
            "mimetype": "video/mp4",
            "subtype": "slack_video",
            "duration_ms": 4000,
            "media_display_type": "video",
        }
    )
    assert video == InboundFile(URL, "clip.mp4", "video/mp4", 9)
    # Nor does a stray duration on a document make it one.
    pdf = one({**png, "name": "r.pdf", "mimetype": "application/pdf", "duration_ms": 9000})
    assert (pdf.duration, pdf.voice) == (0.0, False)
    # A clip without a URL, or deleted, is left out like any file.
    assert files_of({"files": [{"id": "F3", "subtype": "slack_audio", "duration_ms": 1000}]}) == ()
    assert files_of({"files": [slack_file(subtype="slack_audio", mode="tombstone")]}) == ()


def test_a_voice_note_survives_the_inbox_round_trip() -> None:
    clip = one(slack_file(subtype="slack_audio", duration_ms=8458))
    assert InboundFile.from_json(clip.to_json()) == clip
