"""Computer use end to end: a DAEMON session drives a real Xvfb display through the desktop
agent when the operator switch is on and the binding lists (and pre-approves) `computer`;
screenshots reach the model as images; otherwise the call is refused and nothing moves."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App, build_app
from geodebot.engine.compaction import IMAGE_DROPPED
from geodebot.engine.modes import Mode
from geodebot.engine.session import COMPUTER_USE_SWITCH, SessionSpec
from tests.support.config import make_config, with_sections
from tests.support.desktop import Desktop, running_desktop
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply

ALLOWED = SessionSpec("desk", tools=("computer",), preapproved=("computer",))


@pytest.fixture
async def desktop() -> AsyncIterator[Desktop]:
    async with running_desktop() as running:
        yield running


@pytest.fixture
async def app(tmp_path: Path, llm_server: FakeLLMServer, desktop: Desktop) -> AsyncIterator[App]:
    config = with_sections(
        make_config(tmp_path, llm_server),
        tools={
            "workspace": str(tmp_path / "ws"),
            "computer_socket": str(desktop.socket),
            "ipc_tools": [],
            "headless_tools": [],
        },
    )
    async with AsyncExitStack() as stack:
        yield await build_app(config, stack)


def computer(action: dict[str, Any], call_id: str) -> Reply:
    return Reply(tool_calls=[Call("computer", {"action": action}, id=call_id)])


def tool_results(body: Any) -> list[dict[str, Any]]:
    found = []
    for message in body["messages"]:
        if isinstance(message["content"], list):
            found += [b for b in message["content"] if b.get("type") == "tool_result"]
    return found


def images_in(result: dict[str, Any]) -> list[dict[str, Any]]:
    content = result["content"]
    return [b for b in content if b.get("type") == "image"] if isinstance(content, list) else []


async def switch(app: App, on: bool, expires_in_s: float | None = 3600) -> None:
    expires = None if expires_in_s is None else time.time() + expires_in_s
    await app.services.store.set_switch(
        COMPUTER_USE_SWITCH, on, by="ops", expires_at=expires, reason="test"
    )


async def test_screenshots_reach_the_model_and_clicks_reach_the_display(
    app: App, llm_server: FakeLLMServer, desktop: Desktop
) -> None:
    await switch(app, True)
    llm_server.script(
        computer({"type": "screenshot"}, "s1"),
        computer({"type": "click", "x": 100, "y": 50}, "c1"),
        computer({"type": "screenshot"}, "s2"),
        Reply("clicked it"),
    )
    result = await app.run_turn(Mode.DAEMON, ALLOWED, "click the thing")
    assert result.ok, result
    assert await desktop.ask(op="cursor_position") == {"ok": True, "x": 100, "y": 50}

    after_first, _, after_second = (r.json for r in llm_server.requests[1:4])
    [shot] = images_in(tool_results(after_first)[-1])
    assert shot["source"]["media_type"] == "image/png"
    assert shot["source"]["type"] == "base64"
    # Only the newest screenshot is sent again; the older one leaves a note.
    results = tool_results(after_second)
    assert [len(images_in(r)) for r in results] == [0, 0, 1]
    assert IMAGE_DROPPED in json.dumps(results[0])
    assert "click at (100, 50) done" in json.dumps(results[1])


@pytest.mark.parametrize(
    ("state", "spec"),
    [
        ("off", ALLOWED),
        ("expired", ALLOWED),
        ("on", SessionSpec("desk", tools=(), preapproved=())),
        ("on", SessionSpec("desk", tools=("computer",), preapproved=())),
    ],
)
async def test_without_switch_listing_and_preapproval_nothing_happens(
    app: App, llm_server: FakeLLMServer, desktop: Desktop, state: str, spec: SessionSpec
) -> None:
    if state != "off":
        await switch(app, True, expires_in_s=-1 if state == "expired" else 3600)
    assert await desktop.ask(op="click", x=7, y=8) == {"ok": True}
    llm_server.script(computer({"type": "click", "x": 300, "y": 300}, "c1"), Reply("could not"))
    result = await app.run_turn(Mode.DAEMON, spec, "click")
    assert result.ok, result
    [refused] = tool_results(llm_server.requests[1].json)
    assert refused["is_error"] is True
    assert "refused" in json.dumps(refused)
    assert await desktop.ask(op="cursor_position") == {"ok": True, "x": 7, "y": 8}


async def test_a_missing_agent_is_a_clear_tool_error(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    config = with_sections(
        make_config(tmp_path, llm_server),
        tools={"computer_socket": str(tmp_path / "nobody.sock"), "ipc_tools": []},
    )
    async with AsyncExitStack() as stack:
        app = await build_app(config, stack)
        await switch(app, True)
        llm_server.script(computer({"type": "screenshot"}, "s1"), Reply("no desktop"))
        assert (await app.run_turn(Mode.DAEMON, ALLOWED, "look")).ok
    [error] = tool_results(llm_server.requests[1].json)
    assert error["is_error"] is True
    assert "desktop agent is not reachable" in json.dumps(error)


def test_openai_gets_tool_images_in_a_user_message_after_the_tool_results() -> None:
    from geodebot.engine.llm.openai_adapter import to_openai_messages
    from geodebot.engine.llm.types import (
        ImageData,
        Message,
        TextBlock,
        ToolResultBlock,
        ToolUseBlock,
    )

    shot = ImageData("image/png", "iVBORw0KGgo=")
    messages = [
        Message("user", (TextBlock("look"),)),
        Message("assistant", (ToolUseBlock("t1", "computer", {"action": {"type": "screenshot"}}),)),
        Message("user", (ToolResultBlock("t1", "screenshot, 640x480", images=(shot,)),)),
    ]
    out = to_openai_messages("", messages)
    tool, user = out[-2], out[-1]
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": "screenshot, 640x480"}
    assert user["role"] == "user"
    parts = list(user["content"])
    assert parts[1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
    }
