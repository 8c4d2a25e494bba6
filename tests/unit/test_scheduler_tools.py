"""schedule_job / list_jobs / cancel_job as a chat's DAEMON turn calls them: through the
engine's tool pipeline (plan, receipts, dispatch), the model being the fake server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from geodebot.app.build import App
from geodebot.chat.bindings import BindingIndex, binding_key
from geodebot.config.schema import BindingConfig
from geodebot.engine.modes import Mode
from geodebot.engine.session import SessionSpec
from geodebot.engine.tools.spec import ToolCallContext
from geodebot.scheduler.chat_tools import calling_binding
from tests.support.app import open_app
from tests.support.config import make_config, with_sections
from tests.support.fakes.llm_server import Call, FakeLLMServer, Reply

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
    # Two chats on one session: only the first has get_time.
    {
        "platform": "telegram",
        "channel": "c5",
        "session": "shared",
        "allowed_users": ["*"],
        "tools": [*JOB_TOOLS, "get_time"],
        "preapproved": ["schedule_job", "cancel_job"],
    },
    {
        "platform": "telegram",
        "channel": "c6",
        "session": "shared",
        "allowed_users": ["*"],
        "tools": JOB_TOOLS,
        "preapproved": ["schedule_job", "cancel_job"],
    },
]


@pytest.fixture
async def app(tmp_path: Path, llm_server: FakeLLMServer) -> AsyncIterator[App]:
    config = with_sections(make_config(tmp_path, llm_server), bindings=BINDINGS)
    async with AsyncExitStack() as stack:
        yield await open_app(config, stack, tmp_path / "marker")


def binding(app: App, session: str) -> BindingConfig:
    return next(b for b in app.config.bindings if b.session == session)


def by_key(app: App, key: str) -> BindingConfig:
    return next(b for b in app.config.bindings if binding_key(b) == key)


async def call_tool(
    app: App,
    llm: FakeLLMServer,
    session: str,
    tool: str,
    arguments: Mapping[str, Any],
    *,
    origin: str | None = "",
) -> dict[str, Any]:
    """One chat turn in which the model calls ``tool``; the tool_result the model got back.
    The turn comes from the binding ``origin`` names ("": the first binding of the session,
    None: from no chat), with that binding's tools, as the router makes it."""
    before = len(llm.requests)
    llm.script(Reply(tool_calls=[Call(tool, dict(arguments))]), Reply("Done."))
    b = binding(app, session.split("/")[0]) if not origin else by_key(app, origin)
    key = binding_key(b) if origin == "" else origin
    spec = SessionSpec(session, tools=b.tools, preapproved=b.preapproved, origin=key)
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
    assert job.deliver_binding == "telegram:c1"
    assert job.creator == "binding:telegram:c1"
    # A session of its own, never "job:<id>", which a removed job of that id may have used.
    assert job.session_id.startswith("job:standup:")
    assert echoed["delivers_to"] == "telegram:c1"
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
    assert "no job 'mine' was scheduled from this chat" in result_text(result)
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


def test_the_calling_binding_is_the_origin_if_the_session_is_its_own(app: App) -> None:
    index = BindingIndex(app.config.bindings)

    def caller(session: str, origin: str | None) -> BindingConfig | None:
        return calling_binding(index, ToolCallContext(session, "t-1", Mode.DAEMON, origin=origin))

    assert caller("ops", "telegram:c1") is binding(app, "ops")
    assert caller("dev/123.4", "slack:C2") is binding(app, "dev")
    # Two chats on one session: each is itself, whichever comes first in the config.
    assert caller("shared", "telegram:c6") is by_key(app, "telegram:c6")
    assert caller("shared", "telegram:c5") is by_key(app, "telegram:c5")
    # A channel-scope binding has no thread sessions; a job's own turn has no origin; an
    # origin that is not the session's binding, or no binding at all, is nobody.
    assert caller("ops/1", "telegram:c1") is None
    assert caller("job:digest", None) is None
    assert caller("ops", None) is None
    assert caller("ops", "telegram:c3") is None
    assert caller("ops", "telegram:nope") is None


async def test_a_chat_sharing_a_session_has_its_own_tools_target_and_jobs(
    app: App, llm_server: FakeLLMServer
) -> None:
    store = app.services.store
    wider = {"id": "wider", "every": "1h", "prompt": "x", "tools": ["get_time"]}
    result = await call_tool(app, llm_server, "shared", "schedule_job", wider, origin="telegram:c6")
    assert result.get("is_error")
    assert "does not have get_time" in result_text(result)
    assert await store.job_get("wider") is None
    plain = {"id": "plain", "every": "1h", "prompt": "x"}
    result = await call_tool(app, llm_server, "shared", "schedule_job", plain, origin="telegram:c6")
    assert not result.get("is_error")
    job = await store.job_get("plain")
    assert job is not None
    assert (job.deliver_binding, job.creator) == ("telegram:c6", "binding:telegram:c6")
    # The other chat on the session neither sees nor cancels it, and learns nothing of it.
    listed = await call_tool(app, llm_server, "shared", "list_jobs", {}, origin="telegram:c5")
    assert json.loads(result_text(listed)) == {"jobs": []}
    other = await call_tool(
        app, llm_server, "shared", "cancel_job", {"id": "plain"}, origin="telegram:c5"
    )
    ghost = await call_tool(
        app, llm_server, "shared", "cancel_job", {"id": "ghost"}, origin="telegram:c5"
    )
    assert other.get("is_error")
    assert result_text(other).replace("'plain'", "'ghost'") == result_text(ghost)
    assert await store.job_get("plain") is not None
    listed = await call_tool(app, llm_server, "shared", "list_jobs", {}, origin="telegram:c6")
    assert [(j["id"], j["made_here"]) for j in json.loads(result_text(listed))["jobs"]] == [
        ("plain", True)
    ]


async def test_a_turn_from_no_chat_cannot_manage_jobs(app: App, llm_server: FakeLLMServer) -> None:
    """A job's own turn, a terminal or a headless run has no origin, even on a binding's
    session (a config job may run on one)."""
    job = {"id": "loop", "every": "1h", "prompt": "x"}
    result = await call_tool(app, llm_server, "ops", "schedule_job", job, origin=None)
    assert result.get("is_error")
    assert "only from a bound chat" in result_text(result)
    assert await app.services.store.job_get("loop") is None


async def test_jobs_made_with_one_id_one_after_the_other_get_sessions_of_their_own(
    app: App, llm_server: FakeLLMServer
) -> None:
    sessions = []
    for session in ("ops", "dev/1"):
        job = {"id": "again", "every": "1h", "prompt": "x"}
        result = await call_tool(app, llm_server, session, "schedule_job", job)
        assert not result.get("is_error"), result
        made = await app.services.store.job_get("again")
        assert made is not None
        sessions.append(made.session_id)
        result = await call_tool(app, llm_server, session, "cancel_job", {"id": "again"})
        assert not result.get("is_error"), result
    assert len(set(sessions)) == 2
    assert all(s.startswith("job:again:") for s in sessions)


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
