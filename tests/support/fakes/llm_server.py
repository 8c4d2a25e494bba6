"""A scripted fake LLM provider speaking real HTTP, for tests that run the real SDKs.

One aiohttp server on 127.0.0.1 answers both dialects, unstreamed or streamed:

* Anthropic Messages API: ``POST /v1/messages``; base_url for the SDK is ``srv.url``.
* OpenAI Chat Completions: ``POST /v1/chat/completions``; base_url is ``srv.openai_base_url``.

Usage::

    async with FakeLLMServer() as srv:
        srv.script(
            Error.rate_limited(1.0),
            Reply(tool_calls=[Call("shell", {"cmd": "uptime"})]),
            Reply("done", usage=(120, 8)),
        )
        ...  # point a client at srv.url / srv.openai_base_url
        assert srv.requests[0].path == "/v1/messages"
        assert srv.requests[-1].json["model"] == "claude-x"

Behaviour:

* ``srv.script(*items)`` appends to ONE FIFO queue, consumed by whichever endpoint is called.
  When the queue is empty ``srv.default`` answers (it is not consumed); when that is None the
  server answers 500 saying the script is exhausted.
* ``srv.responder``, when set, is asked first with each request's JSON body and may answer
  any item (a model that reacts to what it is sent, for many concurrent sessions); when it
  returns None the queue and ``srv.default`` answer as above.
* Request bodies are parsed strictly, like the real APIs: one holding ``NaN`` or ``Infinity``
  is answered 400 as not JSON.
* Every request is recorded in ``srv.requests`` (path, lower-cased headers, parsed JSON body),
  including rejected ones. ``srv.pending`` counts unconsumed items.
* A request without credentials (``x-api-key`` or ``Authorization: Bearer`` for Anthropic; the
  latter for OpenAI) is answered 401 in the provider's error shape, without consuming the
  script. (The anthropic SDK 2.x sends ``Authorization: Bearer``, not ``x-api-key``.)
* Items: :class:`Reply` (text and/or :class:`Call` tool calls), :class:`Error` (rendered in the
  endpoint's real error JSON), :class:`Hang` (never answers; ends when the client disconnects
  or the server stops), :class:`Delay` (wait, then answer another item) and :class:`Raw`
  (any status and body, for invalid responses).
* Stop reasons use the Anthropic vocabulary (``end_turn``, ``tool_use``, ``max_tokens``,
  ``stop_sequence``, ``refusal``) and are translated to OpenAI's ``finish_reason``.
* A request whose body has ``"stream": true`` gets a :class:`Reply` as server-sent events in
  its dialect, shaped like the real APIs' (and the SDKs' stream readers): Anthropic's
  ``message_start``, ``ping``, ``content_block_start`` / ``_delta`` (``text_delta``,
  ``input_json_delta``) / ``_stop``, ``message_delta`` and ``message_stop``; OpenAI's
  ``chat.completion.chunk`` objects (content, then tool-call fragments by index, then the
  ``finish_reason``), the usage chunk when ``stream_options.include_usage`` is set, then
  ``data: [DONE]``. The Reply's ``chunks``, ``chunk_delay_s``, ``break_after`` and
  ``break_with`` shape the stream; every other item is answered as for an unstreamed
  request (an error before a stream begins is an ordinary HTTP error). ``srv.requests[i]
  .streamed`` tells which requests asked for a stream.

Self-contained (aiohttp and the standard library only) so any test can import it, including
tests that run ``geodebot`` as a subprocess against a server running in the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self, TypeAlias

from aiohttp import web

from tests.support.fakes.loopback import LoopbackServer
from tests.support.fakes.prompt_cache import PromptCache

Dialect: TypeAlias = Literal["anthropic", "openai"]

ANTHROPIC_PATH = "/v1/messages"
OPENAI_PATH = "/v1/chat/completions"

_NO_KEY_ANTHROPIC = "x-api-key header is required"
_NO_KEY_OPENAI = "You didn't provide an API key. Send it as Authorization: Bearer YOUR_KEY."
_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "refusal": "content_filter",
}


@dataclass(frozen=True)
class Call:
    """A tool call in a :class:`Reply`.

    ``arguments`` is normally a dict. On the OpenAI endpoint, and in an Anthropic stream
    (whose tool input arrives as JSON text), a ``str`` is sent verbatim as that JSON text, so
    tests can send malformed JSON; an unstreamed Anthropic answer sends it as a JSON string.
    """

    name: str
    arguments: Any
    id: str | None = None


@dataclass(frozen=True)
class Reply:
    """An answer. The last four fields matter only to a streamed request.

    ``chunks``: the text, and each call's argument JSON, go in this many deltas (fewer when
    shorter). ``chunk_delay_s``: the pause between deltas. ``break_after``: the stream stops
    after this many deltas (text and argument fragments alike, in order), in place of the next
    delta or, when there is none, of the closing events (Anthropic's ``message_delta``,
    OpenAI's ``finish_reason`` chunk); it stops by ``break_with``: ``"cut"`` closes the
    connection mid-body (the SDK sees an incomplete stream), ``"end"`` ends the body cleanly
    but without the closing events, an :class:`Error` is sent as the dialect's in-stream
    error event.
    """

    text: str = ""
    tool_calls: Sequence[Call] = ()
    # Anthropic vocabulary; derived (tool_use if there are calls, else end_turn) when None.
    stop: str | None = None
    usage: tuple[int, int] = (10, 5)  # (input tokens, output tokens)
    chunks: int = 3
    chunk_delay_s: float = 0.0
    break_after: int | None = None
    break_with: Error | Literal["cut", "end"] = "cut"


@dataclass(frozen=True)
class Error:
    """An error response. ``kind`` is the error ``type`` field, ``code`` OpenAI's ``code``
    (on the Anthropic endpoint it becomes ``error.details.error_code``). ``openai``, when set,
    is how the same failure looks on the OpenAI endpoint, since the providers differ."""

    status: int
    kind: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)
    code: str | None = None
    openai: Error | None = None

    @classmethod
    def rate_limited(cls, retry_after: float) -> Error:
        hdr = {"retry-after": f"{retry_after:g}"}
        oai = cls(429, "requests", "Rate limit reached for requests.", hdr, "rate_limit_exceeded")
        return cls(
            429, "rate_limit_error", "Number of requests exceeds your rate limit.", hdr, openai=oai
        )

    @classmethod
    def server(cls) -> Error:
        oai = cls(500, "server_error", "The server had an error processing your request.")
        return cls(500, "api_error", "Internal server error", openai=oai)

    @classmethod
    def overloaded(cls) -> Error:
        oai = cls(503, "server_error", "The engine is currently overloaded, try again later.")
        return cls(529, "overloaded_error", "Overloaded", openai=oai)

    @classmethod
    def unauthorized(cls) -> Error:
        oai = cls(
            401, "invalid_request_error", "Incorrect API key provided.", code="invalid_api_key"
        )
        return cls(401, "authentication_error", "invalid x-api-key", openai=oai)

    @classmethod
    def context_overflow(cls) -> Error:
        oai_text = "This model's maximum context length is 128000 tokens. However, your messages "
        oai_text += "resulted in 250000 tokens. Please reduce the length of the messages."
        oai = cls(400, "invalid_request_error", oai_text, code="context_length_exceeded")
        text = "prompt is too long: 250000 tokens > 200000 maximum"
        return cls(400, "invalid_request_error", text, openai=oai)

    @classmethod
    def billing(cls) -> Error:
        oai_text = "You exceeded your current quota, please check your plan and billing details."
        oai = cls(429, "insufficient_quota", oai_text, code="insufficient_quota")
        text = "Your credit balance is too low to access the Anthropic API."
        return cls(400, "invalid_request_error", text, openai=oai)


@dataclass(frozen=True)
class Hang:
    """Never answers: holds the request until the client disconnects or the server stops."""


@dataclass(frozen=True)
class Delay:
    seconds: float
    then: Item


@dataclass(frozen=True)
class Raw:
    status: int
    body: str
    content_type: str = "application/json"


Item: TypeAlias = Reply | Error | Hang | Delay | Raw


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    headers: dict[str, str]  # lower-cased names
    json: Any  # None when the body was not JSON
    raw: bytes = b""
    # time.monotonic() when it arrived: the time between two requests is how long the
    # client spent between them (a tool call, say), whatever its process cost to start.
    at: float = field(default_factory=time.monotonic)

    @property
    def streamed(self) -> bool:
        """Whether the request asked for a streamed answer."""
        return isinstance(self.json, dict) and self.json.get("stream") is True


class FakeLLMServer(LoopbackServer):
    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, record: bool = True) -> None:
        super().__init__(host=host, port=port)
        self.default: Item | None = None
        self.responder: Callable[[dict[str, Any]], Item | None] | None = None
        # Model ids GET /v1/models/{id} knows; None: every id.
        self.models: set[str] | None = None
        self.requests: list[RecordedRequest] = []
        # False: requests are counted but not kept (a long benchmark would hold every body).
        self.record = record
        self.request_count = 0
        # Set: usage reports the input as a provider's prompt cache would bill it (see
        # prompt_cache.py); None: a Reply's usage as scripted, nothing cached.
        self.prompt_cache: PromptCache | None = None
        self._queue: deque[Item] = deque()
        self._ids = itertools.count(1)
        self._arrived = asyncio.Condition()

    def script(self, *items: Item) -> Self:
        self._queue.extend(items)
        return self

    @property
    def pending(self) -> int:
        """Scripted items not consumed yet."""
        return len(self._queue)

    async def wait_for_requests(self, count: int) -> None:
        """Wait until ``count`` requests have arrived (e.g. before cancelling a hung call).

        Has no timeout of its own: wrap it in ``asyncio.timeout``."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: self.request_count >= count)

    async def _model_info(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if self.models is not None and model not in self.models:
            error = {"type": "not_found_error", "message": f"model: {model}"}
            return web.json_response({"type": "error", "error": error}, status=404)
        return web.json_response(
            {
                "id": model,
                "type": "model",
                "object": "model",
                "display_name": f"Fake {model}",
                "created_at": "2025-01-01T00:00:00Z",
                "created": 1735689600,
                "owned_by": "fake",
            }
        )

    @property
    def url(self) -> str:
        return self.root

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    def _application(self) -> web.Application:
        app = web.Application()
        app.router.add_post(ANTHROPIC_PATH, self._anthropic)
        app.router.add_post(OPENAI_PATH, self._openai)
        # Both SDKs retrieve a model at GET /v1/models/{id}; one body satisfies both.
        app.router.add_get("/v1/models/{model}", self._model_info)
        return app

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "anthropic")

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "openai")

    async def _handle(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        raw = await request.read()
        try:
            # Strict like the real APIs: NaN and Infinity are not JSON.
            body = json.loads(raw, parse_constant=_not_json) if raw else None
        except ValueError:
            body = None
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.request_count += 1
        if self.record:
            self.requests.append(RecordedRequest(request.path, headers, body, raw))
        async with self._arrived:
            self._arrived.notify_all()
        if not _has_credentials(request, dialect):
            return self._missing_key(dialect)
        if not isinstance(body, dict):
            return self._error(dialect, Error(400, "invalid_request_error", "body is not JSON"))
        item = self.responder(body) if self.responder is not None else None
        if item is None:
            item = self._queue.popleft() if self._queue else self.default
        if item is None:
            exhausted = Error(500, "api_error", "FakeLLMServer: script exhausted, no default set")
            return self._error(dialect, exhausted)
        return await self._render(request, dialect, body, item)

    async def _render(
        self, request: web.Request, dialect: Dialect, body: dict[str, Any], item: Item
    ) -> web.StreamResponse:
        while isinstance(item, Delay):
            if await self._wait_stopping(item.seconds):
                return self._stopped(dialect)
            item = item.then
        if isinstance(item, Hang):
            while not self._stopping.is_set():
                transport = request.transport
                if transport is None or transport.is_closing():
                    break
                await self._wait_stopping(0.05)
            return self._stopped(dialect)
        if isinstance(item, Raw):
            headers = {"Content-Type": item.content_type}
            return web.Response(status=item.status, body=item.body.encode(), headers=headers)
        if isinstance(item, Error):
            return self._error(dialect, item)
        model = str(body.get("model", "fake-model"))
        if body.get("stream") is True:
            return await self._stream(request, dialect, body, item)
        if dialect == "anthropic":
            return self._anthropic_reply(item, model, self._anthropic_usage(body, item))
        return self._openai_reply(item, model, self._openai_usage(body, item))

    def _anthropic_usage(self, body: dict[str, Any], reply: Reply) -> dict[str, int]:
        if self.prompt_cache is None:
            plain, written, read = reply.usage[0], 0, 0
        else:
            plain, written, read = self.prompt_cache.anthropic(body)
        return {
            "input_tokens": plain,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read,
        }

    def _openai_usage(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        prompt, completion = reply.usage
        usage: dict[str, Any] = {"prompt_tokens": prompt}
        if self.prompt_cache is not None:
            prompt, cached = self.prompt_cache.openai(body)
            usage = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
        return {**usage, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _stream(
        self, request: web.Request, dialect: Dialect, body: dict[str, Any], reply: Reply
    ) -> web.StreamResponse:
        n = next(self._ids)
        model = str(body.get("model", "fake-model"))
        if dialect == "anthropic":
            events = _anthropic_events(reply, model, n, self._anthropic_usage(body, reply))
            headers = {"request-id": f"req_fake_{n}"}
        else:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            counted = self._openai_usage(body, reply) if usage else None
            events = _openai_events(reply, model, n, counted)
            headers = {"x-request-id": f"req_fake_{n}"}
        headers |= {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        # The client may go away mid-stream (a cancelled call): nothing is left to answer.
        with contextlib.suppress(ConnectionResetError):
            await self._write_events(request, response, dialect, reply, events)
        return response

    async def _write_events(
        self,
        request: web.Request,
        response: web.StreamResponse,
        dialect: Dialect,
        reply: Reply,
        events: Iterator[_Event],
    ) -> None:
        deltas = 0
        for frame, kind in events:
            if kind is not None and deltas == reply.break_after:
                await self._break(request, response, dialect, reply.break_with)
                return
            if kind == "delta":
                pause = reply.chunk_delay_s if deltas else 0.0
                if pause > 0 and await self._wait_stopping(pause):
                    await self._break(request, response, dialect, "cut")
                    return
                deltas += 1
            await response.write(frame)
        await response.write_eof()

    async def _break(
        self,
        request: web.Request,
        response: web.StreamResponse,
        dialect: Dialect,
        how: Error | Literal["cut", "end"],
    ) -> None:
        if how == "cut":
            # close(), not abort(): what was written still arrives, then the connection ends
            # without the chunked body's last chunk, which every HTTP client reports.
            if request.transport is not None:
                request.transport.close()
            return
        if isinstance(how, Error):
            await response.write(_error_event(dialect, how))
        await response.write_eof()

    def _anthropic_reply(self, reply: Reply, model: str, usage: dict[str, int]) -> web.Response:
        n = next(self._ids)
        content: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text else []
        content += [
            {
                "type": "tool_use",
                "id": c.id or f"toolu_fake_{n}_{i}",
                "name": c.name,
                "input": c.arguments,
            }
            for i, c in enumerate(reply.tool_calls)
        ]
        payload = {
            "id": f"msg_fake_{n}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": reply.stop or ("tool_use" if reply.tool_calls else "end_turn"),
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": reply.usage[1]},
        }
        return web.json_response(payload, headers={"request-id": f"req_fake_{n}"})

    def _openai_reply(self, reply: Reply, model: str, usage: dict[str, Any]) -> web.Response:
        n = next(self._ids)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.text or None,
            "refusal": None,
        }
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.id or f"call_fake_{n}_{i}", "type": "function", "function": _function(c)}
                for i, c in enumerate(reply.tool_calls)
            ]
        stop = reply.stop or ("tool_use" if reply.tool_calls else "end_turn")
        choice = {"index": 0, "message": message, "finish_reason": _FINISH_REASONS.get(stop, stop)}
        payload = {
            "id": f"chatcmpl-fake{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{**choice, "logprobs": None}],
            "usage": usage,
        }
        return web.json_response(payload, headers={"x-request-id": f"req_fake_{n}"})

    def _error(self, dialect: Dialect, error: Error) -> web.Response:
        n = next(self._ids)
        if dialect == "anthropic":
            inner: dict[str, Any] = {"type": error.kind, "message": error.message}
            if error.code is not None:
                inner["details"] = {"error_code": error.code}
            payload = {"type": "error", "error": inner, "request_id": f"req_fake_{n}"}
            headers = {**error.headers, "request-id": f"req_fake_{n}"}
            return web.json_response(payload, status=error.status, headers=headers)
        oai = error.openai or error
        inner = {"message": oai.message, "type": oai.kind, "param": None, "code": oai.code}
        headers = {**oai.headers, "x-request-id": f"req_fake_{n}"}
        # OpenAI has no 529; its overload answer is a 503.
        status = 503 if oai.status == 529 else oai.status
        return web.json_response({"error": inner}, status=status, headers=headers)

    def _missing_key(self, dialect: Dialect) -> web.Response:
        if dialect == "anthropic":
            return self._error(dialect, Error(401, "authentication_error", _NO_KEY_ANTHROPIC))
        return self._error(dialect, Error(401, "invalid_request_error", _NO_KEY_OPENAI))

    def _stopped(self, dialect: Dialect) -> web.Response:
        return self._error(dialect, Error(503, "api_error", "FakeLLMServer is stopping"))

    async def _wait_stopping(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if the server began stopping meanwhile."""
        try:
            await asyncio.wait_for(self._stopping.wait(), max(seconds, 0.0))
        except TimeoutError:
            return False
        return True


# One server-sent event as written, and where break_after may stop the stream: before a
# delta (which it counts) or before the closing events.
_Where: TypeAlias = Literal["delta", "closing"] | None
_Event: TypeAlias = tuple[bytes, _Where]


def _sse(data: Any, event: str | None = None) -> bytes:
    line = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
    return (f"event: {event}\n{line}" if event else line).encode()


def _pieces(text: str, count: int) -> list[str]:
    """``text`` in at most ``count`` consecutive non-empty pieces."""
    size = max(1, -(-len(text) // max(count, 1)))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _arguments_json(call: Call) -> str:
    return call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)


def _anthropic_events(
    reply: Reply, model: str, n: int, counted: dict[str, int]
) -> Iterator[_Event]:
    def event(kind: str, where: _Where = None, **fields: Any) -> _Event:
        return _sse({"type": kind, **fields}, kind), where

    stop = reply.stop or ("tool_use" if reply.tool_calls else "end_turn")
    usage = {**counted, "output_tokens": 1}
    message = {"id": f"msg_fake_{n}", "type": "message", "role": "assistant", "model": model}
    message |= {"content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield event("message_start", message=message)
    yield event("ping")
    blocks: list[tuple[dict[str, Any], list[dict[str, str]]]] = []
    if reply.text:
        pieces = _pieces(reply.text, reply.chunks)
        deltas = [{"type": "text_delta", "text": piece} for piece in pieces]
        blocks.append(({"type": "text", "text": ""}, deltas))
    for i, call in enumerate(reply.tool_calls):
        start = {"type": "tool_use", "id": call.id or f"toolu_fake_{n}_{i}", "name": call.name}
        pieces = _pieces(_arguments_json(call), reply.chunks)
        deltas = [{"type": "input_json_delta", "partial_json": piece} for piece in pieces]
        blocks.append(({**start, "input": {}}, deltas))
    for index, (block, deltas) in enumerate(blocks):
        yield event("content_block_start", index=index, content_block=block)
        for delta in deltas:
            yield event("content_block_delta", "delta", index=index, delta=delta)
        yield event("content_block_stop", index=index)
    # The counts are running totals: output_tokens replaces message_start's.
    delta = {"stop_reason": stop, "stop_sequence": None}
    yield event("message_delta", "closing", delta=delta, usage={"output_tokens": reply.usage[1]})
    yield event("message_stop")


def _openai_events(
    reply: Reply, model: str, n: int, usage: dict[str, Any] | None
) -> Iterator[_Event]:
    include_usage = usage is not None
    head = {"id": f"chatcmpl-fake{n}", "object": "chat.completion.chunk"}
    head |= {"created": int(time.time()), "model": model, "system_fingerprint": None}
    if include_usage:
        head["usage"] = None  # on every chunk but the last, as the API does

    def chunk(delta: dict[str, Any], where: _Where = None, finish: str | None = None) -> _Event:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [choice]}), where

    yield chunk({"role": "assistant", "content": "", "refusal": None})
    for piece in _pieces(reply.text, reply.chunks):
        yield chunk({"content": piece}, "delta")
    for i, call in enumerate(reply.tool_calls):
        function = {"name": call.name, "arguments": ""}
        first = {"index": i, "id": call.id or f"call_fake_{n}_{i}", "type": "function"}
        yield chunk({"tool_calls": [{**first, "function": function}]})
        for piece in _pieces(_arguments_json(call), reply.chunks):
            fragment = {"index": i, "function": {"arguments": piece}}
            yield chunk({"tool_calls": [fragment]}, "delta")
    stop = reply.stop or ("tool_use" if reply.tool_calls else "end_turn")
    yield chunk({}, "closing", _FINISH_REASONS.get(stop, stop))
    if usage is not None:
        yield _sse({**head, "choices": [], "usage": usage}), None
    yield _sse("[DONE]"), None


def _error_event(dialect: Dialect, error: Error) -> bytes:
    """An error sent in place of the next event, after a 200 began the stream."""
    if dialect == "anthropic":
        inner: dict[str, Any] = {"type": error.kind, "message": error.message}
        return _sse({"type": "error", "error": inner}, "error")
    oai = error.openai or error
    return _sse(
        {"error": {"message": oai.message, "type": oai.kind, "param": None, "code": oai.code}}
    )


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _function(call: Call) -> dict[str, str]:
    raw = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
    return {"name": call.name, "arguments": raw}


def _has_credentials(request: web.Request, dialect: Dialect) -> bool:
    auth = request.headers.get("Authorization", "")
    bearer = auth.lower().startswith("bearer ") and bool(auth[7:].strip())
    if dialect == "anthropic":
        return bearer or bool(request.headers.get("x-api-key", "").strip())
    return bearer


def user_texts(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """For a responder: every text of the newest user message that has text (Anthropic
    shape; with files, a caption and notes about files), and how many tool rounds followed
    it; ([], rounds) when there is none."""
    rounds = 0
    for message in reversed(body.get("messages") or []):
        content = message["content"]
        if isinstance(content, str):
            return [content], rounds
        texts = [b["text"] for b in content if b.get("type") == "text"]
        if message["role"] == "user" and texts:
            return texts, rounds
        if message["role"] == "user":
            rounds += 1
    return [], rounds


def last_prompt(body: Mapping[str, Any]) -> tuple[str, int]:
    """For a responder: the newest user text of a request (Anthropic shape), and how many tool
    rounds followed it; ("", rounds) when there is none."""
    texts, rounds = user_texts(body)
    return (texts[-1] if texts else ""), rounds


@contextlib.contextmanager
def held_once(llm: FakeLLMServer, prompt: str, then: Item) -> Iterator[list[dict[str, Any]]]:
    """While inside: a request whose newest user message holds ``prompt`` is held forever the
    first time (a daemon killed meanwhile never gets its answer) and answered ``then`` after;
    each such request's body is in the list yielded. Other requests go to the responder
    there was before, which is there again after."""
    before = llm.responder
    seen: list[dict[str, Any]] = []

    def respond(body: dict[str, Any]) -> Item | None:
        if any(prompt in text for text in user_texts(body)[0]):
            seen.append(body)
            return Hang() if len(seen) == 1 else then
        return before(body) if before is not None else None

    llm.responder = respond
    try:
        yield seen
    finally:
        llm.responder = before
