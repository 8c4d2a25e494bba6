"""The Anthropic request body's history as JSON, encoded once per message and per request.

A conversation goes whole with every request. Encoding it anew each round costs time in
proportion to the history; :class:`MessageJSON` keeps each message's block JSON and
:class:`HistoryJSON` the array built from them, so a round encodes only what is new.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import TypeAlias

from anthropic.types import (
    DocumentBlockParam,
    ImageBlockParam,
    TextBlockParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)

from geodebot.engine.llm.types import (
    Block,
    FileBlock,
    Message,
    Role,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    compact_encoder,
)

__all__ = ["CACHE_BREAKPOINT", "HistoryJSON", "MessageJSON", "dumps"]

# Spliced before a block's closing brace: the prompt cache's breakpoint (five minutes, the
# API's default lifetime, renewed by every request that reads it).
CACHE_BREAKPOINT = ',"cache_control":{"type":"ephemeral"}'

_BlockParam: TypeAlias = (
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ImageBlockParam | DocumentBlockParam
)


# json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False), as the SDK
# encodes a body, without building an encoder per call (see compact_encoder).
dumps = compact_encoder(sort_keys=False, allow_nan=False)


# How one message reaches the API: (role, is a tool result, block JSON) per block sent.
_Segments = tuple[tuple[Role, bool, str], ...]


class _Entry(weakref.ref):  # type: ignore[type-arg]  # of a Message; see MessageJSON
    """A message's entry: a weak reference to it that carries its encoding. One object per
    message held, where a reference, its callback and a tuple were three: a long history
    read whole makes one per message, and each is work for the garbage collector."""

    __slots__ = ("key", "segments", "size")
    key: int
    segments: _Segments
    size: int


class MessageJSON:
    """Each history message's block JSON, kept between requests while the message lives.

    A conversation goes whole with every request, so without this a session's history is
    re-encoded on every round of every turn: the largest CPU cost the adapter had. Messages
    are immutable and the engine keeps a session's context between turns, so a message seen
    again is the same object. An entry goes when its message is freed (a weak reference:
    this cache never keeps a history alive) or, past ``max_chars``, oldest first.
    """

    def __init__(self, max_chars: int = 4_000_000) -> None:
        self._max_chars = max_chars
        self._chars = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        # Entries whose message died: removed at the next call, not from the callback,
        # which the garbage collector may run in the middle of one.
        self._dead: list[_Entry] = []
        self._died = self._dead.append  # the callback, made once

    def __call__(self, message: Message) -> _Segments:
        if self._dead:
            self._reap()
        key = id(message)
        entry = self._entries.get(key)
        if entry is not None and entry() is message:
            return entry.segments
        segments = _segments(message)
        size = len(segments[0][2]) if len(segments) == 1 else sum(len(t) for *_, t in segments)
        if size <= self._max_chars:
            if entry is not None:
                self._drop(key)
            entry = _Entry(message, self._died)
            entry.key, entry.segments, entry.size = key, segments, size
            self._entries[key] = entry
            self._chars += size
            while self._chars > self._max_chars:
                self._chars -= self._entries.popitem(last=False)[1].size
        return segments

    def __len__(self) -> int:
        self._reap()
        return len(self._entries)

    def _reap(self) -> None:
        while self._dead:
            entry = self._dead.pop()
            if self._entries.get(entry.key) is entry:
                self._drop(entry.key)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._chars -= entry.size


def _segments(message: Message) -> _Segments:
    content = message.content
    if len(content) == 1 and type(content[0]) is TextBlock:
        # Most of a history: one text block, encoded without the general path's generator.
        text = content[0].text
        if not text.strip():
            return ()
        return ((message.role, False, f'{{"type":"text","text":{encode_basestring(text)}}}'),)
    # Empty text is dropped because the API rejects blank text blocks; a tool result always
    # travels in a user turn.
    return tuple(
        ("user" if isinstance(b, ToolResultBlock) else message.role,
         isinstance(b, ToolResultBlock),
         _block_json(b))
        for b in content
        if not (isinstance(b, TextBlock) and not b.text.strip())
    )  # fmt: skip


def _block_json(block: Block) -> str:
    # A text block, most of a history, written directly: the same text as dumps() of its
    # param in a fraction of the time, which counts when a long history is encoded whole.
    if type(block) is TextBlock:
        return f'{{"type":"text","text":{encode_basestring(block.text)}}}'
    return dumps(_block_param(block))


class _Turns:
    """The ``messages`` array being built: consecutive same-role turns merged (the API requires
    roles to alternate), tool results leading their user turn (the API rejects a tool_result
    after text in the same turn). It can be copied half-built and continued."""

    __slots__ = ("done", "ends", "others", "results", "role")

    def __init__(self) -> None:
        self.done = ""  # the finished turns, comma-separated
        # Where the last two finished turns end in ``done`` (see text's cache breakpoints).
        self.ends: tuple[int, ...] = ()
        self.role: Role | None = None
        self.results: list[str] = []
        self.others: list[str] = []

    def copy(self) -> _Turns:
        other = _Turns()
        other.done, other.ends, other.role = self.done, self.ends, self.role
        other.results, other.others = list(self.results), list(self.others)
        return other

    def add(self, messages: Iterable[_Segments]) -> None:
        """Continue with the blocks of ``messages``, in order. The finished turns are joined
        to ``done`` once per call: a whole history goes in one call, and joining turn by
        turn would copy ``done`` once per turn."""
        finished: list[str] = []
        role, results, others = self.role, self.results, self.others
        for segments in messages:
            for block_role, is_result, text in segments:
                if block_role != role:
                    if role is not None:
                        finished.append(_turn(role, results + others))
                    role, results, others = block_role, [], []
                (results if is_result else others).append(text)
        self.role, self.results, self.others = role, results, others
        if not finished:
            return
        ends, end = list(self.ends), len(self.done)
        for turn in finished:
            end += len(turn) + (1 if end else 0)
            ends.append(end)
        self.done = ",".join([self.done, *finished] if self.done else finished)
        self.ends = tuple(ends[-2:])

    def text(self, *, cache: bool = False) -> str:
        """The array. With ``cache``, the last block of the newest turn and of the turn two
        before it carry a cache breakpoint: the newest writes the conversation so far to the
        provider's prompt cache, and the other is where the previous request of the
        conversation ended (it ended on the turn before the answer it got), which this one
        reads back whatever the number of blocks in between."""
        if self.role is None:
            return f"[{self.done}]"
        last = _turn(self.role, self.results + self.others, CACHE_BREAKPOINT if cache else "")
        done = self.done
        if cache and len(self.ends) == 2:
            # A finished turn ends '}]}': its last block's brace, the content's, the turn's.
            at = self.ends[0] - 3
            done = f"{done[:at]}{CACHE_BREAKPOINT}{done[at:]}"
        return f"[{done},{last}]" if done else f"[{last}]"


def _turn(role: Role, blocks: list[str], mark: str = "") -> str:
    """One turn of the array: its blocks, ``mark`` spliced before the last one's brace."""
    joined = ",".join(blocks)
    if mark:
        joined = f"{joined[:-1]}{mark}}}"
    return f'{{"role":"{role}","content":[{joined}]}}'


