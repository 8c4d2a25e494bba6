"""A streamed Messages API answer put back together as the body an unstreamed call returns.

The adapter then reads it with the same code as an unstreamed body, so both paths give the
same response for the same answer. The events are the API's own JSON (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``); the
SDK's stream has already skipped ``ping`` and raised ``error`` events.

One difference from an unstreamed body: a streamed ``tool_use`` block carries its input as
the JSON text it arrived in, under ``partial_json``, because only the whole text can be
parsed, and it may not parse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StreamedMessage:
    """Accumulates raw stream events; :attr:`done` once ``message_stop`` has arrived.

    A malformed event raises ``KeyError``, ``TypeError`` or ``ValueError``, as a malformed
    unstreamed body does when it is read."""

    def __init__(self, on_text: Callable[[str], None]) -> None:
        self._on_text = on_text
        self._message: dict[str, Any] | None = None
        self._blocks: list[tuple[int, dict[str, Any]]] = []  # (index, content_block_start's)
        # Per content block index, the pieces of its text or input JSON; joined at the end
        # rather than appended to a string, which would cost time quadratic in the answer.
        self._pieces: dict[int, list[str]] = {}
        self.done = False

    @property
    def started(self) -> bool:
        return self._message is not None

    def add(self, event: Any) -> None:
        kind = event["type"]
        if kind == "message_start":
            self._start(event["message"])
            return
        message = self._message
        if message is None:
            raise ValueError(f"stream event {kind!r} before message_start")
        if kind == "content_block_start":
            self._block_start(int(event["index"]), event["content_block"])
        elif kind == "content_block_delta":
            self._delta(int(event["index"]), event["delta"])
        elif kind == "message_delta":
            _message_delta(message, event)
        elif kind == "message_stop":
            self.done = True
        # content_block_stop needs nothing (blocks are finished in body()); event types newer
        # than this code are skipped, as the SDK's own accumulator skips them.

    def body(self) -> dict[str, Any]:
        """The message as an unstreamed call would have returned it."""
        if self._message is None:
            raise ValueError("no message_start in the stream")
        content: list[dict[str, Any]] = []
        for index, start in self._blocks:
            block, pieces = dict(start), self._pieces[index]
            if block["type"] == "text":
                block["text"] = "".join(pieces)
            elif block["type"] == "tool_use" and pieces:
                block["partial_json"] = "".join(pieces)
            content.append(block)
        return {**self._message, "content": content}

    def _start(self, message: Any) -> None:
        if self._message is not None:
            raise ValueError("a second message_start in the stream")
        if not isinstance(message, dict):
            raise TypeError("message_start without a message object")
        self._message = dict(message)

    def _block_start(self, index: int, block: Any) -> None:
        if index in self._pieces:
            raise ValueError(f"content block {index} started twice")
        if not isinstance(block, dict):
            raise TypeError("content_block_start without a content block object")
        self._pieces[index] = []
        self._blocks.append((index, block))

    def _delta(self, index: int, delta: Any) -> None:
        kind = delta["type"]
        if kind == "text_delta":
            text = str(delta["text"])
            self._pieces[index].append(text)
            self._on_text(text)
        elif kind == "input_json_delta":
            self._pieces[index].append(str(delta["partial_json"]))
        # thinking, signature and citations deltas are not visible text and are not kept,
        # as the unstreamed path keeps no thinking blocks either.


def _message_delta(message: dict[str, Any], event: Any) -> None:
    delta = event["delta"]
    message["stop_reason"] = delta.get("stop_reason")
    message["stop_sequence"] = delta.get("stop_sequence")
    # The counts are running totals, so they replace; one left out (null or absent) keeps
    # what message_start said.
    usage = message["usage"] = dict(message["usage"])
    for key, value in event["usage"].items():
        if value is not None:
            usage[key] = value
