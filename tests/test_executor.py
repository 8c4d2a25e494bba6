"""Executor details that are easiest to see without a model: concurrency and ordering."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from geodebot.engine.executor import ToolExecutor
from geodebot.engine.llm.types import ToolUseBlock
from geodebot.engine.modes import Mode
from geodebot.engine.tools import BoundToolPlan, Effect, Safety, ToolCallContext, ToolSpec
from geodebot.store.sqlite import SQLiteStore


def rendezvous_tools(keys: tuple[tuple[str, ...], tuple[str, ...]]) -> dict[str, ToolSpec]:
    """Two tools that each wait for the other to have started: only overlap lets both meet."""
    started = {"a": asyncio.Event(), "b": asyncio.Event()}

    def make(me: str, other: str, resource_keys: tuple[str, ...]) -> ToolSpec:
        async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
            started[me].set()
            try:
                async with asyncio.timeout(1.0):
                    await started[other].wait()
            except TimeoutError:
                return "alone"
            return "met"

        return ToolSpec(
            name=me,
            description=me,
            input_schema={"type": "object"},
            safety=Safety.READ,
            effect=Effect.NONE,
            handler=handler,
            resource_keys=resource_keys,
        )

    return {"a": make("a", "b", keys[0]), "b": make("b", "a", keys[1])}


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ((("x",), ("y",)), ["met", "met"]),
        ((("x",), ("x", "y")), ["alone", "met"]),
    ],
    ids=["disjoint-keys-overlap", "shared-key-serialises"],
)
async def test_resource_keys_decide_concurrency(
    tmp_path: Path, keys: tuple[tuple[str, ...], tuple[str, ...]], expected: list[str]
) -> None:
    tools = rendezvous_tools(keys)
    plan = BoundToolPlan.project(tools, Mode.DAEMON, ["a", "b"])
    async with SQLiteStore(tmp_path / "db") as store:
        executor = ToolExecutor(store=store)
        calls = [ToolUseBlock("1", "a", {}), ToolUseBlock("2", "b", {})]
        outcomes = await executor.run_batch(plan, calls, ToolCallContext("s", "t", Mode.DAEMON))
    # Results come back in proposal order whatever order the calls finished in.
    assert [o.call.id for o in outcomes] == ["1", "2"]
    assert [o.result.content for o in outcomes] == expected
