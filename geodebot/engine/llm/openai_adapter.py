"""OpenAI Chat Completions adapter (``openai`` SDK 3.x), unstreamed or streamed.

Serves both ``provider="openai"`` and ``provider="openai-compatible"`` (Ollama, vLLM, OpenRouter
and similar servers reached through ``base_url``, which includes ``/v1``). Chat Completions is
used rather than the Responses API because it is the dialect those servers actually speak.

As with the Anthropic adapter, one call is one HTTP attempt (``max_retries=0``) and every SDK
exception is mapped once into :mod:`geodebot.engine.llm.errors`.

A streamed call asks for the usage chunk (``stream_options.include_usage``) and is put back
together by :class:`~geodebot.engine.llm.openai_stream.StreamedCompletion` into the
``ChatCompletion`` an unstreamed call returns, which is then read by the same code.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import openai
from openai.types import CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionAssistantMessageParam,
    ChatCompletionContentPartImageParam,
    ChatCompletionContentPartParam,
    ChatCompletionContentPartTextParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
)

from geodebot.engine.llm.common import ErrorText, connection_detail, retry_after
from geodebot.engine.llm.errors import (
    LLMAuthError,
    LLMBadRequest,
    LLMBillingError,
    LLMConnectionError,
    LLMContextOverflow,
    LLMError,
    LLMInvalidResponse,
    LLMMissingCredential,
    LLMRateLimited,
    LLMServerError,
    LLMTimeoutError,
)
from geodebot.engine.llm.openai_stream import StreamedCompletion
from geodebot.engine.llm.stream_listener import GuardedListener
from geodebot.engine.llm.types import (
    Block,
    FileBlock,
    LLMRequest,
    LLMResponse,
    Message,
    StopReason,
    StreamListener,
    TextBlock,
    ToolResultBlock,
    ToolSchema,
    ToolUseBlock,
    Usage,
)
from geodebot.engine.llm.untrusted import clean_text, tool_use_json
from geodebot.logs.redact import Redactor

DEFAULT_BASE_URL = "https://api.openai.com/v1"

_FINISH_REASONS: dict[str, StopReason] = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}

# Compatible servers word their errors freely, so message text backs up the OpenAI codes.
_CONTEXT_RE = re.compile(
    r"maximum context length|context (length|window|limit)|prompt is too long|too many tokens",
    re.IGNORECASE,
)
_BILLING_RE = re.compile(
    r"insufficient (credit|funds|quota|balance)|credit balance|billing|payment required",
    re.IGNORECASE,
)
_BILLING_CODES = frozenset({"insufficient_quota", "billing_hard_limit_reached"})
# The SDK parses leniently: a body that is not JSON raises json's own error, and a
# wrong-shaped one only fails when a missing field is read.
_MALFORMED = (AttributeError, KeyError, TypeError, ValueError, RecursionError)


class OpenAIAdapter:
    def __init__(
        self,
        *,
        model: str,
        api_key: str | None,
        api_key_env: str,
        base_url: str | None = None,
        timeout_s: float = 120.0,
        provider: str = "openai",
    ) -> None:
        self._model = model
        self._provider = provider
        self._api_key_env = api_key_env
        self._err = ErrorText(provider, model, Redactor([api_key] if api_key else []))
        self._client: openai.AsyncOpenAI | None = None
        # Without a key the daemon must still start; the first turn explains what to set.
        if api_key and api_key.strip():
            self._client = openai.AsyncOpenAI(
                api_key=api_key,
                # Explicit so OPENAI_BASE_URL in the daemon's environment cannot silently
                # redirect traffic away from what the config file says.
                base_url=base_url or DEFAULT_BASE_URL,
                timeout=timeout_s,
                max_retries=0,
                # Not the SDK's aiohttp transport (the Anthropic adapter uses its twin): the
                # copy in openai 3.x maps a refused connection to a connect *timeout*, which
                # would tell the operator the wrong thing.
            )

    @property
    def provider(self) -> str:
        return self._provider

    @property
    def model(self) -> str:
        return self._model

    async def complete(
        self, request: LLMRequest, *, on_stream: StreamListener | None = None
    ) -> LLMResponse:
        if self._client is None:
            raise LLMMissingCredential(self._api_key_env, **self._err.ids())
        if on_stream is not None:
            return await self._stream(self._client, request, GuardedListener(on_stream))
        with self._sdk_errors():
            raw = await self._client.chat.completions.with_raw_response.create(
                **self._params(request)
            )
        try:
            # with_raw_response is the SDK's legacy wrapper here: parse() is synchronous.
            return self._response(raw.parse(), raw.request_id)
        except _MALFORMED as exc:
            raise self._malformed("body", exc) from exc

    async def _stream(
        self, client: openai.AsyncOpenAI, request: LLMRequest, listener: GuardedListener
    ) -> LLMResponse:
        completion = StreamedCompletion(lambda text: listener.text(clean_text(text)))
        with self._sdk_errors():
            stream = await client.chat.completions.create(
                **self._params(request), stream=True, stream_options={"include_usage": True}
            )
            async with stream:
                try:
                    async for chunk in stream:
                        completion.add(chunk)
                except _MALFORMED as exc:
                    raise self._malformed("stream chunk", exc) from exc
        if not completion.done:
            raise self._err.unfinished_stream(started=completion.started, end="a finish_reason")
        try:
            return self._response(
                completion.completion(), stream.response.headers.get("x-request-id")
            )
        except _MALFORMED as exc:
            raise self._malformed("streamed completion", exc) from exc

    def _params(self, request: LLMRequest) -> dict[str, Any]:
        # OpenAI's own reasoning models reject max_tokens; compatible servers may not know
        # max_completion_tokens yet, and all of them accept max_tokens.
        limit = request.max_tokens
        return {
            "model": self._model,
            "messages": to_openai_messages(request.system, request.messages),
            "tools": [_tool_param(t) for t in request.tools] if request.tools else openai.omit,
            "max_completion_tokens": limit if self._provider == "openai" else openai.omit,
            "max_tokens": openai.omit if self._provider == "openai" else limit,
            "temperature": openai.omit if request.temperature is None else request.temperature,
        }

    def _malformed(self, what: str, exc: BaseException) -> LLMInvalidResponse:
        return LLMInvalidResponse(self._err.detail(f"malformed {what}: {exc}"), **self._err.ids())

    async def probe(self) -> str:
        """The provider's record of the model, spending no tokens (``geodebot check``)."""
        if self._client is None:
            raise LLMMissingCredential(self._api_key_env, **self._err.ids())
        with self._sdk_errors():
            info = await self._client.models.retrieve(self._model)
        return str(getattr(info, "display_name", None) or info.id)

    @contextlib.contextmanager
    def _sdk_errors(self) -> Iterator[None]:
        """The SDK's exceptions of one request, as our classified errors."""
        try:
            yield
        except openai.APIStatusError as exc:
            raise self._status_error(exc) from exc
        except openai.APITimeoutError as exc:
            raise LLMTimeoutError(self._err.detail("request timed out"), **self._err.ids()) from exc
        except openai.APIConnectionError as exc:
            raise LLMConnectionError(
                self._err.detail(connection_detail(exc)), **self._err.ids()
            ) from exc
        except openai.APIError as exc:
            # The remaining APIError is an error object sent in the middle of a stream.
            raise self._stream_error(exc) from exc
        except openai.OpenAIError as exc:
            # Raised before any HTTP exchange (client-side validation): retrying cannot help.
            raise LLMBadRequest(self._err.detail(f"SDK error: {exc}"), **self._err.ids()) from exc

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _response(self, parsed: object, request_id: str | None) -> LLMResponse:
        if not isinstance(parsed, ChatCompletion) or not parsed.choices:
            raise LLMInvalidResponse(
                self._err.detail("no choices in the response"), **self._err.ids()
            )
        # An empty answer is well-formed (the loop's verifier asks again), so it is returned.
        choice = parsed.choices[0]
        message = choice.message
        blocks: list[Block] = []
        if message.content:
            blocks.append(TextBlock(clean_text(message.content)))
        if message.refusal:
            blocks.append(TextBlock(clean_text(message.refusal)))
        calls = [_tool_use(call) for call in message.tool_calls or ()]
        blocks.extend(calls)
        stop = _FINISH_REASONS.get(str(choice.finish_reason), "other")
        if message.refusal:
            stop = "refusal"
        elif calls and stop == "end_turn":
            # Some compatible servers (Ollama among them) report "stop" next to tool calls.
            stop = "tool_use"
        usage = parsed.usage
        return LLMResponse(
            message=Message("assistant", tuple(blocks)),
            stop_reason=stop,
            usage=_usage(usage),
            provider=self._provider,
            model=self._model,
            request_id=request_id,
        )

    def _status_error(self, exc: openai.APIStatusError) -> LLMError:
        status = exc.status_code
        code = exc.code or ""
        kind = exc.type or ""
        text = _error_message(exc.body)
        label = " ".join(part for part in (kind, code) if part)
        detail = self._err.detail(f"HTTP {status}{f' {label}' if label else ''}: {text}")
        ids = self._err.ids()
        billing = (
            status == 402
            or code in _BILLING_CODES
            or kind in _BILLING_CODES
            or (400 <= status < 500 and status != 429 and bool(_BILLING_RE.search(text)))
        )
        if billing:
            # insufficient_quota arrives as a 429 but waiting does not refill the account.
            return LLMBillingError(detail, status=status, **ids)
        if status == 429 or (status in (503, 529) and "overloaded" in f"{kind} {text}".lower()):
            headers = exc.response.headers
            return LLMRateLimited(detail, retry_after=retry_after(headers), status=status, **ids)
        if status in (401, 403):
            return LLMAuthError(detail, status=status, **ids)
        overflow = code == "context_length_exceeded" or bool(_CONTEXT_RE.search(text))
        # 413 is a body over the size limit: like overflow, only a shorter history fixes it.
        if status == 413 or (400 <= status < 500 and overflow):
            return LLMContextOverflow(detail, status=status, **ids)
        if status == 408:
            return LLMTimeoutError(detail, status=status, **ids)
        if status >= 500:
            return LLMServerError(detail, status=status, **ids)
        if status == 404:
            detail += " (check the model name and that base_url ends in /v1)"
        return LLMBadRequest(detail, status=status, **ids)

    def _stream_error(self, exc: openai.APIError) -> LLMError:
        """An error the server sent in place of the next chunk, after a 200 began the stream:
        a server failure part way through the answer, unless it says rate limit or quota."""
        body = exc.body if isinstance(exc.body, Mapping) else {}
        code, kind = str(body.get("code") or ""), str(body.get("type") or "")
        label = " ".join(part for part in (kind, code) if part) or "error"
        detail = self._err.detail(f"error event in the stream: {label}: {exc.message}")
        ids = self._err.ids()
        if code in _BILLING_CODES or kind in _BILLING_CODES:
            return LLMBillingError(detail, **ids)
        if "rate_limit" in f"{kind} {code}":
            return LLMRateLimited(detail, retry_after=None, status=None, **ids)
        return LLMServerError(detail, **ids)


