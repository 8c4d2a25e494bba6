"""Tool specs, the registry, the bound plan, and the runner port the loop dispatches to."""

from geodebot.engine.tools.registry import (
    PlanToolRunner,
    ToolPlan,
    ToolRegistry,
    ToolRunner,
    builtin_registry,
)
from geodebot.engine.tools.spec import (
    CallClass,
    DataClass,
    Effect,
    Safety,
    ToolCallContext,
    ToolError,
    ToolSpec,
)

__all__ = [
    "CallClass",
    "DataClass",
    "Effect",
    "PlanToolRunner",
    "Safety",
    "ToolCallContext",
    "ToolError",
    "ToolPlan",
    "ToolRegistry",
    "ToolRunner",
    "ToolSpec",
    "builtin_registry",
]
