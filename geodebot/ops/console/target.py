"""What a send into a thread would run with, before anything is sent: its project and
route, the model, the workspace, the system prompt's sources, and the tool plan a turn there
would get, with the reason for each listed tool that it would not.

The plan is projected with the engine's own ``BoundToolPlan.project`` from the same session
spec the chat router builds (``chat.commands.session_spec``) and the operator's switch as it
is now, so the page cannot drift from what a turn does. MCP tools are not resolved here (that
would start their servers for a page view): their declared policy is shown instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from geodebot.chat.commands import session_spec
from geodebot.config.schema import BindingConfig, Config
from geodebot.engine.modes import Mode
from geodebot.engine.session import COMPUTER_USE_SWITCH, time_budget
from geodebot.engine.tools.plan import COMPUTER, BoundToolPlan, allowlist_problems
from geodebot.engine.tools.spec import ToolSpec
from geodebot.ops.console.parts import ConsoleParts

MCP_PREFIX = "mcp__"
# Characters of an inline prompt source the panel shows.
PROMPT_SHOWN = 300


@dataclass(frozen=True, slots=True)
class PlannedTool:
    name: str
    safety: str
    effect: str
    # Who lets a call of it run: "runs unattended", "pre-approved", "approvers: ...", or
    # "refused: nobody may approve it here".
    decision: str
    source: str = "built-in"


@dataclass(frozen=True, slots=True)
class RefusedTool:
    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Target:
    project: str
    session: str
    key: str
    platform: str
    channel: str
    thread: str | None
    model: str
    fallbacks: tuple[str, ...]
    workspace: str
    prompt_sources: tuple[str, ...]
    time_budget_s: float
    tools: tuple[PlannedTool, ...]
    refused: tuple[RefusedTool, ...]
    approvers: tuple[str, ...]
    approval_timeout_s: float
    computer_use: bool
    plan_hash: str


def prompt_sources(config: Config) -> tuple[str, ...]:
    """The system prompt's declared sources, in order (every session of the daemon uses
    the same prompt)."""
    shown = []
    for source in config.prompt.sources:
        if source.file is not None:
            shown.append(f"file {config.prompt_file(source.file)}")
        else:
            text = source.text or ""
            head = text if len(text) <= PROMPT_SHOWN else text[:PROMPT_SHOWN] + "…"
            shown.append(f"text ({len(text)} characters): {head}")
    return tuple(shown)


async def target_of(parts: ConsoleParts, session_id: str, binding: BindingConfig) -> Target:
    config = parts.config
    spec = session_spec(session_id, binding)
    switch = await parts.store.get_switch(COMPUTER_USE_SWITCH)
    computer_use = switch is not None and switch.active(parts.clock())
    builtin = {
        name: found for name in spec.tools if (found := parts.registry.get(name)) is not None
    }
    plan = BoundToolPlan.project(
        builtin, Mode.DAEMON, spec.tools, preapproved=spec.preapproved, computer_use=computer_use
    )
    tools = [_planned(spec_, plan, binding) for spec_ in plan.tools.values()]
    refused: list[RefusedTool] = []
    problems = {
        p.partition(":")[0]: p.partition(": ")[2]
        for p in allowlist_problems(Mode.DAEMON, spec.tools, parts.registry.names())
    }
    for name in spec.tools:
        if name in plan.tools:
            continue
        if name.startswith(MCP_PREFIX):
            mcp = _mcp_tool(config, name, binding)
            if isinstance(mcp, PlannedTool):
                tools.append(mcp)
            else:
                refused.append(mcp)
        elif name == COMPUTER and name in builtin:
            refused.append(RefusedTool(name, "the operator's computer-use switch is off"))
        else:
            refused.append(RefusedTool(name, problems.get(name, "not available in this plan")))
    thread = session_id[len(binding.session) + 1 :] or None
    return Target(
        project=binding.project_name,
        session=session_id,
        key=f"{binding.platform}:{binding.channel}",
        platform=binding.platform,
        channel=binding.channel,
        thread=thread,
        model=f"{config.model.provider}/{config.model.name}",
        fallbacks=tuple(f"{f.provider}/{f.name}" for f in config.model.fallbacks),
        workspace=str(config.workspace),
        prompt_sources=prompt_sources(config),
        time_budget_s=time_budget(Mode.DAEMON, spec, config.budgets),
        tools=tuple(tools),
        refused=tuple(refused),
        approvers=binding.approvers,
        approval_timeout_s=binding.approval_timeout_s,
        computer_use=computer_use,
        plan_hash=plan.content_hash,
    )


def _decision(name: str, needs_approval: bool, preapproved: bool, binding: BindingConfig) -> str:
    if not needs_approval:
        return "runs unattended"
    if preapproved:
        return "pre-approved by the operator"
    if binding.approvers:
        return f"asks the approvers: {', '.join(binding.approvers)}"
    return "refused when called: it needs approval and nobody may approve it here"


def _planned(spec: ToolSpec, plan: BoundToolPlan, binding: BindingConfig) -> PlannedTool:
    decision = _decision(spec.name, spec.needs_approval, spec.name in plan.preapproved, binding)
    return PlannedTool(spec.name, spec.safety.value, spec.effect.value, decision)


def _mcp_tool(config: Config, name: str, binding: BindingConfig) -> PlannedTool | RefusedTool:
    """An MCP tool as its server's declared policy shows it (``mcp__<server>__<tool>``)."""
    server_name, _, tool_name = name.removeprefix(MCP_PREFIX).partition("__")
    server = next((s for s in config.mcp.servers if s.name == server_name), None)
    if server is None:
        return RefusedTool(name, f"no MCP server {server_name!r} in the config")
    policy = server.tools.get(tool_name)
    if policy is None:
        return RefusedTool(name, f"MCP server {server_name} declares no policy for {tool_name}")
    needs_approval = policy.safety != "read"
    decision = _decision(name, needs_approval, name in binding.preapproved, binding)
    return PlannedTool(name, policy.safety, policy.effect, decision, f"MCP server {server_name}")