def to_openai_messages(
    system: str, messages: Sequence[Message]
) -> list[ChatCompletionMessageParam]:
    """Our history in Chat Completions shape.

    Tool results become ``role: tool`` messages placed before any user text of the same turn,
    since the API wants them right after the assistant message that made the calls. A failed
    result is prefixed so the model can tell it from a real answer: the format has no
    ``is_error`` flag.
    """
    out: list[ChatCompletionMessageParam] = []
    if system:
        out.append({"role": "system", "content": system})
    for message in messages:
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        if message.role == "assistant":
            calls = [_call_param(b) for b in message.content if isinstance(b, ToolUseBlock)]
            if not text and not calls:
                continue
            assistant: ChatCompletionAssistantMessageParam = {
                "role": "assistant",
                "content": text or None,
            }
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
            continue
        out += _user_messages(message, text)
    return out


def _user_messages(message: Message, text: str) -> list[ChatCompletionMessageParam]:
    out: list[ChatCompletionMessageParam] = []
    images: list[ChatCompletionContentPartImageParam] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            content = f"ERROR: {block.content}" if block.is_error else block.content
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
            images += [
                {
                    "type": "image_url",
                    "image_url": {"url": f"data:{i.media_type};base64,{i.data}"},
                }
                for i in block.images
            ]
    if images:
        # Chat Completions takes images only in user messages, not in tool results.
        note: ChatCompletionContentPartTextParam = {
            "type": "text",
            "text": "The image(s) the tool calls above returned.",
        }
        out.append({"role": "user", "content": [note, *images]})
    if any(isinstance(b, FileBlock) for b in message.content):
        # Each text and file its own part, in the message's order: a caption, the files,
        # and the notes about files that were not passed on stay apart.
        parts: list[ChatCompletionContentPartParam] = [
            _file_part(b) if isinstance(b, FileBlock) else {"type": "text", "text": b.text}
            for b in message.content
            if isinstance(b, FileBlock) or (isinstance(b, TextBlock) and b.text)
        ]
        out.append({"role": "user", "content": parts})
    elif text:
        out.append({"role": "user", "content": text})
    return out


