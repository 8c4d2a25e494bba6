"""The Anthropic request body's history as JSON, encoded once per message and per request.

A conversation goes whole with every request. Encoding it anew each round costs time in
proportion to the history; :class:`MessageJSON` keeps each message's block JSON and
:class:`HistoryJSON` the array built from them, so a round encodes only what is new.
"""

from __future__ import annotations

import functools
import itertools
import operator
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


# How one message reaches the API: (role, is a tool result, block JSON) per block sent; or,
# for most of a history (one text block), the block JSON alone, the message's role its role.
_Segments = tuple[tuple[Role, bool, str], ...]
_Encoded = _Segments | str


class MessageJSON:
    """Each history message's block JSON, made once and kept on the message (``wire``).

    A conversation goes whole with every request, so without this a session's history is
    re-encoded on every round of every turn: the largest CPU cost the adapter had. Messages
    are immutable and the engine keeps a session's context between turns, so a message seen
    again is the same object, and its encoding lives exactly as long as it does: nothing
    here holds a message or needs a bound of its own (the engine's context cache bounds the
    messages, and counts their encodings).
    """

    def __call__(self, message: Message) -> _Encoded:
        encoded = message.wire
        if encoded is None:
            encoded = _encode(message)
            if type(encoded) is str or not _carries_data(message):
                object.__setattr__(message, "wire", encoded)
        return encoded  # type: ignore[return-value]  # only this class writes ``wire``


def _carries_data(message: Message) -> bool:
    """Whether a message carries an image's or a file's bytes. Only the newest such message
    of a context goes with them (see compaction.latest_images_only and attachments), and
    its encoding, megabytes of base64, is not kept: the context cache holds the messages
    of many sessions, and an old screenshot's copy would stay as long as its message."""
    return any(
        (type(block) is ToolResultBlock and bool(block.images))
        or (type(block) is FileBlock and bool(block.data))
        for block in message.content
    )


def segments(message: Message, encoded: _Encoded) -> _Segments:
    """``encoded`` (of ``message``) as its blocks' segments."""
    return ((message.role, False, encoded),) if type(encoded) is str else encoded  # type: ignore[return-value]


def _encode(message: Message) -> _Encoded:
    content = message.content
    if len(content) == 1 and type(content[0]) is TextBlock:
        # Most of a history: one text block, encoded without the general path's generator,
        # and kept as its string alone (a tuple per message would cost more than the text).
        text = content[0].text
        if not text.strip():
            return ()
        return f'{{"type":"text","text":{encode_basestring(text)}}}'
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

    def add(self, messages: Iterable[Message], encoded: Callable[[Message], _Encoded]) -> None:
        """Continue with the blocks of ``messages``, in order. The finished turns are joined
        to ``done`` once per call: a whole history goes in one call, and joining turn by
        turn would copy ``done`` once per turn."""
        finished: list[str] = []
        role, results, others = self.role, self.results, self.others
        for message in messages:
            for block_role, is_result, text in segments(message, encoded(message)):
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

    An entry holds its conversation's messages but the first, which it references weakly: the
    engine holds a session's context from its first message on, so when it lets the context
    go, the first message dies and takes the entry with it. So this cache never keeps a
    history alive, at the cost of one list slot per message (a weak reference to each,
    with the ids to compare, cost twenty times that). At most ``max_entries`` and
    ``max_chars`` of array text are kept, least recently used first out; the defaults are
    those of the engine's context cache (256 sessions, 32 MB): a smaller bound here would
    have every request of a busy daemon's long sessions encoded whole.
    """

    def __init__(
        self,
        encoded: Callable[[Message], _Encoded],
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
        # (key, serial) of entries whose first message died: removed at the next call, not
        # from the callback, which the garbage collector may run in the middle of one.
        self._dead: list[tuple[int, int]] = []

    def __call__(self, messages: Sequence[Message], *, cache: bool = False) -> str:
        """The array; ``cache``: with the prompt cache's breakpoints (see ``_Turns.text``)."""
        self._reap()
        if not messages:
            return "[]"
        first = messages[0]
        key = id(first)
        entry = self._drop(key)
        if entry is not None and self._continues(entry, first, messages):
            turns, start = entry.turns.copy(), len(entry.rest) + 1
        else:
            self._serial += 1
            forget = functools.partial(self._forget, key, self._serial)
            entry = _Conversation(self._serial, weakref.ref(first, forget), [], _Turns(), 0)
            turns, start = _Turns(), 0
        new = messages[start:]
        turns.add(new, self._encoded)
        text = turns.text(cache=cache)
        if len(text) <= self._max_chars:
            entry.rest.extend(new[1:] if start == 0 else new)
            entry.turns, entry.chars = turns, len(text)
            self._entries[key] = entry
            self._chars += entry.chars
            while self._chars > self._max_chars or len(self._entries) > self._max_entries:
                self._chars -= self._entries.popitem(last=False)[1].chars
        return text

    def __len__(self) -> int:
        self._reap()
        return len(self._entries)

    @staticmethod
    def _continues(entry: _Conversation, first: Message, messages: Sequence[Message]) -> bool:
        """Whether ``messages`` starts with exactly the entry's messages, the same objects."""
        rest = entry.rest
        return (
            entry.first() is first
            and len(messages) > len(rest)
            and all(map(operator.is_, rest, itertools.islice(messages, 1, None)))
        )

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
    serial: int  # tells a dead first message's callback whether this entry is still its own
    first: weakref.ref[Message]
    rest: list[Message]  # the messages after the first, held (see HistoryJSON)
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
