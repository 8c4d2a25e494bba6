"""A stream listener as the adapters and ``ResilientLLM`` call it.

The listener belongs to the chat side (it edits a preview message); whatever goes wrong in it
must not change whether the model call succeeds, so a failure is logged and the call goes on.
"""

from __future__ import annotations

import logging

from geodebot.engine.llm.types import StreamEvent, StreamListener, StreamRestart, TextDelta

log = logging.getLogger(__name__)


class GuardedListener:
    """Calls ``listener``, logging instead of raising, and remembers whether text went out."""

    __slots__ = ("_failures", "_listener", "streamed_text")

    def __init__(self, listener: StreamListener) -> None:
        self._listener = listener
        self._failures = 0
        # True once a TextDelta has reached the listener: the chat may show text that a
        # failure of this attempt would leave truncated.
        self.streamed_text = False

    def __call__(self, event: StreamEvent) -> None:
        if isinstance(event, TextDelta):
            if not event.text:
                return  # nothing to show; the chat side need not handle empty pieces
            self.streamed_text = True
        try:
            self._listener(event)
        except Exception:
            # One traceback per call is enough: a broken preview fails on every piece.
            self._failures += 1
            if self._failures == 1:
                log.exception("the stream listener failed; the model call goes on")

    def text(self, text: str) -> None:
        self(TextDelta(text))

    def restart(self, reason: str) -> None:
        self(StreamRestart(reason))
