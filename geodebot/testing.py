"""Fakes of geodebot's own ports, for tests and benchmarks (ours and users').

``ScriptedLLM`` implements the :class:`~geodebot.engine.llm.types.LLMAdapter` port without any
network: each ``complete`` call takes the next scripted item. ``MemoryChannel`` implements the
chat Channel port in memory. Tests of the SDK adapters themselves use fake servers instead;
these are for exercising the engine and the delivery path.
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from geodebot.channels.base import (
    ApprovalCard,
    ChannelError,
    ChannelStatus,
    Destination,
    FileTooLarge,
    Inbound,
    InboundFile,
    InboundSink,
    OutboundPart,
    Platform,
    Press,
    PressAnswer,
    PressSink,
    SendUnknown,
    SentPart,
)
from geodebot.engine.llm.errors import LLMError, LLMInvalidResponse
from geodebot.engine.llm.types import (
    LLMRequest,
    LLMResponse,
    Message,
    StreamListener,
    TextBlock,
    TextDelta,
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

    async def complete(
        self, request: LLMRequest, *, on_stream: StreamListener | None = None
    ) -> LLMResponse:
        self.requests.append(request)
        await asyncio.sleep(0)
        item = self._script.popleft() if self._script else self.default
        if item is None:
            raise LLMInvalidResponse("the script is exhausted", provider="scripted")
        if isinstance(item, LLMError):
            raise item
        response = item if isinstance(item, LLMResponse) else item(request)
        if on_stream is not None:
            # Streamed word by word, as a provider would.
            for word in re.findall(r"\S+\s*", response.message.text):
                on_stream(TextDelta(word))
                await asyncio.sleep(0)
        return response

    async def aclose(self) -> None:
        return None


class MemoryChannel:
    """An in-memory chat platform implementing the Channel port.

    ``deliver`` plays a platform delivering an event (it awaits the sink, as an adapter would
    before acknowledging); ``sent`` holds every part that went out as a new message, and a
    part with ``edit_of`` edits that message (in ``messages``) instead. ``fail_next`` queues
    send failures (a ChannelError with retry_after for a 429, a SendUnknown, ...). Approval
    cards are kept by message id in ``cards`` (edits replace them); ``press`` plays a
    button press and returns what the presser alone was told. Files users send are served
    from ``files`` (ref -> bytes; ``downloads`` counts fetches per ref; a queued failure
    fails the next download as it fails the next send); files sent are in ``uploads``
    (message id -> the bytes, as read when sent).
    """

    def __init__(self, platform: Platform = "telegram", *, limit: int = 4096) -> None:
        self._platform: Platform = platform
        self.limit = limit
        self.sink: InboundSink | None = None
        self.presses: PressSink | None = None
        self.cards: dict[str, ApprovalCard] = {}
        self.card_chats: dict[str, Destination] = {}
        self.card_edits = 0
        self.sent: list[OutboundPart] = []
        # Every message's current text by id (edits applied), and the edits themselves.
        self.messages: dict[str, str] = {}
        self.edits: list[OutboundPart] = []
        self.deleted: list[str] = []
        self.sent_ids: dict[str, str] = {}
        self.typing_calls: list[Destination] = []
        self.failures: deque[ChannelError] = deque()
        self.lookups_supported = True
        self.files: dict[str, bytes] = {}
        self.downloads: collections.Counter[str] = collections.Counter()
        self.uploads: dict[str, bytes] = {}
        self._ids = 0
        self._changed = asyncio.Condition()

    @property
    def platform(self) -> Platform:
        return self._platform

    @property
    def ingesting(self) -> bool:
        return self.sink is not None

    async def start(self, sink: InboundSink, presses: PressSink | None = None) -> None:
        self.sink, self.presses = sink, presses

    async def start_ingest(self) -> None:
        """Nothing to add: ``deliver`` works once started."""

    async def stop(self) -> None:
        self.sink = None

    async def deliver(self, inbound: Inbound) -> None:
        if self.sink is None:
            raise RuntimeError("MemoryChannel is not started")
        await self.sink(inbound)

    def render(self, markdown: str) -> list[str]:
        text = markdown.strip()
        return [text[i : i + self.limit] for i in range(0, len(text), self.limit)]

    def fail_next(self, *errors: ChannelError) -> None:
        self.failures.extend(errors)

    async def send(self, part: OutboundPart) -> SentPart:
        await asyncio.sleep(0)
        if self.failures:
            error = self.failures.popleft()
            asyncio.get_running_loop().create_task(self._notify())
            if isinstance(error, SendUnknown):
                # The request reached the platform, but nobody heard the answer.
                self._record(part)
            raise error
        return self._record(part)

    def _record(self, part: OutboundPart) -> SentPart:
        if part.edit_of is not None and part.edit_of in self.messages:
            self.messages[part.edit_of] = part.text
            self.edits.append(part)
            asyncio.get_running_loop().create_task(self._notify())
            return SentPart(part.edit_of)
        self._ids += 1
        message_id = str(self._ids)
        if part.file is not None:
            self.uploads[message_id] = part.file.path.read_bytes()
        self.sent.append(part)
        self.messages[message_id] = part.text
        self.sent_ids[part.key] = message_id
        asyncio.get_running_loop().create_task(self._notify())
        return SentPart(message_id)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], object]) -> None:
        """Wait until ``predicate()`` is true, checked after every send, edit and card."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(predicate()))

    async def wait_sent(self, n: int, channel: str | None = None) -> list[str]:
        """Wait until at least ``n`` parts went to ``channel`` (or anywhere); their texts."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.texts(channel)) >= n)
        return self.texts(channel)

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        await asyncio.sleep(0)
        if file.size > max_bytes:
            raise FileTooLarge(max_bytes, file.size)
        if self.failures:
            error = self.failures.popleft()
            asyncio.get_running_loop().create_task(self._notify())
            raise error
        data = self.files.get(file.ref)
        if data is None:
            raise ChannelError(f"no file {file.ref!r}", permanent=True)
        self.downloads[file.ref] += 1
        if len(data) > max_bytes:
            raise FileTooLarge(max_bytes)
        return data

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        if not self.lookups_supported:
            raise NotImplementedError
        message_id = self.sent_ids.get(part.key)
        return SentPart(message_id) if message_id is not None else None

    async def delete(self, destination: Destination, message_id: str) -> None:
        await asyncio.sleep(0)
        if self.messages.pop(message_id, None) is None:
            raise ChannelError("message to delete not found", permanent=True)
        self.deleted.append(message_id)
        asyncio.get_running_loop().create_task(self._notify())

    async def typing(self, destination: Destination) -> None:
        self.typing_calls.append(destination)

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        await asyncio.sleep(0)
        if self.failures:
            raise self.failures.popleft()
        self._ids += 1
        message_id = str(self._ids)
        self.cards[message_id] = card
        self.card_chats[message_id] = destination
        asyncio.get_running_loop().create_task(self._notify())
        return SentPart(message_id)

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        await asyncio.sleep(0)
        if message_id not in self.cards:
            raise ChannelError("message to edit not found", permanent=True)
        self.cards[message_id] = card
        self.card_edits += 1
        asyncio.get_running_loop().create_task(self._notify())

    async def wait_card(
        self, predicate: Callable[[ApprovalCard], bool]
    ) -> tuple[str, ApprovalCard]:
        """Wait until a card matching ``predicate`` is up; its message id and the card."""

        def found() -> tuple[str, ApprovalCard] | None:
            return next(((i, c) for i, c in self.cards.items() if predicate(c)), None)

        async with self._changed:
            await self._changed.wait_for(lambda: found() is not None)
        hit = found()
        assert hit is not None
        return hit

    async def press(
        self, message_id: str, user: str, *, approve: bool = True, channel: str | None = None
    ) -> PressAnswer:
        """``user`` presses Approve (or Deny) on the card ``message_id``, in the card's chat
        unless ``channel`` says otherwise."""
        if self.presses is None:
            raise RuntimeError("MemoryChannel was started without a press sink")
        card = self.cards[message_id]
        return await self.presses(
            Press(
                self._platform,
                channel or self.card_chats[message_id].channel,
                user,
                card.approval_id,
                approve,
                message_id,
            )
        )

    def status(self) -> ChannelStatus:
        return ChannelStatus(self._platform, self.sink is not None)

    def texts(self, channel: str | None = None) -> list[str]:
        return [p.text for p in self.sent if channel is None or p.destination.channel == channel]
