"""Tool specs, the registry, and the runner the loop dispatches tool batches to."""

from geodebot.engine.tools.registry import (
    Effect,
    Safety,
    ToolCallContext,
    ToolPlan,
    ToolRegistry,
    ToolRunner,
    ToolSpec,
    builtin_registry,
)

__all__ = [
    "Effect",
    "Safety",
    "ToolCallContext",
    "ToolPlan",
    "ToolRegistry",
    "ToolRunner",
    "ToolSpec",
    "builtin_registry",
]
