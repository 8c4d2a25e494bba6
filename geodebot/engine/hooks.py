"""Hooks: decision hooks that may change what happens, observers that may only watch.

Decision hooks answer PreToolUse (allow / block / rewrite / ask), PostToolUse (allow /
add context / withhold) and Stop (accept / repair / reject, for the verify step). A decision
hook that fails, times out or answers nonsense *fails closed*: PreToolUse blocks, PostToolUse
withholds, Stop rejects. Observers get lifecycle events and never decide; their failures are
logged and ignored.

Operators declare command hooks in the config: an executable gets the event as JSON on stdin
and answers one JSON object on stdout. Python plugins register through the entry-point group
``geodebot.hooks`` (each entry point is a callable returning a hook or a list of hooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Literal, Protocol

from geodebot.config.schema import HookConfig
from geodebot.engine.verify import Verdict, VerifyContext

log = logging.getLogger(__name__)

HookEvent = Literal["PreToolUse", "PostToolUse", "Stop"]
ENTRY_POINT_GROUP = "geodebot.hooks"
MAX_HOOK_OUTPUT = 64 * 1024


@dataclass(frozen=True, slots=True)
class HookDecision:
    action: str
    reason: str = ""
    arguments: Mapping[str, Any] | None = None  # PreToolUse rewrite
    context: str | None = None  # PostToolUse add_context
    instruction: str | None = None  # Stop repair


class DecisionHook(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def event(self) -> HookEvent: ...

    @property
    def tools(self) -> frozenset[str]:
        """Tool names this hook applies to; empty means every tool."""

    async def decide(self, payload: Mapping[str, Any]) -> HookDecision: ...


_VALID: dict[str, frozenset[str]] = {
    "PreToolUse": frozenset({"allow", "block", "rewrite", "ask"}),
    "PostToolUse": frozenset({"allow", "add_context", "withhold"}),
    "Stop": frozenset({"accept", "repair", "reject"}),
}
_FAIL_CLOSED: dict[str, str] = {"PreToolUse": "block", "PostToolUse": "withhold", "Stop": "reject"}


def fail_closed(event: HookEvent, reason: str) -> HookDecision:
    return HookDecision(_FAIL_CLOSED[event], reason=reason)


def parse_decision(event: HookEvent, raw: Any) -> HookDecision:
    """A hook's JSON answer, or a fail-closed decision saying what was wrong with it."""
    if not isinstance(raw, dict):
        return fail_closed(event, "hook answered something other than a JSON object")
    action = raw.get("decision")
    if action not in _VALID[event]:
        return fail_closed(event, f"hook answered an unknown decision {action!r}")
    reason = raw.get("reason", "")
    arguments = raw.get("arguments")
    if action == "rewrite" and not isinstance(arguments, dict):
        return fail_closed(event, "hook asked for a rewrite without an arguments object")
    context, instruction = raw.get("context"), raw.get("instruction")
    return HookDecision(
        action=str(action),
        reason=str(reason)[:500],
        arguments=arguments if isinstance(arguments, dict) else None,
        context=str(context)[:8000] if context is not None else None,
        instruction=str(instruction)[:2000] if instruction is not None else None,
    )


@dataclass(frozen=True, slots=True)
class CommandHook:
    name: str
    event: HookEvent
    command: tuple[str, ...]
    tools: frozenset[str] = frozenset()
    timeout_s: float = 10.0
    # Hooks get a minimal environment: the daemon's holds API keys.
    env: Mapping[str, str] = field(
        default_factory=lambda: {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    )

    @staticmethod
    def from_config(index: int, config: HookConfig) -> CommandHook:
        return CommandHook(
            name=f"hooks.{index}:{os.path.basename(config.command[0])}",
            event=config.event,
            command=config.command,
            tools=frozenset(config.tools),
            timeout_s=config.timeout_s,
        )

    async def decide(self, payload: Mapping[str, Any]) -> HookDecision:
        data = json.dumps(payload, ensure_ascii=False, default=str).encode()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env=dict(self.env),
                start_new_session=True,
            )
        except OSError as exc:
            return fail_closed(self.event, f"hook {self.name} could not start: {exc.strerror}")
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await self._exchange(proc, data)
        except TimeoutError:
            return fail_closed(self.event, f"hook {self.name} timed out after {self.timeout_s:g} s")
        except _TooLarge:
            return fail_closed(self.event, f"hook {self.name} answered more than 64 KiB")
        finally:
            await _reap(proc)
        if proc.returncode != 0:
            return fail_closed(self.event, f"hook {self.name} exited with {proc.returncode}")
        try:
            raw = json.loads(out)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return fail_closed(self.event, f"hook {self.name} did not answer JSON")
        return parse_decision(self.event, raw)

    async def _exchange(self, proc: asyncio.subprocess.Process, data: bytes) -> bytes:
        assert proc.stdin is not None
        assert proc.stdout is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()
        out = await proc.stdout.read(MAX_HOOK_OUTPUT + 1)
        if len(out) > MAX_HOOK_OUTPUT:
            raise _TooLarge
        await proc.wait()
        return out


