"""Real audio files for tests, made by Debian's ``espeak-ng`` and ``sox``.

Voice notes in tests are real audio so that whatever reads them (a duration probe, a
transcoder, an upload size check) meets the bytes a phone would send, not a stand-in::

    wav = spoken_wav("turn the lights off", tmp_path / "note.wav")   # espeak-ng -w
    ogg = to_ogg(wav, tmp_path / "note.ogg")                          # OGG Vorbis, see to_ogg
    big = padded_ogg(20 * 1024 * 1024, tmp_path / "big.ogg")          # exactly 20 MiB
    assert 1.0 < duration_s(ogg) < 3.0                                # soxi -D

* :func:`spoken_wav`, :func:`silence_wav`, :func:`sized_wav`: WAV files (speech, silence, a
  tone of an exact size in bytes).
* :func:`to_ogg`, :func:`convert`: encodings by sox; :func:`padded_ogg`: a playable OGG of an
  exact size, padded by a long Vorbis comment, for upload-limit tests.
* :func:`duration_s`, :func:`audio_type`, :func:`sample_rate`: what ``soxi`` reads back.
* :func:`cached_note` and :func:`speech_audio` make a file (or bytes) once per test session,
  under :func:`cache_dir`; the fake OpenAI audio server answers speech with
  :func:`speech_audio`.

SoX here (14.4.2 with libsox-fmt-all) writes WAV, FLAC, MP3 (lame), OGG Vorbis, raw PCM and
many older formats, but neither Opus nor AAC: :func:`can_write` asks sox, so the Opus
fallback below follows whatever sox is installed.

A missing tool raises :class:`AudioToolMissing` naming the Debian package to install: tests
that need audio fail loudly rather than skip.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

# Which Debian package ships each tool.
_PACKAGES = {"espeak-ng": "espeak-ng", "sox": "sox", "soxi": "sox"}
# A WAV header as sox writes it for PCM: RIFF, fmt (16 bytes of body) and data chunk headers.
WAV_HEADER_SIZE = 44
_RUN_TIMEOUT_S = 120.0


class AudioToolMissing(RuntimeError):
    """An audio tool is not installed; the message names the Debian package."""


class AudioToolFailed(RuntimeError):
    """An audio tool ran and failed; the message carries its command line and stderr."""


def tool(name: str) -> str:
    """The path of ``name`` (espeak-ng, sox, soxi), or :class:`AudioToolMissing`."""
    path = shutil.which(name)
    if path is None:
        package = _PACKAGES.get(name, name)
        raise AudioToolMissing(
            f"{name} is not installed: the audio test helpers need the Debian package "
            f"{package} (apt-get install {package})"
        )
    return path


def _run(name: str, *args: str) -> str:
    argv = [tool(name), *args]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, check=False, timeout=_RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise AudioToolFailed(f"{' '.join(argv)}: timed out after {_RUN_TIMEOUT_S:g} s") from exc
    if done.returncode != 0:
        raise AudioToolFailed(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _made(path: Path) -> Path:
    if not path.is_file() or path.stat().st_size == 0:
        raise AudioToolFailed(f"{path}: the tool reported success but wrote nothing")
    return path


def spoken_wav(text: str, path: str | os.PathLike[str], *, voice: str = "en") -> Path:
    """``text`` spoken by espeak-ng into a 16-bit mono WAV at 22050 Hz (``espeak-ng -w``)."""
    out = Path(path)
    # "--" so a text that starts with a dash is spoken, not taken for an option.
    _run("espeak-ng", "-v", voice, "-w", str(out), "--", text)
    return _made(out)


def silence_wav(seconds: float, path: str | os.PathLike[str], *, rate: int = 16000) -> Path:
    """``seconds`` of digital silence as a 16-bit mono WAV."""
    out = Path(path)
    shape = ["-r", str(rate), "-c", "1", "-b", "16"]
    _run("sox", "-q", "-n", *shape, str(out), "trim", "0", f"{seconds:g}")
    return _made(out)


def sized_wav(
    size_bytes: int, path: str | os.PathLike[str], *, rate: int = 8000, freq: float = 440.0
) -> Path:
    """A sine tone as an 8-bit mono WAV of exactly ``size_bytes`` bytes.

    One byte per sample after the 44-byte header, so any even size from 46 up is possible
    (a RIFF chunk of odd length takes a pad byte, so a WAV file is never odd-sized). At the
    default 8000 Hz, 25 MiB is about 55 minutes of tone.
    """
    if size_bytes < WAV_HEADER_SIZE + 2 or size_bytes % 2:
        raise ValueError(f"a WAV file is an even number of bytes, at least 46: {size_bytes}")
    samples = size_bytes - WAV_HEADER_SIZE
    out = Path(path)
    # The rate is given before -n so synth runs at it (no resampling), and "vol" keeps the
    # tone clear of full scale so the 8-bit dither never clips.
    _run(
        "sox", "-q", "-r", str(rate), "-n", "-b", "8", "-e", "unsigned-integer", "-c", "1",
        str(out), "synth", f"{samples}s", "sine", f"{freq:g}", "vol", "0.5",
    )  # fmt: skip
    made = _made(out)
    if made.stat().st_size != size_bytes:
        raise AudioToolFailed(f"{out}: sox wrote {made.stat().st_size} bytes, not {size_bytes}")
    return made


@functools.cache
def can_write(file_type: str) -> bool:
    """Whether sox here can write ``file_type`` (``sox -h`` also lists read-only formats)."""
    with tempfile.TemporaryDirectory(prefix="geodebot-sox-probe-") as tmp:
        probe = Path(tmp) / f"probe.{file_type}"
        try:
            shape = ["-r", "8000", "-c", "1", "-t", file_type]
            _run("sox", "-q", "-n", *shape, str(probe), "trim", "0", "0.1")
        except AudioToolFailed:
            return False
        return probe.is_file() and probe.stat().st_size > 0


def sox_formats() -> list[str]:
    """The file formats ``sox -h`` lists: read, write or both (see :func:`can_write`)."""
    for line in _run("sox", "-h").splitlines():
        if line.startswith("AUDIO FILE FORMATS:"):
            return line.split(":", 1)[1].split()
    return []


def convert(
    src: str | os.PathLike[str], path: str | os.PathLike[str], *, file_type: str | None = None
) -> Path:
    """``src`` re-encoded by sox into ``path``, of the type its extension names, or
    ``file_type`` (a sox ``-t`` name: ``mp3``, ``flac``, ``vorbis``, ``wav``...)."""
    out = Path(path)
    typed = ["-t", file_type] if file_type else []
    _run("sox", "-q", str(src), *typed, str(out))
    return _made(out)


def ogg_codec() -> str:
    """What :func:`to_ogg` writes inside the OGG container here: ``opus`` or ``vorbis``."""
    return "opus" if can_write("opus") else "vorbis"


def to_ogg(wav: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """``wav`` in an OGG container, as a messaging app's voice note comes.

    Ogg Opus (what phones send) when sox can write it; otherwise Ogg Vorbis. Debian's SoX
    14.4.2 has no Opus encoder, so here it is Vorbis: the file starts with ``OggS`` and
    ``soxi -t`` says ``vorbis``. :func:`ogg_codec` tells which.
    """
    return convert(wav, path, file_type=ogg_codec())


def padded_ogg(
    size_bytes: int, path: str | os.PathLike[str], *, text: str = "this voice note is padded"
) -> Path:
    """A playable OGG Vorbis voice note of exactly ``size_bytes`` bytes.

    ``text`` is spoken (about 1.5 s) and the rest of the size is one long Vorbis comment, so
    a 20 MiB note is made in about a second and still decodes: ``soxi`` reads its duration,
    ``sox`` plays it. The comment's length is found by a few encodings (the OGG paging
    overhead grows with it); a size below the unpadded note's (some 10 kB) is a ValueError.
    """
    out = Path(path)
    with tempfile.TemporaryDirectory(prefix="geodebot-padded-ogg-") as tmp:
        wav = spoken_wav(text, Path(tmp) / "voice.wav")
        comment = Path(tmp) / "comment.txt"

        def encode(length: int, lines: int) -> int:
            # sox takes each line of the file as one comment; two lines shift the OGG
            # lacing so the few sizes one comment cannot reach are reached.
            first = length // lines
            comment.write_text("\n".join(["x" * first, "x" * (length - first)][:lines]))
            _run("sox", "-q", str(wav), "--comment-file", str(comment), "-t", "vorbis", str(out))
            return out.stat().st_size

        base = encode(1, 1)
        if size_bytes < base:
            raise ValueError(f"an OGG note of this text is at least {base} bytes: {size_bytes}")
        for lines in (1, 2):
            # OGG pages hold 65025 bytes of payload behind a header of up to 282 bytes.
            length = max(lines, round((size_bytes - base) * 65025 / 65307))
            for _ in range(8):
                size = encode(length, lines)
                if size == size_bytes:
                    return out
                length = max(lines, length + size_bytes - size)
    raise AudioToolFailed(f"{out}: no comment length makes an OGG note of {size_bytes} bytes")


def duration_s(path: str | os.PathLike[str]) -> float:
    """The audio's duration in seconds, as ``soxi -D`` reads it."""
    return float(_run("soxi", "-D", str(path)).strip())


