"""Token and spend budgets: each budget refuses before the call (the fake model sees no
request), names itself and when it resets, resets at the UTC day's end, keeps a cut-off
call's worst case, and ``geodebot usage`` adds up to the calls recorded."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
from contextlib import AsyncExitStack, redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App, spend_limits
from geodebot.cli.main import main
from geodebot.config.schema import ConfigError, Prices, parse_config
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec
from geodebot.engine.spend import SpendGate, SpendLimits, SpendScope
from geodebot.store.records import ModelCall, SpendCharge, StoreError
from geodebot.store.sqlite import SQLiteStore
from tests.support.app import open_app
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import FakeLLMServer, Hang, Reply

DAY = dt.datetime(2026, 12, 3, 22, 30, tzinfo=dt.UTC).timestamp()
MAX_TOKENS = 1000
# Room for one call's worst case (its estimate, about 50 tokens, plus MAX_TOKENS), but not
# for a second one once the first has used 500 tokens.
LIMIT = 1400


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def with_gate(app: App, limits: SpendLimits, clock: Clock) -> App:
    """The app with its budgets replaced (and a clock the test moves)."""
    gate = SpendGate(app.services.store, limits, clock=clock)
    return dataclasses.replace(app, services=dataclasses.replace(app.services, spend=gate))


async def opened(tmp_path: Path, server: FakeLLMServer, stack: AsyncExitStack) -> App:
    config = make_config(tmp_path, server, model={"max_tokens": MAX_TOKENS})
    return await open_app(config, stack, tmp_path / "marker")


def call(n: int, *, state: str = "reserved", tokens: int = 100, **fields: Any) -> ModelCall:
    return ModelCall(
        id=f"mc-{n}",
        day="2026-12-03",
        created_at=DAY + n,
        session_id="s",
        turn_id=f"t{n}",
        binding=fields.pop("binding", None),
        job=fields.pop("job", None),
        run=fields.pop("run", None),
        state=state,  # type: ignore[arg-type]
        reserved_tokens=tokens,
        **fields,
    )


# -- the store --------------------------------------------------------------------------
async def test_a_reservation_that_does_not_fit_writes_nothing(tmp_path: Path) -> None:
    async with SQLiteStore(tmp_path / "db") as store:
        daemon = SpendCharge("daemon", "2026-12-03", "tokens", 250)
        chat = SpendCharge("binding:telegram:1", "2026-12-03", "tokens", None)
        assert await store.spend_reserve(call(1), [daemon, chat]) is None
        assert await store.spend_reserve(call(2), [daemon, chat]) is None
        refusal = await store.spend_reserve(call(3), [daemon, chat])
        assert refusal is not None
        assert (refusal.charge, refusal.used, refusal.needed) == (daemon, 200, 100)
        assert [c.id for c in await store.model_calls()] == ["mc-2", "mc-1"]
        counters = [("daemon", "2026-12-03"), ("binding:telegram:1", "2026-12-03")]
        assert await store.spend_used(counters) == dict.fromkeys(counters, 200.0)
        # Settling moves the counters from the worst case to what was used, once.
        used = dataclasses.replace(call(1), state="settled", input_tokens=30, output_tokens=10)
        assert await store.spend_settle(used)
        assert not await store.spend_settle(used)
        assert await store.spend_used(counters) == dict.fromkeys(counters, 140.0)
        assert await store.spend_reserve(call(3), [daemon, chat]) is None
        with pytest.raises(StoreError):
            await store.spend_record(call(4), [daemon])  # a reserved row is not a record


async def test_usage_report_sums_the_calls_by_group(tmp_path: Path) -> None:
    async with SQLiteStore(tmp_path / "db") as store:
        rows = [
            call(1, state="settled", binding="telegram:1", input_tokens=100, output_tokens=10,
                 cache_read_tokens=80, cost_usd=0.5),
            call(2, state="settled", binding="telegram:1", input_tokens=50, output_tokens=5,
                 cache_write_tokens=40, cost_usd=0.25),
            call(3, state="settled", job="nightly", run="fire-1", input_tokens=7,
                 output_tokens=3),
        ]  # fmt: skip
        for row in rows:
            await store.spend_record(row, [])
        await store.spend_reserve(call(4, binding="telegram:1", tokens=900), [])
        by_binding = {r.key: r for r in await store.usage_report(by="binding")}
        chat = by_binding["telegram:1"]
        assert (chat.calls, chat.input_tokens, chat.output_tokens) == (3, 150, 15)
        assert (chat.cache_read_tokens, chat.cache_write_tokens) == (80, 40)
        assert (chat.unsettled, chat.unsettled_tokens, chat.cost_usd) == (1, 900, 0.75)
        assert by_binding["(none)"].unpriced == 1
        [everything] = await store.usage_report()
        assert (everything.calls, everything.input_tokens) == (4, 157)
        assert [r.key for r in await store.usage_report(by="job")] == ["(none)", "nightly"]
        assert [r.key for r in await store.usage_report(by="day")] == ["2026-12-03"]


# -- the budgets, through the loop and the real SDK -------------------------------------
async def test_the_daemons_daily_budget_refuses_before_the_call_and_resets_at_midnight(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("fine", usage=(400, 100))
    clock = Clock(DAY)
    async with AsyncExitStack() as stack:
        app = await opened(tmp_path, llm_server, stack)
        app = with_gate(app, SpendLimits(daily_tokens=LIMIT), clock)
        first = await app.run_turn(Mode.HEADLESS, SessionSpec("s"), "hello")
        assert first.ok
        assert llm_server.request_count == 1
        second = await app.run_turn(Mode.HEADLESS, SessionSpec("s"), "again")
        assert second.outcome == "budget"
        assert llm_server.request_count == 1  # no call was made
        assert "the daemon's daily token budget" in second.text
        assert "daily_tokens = 1,400" in second.text
        assert "It resets at 00:00 UTC, in 1 h 30 min." in second.text
        kinds = [e.kind for e in await app.services.store.timeline("s")]
        assert kinds[-2:] == ["budget_exhausted", "turn_finished"]
        ok, health = await app.services.spend.status()  # type: ignore[union-attr]
        assert not ok
        assert [e["scope"] for e in health["exhausted"]] == ["daemon"]
        # A new UTC day is a new budget.
        clock.now = DAY + 2 * 3600
        third = await app.run_turn(Mode.HEADLESS, SessionSpec("s"), "next day")
        assert third.ok
        assert llm_server.request_count == 2
        assert (await app.services.spend.status())[0]  # type: ignore[union-attr]


async def test_a_bindings_budget_is_its_own(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    llm_server.default = Reply("fine", usage=(400, 100))
    async with AsyncExitStack() as stack:
        app = await opened(tmp_path, llm_server, stack)
        limits = SpendLimits(bindings={"telegram:1": LIMIT})
        app = with_gate(app, limits, Clock(DAY))
        chat = SessionSpec("chat", spend=SpendScope(binding="telegram:1"))
        other = SessionSpec("other", spend=SpendScope(binding="telegram:2"))
        assert (await app.run_turn(Mode.DAEMON, chat, "one")).ok
        refused = await app.run_turn(Mode.DAEMON, chat, "two")
        assert refused.outcome == "budget"
        assert "this chat's daily token budget" in refused.text
        assert "binding telegram:1" in refused.text
        assert (await app.run_turn(Mode.DAEMON, other, "elsewhere")).ok
        assert llm_server.request_count == 2
        ok, health = await app.services.spend.status()  # type: ignore[union-attr]
        assert ok  # one chat's budget leaves the daemon healthy, and says so
        assert [e["scope"] for e in health["exhausted"]] == ["binding:telegram:1"]


async def test_a_job_runs_budget_counts_its_rounds_and_the_next_run_starts_afresh(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(Reply("first run", usage=(400, 100)), Reply("second run", usage=(400, 100)))
    async with AsyncExitStack() as stack:
        app = await opened(tmp_path, llm_server, stack)
        app = with_gate(app, SpendLimits(jobs={"nightly": LIMIT}), Clock(DAY))
        run1 = SessionSpec("job:nightly", spend=SpendScope(job="nightly", run="fire-1"))
        assert (await app.run_turn(Mode.DAEMON, run1, "report")).ok
        # The same run again: its first call settled at 500 tokens, the next worst case
        # does not fit in what is left.
        refused = await app.run_turn(Mode.DAEMON, run1, "more")
        assert refused.outcome == "budget"
        assert "this job run's token budget (max_tokens_per_run = 1,400 on job nightly)" in (
            refused.text
        )
        assert "The job's next run starts with a fresh budget." in refused.text
        run2 = SessionSpec("job:nightly", spend=SpendScope(job="nightly", run="fire-2"))
        assert (await app.run_turn(Mode.DAEMON, run2, "report")).ok
        assert llm_server.request_count == 2


async def test_the_daily_spend_limit_counts_dollars_at_the_configured_prices(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.default = Reply("fine", usage=(1000, 1000))
    prices = Prices(input=3.0, output=15.0, cache_read=0.3, cache_write=3.75)
    async with AsyncExitStack() as stack:
        app = await opened(tmp_path, llm_server, stack)
        limits = SpendLimits(daily_usd=0.05, prices={("anthropic", "model-under-test-1"): prices})
        app = with_gate(app, limits, Clock(DAY))
        assert (await app.run_turn(Mode.HEADLESS, SessionSpec("s"), "one")).ok
        [made] = await app.services.store.model_calls()
        # 1,000 input tokens at $3 and 1,000 output tokens at $15 per million.
        assert made.cost_usd == pytest.approx(0.018)
        assert (await app.run_turn(Mode.HEADLESS, SessionSpec("s"), "two")).ok
        refused = await app.run_turn(Mode.HEADLESS, SessionSpec("s"), "three")
        assert refused.outcome == "budget"
        # Two calls cost $0.036; a third could cost up to $0.015 more (1,000 output tokens).
        assert "daily spend budget ([model] daily_usd = $0.05)" in refused.text
        assert llm_server.request_count == 2


async def test_a_call_cut_off_keeps_its_worst_case_counted(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    """The turn's time budget ends a hung call: what it spent is unknown, so its
    reservation stays at the worst case and nothing of it is freed."""
    llm_server.script(Hang())
    clock = Clock(DAY)
    async with AsyncExitStack() as stack:
        app = await opened(tmp_path, llm_server, stack)
        app = with_gate(app, SpendLimits(daily_tokens=10 * MAX_TOKENS), clock)
        spec = SessionSpec("s", time_budget_s=0.5)
        result = await app.run_turn(Mode.HEADLESS, spec, "hang")
        assert result.outcome == "budget"
        [cut] = await app.services.store.model_calls()
        assert cut.state == "reserved"
        assert cut.reserved_tokens > MAX_TOKENS
        used = await app.services.store.spend_used([("daemon", "2026-12-03")])
        assert used[("daemon", "2026-12-03")] == cut.reserved_tokens


async def test_a_failed_call_is_settled_at_zero(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    from tests.support.fakes.llm_server import Error

    llm_server.script(Error(400, "invalid_request_error", "bad"))
    async with AsyncExitStack() as stack:
        app = await opened(tmp_path, llm_server, stack)
        app = with_gate(app, SpendLimits(daily_tokens=10 * MAX_TOKENS), Clock(DAY))
        result = await app.run_turn(Mode.HEADLESS, SessionSpec("s"), "x")
        assert result.outcome == "model_error"
        [failed] = await app.services.store.model_calls()
        assert (failed.state, failed.input_tokens, failed.output_tokens) == ("failed", 0, 0)
        used = await app.services.store.spend_used([("daemon", "2026-12-03")])
        assert used[("daemon", "2026-12-03")] == 0


async def test_usage_totals_equal_the_calls_on_the_timelines(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    llm_server.script(
        Reply("a", usage=(120, 7)), Reply("b", usage=(300, 11)), Reply("c", usage=(45, 2))
    )
    config = make_config(tmp_path, llm_server)
    async with AsyncExitStack() as stack:
        app = await open_app(config, stack, tmp_path / "marker")
        for session, text in (("s1", "x"), ("s2", "y"), ("s1", "z")):
            assert (await app.run_turn(Mode.HEADLESS, SessionSpec(session), text)).ok
        events = [
            e
            for session in ("s1", "s2")
            for e in await app.services.store.timeline(session)
            if e.kind == "llm_call"
        ]
    out = StringIO()
    config_path = tmp_path / "geodebot.toml"
    config_path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "var"}"\n')
    with redirect_stdout(out):
        code = await asyncio.to_thread(main, ["usage", "--json", "--config", str(config_path)])
    assert code == 0
    [total] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert total["calls"] == len(events) == 3
    assert total["input_tokens"] == sum(e.data["input_tokens"] for e in events) == 465
    assert total["output_tokens"] == sum(e.data["output_tokens"] for e in events) == 20


def test_limits_come_from_the_configuration(tmp_path: Path, llm_server: FakeLLMServer) -> None:
    prices = {"input": 3.0, "output": 15.0}
    config = make_config(
        tmp_path,
        llm_server,
        model={"price_per_mtok": prices, "daily_usd": 20.0},
        budgets={"daily_tokens": 2_000_000},
    )
    config = with_sections(
        config,
        channels={"telegram": {"enabled": True, "token_env": "T"}},
        bindings=[
            {"platform": "telegram", "channel": "1", "session": "a", "daily_tokens": 200_000},
            {"platform": "telegram", "channel": "2", "session": "b"},
        ],
        jobs=[
            {"id": "nightly", "every": "1h", "prompt": "p", "deliver_to": "a",
             "max_tokens_per_run": 50_000},
        ],
    )  # fmt: skip
    limits = spend_limits(config)
    assert limits.daily_tokens == 2_000_000
    assert limits.daily_usd == 20.0
    assert limits.bindings == {"telegram:1": 200_000}
    assert limits.jobs == {"nightly": 50_000}
    assert limits.prices == {("anthropic", "model-under-test-1"): Prices(input=3.0, output=15.0)}


def test_a_spend_limit_needs_prices_on_every_model(tmp_path: Path) -> None:
    fallback = {"provider": "openai", "name": "gpt-x"}
    data = {
        "model": {
            "price_per_mtok": {"input": 3.0, "output": 15.0},
            "daily_usd": 5.0,
            "fallbacks": [fallback],
        }
    }
    with pytest.raises(ConfigError, match=r"daily_usd needs price_per_mtok.*gpt-x"):
        parse_config(data)


async def test_reservations_race_for_the_last_of_a_budget(tmp_path: Path) -> None:
    """Twenty calls reserve at once against room for five: five go through."""
    async with SQLiteStore(tmp_path / "db") as store:
        daemon = SpendCharge("daemon", "2026-12-03", "tokens", 500)
        results = await asyncio.gather(*(store.spend_reserve(call(n), [daemon]) for n in range(20)))
        assert sum(r is None for r in results) == 5
        assert len(await store.model_calls()) == 5
