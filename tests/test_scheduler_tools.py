"""schedule_job / list_jobs / cancel_job as a chat's DAEMON turn calls them: through the
engine's tool pipeline (plan, receipts, dispatch), the model being the fake server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.app import App
from geodebot.config import BindingConfig
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec
from geodebot.scheduler.tools import calling_binding
from tests.conftest import make_config, open_app, with_sections
from tests.fakes.llm_server import Call, FakeLLMServer, Reply

JOB_TOOLS = ["schedule_job", "list_jobs", "cancel_job"]
BINDINGS = [
    {
        "platform": "telegram",
        "channel": "c1",
        "session": "ops",
        "allowed_users": ["*"],
        "tools": [*JOB_TOOLS, "get_time"],
        # Like any write, scheduling unattended needs the operator's pre-approval.
        "preapproved": ["schedule_job", "cancel_job"],
    },
    {
        "platform": "slack",
        "channel": "C2",
        "session": "dev",
        "scope": "thread",
        "allowed_users": ["*"],
        "tools": JOB_TOOLS,
        "preapproved": ["schedule_job", "cancel_job"],
    },
    {"platform": "telegram", "channel": "c3", "session": "quiet", "allowed_users": ["*"]},
    {
        "platform": "telegram",
        "channel": "c4",
        "session": "unapproved",
        "allowed_users": ["*"],
        "tools": JOB_TOOLS,
    },
]


@pytest.fixture
async def app(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[App]:
    config = with_sections(make_config(tmp_path, llm_server), bindings=BINDINGS)
    async with AsyncExitStack() as stack:
        yield await open_app(config, stack, tmp_path / "marker")


def binding(app: App, session: str) -> BindingConfig:
    return next(b for b in app.config.bindings if b.session == session)


async def call_tool(
    app: App, llm: FakeLLMServer, session: str, tool: str, arguments: Mapping[str, Any]
) -> dict[str, Any]:
    """One chat turn in which the model calls ``tool``; the tool_result the model got back."""
    before = len(llm.requests)
    llm.script(Reply(tool_calls=[Call(tool, dict(arguments))]), Reply("Done."))
    b = binding(app, session.split("/")[0])
    spec = SessionSpec(session, tools=b.tools, preapproved=b.preapproved)
    result = await app.run_turn(Mode.DAEMON, spec, "please")
    assert result.ok, result
    body = llm.requests[before + 1].json
    results = [
        block
        for message in body["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    return dict(results[-1])


def result_text(result: Mapping[str, Any]) -> str:
    content = result["content"]
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content)


async def test_schedule_job_echoes_the_schedule_and_three_fire_times(
    app: App, llm_server: FakeLLMServer
) -> None:
    arguments = {"id": "standup", "cron": "0 9 * * 1-5", "timezone": "Europe/Berlin"}
    result = await call_tool(app, llm_server, "ops", "schedule_job", {**arguments, "prompt": "Hi"})
    assert not result.get("is_error")
    echoed = json.loads(result_text(result))
    assert echoed["schedule"] == "cron 0 9 * * 1-5 (Europe/Berlin)"
    assert len(echoed["next_fires"]) == 3
    assert all(t.endswith(("+01:00", "+02:00")) and "T09:00:00" in t for t in echoed["next_fires"])
    job = await app.services.store.job_get("standup")
    assert job is not None
    assert job.origin == "chat"
    assert job.deliver_to == "ops"
    assert job.creator == "binding:ops"
    receipts = await app.services.store.list_receipts(session_id="ops")
    assert [(r.tool, r.effect, r.status) for r in receipts] == [
        ("schedule_job", "administrative", "committed")
    ]


async def test_a_tool_the_binding_lacks_is_refused(app: App, llm_server: FakeLLMServer) -> None:
    arguments = {"id": "sneaky", "every": "1h", "prompt": "x", "tools": ["get_time"]}
    result = await call_tool(app, llm_server, "dev/1700000000.1", "schedule_job", arguments)
    assert result.get("is_error")
    assert "does not have get_time" in result_text(result)
    assert await app.services.store.job_get("sneaky") is None


async def test_a_bad_schedule_is_a_tool_error(app: App, llm_server: FakeLLMServer) -> None:
    for arguments, expected in (
        ({"cron": "61 * * * *"}, "not a valid cron"),
        ({"cron": "* * *"}, "has 3 fields"),
        ({"every": "soon"}, "not a duration"),
        ({"at": "2001-01-01T00:00:00"}, "never fires"),
        ({"every": "1h", "cron": "* * * * *"}, "exactly one"),
        ({"every": "1h", "timezone": "Mars/Base"}, "unknown timezone"),
    ):
        job = {"id": "bad", "prompt": "x", **arguments}
        result = await call_tool(app, llm_server, "ops", "schedule_job", job)
        assert result.get("is_error"), arguments
        assert expected in result_text(result)
    assert await app.services.store.job_list() == []


async def test_only_the_creating_binding_can_cancel(app: App, llm_server: FakeLLMServer) -> None:
    made = {"id": "mine", "every": "1h", "prompt": "x"}
    result = await call_tool(app, llm_server, "ops", "schedule_job", made)
    assert not result.get("is_error")
    result = await call_tool(app, llm_server, "dev/1", "cancel_job", {"id": "mine"})
    assert result.get("is_error")
    assert "not scheduled from this chat" in result_text(result)
    assert await app.services.store.job_get("mine") is not None
    listed = await call_tool(app, llm_server, "dev/1", "list_jobs", {})
    assert json.loads(result_text(listed)) == {"jobs": []}
    listed = await call_tool(app, llm_server, "ops", "list_jobs", {})
    assert [j["id"] for j in json.loads(result_text(listed))["jobs"]] == ["mine"]
    result = await call_tool(app, llm_server, "ops", "cancel_job", {"id": "mine"})
    assert not result.get("is_error")
    assert await app.services.store.job_get("mine") is None


async def test_job_tools_exist_only_where_a_binding_lists_them(
    app: App, llm_server: FakeLLMServer
) -> None:
    result = await call_tool(
        app, llm_server, "quiet", "schedule_job", {"id": "x", "every": "1h", "prompt": "x"}
    )
    assert result.get("is_error")
    assert await app.services.store.job_get("x") is None


def test_calling_binding_maps_thread_sessions_to_their_binding(app: App) -> None:
    bindings = app.config.bindings
    assert calling_binding(bindings, "ops") is binding(app, "ops")
    assert calling_binding(bindings, "dev/123.4") is binding(app, "dev")
    # A channel-scope binding has no thread sessions; a job session belongs to no binding.
    assert calling_binding(bindings, "ops/1") is None
    assert calling_binding(bindings, "job:digest") is None


async def test_listing_without_pre_approval_can_read_but_not_schedule(
    app: App, llm_server: FakeLLMServer
) -> None:
    job = {"id": "nope", "every": "1h", "prompt": "x"}
    result = await call_tool(app, llm_server, "unapproved", "schedule_job", job)
    assert result.get("is_error")
    assert "refused" in result_text(result)
    assert await app.services.store.job_get("nope") is None
    listed = await call_tool(app, llm_server, "unapproved", "list_jobs", {})
    assert not listed.get("is_error")
