"""Compaction: older history is summarised by the model into an append-only summary record.

A channel session may live for years; its context must not grow without bound. When the
context nears the model's budget, everything except the most recent messages is replaced (in
what the model sees, never in the store) by a summary that records the seq range it covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from geodebot.engine.llm.types import (
    LLMAdapter,
    LLMRequest,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    canonical_json,
)

SUMMARY_PREFIX = "[Summary of the earlier conversation]\n"

_SUMMARY_SYSTEM = (
    "You compress a chat transcript into a faithful summary that another assistant will use "
    "as its memory. Keep decisions, facts, names, numbers, open tasks and user preferences. "
    "Drop pleasantries. Write plain prose or short bullet points, at most 400 words."
)

# Keeps any single message from dominating the summary request.
_MAX_CHARS_PER_ITEM = 2_000


@dataclass(frozen=True, slots=True)
class ContextItem:
    """A message as the model sees it, with where it came from in the store."""

    seq: int
    message: Message
    is_summary: bool = False
    # For a summary: the first seq it covers.
    covers_from: int | None = None
    # The message's canonical JSON, made once: every round measures and hashes the whole
    # context, and a long-lived session's context is long.
    canonical: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.canonical:
            object.__setattr__(self, "canonical", canonical_json(self.message.to_json()))


def estimate_tokens(items: Sequence[ContextItem], system: str = "") -> int:
    """A cheap, provider-independent estimate: about four characters per token."""
    return (len(system) + sum(len(item.canonical) for item in items)) // 4 + 1


def split_point(items: Sequence[ContextItem], keep_recent: int) -> int | None:
    """Index of the first item to keep verbatim, or None if nothing can be compacted.

    The kept part must start with a plain user message, so an assistant tool call is never
    separated from its results.
    """
    start = len(items) - keep_recent
    for index in range(min(start, len(items) - 1), 0, -1):
        item = items[index]
        if item.is_summary or item.message.role != "user":
            continue
        if any(isinstance(b, ToolResultBlock) for b in item.message.content):
            continue
        # Compacting a lone previous summary would gain nothing.
        if index == 1 and items[0].is_summary:
            return None
        return index
    return None


def render_transcript(items: Sequence[ContextItem]) -> str:
    lines: list[str] = []
    for item in items:
        role = "summary" if item.is_summary else item.message.role
        for block in item.message.content:
            if isinstance(block, TextBlock):
                text = block.text
            elif isinstance(block, ToolUseBlock):
                text = f"[called tool {block.name} with {canonical_json(dict(block.arguments))}]"
            else:
                flag = " (error)" if block.is_error else ""
                text = f"[tool result{flag}: {block.content}]"
            if len(text) > _MAX_CHARS_PER_ITEM:
                text = text[:_MAX_CHARS_PER_ITEM] + " [...]"
            lines.append(f"{role}: {text}")
    return "\n".join(lines)


async def summarise(llm: LLMAdapter, items: Sequence[ContextItem], max_tokens: int) -> str:
    transcript = render_transcript(items)
    request = LLMRequest(
        system=_SUMMARY_SYSTEM,
        messages=(Message.user_text("Summarise this transcript:\n\n" + transcript),),
        max_tokens=min(max_tokens, 2048),
    )
    response = await llm.complete(request)
    return response.message.text.strip()


def summary_message(text: str) -> Message:
    return Message.user_text(SUMMARY_PREFIX + text)
