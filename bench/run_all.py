"""Every benchmark, one after the other, and ``docs/PERFORMANCE.md`` written from their output.

Each benchmark runs as its own process and prints its figures beside their targets, with the
baseline it measures against in the same run (the bare reference bot for message latency and
throughput, a short history for checkpoint cost, the first rounds for the soak slope). This
script records the machine, the exact commands, each benchmark's exit status and its output,
unedited, so every figure in the report can be traced to the line that printed it.

Run from the repo root: ``.venv/bin/python bench/run_all.py [--quick] [--out docs/PERFORMANCE.md]``
(``--quick``: small sizes, a smoke run of the whole set in a few minutes). Exits 1 if any
benchmark failed or missed a target.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CHAOS_SEED = 20261201


@dataclass(frozen=True)
class Bench:
    name: str
    what: str
    argv: list[str]
    quick: list[str]


BENCHES = [
    Bench(
        "checkpoint",
        "Per-turn checkpoint cost, 10,000 messages of history against 10 (store, same file).",
        ["bench/checkpoint.py"],
        ["bench/checkpoint.py", "--iterations", "100"],
    ),
    Bench(
        "messages",
        "Message latency and throughput against a bare python-telegram-bot + anthropic bot, "
        "RSS idle (all three channels, 10,000 bindings), growth over turns, start to READY.",
        ["bench/telegram_bench.py"],
        ["bench/telegram_bench.py", "--quick"],
    ),
    Bench(
        "long sessions",
        "CPU per turn in 50 busy chats at ~540 messages of history against ~60, and the first "
        "turn of each session after a restart against a warm one.",
        ["bench/long_sessions.py"],
        ["bench/long_sessions.py", "--quick"],
    ),
    Bench(
        "scheduler",
        "10,000 jobs in a running daemon: fire lateness and idle CPU.",
        ["bench/scheduler_bench.py"],
        ["bench/scheduler_bench.py", "--jobs", "2000"],
    ),
    Bench(
        "streaming",
        "Streamed replies on Telegram, Slack and Discord: first visible characters after the "
        "model's first token, edits per chat against each platform's limit, answers whole.",
        ["bench/stream_bench.py"],
        ["bench/stream_bench.py", "--quick"],
    ),
    Bench(
        "store",
        "The daemon on PostgreSQL (durable defaults) against SQLite: latency, throughput and "
        "CPU per reply; two more replicas as members; failover after a SIGKILL.",
        ["bench/store_bench.py"],
        ["bench/store_bench.py", "--quick"],
    ),
    Bench(
        "replicas",
        "Closed-loop throughput and CPU per reply with 1, 2 and 3 replicas on one PostgreSQL "
        "(Telegram webhooks behind a balancer, Slack spread; zero-latency and 50 ms model), "
        "and how the sessions spread.",
        ["bench/replicas_bench.py"],
        ["bench/replicas_bench.py", "--quick"],
    ),
    Bench(
        "voice",
        "The daemon's own CPU per voice-note turn against a text turn (the audio service's "
        "time excluded), and peak RSS per 20 MB note with several notes in flight at once.",
        ["bench/voice_bench.py"],
        ["bench/voice_bench.py", "--quick"],
    ),
    Bench(
        "memory",
        "Project memory's search latency in a store of 50 projects of 5,000 items, and the "
        "CPU recall adds to a turn.",
        ["bench/memory_bench.py"],
        ["bench/memory_bench.py", "--quick"],
    ),
    Bench(
        "soak",
        "20,000 turns: RSS series and slope (whole, and without the bounded context cache), "
        "open files, threads, asyncio tasks, the size of the store's log.",
        ["bench/soak.py"],
        ["bench/soak.py", "--turns", "3000", "--every", "500"],
    ),
    Bench(
        "console",
        "What an idle open page of the Work console costs the daemon, against no page, in the "
        "same run.",
        ["bench/console_idle.py"],
        ["bench/console_idle.py", "--quick"],
    ),
    Bench(
        "chaos",
        "Messages on all three platforms with seeded SIGKILLs and restarts: exactly-once counts.",
        ["bench/chaos.py", "--messages", "1000", "--kills", "30", "--seed", str(CHAOS_SEED)],
        ["bench/chaos.py", "--messages", "100", "--kills", "5", "--seed", str(CHAOS_SEED)],
    ),
]


@dataclass
class Result:
    bench: Bench
    argv: list[str]
    code: int
    seconds: float
    output: str


def machine() -> list[str]:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        )
        memory = f"{int(mem) / 1024**2:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        memory = "unknown"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return [
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu}), {memory} memory",
        f"- system: {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()} ({platform.python_implementation()})",
        f"- commit: `{commit}`{' with uncommitted changes' if dirty else ''}",
        f"- run: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
    ]


def run(bench: Bench, quick: bool) -> Result:
    argv = [PY, *(bench.quick if quick else bench.argv)]
    shown = shlex.join([".venv/bin/python", *argv[1:]])
    print(f"== {bench.name}: {shown}", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    output = (proc.stdout + proc.stderr).rstrip()
    print(output, flush=True)
    print(f"== {bench.name}: exit {proc.returncode} after {seconds:.0f} s\n", flush=True)
    return Result(bench, argv, proc.returncode, seconds, output)


def render(results: list[Result], quick: bool, command: str) -> str:
    note = " (quick sizes: a smoke run, not the reference figures)" if quick else ""
    lines = [
        "# Performance",
        "",
        "Written by `bench/run_all.py`; every figure below is the unedited output of the "
        "benchmark named, run on this machine in this run. Each benchmark prints its targets "
        "beside its figures and measures ratios against a baseline in the same run, so they "
        "hold on a noisy machine.",
        "",
        *machine(),
        f"- command: `{command}`{note}",
        "",
        "| benchmark | what it measures | result | time |",
        "|---|---|---|---|",
    ]
    for r in results:
        verdict = "PASS" if r.code == 0 else ("FAIL" if r.code == 1 else f"error (exit {r.code})")
        lines.append(f"| {r.bench.name} | {r.bench.what} | {verdict} | {r.seconds:.0f} s |")
    for r in results:
        shown = shlex.join([".venv/bin/python", *r.argv[1:]])
        lines += ["", f"## {r.bench.name}", "", f"`{shown}` (exit {r.code})", "", "```text"]
        lines += [r.output, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="report path")
    parser.add_argument("--only", nargs="*", help="run only these benchmarks")
    args = parser.parse_args(argv)
    out = args.out or (None if args.quick else ROOT / "docs" / "PERFORMANCE.md")
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    results = [run(bench, args.quick) for bench in chosen]
    command = shlex.join([".venv/bin/python", "bench/run_all.py", *(argv or sys.argv[1:])])
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render(results, args.quick, command))
        print(f"wrote {out}")
    return 0 if all(r.code == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
