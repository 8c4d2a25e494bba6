"""Property: whatever a model proposes, only plan tools run, nothing crashes, every call is
answered. Thousands of random tool names and argument shapes go through the real loop,
executor and SQLite store; the model is a scripted port fake so the examples stay fast."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geodebot.config.schema import BudgetConfig
from geodebot.engine.ledger import EvidenceLedger
from geodebot.engine.llm.types import (
    LLMResponse,
    Message,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from geodebot.engine.loop import AgenticLoop
from geodebot.engine.modes import Mode
from geodebot.engine.session import EngineServices, SessionSpec, create_session
from geodebot.engine.tools.authority import ToolAuthority
from geodebot.engine.tools.catalog import ToolCatalog
from geodebot.logs.redact import Redactor
from geodebot.store.sqlite import SQLiteStore
from geodebot.testing import ScriptedLLM, text_reply
from tests.support.tools import marker_lines, tool_registry

PLAN = ("get_time", "lookup")
KNOWN = ("get_time", "lookup", "write_marker", "run_bash", "computer", "wait_forever")

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    # Huge strings: a short random text blown up well past any sane argument size.
    st.text(min_size=1, max_size=20).map(lambda s: s * 5_000),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=25,
)
arguments = st.one_of(
    st.dictionaries(st.text(max_size=12), json_value, max_size=6),
    st.fixed_dictionaries({"topic": json_value}),
    st.fixed_dictionaries({"topic": st.text(max_size=30)}),
    st.fixed_dictionaries({"timezone": st.text(max_size=70)}),
)
names = st.one_of(st.sampled_from(KNOWN), st.text(max_size=60))
call = st.tuples(names, arguments, st.one_of(st.none(), st.text(max_size=30)))
counter = itertools.count()


def deep(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


async def run_batch(store: SQLiteStore, marker: Path, batch: list[tuple[str, Any, Any]]) -> None:
    calls = tuple(
        ToolUseBlock(f"c{i}", name, args if error is None else {}, error)
        for i, (name, args, error) in enumerate(batch)
    )
    llm = ScriptedLLM(
        [LLMResponse(Message("assistant", calls), "tool_use", Usage(1, 1)), text_reply("ok")]
    )
    services = EngineServices(
        store=store,
        llm=lambda on_event: llm,
        tools=ToolCatalog(tool_registry(marker)),
        runner=ToolAuthority(store=store),
        ledger=EvidenceLedger(None, Redactor()),
        redactor=Redactor(),
        system_prompt="fuzz",
        budgets=BudgetConfig(max_rounds=4),
    )
    before = marker_lines(marker)
    session = await create_session(
        Mode.DAEMON, SessionSpec(f"fuzz-{next(counter)}", tools=PLAN), services
    )
    result = await AgenticLoop(session).arun("go")
    assert result.ok, result
    # Every call was answered, in order, exactly once.
    answered = llm.requests[1].messages[-1].content
    assert [b.tool_use_id for b in answered if isinstance(b, ToolResultBlock)] == [
        c.id for c in calls
    ]
    # Only plan tools ever ran: lookup is the only plan tool that leaves a mark.
    new = marker_lines(marker)[len(before) :]
    assert all(line.startswith("lookup:") for line in new), new


def test_random_calls_never_escape_the_plan(tmp_path: Path) -> None:
    # One loop and one store for every example (each runs in a session of its own): opening a
    # store per example cost more than the batches themselves. No fsync: durability is not
    # what this checks.
    with asyncio.Runner() as runner:
        store = SQLiteStore(tmp_path / "fuzz.db", synchronous="OFF")
        runner.run(store.open())

        @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(batch=st.lists(call, min_size=1, max_size=12))
        def check(batch: list[Any]) -> None:
            runner.run(run_batch(store, tmp_path / "marker", batch))

        try:
            check()
        finally:
            runner.run(store.close())


async def test_pathological_arguments_are_answered(tmp_path: Path) -> None:
    async with SQLiteStore(tmp_path / "fuzz.db") as store:
        await run_batch(
            store,
            tmp_path / "marker",
            [
                ("lookup", {"topic": deep(800)}, None),
                ("lookup", {"topic": "\x00\ud7ff\U0010ffff" * 1000}, None),
                ("get_time", {"timezone": "../../etc/passwd"}, None),
                ("run_bash", {"command": "touch /tmp/pwned"}, None),
                ("", {}, "arguments are not valid JSON"),
            ],
        )
