"""Project memory's search and recall: how long a search takes in a full store, and what
recall adds to a turn.

* search latency: ``--projects`` projects of ``--items`` items each (the defaults: 50 and
  5,000, ``[memory] max_items``), written straight into a SQLite store migrated by the store
  itself (as its saves leave the rows; the FTS5 index filled by its triggers), then
  ``--queries`` searches through ``SQLiteStore.memory_search`` (limit 5) of a random project.
  The notes' words follow a Zipf distribution over 30,000 words (as prose does: a few words
  in nearly every note, most in few), 8 to 30 words a note, queries 2 to 6 words of the same
  distribution; p50, p99 and max. Target: p99 <= 5 ms.
* recall's CPU: the same searches as :class:`geodebot.memory.recall.Recall` makes them for a
  turn (search, format, timeline record), the process CPU per recall. Target: <= 2 ms.

Both in this process, on this machine's disk (the store's durable defaults). Run from the
repo root: ``.venv/bin/python bench/memory_bench.py [--quick]``. Exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from geodebot.config.schema import BindingConfig, MemoryConfig
from geodebot.memory.recall import Recall
from geodebot.store.memory import SLOT_BITS, new_ref
from geodebot.store.sqlite import SQLiteStore

SEARCH_P99_MS = 5.0
RECALL_CPU_MS = 2.0
# Words as notes use them: a Zipf distribution over a vocabulary (a few words in nearly
# every note, most in a handful), notes of 8 to 30 words, queries of 2 to 6 from the same
# distribution (so they hold a common word or two, as questions do).
VOCABULARY = 30_000
_CUMULATIVE = list(itertools.accumulate(1.0 / rank for rank in range(1, VOCABULARY + 1)))
_WORDS = [f"w{rank}" for rank in range(1, VOCABULARY + 1)]


def words(rng: random.Random, low: int, high: int) -> list[str]:
    return rng.choices(_WORDS, cum_weights=_CUMULATIVE, k=rng.randint(low, high))


def sentence(rng: random.Random) -> str:
    return " ".join(words(rng, 8, 30))


def fill(path: Path, projects: int, items: int, rng: random.Random) -> None:
    """The store's tables as its saves leave them (each project a slot, its items that slot's
    ids; the index filled by the triggers), one transaction per project."""
    with sqlite3.connect(path) as db:
        for p in range(projects):
            slot = p + 1
            db.execute(
                "INSERT INTO memory_projects (id, project, items) VALUES (?, ?, ?)",
                (slot, f"project-{p}", items),
            )
            rows = [
                ((slot << SLOT_BITS) + n + 1, new_ref(), f"project-{p}", sentence(rng), time.time())
                for n in range(items)
            ]
            db.executemany(
                "INSERT INTO memory_items (id, ref, project, text, tags, session_id, turn_id, "
                "user_id, origin, forwarded, created_at) "
                "VALUES (?, ?, ?, ?, '', 's', 't', 'u', 'chat', 0, ?)",
                rows,
            )
            db.commit()


def query(rng: random.Random) -> str:
    return " ".join(words(rng, 2, 6))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(args: argparse.Namespace) -> int:
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        path = Path(tmp) / "geodebot.db"
        async with SQLiteStore(path):
            pass  # migrated
        started = time.monotonic()
        fill(path, args.projects, args.items, rng)
        filled_s = time.monotonic() - started
        async with SQLiteStore(path) as store:
            for _ in range(20):  # warm the page cache and the statement cache
                await store.memory_search("project-0", query(rng), limit=5)
            latencies: list[float] = []
            found = 0
            for _ in range(args.queries):
                project = f"project-{rng.randrange(args.projects)}"
                text = query(rng)
                t0 = time.perf_counter()
                hits = await store.memory_search(project, text, limit=5)
                latencies.append((time.perf_counter() - t0) * 1000)
                found += bool(hits)
            recall = Recall(store, store, MemoryConfig(recall=3))
            cpu: list[float] = []
            for n in range(args.queries // 2):
                binding = BindingConfig(
                    platform="telegram",
                    channel="1",
                    session="s",
                    project=f"project-{n % args.projects}",
                )
                c0 = time.process_time()
                await recall.block(binding, query(rng), session_id="s", turn_id=f"t-{n}")
                cpu.append((time.process_time() - c0) * 1000)
    p50, p99, worst = pct(latencies, 0.5), pct(latencies, 0.99), max(latencies)
    recall_ms = statistics.mean(cpu)
    print(
        f"machine: {platform.machine()}, Python {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}"
    )
    print(
        f"store: {args.projects} projects x {args.items:,} items = "
        f"{args.projects * args.items:,} items, filled in {filled_s:.1f} s"
    )
    print(f"{'figure':<44} {'value':>9}  {'target':<12} result")
    rows = [
        ("search p50 (ms)", p50, "", None),
        ("search p99 (ms)", p99, f"<= {SEARCH_P99_MS:g}", p99 <= SEARCH_P99_MS),
        ("search max (ms)", worst, "", None),
        (f"searches with a hit (of {args.queries})", float(found), "", None),
        (
            "recall CPU per turn, mean (ms)",
            recall_ms,
            f"<= {RECALL_CPU_MS:g}",
            recall_ms <= RECALL_CPU_MS,
        ),
    ]
    ok = True
    for name, value, target, passed in rows:
        verdict = "n/a" if passed is None else ("PASS" if passed else "FAIL")
        ok = ok and passed is not False
        print(f"{name:<44} {value:>9.2f}  {target:<12} {verdict}")
    print(f"overall: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="5 projects of 1,000 items")
    parser.add_argument("--projects", type=int, default=50)
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--queries", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.quick:
        args.projects, args.items, args.queries = 5, 1000, 400
    return asyncio.run(measure(args))


if __name__ == "__main__":
    sys.exit(main())
