"""Voice notes: the daemon's own CPU per voice turn against a text turn, and its memory with
several 20 MB notes in flight at once.

One ``geodebot serve`` runs as a subprocess against the in-process fakes
(``tests.support.fakes``): the Telegram Bot API fake (a voice note is a ``voice`` message,
getFile and the file URL), the Anthropic fake and the OpenAI audio fake (``[voice]``
transcribe_url: a multipart upload in, JSON out), the model and the audio service answering
at once. Answers are not streamed (``stream = false``), so a turn's reply is one message.

Figures (same run, same machine):

* CPU per turn: the daemon's user + system CPU time (all threads, from ``/proc/<pid>/stat``)
  over ``--per-round`` sequential voice-note turns and as many text turns, in ``--rounds``
  rounds after a warm-up, the two kinds taking turns and who goes first swapping every
  round, so a drift of the machine's speed meets both alike. Each turn waits for its reply,
  and a short pause after each lets the daemon finish its work after the reply (recording
  it, the next poll) inside the same turn. A voice note is a real spoken OGG of about 9 s
  (some 55 kB), its transcript the same sentence a text turn types. Target: voice CPU per
  turn <= 1.5x the text figure. What the audio service does is not the daemon's CPU, so
  this figure excludes it; the wall-clock p50 of each kind is shown with the fake audio
  service's own handling time (its handler, from the request to its answer, the upload
  read included) beside it, for information.
* Memory: ``--concurrent`` voice notes of 20,000,000 bytes (20 MB in 10^6 bytes: the
  Telegram fake, like the cloud Bot API, refuses getFile of a declared size over 20 MB, so
  this is the largest note Telegram hands over; the bindings take 25 MB) pushed at once into
  as many chats (sessions of their own); the daemon's VmRSS sampled every ``SAMPLE_S`` from
  before the push until every reply arrived, and VmHWM read at the end (reset before the
  push through ``/proc/<pid>/clear_refs`` where the kernel lets it be, so it is this phase's
  peak; the kernel updates it lazily, so the peak is the larger of the two). Target:
  (peak - idle) / notes <= 25 MB per 20 MB note, i.e. each note held about once.

Run from the repo root: ``.venv/bin/python bench/voice_bench.py [--quick]``. Exits 1 on FAIL.
MB here is 10^6 bytes (VmRSS is reported in KiB).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from telegram_bench import cpu_seconds, print_table, stop_daemon

from tests.support.audio import cached_note, duration_s, spoken_wav, to_ogg
from tests.support.daemon import MODELS_MARK, DaemonProcess
from tests.support.fakes.audio_server import FakeAudioServer
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.telegram_server import DOWNLOAD_LIMIT, FakeTelegram

KEY_ENV = "BENCH_ANTHROPIC_KEY"
KEY = "sk-bench-0123456789abcdef"
TOKEN_ENV = "BENCH_TELEGRAM_TOKEN"
AUDIO_KEY_ENV = "BENCH_AUDIO_KEY"
AUDIO_KEY = "sk-bench-audio-0123456789"
USER = 4242
VOICE_CHAT = -300_001
TEXT_CHAT = -300_002
MEMORY_CHAT_BASE = -300_100  # the memory phase's chats are MEMORY_CHAT_BASE - i
CAP = 8  # max_concurrent_sessions: above the memory phase's notes at once
MAX_ATTACHMENT_MB = 25  # the bindings' limit: a 20 MB note is taken
ANSWER = "ok, done"
# What the voice note says, and what a text turn types (the transcript is scripted to it).
SENTENCE = (
    "please check the disk usage on the build server and tell me which folders grew the "
    "most since last week, then remind me tomorrow morning to clean them up"
)
BIG_NOTE_BYTES = DOWNLOAD_LIMIT  # 20,000,000: the most the Telegram fake's getFile serves
BIG_NOTE_SECONDS = 2  # announced; the padded note speaks for about 1.5 s
TURN_TIMEOUT_S = 60.0
TURN_PAUSE_S = 0.02
SAMPLE_S = 0.02
MB = 1e6

# Targets.
CPU_RATIO_MAX = 1.5
PER_NOTE_MAX_MB = 25.0


@dataclass
class Sizes:
    warmup: int
    rounds: int
    per_round: int
    concurrent: int


@dataclass
class Figures:
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per turn, by kind
    wall: dict[str, list[float]] = field(default_factory=dict)  # seconds per turn, by kind
    service_s: list[float] = field(default_factory=list)  # the fake's handling, measured turns
    note_bytes: int = 0
    note_seconds: float = 0.0
    rss_idle_mb: float = float("nan")
    rss_peak_sampled_mb: float = float("nan")
    hwm_mb: float = float("nan")
    hwm_reset: bool = False
    rss_after_mb: float = float("nan")
    samples: int = 0
    memory_wall_s: float = float("nan")


# -- processes ------------------------------------------------------------------------------
def status_mb(pid: int, key: str) -> float:
    """A ``/proc/<pid>/status`` size field (``VmRSS``, ``VmHWM``) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError(f"no {key} for pid {pid}")


