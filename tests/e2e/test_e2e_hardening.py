"""What an outside attack found, closed, shown through ``geodebot serve``: a hostile model (the
fake model server answers what an attacker would) and a hostile HTTP client, against the real
daemon on the fake Telegram Bot API.

One daemon serves every test of this file; each test talks in a chat of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.support.abuse import free_port, metric
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import Call, FakeLLMServer, Item, Raw, Reply, last_prompt
from tests.support.fakes.telegram_server import FakeTelegram

pytestmark = pytest.mark.asyncio(loop_scope="module")

SEARCH, OTHER, FILES, LABELS = -4001, -4002, -4003, -4004
# One chat (and session) per unrepresentable input, so each case stands on its own.
NAN_CHAT, DEEP_CHAT, SURROGATE_CHAT = -4005, -4006, -4007
ALICE = 4242
KEY_ENV, TOKEN_ENV, HTTP_TOKEN_ENV = "HARDEN_MODEL_KEY", "HARDEN_TG_TOKEN", "HARDEN_HTTP_TOKEN"
HTTP_TOKEN = "harden-http-token-0123456789"
# Nested quantifiers on an ordinary 40-character line: a backtracking engine tries every way
# of splitting the 38 word characters before it finds that the line does not match (about
# 2^38 steps, hours; each further character doubles it).
CATASTROPHIC = r"^(\w+\s?)*$"
LINE = "deployment_finished_without_any_errors!!"
HOOK = """
import json, sys
event = json.load(sys.stdin)
if event["tool"] == "write_file":
    print(json.dumps({"decision": "withhold", "reason": "writes are private here"}))
else:
    print(json.dumps({"decision": "add_context", "context": "reviewed by the edit hook"}))
