"""``send_file``: the agent uploads a workspace file into the chat it is answering.

The file is read through the workspace's confinement (engine/tools/builtin/paths.py), checked
against the chat's platform upload limit, copied into the file store (so a later change in
the workspace cannot change what is sent) and queued in the outbox through the turn's
:class:`~geodebot.engine.tools.spec.ChatOutlet`: it goes out once, in order with the turn's
other replies, like every reply. The tool is effectful (its receipt is admitted before it
runs, and a call whose outcome is uncertain is never run again) and, as a write, needs
approval or a pre-approval like any other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import mimetypes
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from geodebot.channels.base import UPLOAD_LIMITS
from geodebot.chat.attachments import safe_name, sniff
from geodebot.chat.replies import reply_to
from geodebot.engine.attachments import IMAGE_TYPES, PDF_TYPE
from geodebot.engine.llm.types import human_size
from geodebot.engine.tools.builtin.paths import inside, locate, open_file, os_errors
from geodebot.engine.tools.spec import Effect, Safety, ToolCallContext, ToolError, ToolSpec
from geodebot.store.files import FileStore
from geodebot.store.protocol import InboxOutboxStore
from geodebot.store.records import InboxRow, NewOutbound, OutboxRow, StoredFile, StoreError

__all__ = ["MAX_CAPTION_CHARS", "SEND_FILE", "OutboxOutlet", "send_file_spec"]

SEND_FILE = "send_file"
# Telegram takes 1,024 characters of caption; markup added by rendering needs some room.
MAX_CAPTION_CHARS = 900

_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "path": {
            "type": "string",
            "minLength": 1,
            "maxLength": 4096,
            "description": "The file, relative to the workspace",
        },
        "caption": {
            "type": "string",
            "maxLength": MAX_CAPTION_CHARS,
            "description": "A short text shown with the file",
        },
    },
    "required": ["path"],
    "additionalProperties": False,
}


class OutboxOutlet:
    """Where a turn's files go: one chat (and thread, answering one message if any), through
    the outbox; ``where`` is a message to that place, whose text and file each upload sets.
    ``deliver`` gets each row once it is written: a chat turn hands it to the outbox at once,
    so it goes before the turn's answer (handed over the same way when the turn ends); a
    job's turn wakes the outbox, whose scan sends rows in the order written."""

    def __init__(
        self, store: InboxOutboxStore, where: NewOutbound, deliver: Callable[[OutboxRow], None]
    ) -> None:
        self._store = store
        self._where = where
        self._deliver = deliver

    @classmethod
    def answering(
        cls, store: InboxOutboxStore, row: InboxRow, deliver: Callable[[OutboxRow], None]
    ) -> OutboxOutlet:
        """Into the chat and thread of an inbox row, answering its message."""
        return cls(store, reply_to(row, ""), deliver)

    @property
    def platform(self) -> str:
        return self._where.platform

    async def send_file(self, file: StoredFile, caption: str) -> None:
        queued = await self._store.outbox_add(
            dataclasses.replace(self._where, text=caption, kind="file", file=file)
        )
        self._deliver(queued)


def send_file_spec(workspace: Path, files: FileStore) -> ToolSpec:
    async def send(arguments: Mapping[str, Any], ctx: ToolCallContext) -> str:
        outlet = ctx.outlet
        if outlet is None:
            raise ToolError(
                "send_file posts into a chat: it works in a chat's turn or a job that posts "
                "in one, and there is no chat here"
            )
        limit = UPLOAD_LIMITS.get(outlet.platform, 0)
        raw = arguments.get("path")
        stored = await asyncio.to_thread(_copy, workspace, raw, limit, files)
        await outlet.send_file(stored, str(arguments.get("caption") or ""))
        return f"{stored.name} ({human_size(stored.size)}) is queued and will appear in the chat."

    return ToolSpec(
        name=SEND_FILE,
        description=(
            "Upload a file from the workspace into this chat, with an optional short caption. "
            f"Limits: {_limits_text()}."
        ),
        input_schema=_SCHEMA,
        safety=Safety.WRITE,
        effect=Effect.COMMUNICATE,
        handler=send,
        resource_keys=("fs:workspace",),
        timeout_s=60.0,
    )


def _copy(workspace: Path, raw: object, limit: int, files: FileStore) -> StoredFile:
    root, rel, shown = locate(workspace, raw)
    with os_errors(shown):
        real = inside(root, rel)
        with open_file(root, real, shown) as handle:
            data = handle.read(limit + 1)
    if len(data) > limit:
        raise ToolError(f"{shown}: larger than this chat's upload limit of {human_size(limit)}")
    if not data:
        raise ToolError(f"{shown}: is empty; the platforms do not take empty files")
    name = safe_name(PurePosixPath(shown).name)
    try:
        return files.put(data, name=name, media_type=_media_type(data, name))
    except StoreError as exc:
        raise ToolError(f"{shown}: could not be kept for sending: {exc}") from exc


def _media_type(data: bytes, name: str) -> str:
    """Images and PDFs by their bytes (a platform shows them inline), anything else by
    its name, text as plain text, the rest as bytes."""
    found = sniff(data)
    if found in IMAGE_TYPES or found == PDF_TYPE:
        return found
    return mimetypes.guess_type(name)[0] or found or "application/octet-stream"


def _limits_text() -> str:
    return ", ".join(f"{p} {human_size(n)}" for p, n in sorted(UPLOAD_LIMITS.items()))
