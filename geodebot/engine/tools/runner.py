"""The port the loop dispatches tool batches to, and what it gets back for each call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from geodebot.engine.llm.types import ToolResultBlock, ToolUseBlock
from geodebot.engine.tools.plan import BoundToolPlan
from geodebot.engine.tools.spec import ToolCallContext

OutcomeStatus = Literal["ok", "error", "refused", "replayed", "uncertain"]
# Every ``ToolOutcome.reason`` the authority pipeline gives: a closed set, so metrics can use
# it as a label.
REASON_CODES = frozenset(
    {
        "not_in_plan",
        "denied_by_mode",
        "invalid_arguments",
        "schema_unusable",
        "rewrite_escalates",
        "blocked_by_hook",
        "approval_denied",
        "approval_expired",
        "needs_approval",
        "receipt_uncertain",
        "deadline",
        "outcome_unknown",
        "tool_error",
        "crashed",
        "replay",
    }
)


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """One call's fate. ``result`` is what the model sees; the rest goes on the timeline."""

    call: ToolUseBlock
    result: ToolResultBlock
    status: OutcomeStatus
    # Why it was refused or failed: a stable code such as "not_in_plan" or "needs_approval".
    reason: str | None = None
    receipt_id: str | None = None
    approved: bool | None = None
    # The person's decision (an approval request's id), when one was asked for, and who
    # made it ("expired": nobody, in time).
    approval_id: str | None = None
    decided_by: str | None = None

    def timeline(self) -> dict[str, object]:
        return {
            "tool": self.call.name,
            "call_id": self.call.id,
            "status": self.status,
            "reason": self.reason,
            "receipt": self.receipt_id,
            "approved": self.approved,
            "approval": self.approval_id,
            "decided_by": self.decided_by,
            "result_chars": len(self.result.content),
        }


class ToolRunner(Protocol):
    """Answers every call of one proposed batch with exactly one outcome, in order."""

    async def run_batch(
        self, plan: BoundToolPlan, calls: Sequence[ToolUseBlock], ctx: ToolCallContext
    ) -> list[ToolOutcome]: ...