def _file_part(block: FileBlock) -> ChatCompletionContentPartParam:
    """A user's file as a content part: an image as a data URL, a PDF as a file part (the
    Chat Completions API takes base64 PDFs), anything else, or a file without its bytes in
    this request, as the line that names it."""
    url = f"data:{block.media_type};base64,{block.data}"
    if block.data and block.media_type.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": url}}
    if block.data and block.media_type == "application/pdf":
        return {"type": "file", "file": {"filename": block.name, "file_data": url}}
    return {"type": "text", "text": block.note}


def _call_param(block: ToolUseBlock) -> ChatCompletionMessageFunctionToolCallParam:
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": json.dumps(dict(block.arguments))},
    }


def _tool_param(tool: ToolSchema) -> ChatCompletionFunctionToolParam:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": dict(tool.input_schema),
        },
    }


def _tool_use(call: object) -> ToolUseBlock:
    if not isinstance(call, ChatCompletionMessageFunctionToolCall):
        # Custom (free-text) tools are never offered, so such a call cannot be run.
        call_id, name = str(getattr(call, "id", "")), str(getattr(call, "type", "unknown"))
        return ToolUseBlock(call_id, name, {}, f"unsupported tool call type {name!r}")
    return tool_use_json(call.id, call.function.name, call.function.arguments)


def _error_message(body: object) -> str:
    # The SDK hands over the inner ``error`` object when the body had one.
    if isinstance(body, Mapping):
        message = body.get("message")
        return message if isinstance(message, str) else json.dumps(body, default=str)
    return "" if body is None else str(body)


def _usage(usage: CompletionUsage | None) -> Usage:
    """OpenAI caches long prompts by itself; the part of the prompt it read from its cache is
    reported, and there is no separate price for writing it."""
    if usage is None:
        return Usage()
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return Usage(usage.prompt_tokens, usage.completion_tokens, cache_read_tokens=int(cached))
