"""The console's parts that need no daemon: the live feed's bounds, the same-origin and CSRF
checks, runs grouped from timeline events, durations, and sessions found by binding.
(tests/e2e/test_console.py drives the whole console through ``geodebot serve``.)"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from geodebot.chat.bindings import BindingIndex
from geodebot.chat.deadletters import DeadLetters
from geodebot.config.schema import BindingConfig, ConfigError, parse_config
from geodebot.engine.tools.registry import ToolRegistry
from geodebot.ops.console import deadletters as console_deadletters
from geodebot.ops.console.actions import Refused, duration_s
from geodebot.ops.console.live import LiveFeed
from geodebot.ops.console.parts import ConsoleParts, binding_of
from geodebot.ops.console.security import Guard, same_origin
from geodebot.ops.console.server import Console
from geodebot.ops.console.work import group_runs, timeline_page
from geodebot.store.records import InboxRow, NewOutbound, OutboxRow, TimelineEvent
from geodebot.store.sqlite import SQLiteStore


# -- the live feed --------------------------------------------------------------------------
@pytest.fixture
async def feed_client() -> AsyncIterator[tuple[LiveFeed, TestClient[web.Request, web.Application]]]:
    feed = LiveFeed(max_clients=2, queue_size=3, keep_alive_s=0.2)
    app = web.Application()
    app.router.add_get("/events", feed.stream)
    async with TestClient(TestServer(app)) as client:
        yield feed, client


async def until_clients(feed: LiveFeed, count: int) -> None:
    async with asyncio.timeout(5):
        while True:
            if feed.clients == count:
                return
            await asyncio.sleep(0.01)


def test_without_an_open_page_the_observer_does_nothing() -> None:
    feed = LiveFeed()
    feed("turn_started", {"session": "s"})
    feed.publish("jobs", job="j")
    assert (feed.clients, feed.dropped) == (0, 0)


async def test_a_page_hears_engine_events_it_shows_and_keep_alives_when_idle(
    feed_client: tuple[LiveFeed, TestClient[web.Request, web.Application]],
) -> None:
    feed, client = feed_client
    async with client.get("/events") as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        assert await response.content.readline() == b"retry: 3000\n"
        await response.content.readline()
        await until_clients(feed, 1)
        feed("llm_call", {"session": "s"})  # not something a page shows
        feed("turn_finished", {"session": "s1", "outcome": "completed"})
        assert await response.content.readline() == b"event: runs\n"
        data = json.loads((await response.content.readline()).removeprefix(b"data: "))
        assert data == {"session": "s1", "kind": "turn_finished"}
        assert await response.content.readline() == b"\n"
        # Nothing happens: a comment now and then keeps the connection open.
        assert await response.content.readline() == b": keep-alive\n"


async def test_a_page_that_went_away_gives_its_place_back_before_any_keep_alive() -> None:
    # No keep-alive for an hour: only a look at the socket can notice the page is gone.
    feed = LiveFeed(max_clients=1, keep_alive_s=3600, gone_check_s=0.05)
    app = web.Application()
    app.router.add_get("/events", feed.stream)
    async with TestClient(TestServer(app)) as client:
        async with client.get("/events") as response:
            assert await response.content.readline() == b"retry: 3000\n"
            await until_clients(feed, 1)
            async with client.get("/events") as refused:
                assert refused.status == 503
            response.connection.transport.close()  # the tab is closed
        await until_clients(feed, 0)
        async with client.get("/events") as again:
            assert await again.content.readline() == b"retry: 3000\n"
            await until_clients(feed, 1)


async def test_a_page_that_falls_behind_is_dropped_and_its_queue_does_not_grow(
    feed_client: tuple[LiveFeed, TestClient[web.Request, web.Application]],
) -> None:
    feed, client = feed_client
    async with client.get("/events") as response:
        await response.content.readline()
        await until_clients(feed, 1)
        # Published in one go, with no chance for the stream to write in between.
        for n in range(10):
            feed.publish("jobs", job=str(n))
        assert (feed.clients, feed.dropped) == (0, 1)
        rest = await response.content.read()
        assert b"event:" not in rest  # the queue was emptied: the stream just ends


async def test_a_page_gone_before_its_stream_began_is_no_error_and_no_client() -> None:
    feed = LiveFeed()
    writer = mock.Mock()
    writer.write_headers = mock.AsyncMock(
        side_effect=ClientConnectionResetError("Cannot write to closing transport")
    )
    # Answered (aiohttp's own ConnectionError handling ends it quietly), never raised.
    await feed.stream(make_mocked_request("GET", "/events", writer=writer))
    writer.write_headers.assert_awaited_once()
    assert (feed.clients, feed.dropped) == (0, 0)


async def test_open_pages_are_bounded_and_closing_ends_every_stream(
    feed_client: tuple[LiveFeed, TestClient[web.Request, web.Application]],
) -> None:
    feed, client = feed_client
    first = await client.get("/events")
    second = await client.get("/events")
    await until_clients(feed, 2)
    async with client.get("/events") as third:
        assert third.status == 503
    feed.close()
    for response in (first, second):
        await response.content.read()
        response.release()
    assert feed.clients == 0
    async with client.get("/events") as late:
        assert late.status == 503


# -- same origin and CSRF -------------------------------------------------------------------
def post(headers: dict[str, str]) -> web.Request:
    return make_mocked_request(
        "POST", "/jobs/x/pause", headers={"Host": "127.0.0.1:8787", **headers}
    )


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        ({"Origin": "http://127.0.0.1:8787"}, True),
        ({"Referer": "http://127.0.0.1:8787/jobs"}, True),
        ({"Origin": "http://127.0.0.1:8788"}, False),
        ({"Origin": "https://127.0.0.1:8787"}, False),
        ({"Origin": "null"}, False),
        # The Origin decides when present, whatever the Referer says.
        ({"Origin": "http://evil.example", "Referer": "http://127.0.0.1:8787/jobs"}, False),
        ({"Referer": "http://evil.example/http://127.0.0.1:8787/"}, False),
        ({"Referer": "http://127.0.0.1:8787.evil.example/"}, False),
        ({}, False),
    ],
)
def test_same_origin(headers: dict[str, str], ok: bool) -> None:
    assert same_origin(post(headers)) is ok


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        # Behind a proxy that ends TLS: the browser's origin is the public one, the request
        # reaches the daemon over plain http.
        ({"Origin": "https://ops.example.com"}, True),
        ({"Referer": "https://ops.example.com/jobs"}, True),
        ({"Origin": "http://127.0.0.1:8787"}, True),  # straight to the daemon, e.g. a tunnel
        ({"Origin": "http://ops.example.com"}, False),
        ({"Origin": "https://ops.example.com.evil.example"}, False),
        ({"Origin": "https://evil.example", "Referer": "https://ops.example.com/"}, False),
    ],
)
def test_same_origin_behind_a_proxy_with_a_console_url(headers: dict[str, str], ok: bool) -> None:
    guard = Guard("t", public_origin="https://ops.example.com")
    assert guard.same_origin(post(headers)) is ok
    assert same_origin(post(headers)) is (headers.get("Origin") == "http://127.0.0.1:8787")


def test_cookies_are_secure_when_browsers_reach_the_console_over_tls() -> None:
    def cookie_secure(guard: Guard) -> bool:
        response = web.Response()
        guard.set_session_cookie(post({}), response, guard.new_session())
        return bool(response.cookies["geodebot_console"]["secure"])

    assert not cookie_secure(Guard(None))
    assert not cookie_secure(Guard(None, public_origin="http://ops.internal:8080"))
    assert cookie_secure(Guard(None, public_origin="https://ops.example.com"))


def test_a_console_url_answers_to_its_own_name_without_a_token() -> None:
    guard = Guard(None, public_origin="https://ops.example.com")
    for host, ok in (("ops.example.com", True), ("127.0.0.1:8787", True), ("evil.example", False)):
        request = make_mocked_request("GET", "/work", headers={"Host": host})
        assert guard.host_ok(request) is ok, host


@pytest.mark.parametrize(
    ("url", "stored"),
    [
        ("https://Ops.Example.com", "https://ops.example.com"),
        ("https://ops.example.com/", "https://ops.example.com"),
        ("http://10.0.0.5:8080", "http://10.0.0.5:8080"),
        ("ops.example.com", None),
        ("ftp://ops.example.com", None),
        ("https://ops.example.com/console", None),
        ("https://user@ops.example.com", None),
    ],
)
def test_console_url_is_an_origin(url: str, stored: str | None) -> None:
    data = {"daemon": {"console_url": url}}
    if stored is None:
        with pytest.raises(ConfigError, match="console_url"):
            parse_config(data)
    else:
        assert parse_config(data).daemon.console_url == stored


def test_a_csrf_token_belongs_to_its_console_session_and_this_run_of_the_daemon() -> None:
    guard = Guard(None)
    sid = guard.new_session()
    token = guard.csrf_token(sid)
    assert guard.csrf_ok(sid, token)
    assert not guard.csrf_ok(guard.new_session(), token)
    assert not guard.csrf_ok(None, token)
    assert not guard.csrf_ok(sid, "")
    assert not guard.csrf_ok(sid, token[:-1] + "\udcff")
    assert not Guard(None).csrf_ok(sid, token)  # a restarted daemon draws a new key


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1:8787", True),
        ("localhost:8787", True),
        ("LOCALHOST:8787", True),
        ("[::1]:8787", True),
        ("127.0.0.2:8787", True),  # the address it is bound to
        ("rebound.example:8787", False),
        ("127.0.0.1.rebound.example:8787", False),
    ],
)
def test_without_a_token_only_its_own_names_are_answered(host: str, ok: bool) -> None:
    request = make_mocked_request("GET", "/work", headers={"Host": host})
    assert Guard(None, bound_host="127.0.0.2").host_ok(request) is ok
    # With a token any name is: the token, not the name, keeps another site out.
    assert Guard("t", bound_host="127.0.0.2").host_ok(request)


def test_the_token_passes_as_a_bearer_header_or_as_the_login_cookie() -> None:
    guard = Guard("s3cret")

    def request(headers: dict[str, str]) -> web.Request:
        return make_mocked_request("GET", "/work", headers=headers)

    assert guard.token_ok(request({"Authorization": "Bearer s3cret"}))
    assert guard.token_ok(request({"Cookie": "geodebot_token=s3cret"}))
    assert not guard.token_ok(request({"Authorization": "Bearer wrong"}))
    assert not guard.token_ok(request({"Authorization": "s3cret"}))
    assert not guard.token_ok(request({"Cookie": "geodebot_token=s3cre"}))
    assert not guard.token_ok(request({}))
    assert Guard(None).token_ok(request({}))


# -- runs, durations, bindings --------------------------------------------------------------
def event(id_: int, turn: str | None, kind: str, **data: object) -> TimelineEvent:
    return TimelineEvent(id_, "s", turn, float(id_), kind, data)


def test_timeline_events_become_runs_newest_first_with_their_steps_in_order() -> None:
    events = [
        event(1, "t1", "turn_started"),
        event(2, "t1", "llm_call"),
        event(3, "t1", "approval_requested", tool="write"),
        event(4, None, "receipt_resolved", reason="checked"),
        event(5, "t1", "approval_decided", tool="write", by="operator", via="console"),
        event(6, "t1", "tool_call", tool="write", status="ok"),
        event(7, "t1", "tool_call", tool="bash", status="refused", reason="not_in_plan"),
        event(8, "t1", "turn_finished", outcome="completed", rounds=2, input_tokens=9),
        event(9, "t2", "turn_started"),
    ]
    runs = group_runs(list(reversed(events)))
    assert [r.turn_id for r in runs] == ["t2", None, "t1"]
    t2, loose, t1 = runs
    assert (t2.outcome, t2.steps) == (None, [])
    assert [e.kind for e in loose.steps] == ["receipt_resolved"]
    assert [e.id for e in t1.steps] == [3, 5, 6, 7]
    assert [c["tool"] for c in t1.refusals] == ["bash"]
    assert (t1.outcome, t1.rounds, t1.tokens, t1.model_calls) == ("completed", 2, (9, 0), 1)


@pytest.mark.parametrize(("text", "seconds"), [("", None), ("30m", 1800.0), ("1.5h", 5400.0)])
def test_durations(text: str, seconds: float | None) -> None:
    assert duration_s(text) == seconds


@pytest.mark.parametrize("text", ["30", "m", "-1h", "0d", "nanh", "infd", "400d", "2w"])
def test_what_is_no_duration(text: str) -> None:
    with pytest.raises(Refused):
        duration_s(text)


def test_a_session_is_found_by_its_binding_or_its_thread_binding() -> None:
    def binding(channel: str, session: str, scope: str = "channel") -> BindingConfig:
        return BindingConfig.model_validate(
            {"platform": "slack", "channel": channel, "session": session, "scope": scope}
        )

    plain, threads, slashed = (
        binding("C1", "ops"),
        binding("C2", "dev", "thread"),
        binding("C3", "team/a", "thread"),
    )
    index = BindingIndex([plain, threads, slashed])
    assert binding_of(index, "ops") is plain
    assert binding_of(index, "dev/1700.1") is threads
    assert binding_of(index, "team/a/99") is slashed
    assert binding_of(index, "ops/1") is None  # a channel binding owns no threads
    assert binding_of(index, "job:nightly") is None


# -- a long timeline, paged -------------------------------------------------------------------
async def test_a_long_timeline_is_read_a_page_at_a_time_newest_first(tmp_path: Path) -> None:
    async with SQLiteStore(tmp_path / "state.db") as store:
        await store.ensure_session("s", "daemon")
        await store.ensure_session("other", "daemon")
        for turn in range(1, 8):
            await store.append_timeline("s", f"t{turn}", "turn_started", {})
            await store.append_timeline("other", "x", "turn_started", {})
            await store.append_timeline("s", f"t{turn}", "tool_call", {"tool": "a", "status": "ok"})
            await store.append_timeline("s", f"t{turn}", "turn_finished", {"outcome": "completed"})
        newest = await store.timeline_newest("s", limit=4)
        assert [e.turn_id for e in newest] == ["t7", "t7", "t7", "t6"]
        assert [e.id for e in newest] == sorted((e.id for e in newest), reverse=True)
        assert await store.timeline_newest("s", before_id=newest[0].id, limit=2) == newest[1:3]

        parts = ConsoleParts(store, parse_config({}), BindingIndex([]), ToolRegistry(), LiveFeed())
        seen: list[str | None] = []
        before = None
        pages = 0
        while True:
            page = await timeline_page(parts, "s", before=before, limit=7)
            pages += 1
            # Only whole runs: a run cut at the page's edge waits for the next page.
            assert all(run.outcome == "completed" and len(run.steps) == 1 for run in page.runs)
            seen += [run.turn_id for run in page.runs]
            if page.older is None:
                break
            before = page.older
        assert seen == [f"t{n}" for n in range(7, 0, -1)]
        assert pages == 4


# -- dead letters -----------------------------------------------------------------------------
async def _dead_outbox(store: SQLiteStore, text: str) -> OutboxRow:
    row = await store.outbox_add(NewOutbound("s", "telegram", "42", None, None, text))
    return await store.outbox_finish(row.id, "failed", error="403: bot was blocked")


async def _dead_inbox(store: SQLiteStore, event: str) -> InboxRow:
    row, _ = await store.inbox_add(
        platform="telegram",
        event_id=event,
        session_id="s",
        channel="42",
        thread="7",
        user="u1",
        text="the question",
        message_id=f"m-{event}",
    )
    finished, _ = await store.inbox_finish(row.id, "done", detail="its reply was lost")
    return finished


@pytest.fixture
async def letters_client(
    tmp_path: Path,
) -> AsyncIterator[tuple[SQLiteStore, list[InboxRow | OutboxRow], TestClient[Any, Any]]]:
    async with SQLiteStore(tmp_path / "state.db") as store:
        replayed: list[InboxRow | OutboxRow] = []
        parts = ConsoleParts(
            store,
            parse_config({}),
            BindingIndex([]),
            ToolRegistry(),
            LiveFeed(),
            deadletters=DeadLetters(store, on_replayed=replayed.append),
        )
        app = web.Application()
        Console(parts).install(app)
        async with TestClient(TestServer(app)) as client:
            yield store, replayed, client


async def _page(client: TestClient[Any, Any], path: str) -> tuple[int, str, str]:
    """(status, page, the page's CSRF token)."""
    async with client.get(path) as response:
        text = await response.text()
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', text)
    return response.status, text, found.group(1) if found else ""


async def _post(client: TestClient[Any, Any], path: str, csrf: str) -> tuple[int, str]:
    origin = str(client.make_url("/")).rstrip("/")
    async with client.post(
        path, data={"csrf": csrf}, headers={"Origin": origin}, allow_redirects=False
    ) as response:
        return response.status, await response.text()


async def test_dead_letters_are_listed_shown_and_decided_once_through_the_daemons_object(
    letters_client: tuple[SQLiteStore, list[InboxRow | OutboxRow], TestClient[Any, Any]],
) -> None:
    store, replayed, client = letters_client
    long_text = "<script>alert(1)</script>\n" + "word " * 60
    out = await _dead_outbox(store, long_text)
    inbox = await _dead_inbox(store, "e1")

    code, page, csrf = await _page(client, "/deadletters")
    assert code == 200
    assert page.index(f'data-deadletter-id="in-{inbox.id}"') < page.index(
        f'data-deadletter-id="out-{out.id}"'
    )  # the most recently dead first
    assert "message (inbox)" in page
    assert "telegram · channel 42 · thread 7" in page
    assert "its reply was lost" in page
    assert "<script>" not in page
    # Cut in the list, whole behind <details>.
    assert "<summary>&lt;script&gt;alert(1)&lt;/script&gt; word word" in page
    assert "…</summary>" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;\nword word" in page
    _, work, _ = await _page(client, "/work")
    assert 'data-field="deadletters" data-count="2"' in work

    code, _ = await _post(client, f"/deadletters/in-{inbox.id}/replay", csrf)
    assert code == 303
    # Handed to the daemon's router at once, not left for its poll.
    assert [(type(row), row.id, row.status) for row in replayed] == [
        (InboxRow, inbox.id, "pending")
    ]
    code, page = await _post(client, f"/deadletters/in-{inbox.id}/discard", csrf)
    assert code == 409
    assert f"in-{inbox.id} was already replayed by operator via console at " in page
    code, _ = await _post(client, f"/deadletters/out-{out.id}/discard", csrf)
    assert code == 303
    assert len(replayed) == 1
    code, page = await _post(client, "/deadletters/out-999/replay", csrf)
    assert code == 404
    code, page = await _post(client, "/deadletters/bogus/replay", csrf)
    assert code == 404
    # A reply that went out is no dead letter: nothing to decide.
    fine = await store.outbox_add(NewOutbound("s", "telegram", "42", None, None, "fine"))
    await store.outbox_finish(fine.id, "sent")
    code, page = await _post(client, f"/deadletters/out-{fine.id}/replay", csrf)
    assert code == 409
    assert "is not a dead letter (its status is &#39;sent&#39;)" in page

    code, page, _ = await _page(client, "/deadletters")
    assert "No dead letters." in page
    assert page.index(f'data-decision="out-{out.id}" data-decided="discard"') < page.index(
        f'data-decision="in-{inbox.id}" data-decided="replay"'
    )  # the newest decision first
    _, work, _ = await _page(client, "/work")
    assert 'data-field="deadletters" data-count="0"' in work
    code, page, _ = await _page(client, f"/deadletters/in-{inbox.id}")
    assert code == 200
    assert "Not a dead letter now: its status is <code>pending</code>." in page
    assert 'its error then: <span class="error-text">its reply was lost</span>' in page
    assert 'data-action="replay"' not in page
    assert (await _page(client, "/deadletters/in-999"))[0] == 404


async def test_dead_letters_are_paged(
    letters_client: tuple[SQLiteStore, list[InboxRow | OutboxRow], TestClient[Any, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, _, client = letters_client
    monkeypatch.setattr(console_deadletters, "PAGE", 2)
    rows = [await _dead_outbox(store, f"text {n}") for n in range(3)]
    _, first, _ = await _page(client, "/deadletters")
    assert re.findall(r'data-deadletter-id="([^"]+)"', first) == [
        f"out-{rows[2].id}",
        f"out-{rows[1].id}",
    ]
    assert 'href="/deadletters?offset=2">Older' in first
    _, second, _ = await _page(client, "/deadletters?offset=2")
    assert re.findall(r'data-deadletter-id="([^"]+)"', second) == [f"out-{rows[0].id}"]
    assert "Older" not in second
    assert 'href="/deadletters">Newest' in second
