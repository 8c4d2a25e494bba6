"""What geodebot itself says in a chat, and the reply row that carries it.

Every text here is said by geodebot, not by the model: a notice, a refusal line, a failure.
Kept in one place so the words a user sees can be read (and reviewed) together.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Literal

from geodebot.engine.session import TurnResult
from geodebot.store.records import InboxRow, NewOutbound

FinishStatus = Literal["done", "failed", "dropped"]

STORE_FAILURE_TEXT = "geodebot could not save this conversation, so it stopped the turn."
INTERNAL_FAILURE_TEXT = "Something went wrong inside geodebot; the turn was stopped."
STOPPED_TEXT = "Stopped, as asked."
VOICE_UNAVAILABLE_TEXT = (
    "I could not listen to your voice note: the transcription service is unavailable. "
    "It is kept, and will be answered once the service is back."
)
BUSY_TEXT = "I am still working on earlier messages here; please send this again in a moment."
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def throttle_notice(wait_s: float) -> str:
    return (
        "You are sending messages faster than I take them here, so I am skipping "
        f"them for now; try again in about {max(1, math.ceil(wait_s))} s."
    )


def reply_to(row: InboxRow, text: str, *, kind: str = "reply") -> NewOutbound:
    """The reply to an inbox row: in its chat and thread, answering its message."""
    return NewOutbound(
        session_id=row.session_id,
        platform=row.platform,
        channel=row.channel,
        thread=row.thread,
        reply_to=row.message_id,
        text=text,
        kind=kind,
    )


def files_refused(refused: Sequence[tuple[str, str]]) -> str:
    """The notice for files of a message that were not passed on: (name, why) each. Names
    are the sender's own, shown as code so they cannot format the message."""
    lines = ["- `" + name.replace("`", "'") + f"`: {why}" for name, why in refused]
    return "Not everything you sent was passed on:\n" + "\n".join(lines)


def closing(result: TurnResult) -> tuple[FinishStatus, str, str]:
    """How a turn's result finishes its inbox row: status, reply text, detail."""
    status: FinishStatus = "done" if result.ok else "failed"
    return status, result.text + refusal_note(result.refused_tools), result.outcome


def refusal_note(tools: Sequence[str], shown: int = 8) -> str:
    """A line under the answer naming the tools that were refused, said by geodebot itself:
    a model steered by a prompt injection may well not mention them. Names come from the
    model, so anything that is not a plain tool name is not repeated into the chat."""
    if not tools:
        return ""
    names = [f"`{t}`" if _TOOL_NAME.fullmatch(t) else "a tool with an odd name" for t in tools]
    listed = ", ".join(names[:shown])
    if len(names) > shown:
        listed += f" and {len(names) - shown} more"
    return f"\n\n(Not allowed here, so not run: {listed}.)"
