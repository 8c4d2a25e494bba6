"""What an open console page costs an idle daemon.

``geodebot serve`` runs as a subprocess against the Telegram fake and the model fake, with
its HTTP endpoint (and so the Work console) on. Once it is up and idle, its CPU time (user +
system of the process, from ``/proc``) is measured over windows of ``--window`` seconds that
alternate: no page open (the baseline: the daemon's own idle work, its Telegram long poll
among it), and pages open (``--pages`` clients, each having loaded ``/work`` and following
``/events`` as the page's script does). The pages' cost is the mean difference of the two,
in percent of one core, measured in the same run.

Target (issue 19): an idle open page costs the daemon under 0.5 % of a core.

Run from the repo root: ``.venv/bin/python bench/console_idle.py [--quick]``. Exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from telegram_bench import cpu_seconds, geodebot_config, geodebot_env, stop_daemon

from tests.support.daemon import CONNECTED_MARK, MODELS_MARK, DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.fakes.telegram_server import FakeTelegram

TARGET_PCT = 0.5
CHAT = -9101


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def open_pages(base: str, count: int) -> AsyncIterator[None]:
    """``count`` pages: each loads /work once, then follows /events until the context ends."""
    async with aiohttp.ClientSession() as session:
        streams = []
        try:
            for _ in range(count):
                async with session.get(base + "/work") as page:
                    assert page.status == 200, page.status
                    await page.read()
                stream = await session.get(base + "/events")
                assert stream.status == 200, stream.status
                assert await stream.content.readline() == b"retry: 3000\n"
                streams.append(stream)
            yield
        finally:
            for stream in streams:
                stream.close()


async def window(pid: int, seconds: float) -> float:
    """The daemon's CPU use over ``seconds``, in percent of one core."""
    cpu, wall = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return 100 * (cpu_seconds(pid) - cpu) / (time.monotonic() - wall)


async def run(rounds: int, seconds: float, pages: int) -> tuple[list[float], list[float]]:
    idle: list[float] = []
    open_: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with FakeTelegram() as telegram, FakeLLMServer() as llm:
            config = geodebot_config(Path(tmp) / "console.toml", telegram, llm, [CHAT])
            port = free_port()
            text = config.read_text().replace(
                "[daemon]\n", f'[daemon]\nhttp = "127.0.0.1:{port}"\n', 1
            )
            config.write_text(text)
            daemon = DaemonProcess(config, geodebot_env(telegram))
            await daemon.start()
            try:
                await daemon.wait_for_line(CONNECTED_MARK)
                await daemon.wait_for_line(MODELS_MARK)
                assert daemon.proc is not None
                pid = daemon.proc.pid
                base = f"http://127.0.0.1:{port}"
                await asyncio.sleep(2)  # start-up's last work (the heap keeper's first pass)
                for n in range(1, rounds + 1):
                    idle.append(await window(pid, seconds))
                    async with open_pages(base, pages):
                        await asyncio.sleep(1)  # the page's own load is not idle time
                        open_.append(await window(pid, seconds))
                    print(
                        f"  round {n}: no page {idle[-1]:.3f} %, "
                        f"{pages} page(s) open {open_[-1]:.3f} % of a core",
                        flush=True,
                    )
            finally:
                await stop_daemon(daemon)
    return idle, open_


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 s windows")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--window", type=float, default=30.0, help="seconds per window")
    parser.add_argument("--pages", type=int, default=1, help="pages open at once")
    args = parser.parse_args(argv)
    rounds, seconds = (2, 10.0) if args.quick else (args.rounds, args.window)
    print(f"console idle cost: {rounds} rounds of {seconds:g} s windows, {args.pages} page(s)")
    idle, open_ = asyncio.run(run(rounds, seconds, args.pages))
    cost = statistics.mean(o - i for o, i in zip(open_, idle, strict=True))
    per_page = cost / args.pages
    verdict = "PASS" if per_page < TARGET_PCT else "FAIL"
    print(
        f"daemon idle, no page: {statistics.mean(idle):.3f} % of a core; "
        f"with {args.pages} page(s) open: {statistics.mean(open_):.3f} %"
    )
    print(f"an open page costs {per_page:.3f} % of a core (target < {TARGET_PCT} %): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
