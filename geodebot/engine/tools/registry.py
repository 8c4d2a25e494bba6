"""Tool specs, the registry, the immutable per-session plan, and the minimal runner.

The plan is deny-by-default: a tool is callable in a session only if it is registered, on the
session's allowlist, and not denied by the mode. An empty allowlist means no tools. The
runner answers everything outside the plan, and every malformed call, with an error result
instead of dispatching it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import jsonschema

from geodebot.engine.llm.types import ToolResultBlock, ToolSchema, ToolUseBlock, canonical_json
from geodebot.engine.modes import Mode, denied_tools
from geodebot.engine.tools.spec import (
    Effect,
    Safety,
    ToolCallContext,
    ToolError,
    ToolSpec,
)

log = logging.getLogger(__name__)

MAX_RESULT_CHARS = 32_000


class ToolRegistry:
    """Every tool geodebot knows. Knowing a tool grants nothing; the plan does."""

    def __init__(self, specs: Iterable[ToolSpec] = ()) -> None:
        self._specs: dict[str, ToolSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: ToolSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"tool {spec.name!r} is already registered")
        jsonschema.Draft202012Validator.check_schema(dict(spec.input_schema))
        self._specs[spec.name] = spec

    def get(self, name: str) -> ToolSpec | None:
        return self._specs.get(name)

    def names(self) -> list[str]:
        return sorted(self._specs)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The immutable set of tools one session may see and call."""

    tools: Mapping[str, ToolSpec]
    generation: int
    content_hash: str

    @staticmethod
    def project(
        registry: ToolRegistry, mode: Mode, allowlist: Iterable[str], *, generation: int = 1
    ) -> ToolPlan:
        deny = denied_tools(mode)
        chosen: dict[str, ToolSpec] = {}
        for name in sorted(set(allowlist)):
            spec = registry.get(name)
            if spec is None or name in deny:
                continue
            chosen[name] = spec
        digest = hashlib.sha256(
            canonical_json([s.fingerprint() for s in chosen.values()]).encode()
        ).hexdigest()
        return ToolPlan(MappingProxyType(chosen), generation, digest)

    @staticmethod
    def empty() -> ToolPlan:
        return ToolPlan(MappingProxyType({}), 0, hashlib.sha256(b"[]").hexdigest())

    def schemas(self) -> tuple[ToolSchema, ...]:
        return tuple(spec.schema() for spec in self.tools.values())


class ToolRunner(Protocol):
    """Runs one proposed batch and answers every call with exactly one result, in order."""

    async def run_batch(
        self, plan: ToolPlan, calls: Sequence[ToolUseBlock], ctx: ToolCallContext
    ) -> list[ToolResultBlock]: ...


class PlanToolRunner:
    """Deny-by-default dispatch: plan membership, argument validation, deadline.

    The full authority pipeline (hooks, approvals, effect receipts, locks) replaces this
    behind the same :class:`ToolRunner` port.
    """

    async def run_batch(
        self, plan: ToolPlan, calls: Sequence[ToolUseBlock], ctx: ToolCallContext
    ) -> list[ToolResultBlock]:
        return [await self._run_one(plan, call, ctx) for call in calls]

    async def _run_one(
        self, plan: ToolPlan, call: ToolUseBlock, ctx: ToolCallContext
    ) -> ToolResultBlock:
        spec = plan.tools.get(call.name)
        if spec is None:
            return _error(call, f"tool {call.name!r} is not available in this session")
        if call.arguments_error is not None:
            return _error(call, f"invalid arguments: {call.arguments_error}")
        problems = _schema_problems(spec, call.arguments)
        if problems:
            return _error(call, "invalid arguments: " + "; ".join(problems))
        try:
            async with asyncio.timeout(spec.timeout_s):
                text = await spec.handler(call.arguments, ctx)
        except TimeoutError:
            return _error(call, f"tool {spec.name} did not finish within {spec.timeout_s:g} s")
        except ToolError as exc:
            return _error(call, str(exc))
        except Exception as exc:
            log.exception("tool %s failed", spec.name)
            return _error(call, f"tool {spec.name} failed: {type(exc).__name__}")
        if len(text) > MAX_RESULT_CHARS:
            text = text[:MAX_RESULT_CHARS] + f"\n[truncated {len(text) - MAX_RESULT_CHARS} chars]"
        return ToolResultBlock(call.id, text)


def _error(call: ToolUseBlock, message: str) -> ToolResultBlock:
    return ToolResultBlock(call.id, message, is_error=True)


def _schema_problems(spec: ToolSpec, arguments: Mapping[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(dict(spec.input_schema))
    problems = []
    for err in validator.iter_errors(dict(arguments)):
        where = "/".join(str(p) for p in err.absolute_path) or "arguments"
        problems.append(f"{where}: {err.message[:200]}")
        if len(problems) >= 5:
            break
    return problems


async def _get_time(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
    tz_name = arguments.get("timezone", "UTC")
    try:
        tz = UTC if tz_name == "UTC" else ZoneInfo(str(tz_name))
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ToolError(f"unknown timezone {tz_name!r}") from exc
    return json.dumps({"now": datetime.now(tz).isoformat(timespec="seconds"), "timezone": tz_name})


GET_TIME = ToolSpec(
    name="get_time",
    description="Current date and time, in UTC or an IANA timezone such as Europe/Berlin.",
    input_schema={
        "type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 64}},
        "additionalProperties": False,
    },
    safety=Safety.READ,
    effect=Effect.NONE,
    handler=_get_time,
    timeout_s=5.0,
)


def builtin_registry() -> ToolRegistry:
    return ToolRegistry([GET_TIME])
