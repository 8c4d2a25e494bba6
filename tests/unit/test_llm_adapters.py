"""The adapters and ResilientLLM through the real anthropic/openai SDKs against FakeLLMServer.

Nothing is mocked: every test sends real HTTP through the SDK, so request shapes, response
parsing and the SDKs' exception classes are exercised as in production.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest

from geodebot.engine.llm.anthropic_adapter import AnthropicAdapter
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
from geodebot.engine.llm.openai_adapter import OpenAIAdapter
from geodebot.engine.llm.resilient import ResilientLLM
from geodebot.engine.llm.types import (
    LLMAdapter,
    LLMRequest,
    Message,
    ToolResultBlock,
    ToolSchema,
    ToolUseBlock,
    Usage,
)
from tests.support.fakes.llm_server import Call, Error, FakeLLMServer, Hang, Item, Raw, Reply

EPHEMERAL = {"type": "ephemeral"}
KEY = "sk-adaptertest-5b0c9e1d7f3a4b2c8d6e0f1a2b3c4d5e"
KEY_ENV = "GEODEBOT_ADAPTER_TEST_KEY"
PROVIDERS = ["anthropic", "openai"]
OTHER = {"anthropic": "openai", "openai": "anthropic"}
REQUEST = LLMRequest(system="You are terse.", messages=(Message.user_text("hi"),), max_tokens=256)
WEATHER = ToolSchema(
    name="get_weather",
    description="Current weather for a city.",
    input_schema={"type": "object", "properties": {"city": {"type": "string"}}},
)

Make = Callable[..., LLMAdapter]
Events = list[tuple[str, dict[str, Any]]]


@pytest.fixture
async def srv() -> AsyncIterator[FakeLLMServer]:
    async with FakeLLMServer() as server:
        yield server


@pytest.fixture
async def make(srv: FakeLLMServer) -> AsyncIterator[Make]:
    made: list[LLMAdapter] = []

    def factory(provider: str, *, api_key: str | None = KEY, **kwargs: Any) -> LLMAdapter:
        kwargs = {"model": "model-a", "timeout_s": 5.0, **kwargs}
        adapter: LLMAdapter
        if provider == "anthropic":
            kwargs.setdefault("base_url", srv.url)
            adapter = AnthropicAdapter(api_key=api_key, api_key_env=KEY_ENV, **kwargs)
        else:
            kwargs.setdefault("base_url", srv.openai_base_url)
            adapter = OpenAIAdapter(api_key=api_key, api_key_env=KEY_ENV, **kwargs)
        made.append(adapter)
        return adapter

    yield factory
    for adapter in made:
        await adapter.aclose()


def resilient(chain: list[LLMAdapter], events: Events, **kwargs: Any) -> ResilientLLM:
    return ResilientLLM(
        chain=chain, on_event=lambda kind, data: events.append((kind, data)), **kwargs
    )


def use(call_id: str, city: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": city}}


def result(call_id: str, content: str, is_error: bool = False) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": content, "is_error": is_error}


async def no_sleep(seconds: float) -> None:
    await asyncio.sleep(0)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_plain_text_answer(srv: FakeLLMServer, make: Make, provider: str) -> None:
    srv.script(Reply("Hello there.", usage=(42, 7)))
    request = LLMRequest(REQUEST.system, REQUEST.messages, max_tokens=256, temperature=0.2)
    response = await make(provider, model="exact-model-id-2026").complete(request)
    assert response.message == Message.assistant_text("Hello there.")
    assert response.stop_reason == "end_turn"
    assert response.usage == Usage(42, 7)
    assert (response.provider, response.model) == (provider, "exact-model-id-2026")
    assert response.request_id is not None
    assert response.request_id.startswith("req_fake_")
    [sent] = srv.requests
    body = sent.json
    assert body["model"] == "exact-model-id-2026"
    assert "tools" not in body
    if provider == "anthropic":
        assert sent.path == "/v1/messages"
        assert KEY in (sent.headers.get("x-api-key", ""), sent.headers.get("authorization", "")[7:])
        # Prompt-cache breakpoints (prompt_cache is on by default) on the system prompt and
        # the newest turn; test_prompt_cache.py checks where they go in longer requests.
        assert body["system"] == [
            {"type": "text", "text": "You are terse.", "cache_control": EPHEMERAL}
        ]
        hi = {"type": "text", "text": "hi", "cache_control": EPHEMERAL}
        assert body["messages"] == [{"role": "user", "content": [hi]}]
        assert body["max_tokens"] == 256
        assert "temperature" not in body  # API 2026-10-21 rejects sampling parameters
    else:
        assert sent.path == "/v1/chat/completions"
        assert sent.headers["authorization"] == f"Bearer {KEY}"
        assert body["messages"] == [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hi"},
        ]
        assert body["max_completion_tokens"] == 256
        assert body["temperature"] == 0.2


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_tool_call_round_trip(srv: FakeLLMServer, make: Make, provider: str) -> None:
    srv.script(
        Reply(
            "Checking.",
            tool_calls=[
                Call("get_weather", {"city": "Oslo"}, id="call_1"),
                Call("get_weather", {"city": "Nowhere"}, id="call_2"),
            ],
        ),
        Reply("Sunny in Oslo."),
    )
    adapter = make(provider)
    first = await adapter.complete(LLMRequest(REQUEST.system, REQUEST.messages, (WEATHER,)))
    assert first.stop_reason == "tool_use"
    assert first.message.text == "Checking."
    assert first.message.tool_uses == (
        ToolUseBlock("call_1", "get_weather", {"city": "Oslo"}),
        ToolUseBlock("call_2", "get_weather", {"city": "Nowhere"}),
    )
    results = Message(
        "user",
        (
            ToolResultBlock("call_1", "sunny, 21 C"),
            ToolResultBlock("call_2", "unknown city", is_error=True),
        ),
    )
    history = (*REQUEST.messages, first.message, results)
    second = await adapter.complete(LLMRequest(REQUEST.system, history, (WEATHER,)))
    assert second.message.text == "Sunny in Oslo."

    tools = srv.requests[0].json["tools"]
    sent = srv.requests[1].json["messages"]
    description, schema = WEATHER.description, dict(WEATHER.input_schema)
    if provider == "anthropic":
        assert tools == [
            {
                "name": "get_weather",
                "description": description,
                "input_schema": schema,
                "cache_control": EPHEMERAL,
            }
        ]
        assert sent[1] == {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                use("call_1", "Oslo"),
                use("call_2", "Nowhere"),
            ],
        }
        assert sent[2] == {
            "role": "user",
            "content": [
                result("call_1", "sunny, 21 C"),
                {**result("call_2", "unknown city", True), "cache_control": EPHEMERAL},
            ],
        }
    else:
        function = {"name": "get_weather", "description": description, "parameters": schema}
        assert tools == [{"type": "function", "function": function}]
        assert sent[2]["content"] == "Checking."
        calls = sent[2]["tool_calls"]
        assert [(c["id"], c["type"], c["function"]["name"]) for c in calls] == [
            ("call_1", "function", "get_weather"),
            ("call_2", "function", "get_weather"),
        ]
        assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Nowhere"}
        assert sent[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
        assert sent[4]["tool_call_id"] == "call_2"
        assert sent[4]["content"].startswith("ERROR: ")
        assert "unknown city" in sent[4]["content"]


async def test_anthropic_merges_same_role_turns_with_tool_results_first(
    srv: FakeLLMServer, make: Make
) -> None:
    srv.script(Reply("ok"))
    history = (
        Message.user_text("first"),
        Message.user_text("second"),
        Message("assistant", (ToolUseBlock("t1", "get_weather", {"city": "Oslo"}),)),
        Message.user_text("   "),
        Message("user", (ToolResultBlock("t1", "sunny"),)),
    )
    await make("anthropic").complete(LLMRequest("", history))
    body = srv.requests[0].json
    assert "system" not in body
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert [b["text"] for b in body["messages"][0]["content"]] == ["first", "second"]
    assert body["messages"][2]["content"] == [{**result("t1", "sunny"), "cache_control": EPHEMERAL}]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (Reply("cut", stop="max_tokens"), "max_tokens"),
        (Reply("done", stop="stop_sequence"), "end_turn"),
        (Reply("no", stop="refusal"), "refusal"),
        (Reply(""), "end_turn"),  # empty is well-formed: the loop's verifier asks again
    ],
)
async def test_stop_reasons_and_empty_answers(
    srv: FakeLLMServer, make: Make, provider: str, reply: Reply, expected: str
) -> None:
    srv.script(reply)
    response = await make(provider).complete(REQUEST)
    assert response.stop_reason == expected
    assert response.message.text == reply.text


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_rate_limit_waits_for_retry_after(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(Error.rate_limited(1.0), Reply("after the wait"))
    events: Events = []
    llm = resilient([make(provider)], events, max_retries=2)
    started = time.monotonic()
    response = await llm.complete(REQUEST)
    elapsed = time.monotonic() - started
    assert response.message.text == "after the wait"
    assert elapsed >= 0.9
    assert elapsed < 3.0
    assert len(srv.requests) == 2
    [(kind, data)] = events
    assert kind == "llm_retry"
    assert data["error"] == "LLMRateLimited"
    assert data["wait_s"] == 1.0
    assert (data["provider"], data["model"], data["attempt"]) == (provider, "model-a", 1)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_retry_after_is_capped(srv: FakeLLMServer, make: Make, provider: str) -> None:
    srv.script(Error.rate_limited(60), Reply("soon enough"))
    events: Events = []
    llm = resilient([make(provider)], events, max_retry_wait_s=0.2, base_backoff_s=0.01)
    started = time.monotonic()
    assert (await llm.complete(REQUEST)).message.text == "soon enough"
    assert time.monotonic() - started < 2.0
    assert events[0][1]["wait_s"] == 0.2


def in_5_s() -> str:
    return format_datetime(datetime.now(UTC) + timedelta(seconds=5), usegmt=True)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (lambda: {"retry-after-ms": "250", "retry-after": "9"}, (0.25, 0.25)),
        (lambda: {"retry-after": "1.5"}, (1.5, 1.5)),
        (lambda: {"retry-after": in_5_s()}, (3.0, 5.0)),
        (lambda: {"retry-after": "in a bit"}, None),
    ],
)
async def test_retry_after_header_forms(
    srv: FakeLLMServer,
    make: Make,
    provider: str,
    headers: Callable[[], dict[str, str]],
    expected: tuple[float, float] | None,
) -> None:
    srv.script(Error(429, "rate_limit_error", "slow down", headers()))
    with pytest.raises(LLMRateLimited) as caught:
        await make(provider).complete(REQUEST)
    got = caught.value.retry_after
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert expected[0] <= got <= expected[1]


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_server_error_is_retried_with_backoff(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(Error.server(), Reply("recovered"))
    sleeps: list[float] = []

    async def record_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    events: Events = []
    llm = resilient([make(provider)], events, base_backoff_s=0.5, sleep=record_sleep)
    assert (await llm.complete(REQUEST)).message.text == "recovered"
    assert len(srv.requests) == 2
    [wait] = sleeps
    assert 0.375 <= wait <= 0.625
    assert events[0][1]["error"] == "LLMServerError"


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_exhausted_primary_falls_back(srv: FakeLLMServer, make: Make, provider: str) -> None:
    srv.script(Error.server(), Error.overloaded(), Reply("from the fallback"))
    primary = make(provider, model="primary-model-x")
    fallback = make(OTHER[provider], model="fallback-model-y@2026-01")
    events: Events = []
    llm = resilient([primary, fallback], events, max_retries=1, sleep=no_sleep)
    assert (llm.provider, llm.model) == (provider, "primary-model-x")
    response = await llm.complete(REQUEST)
    assert response.message.text == "from the fallback"
    assert (response.provider, response.model) == (OTHER[provider], "fallback-model-y@2026-01")
    assert [r.json["model"] for r in srv.requests] == [
        "primary-model-x",
        "primary-model-x",
        "fallback-model-y@2026-01",
    ]
    assert [kind for kind, _ in events] == ["llm_retry", "llm_fallback"]
    fell = events[1][1]
    assert fell["from"] == {"provider": provider, "model": "primary-model-x"}
    assert fell["to"] == {"provider": OTHER[provider], "model": "fallback-model-y@2026-01"}
    assert fell["error"] == "LLMRateLimited"


async def test_all_adapters_exhausted_raises_last_transient(srv: FakeLLMServer, make: Make) -> None:
    srv.script(Error.server(), Error.overloaded())
    llm = resilient([make("anthropic"), make("openai")], [], max_retries=0, sleep=no_sleep)
    with pytest.raises(LLMRateLimited) as caught:
        await llm.complete(REQUEST)
    assert caught.value.provider == "openai"
    assert caught.value.status == 503


@pytest.mark.parametrize(
    ("provider", "item", "expected"),
    [
        *[(p, Error.unauthorized(), LLMAuthError) for p in PROVIDERS],
        *[(p, Error.context_overflow(), LLMContextOverflow) for p in PROVIDERS],
        # On OpenAI this is a 429 insufficient_quota: terminal, not a rate limit.
        *[(p, Error.billing(), LLMBillingError) for p in PROVIDERS],
        ("anthropic", Error(402, "billing_error", "Payment required"), LLMBillingError),
        ("openai", Error(402, "payment_required", "Insufficient credits"), LLMBillingError),
        (
            "anthropic",
            Error(429, "rate_limit_error", "Spend cap hit", code="enforced_spend_limit_reached"),
            LLMBillingError,
        ),
    ],
)
async def test_terminal_errors_neither_retry_nor_fall_back(
    srv: FakeLLMServer, make: Make, provider: str, item: Error, expected: type[LLMError]
) -> None:
    srv.script(item, Reply("must not be used"))
    events: Events = []
    llm = resilient([make(provider), make(OTHER[provider])], events, sleep=no_sleep)
    with pytest.raises(LLMError) as caught:
        await llm.complete(REQUEST)
    assert type(caught.value) is expected
    sent = item.openai if provider == "openai" and item.openai else item
    assert caught.value.status == sent.status
    assert len(srv.requests) == 1
    assert srv.pending == 1
    assert events == []


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    ("item", "expected"),
    [
        (Error.overloaded(), LLMRateLimited),
        (Error(403, "permission_error", "not allowed"), LLMAuthError),
        (Error(404, "not_found_error", "model: no-such-model"), LLMBadRequest),
        (Error(400, "invalid_request_error", "messages: field required"), LLMBadRequest),
        (Error(502, "api_error", "bad gateway"), LLMServerError),
        (Raw(503, "<html>upstream down</html>", "text/html"), LLMServerError),
    ],
)
async def test_error_classification(
    srv: FakeLLMServer, make: Make, provider: str, item: Item, expected: type[LLMError]
) -> None:
    srv.script(item)
    with pytest.raises(LLMError) as caught:
        await make(provider).complete(REQUEST)
    assert type(caught.value) is expected
    assert caught.value.provider == provider
    assert caught.value.model == "model-a"


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize(
    "item",
    [
        Raw(200, "this is not json"),
        Raw(200, '{"unexpected": true}'),
        Raw(200, "<html>captive portal</html>", "text/html"),
        Raw(200, '{"choices": [], "content": null}'),
    ],
)
async def test_invalid_200_body(srv: FakeLLMServer, make: Make, provider: str, item: Raw) -> None:
    srv.script(item)
    with pytest.raises(LLMInvalidResponse):
        await make(provider).complete(REQUEST)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_connection_refused(make: Make, provider: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}" + ("/v1" if provider == "openai" else "")
    with pytest.raises(LLMConnectionError):
        await make(provider, base_url=base_url).complete(REQUEST)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_timeout(srv: FakeLLMServer, make: Make, provider: str) -> None:
    srv.script(Hang())
    started = time.monotonic()
    with pytest.raises(LLMTimeoutError):
        await make(provider, timeout_s=0.5).complete(REQUEST)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("key", [None, ""])
async def test_missing_key_sends_nothing(
    srv: FakeLLMServer, make: Make, provider: str, key: str | None
) -> None:
    llm = resilient([make(provider, api_key=key)], [], sleep=no_sleep)
    with pytest.raises(LLMMissingCredential) as caught:
        await llm.complete(REQUEST)
    assert caught.value.env_name == KEY_ENV
    assert KEY_ENV in caught.value.user_message
    assert srv.requests == []


async def test_anthropic_body_that_is_not_json_is_a_bad_request(
    srv: FakeLLMServer, make: Make
) -> None:
    # NaN has no JSON form; the API would reject it, so it is refused before sending.
    history = Message("assistant", (ToolUseBlock("call_1", "get_weather", {"x": float("nan")}),))
    results = Message("user", (ToolResultBlock("call_1", "ok"),))
    request = LLMRequest(REQUEST.system, (*REQUEST.messages, history, results), (WEATHER,))
    with pytest.raises(LLMBadRequest, match="not JSON"):
        await make("anthropic").complete(request)
    assert srv.requests == []


async def test_openai_garbage_tool_arguments_do_not_raise(srv: FakeLLMServer, make: Make) -> None:
    srv.script(
        Reply(
            tool_calls=[
                Call("get_weather", "{not json", id="c1"),
                Call("get_weather", "[1, 2]", id="c2"),
                Call("get_weather", '{"city": "Oslo"}', id="c3"),
            ]
        )
    )
    response = await make("openai").complete(LLMRequest("", REQUEST.messages, (WEATHER,)))
    bad_json, not_object, good = response.message.tool_uses
    assert response.stop_reason == "tool_use"
    assert (bad_json.id, bad_json.arguments) == ("c1", {})
    assert "not valid JSON" in (bad_json.arguments_error or "")
    assert not_object.arguments == {}
    assert "not an object" in (not_object.arguments_error or "")
    assert (good.arguments, good.arguments_error) == ({"city": "Oslo"}, None)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_cancellation_during_hang_propagates(
    srv: FakeLLMServer, make: Make, provider: str
) -> None:
    srv.script(Hang())
    llm = resilient([make(provider, timeout_s=30)], [])
    task = asyncio.create_task(llm.complete(REQUEST))
    async with asyncio.timeout(5):
        await srv.wait_for_requests(1)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 0.5


async def test_cancellation_during_backoff_propagates(srv: FakeLLMServer, make: Make) -> None:
    srv.script(Error.rate_limited(20), Reply("never"))
    retrying = asyncio.Event()
    llm = ResilientLLM(chain=[make("openai")], on_event=lambda kind, data: retrying.set())
    task = asyncio.create_task(llm.complete(REQUEST))
    async with asyncio.timeout(5):
        await retrying.wait()
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 0.5
    assert len(srv.requests) == 1


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_api_key_never_in_error_text(srv: FakeLLMServer, make: Make, provider: str) -> None:
    echoes: list[Item] = [
        Error(401, "authentication_error", f"Incorrect API key provided: {KEY}"),
        Error(400, "invalid_request_error", f"header was 'Authorization: Bearer {KEY}'"),
        Error(429, "rate_limit_error", f"key {KEY} is over its limit", {"retry-after": "0"}),
        Error(500, "api_error", f"upstream said {KEY}"),
        Raw(502, f"<html>proxy saw {KEY}</html>", "text/html"),
        Raw(200, f"not json {KEY}"),
    ]
    adapter = make(provider)
    for item in echoes:
        srv.script(item)
        with pytest.raises(LLMError) as caught:
            await adapter.complete(REQUEST)
        for text in (str(caught.value), caught.value.user_message, repr(caught.value)):
            assert KEY not in text, (item, text)
    assert len(srv.requests) == len(echoes)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_fake_rejects_requests_without_credentials(srv: FakeLLMServer, provider: str) -> None:
    # Guards the guard: the fake must notice a missing key, or the auth checks above prove nothing.
    import aiohttp

    url = srv.url + ("/v1/messages" if provider == "anthropic" else "/v1/chat/completions")
    srv.script(Reply("unused"))
    async with aiohttp.ClientSession() as session, session.post(url, json={"model": "m"}) as resp:
        assert resp.status == 401
        body = await resp.json()
    assert body["error"]["type"] in ("authentication_error", "invalid_request_error")
    assert srv.pending == 1
    assert len(srv.requests) == 1
