"""Tools for in-process tests: each leaves a line in a marker file, so a test can count runs."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from geodebot.engine.tools import (
    GET_TIME,
    CallClass,
    DataClass,
    Effect,
    Safety,
    ToolCallContext,
    ToolRegistry,
    ToolSpec,
)


def marker_tool(path: Path, name: str = "write_marker", safety: Safety = Safety.WRITE) -> ToolSpec:
    """A tool whose every run leaves a line in ``path``, so tests can count dispatches."""

    async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        with path.open("a", encoding="utf-8") as handle:
            handle.write(f"{name}:{arguments.get('text', '')}\n")
        return f"wrote {arguments.get('text', '')!r}"

    return ToolSpec(
        name=name,
        description="Append a line to the marker file.",
        input_schema={
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
            "additionalProperties": False,
        },
        safety=safety,
        effect=Effect.MUTATE,
        handler=handler,
    )


def hanging_tool() -> ToolSpec:
    async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        await asyncio.Event().wait()
        return "unreachable"

    return ToolSpec(
        name="wait_forever",
        description="Never returns.",
        input_schema={"type": "object", "properties": {}},
        safety=Safety.READ,
        effect=Effect.NONE,
        handler=handler,
        timeout_s=3600,
    )


def lookup_tool(marker: Path) -> ToolSpec:
    """A read tool whose data class depends on its argument, for rewrite-escalation tests."""

    def classify(arguments: Mapping[str, Any]) -> CallClass:
        topic = str(arguments.get("topic", ""))
        data = DataClass.PUBLIC if topic.startswith("public/") else DataClass.CONFIDENTIAL
        return CallClass(Safety.READ, data)

    async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        with marker.open("a", encoding="utf-8") as handle:
            # Escaped, so a topic holding a line break still leaves exactly one line.
            topic = str(arguments["topic"]).encode("unicode_escape").decode("ascii")
            handle.write(f"lookup:{topic}\n")
        return f"facts about {arguments['topic']}"

    return ToolSpec(
        name="lookup",
        description="Look up a topic.",
        input_schema={
            "type": "object",
            "properties": {"topic": {"type": "string"}},
            "required": ["topic"],
        },
        safety=Safety.READ,
        effect=Effect.NONE,
        handler=handler,
        data_class=DataClass.PUBLIC,
        classify=classify,
    )


def dying_tool(marker: Path) -> ToolSpec:
    """Acts (writes the marker), then the process dies before the call can be committed."""

    async def handler(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        with marker.open("a", encoding="utf-8") as handle:
            handle.write(f"write_and_die:{arguments.get('text', '')}\n")
        os.kill(os.getpid(), signal.SIGKILL)
        return "unreachable"

    return ToolSpec(
        name="write_and_die",
        description="Write the marker, then crash.",
        input_schema={"type": "object", "properties": {"text": {"type": "string"}}},
        safety=Safety.WRITE,
        effect=Effect.MUTATE,
        handler=handler,
    )


def marker_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def tool_registry(marker: Path) -> ToolRegistry:
    registry = ToolRegistry([GET_TIME])
    registry.register(marker_tool(marker))
    registry.register(marker_tool(marker, name="run_bash", safety=Safety.DANGEROUS))
    registry.register(hanging_tool())
    registry.register(lookup_tool(marker))
    registry.register(dying_tool(marker))
    registry.register(marker_tool(marker, name="computer", safety=Safety.DANGEROUS))
    return registry
