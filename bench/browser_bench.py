"""What the headless-browser harness of the tests costs (tests/support/browser.py).

Debian's chromium under Playwright, launched the way the ``browser`` fixture does, on the
harness test's own page (tests/e2e/test_browser_harness.py: a form and a server-sent-events
stream on 127.0.0.1):

* start: Playwright's driver (a node process) up, then chromium launched, wall time;
* per tab, ``--tabs`` times: a fresh context and page as the ``tab`` fixture opens them
  (fenced routes included), the page loaded until its event stream is open, one pushed update
  shown, the context closed, wall time of each step;
* memory: resident set (RSS) and proportional set (PSS: shared pages divided among the
  processes that share them) summed over chromium's processes, idle after launch and with a
  tab open on the page; the driver's own alike. Summed RSS counts shared pages more than once,
  so PSS is the fair total;
* CPU: user+system time from /proc of chromium's processes and of the driver over the run.

Timings are wall time on a shared 2-core machine: take medians, compare within one run.

Run from the repo root: ``.venv/bin/python bench/browser_bench.py [--tabs 10]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playwright.async_api import async_playwright, expect

from tests.e2e.test_browser_harness import Site
from tests.support.browser import CHROMIUM_ARGS, LAUNCH_TIMEOUT_MS, chromium_executable, open_tab

TICKS = os.sysconf("SC_CLK_TCK")


def children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree, found, todo = children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kind(pid: int) -> str:
    """Chromium's role of the process: browser, zygote, renderer, gpu-process, utility."""
    try:
        # chromium rewrites its command line into one string: split on spaces too
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
    except OSError:
        return "gone"
    if not arguments:  # exited, not yet reaped
        return "gone"
    if arguments[0].endswith(b"crashpad_handler"):
        return "crashpad"
    for argument in arguments:
        if argument.startswith(b"--type="):
            return argument.removeprefix(b"--type=").decode()
    return "browser"


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB, from smaps_rollup."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "Rss":
                rss = int(value.split()[0])
            elif key == "Pss":
                pss = int(value.split()[0])
    except OSError:
        pass
    return rss, pss


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def processes() -> tuple[list[int], list[int]]:
    """(driver, chromium) process ids below this one."""
    driver = children().get(os.getpid(), [])
    return driver, [pid for parent in driver for pid in descendants(parent)]


def report_memory(label: str) -> None:
    driver, chromium = processes()
    rss = sum(memory_kib(pid)[0] for pid in chromium)
    pss = sum(memory_kib(pid)[1] for pid in chromium)
    kinds = sorted(kind(pid) for pid in chromium)
    drv_rss, drv_pss = map(sum, zip(*(memory_kib(pid) for pid in driver), strict=True))
    print(
        f"memory {label}: chromium {len(chromium)} processes ({', '.join(kinds)}): "
        f"RSS {rss / 1024:.0f} MiB, PSS {pss / 1024:.0f} MiB; "
        f"driver RSS {drv_rss / 1024:.0f} MiB, PSS {drv_pss / 1024:.0f} MiB"
    )


def ms(values: list[float]) -> str:
    return (
        f"median {statistics.median(values) * 1000:.0f} ms, "
        f"min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f}"
    )


async def main(tabs: int) -> None:
    executable = chromium_executable()
    site = Site()
    await site.start()
    started = time.perf_counter()
    async with async_playwright() as playwright:
        driver_up = time.perf_counter()
        browser = await playwright.chromium.launch(
            executable_path=executable,
            headless=True,
            args=list(CHROMIUM_ARGS),
            timeout=LAUNCH_TIMEOUT_MS,
        )
        launched = time.perf_counter()
        print(f"chromium {browser.version} at {executable}")
        print(
            f"start: driver {(driver_up - started) * 1000:.0f} ms, "
            f"chromium launch {(launched - driver_up) * 1000:.0f} ms"
        )
        await asyncio.sleep(1)
        report_memory("idle after launch")
        opening: list[float] = []
        loading: list[float] = []
        pushing: list[float] = []
        closing: list[float] = []
        for number in range(tabs):
            t0 = time.perf_counter()
            tab = await open_tab(browser)
            t1 = time.perf_counter()
            await tab.page.goto(site.url)
            await expect(tab.page.locator("#state")).to_have_text("live")
            t2 = time.perf_counter()
            site.push(f"update {number}")
            await expect(tab.page.locator("#live li")).to_have_text([f"update {number}"])
            t3 = time.perf_counter()
            if number == 0:
                report_memory("one tab open on the page")
            await tab.context.close()
            t4 = time.perf_counter()
            tab.check()
            opening.append(t1 - t0)
            loading.append(t2 - t1)
            pushing.append(t3 - t2)
            closing.append(t4 - t3)
        print(f"per tab ({tabs}): open context+page {ms(opening)}")
        print(f"per tab ({tabs}): load until the stream is open {ms(loading)}")
        print(f"per tab ({tabs}): pushed update shown {ms(pushing)}")
        print(f"per tab ({tabs}): close context {ms(closing)}")
        report_memory(f"after {tabs} tabs closed")
        driver, chromium = processes()
        print(
            f"cpu over the run: chromium {sum(map(cpu_s, chromium)):.2f} s, "
            f"driver {sum(map(cpu_s, driver)):.2f} s, this process "
            f"{sum(os.times()[:2]):.2f} s"
        )
        t5 = time.perf_counter()
        await browser.close()
        print(f"browser close {(time.perf_counter() - t5) * 1000:.0f} ms")
    await site.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tabs", type=int, default=10)
    asyncio.run(main(parser.parse_args().tabs))
