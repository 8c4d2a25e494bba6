"""Dead letters: how soon a running ``geodebot serve`` sends a reply replayed by another
process, and what polling for such replays costs it while idle.

* pickup: a reply the fake Telegram refused for good (403) is replayed straight on the store,
  as ``geodebot deadletters replay`` does, ``--replays`` times; the time from the replay's
  commit to the daemon's sender taking the row and to the send arriving at the fake. The
  daemon polls every second, so the target is below 1.5 s each time.
* idle CPU: the daemon's own CPU time (utime + stime from /proc) over ``--idle`` seconds with
  nothing to do, for this tree and for a baseline tree without the poll (``--baseline``, e.g.
  the main checkout), alternately ``--rounds`` times, on the same fakes and config. The
  difference is the poll's cost; target: under 0.1 % of a core.

Run from the repo root: ``.venv/bin/python bench/deadletters_bench.py --baseline ../main``.
Prints figures and PASS/FAIL; exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from geodebot.config.schema import DB_FILE
from geodebot.store.sqlite import SQLiteStore
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.fakes.llm_server import FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram

CHAT, ALICE = -1001, 4242
READY_MARK = "ready: every enabled channel is connected"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of the whole line (11 and 12 after the name).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_config(tmp: Path, telegram: FakeTelegram, llm: FakeLLMServer) -> Path:
    path = tmp / "config.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp / "var"}"\nshutdown_grace_s = 5\n'
        f'[model]\nprovider = "anthropic"\nname = "bench-model"\n'
        f'base_url = "{llm.url}"\napi_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
        f'[channels.telegram]\ntoken_env = "BENCH_TG_TOKEN"\n'
        f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 25\n'
        f'[[bindings]]\nplatform = "telegram"\nchannel = "{CHAT}"\nsession = "ops"\n'
        f'allowed_users = ["{ALICE}"]\n'
    )
    return path


class Daemon:
    """``geodebot serve`` of the tree at ``tree`` (its own code first on the path)."""

    def __init__(self, tree: Path, config: Path, env: dict[str, str]) -> None:
        self.tree, self.config = tree, config
        self.env = dict(env, PYTHONPATH=str(tree))
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._ready = asyncio.Event()
        self.loaded = asyncio.Event()

    async def __aenter__(self) -> Daemon:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "geodebot",
            "serve",
            "--config",
            str(self.config),
            cwd=self.tree,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self._reader = asyncio.create_task(self._read())
        async with asyncio.timeout(60):
            await self._ready.wait()
        return self

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if READY_MARK in line:
                self._ready.set()
            if "models loaded (" in line:
                self.loaded.set()

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        await self.proc.wait()
        await self._reader


async def idle_cpu(daemon: Daemon, seconds: float) -> float:
    """Percent of one core the daemon used over ``seconds`` of doing nothing."""
    assert daemon.proc is not None
    # Start-up's tail (the model SDKs load after READY) is not idle time.
    async with asyncio.timeout(60):
        await daemon.loaded.wait()
    await asyncio.sleep(2)
    before = cpu_seconds(daemon.proc.pid)
    await asyncio.sleep(seconds)
    return 100 * (cpu_seconds(daemon.proc.pid) - before) / seconds


async def pickup(
    telegram: FakeTelegram, llm: FakeLLMServer, db: Path, count: int
) -> tuple[list[float], list[float]]:
    """Seconds from each replay's commit to the daemon's sender taking the row (its first
    write: the refused part is counted as resent, since Telegram cannot say whether it
    arrived), and to its send arriving."""
    taken, arrived = [], []
    async with SQLiteStore(db) as store:
        for n in range(count):
            llm.script(Reply(f"answer {n}"))
            telegram.fail_next("sendMessage", 403, "Forbidden: bot was blocked by the user")
            before = len(telegram.sent[CHAT])
            telegram.push_message(CHAT, f"question {n}", user_id=ALICE)
            async with asyncio.timeout(30):
                while True:
                    letters = await store.deadletters()
                    if letters:
                        break
                    await asyncio.sleep(0.05)
            [letter] = letters
            # Each round starts right after the last replay's poll: a random pause keeps
            # the replays from all falling at one phase of the daemon's poll.
            await asyncio.sleep(random.uniform(0, 1))
            done = await store.deadletter_replay("outbox", letter.row.id, by="bench", via="cli")
            assert done.result == "decided", done
            replayed = time.monotonic()
            async with asyncio.timeout(30):
                while True:
                    row = await store.get_outbox(letter.row.id)
                    if row is not None and (row.blind_resends or row.status != "pending"):
                        break
                    await asyncio.sleep(0.005)
            taken.append(time.monotonic() - replayed)
            await telegram.wait_until(lambda b=before: len(telegram.sent[CHAT]) > b, timeout=30)
            arrived.append(time.monotonic() - replayed)
    return taken, arrived


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a tree without the poll (main)")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds per idle sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replays", type=int, default=10)
    args = parser.parse_args()
    env = dict(os.environ)
    env[TEST_KEY_ENV] = TEST_KEY
    ok = True
    async with FakeTelegram() as telegram, FakeLLMServer() as llm:
        env["BENCH_TG_TOKEN"] = telegram.token
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            config = write_config(tmp, telegram, llm)
            async with Daemon(ROOT, config, env):
                taken, arrived = await pickup(telegram, llm, tmp / "var" / DB_FILE, args.replays)
            ok = ok and max(arrived) < 1.5
            for what, times in (("taken by the sender", taken), ("arrived", arrived)):
                print(
                    f"replay to {what}, {len(times)} replays: mean {statistics.mean(times):.3f} s, "
                    f"median {statistics.median(times):.3f} s, max {max(times):.3f} s"
                )
            print("target: arrived < 1.5 s each")
            if args.baseline is None:
                print("idle CPU: skipped (no --baseline)")
            else:
                trees = {"this tree": ROOT, "baseline": args.baseline.resolve()}
                samples: dict[str, list[float]] = {name: [] for name in trees}
                for _ in range(args.rounds):
                    for name, tree in trees.items():
                        async with Daemon(tree, config, env) as daemon:
                            samples[name].append(await idle_cpu(daemon, args.idle))
                for name, values in samples.items():
                    shown = ", ".join(f"{v:.3f}" for v in values)
                    median = statistics.median(values)
                    print(f"idle CPU, {name}: {shown} % of a core (median {median:.3f} %)")
                extra = statistics.median(samples["this tree"]) - statistics.median(
                    samples["baseline"]
                )
                ok = ok and extra < 0.1
                print(f"idle CPU added: {extra:.3f} % of a core (target < 0.1 %)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
