"""A user's files in a model request: the history holds references, the request the bytes.

A message with files is stored with :class:`FileBlock` s that name a digest in the file store.
Each model call, :class:`FileView` gives the newest files their content (an image or a PDF as
base64 for its block, a text file as text) and leaves older ones as references, which the
adapters show as a line naming the file, so a long-lived chat does not resend every picture
it was ever shown. What the provider would refuse (an image over its size limit, too many
bytes in one request) is named, not sent: a refused block would fail the call, and with it
every later turn of the session.

Resolved messages are kept while their original lives (a weak reference, as the adapters'
JSON caches do) and within a byte bound, so a round does not read the files again and the
adapters see the same message objects from round to round.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from geodebot.engine.compaction import Context, ContextItem, as_context
from geodebot.engine.llm.types import Block, FileBlock, Message, TextBlock, human_size
from geodebot.store.files import FileStore
from geodebot.store.records import StoreError

__all__ = [
    "IMAGE_TYPES",
    "MAX_IMAGE_BYTES",
    "MAX_PDF_BYTES",
    "MAX_TEXT_BYTES",
    "PDF_TYPE",
    "SHOWN_LIMITS",
    "TEXT_TYPE",
    "FileView",
    "file_note",
]

log = logging.getLogger(__name__)

# What the providers take as blocks: Anthropic's four image types (OpenAI takes the same),
# PDFs as documents, and text, which goes as text.
IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
PDF_TYPE = "application/pdf"
TEXT_TYPE = "text/plain"
# Anthropic refuses an image over 5 MB and a request over 32 MB (base64 counts 4/3).
MAX_IMAGE_BYTES = 5 * 1000 * 1000
MAX_PDF_BYTES = 20 * 1000 * 1000
# A text file is read into the prompt whole; larger ones would crowd out the conversation.
MAX_TEXT_BYTES = 200_000
# The newest files shown with their content; older ones are named only.
FILES_SHOWN = 8
SHOWN_BYTES = 22 * 1000 * 1000
_CACHE_BYTES = 64 * 1000 * 1000
# The largest file of each kind the model is shown: what chat/attachments.py accepts, too.
SHOWN_LIMITS: Mapping[str, int] = {
    **dict.fromkeys(IMAGE_TYPES, MAX_IMAGE_BYTES),
    PDF_TYPE: MAX_PDF_BYTES,
    TEXT_TYPE: MAX_TEXT_BYTES,
}


def file_note(block: FileBlock, why: str) -> TextBlock:
    return TextBlock(
        f"[file {block.name} ({block.media_type}, {human_size(block.size)}) not shown: {why}]"
    )


@dataclass(slots=True)
class _Entry:
    ref: weakref.ref[Message]
    shown: frozenset[int]
    message: Message
    size: int


class FileView:
    def __init__(self, files: FileStore, *, max_bytes: int = _CACHE_BYTES) -> None:
        self._files = files
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        # Keys of entries whose message died: removed at the next call, not from the
        # callback, which the garbage collector may run in the middle of one.
        self._dead: list[tuple[int, weakref.ref[Message]]] = []

    async def view(self, items: Sequence[ContextItem]) -> Context:
        """``items`` as the model sees them: file blocks filled in or named (see above)."""
        self._reap()
        context = as_context(items)
        shown = _choose(context)
        if not shown:
            return context
        # Only messages with a file shown change: a file not shown stays a reference, which
        # every adapter renders as the line naming it (FileBlock.note). The item keeps its
        # canonical JSON, where a file is its reference.
        changes: dict[int, ContextItem] = {}
        for index, positions in shown.items():
            item = context[index]
            changes[index] = replace(item, message=await self._resolved(item.message, positions))
        return context.replacing(changes)

    async def _resolved(self, message: Message, shown: frozenset[int]) -> Message:
        key = id(message)
        entry = self._entries.get(key)
        if entry is not None and entry.ref() is message and entry.shown == shown:
            self._entries.move_to_end(key)
            return entry.message
        blocks: list[Block] = []
        size = 0
        for position, block in enumerate(message.content):
            if not isinstance(block, FileBlock) or position not in shown:
                blocks.append(block)
                continue
            resolved = await self._content(block)
            if isinstance(resolved, FileBlock):
                size += len(resolved.data)
            elif isinstance(resolved, TextBlock):
                size += len(resolved.text)
            blocks.append(resolved)
        result = Message(message.role, tuple(blocks))
        self._keep(key, message, shown, result, size)
        return result

    async def _content(self, block: FileBlock) -> Block:
        limit = SHOWN_LIMITS.get(block.media_type)
        if limit is None or block.size > limit:
            # Accepted files are within these (chat/attachments.py); a history written under
            # other rules must still not fail the call.
            return file_note(block, "not a kind or size the model is shown")
        try:
            data = await asyncio.to_thread(self._files.read, block.sha256)
        except StoreError as exc:
            log.warning("file %s of the history cannot be read: %s", block.sha256[:12], exc)
            return file_note(block, "its stored copy is missing")
        if block.media_type == TEXT_TYPE:
            text = data.decode("utf-8", errors="replace")
            return TextBlock(f"[file {block.name}]\n{text}")
        return replace(block, data=base64.b64encode(data).decode())

    def _keep(
        self, key: int, original: Message, shown: frozenset[int], result: Message, size: int
    ) -> None:
        self._drop(key)
        if size > self._max_bytes:
            return
        ref = weakref.ref(original, functools.partial(self._forget, key))
        self._entries[key] = _Entry(ref, shown, result, size)
        self._bytes += size
        while self._bytes > self._max_bytes:
            self._bytes -= self._entries.popitem(last=False)[1].size

    def _forget(self, key: int, ref: weakref.ref[Message]) -> None:
        self._dead.append((key, ref))

    def _reap(self) -> None:
        while self._dead:
            key, ref = self._dead.pop()
            entry = self._entries.get(key)
            if entry is not None and entry.ref is ref:
                self._drop(key)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size


def _choose(items: Context) -> dict[int, frozenset[int]]:
    """Which file blocks get their content, newest first, within the count and byte bounds:
    item index -> positions of its shown blocks. A summary never carries files."""
    chosen: dict[int, set[int]] = {}
    count = total = 0
    for index in reversed(items.with_files):
        if count >= FILES_SHOWN:
            break
        item = items[index]
        for position in range(len(item.message.content) - 1, -1, -1):
            block = item.message.content[position]
            if not isinstance(block, FileBlock):
                continue
            if count >= FILES_SHOWN or total + block.size > SHOWN_BYTES:
                continue
            count += 1
            total += block.size
            chosen.setdefault(index, set()).add(position)
    return {index: frozenset(positions) for index, positions in chosen.items()}
