"""geodebot as an MCP server: one tool, ``run_agent``, over stdio.

Every call is a one-shot HEADLESS turn in a fresh session. The engine is this process's own
(``build_app``: its own store handle, model clients and lanes), so the server needs no running
daemon and never talks to one. stdout carries the MCP protocol and nothing else: the SDK points
fd 1 at stderr while it serves, and logs go to stderr through the redacting handler.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from typing import Annotated, Any

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, TextContent
from pydantic import BeforeValidator, Field

from geodebot import __version__
from geodebot.app.build import App, build_app
from geodebot.app.secrets import build_redactor
from geodebot.config.schema import BudgetConfig, Config
from geodebot.engine.loop import new_id
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec, TurnResult
from geodebot.logs.setup import setup_logging

RUN_AGENT_DESCRIPTION = (
    "Run the geodebot agent once on a prompt, in a fresh session, and return its final answer. "
    "The agent has only the operator's headless tools: no shell, no delegation, no computer "
    "use, and nobody to approve anything, so only pre-approved writes can run. "
    "time_budget_s defaults to {default:g} s; more than {cap:g} s is capped."
)
# A cancelled run_agent call waits this long at most for its turn to record the cancellation.
_CANCEL_RECORD_S = 10.0


def _not_a_boolean(value: object) -> object:
    # JSON true is a bool, which pydantic would otherwise read as the number 1.
    if isinstance(value, bool):
        raise ValueError(f"time_budget_s must be a number of seconds, not {str(value).lower()}")
    return value


# Module-level because the SDK evaluates the tool's (string) annotations in module globals.
PromptArg = Annotated[str, Field(description="The task, self-contained: no memory is kept.")]
# Strict: a JSON number or null, not a string that looks like one.
BudgetArg = Annotated[
    Annotated[float, Field(strict=True)] | None,
    BeforeValidator(_not_a_boolean),
    Field(description="Seconds the run may take."),
]


def resolve_budget(requested: float | None, budgets: BudgetConfig) -> float:
    """The turn's time budget: the headless default, capped at the headless maximum."""
    budget = budgets.headless_time_s if requested is None else requested
    # JSON from an MCP client can carry NaN or Infinity, and asyncio.timeout(nan) never fires.
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError("time_budget_s must be a positive, finite number of seconds")
    return min(budget, budgets.headless_max_time_s)


def _result(text: str, *, error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=error)


def build_server(app: App) -> MCPServer:
    config = app.config
    redact = app.services.redactor.redact
    server: MCPServer = MCPServer(
        "geodebot",
        version=__version__,
        instructions="Call run_agent to hand a self-contained task to the geodebot agent.",
    )

    # Returns a CallToolResult rather than raising ToolError, which the SDK would prefix with
    # "Error executing tool run_agent: ": the client gets the turn's own text, unchanged.
    async def run_agent(prompt: PromptArg, time_budget_s: BudgetArg = None) -> CallToolResult:
        if not prompt.strip():
            return _result("prompt must not be empty", error=True)
        try:
            budget = resolve_budget(time_budget_s, config.budgets)
        except ValueError as exc:
            return _result(str(exc), error=True)
        spec = SessionSpec(
            new_id("mcp"),
            tools=config.tools.headless_tools,
            preapproved=config.tools.headless_preapproved,
            time_budget_s=budget,
        )
        result = await _run_cancellable(app.run_turn(Mode.HEADLESS, spec, prompt))
        if result.ok:
            return _result(result.text)
        # The turn's text is already meant for users; redacting again costs nothing and keeps
        # a key out of the client even if some error message ever quoted one.
        return _result(redact(result.text or f"the run ended with {result.outcome}"), error=True)

    description = RUN_AGENT_DESCRIPTION.format(
        default=config.budgets.headless_time_s, cap=config.budgets.headless_max_time_s
    )
    server.add_tool(run_agent, description=description)
    return server


async def _run_cancellable(turn: Coroutine[Any, Any, TurnResult]) -> TurnResult:
    """Run the turn in a task of its own, so that a client's ``notifications/cancelled``
    reaches it as one plain cancellation: the turn then records it on its timeline (see
    AgenticLoop._guarded). The SDK cancels this handler through an anyio cancel scope, which
    would cancel every await of that record again; the turn's task is outside that scope."""
    task = asyncio.create_task(turn)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_RECORD_S):
            await asyncio.wait({task})
        raise


async def serve_mcp(config: Config) -> None:
    """Serve ``run_agent`` on stdin/stdout until the client closes stdin."""
    # The CLI sets logging up; a bare caller must not get the SDK's own unredacted handler,
    # which MCPServer installs whenever the root logger has none.
    if not logging.getLogger().handlers:
        setup_logging(config.daemon.log_level, build_redactor(config), quiet=True)
    async with AsyncExitStack() as stack:
        app = await build_app(config, stack)
        await build_server(app).run_stdio_async()
