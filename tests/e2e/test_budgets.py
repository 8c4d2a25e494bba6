"""Token budgets through ``geodebot serve`` on Telegram: a SIGKILL between a call's
reservation and its settlement frees nothing, the chat is told which budget ran out and
when it resets, ``/healthz`` shows it, and a job run over its budget is recorded as
``budget`` without a model call."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from geodebot.store.sqlite import SQLiteStore
from tests.support.abuse import free_port
from tests.support.cli import geodebot
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import Hang, Reply
from tests.support.telegram_world import GROUP, TelegramWorld

# Room for one call's worst case (an estimate of about 50 tokens plus max_tokens), not two.
MODEL = "max_retries = 0\nmax_tokens = 1000"
BINDING_TOKENS = 1400


async def healthz(port: int) -> dict[str, object]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/healthz") as response,
    ):
        body = await response.json()
        assert isinstance(body, dict)
        return body


async def test_a_sigkill_between_reservation_and_settlement_frees_nothing(
    tg: TelegramWorld,
) -> None:
    port = free_port()
    config = tg.write_config(model=MODEL, binding=f"daily_tokens = {BINDING_TOKENS}")
    config.write_text(
        config.read_text().replace("shutdown_grace_s = 5\n", f'http = "127.0.0.1:{port}"\n', 1)
    )
    tg.llm.script(Hang())
    daemon = DaemonProcess(config, tg.env)
    tg.daemons.append(daemon)
    await daemon.start()
    tg.ask("first question")
    async with asyncio.timeout(30):
        await tg.llm.wait_for_requests(1)
    # The call is on its way: its reservation was committed before it.
    await daemon.kill()
    tg.llm.default = Reply("an answer that must not be asked for", usage=(10, 10))

    again = DaemonProcess(config, tg.env)
    tg.daemons.append(again)
    await again.start()
    # The unanswered message is taken up again; its new call does not fit beside the
    # killed call's worst case, which is still counted.
    [reply] = await tg.replies(1)
    assert "No model call was made: this chat's daily token budget" in reply
    assert f"daily_tokens = {BINDING_TOKENS:,} on binding telegram:{GROUP}" in reply
    assert "It resets at 00:00 UTC" in reply
    assert tg.llm.request_count == 1
    health = await healthz(port)
    budgets = health["components"]["budgets"]  # type: ignore[index]
    assert budgets["ok"] is True  # one chat's budget, not the daemon's
    assert [e["scope"] for e in budgets["exhausted"]] == [f"binding:telegram:{GROUP}"]
    [counted] = [b for b in budgets["budgets"] if b["scope"] == f"binding:telegram:{GROUP}"]
    assert counted["used"] > 1000  # the killed call's worst case
    code, out, err = await geodebot(
        "usage", "--by", "binding", "--json", "--config", str(config), env=tg.env
    )
    assert code == 0, err
    [row] = [json.loads(line) for line in out.splitlines()]
    assert (row["key"], row["calls"], row["unsettled"]) == (f"telegram:{GROUP}", 1, 1)
    assert row["unsettled_tokens"] == counted["used"]
    assert await again.stop() == 0
    assert "Traceback" not in again.text()


async def test_a_job_run_over_its_budget_is_recorded_as_budget(tg: TelegramWorld) -> None:
    job = (
        '[[jobs]]\nid = "tick"\nevery = "1s"\nprompt = "report"\ndeliver_to = "ops"\n'
        "max_tokens_per_run = 100\n"
    )
    tg.llm.default = Reply("never asked", usage=(10, 10))
    daemon = await tg.start(model=MODEL, extra=job)
    notices = await tg.replies(1)
    assert await daemon.stop() == 0
    assert notices[0].startswith("Job tick (")
    assert (
        "stopped on a budget: No model call was made: this job run's token budget" in (notices[0])
    )
    assert "(max_tokens_per_run = 100 on job tick)" in notices[0]
    assert tg.llm.request_count == 0
    async with SQLiteStore(tg.tmp_path / "var" / "geodebot.db") as store:
        fires = await store.fire_history("tick")
    assert fires
    assert {f.outcome for f in fires} == {"budget"}
    assert all("this job run's token budget" in (f.reason or "") for f in fires)
