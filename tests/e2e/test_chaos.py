"""The chaos run, short: three platforms, a scheduled job, a few hundred tool effects and
repeated SIGKILLs of ``geodebot serve``; nothing acknowledged is lost, nothing is answered or
done twice, the store stays sound. ``bench/chaos.py`` runs the long version."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.support.chaos.driver import ChaosPlan, run_chaos

SEED = int(os.environ.get("GEODEBOT_CHAOS_SEED", "20261201"))


async def test_chaos_short_run_keeps_every_promise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # A daemon killed mid-request makes the fakes' server log "Connection lost": expected.
    caplog.set_level(logging.CRITICAL, logger="aiohttp.server")
    plan = ChaosPlan(seed=SEED, messages=120, kills=6)
    report = await run_chaos(plan, tmp_path, say=print)
    with capsys.disabled():  # the counts go to the terminal, in CI too, pass or fail
        print(f"\nchaos run, seed {SEED}:\n{report.summary()}")
    assert report.counts["kills (SIGKILL)"] >= 5
    assert report.counts["messages sent"] >= 100
    assert report.counts["messages answered once"] > 0
    assert not report.problems, report.summary()