def audio_type(path: str | os.PathLike[str]) -> str:
    """The file type ``soxi -t`` detects: ``wav``, ``vorbis``, ``mp3``, ``flac``..."""
    return _run("soxi", "-t", str(path)).strip()


def sample_rate(path: str | os.PathLike[str]) -> int:
    """The sample rate in Hz, as ``soxi -r`` reads it."""
    return int(_run("soxi", "-r", str(path)).strip())


_cache_lock = threading.Lock()
_cache_root: Path | None = None


def cache_dir() -> Path:
    """A directory for this test session's generated audio, removed when the process ends."""
    global _cache_root
    with _cache_lock:
        if _cache_root is None:
            _cache_root = Path(tempfile.mkdtemp(prefix="geodebot-audio-"))
            atexit.register(shutil.rmtree, _cache_root, True)
        return _cache_root


_note_locks: dict[str, threading.Lock] = {}


def _cached(name: str, make: Callable[[Path], Path]) -> Path:
    """``cache_dir() / name``, made by ``make`` the first time it is asked for."""
    target = cache_dir() / name
    with _cache_lock:
        lock = _note_locks.setdefault(name, threading.Lock())
    with lock:
        if not target.is_file():
            # Made beside the target and renamed, so a failed run leaves no half a file.
            partial = target.with_name(f"partial-{target.name}")
            make(partial).replace(target)
        return target


