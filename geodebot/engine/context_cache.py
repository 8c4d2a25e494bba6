"""Decoded contexts of recently active sessions, kept between turns within a bound.

Without it every turn reads and decodes its session's whole context from the store, and a
channel session's context is long. The store stays the truth:

* an entry is used only while the session row's ``(generation, next_seq)`` equals the entry's,
  and every append or reset changes one of them, whoever makes it;
* an entry is extended only by the appends this process made, in seq order, with the rule the
  store's ``load_context`` applies (the newest summary, then the messages after the range it
  covers); an append that does not continue the entry drops it.

Least recently used entries go first once more than ``max_sessions`` sessions or
``max_bytes`` of memory are held, so idle sessions cost nothing here. The size counts what an
item keeps alive: measured (``sys.getsizeof``) over the item, its message and blocks with
their strings, any image's data, and the item's canonical JSON; and, estimated from that
JSON's length, the Anthropic adapter's encodings of the message, which live exactly as long
as it does (its block JSON, kept on the message, and its share of the conversation's array
text; see anthropic_json). tests/unit/test_context_cache.py checks the total against what
tracemalloc sees a cached session hold. The default bound holds 50 busy channel sessions of
about 540 messages each (a few hundred bytes of text per message): below the working set
every turn of every session misses, and a miss reads and decodes the whole history.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from sys import getsizeof

from geodebot.engine.compaction import Context, ContextItem
from geodebot.engine.llm.types import Message, TextBlock, ToolResultBlock, ToolUseBlock
from geodebot.store.records import NewMessage

__all__ = ["ContextCache", "item_size"]


@dataclass(slots=True)
class _Entry:
    generation: int
    next_seq: int
    items: Context
    size: int
    # No message at or below this seq is in the context (it is at least the current
    # summary's upper bound): a summary reaching lower would bring back messages not held.
    floor: int


def item_size(item: ContextItem) -> int:
    """Bytes ``item`` keeps alive (see the module's docstring)."""
    message = item.message
    content = message.content
    if len(content) == 1 and type(content[0]) is TextBlock:
        # Most of a history, measured without the general path's walk: what differs
        # between two such items is only the size of their strings.
        return (
            _ONE_TEXT_BLOCK
            + getsizeof(message.role)
            + getsizeof(content[0].text)
            + getsizeof(item.canonical)
            + _encodings(item)
        )
    size = (
        _encodings(item)
        + getsizeof(item)
        + getsizeof(message)
        + getsizeof(message.role)
        + getsizeof(message.content)
        + getsizeof(item.canonical)
    )
    for block in message.content:
        size += getsizeof(block)
        if isinstance(block, TextBlock):
            size += getsizeof(block.text)
        elif isinstance(block, ToolResultBlock):
            size += getsizeof(block.content) + getsizeof(block.tool_use_id)
            for image in block.images:
                size += getsizeof(image) + getsizeof(image.data)
        elif isinstance(block, ToolUseBlock):
            size += getsizeof(block.id) + getsizeof(block.name) + _json_size(block.arguments)
        else:
            size += getsizeof(block.sha256) + getsizeof(block.name) + getsizeof(block.data)
    return size


def _encodings(item: ContextItem) -> int:
    """The adapter's encodings of the item's message, estimated: its block JSON (a string,
    about the canonical JSON's length less the keys that differ, plus a string's header)
    and the same text again in the conversation's array, with the turn around it. Within a
    few percent of what tracemalloc sees for text messages of any length."""
    return 2 * len(item.canonical) + _ENCODING_OVERHEAD


# A str's header (49 bytes) and the array's turn wrapper, less the keys the canonical JSON
# has and the block JSON does not (measured; see the module's docstring).
_ENCODING_OVERHEAD = 32


def _fixed_size(item: ContextItem) -> int:
    """The bytes of a one-text-block item's objects, its strings aside (sizes of instances
    of a class with slots and of a one-item tuple are the same for all)."""
    return (
        getsizeof(item)
        + getsizeof(item.message)
        + getsizeof(item.message.content)
        + sum(map(getsizeof, item.message.content))
    )


_ONE_TEXT_BLOCK = _fixed_size(ContextItem(0, Message.user_text("")))


def _json_size(value: object) -> int:
    """Bytes of a JSON value (a tool call's arguments), its containers and their items."""
    size = getsizeof(value)
    if isinstance(value, Mapping):
        size += sum(getsizeof(k) + _json_size(v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        size += sum(_json_size(v) for v in value)
    return size


def _size(items: Sequence[ContextItem]) -> int:
    return sum(map(item_size, items))


class ContextCache:
    def __init__(self, *, max_sessions: int = 256, max_bytes: int = 32_000_000) -> None:
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._max_sessions = max_sessions
        self._max_bytes = max_bytes
        self._size = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        """Bytes held, as measured by :func:`item_size`."""
        return self._size

    def figures(self) -> dict[str, int]:
        """What ``geodebot status`` shows of it: sessions and bytes held, and the bound."""
        return {"sessions": len(self), "bytes": self._size, "max_bytes": self._max_bytes}

    def get(self, session_id: str, generation: int, next_seq: int) -> Context | None:
        """A copy of the context, if the entry is still the session's current context."""
        entry = self._entries.get(session_id)
        if entry is None or (entry.generation, entry.next_seq) != (generation, next_seq):
            return None
        self.hits += 1
        self._entries.move_to_end(session_id)
        return entry.items.copy()

    def put(
        self, session_id: str, generation: int, next_seq: int, items: Sequence[ContextItem]
    ) -> None:
        """Remember ``items`` as the context while the row reads ``(generation, next_seq)``."""
        if any(item.seq >= next_seq for item in items):
            # Read after a later append than the row says: not a context of that row.
            self.drop(session_id)
            return
        messages = [item.seq for item in items if not item.is_summary]
        floor = min(messages) - 1 if messages else next_seq - 1
        copy = items.copy() if isinstance(items, Context) else Context(items)
        self._set(session_id, _Entry(generation, next_seq, copy, _size(items), floor))

    def appended(
        self,
        session_id: str,
        seqs: Sequence[int],
        messages: Sequence[NewMessage],
        decoded: Sequence[Message] | None = None,
    ) -> None:
        """Apply appends this process committed (``seqs`` as the store assigned them).

        ``decoded``: the messages ``messages`` were encoded from. Kept as they are, the next
        turn's request carries the very objects this one's did, which the adapters' caches
        of encoded history recognise; decoded again, every message would look new."""
        entry = self._entries.get(session_id)
        if entry is None or not seqs:
            return
        if decoded is None:
            decoded = [Message.from_json(new.content) for new in messages]
        items, floor, size = entry.items, entry.floor, entry.size
        for seq, new, message in zip(seqs, messages, decoded, strict=True):
            if seq != entry.next_seq:
                # Someone else appended in between: the entry no longer knows the context.
                self.drop(session_id)
                return
            item = ContextItem(
                seq,
                message,
                is_summary=new.kind == "summary",
                covers_from=new.covers_from,
            )
            if item.is_summary:
                upto = new.covers_to if new.covers_to is not None else seq
                if upto < floor:
                    self.drop(session_id)
                    return
                items = Context([item, *(i for i in items if not i.is_summary and i.seq > upto)])
                floor, size = upto, _size(items)
            else:
                # The common case (a turn's messages) costs only what it adds.
                items.append(item)
                size += item_size(item)
            entry.next_seq = seq + 1
        self._set(session_id, _Entry(entry.generation, entry.next_seq, items, size, floor))

    def drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._size -= entry.size

    def _set(self, session_id: str, entry: _Entry) -> None:
        self.drop(session_id)
        if entry.size > self._max_bytes:
            return
        self._entries[session_id] = entry
        self._size += entry.size
        while len(self._entries) > self._max_sessions or self._size > self._max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self._size -= oldest.size
