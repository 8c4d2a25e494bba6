from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App, build_app
from geodebot.config.schema import Config, parse_config
from geodebot.engine.session import Observer
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
from tests.fakes.llm_server import FakeLLMServer

TEST_KEY_ENV = "GEODEBOT_TEST_API_KEY"
TEST_KEY = "sk-test-8c1f0e2b7d9a4b3c5e6f7a8b9c0d1e2f"


@pytest.fixture(autouse=True)
def _api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_KEY_ENV, TEST_KEY)
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)


@pytest.fixture
async def llm_server() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


def make_config(
    tmp_path: Path,
    server: FakeLLMServer,
    *,
    provider: str = "anthropic",
    model: Mapping[str, Any] | None = None,
    budgets: Mapping[str, Any] | None = None,
) -> Config:
    base_url = server.url if provider == "anthropic" else server.openai_base_url
    data: dict[str, Any] = {
        "daemon": {"state_dir": str(tmp_path / "var")},
        "model": {
            "provider": provider,
            "name": "model-under-test-1",
            "base_url": base_url,
            "api_key_env": TEST_KEY_ENV,
            "max_retries": 0,
            "max_retry_wait_s": 1,
            "request_timeout_s": 30,
            **(model or {}),
        },
        "budgets": dict(budgets or {}),
        # Only tools the test registry has; the defaults name built-ins it leaves out.
        "tools": {"ipc_tools": ["get_time"], "headless_tools": ["get_time"]},
    }
    return parse_config(data)


def with_sections(config: Config, **sections: Any) -> Config:
    """The same config with whole top-level sections replaced."""
    data = config.model_dump(mode="json", exclude={"source"})
    data.update(sections)
    return parse_config(data)


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


async def open_app(
    config: Config,
    stack: AsyncExitStack,
    marker: Path,
    observers: tuple[Observer, ...] = (),
) -> App:
    return await build_app(config, stack, registry=tool_registry(marker), observers=observers)