class HistoryJSON:
    """The ``messages`` array of recent conversations, kept so a request encodes only the
    messages the previous request of its conversation did not have.

    A session's requests grow at the end: each carries the messages of the one before, the
    same objects, and a few new ones. Rebuilding the array from every message costs a round
    time in proportion to the whole history, which only compaction ever shortens. An entry
    is found by the conversation's first message and continued when the request starts with
    exactly the entry's messages (the same objects); any other request is built whole, from
    :class:`MessageJSON`, and becomes the entry.

    Entries hold weak references: a message that dies takes its entry with it, so the ids
    an entry compares by always belong to live messages, and this cache never keeps a
    history alive. At most ``max_entries`` and ``max_chars`` of array text are kept, least
    recently used first out; the defaults are those of the engine's context cache (256
    sessions, 32 MB), which keeps the messages alive: a smaller bound here would have every
    request of a busy daemon's long sessions encoded whole.
    """

    def __init__(
        self,
        encoded: Callable[[Message], _Segments],
        *,
        max_entries: int = 256,
        max_chars: int = 32_000_000,
    ) -> None:
        self._encoded = encoded
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._chars = 0
        self._serial = 0
        self._entries: OrderedDict[int, _Conversation] = OrderedDict()
        # (key, serial) of entries one of whose messages died; see MessageJSON._dead.
        self._dead: list[tuple[int, int]] = []

    def __call__(self, messages: Sequence[Message], *, cache: bool = False) -> str:
        """The array; ``cache``: with the prompt cache's breakpoints (see ``_Turns.text``)."""
        self._reap()
        if not messages:
            return "[]"
        ids = tuple(map(id, messages))
        entry = self._drop(ids[0])
        if entry is not None and ids[: len(entry.ids)] == entry.ids:
            turns, start = entry.turns.copy(), len(entry.ids)
        else:
            self._serial += 1
            entry = _Conversation(self._serial, (), [], _Turns(), 0)
            turns, start = _Turns(), 0
        turns.add(map(self._encoded, messages[start:]))
        text = turns.text(cache=cache)
        if len(text) <= self._max_chars:
            forget = functools.partial(self._forget, ids[0], entry.serial)
            entry.refs.extend(map(weakref.ref, messages[start:], itertools.repeat(forget)))
            entry.ids, entry.turns, entry.chars = ids, turns, len(text)
            self._entries[ids[0]] = entry
            self._chars += entry.chars
            while self._chars > self._max_chars or len(self._entries) > self._max_entries:
                self._chars -= self._entries.popitem(last=False)[1].chars
        return text

    def __len__(self) -> int:
        self._reap()
        return len(self._entries)

    def _forget(self, key: int, serial: int, _: weakref.ref[Message]) -> None:
        self._dead.append((key, serial))

    def _reap(self) -> None:
        while self._dead:
            key, serial = self._dead.pop()
            entry = self._entries.get(key)
            if entry is not None and entry.serial == serial:
                self._drop(key)

    def _drop(self, key: int) -> _Conversation | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._chars -= entry.chars
        return entry


