"""What a read shows of a thread (``ThreadReadProjectionV1``): its visible messages, bounded.

Visible is the text users and the assistant wrote, from the thread's current context (the
newest summary onward). Everything else is named and left out: tool calls and their results,
summaries of older history; files travel as references. Nothing of the session's state, its
configuration, its provider or its hidden reasoning is part of a projection. The newest
messages come first within the bounds; a cursor reads further back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from geodebot.config.schema import RelayConfig
from geodebot.relay.contracts import (
    ExcludedItem,
    ThreadReadProjectionV1,
    VisibleFile,
    VisibleMessage,
)
from geodebot.relay.threads import Thread
from geodebot.store.protocol import RelayStore, SessionStore
from geodebot.store.records import MessageRecord

__all__ = ["EDITING_RULES", "ThreadStore", "project_thread"]

EDITING_RULES = (
    "Nothing in a thread can be edited or deleted through the relay.",
    "thread_send appends one user message after the thread's last one, posted there "
    "attributed to the person who asked.",
    "A send is checked against your last read: the revision, the active turn and the "
    "capability revision must be unchanged, and the read recent enough.",
    "user_authored text must be exactly a message the person wrote in your thread; any "
    "other text needs their approval.",
)
_CURSOR = re.compile(r"^before:([1-9][0-9]{0,17})$")


class ThreadStore(SessionStore, RelayStore, Protocol):
    """What the relay reads of threads and writes between them: sessions and their
    histories, and the deliveries."""


async def project_thread(
    store: ThreadStore,
    thread: Thread,
    relay: RelayConfig,
    *,
    model: str,
    messages: bool = True,
    cursor: str | None = None,
) -> ThreadReadProjectionV1:
    """The projection of ``thread`` now; ValueError for a malformed cursor."""
    before: int | None = None
    if cursor:
        match = _CURSOR.match(cursor)
        if match is None:
            raise ValueError(f"cursor {cursor[:40]!r} is not one a read returned")
        before = int(match.group(1))
    record = await store.get_session(thread.session_id)
    running, queued = await store.inbox_activity(thread.session_id)
    shown: list[VisibleMessage] = []
    excluded: list[ExcludedItem] = []
    unsupported: list[ExcludedItem] = []
    next_cursor = None
    if messages and record is not None:
        history = await store.load_context(thread.session_id)
        if before is not None:
            history = [r for r in history if r.seq < before]
        shown, excluded, unsupported, next_cursor = _visible(history, relay)
    state: Literal["idle", "running", "queued"] = (
        "running" if running is not None else ("queued" if queued else "idle")
    )
    binding = thread.binding
    return ThreadReadProjectionV1(
        locator=thread.locator(relay, send=True),
        title=thread.key if binding is None else f"{thread.session_id} ({thread.key})",
        state=state,
        created_at=record.created_at if record is not None else None,
        updated_at=record.updated_at if record is not None else None,
        active_turn=None if running is None else running.turn_id,
        revision=record.next_seq - 1 if record is not None else 0,
        route={
            "platform": thread.adapter,
            "channel": binding.channel if binding is not None else None,
            "thread": thread.platform_thread,
        },
        model=model,
        links=thread.links,
        messages=tuple(shown),
        cursor=next_cursor,
        excluded=tuple(excluded),
        unsupported=tuple(unsupported),
        editing_rules=EDITING_RULES,
    )


def _visible(
    history: Sequence[MessageRecord], relay: RelayConfig
) -> tuple[list[VisibleMessage], list[ExcludedItem], list[ExcludedItem], str | None]:
    """Newest first until a bound is reached; returned oldest first."""
    shown: list[VisibleMessage] = []
    excluded: list[ExcludedItem] = []
    unsupported: list[ExcludedItem] = []
    chars_left = relay.max_read_chars
    cursor = None
    for record in reversed(history):
        if len(shown) >= relay.max_read_messages or chars_left <= 0:
            cursor = f"before:{shown[-1].seq}" if shown else None
            break
        if record.kind == "summary":
            excluded.append(ExcludedItem(seq=record.seq, kind="summary", reason="older history"))
            continue
        text, files, hidden = _parts(record.content)
        for kind in hidden:
            excluded.append(ExcludedItem(seq=record.seq, kind=kind, reason=_WHY[kind]))
        if not text and not files:
            continue
        unsupported.extend(
            ExcludedItem(seq=record.seq, kind="file", reason=f"{f.name}: its content is not copied")
            for f in files
        )
        cut = len(text) > chars_left
        shown.append(
            VisibleMessage(
                seq=record.seq,
                role="assistant" if record.role == "assistant" else "user",
                text=text[:chars_left] if cut else text,
                truncated=cut,
                files=tuple(files),
                at=record.created_at,
            )
        )
        chars_left -= len(text)
    shown.reverse()
    excluded.reverse()
    unsupported.reverse()
    return shown, excluded, unsupported, cursor


_WHY = {
    "tool_call": "tool calls are not shown",
    "tool_result": "tool results are not shown",
}


def _parts(content: Mapping[str, Any]) -> tuple[str, list[VisibleFile], list[str]]:
    texts: list[str] = []
    files: list[VisibleFile] = []
    hidden: list[str] = []
    for block in content.get("content", ()):
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "file":
            files.append(
                VisibleFile(
                    sha256=str(block.get("sha256")),
                    name=str(block.get("name", ""))[:300],
                    media_type=str(block.get("media_type", ""))[:200],
                    size=int(block.get("size", 0) or 0),
                )
            )
        elif kind == "tool_use" and "tool_call" not in hidden:
            hidden.append("tool_call")
        elif kind == "tool_result" and "tool_result" not in hidden:
            hidden.append("tool_result")
    return "".join(texts), files, hidden
