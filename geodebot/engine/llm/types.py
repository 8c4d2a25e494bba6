"""Provider-neutral request and response types.

Provider-specific data (Anthropic content blocks, OpenAI tool_call objects) never leaves its
adapter: the engine, the store and the timeline see only these frozen dataclasses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from json.encoder import (  # type: ignore[attr-defined]  # c_make_encoder is untyped
    c_make_encoder,
    encode_basestring,
)
from typing import Any, Literal, Protocol

Role = Literal["user", "assistant"]
StopReason = Literal["end_turn", "tool_use", "max_tokens", "refusal", "other"]


@dataclass(frozen=True, slots=True)
class TextBlock:
    text: str
    type: Literal["text"] = "text"


@dataclass(frozen=True, slots=True)
class ToolUseBlock:
    """A tool call the model proposed.

    ``arguments`` is what the model sent, parsed. When the model sent something that is not a
    JSON object (OpenAI sends arguments as a string, which may be garbage), ``arguments`` is
    empty and ``arguments_error`` says why; the tool layer answers such a call with an error
    result instead of running it.
    """

    id: str
    name: str
    arguments: Mapping[str, Any]
    arguments_error: str | None = None
    type: Literal["tool_use"] = "tool_use"


@dataclass(frozen=True, slots=True)
class ImageData:
    """An image a tool returned (a screenshot): base64 of the bytes, and their media type."""

    media_type: str
    data: str


@dataclass(frozen=True, slots=True)
class ToolResultBlock:
    tool_use_id: str
    content: str
    is_error: bool = False
    type: Literal["tool_result"] = "tool_result"
    images: tuple[ImageData, ...] = ()


@dataclass(frozen=True, slots=True)
class FileBlock:
    """A file a user sent (an image, a PDF, a text file), by reference: the history keeps
    its digest in the file store, never its bytes. ``data`` (base64) is filled only in the
    request being sent (see engine/attachments.py) and never stored; an adapter given a
    block without data shows the model a line naming the file instead."""

    sha256: str
    media_type: str
    name: str
    size: int
    data: str = ""
    type: Literal["file"] = "file"

    @property
    def note(self) -> str:
        """The one line that stands for the file where its content is not shown."""
        return f"[file {self.name} ({self.media_type}, {human_size(self.size)}) not shown here]"


Block = TextBlock | ToolUseBlock | ToolResultBlock | FileBlock


def human_size(size: int) -> str:
    if size < 1000:
        return f"{size} bytes"
    if size < 1000 * 1000:
        return f"{size / 1000:.1f} KB"
    return f"{size / 1000 / 1000:.1f} MB"


# weakref_slot: the engine may keep per-message data only as long as the message lives.
@dataclass(frozen=True, slots=True, weakref_slot=True)
class Message:
    role: Role
    content: tuple[Block, ...]
    # The Anthropic adapter's encoding of the message, made at its first request and kept
    # with it (see anthropic_json.MessageJSON): a message is immutable, and a long session's
    # history goes whole with every request. Not part of the value, and not copied by
    # dataclasses.replace (init=False): a changed message is encoded anew.
    wire: object = field(default=None, init=False, compare=False, repr=False)

    @staticmethod
    def user_text(text: str) -> Message:
        return Message("user", (TextBlock(text),))

    @staticmethod
    def assistant_text(text: str) -> Message:
        return Message("assistant", (TextBlock(text),))

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def tool_uses(self) -> tuple[ToolUseBlock, ...]:
        return tuple(b for b in self.content if isinstance(b, ToolUseBlock))

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "content": [block_to_json(b) for b in self.content]}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Message:
        role = data["role"]
        if role not in ("user", "assistant"):
            raise ValueError(f"unknown message role {role!r}")
        return Message(role, tuple(block_from_json(b) for b in data["content"]))


def block_to_json(block: Block) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, FileBlock):
        # The bytes are never part of the history: only the reference is.
        return {
            "type": "file",
            "sha256": block.sha256,
            "media_type": block.media_type,
            "name": block.name,
            "size": block.size,
        }
    if isinstance(block, ToolUseBlock):
        out: dict[str, Any] = {
            "type": "tool_use",
            "id": block.id,
            "name": block.name,
            "arguments": dict(block.arguments),
        }
        if block.arguments_error is not None:
            out["arguments_error"] = block.arguments_error
        return out
    result: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": block.tool_use_id,
        "content": block.content,
        "is_error": block.is_error,
    }
    if block.images:
        result["images"] = [{"media_type": i.media_type, "data": i.data} for i in block.images]
    return result


def block_from_json(data: Mapping[str, Any]) -> Block:
    kind = data.get("type")
    if kind == "text":
        return TextBlock(str(data["text"]))
    if kind == "tool_use":
        return ToolUseBlock(
            id=str(data["id"]),
            name=str(data["name"]),
            arguments=dict(data.get("arguments") or {}),
            arguments_error=data.get("arguments_error"),
        )
    if kind == "file":
        return FileBlock(
            sha256=str(data["sha256"]),
            media_type=str(data["media_type"]),
            name=str(data["name"]),
            size=int(data["size"]),
        )
    if kind == "tool_result":
        return ToolResultBlock(
            tool_use_id=str(data["tool_use_id"]),
            content=str(data["content"]),
            is_error=bool(data.get("is_error", False)),
            images=tuple(
                ImageData(str(i["media_type"]), str(i["data"])) for i in data.get("images") or ()
            ),
        )
    raise ValueError(f"unknown content block type {kind!r}")


@dataclass(frozen=True, slots=True)
class ToolSchema:
    """What the model is shown of a tool: name, description and JSON schema of its input."""

    name: str
    description: str
    input_schema: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class LLMRequest:
    system: str
    messages: tuple[Message, ...]
    tools: tuple[ToolSchema, ...] = ()
    max_tokens: int = 4096
    temperature: float | None = None
    # The caller's estimate of the input's tokens (the loop has it at hand); None: the
    # budgets estimate it from the request (see engine/spend.py).
    estimated_input_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one or more model calls. ``input_tokens`` counts every input token, those
    read from and written to the provider's prompt cache included; the two cache fields say
    how many of them were."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cache_read_tokens + other.cache_read_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
        )

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class LLMResponse:
    message: Message
    stop_reason: StopReason
    usage: Usage = field(default_factory=Usage)
    provider: str = ""
    model: str = ""
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    """The next piece of the answer's visible text, as the provider streams it."""

    text: str


