"""Tool faults on a live daemon: an MCP server that crashes mid-call, one that hangs, and a
command hook that hangs. Each ends within its time budget with a clear error for the model
(which the user's reply is built from), and the next message is answered normally."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.llm_server import Call, Reply
from tests.support.telegram_world import TelegramWorld, shut_down

ROOT = Path(__file__).resolve().parents[2]
MCP_TOOLS = ("crash", "hang", "freeze", "echo")
MCP_SERVER = (
    '[[mcp.servers]]\nname = "fake"\n'
    f"command = [{sys.executable!r}, '-m', 'tests.support.fakes.mcp_tools_server']\n"
    'env = ["PYTHONPATH"]\nprobe_timeout_s = 1\n'
    + "".join(
        f'[mcp.servers.tools.{tool}]\nsafety = "read"\neffect = "none"\n'
        + ("timeout_s = 1\n" if tool in ("hang", "freeze") else "")
        for tool in MCP_TOOLS
    )
)


def tool_results(world: TelegramWorld, index: int) -> list[dict[str, Any]]:
    """The tool_result blocks the model was given in request ``index``."""
    content = world.llm.requests[index].json["messages"][-1]["content"]
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


def result_text(block: dict[str, Any]) -> str:
    content = block["content"]
    return content if isinstance(content, str) else json.dumps(content)


async def test_mcp_server_crash_and_hang_end_in_clear_tool_errors(tg: TelegramWorld) -> None:
    tg.env["PYTHONPATH"] = str(ROOT)
    tg.llm.script(
        Reply(tool_calls=[Call("mcp__fake__crash", {}, id="c1")]),
        Reply("the crash tool broke"),
        Reply(tool_calls=[Call("mcp__fake__hang", {}, id="h1")]),
        Reply("the hang tool timed out"),
        Reply(tool_calls=[Call("mcp__fake__freeze", {}, id="f1")]),
        Reply("the server froze"),
        Reply(tool_calls=[Call("mcp__fake__echo", {"text": "alive again"}, id="e1")]),
        Reply("echo works"),
    )
    tools = ", ".join(f'"mcp__fake__{tool}"' for tool in MCP_TOOLS)
    daemon = await tg.start(binding=f"tools = [{tools}]", extra=MCP_SERVER)
    try:
        asks = ("crash it", "hang it", "freeze it", "echo something")
        for n, text in enumerate(asks, start=1):
            tg.ask(text)
            await tg.replies(n)
        await tg.control()
    finally:
        await shut_down(daemon)
    assert tg.texts() == [
        "the crash tool broke",
        "the hang tool timed out",
        "the server froze",
        "echo works",
        CONTROL_ANSWER,
    ]
    [crashed] = tool_results(tg, 1)
    assert crashed["is_error"] is True
    assert "went away during the call" in result_text(crashed)
    [hung] = tool_results(tg, 3)
    assert hung["is_error"] is True
    assert "did not finish within 1 s" in result_text(hung)
    # A wedged server (its event loop blocked) is cut off the same way.
    [frozen] = tool_results(tg, 5)
    assert frozen["is_error"] is True
    assert "did not finish within 1 s" in result_text(frozen)
    # The crashed, then wedged server was started again for the next call.
    [echoed] = tool_results(tg, 7)
    assert not echoed.get("is_error")
    assert "alive again" in result_text(echoed)


def hook_script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "hook.py"
    path.write_text("import json, sys, time\nevent = json.load(sys.stdin)\n" + body)
    return f"command = [{sys.executable!r}, {str(path)!r}]\ntimeout_s = 1\n"


async def test_hanging_hooks_are_cut_off_and_the_next_message_answered(tg: TelegramWorld) -> None:
    # PreToolUse hangs for get_time; Stop hangs for an answer that mentions "slow".
    pre = hook_script(tg.tmp_path, "time.sleep(3600)\n")
    stop_path = tg.tmp_path / "stop"
    stop_path.mkdir()
    stop = hook_script(
        stop_path,
        "if 'slow' in event['answer']:\n    time.sleep(3600)\n"
        "print(json.dumps({'decision': 'accept'}))\n",
    )
    hooks = (
        f'[[hooks]]\nevent = "PreToolUse"\ntools = ["get_time"]\n{pre}'
        f'[[hooks]]\nevent = "Stop"\n{stop}'
    )
    tg.llm.script(
        Reply(tool_calls=[Call("get_time", {}, id="t1")]),
        Reply("I could not read the clock"),
        Reply("a slow answer"),
        Reply("a quick answer"),
    )
    daemon = await tg.start(binding='tools = ["get_time"]', extra=hooks)
    try:
        for n, text in enumerate(("what time is it?", "take your time", "and now?"), start=1):
            tg.ask(text)
            await tg.replies(n)
        await tg.control()
    finally:
        await shut_down(daemon)
    blocked, rejected, normal, control = tg.texts()
    assert control == CONTROL_ANSWER
    [result] = tool_results(tg, 1)
    assert result["is_error"] is True
    assert "timed out after 1 s" in result_text(result)
    # A hook that cannot decide blocks the call, and geodebot says so under the answer.
    assert blocked == (
        "I could not read the clock\n\n(Not allowed here, so not run: <code>get_time</code>.)"
    )
    assert "could not finish this request" in rejected
    assert "timed out after 1 s" in rejected
    assert normal == "a quick answer"
