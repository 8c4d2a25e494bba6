"""Tool specs, the registry, the bound plan, and the runner port the loop dispatches to."""

from geodebot.engine.tools.plan import BoundToolPlan
from geodebot.engine.tools.registry import GET_TIME, ToolRegistry
from geodebot.engine.tools.runner import ToolOutcome, ToolRunner
from geodebot.engine.tools.spec import (
    ApprovalRequest,
    Approver,
    CallClass,
    DataClass,
    Effect,
    Safety,
    ToolCallContext,
    ToolError,
    ToolSpec,
)

__all__ = [
    "GET_TIME",
    "ApprovalRequest",
    "Approver",
    "BoundToolPlan",
    "CallClass",
    "DataClass",
    "Effect",
    "Safety",
    "ToolCallContext",
    "ToolError",
    "ToolOutcome",
    "ToolRegistry",
    "ToolRunner",
    "ToolSpec",
]