@dataclass(frozen=True, slots=True)
class StreamRestart:
    """The stream broke, or the call is being retried or falling back: every TextDelta
    streamed so far is void, and the answer (if any) starts again from nothing."""

    reason: str


StreamEvent = TextDelta | StreamRestart
# Called synchronously from inside the model call, so it must be cheap; an exception it
# raises is logged and ignored (a chat preview that fails must not fail the answer).
StreamListener = Callable[[StreamEvent], None]


class LLMAdapter(Protocol):
    """One provider behind one narrow method.

    ``complete`` makes exactly one attempt (no SDK retries) and raises an
    :class:`~geodebot.engine.llm.errors.LLMError` subclass on failure; retries and fallbacks
    are the job of :class:`~geodebot.engine.llm.resilient.ResilientLLM`.

    With ``on_stream`` the attempt is streamed: the listener gets each piece of visible text
    as it arrives, and the returned response is the one the same answer would have given
    unstreamed. A stream that breaks raises the same classified errors; one that ends without
    its terminal event is an error too, never a silently truncated answer.
    """

    @property
    def provider(self) -> str: ...

    @property
    def model(self) -> str: ...

    async def complete(
        self, request: LLMRequest, *, on_stream: StreamListener | None = None
    ) -> LLMResponse: ...

    async def aclose(self) -> None: ...


def compact_encoder(*, sort_keys: bool, allow_nan: bool = True) -> Callable[[Any], str]:
    """``json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=...,
    allow_nan=...)`` as a function giving the same text.

    ``json.dumps`` with arguments builds a ``JSONEncoder`` and its C encoder on every call,
    which costs twice what encoding a chat message does; every message of a history that is
    read again goes through here. This builds the C encoder per call only (it holds the
    per-call circular-reference markers), where the interpreter has one."""
    fallback = json.JSONEncoder(
        ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys, allow_nan=allow_nan
    )
    make = c_make_encoder
    if make is None:
        return fallback.encode
    default = fallback.default

    def encode(value: Any) -> str:
        if isinstance(value, str):
            return encode_basestring(value)
        return "".join(
            make({}, default, encode_basestring, None, ":", ",", sort_keys, False, allow_nan)(
                value, 0
            )
        )

    return encode


_canonical = compact_encoder(sort_keys=True)


def canonical_json(value: Any) -> str:
    """Stable JSON used for hashing and storage."""
    return _canonical(value)