"""


Script = Callable[[int, bool], Item]  # (tool rounds so far, streamed) -> the answer


def _raw_tool_use(call_id: str, name: str, input_json: str) -> Raw:
    """An Anthropic message whose tool input is ``input_json`` verbatim (any JSON, or not)."""
    return Raw(
        200,
        '{"id":"msg_raw","type":"message","role":"assistant","model":"harden-model",'
        f'"content":[{{"type":"tool_use","id":"{call_id}","name":"{name}","input":{input_json}}}],'
        '"stop_reason":"tool_use","stop_sequence":null,'
        '"usage":{"input_tokens":3,"output_tokens":3}}',
    )


def _search(rounds: int) -> Item:
    if rounds == 0:
        arguments = {"pattern": CATASTROPHIC, "regex": True, "path": "logs"}
        return Reply(tool_calls=[Call("search_files", arguments)])
    return Reply("search finished")


def _write_and_edit(rounds: int) -> Item:
    if rounds < 2:  # the same two calls twice: the second round is a replay
        return Reply(
            tool_calls=[
                Call("write_file", {"path": "secret.txt", "content": "s3cr3t"}),
                Call("edit_file", {"path": "notes.txt", "old_text": "old", "new_text": "new"}),
            ]
        )
    return Reply("files done")


def _made_up_tools(rounds: int) -> Item:
    if rounds == 0:
        return Reply(tool_calls=[Call(f"{'z' * 10_000}{i:03d}", {}) for i in range(100)])
    return Reply("labels done")


def _raw_streamed_tool_use(call_id: str, name: str, input_json: str) -> Raw:
    """The same message streamed (SSE), its tool input one ``input_json_delta`` verbatim."""
    message = {
        "id": "msg_raw",
        "type": "message",
        "role": "assistant",
        "model": "harden-model",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 0},
    }
    block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
    events = [
        ("message_start", {"type": "message_start", "message": message}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": input_json},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 3},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    body = "".join(f"event: {kind}\ndata: {json.dumps(data)}\n\n" for kind, data in events)
    return Raw(200, body, content_type="text/event-stream")


def _unrepresentable(call_id: str, input_json: str, answer: str) -> Script:
    def reply(rounds: int, streamed: bool) -> Item:
        if rounds:
            return Reply(answer)
        raw = _raw_streamed_tool_use if streamed else _raw_tool_use
        return raw(call_id, "get_time", input_json)

    return reply


# The newest user text of a request -> what the model answers, by tool rounds since.
SCRIPTS: dict[str, Callable[[int], Item]] = {
    "search the logs": _search,
    "are you there?": lambda _: Reply("still here"),
    "write and edit": _write_and_edit,
    "call made-up tools": _made_up_tools,
    "still working?": lambda _: Reply("yes, still working"),
}
# The same, for answers written out by hand: streamed or not, as the request asked.
RAW_SCRIPTS: dict[str, Script] = {
    "send NaN": _unrepresentable("toolu_nan", '{"timezone": NaN}', "NaN refused"),
    "send a deep input": _unrepresentable(
        "toolu_deep", '{"a":' * 3000 + "1" + "}" * 3000, "depth refused"
    ),
    "send a lone surrogate": _unrepresentable(
        "toolu_sur", '{"timezone": "\\ud800"}', "surrogate refused"
    ),
}


def hostile_model(body: Mapping[str, Any]) -> Item | None:
    prompt, rounds = last_prompt(body)
    if prompt in RAW_SCRIPTS:
        return RAW_SCRIPTS[prompt](rounds, bool(body.get("stream")))
    script = SCRIPTS.get(prompt)
    return None if script is None else script(rounds)


@dataclass
class World:
    telegram: FakeTelegram
    llm: FakeLLMServer
    daemon: DaemonProcess
    workspace: Path
    http_port: int
    http: aiohttp.ClientSession
    pending: dict[int, int] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def get(self, path: str) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {HTTP_TOKEN}"}
        async with self.http.get(self.base + path, headers=headers) as response:
            return response.status, await response.text()

    async def ask(self, chat: int, text: str, timeout: float = 30) -> str:
        """Send ``text`` in ``chat`` and return the next reply there."""
        seen = len(self.telegram.sent[chat])
        self.telegram.push_message(chat, text, user_id=ALICE)
        sent = await self.telegram.wait_for_sent(chat, seen + 1, timeout=timeout)
        return sent[seen].text

    def requests_with(self, prompt: str) -> list[dict[str, Any]]:
        return [
            r.json
            for r in self.llm.requests
            if isinstance(r.json, dict) and last_prompt(r.json)[0] == prompt
        ]


def tool_results(body: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every tool_result block of a request, by its tool_use_id (the latest wins)."""
    found: dict[str, dict[str, Any]] = {}
    for message in body["messages"]:
        if isinstance(message["content"], list):
            for block in message["content"]:
                if block.get("type") == "tool_result":
                    found[block["tool_use_id"]] = block
    return found