def reset_hwm(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux 4.0+); whether it could be."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class TimedAudioServer(FakeAudioServer):
    """The fake audio service, timing its own handling of each transcription (from the
    request reaching the handler to its answer, the streamed upload read included)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.handling_s: list[float] = []

    async def _transcription(self, request: web.Request) -> web.Response:
        start = time.perf_counter()
        try:
            return await super()._transcription(request)
        finally:
            self.handling_s.append(time.perf_counter() - start)


def write_config(
    path: Path,
    telegram: FakeTelegram,
    llm: FakeLLMServer,
    audio: FakeAudioServer,
    chats: Sequence[int],
) -> Path:
    lines = [
        "[daemon]",
        f'state_dir = "{path.parent / "var"}"',
        f"max_concurrent_sessions = {CAP}",
        # One sender drives the whole load: flood control would measure itself, not the path.
        "user_rate_per_min = 0",
        "[model]",
        'provider = "anthropic"',
        'name = "bench-model"',
        f'base_url = "{llm.url}"',
        f'api_key_env = "{KEY_ENV}"',
        "max_retries = 0",
        "[channels.telegram]",
        f'token_env = "{TOKEN_ENV}"',
        f'api_base_url = "{telegram.api_base_url}"',
        f'file_base_url = "{telegram.file_base_url}"',
        "poll_timeout_s = 1",
        "[voice]",
        f'transcribe_url = "{audio.url}/audio/transcriptions"',
        f'api_key_env = "{AUDIO_KEY_ENV}"',
        "max_seconds = 300",
        "max_retries = 0",
    ]
    for chat in chats:
        lines += [
            "[[bindings]]",
            'platform = "telegram"',
            f'channel = "{chat}"',
            f'session = "s{abs(chat)}"',
            f'allowed_users = ["{USER}"]',
            "tools = []",
            "stream = false",
            f"max_attachment_mb = {MAX_ATTACHMENT_MB}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def env(telegram: FakeTelegram) -> dict[str, str]:
    return dict(os.environ, **{TOKEN_ENV: telegram.token, KEY_ENV: KEY, AUDIO_KEY_ENV: AUDIO_KEY})


def realistic_note(tmp: Path) -> Path:
    """A real voice note of about 9 s: the sentence spoken, as an OGG."""
    wav = spoken_wav(SENTENCE, tmp / "note.wav")
    try:
        return to_ogg(wav, tmp / "note.ogg")
    finally:
        wav.unlink()


# -- load -----------------------------------------------------------------------------------
async def turn(
    telegram: FakeTelegram,
    audio: TimedAudioServer,
    kind: str,
    note: bytes,
    seconds: int,
) -> float:
    """One turn of ``kind`` (voice or text), waited until its reply arrived; its seconds."""
    chat = VOICE_CHAT if kind == "voice" else TEXT_CHAT
    want = len(telegram.sent[chat]) + 1
    start = time.perf_counter()
    if kind == "voice":
        audio.script_transcript(SENTENCE, duration=seconds)
        telegram.push_file(chat, note, user_id=USER, voice=True, duration=seconds)
    else:
        telegram.push_message(chat, SENTENCE, user_id=USER)
    await telegram.wait_for_sent(chat, want, timeout=TURN_TIMEOUT_S)
    took = time.perf_counter() - start
    await asyncio.sleep(TURN_PAUSE_S)
    return took


async def cpu_rounds(
    pid: int,
    telegram: FakeTelegram,
    audio: TimedAudioServer,
    note: bytes,
    seconds: int,
    sizes: Sizes,
    fig: Figures,
) -> None:
    """Voice and text turns in alternating blocks; CPU per turn and wall time of each."""
    kinds = ("voice", "text")
    for _ in range(sizes.warmup):
        for kind in kinds:
            await turn(telegram, audio, kind, note, seconds)
    await asyncio.sleep(0.5)
    handled_before = len(audio.handling_s)
    cpu = dict.fromkeys(kinds, 0.0)
    fig.wall = {kind: [] for kind in kinds}
    for index in range(sizes.rounds):
        for kind in kinds if index % 2 == 0 else kinds[::-1]:
            used = cpu_seconds(pid)
            for _ in range(sizes.per_round):
                fig.wall[kind].append(await turn(telegram, audio, kind, note, seconds))
            cpu[kind] += cpu_seconds(pid) - used
    turns = sizes.rounds * sizes.per_round
    fig.cpu_ms = {kind: cpu[kind] * 1000 / turns for kind in kinds}
    fig.service_s = audio.handling_s[handled_before:]


async def memory_phase(
    pid: int, telegram: FakeTelegram, big: bytes, chats: Sequence[int], fig: Figures
) -> None:
    """K 20 MB notes pushed at once into K chats; RSS sampled until every reply arrived."""
    await asyncio.sleep(2.0)  # the CPU phase's tail done
    idle = [status_mb(pid, "VmRSS")]
    for _ in range(9):
        await asyncio.sleep(0.05)
        idle.append(status_mb(pid, "VmRSS"))
    fig.rss_idle_mb = statistics.fmean(idle)
    fig.hwm_reset = reset_hwm(pid)
    peak = max(idle)
    samples = 0
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak, samples
        while not done.is_set():
            peak = max(peak, status_mb(pid, "VmRSS"))
            samples += 1
            await asyncio.sleep(SAMPLE_S)

    sampler = asyncio.create_task(sample())
    start = time.perf_counter()
    try:
        wants = {chat: len(telegram.sent[chat]) + 1 for chat in chats}
        for chat in chats:
            telegram.push_file(chat, big, user_id=USER, voice=True, duration=BIG_NOTE_SECONDS)
        await telegram.wait_until(
            lambda: all(len(telegram.sent[c]) >= n for c, n in wants.items()), TURN_TIMEOUT_S * 2
        )
    finally:
        done.set()
        await sampler
    fig.memory_wall_s = time.perf_counter() - start
    fig.rss_peak_sampled_mb = peak
    fig.samples = samples
    fig.hwm_mb = status_mb(pid, "VmHWM")
    await asyncio.sleep(1.0)
    fig.rss_after_mb = status_mb(pid, "VmRSS")


async def step(label: str, action: Awaitable[object]) -> None:
    start = time.perf_counter()
    print(f"  .. {label}", end="", flush=True)
    await action
    print(f" ({time.perf_counter() - start:.1f} s)", flush=True)


# -- report ---------------------------------------------------------------------------------
def p50_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1000 if samples else float("nan")


def report(fig: Figures, sizes: Sizes) -> bool:
    rows: list[tuple[str, str, str, str, str, bool | None]] = []
    voice, text = fig.cpu_ms["voice"], fig.cpu_ms["text"]
    ratio = voice / text
    turns = sizes.rounds * sizes.per_round
    rows.append(
        (
            f"CPU per turn, {turns} each (ms)",
            f"{voice:.2f}",
            f"{text:.2f}",
            f"{ratio:.2f}x",
            f"<= {CPU_RATIO_MAX}x text",
            ratio <= CPU_RATIO_MAX,
        )
    )
    wall_voice, wall_text = p50_ms(fig.wall["voice"]), p50_ms(fig.wall["text"])
    rows.append(
        (
            "wall-clock p50 per turn (ms)",
            f"{wall_voice:.1f}",
            f"{wall_text:.1f}",
            f"{wall_voice / wall_text:.2f}x",
            "(info)",
            None,
        )
    )
    service = p50_ms(fig.service_s)
    rows.append(
        (
            "  of it the audio fake's handling, p50 (ms)",
            f"{service:.1f}",
            "-",
            "-",
            "(info, excluded)",
            None,
        )
    )
    rows.append(
        (
            "  wall p50 less the audio fake's (ms)",
            f"{wall_voice - service:.1f}",
            f"{wall_text:.1f}",
            f"{(wall_voice - service) / wall_text:.2f}x",
            "(info)",
            None,
        )
    )
    k = sizes.concurrent
    peak = max(fig.rss_peak_sampled_mb, fig.hwm_mb if fig.hwm_reset else float("-inf"))
    rows.append(("RSS idle before the push (MB)", f"{fig.rss_idle_mb:.1f}", "", "", "", None))
    rows.append(
        (
            f"RSS peak, sampled every {SAMPLE_S * 1000:g} ms (MB)",
            f"{fig.rss_peak_sampled_mb:.1f}",
            "",
            "",
            f"({fig.samples} samples)",
            None,
        )
    )
    rows.append(
        (
            "VmHWM at the end (MB)",
            f"{fig.hwm_mb:.1f}",
            "",
            "",
            "(reset before the push)" if fig.hwm_reset else "(not reset: lifetime)",
            None,
        )
    )
    per_note = (peak - fig.rss_idle_mb) / k
    rows.append(
        (
            f"(peak - idle) / {k} notes of {fig.note_bytes / MB:g} MB (MB)",
            f"{per_note:.1f}",
            "",
            f"{per_note * MB / fig.note_bytes:.2f}x note",
            f"<= {PER_NOTE_MAX_MB:g} MB",
            per_note <= PER_NOTE_MAX_MB,
        )
    )
    rows.append(
        (
            "RSS 1 s after the last reply (MB)",
            f"{fig.rss_after_mb:.1f}",
            "",
            "",
            f"({fig.memory_wall_s:.1f} s for all {k})",
            None,
        )
    )
    return print_table(("figure", "voice", "text", "ratio", "target", "result"), rows)


def parse(argv: list[str] | None) -> Sizes:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (under a minute)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds of one turn of each")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=10, help="turns of each kind a round")
    parser.add_argument("--concurrent", type=int, default=4, help="20 MB notes at once")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.rounds, args.per_round, args.concurrent = 2, 4, 5, 2
    if not 1 <= args.concurrent <= CAP:
        parser.error(f"--concurrent is 1..{CAP} (max_concurrent_sessions)")
    return Sizes(args.warmup, args.rounds, args.per_round, args.concurrent)


async def amain(sizes: Sizes) -> int:
    started = time.perf_counter()
    fig = Figures()
    memory_chats = [MEMORY_CHAT_BASE - i for i in range(sizes.concurrent)]
    with tempfile.TemporaryDirectory(prefix="geodebot-voice-bench-") as tmp_name:
        tmp = Path(tmp_name)
        path = realistic_note(tmp)
        note = path.read_bytes()
        fig.note_seconds = duration_s(path)
        seconds = round(fig.note_seconds)
        big = await asyncio.to_thread(lambda: cached_note(BIG_NOTE_BYTES).read_bytes())
        fig.note_bytes = len(big)
        print(
            f"notes: a {fig.note_seconds:.1f} s spoken OGG of {len(note):,} bytes for the "
            f"turns; {len(big):,} bytes (20 MB, 10^6-based: the Telegram fake's getFile limit "
            f"is {DOWNLOAD_LIMIT:,}) for the memory phase",
            flush=True,
        )
        async with (
            FakeTelegram() as telegram,
            FakeLLMServer(record=False) as llm,
            TimedAudioServer(key=AUDIO_KEY) as audio,
        ):
            llm.default = Reply(ANSWER)
            chats = [VOICE_CHAT, TEXT_CHAT, *memory_chats]
            config = write_config(tmp / "voice.toml", telegram, llm, audio, chats)
            daemon = DaemonProcess(config, env(telegram))
            try:
                await daemon.start(timeout_s=60)
                await daemon.wait_for_line(MODELS_MARK, 120)
                assert daemon.proc is not None
                pid = daemon.proc.pid
                await asyncio.sleep(1.5)  # start-up work done
                turns = sizes.rounds * sizes.per_round
                await step(
                    f"{sizes.warmup} warm-up rounds, then {sizes.rounds} rounds of "
                    f"{sizes.per_round} voice + {sizes.per_round} text turns ({turns} each)",
                    cpu_rounds(pid, telegram, audio, note, seconds, sizes, fig),
                )
                await step(
                    f"{sizes.concurrent} notes of {len(big):,} bytes at once, "
                    f"{sizes.concurrent} chats",
                    memory_phase(pid, telegram, big, memory_chats, fig),
                )
            finally:
                await stop_daemon(daemon)
            heard = [t for t in audio.transcriptions if t.size == len(big)]
            if len(heard) != sizes.concurrent or any(t.status != 200 for t in heard):
                print(f"\nthe audio fake did not transcribe every 20 MB note: {heard}")
                return 1
    ok = report(fig, sizes)
    problems = [line for line in daemon.log if "Traceback" in line or " ERROR " in line]
    if problems:
        print(f"\ngeodebot logged {len(problems)} error line(s); first: {problems[0]}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s; overall: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    sizes = parse(argv)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.release()}"
    )
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"sizes: warm-up {sizes.warmup}, {sizes.rounds} rounds x ({sizes.per_round} voice + "
        f"{sizes.per_round} text), {sizes.concurrent} notes of 20 MB at once, cap {CAP}"
    )
    return asyncio.run(amain(sizes))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