class _TooLarge(Exception):
    pass


async def _reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()


@dataclass(frozen=True, slots=True)
class PreToolOutcome:
    blocked: str | None = None
    arguments: Mapping[str, Any] | None = None
    ask: str | None = None


@dataclass(frozen=True, slots=True)
class PostToolOutcome:
    context: tuple[str, ...] = ()
    withheld: str | None = None


class HookRegistry:
    def __init__(self, hooks: Iterable[DecisionHook] = ()) -> None:
        self._hooks: list[DecisionHook] = list(hooks)

    def add(self, hook: DecisionHook) -> None:
        self._hooks.append(hook)

    def _for(self, event: HookEvent, tool: str | None) -> list[DecisionHook]:
        return [
            h
            for h in self._hooks
            if h.event == event and (tool is None or not h.tools or tool in h.tools)
        ]

    async def decide(self, hook: DecisionHook, payload: Mapping[str, Any]) -> HookDecision:
        try:
            decision = await hook.decide(payload)
        except Exception as exc:
            log.exception("hook %s failed", hook.name)
            return fail_closed(hook.event, f"hook {hook.name} raised {type(exc).__name__}")
        if decision.action not in _VALID[hook.event]:
            return fail_closed(hook.event, f"hook {hook.name} answered {decision.action!r}")
        return decision

    async def pre_tool_use(self, payload: Mapping[str, Any]) -> PreToolOutcome:
        """Hooks run in order; a block ends it, a rewrite is seen by the hooks after it."""
        tool = str(payload.get("tool"))
        current = dict(payload)
        rewritten: Mapping[str, Any] | None = None
        ask: str | None = None
        for hook in self._for("PreToolUse", tool):
            decision = await self.decide(hook, current)
            if decision.action == "block":
                return PreToolOutcome(blocked=decision.reason or f"blocked by hook {hook.name}")
            if decision.action == "rewrite" and decision.arguments is not None:
                rewritten = decision.arguments
                current["arguments"] = dict(rewritten)
            elif decision.action == "ask":
                ask = decision.reason or f"hook {hook.name} asks for approval"
        return PreToolOutcome(arguments=rewritten, ask=ask)

    async def post_tool_use(self, payload: Mapping[str, Any]) -> PostToolOutcome:
        tool = str(payload.get("tool"))
        context: list[str] = []
        for hook in self._for("PostToolUse", tool):
            decision = await self.decide(hook, payload)
            if decision.action == "withhold":
                return PostToolOutcome(tuple(context), decision.reason or "withheld by a hook")
            if decision.action == "add_context" and decision.context:
                context.append(decision.context)
        return PostToolOutcome(tuple(context))

    def stop_verifier(self) -> StopHookVerifier | None:
        hooks = self._for("Stop", None)
        return StopHookVerifier(hooks, self) if hooks else None


class StopHookVerifier:
    """Stop hooks as a step of the verify phase (the loop owns the repair budget)."""

    name = "stop_hooks"

    def __init__(self, hooks: Sequence[DecisionHook], registry: HookRegistry) -> None:
        self._hooks = list(hooks)
        self._registry = registry

    async def verify(self, ctx: VerifyContext) -> Verdict:
        payload = {
            "event": "Stop",
            "session": ctx.session_id,
            "turn": ctx.turn_id,
            "user_message": ctx.user_message,
            "answer": ctx.answer,
            "round": ctx.round,
        }
        for hook in self._hooks:
            decision = await self._registry.decide(hook, payload)
            if decision.action == "repair":
                return Verdict(
                    False,
                    decision.reason or f"hook {hook.name} asked for a repair",
                    repair=decision.instruction or decision.reason or "Please revise your answer.",
                )
            if decision.action == "reject":
                return Verdict(False, decision.reason or f"hook {hook.name} rejected the answer")
        return Verdict.accept()


def hooks_from_config(configs: Sequence[HookConfig]) -> list[DecisionHook]:
    return [CommandHook.from_config(i, c) for i, c in enumerate(configs)]


def hooks_from_entry_points(group: str = ENTRY_POINT_GROUP) -> list[DecisionHook]:
    """Python plugins. A plugin that fails to load is an error at startup, not a silent gap."""
    found: list[DecisionHook] = []
    for ep in entry_points(group=group):
        loaded = ep.load()()
        found.extend(loaded if isinstance(loaded, list | tuple) else [loaded])
    return found