def result_text(block: Mapping[str, Any]) -> str:
    content = block["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    tmp = tmp_path_factory.mktemp("harden")
    workspace = tmp / "workspace"
    (workspace / "logs").mkdir(parents=True)
    for i in range(20):
        (workspace / "logs" / f"app-{i:03d}.log").write_text(f"{LINE}\n" * 20)
    (workspace / "notes.txt").write_text("old notes\n")
    hook = tmp / "hook.py"
    hook.write_text(HOOK)
    port = free_port()
    async with (
        FakeTelegram() as telegram,
        FakeLLMServer() as llm,
        aiohttp.ClientSession() as http,
    ):
        llm.responder = hostile_model
        config = tmp / "config.toml"
        binding = 'platform = "telegram"\nallowed_users = ["*"]\n'
        config.write_text(
            f'[daemon]\nstate_dir = "{tmp / "var"}"\nhttp = "127.0.0.1:{port}"\n'
            f'http_token_env = "{HTTP_TOKEN_ENV}"\nshutdown_grace_s = 5\n'
            "max_concurrent_sessions = 8\nuser_rate_per_min = 0\n"
            f'[model]\nprovider = "anthropic"\nname = "harden-model"\n'
            f'base_url = "{llm.url}"\napi_key_env = "{KEY_ENV}"\nmax_retries = 0\n'
            f'[tools]\nworkspace = "{workspace}"\nipc_tools = ["get_time"]\n'
            f'[[hooks]]\nevent = "PostToolUse"\ncommand = ["{sys.executable}", "{hook}"]\n'
            'tools = ["write_file", "edit_file"]\n'
            f'[channels.telegram]\ntoken_env = "{TOKEN_ENV}"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f'[[bindings]]\n{binding}channel = "{SEARCH}"\nsession = "search"\n'
            'tools = ["search_files"]\n'
            f'[[bindings]]\n{binding}channel = "{OTHER}"\nsession = "other"\n'
            f'[[bindings]]\n{binding}channel = "{FILES}"\nsession = "files"\n'
            'tools = ["write_file", "edit_file"]\npreapproved = ["write_file", "edit_file"]\n'
            f'[[bindings]]\n{binding}channel = "{LABELS}"\nsession = "labels"\n'
            'tools = ["get_time"]\n'
            + "".join(
                f'[[bindings]]\n{binding}channel = "{chat}"\nsession = "brick{chat}"\n'
                'tools = ["get_time"]\n'
                for chat in (NAN_CHAT, DEEP_CHAT, SURROGATE_CHAT)
            )
        )
        env = dict(
            os.environ,
            **{KEY_ENV: "sk-harden", TOKEN_ENV: telegram.token, HTTP_TOKEN_ENV: HTTP_TOKEN},
        )
        daemon = await DaemonProcess(config, env).start()
        try:
            yield World(telegram, llm, daemon, workspace, port, http)
        finally:
            code = await daemon.stop()
            assert code == 0, daemon.text()[-3000:]


# -- 1. no tool's work stalls the event loop --------------------------------------------
async def test_a_catastrophic_search_pattern_never_stalls_the_daemon(world: World) -> None:
    latencies: list[float] = []

    statuses: set[int] = set()

    async def probe() -> None:
        while True:
            started = time.monotonic()
            try:
                status, _ = await asyncio.wait_for(world.get("/healthz"), 5)
            except TimeoutError:
                status = 0
            latencies.append(time.monotonic() - started)
            statuses.add(status)
            await asyncio.sleep(0.05)

    prober = asyncio.create_task(probe())
    try:
        asked = len(world.llm.requests)
        searched = asyncio.create_task(world.ask(SEARCH, "search the logs"))
        # The other chat asks once the search's call went out, while it runs.
        async with asyncio.timeout(20):
            await world.llm.wait_for_requests(asked + 1)
        other = await world.ask(OTHER, "are you there?", timeout=10)
        answer = await asyncio.wait_for(searched, 30)
    finally:
        prober.cancel()
    assert latencies
    assert max(latencies) < 1.0, latencies
    # Every probe got an answer (0: none within 5 s).
    assert statuses <= {200, 503}
    assert other == "still here"
    assert answer == "search finished"
    [*_, last] = world.requests_with("search the logs")
    [result] = tool_results(last).values()
    text = result_text(result)
    # Every line was searched to its end: no match, no timeout, no partial result.
    assert text.startswith("no matches"), text
    assert "stopped" not in text


async def test_a_pattern_re2_cannot_run_linearly_is_refused_cleanly(world: World) -> None:
    # Backreferences need backtracking; the model is told, the daemon logs nothing for it.
    world.llm.responder = None
    world.llm.script(
        Reply(tool_calls=[Call("search_files", {"pattern": r"(a)\1", "regex": True})]),
        Reply("refused as expected"),
    )
    try:
        assert await world.ask(SEARCH, "backreference please") == "refused as expected"
    finally:
        world.llm.responder = hostile_model
    *_, result = tool_results(world.llm.requests[-1].json).values()
    assert result["is_error"] is True
    assert "invalid regex" in result_text(result)
    assert "re2.cc" not in world.daemon.text()


# -- 4. a PostToolUse decision also governs replays --------------------------------------
async def test_a_replay_returns_what_the_hooks_let_the_model_see(world: World) -> None:
    assert await world.ask(FILES, "write and edit") == "files done"
    first, second, last = world.requests_with("write and edit")
    assert tool_results(first) == {}
    # Round one: the write's result withheld, the edit's result with the hook's note.
    round_one = list(tool_results(second).values())
    withheld, noted = (result_text(b) for b in round_one)
    assert "withheld" in withheld
    assert "s3cr3t" not in withheld
    assert "reviewed by the edit hook" in noted
    # Round two repeated both calls exactly: they were replayed, not run again, and the model
    # saw the same as the first time, never the result the hook withheld.
    round_two = [b for b in tool_results(last).values() if b not in round_one]
    assert len(round_two) == 2
    replay_write, replay_edit = (result_text(b) for b in round_two)
    assert "already ran" in replay_write
    assert "already ran" in replay_edit
    assert "withheld" in replay_write
    # What the write tool itself answered ("created secret.txt (6 bytes)") never reaches it.
    assert "secret.txt" not in replay_write
    assert "reviewed by the edit hook" in replay_edit
    assert (world.workspace / "secret.txt").read_text() == "s3cr3t"
    assert (world.workspace / "notes.txt").read_text() == "new notes\n"


# -- 5. nothing a model chooses becomes a metric label -----------------------------------
async def test_made_up_tool_names_never_become_metric_labels(world: World) -> None:
    _, before = await world.get("/metrics")
    assert (await world.ask(LABELS, "call made-up tools")).startswith("labels done")
    _, after = await world.get("/metrics")
    assert "zzzzzzzzzz" not in after
    refused = metric(after, "geodebot_tool_calls_total", tool="other", status="refused")
    assert refused - metric(before, "geodebot_tool_calls_total", tool="other") == 100
    # 100 refused calls with 10 KB names add one series, not 100 (about 2 MB).
    assert len(after) - len(before) < 20_000


# -- 6. one bad model response never bricks a session -------------------------------------
@pytest.mark.parametrize(
    ("chat", "prompt", "call_id", "said", "answer"),
    [
        (NAN_CHAT, "send NaN", "toolu_nan", "NaN", "NaN refused"),
        (DEEP_CHAT, "send a deep input", "toolu_deep", "nested", "depth refused"),
        (SURROGATE_CHAT, "send a lone surrogate", "toolu_sur", "surrogate", "surrogate refused"),
    ],
)
async def test_an_unrepresentable_tool_input_is_refused_and_the_session_goes_on(
    world: World, chat: int, prompt: str, call_id: str, said: str, answer: str
) -> None:
    assert (await world.ask(chat, prompt)).startswith(answer)
    result = tool_results(world.requests_with(prompt)[-1])[call_id]
    assert result["is_error"] is True
    assert "invalid arguments" in result_text(result)
    assert said in result_text(result)
    # The session still sends its whole history: the next message gets a model call.
    assert await world.ask(chat, "still working?") == "yes, still working"
    assert "Traceback" not in world.daemon.text()


# -- 10. a non-UTF-8 Authorization header is a 401, not a 500 ------------------------------
@pytest.mark.parametrize("value", [b"Bearer \xff\xfe\xfd", b"\xc3\x28", "Bearer é".encode()])
async def test_an_undecodable_authorization_header_is_refused_with_401(
    world: World, value: bytes
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", world.http_port)
    try:
        writer.write(
            b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
            + value
            + b"\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line = response.split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"401", response[:500]
    assert b"Traceback" not in response
    assert json.loads(response.split(b"\r\n\r\n", 1)[1]) == {"error": "unauthorized"}
    assert "Traceback" not in world.daemon.text()
