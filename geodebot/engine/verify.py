"""The verify step: a stop proposal becomes a completion only if every verifier agrees.

A verifier may ask for a repair (an instruction the model gets as the next user message);
the loop grants at most ``repair_budget`` repairs per turn. A verifier that raises fails
closed: the answer is not accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VerifyContext:
    session_id: str
    turn_id: str
    user_message: str
    answer: str
    round: int


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    reason: str = ""
    # What the model is told to fix; None means the failure cannot be repaired.
    repair: str | None = None

    @staticmethod
    def accept() -> Verdict:
        return Verdict(True)


class Verifier(Protocol):
    name: str

    async def verify(self, ctx: VerifyContext) -> Verdict: ...


class NonEmptyAnswer:
    """An empty reply is never a completion: chat users would see nothing at all."""

    name = "non_empty_answer"

    async def verify(self, ctx: VerifyContext) -> Verdict:
        if ctx.answer.strip():
            return Verdict.accept()
        return Verdict(
            False,
            "the answer was empty",
            repair="Your last reply was empty. Reply to the user's message with a short answer.",
        )


async def run_verifiers(verifiers: Sequence[Verifier], ctx: VerifyContext) -> tuple[str, Verdict]:
    """The first failing verifier's name and verdict, or ("", accept)."""
    for verifier in verifiers:
        try:
            verdict = await verifier.verify(ctx)
        except Exception as exc:
            log.exception("verifier %s failed", verifier.name)
            return verifier.name, Verdict(False, f"verifier raised {type(exc).__name__}")
        if not verdict.ok:
            return verifier.name, verdict
    return "", Verdict.accept()
