"""Executor details that are easiest to see without a model: concurrency and ordering."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from geodebot.engine.llm.types import ToolUseBlock
from geodebot.engine.modes import Mode
from geodebot.engine.tools import BoundToolPlan, Effect, Safety, ToolCallContext, ToolSpec
from geodebot.engine.tools.authority import ToolAuthority, approval_hash
from geodebot.engine.tools.schema import SchemaError
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
        executor = ToolAuthority(store=store)
        calls = [ToolUseBlock("1", "a", {}), ToolUseBlock("2", "b", {})]
        outcomes = await executor.run_batch(plan, calls, ToolCallContext("s", "t", Mode.DAEMON))
    # Results come back in proposal order whatever order the calls finished in.
    assert [o.call.id for o in outcomes] == ["1", "2"]
    assert [o.result.content for o in outcomes] == expected


def echo_tool(name: str, schema: Mapping[str, Any]) -> ToolSpec:
    async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        return "ran"

    return ToolSpec(
        name=name,
        description=name,
        input_schema=schema,
        safety=Safety.READ,
        effect=Effect.NONE,
        handler=handler,
    )


# Nested quantifiers: a backtracking engine needs about 2^38 steps on a 40-character value.
CATASTROPHIC = r"^(\w+\s?)*$"
VALUE = "deployment_finished_without_any_errors!!"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"v": {"type": "string", "pattern": CATASTROPHIC}}},
        {"type": "object", "patternProperties": {CATASTROPHIC: {"type": "integer"}}},
        {
            "type": "object",
            "patternProperties": {CATASTROPHIC: {"type": "integer"}},
            "additionalProperties": False,
        },
    ],
    ids=["pattern", "patternProperties", "additionalProperties"],
)
async def test_a_schema_pattern_is_matched_in_linear_time(
    tmp_path: Path, schema: Mapping[str, Any]
) -> None:
    """A server-supplied schema's regex must not hold the event loop: the value a
    backtracking engine would take hours on is checked at once, and refused."""
    tool = echo_tool("t", schema)
    plan = BoundToolPlan.project({"t": tool}, Mode.DAEMON, ["t"])
    async with SQLiteStore(tmp_path / "db") as store:
        executor = ToolAuthority(store=store)
        calls = [ToolUseBlock("1", "t", {"v": VALUE, VALUE: "not an integer"})]
        started = time.monotonic()
        [outcome] = await executor.run_batch(plan, calls, ToolCallContext("s", "t", Mode.DAEMON))
        elapsed = time.monotonic() - started
    # A bound, not a benchmark: the backtracking check took hours.
    assert elapsed < 2.0
    assert (outcome.status, outcome.reason) == ("refused", "invalid_arguments")
    assert "ran" not in outcome.result.content


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(a"}}}, "regex"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "object", "properties": {"a": {"pattern": "(?=x)"}}}, "regex"),
        ({"type": "object", "properties": {"a": {"minimum": float("nan")}}}, "nan"),
    ],
    ids=["unknown-type", "bad-pattern", "dangling-ref", "lookahead", "nan"],
)
def test_an_unusable_schema_is_refused_when_it_is_compiled(
    schema: Mapping[str, Any], why: str
) -> None:
    tool = echo_tool("t", schema)
    with pytest.raises(SchemaError) as refused:
        tool.arguments_schema  # noqa: B018 - compiling is what raises
    assert why in str(refused.value).lower()


def test_a_schema_nested_past_the_limit_is_refused_not_recursed_into() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(SchemaError, match="nested"):
        echo_tool("t", deep).arguments_schema  # noqa: B018 - compiling is what raises


async def test_a_tool_whose_schema_cannot_be_compiled_is_refused_and_its_batch_goes_on(
    tmp_path: Path,
) -> None:
    bad = echo_tool("bad", {"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}})
    good = echo_tool("good", {"type": "object"})
    plan = BoundToolPlan.project({"bad": bad, "good": good}, Mode.DAEMON, ["bad", "good"])
    async with SQLiteStore(tmp_path / "db") as store:
        executor = ToolAuthority(store=store)
        calls = [ToolUseBlock("1", "bad", {"a": 1}), ToolUseBlock("2", "good", {})]
        refused, ran = await executor.run_batch(plan, calls, ToolCallContext("s", "t", Mode.DAEMON))
    assert (refused.status, refused.reason) == ("refused", "schema_unusable")
    assert "gone" in refused.result.content
    assert (ran.status, ran.result.content) == ("ok", "ran")


def test_an_approval_is_bound_to_the_plan_the_tool_and_the_canonical_arguments() -> None:
    schema = {"type": "object"}
    tools = {"t": echo_tool("t", schema), "u": echo_tool("u", schema)}
    plan = BoundToolPlan.project(tools, Mode.DAEMON, ["t", "u"])
    other_plan = BoundToolPlan.project(tools, Mode.DAEMON, ["t"])
    base = approval_hash(plan, "t", {"a": 1, "b": [1, 2]})
    # Key order is not part of the call; anything else is.
    assert approval_hash(plan, "t", {"b": [1, 2], "a": 1}) == base
    assert approval_hash(plan, "t", {"a": 2, "b": [1, 2]}) != base
    assert approval_hash(plan, "u", {"a": 1, "b": [1, 2]}) != base
    assert approval_hash(other_plan, "t", {"a": 1, "b": [1, 2]}) != base
