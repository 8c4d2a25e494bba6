"""Compaction: older history is summarised by the model into an append-only summary record.

A channel session may live for years; its context must not grow without bound. When the
context nears the model's budget, everything except the most recent messages is replaced (in
what the model sees, never in the store) by a summary that records the seq range it covers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from json.encoder import encode_basestring
from typing import Any, overload

from geodebot.engine.llm.types import (
    FileBlock,
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
    # context, and a long-lived session's context is long. An image stands in it as the
    # digest of its bytes, so a screenshot neither bloats the hash input nor the size.
    canonical: str = field(default="", compare=False, repr=False)
    images: int = field(default=0, compare=False, repr=False)
    # Files a user sent (by reference in the JSON), each costing the model about an image.
    files: int = field(default=0, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.canonical:
            text = _text_only_canonical(self.message)
            if text is not None:
                object.__setattr__(self, "canonical", text)
                return
            data = self.message.to_json()
            count = files = 0
            for block in data["content"]:
                files += block["type"] == "file"
                for image in block.get("images", ()):
                    image["data"] = "sha256:" + hashlib.sha256(image["data"].encode()).hexdigest()
                    count += 1
            object.__setattr__(self, "canonical", canonical_json(data))
            object.__setattr__(self, "images", count)
            object.__setattr__(self, "files", files)


def _text_only_canonical(message: Message) -> str | None:
    """The canonical JSON of a message of text blocks only (most of a chat's history),
    written directly: the same text as ``canonical_json(message.to_json())`` in a fifth of
    the time, which counts when a long history is read again."""
    parts = []
    for block in message.content:
        if type(block) is not TextBlock:
            return None
        parts.append(f'{{"text":{encode_basestring(block.text)},"type":"text"}}')
    return f'{{"content":[{",".join(parts)}],"role":{encode_basestring(message.role)}}}'


# Each field's slot, set directly by text_item (see there).
_SLOTS = {f.name: vars(ContextItem)[f.name].__set__ for f in fields(ContextItem)}
_SET_SEQ, _SET_MESSAGE, _SET_SUMMARY, _SET_COVERS, _SET_CANONICAL, _SET_IMAGES, _SET_FILES = (
    _SLOTS.pop(name)
    for name in ("seq", "message", "is_summary", "covers_from", "canonical", "images", "files")
)
if _SLOTS:
    raise TypeError(f"text_item must set every field of ContextItem, also {sorted(_SLOTS)}")


def text_item(
    seq: int, message: Message, is_summary: bool, covers_from: int | None, canonical: str
) -> ContextItem:
    """``ContextItem(seq, message, is_summary, covers_from, canonical)`` for a message of text
    blocks (no image, no file) whose canonical JSON is known: what decoding a whole history
    makes of most of its messages. The frozen dataclass's ``__init__`` sets each field
    through ``object.__setattr__`` and then runs ``__post_init__``, three times the cost of
    setting the slots directly, which a cache miss pays for every message of a long
    history. The item is as frozen as any."""
    item = object.__new__(ContextItem)
    _SET_SEQ(item, seq)
    _SET_MESSAGE(item, message)
    _SET_SUMMARY(item, is_summary)
    _SET_COVERS(item, covers_from)
    _SET_CANONICAL(item, canonical)
    _SET_IMAGES(item, 0)
    _SET_FILES(item, 0)
    return item


# What one screenshot costs a provider, roughly (about 1,600 tokens for 1280x800).
IMAGE_CHARS = 4 * 1_600
IMAGE_DROPPED = "[an earlier image was dropped: only the latest one stays in the context]"


def _chars(item: ContextItem) -> int:
    return len(item.canonical) + (item.images + item.files) * IMAGE_CHARS


class Context(Sequence[ContextItem]):
    """A session's context, in order, with what every model round measures of it kept up to
    date as items are appended: its size (:func:`estimate_tokens`), which items carry
    images (:func:`latest_images_only`) or files (the file view), its messages, and the
    digest of their canonical JSON (for the request's hash in the evidence ledger).

    A long-lived session's context is long, and measured afresh, each round cost time in
    proportion to the whole history; kept here, a round costs what was appended since. The
    items are only appended, or one is given its seq once saved (``context[i] = item`` with
    the same message); compaction makes a new Context."""

    __slots__ = ("_chars", "_digest", "_files", "_images", "_items", "_messages")

    def __init__(self, items: Iterable[ContextItem] = ()) -> None:
        # Made whole in a few passes, not appended one by one: a cache miss makes one of a
        # whole history.
        self._items: list[ContextItem] = list(items)
        self._messages: list[Message] = [item.message for item in self._items]
        self._chars = sum(map(_chars, self._items))
        # The indices of the items that carry images, and of those that carry files
        # (summaries never do).
        self._images: list[int] = [i for i, item in enumerate(self._items) if item.images]
        self._files: list[int] = [
            i for i, item in enumerate(self._items) if item.files and not item.is_summary
        ]
        # sha256 of '[[<item>,<item>...', continued by each append.
        self._digest: Any = hashlib.sha256(
            b"[[" + ",".join(item.canonical for item in self._items).encode()
        )

    def append(self, item: ContextItem) -> None:
        index = len(self._items)
        self._items.append(item)
        self._messages.append(item.message)
        self._chars += _chars(item)
        if item.images:
            self._images.append(index)
        if item.files and not item.is_summary:
            self._files.append(index)
        self._digest.update(f"{',' if index else ''}{item.canonical}".encode())

    def copy(self) -> Context:
        other = Context.__new__(Context)
        other._items, other._messages = list(self._items), list(self._messages)
        other._chars = self._chars
        other._images, other._files = list(self._images), list(self._files)
        other._digest = self._digest.copy()
        return other

    def replacing(self, changes: Mapping[int, ContextItem]) -> Context:
        """A copy with the items at these indices replaced (a view of it for the model)."""
        other, carriers, rehash = self.copy(), False, False
        for index, item in changes.items():
            old = other._items[index]
            other._items[index], other._messages[index] = item, item.message
            other._chars += _chars(item) - _chars(old)
            rehash |= item.canonical != old.canonical
            carriers |= (bool(item.images), bool(item.files)) != (bool(old.images), bool(old.files))
        if rehash:
            other._digest = hashlib.sha256(b"[[")
            other._digest.update(",".join(item.canonical for item in other._items).encode())
        if carriers:
            other._images = [i for i, item in enumerate(other._items) if item.images]
            other._files = [
                i for i, item in enumerate(other._items) if item.files and not item.is_summary
            ]
        return other

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> ContextItem: ...
    @overload
    def __getitem__(self, index: slice) -> list[ContextItem]: ...
    def __getitem__(self, index: int | slice) -> ContextItem | list[ContextItem]:
        return self._items[index]

    def __setitem__(self, index: int, item: ContextItem) -> None:
        if item.message is not self._items[index].message:
            raise ValueError("an item of a context is replaced only by its own message")
        self._items[index] = item

    def __iter__(self) -> Iterator[ContextItem]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"Context({self._items!r})"

    @property
    def chars(self) -> int:
        """What :func:`estimate_tokens` counts: the canonical JSON's characters, an image
        or a file as IMAGE_CHARS."""
        return self._chars

    @property
    def with_images(self) -> Sequence[int]:
        return self._images

    @property
    def with_files(self) -> Sequence[int]:
        return self._files

    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    def digest(self, *after: str) -> str:
        """The sha256 (hex) of ``[[item,...],after,...]``: the items' canonical JSON, then
        the canonical JSON texts ``after``, as hashing that whole text gives, in time
        independent of the context's length."""
        final = self._digest.copy()
        final.update(f"],{','.join(after)}]".encode() if after else b"]]")
        return str(final.hexdigest())


def as_context(items: Sequence[ContextItem]) -> Context:
    return items if isinstance(items, Context) else Context(items)


def estimate_tokens(items: Sequence[ContextItem], system: str = "") -> int:
    """A cheap, provider-independent estimate: about four characters per token."""
    return (len(system) + as_context(items).chars) // 4 + 1


def latest_images_only(items: Sequence[ContextItem]) -> Context:
    """The context as the model sees it: tool-result images only in the newest message
    that has any (a computer-use session takes a screenshot per step)."""
    context = as_context(items)
    carrying = context.with_images
    if len(carrying) <= 1:
        return context
    changes: dict[int, ContextItem] = {}
    for index in carrying[:-1]:
        item = context[index]
        blocks = tuple(
            replace(b, content=f"{b.content}\n{IMAGE_DROPPED}", images=())
            if isinstance(b, ToolResultBlock) and b.images
            else b
            for b in item.message.content
        )
        changes[index] = ContextItem(
            item.seq, replace(item.message, content=blocks), item.is_summary, item.covers_from
        )
    return context.replacing(changes)


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
            elif isinstance(block, FileBlock):
                text = f"[sent file {block.name} ({block.media_type}, {block.size} bytes)]"
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
