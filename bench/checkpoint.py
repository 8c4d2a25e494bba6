"""Per-turn checkpoint cost with a short history vs. a long one, in the same database file.

A checkpoint must not read history, so appending to a session with 10,000 messages should cost
about the same as appending to one with 10. Measurements alternate between the two cases so
that drift (WAL growth, auto-checkpoints, page cache) hits both equally, and every short-case
checkpoint runs on its own session so that it really has 10 prior messages, not 10 plus
everything measured before it.

Run: ``python bench/checkpoint.py [--synchronous FULL] [--iterations 500]``. Exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import platform
import sqlite3
import statistics
import sys
import tempfile
import time

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from geodebot.store.records import NewMessage
from geodebot.store.sqlite import SQLiteStore

TARGET_RATIO = 1.3
SHORT_HISTORY = 10
LONG_HISTORY = 10_000
FILL_BATCH = 500

_TEXT = (
    "Deploy of api-gateway to staging finished; 3 of 3 pods healthy, p95 latency 212 ms, "
    "no error-rate change over the last 15 minutes. Next: canary to 5% of production."
)


def message(role: str, turn: str, n: int) -> NewMessage:
    content = {"role": role, "content": [{"type": "text", "text": f"{_TEXT} #{n}"}]}
    return NewMessage(role=role, content=content, turn_id=turn)


async def fill(store: SQLiteStore, session_id: str, count: int) -> None:
    await store.ensure_session(session_id, "channel")
    for start in range(0, count, FILL_BATCH):
        n = min(FILL_BATCH, count - start)
        roles = ("user", "assistant")
        batch = [message(roles[(start + i) % 2], "fill", start + i) for i in range(n)]
        await store.checkpoint(session_id, messages=batch)


async def turn(store: SQLiteStore, session_id: str, n: int) -> float:
    """One agent round: user + assistant message, a timeline event and the new loop state."""
    turn_id = f"turn-{n}"
    started = time.perf_counter()
    await store.checkpoint(
        session_id,
        messages=[message("user", turn_id, n), message("assistant", turn_id, n)],
        state={"last_turn": turn_id, "input_tokens": 1200 + n, "output_tokens": 300},
        timeline=[(turn_id, "llm_call", {"round": 0, "input_tokens": 1200, "ms": 850})],
    )
    return time.perf_counter() - started


async def run(path: pathlib.Path, synchronous: str, iterations: int, warmup: int) -> bool:
    async with SQLiteStore(path, synchronous=synchronous) as store:
        await fill(store, "long", LONG_HISTORY)
        for i in range(warmup + iterations):
            await fill(store, f"short-{i}", SHORT_HISTORY)
        short: list[float] = []
        long: list[float] = []
        for i in range(warmup + iterations):
            # Alternate which case goes first, so neither always follows the other's commit.
            cases = [(f"short-{i}", short), ("long", long)]
            for session_id, samples in cases if i % 2 == 0 else cases[::-1]:
                elapsed = await turn(store, session_id, i)
                if i >= warmup:
                    samples.append(elapsed)
        long_total = len(await store.load_messages("long"))

    print(f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version}")
    print(f"synchronous={synchronous}, journal_mode=WAL, db={path}")
    print(f"{iterations} measured checkpoints per case after {warmup} warm-up")
    print(f"long session ended with {long_total} messages")
    p50 = {}
    for label, samples, history in (("short", short, SHORT_HISTORY), ("long", long, LONG_HISTORY)):
        p50[label] = statistics.median(samples) * 1e3
        mean = statistics.fmean(samples) * 1e3
        print(f"{history:>6} prior messages: p50 {p50[label]:.3f} ms, mean {mean:.3f} ms")
    ratio = p50["long"] / p50["short"]
    ok = ratio <= TARGET_RATIO
    verdict = "PASS" if ok else "FAIL"
    print(f"ratio of medians ({LONG_HISTORY} / {SHORT_HISTORY}): {ratio:.3f}")
    print(f"target <= {TARGET_RATIO}: {verdict}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--synchronous", default="FULL", choices=["OFF", "NORMAL", "FULL"])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="geodebot-bench-") as tmp:
        path = pathlib.Path(tmp) / "bench.db"
        ok = asyncio.run(run(path, args.synchronous, args.iterations, args.warmup))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
