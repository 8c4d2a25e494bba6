"""A streamed Chat Completions answer put back together as the ``ChatCompletion`` an
unstreamed call returns.

The adapter then reads it with the same code as an unstreamed response, so both paths give
the same result for the same answer. Only the first choice is kept (geodebot never asks for
more than one), and its pieces are joined once at the end rather than appended to strings,
which would cost time quadratic in the answer. The SDK's own accumulator
(``ChatCompletionStreamState``) is not used for that reason: it re-dumps the whole message at
every chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall


@dataclass(slots=True)
class _Call:
    id: str = ""
    name: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


class StreamedCompletion:
    """Accumulates ``chat.completion.chunk`` objects; :attr:`done` once the choice has its
    ``finish_reason`` (the usage chunk and ``[DONE]`` that follow carry no answer)."""

    def __init__(self, on_text: Callable[[str], None]) -> None:
        self._on_text = on_text
        self._first: ChatCompletionChunk | None = None
        self._content: list[str] = []
        self._refusal: list[str] = []
        self._calls: dict[int, _Call] = {}
        self._finish_reason: str | None = None
        self._usage: CompletionUsage | None = None

    @property
    def started(self) -> bool:
        return self._first is not None

    @property
    def done(self) -> bool:
        return self._finish_reason is not None

    def add(self, chunk: ChatCompletionChunk) -> None:
        if self._first is None:
            self._first = chunk
        if chunk.usage is not None:
            self._usage = chunk.usage
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            delta = choice.delta
            # Both are what the unstreamed answer shows as text; reasoning fields that some
            # compatible servers add (reasoning_content) are not read, so never shown.
            if delta.content:
                self._content.append(delta.content)
                self._on_text(delta.content)
            if delta.refusal:
                self._refusal.append(delta.refusal)
                self._on_text(delta.refusal)
            for call in delta.tool_calls or ():
                self._add_call(call)
            if choice.finish_reason is not None:
                self._finish_reason = choice.finish_reason

    def completion(self) -> ChatCompletion:
        """The answer as an unstreamed call would have returned it."""
        first = self._first
        if first is None:
            raise ValueError("no chunk in the stream")
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self._content) or None,
            "refusal": "".join(self._refusal) or None,
        }
        if self._calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "".join(call.name), "arguments": "".join(call.arguments)},
                }
                for _, call in sorted(self._calls.items())
            ]
        choice = {"index": 0, "message": message, "finish_reason": self._finish_reason}
        # construct(), as the SDK builds an unstreamed response: nested models, no validation.
        return ChatCompletion.construct(
            id=first.id,
            object="chat.completion",
            created=first.created,
            model=first.model,
            choices=[choice],
            usage=None if self._usage is None else self._usage.to_dict(),
        )

    def _add_call(self, delta: ChoiceDeltaToolCall) -> None:
        call = self._calls.setdefault(delta.index, _Call())
        # The id comes once, in the call's first fragment; a server that repeats it must not
        # make it grow. The name and the arguments come in pieces, joined as the SDK joins them.
        if delta.id and not call.id:
            call.id = delta.id
        function = delta.function
        if function is not None:
            if function.name:
                call.name.append(function.name)
            if function.arguments:
                call.arguments.append(function.arguments)
