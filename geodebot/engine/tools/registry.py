"""The registry of every tool geodebot knows, and the always-harmless ``get_time``.

Knowing a tool grants nothing: a session can call only what its BoundToolPlan holds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from geodebot.engine.tools.spec import (
    Effect,
    Safety,
    ToolCallContext,
    ToolError,
    ToolSpec,
)

log = logging.getLogger(__name__)


class ToolRegistry:
    """Every tool geodebot knows. Knowing a tool grants nothing; the plan does."""

    def __init__(self, specs: Iterable[ToolSpec] = ()) -> None:
        self._specs: dict[str, ToolSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: ToolSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"tool {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def get(self, name: str) -> ToolSpec | None:
        return self._specs.get(name)

    def names(self) -> list[str]:
        return sorted(self._specs)


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
