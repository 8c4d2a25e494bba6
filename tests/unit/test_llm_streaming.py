"""Streamed model calls through the real anthropic/openai SDKs against FakeLLMServer's SSE.

A streamed call must give the listener the answer's visible text as it arrives and return
exactly what the unstreamed call returns for the same answer; a stream that breaks must
raise the classified error ResilientLLM retries, and a retry after streamed text must tell
the listener that text is void.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import openai
import pytest

from geodebot.engine.llm.anthropic_adapter import AnthropicAdapter
from geodebot.engine.llm.errors import (
    LLMAuthError,
    LLMBillingError,
    LLMConnectionError,
    LLMContextOverflow,
    LLMError,
    LLMInvalidResponse,
    LLMRateLimited,
    LLMServerError,
    LLMTimeoutError,
    TransientLLMError,
)
from geodebot.engine.llm.openai_adapter import OpenAIAdapter
from geodebot.engine.llm.resilient import ResilientLLM
from geodebot.engine.llm.types import (
    LLMAdapter,
    LLMRequest,
    LLMResponse,
    Message,
    StreamEvent,
    StreamRestart,
    TextBlock,
    TextDelta,
    ToolSchema,
    ToolUseBlock,
    Usage,
)
from tests.support.fakes.llm_server import Call, Error, FakeLLMServer, Item, Raw, Reply

KEY = "sk-streamtest-0d9c8b7a6f5e4d3c2b1a0f9e8d7c6b5a"
PROVIDERS = ["anthropic", "openai"]
OTHER = {"anthropic": "openai", "openai": "anthropic"}
ANSWER = "The quick brown fox jumps over the lazy dog."
REQUEST = LLMRequest(system="You are terse.", messages=(Message.user_text("hi"),), max_tokens=256)
WEATHER = ToolSchema(
    name="get_weather",
    description="Current weather for a city.",
    input_schema={"type": "object", "properties": {"city": {"type": "string"}}},
)
TOOLS_REQUEST = LLMRequest(REQUEST.system, REQUEST.messages, (WEATHER,))

Make = Callable[..., LLMAdapter]


@pytest.fixture
async def srv() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
async def make(srv: FakeLLMServer) -> AsyncIterator[Make]:
    made: list[LLMAdapter] = []

    def factory(provider: str, **kwargs: Any) -> LLMAdapter:
        kwargs = {
            "model": "model-a",
            "timeout_s": 5.0,
            "api_key": KEY,
            "api_key_env": "K",
            **kwargs,
        }
        adapter: LLMAdapter
        if provider == "anthropic":
            adapter = AnthropicAdapter(base_url=srv.url, **kwargs)
        else:
            adapter = OpenAIAdapter(base_url=srv.openai_base_url, **kwargs)
        made.append(adapter)
        return adapter

    yield factory
    for adapter in made:
        await adapter.aclose()


def texts(events: list[StreamEvent]) -> list[str]:
    return [e.text for e in events if isinstance(e, TextDelta)]


async def both_ways(
    srv: FakeLLMServer, adapter: LLMAdapter, reply: Reply, request: LLMRequest = REQUEST
) -> tuple[LLMResponse, list[StreamEvent], LLMResponse]:
    """The same answer streamed (with what the listener saw), then unstreamed."""
    events: list[StreamEvent] = []
    srv.script(reply, reply)
    streamed = await adapter.complete(request, on_stream=events.append)
    plain = await adapter.complete(request)
    assert [r.streamed for r in srv.requests[-2:]] == [True, False]
    return streamed, events, plain


def same_answer(streamed: LLMResponse, plain: LLMResponse) -> None:
    assert streamed.message == plain.message
    assert streamed.stop_reason == plain.stop_reason
    assert streamed.usage == plain.usage
    assert (streamed.provider, streamed.model) == (plain.provider, plain.model)
    assert streamed.request_id is not None
    assert streamed.request_id.startswith("req_fake_")


async def no_sleep(seconds: float) -> None:
    await asyncio.sleep(0)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_streamed_text_arrives_in_deltas_and_returns_the_unstreamed_answer(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    streamed, events, plain = await both_ways(
        srv, make(provider), Reply(ANSWER, usage=(42, 7), chunks=4)
    )
    assert all(isinstance(e, TextDelta) for e in events)
    assert len(events) == 4
    assert "".join(texts(events)) == ANSWER
    same_answer(streamed, plain)
    assert streamed.message == Message.assistant_text(ANSWER)
    assert (streamed.stop_reason, streamed.usage) == ("end_turn", Usage(42, 7))
    body = srv.requests[0].json
    assert body["stream"] is True
    if provider == "openai":
        assert body["stream_options"] == {"include_usage": True}
    # Apart from asking for a stream, the request is the unstreamed one.
    plain_body = srv.requests[1].json
    assert {k: v for k, v in body.items() if k not in ("stream", "stream_options")} == plain_body


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    "reply",
    [
        Reply("cut", stop="max_tokens"),
        Reply("no", stop="refusal"),
        Reply(""),  # an empty answer streams no text and is still well-formed
    ],
)
async def test_streamed_stop_reasons_match_unstreamed(
    srv: FakeLLMServer, make: Make, provider: str, reply: Reply
) -> None:
    streamed, events, plain = await both_ways(srv, make(provider), reply)
    same_answer(streamed, plain)
    assert "".join(texts(events)) == reply.text


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_text_reaches_the_listener_while_the_answer_is_still_coming(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    # The server waits a minute between deltas: the first one can only be seen mid-answer.
    srv.script(Reply(ANSWER, chunks=3, chunk_delay_s=60))
    first = asyncio.Event()
    events: list[StreamEvent] = []

    def listener(event: StreamEvent) -> None:
        events.append(event)
        first.set()

    task = asyncio.create_task(make(provider, timeout_s=120).complete(REQUEST, on_stream=listener))
    async with asyncio.timeout(5):
        await first.wait()
    assert not task.done()
    [piece] = texts(events)
    assert ANSWER.startswith(piece)
    assert piece != ANSWER
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_streamed_tool_calls_after_text(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    reply = Reply(
        "Checking the weather.",
        tool_calls=[
            Call("get_weather", {"city": "Oslo"}, id="call_1"),
            Call("get_weather", {"city": "Nowhere", "days": [1, 2, 3]}, id="call_2"),
        ],
        usage=(30, 12),
        chunks=3,
    )
    streamed, events, plain = await both_ways(srv, make(provider), reply, TOOLS_REQUEST)
    same_answer(streamed, plain)
    # Only the text is visible; the arguments arrive in fragments too, but are not shown.
    assert "".join(texts(events)) == "Checking the weather."
    assert streamed.stop_reason == "tool_use"
    assert streamed.message.content == (
        TextBlock("Checking the weather."),
        ToolUseBlock("call_1", "get_weather", {"city": "Oslo"}),
        ToolUseBlock("call_2", "get_weather", {"city": "Nowhere", "days": [1, 2, 3]}),
    )


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_streamed_malformed_tool_json_gives_arguments_error(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    reply = Reply(
        tool_calls=[
            Call("get_weather", "{not json", id="c1"),
            Call("get_weather", "[1, 2]", id="c2"),
            Call("get_weather", '{"city": "Oslo"}', id="c3"),
            Call("get_weather", {"x": float("nan")}, id="c4"),  # JSON cannot carry it again
        ],
        chunks=2,
    )
    streamed, events, plain = await both_ways(srv, make(provider), reply, TOOLS_REQUEST)
    assert events == []
    assert streamed.stop_reason == "tool_use"
    bad_json, not_object, good, nan = streamed.message.tool_uses
    assert (bad_json.id, bad_json.name, bad_json.arguments) == ("c1", "get_weather", {})
    assert "not valid JSON" in (bad_json.arguments_error or "")
    assert not_object.arguments == {}
    assert "not an object" in (not_object.arguments_error or "")
    assert (good.arguments, good.arguments_error) == ({"city": "Oslo"}, None)
    assert nan.arguments == {}
    assert "NaN" in (nan.arguments_error or "")
    if provider == "openai":
        # Arguments are JSON text streamed or not: the very same blocks.
        same_answer(streamed, plain)
    else:
        # Unstreamed, the fake sends a str input as a JSON string (a str, not an object), so
        # only the NaN input is the same answer both ways.
        assert nan == plain.message.tool_uses[3]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("cut", LLMConnectionError),  # the connection closes mid-body
        ("end", LLMConnectionError),  # the body ends cleanly, without the terminal events
        (Error.server(), LLMServerError),  # an error event in place of the next delta
    ],
)
async def test_a_stream_that_breaks_raises_a_transient_error(
    srv: FakeLLMServer,
    make: Make,
    provider: str,
    how: Error | str,
    expected: type[TransientLLMError],
) -> None:
    srv.script(Reply(ANSWER, chunks=4, break_after=2, break_with=how))  # type: ignore[arg-type]
    events: list[StreamEvent] = []
    with pytest.raises(expected) as caught:
        await make(provider).complete(REQUEST, on_stream=events.append)
    assert caught.value.transient
    pieces = texts(events)
    assert len(pieces) == 2
    assert ANSWER.startswith("".join(pieces))


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_the_whole_text_without_the_closing_events_is_an_error(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    # Every delta arrived, then the body ended: still not an answer, as nothing said it ended.
    srv.script(Reply(ANSWER, chunks=2, break_after=2, break_with="end"))
    events: list[StreamEvent] = []
    with pytest.raises(LLMConnectionError, match="ended before"):
        await make(provider).complete(REQUEST, on_stream=events.append)
    assert "".join(texts(events)) == ANSWER


async def test_an_overloaded_error_event_is_rate_limited(srv: FakeLLMServer, make: Make) -> None:
    srv.script(Reply(ANSWER, break_after=1, break_with=Error.overloaded()))
    with pytest.raises(LLMRateLimited, match="overloaded_error"):
        await make("anthropic").complete(REQUEST, on_stream=lambda event: None)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_stream_that_stalls_times_out(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(Reply(ANSWER, chunks=3, chunk_delay_s=60))
    started = time.monotonic()
    with pytest.raises(LLMTimeoutError):
        await make(provider, timeout_s=0.5).complete(REQUEST, on_stream=lambda event: None)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    ("item", "expected"),
    [
        (Error.rate_limited(0), LLMRateLimited),
        (Error.unauthorized(), LLMAuthError),
        (Error.context_overflow(), LLMContextOverflow),
        (Error.billing(), LLMBillingError),
        (Error.server(), LLMServerError),
        (Raw(200, "<html>captive portal</html>", "text/html"), LLMInvalidResponse),
    ],
)
async def test_errors_before_the_stream_are_classified_as_unstreamed(
    srv: FakeLLMServer, make: Make, provider: str, item: Item, expected: type[LLMError]
) -> None:
    adapter = make(provider)
    srv.script(item, item)
    with pytest.raises(expected) as streamed:
        await adapter.complete(REQUEST, on_stream=lambda event: None)
    with pytest.raises(expected) as plain:
        await adapter.complete(REQUEST)
    assert (streamed.value.status, streamed.value.kind) == (plain.value.status, plain.value.kind)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_retry_after_streamed_text_restarts_the_stream(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(Reply(ANSWER, chunks=4, break_after=2), Reply(ANSWER, chunks=4, usage=(9, 4)))
    seen: list[object] = []
    llm = ResilientLLM(
        chain=[make(provider)],
        max_retries=1,
        on_event=lambda kind, data: seen.append(kind),
        sleep=no_sleep,
    )
    response = await llm.complete(REQUEST, on_stream=seen.append)
    first, second, retry, restart, *rest = seen
    assert isinstance(first, TextDelta)
    assert isinstance(second, TextDelta)
    assert ANSWER.startswith(first.text + second.text)
    assert retry == "llm_retry"
    assert isinstance(restart, StreamRestart)
    assert "LLMConnectionError" in restart.reason
    # The retry streams the whole answer again, from its start.
    assert rest[0] == first
    assert all(isinstance(e, TextDelta) for e in rest)
    assert len(rest) == 4
    assert "".join(e.text for e in rest if isinstance(e, TextDelta)) == ANSWER
    assert response.message == Message.assistant_text(ANSWER)
    assert response.usage == Usage(9, 4)
    assert [r.streamed for r in srv.requests] == [True, True]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_fallback_after_streamed_text_restarts_the_stream(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(Reply("Half an ans", chunks=2, break_after=1), Reply("Whole.", chunks=1))
    seen: list[object] = []
    chain = [make(provider), make(OTHER[provider], model="model-b")]
    llm = ResilientLLM(chain=chain, max_retries=0, on_event=lambda kind, data: seen.append(kind))
    response = await llm.complete(REQUEST, on_stream=seen.append)
    assert seen[:2] == [TextDelta("Half a"), "llm_fallback"]
    restart = seen[2]
    assert isinstance(restart, StreamRestart)
    assert f"falling back to {OTHER[provider]} model-b" in restart.reason
    assert seen[3:] == [TextDelta("Whole.")]
    assert (response.provider, response.model) == (OTHER[provider], "model-b")
    assert response.message.text == "Whole."


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_no_restart_when_the_failed_attempt_streamed_no_text(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(
        Error.server(),  # before the stream
        Reply(ANSWER, break_after=0),  # cut before the first delta
        Reply(ANSWER, break_after=2, break_with="end"),  # broke after text: the one restart
        Reply(ANSWER, chunks=1),
    )
    events: list[StreamEvent] = []
    llm = ResilientLLM(chain=[make(provider)], max_retries=3, sleep=no_sleep)
    response = await llm.complete(REQUEST, on_stream=events.append)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["TextDelta", "TextDelta", "StreamRestart", "TextDelta"]
    assert events[-1] == TextDelta(ANSWER)
    assert response.message.text == ANSWER


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_no_restart_when_no_attempt_follows(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(Reply(ANSWER, break_after=1), Reply(ANSWER, break_after=1))
    events: list[StreamEvent] = []
    llm = ResilientLLM(chain=[make(provider)], max_retries=1, sleep=no_sleep)
    with pytest.raises(LLMConnectionError):
        await llm.complete(REQUEST, on_stream=events.append)
    # The error itself says the text is void; a restart would promise an answer to come.
    assert [type(e).__name__ for e in events] == ["TextDelta", "StreamRestart", "TextDelta"]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_listener_that_raises_does_not_break_the_call(
    srv: FakeLLMServer, make: Make, provider: str, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[StreamEvent] = []

    def broken(event: StreamEvent) -> None:
        calls.append(event)
        raise RuntimeError("the chat preview is down")

    adapter = make(provider)
    srv.script(Reply(ANSWER, chunks=4))
    response = await adapter.complete(REQUEST, on_stream=broken)
    assert response.message == Message.assistant_text(ANSWER)
    assert len(calls) == 4
    calls.clear()

    srv.script(Reply(ANSWER, chunks=4, break_after=2), Reply(ANSWER, chunks=4))
    llm = ResilientLLM(chain=[adapter], max_retries=1, sleep=no_sleep)
    with caplog.at_level(logging.ERROR, logger="geodebot.engine.llm"):
        response = await llm.complete(REQUEST, on_stream=broken)
    assert response.message == Message.assistant_text(ANSWER)
    # Every event was still offered, the restart included, and the retry still happened.
    assert [type(e).__name__ for e in calls] == ["TextDelta"] * 2 + ["StreamRestart"] + [
        "TextDelta"
    ] * 4
    failures = [r for r in caplog.records if "stream listener failed" in r.getMessage()]
    assert failures  # logged, with the traceback, and not for every single delta
    assert len(failures) < len(calls)
    assert all(r.exc_info is not None for r in failures)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_unstreamed_calls_stay_unstreamed(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(Reply(ANSWER, chunks=4), Reply(ANSWER, chunks=4))
    llm = ResilientLLM(chain=[make(provider)])
    response = await llm.complete(REQUEST)
    assert response.message.text == ANSWER
    assert "stream" not in srv.requests[0].json
    assert not srv.requests[0].streamed
    await make(provider).complete(REQUEST)
    assert not srv.requests[1].streamed


async def test_anthropic_thinking_is_not_visible_text_and_usage_totals_replace(
    srv: FakeLLMServer, make: Make
) -> None:
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    usage = {"input_tokens": 3, "output_tokens": 1}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "model-a"}
    thinking = {"type": "thinking_delta", "thinking": "let me think"}
    stream = "".join(
        [
            event("message_start", message={**message, "content": [], "usage": usage}),
            event("ping"),
            event(
                "content_block_start", index=0, content_block={"type": "thinking", "thinking": ""}
            ),
            event("content_block_delta", index=0, delta=thinking),
            event(
                "content_block_delta", index=0, delta={"type": "signature_delta", "signature": "s"}
            ),
            event("content_block_stop", index=0),
            event("content_block_start", index=1, content_block={"type": "text", "text": ""}),
            event("content_block_delta", index=1, delta={"type": "text_delta", "text": "Hi"}),
            event("content_block_delta", index=1, delta={"type": "text_delta", "text": "!"}),
            event("content_block_stop", index=1),
            event(
                "message_delta",
                delta={"stop_reason": "end_turn", "stop_sequence": None},
                usage={"output_tokens": 20, "input_tokens": 40, "cache_read_input_tokens": 2},
            ),
            event("message_stop"),
        ]
    )
    srv.script(Raw(200, stream, "text/event-stream"))
    events: list[StreamEvent] = []
    response = await make("anthropic").complete(REQUEST, on_stream=events.append)
    assert events == [TextDelta("Hi"), TextDelta("!")]
    assert response.message == Message.assistant_text("Hi!")
    assert response.usage == Usage(42, 20, cache_read_tokens=2)


async def test_openai_reasoning_is_not_visible_text(srv: FakeLLMServer, make: Make) -> None:
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "model-a"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    # Compatible servers (vLLM, DeepSeek, Ollama) stream their reasoning beside the content.
    stream = "".join(
        [
            chunk({"role": "assistant", "reasoning_content": "hmm"}),
            chunk({"reasoning_content": " let me see"}),
            chunk({"content": "Hi!"}),
            chunk({}, "stop"),
            "data: [DONE]\n\n",
        ]
    )
    srv.script(Raw(200, stream, "text/event-stream"))
    events: list[StreamEvent] = []
    response = await make("openai").complete(REQUEST, on_stream=events.append)
    assert events == [TextDelta("Hi!")]
    assert response.message == Message.assistant_text("Hi!")
    assert response.usage == Usage()  # no usage chunk was sent; none is made up


# The fake guards every test above: its streams must be what the SDKs' own stream readers
# understand, and mean what its unstreamed bodies mean.


def blocks(block: Any) -> tuple[Any, ...]:
    """What an SDK content block says (its streamed twin adds fields of its own)."""
    if block.type == "text":
        return ("text", block.text)
    return (block.type, block.id, block.name, block.input)


def calls(call: Any) -> tuple[Any, ...]:
    return (call.id, call.function.name, call.function.arguments)


async def test_fake_anthropic_stream_is_what_the_sdk_accumulates(srv: FakeLLMServer) -> None:
    reply = Reply("Checking.", tool_calls=[Call("get_weather", {"city": "Oslo"}, id="t1")])
    srv.script(reply, reply)
    params: dict[str, Any] = {
        "model": "model-a",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with anthropic.AsyncAnthropic(api_key=KEY, base_url=srv.url, max_retries=0) as client:
        async with client.messages.stream(**params) as stream:
            deltas = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        plain = await client.messages.create(**params)
    assert "".join(deltas) == "Checking."
    assert len(deltas) == 3
    assert [blocks(b) for b in final.content] == [blocks(b) for b in plain.content]
    assert blocks(final.content[1]) == ("tool_use", "t1", "get_weather", {"city": "Oslo"})
    assert (final.stop_reason, final.usage) == (plain.stop_reason, plain.usage)


async def test_fake_openai_stream_is_what_the_sdk_accumulates(srv: FakeLLMServer) -> None:
    reply = Reply("Checking.", tool_calls=[Call("get_weather", {"city": "Oslo"}, id="t1")])
    srv.script(reply, reply)
    params: dict[str, Any] = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}
    base_url = srv.openai_base_url
    async with openai.AsyncOpenAI(api_key=KEY, base_url=base_url, max_retries=0) as client:
        options: dict[str, Any] = {"include_usage": True}
        async with client.chat.completions.stream(**params, stream_options=options) as stream:
            final = await stream.get_final_completion()
        plain = await client.chat.completions.create(**params)
    got, want = final.choices[0], plain.choices[0]
    assert got.message.content == want.message.content == "Checking."
    assert got.finish_reason == want.finish_reason == "tool_calls"
    assert [calls(c) for c in got.message.tool_calls or ()] == [
        calls(c) for c in want.message.tool_calls or ()
    ]
    assert calls((got.message.tool_calls or [])[0]) == ("t1", "get_weather", '{"city": "Oslo"}')
    assert final.usage == plain.usage