@dataclass(slots=True)
class _Conversation:
    serial: int  # tells a dead message's callback whether this entry is still its own
    ids: tuple[int, ...]
    refs: list[weakref.ref[Message]]
    turns: _Turns
    chars: int  # of the array text, for the bound


def _file_param(block: FileBlock) -> _BlockParam:
    """A user's file: an image or a PDF as its block, anything else (or a file whose bytes
    this request does not carry) as the line that names it."""
    if block.data and block.media_type.startswith("image/"):
        image: ImageBlockParam = {
            "type": "image",
            "source": {
                "type": "base64",
                # Only the four types the API takes get here (see engine/attachments.py).
                "media_type": block.media_type,  # type: ignore[typeddict-item]
                "data": block.data,
            },
        }
        return image
    if block.data and block.media_type == "application/pdf":
        document: DocumentBlockParam = {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": block.data},
            "title": block.name[:200],
        }
        return document
    return {"type": "text", "text": block.note}


def _block_param(block: Block) -> _BlockParam:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, FileBlock):
        return _file_param(block)
    if isinstance(block, ToolUseBlock):
        return {
            "type": "tool_use",
            "id": block.id,
            "name": block.name,
            "input": dict(block.arguments),
        }
    if not block.images:
        return {
            "type": "tool_result",
            "tool_use_id": block.tool_use_id,
            "content": block.content,
            "is_error": block.is_error,
        }
    # A screenshot goes back as an image block inside the tool result.
    parts: list[TextBlockParam | ImageBlockParam] = [{"type": "text", "text": block.content}]
    for image in block.images:
        parts.append(
            {
                "type": "image",
                "source": {
                    "type": "base64",
                    # A plain str here; the computer tool only returns PNG screenshots.
                    "media_type": image.media_type,  # type: ignore[typeddict-item]
                    "data": image.data,
                },
            }
        )
    return {
        "type": "tool_result",
        "tool_use_id": block.tool_use_id,
        "content": parts,
        "is_error": block.is_error,
    }
