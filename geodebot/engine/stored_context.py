"""A session's context decoded from the rows the store holds, in one pass.

This is what a turn pays when its session's context is not cached (the first turn after a
restart, or after the cache let the session go): the whole history, every message decoded.
The plain way, ``Message.from_json(json.loads(content))`` and then the item's canonical JSON
encoded again, builds dicts only to take them apart and escapes every string a second time.

Most of a chat's history is messages of text blocks only, which the store writes in one
compact form (see :class:`~geodebot.store.records.ContextRow`). Such a row is read here
straight from its text: each string by the scanner ``json.loads`` uses, so it decodes (and
refuses) exactly what ``json.loads`` would, and the item's canonical JSON is put together
from the strings' JSON as stored where that is the JSON ``canonical_json`` writes (no
escapes in it), encoded anew where not. Anything not in exactly that form goes the plain
way: the form is relied on for speed only, never for what is decoded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from json import decoder
from json.encoder import encode_basestring

from geodebot.engine.compaction import ContextItem, text_item
from geodebot.engine.llm.types import Block, Message, Role, TextBlock
from geodebot.store.records import ContextRow

__all__ = ["decode_context"]

# json.loads' own string scanner: (the string, the index after it) of the JSON string whose
# opening quote is just before the index given.
_scan: Callable[[str, int], tuple[str, int]] = decoder.scanstring  # type: ignore[attr-defined]

# A message of text blocks as the store writes it (Message.to_json's key order, compact):
# the head of its role, each block's text as a JSON string, blocks joined by _NEXT, then _END.
_USER = '{"role":"user","content":[{"type":"text","text":"'
_ASSISTANT = '{"role":"assistant","content":[{"type":"text","text":"'
_NEXT = '},{"type":"text","text":"'
_END = "}]}"


def decode_context(rows: Iterable[ContextRow]) -> list[ContextItem]:
    """The context items of ``rows`` (as ``load_context_json`` returns them), equal to
    ``ContextItem(seq, Message.from_json(json.loads(content)), kind == "summary",
    covers_from)`` for each, canonical JSON included."""
    items: list[ContextItem] = []
    append = items.append
    for seq, kind, covers_from, content in rows:
        item = _text_item(seq, kind == "summary", covers_from, content)
        if item is None:
            message = Message.from_json(json.loads(content))
            item = ContextItem(seq, message, kind == "summary", covers_from)
        append(item)
    return items


def _text_item(
    seq: int, is_summary: bool, covers_from: int | None, text: str
) -> ContextItem | None:
    """The item of a message of text blocks in the exact stored form; None for anything
    else (see the module's docstring)."""
    role: Role
    if text.startswith(_USER):
        role, at = "user", len(_USER)
    elif text.startswith(_ASSISTANT):
        role, at = "assistant", len(_ASSISTANT)
    else:
        return None
    blocks: list[Block] = []
    parts: list[str] = []  # each block's canonical JSON
    while True:
        opening = at - 1  # the string's opening quote
        try:
            value, at = _scan(text, at)
        except ValueError:
            return None  # not a JSON string: the plain way reports it
        stored = text[opening:at]
        # Without a backslash the stored JSON of the string is the string in quotes, which
        # is what encode_basestring writes (a quote or a control character would have had
        # to be escaped); with one it may be escaped another valid way.
        escaped = stored if "\\" not in stored else encode_basestring(value)
        if not text.startswith(_NEXT, at):
            break
        blocks.append(TextBlock(value))
        parts.append(f'{{"text":{escaped},"type":"text"}}')
        at += len(_NEXT)
    if text[at:] != _END:
        return None
    # canonical_json(message.to_json()): keys sorted, compact (see ContextItem).
    if not blocks:  # one block, most messages: no lists to join
        canonical = f'{{"content":[{{"text":{escaped},"type":"text"}}],"role":"{role}"}}'
        message = Message(role, (TextBlock(value),))
    else:
        blocks.append(TextBlock(value))
        parts.append(f'{{"text":{escaped},"type":"text"}}')
        canonical = f'{{"content":[{",".join(parts)}],"role":"{role}"}}'
        message = Message(role, tuple(blocks))
    return text_item(seq, message, is_summary, covers_from, canonical)
