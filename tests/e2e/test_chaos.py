"""The chaos run, short: three platforms, a scheduled job, a few hundred tool effects and
repeated SIGKILLs of ``geodebot serve``; nothing acknowledged is lost, nothing is answered or
done twice, the store stays sound. Then the same with three replicas on one PostgreSQL
database, killed and paused so that others take over. ``bench/chaos.py`` runs the long
versions."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.support.chaos.driver import ChaosPlan, run_chaos
from tests.support.postgres import Cluster

SEED = int(os.environ.get("GEODEBOT_CHAOS_SEED", "20261201"))

# What must stay zero in every run: lost replies, duplicated replies, effects run twice,
# double job fires.
BROKEN = (
    "messages accepted, never answered",
    "messages answered more than once",
    "tool calls run twice",
    "messages/fires whose tool ran twice",
    "job fires claimed or posted twice",
)


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


async def test_chaos_with_three_replicas_keeps_every_promise(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    postgres_cluster: Cluster,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="aiohttp.server")
    plan = ChaosPlan(seed=SEED, messages=40, kills=2, replicas=3, pauses=1)
    report = await run_chaos(plan, tmp_path, say=print, cluster=postgres_cluster)
    with capsys.disabled():
        print(f"\nchaos run with 3 replicas, seed {SEED}:\n{report.summary()}")
    assert report.counts["kills (SIGKILL)"] == 2
    assert report.counts["pauses (SIGSTOP past the lease TTL)"] == 1
    # The pause alone hands the lease to another replica.
    assert report.counts["takeovers (final epoch - 1)"] >= 1
    assert report.counts["messages sent"] == 40
    assert report.counts["messages answered once"] > 0
    assert {name: report.counts[name] for name in BROKEN} == dict.fromkeys(BROKEN, 0)
    assert not report.problems, report.summary()
