"""Anthropic Messages API adapter (``anthropic`` SDK 2.x), unstreamed or streamed.

One call to :meth:`AnthropicAdapter.complete` is one HTTP attempt: the SDK client is built with
``max_retries=0`` because retries and fallbacks belong to ``ResilientLLM``, which needs to see
every failure to put it on the timeline. Every SDK exception is mapped here, once, into the
:mod:`geodebot.engine.llm.errors` tree; nothing Anthropic-specific leaves this module.

SDK 2.x notes that shape this file: it speaks API version 2026-10-21, sends the key as
``Authorization: Bearer``, and no longer has sampling parameters (the API answers 400 to
``temperature``), so ``LLMRequest.temperature`` is not sent.

A streamed call goes through the SDK's own event stream (``AsyncStream``: its SSE decoding,
``ping`` skipping and ``error`` events raised as status errors) and is put back together by
:class:`~geodebot.engine.llm.anthropic_stream.StreamedMessage` into the body an unstreamed
call returns, which is then read by the same code.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import anthropic
import httpx2
from anthropic import AsyncStream
from anthropic.types import (
    ToolParam,
)

from geodebot.engine.llm.anthropic_json import HistoryJSON, MessageJSON, dumps
from geodebot.engine.llm.anthropic_stream import StreamedMessage
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
from geodebot.engine.llm.stream_listener import GuardedListener
from geodebot.engine.llm.types import (
    Block,
    LLMRequest,
    LLMResponse,
    Message,
    StopReason,
    StreamListener,
    TextBlock,
    ToolSchema,
    ToolUseBlock,
    Usage,
)
from geodebot.engine.llm.untrusted import clean_text, loads_response, tool_use, tool_use_json
from geodebot.logs.redact import Redactor

PROVIDER = "anthropic"
DEFAULT_BASE_URL = "https://api.anthropic.com"

_STOP_REASONS: dict[str, StopReason] = {
    "end_turn": "end_turn",
    "stop_sequence": "end_turn",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
    # The output was cut short because the context filled up: to the loop that is the same
    # situation as hitting max_tokens (a truncated answer), not a failed request.
    "model_context_window_exceeded": "max_tokens",
    "refusal": "refusal",
}

# Wording is not a stable API, so these are the fallback after status, type and error_code.
_CONTEXT_RE = re.compile(
    r"prompt is too long|context (length|window|limit)|too many (input )?tokens", re.IGNORECASE
)
_BILLING_RE = re.compile(
    r"credit balance|billing|insufficient (credit|funds|quota)|spend(ing)? limit|payment",
    re.IGNORECASE,
)
# SDK 2.x reports spend caps as 429s; waiting does not lift them, so they are billing errors.
_SPEND_LIMIT_CODES = frozenset({"contract_spend_limit_reached", "enforced_spend_limit_reached"})
# Prompt caching: a breakpoint on the tools and one on the system prompt (they change only
# with the configuration), and two in the history (see anthropic_json._Turns.text); four is
# the most the API takes. A prefix shorter than the model's minimum is simply not cached.
_EPHEMERAL: dict[str, object] = {"cache_control": {"type": "ephemeral"}}
# What a body that cannot be read raises while it is read (a value of the wrong shape, JSON
# that is not JSON, nesting too deep for the parser).
_MALFORMED = (AttributeError, KeyError, TypeError, ValueError, RecursionError)


class AnthropicAdapter:
    def __init__(
        self,
        *,
        model: str,
        api_key: str | None,
        api_key_env: str,
        base_url: str | None = None,
        timeout_s: float = 120.0,
        prompt_cache: bool = True,
    ) -> None:
        self._model = model
        self._prompt_cache = prompt_cache
        self._api_key_env = api_key_env
        self._err = ErrorText(PROVIDER, model, Redactor([api_key] if api_key else []))
        self._client: anthropic.AsyncAnthropic | None = None
        self._history = HistoryJSON(MessageJSON())
        # Without a key the daemon must still start; the first turn explains what to set.
        if api_key and api_key.strip():
            self._client = anthropic.AsyncAnthropic(
                api_key=api_key,
                # Explicit so ANTHROPIC_BASE_URL in the daemon's environment cannot silently
                # redirect traffic that the config file says goes to Anthropic.
                base_url=base_url or DEFAULT_BASE_URL,
                timeout=timeout_s,
                max_retries=0,
                # The SDK's own aiohttp transport: about a quarter less CPU per request than
                # its default httpx/httpcore stack, which a busy daemon pays on every turn.
                http_client=anthropic.DefaultAioHttpClient(),
            )

    @property
    def provider(self) -> str:
        return PROVIDER

    @property
    def model(self) -> str:
        return self._model

    async def complete(
        self, request: LLMRequest, *, on_stream: StreamListener | None = None
    ) -> LLMResponse:
        if self._client is None:
            raise LLMMissingCredential(self._api_key_env, provider=PROVIDER, model=self._model)
        if on_stream is not None:
            return await self._stream(self._client, request, GuardedListener(on_stream))
        with self._sdk_errors():
            content = self._body(request)
            # The SDK's documented call for a raw request: its transport, headers, auth and
            # error classes, without building its pydantic Message only for this adapter to
            # copy it into ours (a tenth of the daemon's CPU per turn at saturation). The body
            # goes as encoded bytes: given a dict, the SDK deep-copies and walks the whole
            # conversation on every request before encoding it, as much CPU again as the
            # encoding; our history is plain JSON values, which need neither.
            raw = await self._client.post("/v1/messages", content=content, cast_to=httpx2.Response)
        try:
            return self._response(loads_response(raw.content), raw.headers.get("request-id"))
        except _MALFORMED as exc:
            # A body that is not JSON, or a JSON value of the wrong shape.
            raise self._malformed("body", exc) from exc

    async def _stream(
        self, client: anthropic.AsyncAnthropic, request: LLMRequest, listener: GuardedListener
    ) -> LLMResponse:
        message = StreamedMessage(lambda text: listener.text(clean_text(text)))
        with self._sdk_errors():
            content = self._body(request, stream=True)
            # The raw-body request of complete(), streamed: the SDK's own event stream, with
            # each event left as its JSON (cast to object) for StreamedMessage to read.
            stream = await client.post(
                "/v1/messages",
                content=content,
                cast_to=object,
                stream=True,
                stream_cls=AsyncStream[object],
            )
            async with stream:
                try:
                    async for event in stream:
                        message.add(event)
                except _MALFORMED as exc:
                    raise self._malformed("stream event", exc) from exc
        if not message.done:
            raise self._err.unfinished_stream(started=message.started, end="message_stop")
        try:
            return self._response(message.body(), stream.response.headers.get("request-id"))
        except _MALFORMED as exc:
            raise self._malformed("streamed message", exc) from exc

    def _malformed(self, what: str, exc: BaseException) -> LLMInvalidResponse:
        return LLMInvalidResponse(self._err.detail(f"malformed {what}: {exc!r}"), **self._err.ids())

    def _body(self, request: LLMRequest, *, stream: bool = False) -> bytes:
        """The request body as the SDK itself would encode it (compact UTF-8, no NaN), the
        history from the messages' cached JSON."""
        head: dict[str, object] = {"model": self._model, "max_tokens": request.max_tokens}
        cache = self._prompt_cache
        if request.system:
            if cache:
                head["system"] = [{"type": "text", "text": request.system, **_EPHEMERAL}]
            else:
                head["system"] = request.system
        if request.tools:
            tools: list[dict[str, object]] = [dict(_tool_param(t)) for t in request.tools]
            if cache:
                tools[-1].update(_EPHEMERAL)
            head["tools"] = tools
        if stream:
            head["stream"] = True
        try:
            messages = self._history(request.messages, cache=cache)
            return f'{dumps(head)[:-1]},"messages":{messages}}}'.encode()
        except (TypeError, ValueError) as exc:
            # A tool schema or argument that is not JSON; the SDK would refuse it the same way.
            raise anthropic.AnthropicError(f"request body is not JSON: {exc}") from exc

    async def probe(self) -> str:
        """The provider's record of the model, spending no tokens (``geodebot check``)."""
        if self._client is None:
            raise LLMMissingCredential(self._api_key_env, provider=PROVIDER, model=self._model)
        with self._sdk_errors():
            info = await self._client.models.retrieve(self._model)
        return str(getattr(info, "display_name", None) or info.id)

    @contextlib.contextmanager
    def _sdk_errors(self) -> Iterator[None]:
        """The SDK's exceptions of one request, as our classified errors."""
        try:
            yield
        except anthropic.APIStatusError as exc:
            # The SDK raises an in-stream error event as a status error of the 200 response.
            if exc.status_code < 400:
                raise self._stream_error(exc) from exc
            raise self._status_error(exc) from exc
        except anthropic.APITimeoutError as exc:
            raise LLMTimeoutError(self._err.detail("request timed out"), **self._err.ids()) from exc
        except anthropic.APIConnectionError as exc:
            raise LLMConnectionError(
                self._err.detail(connection_detail(exc)), **self._err.ids()
            ) from exc
        # While a stream is read the SDK lets its transport's errors through unwrapped.
        except httpx2.TimeoutException as exc:
            raise LLMTimeoutError(self._err.detail("stream timed out"), **self._err.ids()) from exc
        except httpx2.TransportError as exc:
            detail = f"the stream broke ({type(exc).__name__}: {exc})"
            raise LLMConnectionError(self._err.detail(detail), **self._err.ids()) from exc
        except anthropic.AnthropicError as exc:
            # Raised before any HTTP exchange (client-side validation): retrying cannot help.
            raise LLMBadRequest(self._err.detail(f"SDK error: {exc}"), **self._err.ids()) from exc

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _response(self, data: object, request_id: str | None) -> LLMResponse:
        if not isinstance(data, dict) or data.get("type") != "message":
            raise LLMInvalidResponse(
                self._err.detail("body is not a message object"), **self._err.ids()
            )
        blocks: list[Block] = []
        for block in data["content"]:
            kind = block["type"]
            if kind == "text":
                if block["text"]:
                    blocks.append(TextBlock(clean_text(str(block["text"]))))
            elif kind == "tool_use":
                blocks.append(_tool_use(block))
            # Thinking and server-tool blocks are never requested; nothing to map them to.
        # An empty answer is well-formed (the loop's verifier asks again), so it is returned.
        stop: StopReason = _STOP_REASONS.get(str(data.get("stop_reason")), "other")
        usage = data["usage"]
        cache_write = int(usage.get("cache_creation_input_tokens") or 0)
        cache_read = int(usage.get("cache_read_input_tokens") or 0)
        return LLMResponse(
            message=Message("assistant", tuple(blocks)),
            stop_reason=stop,
            usage=Usage(
                int(usage["input_tokens"]) + cache_write + cache_read,
                int(usage["output_tokens"]),
                cache_read,
                cache_write,
            ),
            provider=PROVIDER,
            model=self._model,
            request_id=request_id,
        )

    def _status_error(self, exc: anthropic.APIStatusError) -> LLMError:
        status = exc.status_code
        kind = exc.type or ""
        text = exc.api_message or _body_text(exc.body)
        detail = self._err.detail(f"HTTP {status}{f' {kind}' if kind else ''}: {text}")
        ids = self._err.ids()
        billing = (
            status == 402
            or kind == "billing_error"
            or exc.error_code in _SPEND_LIMIT_CODES
            or (400 <= status < 500 and status != 429 and bool(_BILLING_RE.search(text)))
        )
        if billing:
            return LLMBillingError(detail, status=status, **ids)
        if status in (429, 529) or kind in ("rate_limit_error", "overloaded_error"):
            return LLMRateLimited(
                detail, retry_after=retry_after(exc.response.headers), status=status, **ids
            )
        if status in (401, 403):
            return LLMAuthError(detail, status=status, **ids)
        # 413 is a body over the size limit: like overflow, only a shorter history fixes it.
        if status == 413 or (400 <= status < 500 and _CONTEXT_RE.search(text)):
            return LLMContextOverflow(detail, status=status, **ids)
        if status == 408:
            return LLMTimeoutError(detail, status=status, **ids)
        if status >= 500:
            return LLMServerError(detail, status=status, **ids)
        return LLMBadRequest(detail, status=status, **ids)

    def _stream_error(self, exc: anthropic.APIStatusError) -> LLMError:
        """An ``error`` event in place of the next event, after a 200 began the stream: the
        API's way of reporting a failure part way through the answer (``overloaded_error``,
        ``api_error``), which a new attempt may not meet."""
        kind = exc.type or "error"
        text = exc.api_message or _body_text(exc.body)
        detail = self._err.detail(f"error event in the stream: {kind}: {text}")
        if kind == "billing_error" or exc.error_code in _SPEND_LIMIT_CODES:
            return LLMBillingError(detail, **self._err.ids())
        if kind in ("rate_limit_error", "overloaded_error"):
            return LLMRateLimited(detail, status=None, **self._err.ids())
        return LLMServerError(detail, **self._err.ids())


def _tool_param(tool: ToolSchema) -> ToolParam:
    return {
        "name": tool.name,
        "description": tool.description,
        "input_schema": dict(tool.input_schema),
    }


def _tool_use(block: dict[str, object]) -> ToolUseBlock:
    call_id, name = str(block["id"]), str(block["name"])
    if "partial_json" in block:
        # Streamed: the input is the JSON text it arrived in (see anthropic_stream).
        return tool_use_json(call_id, name, str(block["partial_json"]))
    return tool_use(call_id, name, block["input"])


def _body_text(body: object) -> str:
    if isinstance(body, str):
        return body
    return "" if body is None else str(body)
