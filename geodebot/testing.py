"""Fakes of geodebot's own ports, for tests and benchmarks (ours and users').

``ScriptedLLM`` implements the :class:`~geodebot.engine.llm.types.LLMAdapter` port without any
network: each ``complete`` call takes the next scripted item. Tests of the SDK adapters
themselves use fake HTTP servers instead; this is for exercising the engine.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from geodebot.engine.llm.errors import LLMError, LLMInvalidResponse
from geodebot.engine.llm.types import (
    LLMRequest,
    LLMResponse,
    Message,
    TextBlock,
    ToolUseBlock,
    Usage,
)

Script = LLMResponse | LLMError | Callable[[LLMRequest], LLMResponse]


def text_reply(text: str) -> LLMResponse:
    return LLMResponse(Message("assistant", (TextBlock(text),)), "end_turn", Usage(1, 1))


def tool_reply(*calls: tuple[str, dict[str, Any]], text: str = "") -> LLMResponse:
    blocks: list[TextBlock | ToolUseBlock] = [TextBlock(text)] if text else []
    for index, (name, arguments) in enumerate(calls):
        blocks.append(ToolUseBlock(f"call_{index}", name, arguments))
    return LLMResponse(Message("assistant", tuple(blocks)), "tool_use", Usage(1, 1))


class ScriptedLLM:
    """Answers from a script; when it runs out, ``default`` (if any) answers every call."""

    def __init__(self, script: Iterable[Script] = (), default: Script | None = None) -> None:
        self._script: deque[Script] = deque(script)
        self.default = default
        self.requests: list[LLMRequest] = []

    @property
    def provider(self) -> str:
        return "scripted"

    @property
    def model(self) -> str:
        return "scripted-model"

    def push(self, *items: Script) -> None:
        self._script.extend(items)

    async def complete(self, request: LLMRequest) -> LLMResponse:
        self.requests.append(request)
        await asyncio.sleep(0)
        item = self._script.popleft() if self._script else self.default
        if item is None:
            raise LLMInvalidResponse("the script is exhausted", provider="scripted")
        if isinstance(item, LLMError):
            raise item
        if isinstance(item, LLMResponse):
            return item
        return item(request)

    async def aclose(self) -> None:
        return None