def cached_note(size_bytes: int | None = None, *, kind: str = "ogg") -> Path:
    """A voice note made once per test session (treat it as read-only).

    ``kind`` ``"ogg"``: a spoken note (:func:`to_ogg`), or with ``size_bytes`` a
    :func:`padded_ogg` of exactly that size. ``kind`` ``"wav"``: the spoken WAV, or a
    :func:`sized_wav` tone of exactly that size.
    """
    text = "please remind me to water the plants tomorrow morning"
    if kind == "ogg" and size_bytes is None:

        def spoken_ogg(path: Path) -> Path:
            wav = spoken_wav(text, path.with_suffix(".wav"))
            try:
                return to_ogg(wav, path.with_suffix(".ogg"))
            finally:
                wav.unlink()

        return _cached("note.ogg", spoken_ogg)
    if kind == "ogg" and size_bytes is not None:
        return _cached(f"note-{size_bytes}.ogg", functools.partial(_padded, size_bytes))
    if kind == "wav" and size_bytes is None:
        return _cached("note.wav", functools.partial(_spoken, text))
    if kind == "wav" and size_bytes is not None:
        return _cached(f"note-{size_bytes}.wav", functools.partial(_sized, size_bytes))
    raise ValueError(f"kind is 'ogg' or 'wav': {kind!r}")


def _padded(size_bytes: int, path: Path) -> Path:
    return padded_ogg(size_bytes, path.with_suffix(".ogg"))


def _spoken(text: str, path: Path) -> Path:
    return spoken_wav(text, path.with_suffix(".wav"))


def _sized(size_bytes: int, path: Path) -> Path:
    return sized_wav(size_bytes, path.with_suffix(".wav"))


# The formats of OpenAI's speech endpoint, as the sox file type that encodes each (None:
# sox cannot, see speech_audio) and the options that shape it.
_SPEECH_ENCODINGS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "mp3": ("mp3", ()),
    "opus": ("ogg", ()),
    "aac": (None, ()),
    "flac": ("flac", ()),
    "wav": ("wav", ()),
    # OpenAI's pcm: raw 24 kHz 16-bit signed little-endian mono samples, no header.
    "pcm": ("raw", ("-r", "24000", "-e", "signed-integer", "-b", "16", "-c", "1", "-L")),
}
SPEECH_FORMATS = tuple(_SPEECH_ENCODINGS)


@functools.cache
def speech_audio(response_format: str) -> bytes:
    """Real audio in one of OpenAI's speech ``response_format`` values, made once a session.

    The same spoken sentence whatever the input: ``opus`` is an OGG file (:func:`to_ogg`,
    so Vorbis where sox has no Opus encoder), ``mp3`` an MPEG stream (frame sync first, no
    ID3 tag), ``flac`` starts with ``fLaC``, ``wav`` with ``RIFF....WAVE``, ``pcm`` is raw
    24 kHz 16-bit mono. sox writes no AAC, so ``aac`` is answered with the WAV bytes, as is
    ``mp3`` where sox has no MP3 encoder.
    """
    if response_format not in _SPEECH_ENCODINGS:
        raise ValueError(f"not an OpenAI speech format: {response_format!r}")
    file_type, options = _SPEECH_ENCODINGS[response_format]
    with tempfile.TemporaryDirectory(prefix="geodebot-speech-") as tmp:
        wav = spoken_wav("this is the fake speech endpoint speaking", Path(tmp) / "speech.wav")
        if file_type is None or (file_type == "mp3" and not can_write("mp3")):
            return wav.read_bytes()
        if file_type == "ogg":
            return to_ogg(wav, Path(tmp) / "speech.ogg").read_bytes()
        out = Path(tmp) / f"answer.{file_type}"  # not speech.wav: sox would read what it writes
        _run("sox", "-q", str(wav), *options, "-t", file_type, str(out))
        return _made(out).read_bytes()
