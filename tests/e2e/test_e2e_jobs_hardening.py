"""Chat-made jobs act for the chat that made them, through ``geodebot serve`` as a real process:
python-telegram-bot against the fake Bot API, the anthropic SDK against the fake model.

One daemon serves the whole file. Its model is a responder: a message (or a job's prompt)
``TAG: CALL {"name": ..., "arguments": ...}`` makes it call that tool, and the answer after a
tool result is ``DONE TAG``; a prompt without a call is answered ``REPORT TAG``. Four chats:
X and Y share the session "ops" (X first, so "the first binding of the session" is X), A and
B have sessions of their own; only X has ``write_file`` and only A has ``read_file``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from geodebot.config.schema import DB_FILE
from geodebot.store.records import FireRecord, JobRecord
from geodebot.store.sqlite import SQLiteStore
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import Call, FakeLLMServer, Item, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.waiting import fires_when

pytestmark = pytest.mark.asyncio(loop_scope="module")

X, Y, A, B = -2001, -2002, -1001, -1002
ALICE = 4242
SECRET = "SECRET-OF-A-7731"
JOB_TOOLS = ["schedule_job", "list_jobs", "cancel_job"]
APPROVED = ["schedule_job", "cancel_job"]


def _binding(chat: int, session: str, tools: Sequence[str], preapproved: Sequence[str]) -> str:
    return (
        f'[[bindings]]\nplatform = "telegram"\nchannel = "{chat}"\nsession = "{session}"\n'
        f'allowed_users = ["{ALICE}"]\ntools = {json.dumps(list(tools))}\n'
        f"preapproved = {json.dumps(list(preapproved))}\n"
    )


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message["content"]
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def _text(block: dict[str, Any]) -> str:
    content = block.get("content", block.get("text", ""))
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def prompt_of(body: dict[str, Any]) -> str:
    """The text that started this turn: the newest user message that is not a tool result."""
    for message in reversed(body["messages"]):
        if message["role"] != "user":
            continue
        texts = [_text(b) for b in _blocks(message) if b.get("type") == "text"]
        if texts:
            return "\n".join(texts)
    return ""


def tag_of(body: dict[str, Any]) -> str:
    words = prompt_of(body).split()
    return words[0].rstrip(":") if words else ""


def respond(body: dict[str, Any]) -> Item:
    tag = tag_of(body)
    last = body["messages"][-1]
    if any(b.get("type") == "tool_result" for b in _blocks(last)):
        return Reply(f"DONE {tag}")
    prompt = prompt_of(body)
    if "CALL " not in prompt:
        return Reply(f"REPORT {tag}")
    call, _ = json.JSONDecoder().raw_decode(prompt, prompt.index("CALL ") + len("CALL "))
    return Reply(tool_calls=[Call(call["name"], call["arguments"])])


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def schedule(job_id: str, prompt: str, tools: Sequence[str] = ()) -> dict[str, Any]:
    return call("schedule_job", id=job_id, every="1h", prompt=prompt, tools=list(tools))


@dataclass(frozen=True)
class ToolResult:
    text: str
    is_error: bool


@dataclass
class Daemon:
    telegram: FakeTelegram
    llm: FakeLLMServer
    tmp: Path
    process: DaemonProcess

    @property
    def store_path(self) -> Path:
        return self.tmp / "var" / DB_FILE

    @property
    def workspace(self) -> Path:
        return self.tmp / "workspace"

    def texts(self, chat: int) -> list[str]:
        return [m.text for m in self.telegram.sent[chat]]

    async def wait_text(self, needle: str, chats: Sequence[int]) -> int:
        """Until a message containing ``needle`` is sent in one of ``chats``; returns that chat."""
        async with asyncio.timeout(30):
            while True:
                for chat in chats:
                    if any(needle in text for text in self.texts(chat)):
                        return chat
                await asyncio.sleep(0.02)

    async def say(self, chat: int, tag: str, tool_call: dict[str, Any]) -> ToolResult:
        """A user in ``chat`` has the model make ``tool_call``; the tool result it got back."""
        self.telegram.push_message(chat, f"{tag}: CALL {json.dumps(tool_call)}", user_id=ALICE)
        await self.wait_text(f"DONE {tag}", [chat])
        return self.tool_result(tag)

    def tool_result(self, tag: str) -> ToolResult:
        for request in self.llm.requests:
            body = request.json
            if isinstance(body, dict) and tag_of(body) == tag:
                blocks = _blocks(body["messages"][-1])
                results = [b for b in blocks if b.get("type") == "tool_result"]
                if results:
                    return ToolResult(_text(results[-1]), bool(results[-1].get("is_error")))
        raise AssertionError(f"no tool result for {tag}")

    def requests_of(self, tag: str) -> list[str]:
        """Every model request of the turns started by a prompt tagged ``tag``, as JSON."""
        return [
            json.dumps(r.json)
            for r in self.llm.requests
            if isinstance(r.json, dict) and tag_of(r.json) == tag
        ]

    async def job(self, job_id: str) -> JobRecord | None:
        async with SQLiteStore(self.store_path) as store:
            return await store.job_get(job_id)

    async def add_job(self, job: JobRecord) -> None:
        async with SQLiteStore(self.store_path) as store:
            await store.job_add(job)

    async def fire(self, job_id: str) -> None:
        """A manual run, as ``geodebot jobs run`` requests it; the daemon picks it up."""
        async with SQLiteStore(self.store_path) as store:
            await store.fire_request(job_id, int(time.time() * 1000))

    async def wait_history(
        self, job_id: str, predicate: Callable[[list[FireRecord]], bool]
    ) -> list[FireRecord]:
        return await fires_when(self.store_path, job_id, predicate, timeout=30)


def old_job(job_id: str, session: str, prompt: str) -> JobRecord:
    """A chat-made job as rows were written before jobs recorded their binding; anchored at
    its making, as the chat's tool anchors one, so it does not fire at a whole hour while the
    tests run."""
    now = time.time()
    return JobRecord(
        id=job_id, origin="chat", schedule_kind="every", schedule="1h", timezone="UTC",
        anchor_ms=int(now * 1000), prompt=prompt, deliver_to=session,
        session_id=f"job:{job_id}", tools=(), time_budget_s=None, catch_up="latest",
        notify_on_failure=True,
        creator=f"binding:{session}", paused=False, since_ms=int(now * 1000), created_at=now,
        updated_at=now,
    )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    tmp = tmp_path_factory.mktemp("jobs-hardening")
    (tmp / "workspace").mkdir()
    (tmp / "workspace" / "secret.txt").write_text(SECRET + "\n")
    async with FakeTelegram() as telegram, FakeLLMServer() as llm:
        llm.responder = respond
        config = tmp / "config.toml"
        config.write_text(
            # One user sends every message of the file, a dozen within seconds: the default
            # rate limit (a burst of 10, then one message every 2 s) would drop the last ones
            # whenever the tests run quickly. Throttling has tests of its own.
            f'[daemon]\nstate_dir = "{tmp / "var"}"\nuser_rate_per_min = 0\n'
            f'[model]\nprovider = "anthropic"\nname = "e2e-model"\nbase_url = "{llm.url}"\n'
            f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            f'[tools]\nworkspace = "{tmp / "workspace"}"\n'
            f'[channels.telegram]\ntoken_env = "E2E_TELEGRAM_TOKEN"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
            + _binding(X, "ops", [*JOB_TOOLS, "write_file"], [*APPROVED, "write_file"])
            + _binding(Y, "ops", JOB_TOOLS, APPROVED)
            + _binding(A, "alpha", [*JOB_TOOLS, "read_file"], APPROVED)
            + _binding(B, "beta", JOB_TOOLS, APPROVED)
        )
        env = dict(os.environ, E2E_TELEGRAM_TOKEN=telegram.token)
        env[TEST_KEY_ENV] = TEST_KEY
        async with SQLiteStore(tmp / "var" / DB_FILE) as store:
            await store.job_add(old_job("old-shared", "ops", "JOB-OS"))
            await store.job_add(old_job("old-alpha", "alpha", "JOB-OA"))
        process = await DaemonProcess(config, env).start()
        try:
            yield Daemon(telegram, llm, tmp, process)
        finally:
            assert await process.stop() == 0
        assert "Traceback" not in process.text()
        assert telegram.token not in process.text()


async def test_a_job_remade_with_a_cancelled_jobs_id_in_another_chat_inherits_nothing(
    daemon: Daemon,
) -> None:
    reader = call("read_file", path="secret.txt")
    made = await daemon.say(
        A, "a-make", schedule("daily", f"JOB-A: CALL {json.dumps(reader)}", ["read_file"])
    )
    assert not made.is_error, made.text
    first = await daemon.job("daily")
    assert first is not None
    await daemon.fire("daily")
    await daemon.wait_text("DONE JOB-A", [A])
    # The first job's history holds what only chat A could read.
    assert any(SECRET in body for body in daemon.requests_of("JOB-A"))
    cancelled = await daemon.say(A, "a-cancel", call("cancel_job", id="daily"))
    assert not cancelled.is_error, cancelled.text
    assert await daemon.job("daily") is None

    remade = await daemon.say(B, "b-make", schedule("daily", "JOB-B"))
    assert not remade.is_error, remade.text
    second = await daemon.job("daily")
    assert second is not None
    await daemon.fire("daily")
    chat = await daemon.wait_text("REPORT JOB-B", [A, B])

    assert chat == B
    assert not any("JOB-B" in text for text in daemon.texts(A))
    bodies = daemon.requests_of("JOB-B")
    assert bodies
    for body in bodies:
        assert SECRET not in body
        assert "JOB-A" not in body
        assert "a-make" not in body
    assert second.session_id != first.session_id


async def test_a_chat_sharing_a_session_is_checked_and_answered_as_itself(
    daemon: Daemon,
) -> None:
    writer = call("write_file", path="pwned.txt", content="owned")
    in_x = len(daemon.texts(X))
    refused = await daemon.say(
        Y, "y-writer", schedule("writer", f"JOB-W: CALL {json.dumps(writer)}", ["write_file"])
    )
    plain = await daemon.say(Y, "y-plain", schedule("plain", "JOB-P"))
    created = await daemon.job("writer")
    # Run both, had the first been made, and wait until each run is over.
    for job_id in ("writer", "plain"):
        await daemon.fire(job_id)
        await daemon.wait_history(job_id, lambda rows: any(f.final for f in rows))
    chat = await daemon.wait_text("REPORT JOB-P", [X, Y])

    assert refused.is_error
    assert "does not have write_file" in refused.text
    assert created is None
    assert not (daemon.workspace / "pwned.txt").exists()
    assert not plain.is_error, plain.text
    assert chat == Y
    assert daemon.texts(X)[in_x:] == []


async def test_a_chat_neither_sees_nor_cancels_the_job_of_another_chat_on_its_session(
    daemon: Daemon,
) -> None:
    made = await daemon.say(Y, "y-mine", schedule("mine", "JOB-M"))
    assert not made.is_error, made.text
    listed_x = await daemon.say(X, "x-list", call("list_jobs"))
    foreign = await daemon.say(X, "x-cancel", call("cancel_job", id="mine"))
    ghost = await daemon.say(X, "x-ghost", call("cancel_job", id="ghost"))
    daemon.telegram.push_message(X, "/status", user_id=ALICE)
    await daemon.wait_text("Session: ops", [X])
    listed_y = await daemon.say(Y, "y-list", call("list_jobs"))

    assert "mine" not in [j["id"] for j in json.loads(listed_x.text)["jobs"]]
    assert foreign.is_error
    assert ghost.is_error
    # Another chat's job and no job at all get the same answer.
    assert foreign.text.replace("'mine'", "'ghost'") == ghost.text
    assert await daemon.job("mine") is not None
    status = next(text for text in daemon.texts(X) if "Session: ops" in text)
    assert "mine" not in status
    mine = [j for j in json.loads(listed_y.text)["jobs"] if j["id"] == "mine"]
    assert [j["made_here"] for j in mine] == [True]


async def test_old_chat_jobs_go_by_the_one_binding_of_their_session_or_fail_if_shared(
    daemon: Daemon,
) -> None:
    """Rows from before jobs recorded their binding name only a session. Where one binding
    has it, the job goes on in that chat: the daemon names the binding when it starts (the
    rows seeded before it did), and a row written since still delivers there. Where several
    bindings share it, the fire fails with the reason instead of picking one of them."""
    named, shared = await daemon.job("old-alpha"), await daemon.job("old-shared")
    await daemon.add_job(old_job("late-alpha", "alpha", "JOB-LA"))
    listed_a = await daemon.say(A, "a-list", call("list_jobs"))
    listed_x = await daemon.say(X, "x-list-old", call("list_jobs"))
    sent_before = {chat: len(daemon.texts(chat)) for chat in (X, Y)}
    for job_id in ("old-shared", "old-alpha", "late-alpha"):
        await daemon.fire(job_id)
    rows = await daemon.wait_history("old-shared", lambda rows: any(f.final for f in rows))
    chats = [await daemon.wait_text(f"REPORT {tag}", [A, B, X, Y]) for tag in ("JOB-OA", "JOB-LA")]

    assert [f.outcome for f in rows] == ["failed"], rows
    assert "shared by telegram:-2001, telegram:-2002" in rows[0].reason
    assert daemon.requests_of("JOB-OS") == []
    assert {chat: len(daemon.texts(chat)) for chat in (X, Y)} == sent_before
    assert chats == [A, A]
    mine = {j["id"]: j["made_here"] for j in json.loads(listed_a.text)["jobs"]}
    assert mine == {"old-alpha": True}
    assert "old-shared" not in [j["id"] for j in json.loads(listed_x.text)["jobs"]]
    assert named is not None
    assert (named.deliver_binding, named.creator) == ("telegram:-1001", "binding:telegram:-1001")
    assert shared is not None
    assert (shared.deliver_binding, shared.creator) == ("", "binding:ops")
