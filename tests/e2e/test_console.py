"""The Work console of a real ``geodebot serve`` (python-telegram-bot against the fake Bot
API, the anthropic SDK against the fake model server, ``write_note`` from a real MCP server
needing approval), driven over HTTP like a browser without JavaScript.

Each page renders from the daemon's own data; each action works once and a second attempt
is answered as done already; every POST without the page's CSRF token, with a wrong one,
from another origin, or without the bearer token where one is configured is refused and
changes nothing in the store; an approval given in the console runs the call once; a
reply the platform refused for good is listed as a dead letter, replayed once (it arrives
once) or discarded (it never arrives); project memory is listed and searched per project, and
an item is forgotten once, recorded in the evidence ledger, its text shown as text (the one
test in a real headless chromium, tests/support/browser.py: no script of an item runs).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from playwright.async_api import Dialog, expect

from geodebot.config.schema import DB_FILE
from geodebot.ops.console.parts import when
from geodebot.store.memory import new_ref
from geodebot.store.records import EffectReceipt, MemoryItem
from geodebot.store.sqlite import SQLiteStore
from tests.support.browser import launched_chromium, open_tab
from tests.support.chat_e2e_telegram import (
    ALICE,
    BLOCKED,
    WRITE_NOTE,
    Chat,
    RefusingTelegram,
)
from tests.support.config import TEST_KEY
from tests.support.console_world import (
    JOB,
    JOB_PROMPT,
    Browser,
    ConsoleWorld,
    seed_admitted_receipt,
    token_world,
    until,
)
from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.llm_server import Call, Delay, FakeLLMServer, Reply

pytestmark = pytest.mark.asyncio(loop_scope="module")

APPROVE, REFUSE, JOBS, LIVE, THREADS = -7001, -7002, -7003, -7004, -7005
# Chats whose replies the platform refuses while a test says so: their dead letters.
REPLAYED, DISCARDED = -7006, -7007
# Listed on a binding, but the MCP server's config declares no policy for it.
UNDECLARED = "mcp__fake__undeclared"
CHATS = (
    Chat(APPROVE, 'project = "ops"\ndaily_tokens = 50000\n'),
    Chat(REFUSE, 'project = "ops"\n'),
    Chat(JOBS, tools=()),
    Chat(LIVE),
    Chat(THREADS, 'scope = "thread"\n', tools=(WRITE_NOTE, "computer", UNDECLARED)),
    Chat(REPLAYED, stream=False, tools=()),
    Chat(DISCARDED, stream=False, tools=()),
)
# A person no binding allows, who asks to pair by direct message.
STRANGER = 8123
RECEIPT = "receipt-console-1"
TOKEN = "console-bearer-token-0123456789"


def session(chat: int) -> str:
    return f"chat{-chat}"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ConsoleWorld]:
    async with RefusingTelegram() as telegram, FakeLLMServer() as llm:
        root = tmp_path_factory.mktemp("console")
        world = ConsoleWorld(telegram, llm, root, CHATS, job_chat=JOBS)
        receipt = EffectReceipt(
            id=RECEIPT,
            key="console-receipt-key",
            session_id=session(APPROVE),
            turn_id="turn-before-the-crash",
            call_id="toolu_crashed",
            tool=WRITE_NOTE,
            effect="mutate",
            arguments_sha256="ab" * 32,
            status="admitted",
            admitted_at=time.time(),
        )
        await seed_admitted_receipt(root, receipt)
        await world.start()
        try:
            yield world
        finally:
            assert world.daemon is not None
            code = await world.daemon.stop()
            logged = world.logged()
            assert code == 0, logged[-3000:]
            assert "Traceback" not in logged, logged[-3000:]
            assert TEST_KEY not in logged


@pytest_asyncio.fixture(loop_scope="module")
async def browser(world: ConsoleWorld) -> AsyncIterator[Browser]:
    async with Browser.open(world.base) as browser:
        yield browser


def ask_to_note(world: ConsoleWorld, chat: int, note: str, answer: str) -> str:
    prompt = f"asked in {chat}:"
    call = Call(WRITE_NOTE, {"text": note}, id=f"toolu_{-chat}")
    world.model.script(prompt, Reply(tool_calls=[call]), Reply(answer))
    world.ask(chat, f"{prompt} please note {note!r}")
    return prompt


# -- pages ------------------------------------------------------------------------------------
async def test_the_root_leads_to_work_and_health_and_metrics_answer_as_before(
    world: ConsoleWorld, browser: Browser
) -> None:
    code, _ = await browser.get("/", redirects=False)
    assert code == 302
    async with browser.session.get(world.base + "/", allow_redirects=False) as response:
        assert response.headers["Location"] == "/work"
    code, text = await browser.get("/healthz")
    assert code == 200
    assert json.loads(text)["status"] == "ok"
    code, text = await browser.get("/metrics")
    assert code == 200
    assert "geodebot_turns_running" in text
    # No page follows the live updates yet (all tabs of a browser would share one stream).
    assert "\ngeodebot_console_live_clients 0.0\n" in text


async def test_work_shows_projects_their_threads_and_their_state(
    world: ConsoleWorld, browser: Browser
) -> None:
    code, page = await browser.get("/work")
    assert code == 200
    assert 'data-project="ops"' in page
    for chat in CHATS:
        assert f'data-session="{session(chat.id)}"' in page
        assert f'href="/threads/{session(chat.id)}"' in page
    assert f'data-binding="telegram:{APPROVE}"' in page
    # No chat ran yet: idle, and no run.
    assert 'data-state="idle"' in page
    assert (
        f'<tr data-budget="binding:telegram:{APPROVE}"><td>binding:telegram:{APPROVE} (tokens)'
        in page
    )
    assert 'href="/static/console.css"' in page
    assert 'src="/static/console.js"' in page
    for asset, kind in (("console.css", "text/css"), ("console.js", "text/javascript")):
        async with browser.session.get(f"{world.base}/static/{asset}") as response:
            assert response.status == 200
            assert response.content_type == kind
    assert (await browser.get("/static/../parts.py"))[0] == 404


async def test_a_threads_target_shows_route_model_prompt_and_the_tool_plan(
    world: ConsoleWorld, browser: Browser
) -> None:
    code, page = await browser.get(f"/threads/{session(THREADS)}")
    assert code == 200
    assert f"telegram · channel {THREADS}" in page
    assert "anthropic/chat-e2e-model" in page
    assert f"<code>{world.root / 'ws'}</code>" in page
    assert "You are geodebot" in page  # the default prompt source, shown
    assert f'data-tool="{WRITE_NOTE}"' in page
    assert "asks the approvers: 5151, 6262" in page
    assert "MCP server fake" in page
    assert 'data-refused-tool="computer"' in page
    assert "the operator&#39;s computer-use switch is off" in page
    assert f'data-refused-tool="{UNDECLARED}"' in page
    assert "MCP server fake declares no policy for undeclared" in page
    code, page = await browser.get("/threads/no-such-session")
    assert code == 404
    assert "There is no session" in page


async def test_a_thread_bindings_threads_show_as_threads_of_its_project(
    world: ConsoleWorld, browser: Browser
) -> None:
    world.model.script("in a topic:", Reply("topic answer"))
    world.telegram.push_message(THREADS, "in a topic: hi", user_id=ALICE, thread_id=77)
    topic = f"{session(THREADS)}/77"
    await world.showing(THREADS, "topic answer")
    code, page = await browser.get("/work")
    assert f'<tr data-session="{topic}" data-binding="telegram:{THREADS}">' in page
    assert "(thread 77)" in page
    assert "Sessions without a binding" in page
    assert f'data-session="{topic}"' not in page.split("Sessions without a binding")[1]
    code, page = await browser.get(f"/threads/{topic}")
    assert code == 200
    assert f"telegram · channel {THREADS} · thread 77" in page
    assert 'data-outcome="completed"' in page


async def test_jobs_receipts_approvals_and_operator_render(
    world: ConsoleWorld, browser: Browser
) -> None:
    code, page = await browser.get("/jobs")
    assert code == 200
    assert f'data-job-id="{JOB}"' in page
    assert "cron 0 3 * * *" in page
    assert "Never fired." in page
    code, page = await browser.get("/receipts")
    assert code == 200
    assert f'data-receipt-id="{RECEIPT}"' in page
    assert "geodebot restarted while the call ran" in page
    code, page = await browser.get("/approvals")
    assert code == 200
    code, page = await browser.get("/operator")
    assert code == 200
    assert 'data-switch="off"' in page
    assert "Never set" in page


# -- actions ----------------------------------------------------------------------------------
async def test_an_approval_given_in_the_console_runs_the_call_once(
    world: ConsoleWorld, browser: Browser
) -> None:
    prompt = ask_to_note(world, APPROVE, "console approved", "Noted from the console.")
    card = await world.card(APPROVE)
    approval = await world.until_pending(session(APPROVE))
    code, page = await browser.get("/approvals")
    assert f'data-approval-id="{approval}"' in page
    assert "console approved" in page
    code, _, response = await browser.post(f"/approvals/{approval}/approve", {"back": "/approvals"})
    assert code == 303
    assert response.headers["Location"] == "/approvals"
    code, page = await browser.get("/approvals")
    assert f"Approved {WRITE_NOTE} for {session(APPROVE)}." in page
    assert f'data-approval-id="{approval}"' not in page
    assert world.approval(approval) == ("approved", "operator", "console")

    await world.showing(APPROVE, "Noted from the console.")
    outcome = await world.card_outcome(APPROVE, card.message_id)
    assert outcome[3].startswith("Approved by operator, ")
    assert world.notes_written("console approved") == 1
    assert world.model.rounds(prompt) == [0, 1]

    # The second press: answered, changes nothing.
    code, page, _ = await browser.post(f"/approvals/{approval}/approve")
    assert code == 409
    assert "Already decided: approved by operator (via console)" in page
    code, page, _ = await browser.post(f"/approvals/{approval}/deny")
    assert code == 409
    assert world.approval(approval) == ("approved", "operator", "console")
    await world.control(APPROVE)
    assert world.notes_written("console approved") == 1

    code, page = await browser.get(f"/threads/{session(APPROVE)}")
    assert f'data-tool-call="{WRITE_NOTE}" data-status="ok"' in page
    assert 'data-approval-event="approval_decided"' in page
    assert "by operator via console" in page
    code, page = await browser.get("/work")
    assert "completed" in page


async def test_every_post_without_a_valid_token_or_origin_is_refused_and_changes_nothing(
    world: ConsoleWorld, browser: Browser
) -> None:
    ask_to_note(world, REFUSE, "never approved", "Not noted.")
    approval = await world.until_pending(session(REFUSE))
    await browser.get("/approvals")
    assert browser.csrf
    approve = f"/approvals/{approval}/approve"
    other = "http://evil.example"
    attempts: list[tuple[str, dict[str, str], str | None, dict[str, str] | None]] = [
        ("no csrf token", {}, None, None),
        ("a wrong csrf token", {}, "0" * 64, None),
        ("another origin", {}, "page", {"Origin": other}),
        ("a null origin", {}, "page", {"Origin": "null"}),
        ("another referer", {}, "page", {"Referer": other + "/approvals"}),
        ("neither origin nor referer", {}, "page", {}),
    ]
    actions = [
        (approve, {}),
        (f"/jobs/{JOB}/pause", {}),
        (f"/jobs/{JOB}/run", {}),
        (f"/receipts/{RECEIPT}/resolve", {"as": "done"}),
        ("/operator/computer-use", {"state": "on", "reason": "forged", "duration": "1h"}),
        (
            "/relay/send",
            {"source": session(APPROVE), "turn": "t", "target": session(REFUSE), "intent": "ask"},
        ),
    ]
    fires, switches = world.fires(), world.switches()
    relayed = world.query("SELECT COUNT(*) FROM relay_deliveries")
    for path, data in actions:
        for what, _, csrf, headers in attempts:
            code, page, _ = await browser.post(path, data, csrf=csrf, headers=headers)
            assert code == 403, (path, what, page)
            assert "Not done" in page
    # A token of another console session is no token here either.
    async with Browser.open(world.base) as stranger:
        await stranger.get("/approvals")
        assert stranger.csrf != browser.csrf
        code, _, _ = await browser.post(approve, csrf=stranger.csrf)
        assert code == 403
    # A site whose name was made to resolve to 127.0.0.1 is its own origin: its name is
    # refused, for its POSTs and for the pages it would read the token from.
    port = world.base.rsplit(":", 1)[1]
    rebound = {"Host": f"rebound.example:{port}", "Origin": f"http://rebound.example:{port}"}
    code, _, _ = await browser.post(approve, headers=rebound)
    assert code == 421
    assert (await browser.get("/approvals", headers=rebound))[0] == 421
    # A GET never acts.
    async with browser.session.get(world.base + approve) as response:
        assert response.status == 405
    assert world.approval(approval) == ("pending", None, None)
    assert not world.job_paused()
    assert world.fires() == fires
    assert world.receipt_resolution(RECEIPT) is None
    assert world.switches() == switches
    assert world.query("SELECT COUNT(*) FROM relay_deliveries") == relayed
    assert world.notes_written("never approved") == 0

    # The real form is accepted: the turn goes on, the call refused.
    code, _, _ = await browser.post(f"/approvals/{approval}/deny")
    assert code == 303
    assert world.approval(approval) == ("denied", "operator", "console")
    await world.showing(REFUSE, "Not noted.", part=True)
    assert world.notes_written("never approved") == 0


async def test_a_runs_result_is_sent_to_another_thread_of_its_project_once(
    world: ConsoleWorld, browser: Browser
) -> None:
    code, page = await browser.get(f"/threads/{session(APPROVE)}")
    # The oldest run on the page is the one that noted "console approved".
    turn = re.findall(r'data-send-turn="([^"]+)"', page)[-1]
    assert f'<option value="{session(REFUSE)}">' in page
    assert f'<option value="{session(LIVE)}">' not in page  # another project
    # As the page's form sends it.
    form = {
        "source": session(APPROVE),
        "turn": turn,
        "target": session(REFUSE),
        "back": f"/threads/{session(APPROVE)}",
    }
    code, page, _ = await browser.post("/relay/send", {**form, "intent": "maybe"})
    assert code == 400
    code, _, response = await browser.post("/relay/send", {**form, "intent": "notify"})
    assert code == 303
    assert response.headers["Location"] == f"/threads/{session(APPROVE)}"
    code, page = await browser.get(f"/threads/{session(APPROVE)}")
    [receipt] = re.findall(rf"Sent to {session(REFUSE)} \(notify\): receipt ([\w-]+)\.", page)
    post = await world.showing(REFUSE, "by @operator", part=True)
    assert "Noted from the console." in post.shows[0]

    code, page, _ = await browser.post("/relay/send", {**form, "intent": "notify"})
    assert code == 409
    assert f"Already sent to {session(REFUSE)}: receipt {receipt} (delivered)" in page
    # Into another project's thread: refused, with a receipt, and nothing sent.
    elsewhere = {**form, "target": session(LIVE), "intent": "notify"}
    code, page, _ = await browser.post("/relay/send", elsewhere)
    assert code == 409
    assert "Not sent: refused: there is no thread" in page
    messages = await world.control(REFUSE)
    assert len([m for m in messages if "by @operator" in m.shows[0]]) == 1
    assert not [m for m in world.messages(LIVE) if "by @operator" in m.shows[0]]
    code, page = await browser.get(f"/threads/{session(REFUSE)}")
    assert 'data-event="relay_received"' in page


async def test_a_job_is_paused_resumed_and_run_once(world: ConsoleWorld, browser: Browser) -> None:
    # A slow answer holds the run open while the button is pressed again.
    world.model.script(JOB_PROMPT, Delay(5, Reply("digest: all quiet")))
    await browser.get("/jobs")
    code, _, _ = await browser.post(f"/jobs/{JOB}/pause")
    assert code == 303
    assert world.job_paused()
    code, page = await browser.get("/jobs")
    assert f"Job {JOB} paused." in page
    assert 'data-paused="true"' in page
    code, page, _ = await browser.post(f"/jobs/{JOB}/pause")
    assert (code, f"Job {JOB} is paused already.") == (409, _error(page))
    code, _, _ = await browser.post(f"/jobs/{JOB}/resume")
    assert code == 303
    assert not world.job_paused()

    async with browser.session.get(world.base + "/events") as stream:
        assert await stream.content.readline() == b"retry: 3000\n"
        code, _, _ = await browser.post(f"/jobs/{JOB}/run")
        assert code == 303
        code, page, _ = await browser.post(f"/jobs/{JOB}/run")
        assert code == 409
        assert f"Job {JOB} has a run" in page
        # An open /jobs page hears of the fire as it starts, ends and is settled by its
        # delivery, each time after the store has it.
        seen: list[str] = []

        def heard(topic: str, data: dict[str, Any]) -> bool:
            if topic == "jobs" and data == {"job": JOB}:
                seen.append(world.fires()[-1][1])
            return bool(seen) and seen[-1] == "ok"

        await _read_events(stream, heard, timeout=60)
    # The button's own (requested), the run's start (it runs for 5 s), its end (delivering)
    # and the settling (ok, heard only once the store has it).
    assert len(seen) >= 4, seen
    assert "running" in seen
    assert seen[-1] == "ok"
    assert [(cause, outcome) for cause, outcome, _ in world.fires()] == [("manual", "ok")]
    await world.showing(JOBS, "digest: all quiet", part=True)
    code, page = await browser.get("/jobs")
    assert 'data-outcome="ok"' in page
    assert "manual" in page
    [job_session] = re.findall(r'href="/threads/(job[^"]+)"', page)
    code, page = await browser.get(f"/threads/{job_session}")
    assert code == 200
    assert "No binding owns this session" in page
    assert 'data-outcome="completed"' in page
    code, page = await browser.get("/work")
    loose = page.split("Sessions without a binding")[1]
    assert 'data-session="job:' in loose


async def test_an_uncertain_receipt_is_resolved_once(world: ConsoleWorld, browser: Browser) -> None:
    await browser.get("/receipts")
    code, page, _ = await browser.post(f"/receipts/{RECEIPT}/resolve", {"as": "maybe"})
    assert code == 400
    assert world.receipt_resolution(RECEIPT) is None
    code, _, _ = await browser.post(f"/receipts/{RECEIPT}/resolve", {"as": "failed"})
    assert code == 303
    assert world.receipt_resolution(RECEIPT) == "failed"
    code, page = await browser.get("/receipts")
    assert f'data-receipt-id="{RECEIPT}"' not in page
    assert f"Receipt {RECEIPT} ({WRITE_NOTE}) resolved as failed." in page
    code, page, _ = await browser.post(f"/receipts/{RECEIPT}/resolve", {"as": "done"})
    assert code == 409
    assert "Already resolved: failed by operator" in page
    assert world.receipt_resolution(RECEIPT) == "failed"


# -- dead letters -----------------------------------------------------------------------------
async def given_up(world: ConsoleWorld, chat: int, answer: str) -> tuple[str, int]:
    """Alice asks in ``chat`` and the platform refuses the answer for good: its dead
    letter's id and outbox row id, once the sender gave up on it."""
    telegram = world.telegram
    assert isinstance(telegram, RefusingTelegram)
    telegram.blocked.add(chat)
    prompt = f"dead letter in {chat}:"
    world.model.script(prompt, Reply(answer))
    world.ask(chat, f"{prompt} hello")
    await until(lambda: bool(failed_rows(world, chat)))
    [(row_id, error)] = failed_rows(world, chat)
    assert BLOCKED in error
    telegram.blocked.discard(chat)
    return f"out-{row_id}", row_id


def failed_rows(world: ConsoleWorld, chat: int) -> list[tuple[Any, ...]]:
    return world.query(
        "SELECT id, error FROM outbox WHERE channel = ? AND status = 'failed'", str(chat)
    )


def decisions(world: ConsoleWorld, row_id: int) -> list[tuple[Any, ...]]:
    """(action, by, via) of every decision on the outbox row: one at most."""
    return world.query(
        "SELECT action, decided_by, via FROM deadletter_decisions "
        "WHERE kind = 'outbox' AND row_id = ?",
        row_id,
    )


def outbox_status(world: ConsoleWorld, row_id: int) -> str:
    [(status,)] = world.query("SELECT status FROM outbox WHERE id = ?", row_id)
    return str(status)


async def forged_decisions_are_refused(browser: Browser, letter: str) -> None:
    """Replay and discard without the page's CSRF token or from another site: refused."""
    await browser.get("/deadletters")
    for action in ("replay", "discard"):
        path = f"/deadletters/{letter}/{action}"
        for csrf, headers in ((None, None), ("page", {"Origin": "http://evil.example"})):
            code, page, _ = await browser.post(path, csrf=csrf, headers=headers)
            assert code == 403, (path, csrf, headers, page)
            assert "Not done" in page


async def test_a_reply_given_up_on_is_listed_and_replayed_from_the_console_once(
    world: ConsoleWorld, browser: Browser
) -> None:
    async with browser.session.get(world.base + "/events") as stream:
        assert await stream.content.readline() == b"retry: 3000\n"
        letter, row_id = await given_up(world, REPLAYED, "the late <answer>")
        # Open pages hear of the new dead letter from the sender that gave up on it.
        events = await _read_events(stream, lambda topic, data: topic == "deadletters")
        assert events[-1][1] == {"session": session(REPLAYED)}
    code, page = await browser.get("/deadletters")
    assert code == 200
    assert 'href="/deadletters" data-nav="dead letters" aria-current="page"' in page
    [article] = re.findall(
        rf'<article class="deadletter" data-deadletter-id="{letter}".*?</article>', page, re.S
    )
    assert 'data-kind="outbox"' in article
    assert "reply (outbox)" in article
    assert f"telegram · channel {REPLAYED}" in article
    assert f'<a href="/threads/{session(REPLAYED)}">{session(REPLAYED)}</a>' in article
    assert BLOCKED in article
    assert "the late &lt;answer&gt;" in article  # escaped, never markup
    assert 'data-action="replay"' in article
    assert 'data-action="discard"' in article
    listed = page.count('<article class="deadletter"')
    code, page = await browser.get("/work")
    assert f'data-field="deadletters" data-count="{listed}"' in page
    assert f'<a href="/deadletters">{listed} dead letter' in page
    assert 'data-field="unanswered" data-count="0"' in page
    code, page = await browser.get(f"/deadletters/{letter}")
    assert code == 200
    assert f'data-deadletter-id="{letter}"' in page
    assert 'data-dead="true"' in page
    assert '<dd data-field="decision">not yet</dd>' in page
    assert '<pre class="text" data-field="text">the late &lt;answer&gt;</pre>' in page
    assert (await browser.get("/deadletters/out-999999"))[0] == 404

    await forged_decisions_are_refused(browser, letter)
    assert decisions(world, row_id) == []
    assert outbox_status(world, row_id) == "failed"

    async with browser.session.get(world.base + "/events") as stream:
        assert await stream.content.readline() == b"retry: 3000\n"
        code, _, response = await browser.post(f"/deadletters/{letter}/replay")
        assert code == 303
        assert response.headers["Location"] == "/deadletters"
        events = await _read_events(stream, lambda topic, data: topic == "deadletters")
        assert events[-1][1] == {"session": session(REPLAYED)}
        # And of the replayed row sent at last: what the decisions show of it changed.
        events = await _read_events(
            stream,
            lambda topic, data: topic == "deadletters" and outbox_status(world, row_id) == "sent",
        )
        assert events[-1][1] == {"session": session(REPLAYED)}
    sent = await world.telegram.wait_for_sent(REPLAYED, 1, timeout=30)
    assert [m.shows[0] for m in sent] == ["the late <answer>"]
    code, page = await browser.get("/deadletters")
    assert f"{letter} replayed: it is sent again." in page
    assert f'data-deadletter-id="{letter}"' not in page

    # The second press, either button: answered with the first decision, nothing sent.
    for action in ("replay", "discard"):
        code, page, _ = await browser.post(f"/deadletters/{letter}/{action}")
        assert code == 409
        assert re.fullmatch(
            rf"{letter} was already replayed by operator via console at [-\d: ]+ UTC\.",
            _error(page),
        )
    messages = await world.control(REPLAYED)
    assert [m.shows[0] for m in messages] == ["the late <answer>", CONTROL_ANSWER]
    assert decisions(world, row_id) == [("replay", "operator", "console")]
    assert outbox_status(world, row_id) == "sent"
    code, page = await browser.get("/deadletters")
    assert f'<tr data-decision="{letter}" data-decided="replay" data-via="console">' in page
    code, page = await browser.get(f"/deadletters/{letter}")
    assert 'data-dead="false"' in page
    assert "replayed by operator via console at " in page
    assert 'data-action="replay"' not in page


async def test_a_discarded_dead_letter_leaves_the_list_and_is_never_sent(
    world: ConsoleWorld, browser: Browser
) -> None:
    letter, row_id = await given_up(world, DISCARDED, "never to be seen")
    await forged_decisions_are_refused(browser, letter)
    assert decisions(world, row_id) == []
    code, _, _ = await browser.post(f"/deadletters/{letter}/discard")
    assert code == 303
    code, page = await browser.get("/deadletters")
    assert f"{letter} discarded: it stays as it is and is no longer listed." in page
    assert f'data-deadletter-id="{letter}"' not in page
    assert f'<tr data-decision="{letter}" data-decided="discard" data-via="console">' in page
    for action in ("discard", "replay"):
        code, page, _ = await browser.post(f"/deadletters/{letter}/{action}")
        assert code == 409
        assert f"{letter} was already discarded by operator via console at " in page
    code, page, _ = await browser.post("/deadletters/out-999999/replay")
    assert code == 404
    assert "no dead letter out-999999" in page
    messages = await world.control(DISCARDED)
    assert [m.shows[0] for m in messages] == [CONTROL_ANSWER]
    assert decisions(world, row_id) == [("discard", "operator", "console")]
    assert outbox_status(world, row_id) == "failed"


async def test_a_strangers_request_is_approved_from_the_pairing_page_once(
    world: ConsoleWorld, browser: Browser
) -> None:
    world.telegram.push_message(STRANGER, "may I?", user_id=STRANGER, chat_type="private")
    [asked] = await world.telegram.wait_for_sent(STRANGER, 1, timeout=20)
    found = re.search(r"\b([0-9A-Z]{5}-[0-9A-Z]{5})\b", asked.text)
    assert found is not None
    code = found.group(1)
    status, page = await browser.get("/pairing")
    assert status == 200
    assert f'data-code="{code}"' in page
    assert "may I?" in page
    # Forged posts are refused as every action's are.
    forged, _, _ = await browser.post(f"/pairing/telegram/{code}/approve", csrf="0" * 64)
    assert forged == 403
    assert world.query("SELECT status FROM pairings") == [("pending",)]

    status, _, _ = await browser.post(f"/pairing/telegram/{code}/approve")
    assert status == 303
    _, page = await browser.get("/pairing")
    assert f"Approved telegram user {STRANGER}" in page
    assert f'data-key="telegram:{STRANGER}"' in page
    welcome = await world.telegram.wait_for_sent(STRANGER, 2, timeout=20)
    assert "paired" in welcome[1].text
    status, page, _ = await browser.post(f"/pairing/telegram/{code}/approve")
    assert status == 409
    assert "approved already" in _error(page)
    assert world.query("SELECT decided_by FROM pairings") == [("operator",)]

    status, page, _ = await browser.post(f"/bindings/telegram:{APPROVE}/remove")
    assert status == 409
    assert "edit the file" in _error(page)
    status, _, _ = await browser.post(f"/bindings/telegram:{STRANGER}/remove")
    assert status == 303
    assert world.query("SELECT COUNT(*) FROM stored_bindings") == [(0,)]
    status, page, _ = await browser.post(f"/bindings/telegram:{STRANGER}/remove")
    assert status == 404


# -- memory -----------------------------------------------------------------------------------
async def remember(world: ConsoleWorld, project: str, *texts: str, **fields: Any) -> list[str]:
    """Items saved for ``project`` straight into the daemon's store, as memory_save saves
    them, oldest first; their ids."""
    store = SQLiteStore(world.root / "var" / DB_FILE)
    await store.open()
    refs: list[str] = []
    try:
        for n, text in enumerate(texts):
            item = MemoryItem(
                ref=new_ref(),
                project=project,
                text=text,
                created_at=time.time() - 3600 + n,
                **fields,
            )
            await store.memory_save(item, max_items=100)
            refs.append(item.ref)
    finally:
        await store.close()
    return refs


def memory_refs(world: ConsoleWorld, project: str) -> set[str]:
    return {
        row[0] for row in world.query("SELECT ref FROM memory_items WHERE project = ?", project)
    }


def forgotten(world: ConsoleWorld, ref: str) -> list[dict[str, Any]]:
    """The ledger's memory_forgotten rows of ``ref``."""
    lines = (world.root / "var" / "ledger.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [r for r in rows if r["kind"] == "memory_forgotten" and r.get("id") == ref]


def items_on(page: str) -> list[str]:
    """The ids of the memory items a page shows, in its order."""
    return re.findall(r'<article class="memory" data-ref="([^"]+)"', page)


async def test_the_memory_page_lists_projects_their_items_and_finds_them(
    world: ConsoleWorld, browser: Browser
) -> None:
    older, primary, backups = await remember(
        world,
        "mem-ops",
        "The deploy window is Tuesday 14:00 UTC.",
        "The postgres primary is db1; the replica is db2.",
        "Backups copy the postgres dump nightly to the bucket in the other region.",
        tags=("db", "runbook"),
        session_id=session(APPROVE),
        turn_id="turn-7",
        user=str(ALICE),
        origin="chat",
    )
    [elsewhere] = await remember(world, "mem-support", "The postgres of support is pg-s1.")
    code, page = await browser.get("/memory")
    assert code == 200
    assert 'href="/memory" data-nav="memory" aria-current="page"' in page
    # In the nav beside Pairing.
    nav = re.findall(r'data-nav="([^"]+)"', page)
    assert nav[nav.index("pairing") + 1] == "memory"
    assert '<tr data-project="mem-ops"><td><a href="/memory?project=mem-ops">mem-ops</a>' in page
    assert re.search(r'data-project="mem-ops">.*?<td data-field="items">3</td>', page)
    assert re.search(r'data-project="mem-support">.*?<td data-field="items">1</td>', page)
    assert items_on(page) == []  # no project chosen: no items

    code, page = await browser.get("/memory?project=mem-ops")
    assert code == 200
    assert items_on(page) == [backups, primary, older]  # newest first
    [article] = re.findall(
        rf'<article class="memory" data-ref="{primary}".*?</article>', page, re.S
    )
    [(saved,)] = world.query("SELECT created_at FROM memory_items WHERE ref = ?", primary)
    assert f"<code>{primary}</code> <small>{when(saved)}</small>" in article  # UTC
    assert '<dd data-field="origin">chat</dd>' in article
    assert f'<dd data-field="user">{ALICE}</dd>' in article
    assert f'<a href="/threads/{session(APPROVE)}">{session(APPROVE)}</a>' in article
    assert "turn turn-7" in article
    assert '<dd data-field="tags">db, runbook</dd>' in article
    assert '<pre class="text" data-field="text">The postgres primary is db1;' in article
    assert f'action="/memory/mem-ops/{primary}/forget"' in article
    assert 'name="back" value="/memory?project=mem-ops"' in article
    assert elsewhere not in page  # another project's

    # The store's search, best first: both words before one; another project's never.
    code, page = await browser.get("/memory?project=mem-ops&q=postgres+primary")
    assert code == 200
    assert items_on(page) == [primary, backups]
    assert 'name="q" value="postgres primary"' in page
    code, page = await browser.get("/memory?project=mem-support&q=deploy+window")
    assert items_on(page) == []
    assert "Nothing in this project's memory matches." in page
    code, page = await browser.get("/memory?project=no-such-project")
    assert code == 200
    assert "This project holds no memory items." in page


async def test_an_item_is_forgotten_once_from_its_projects_page_and_recorded(
    world: ConsoleWorld, browser: Browser
) -> None:
    doomed, kept = await remember(world, "mem-forget", "Forget me.", "Keep me.")
    [other] = await remember(world, "mem-other", "Not this project's to forget.")
    code, page = await browser.get("/memory?project=mem-forget")
    [(action, back)] = re.findall(
        rf'<form method="post" action="(/memory/mem-forget/{doomed}/forget)" class="inline">\s*'
        r'<input type="hidden" name="csrf" value="[0-9a-f]+">\s*'
        r'<input type="hidden" name="back" value="([^"]+)">',
        page,
    )
    # Forged posts are refused as every action's are, and remove nothing.
    for csrf, headers in (
        (None, None),
        ("0" * 64, None),
        ("page", {"Origin": "http://evil.example"}),
    ):
        code, page, _ = await browser.post(action, {"back": back}, csrf=csrf, headers=headers)
        assert code == 403, (csrf, headers, page)
        assert "Not done" in page
    # Another project's id, named under this project or this one's under another: no item.
    code, page, _ = await browser.post(f"/memory/mem-forget/{other}/forget", {"back": back})
    assert code == 404
    assert (
        _error(page)
        == f"There is no memory item &#39;{other}&#39; in project &#39;mem-forget&#39;."
    )
    code, page, _ = await browser.post(f"/memory/mem-other/{doomed}/forget", {"back": back})
    assert code == 404
    assert memory_refs(world, "mem-forget") == {doomed, kept}
    assert memory_refs(world, "mem-other") == {other}

    async with browser.session.get(world.base + "/events") as stream:
        assert await stream.content.readline() == b"retry: 3000\n"
        code, _, response = await browser.post(action, {"back": back})
        assert code == 303
        assert response.headers["Location"] == "/memory?project=mem-forget"
        events = await _read_events(stream, lambda topic, data: topic == "memory")
        assert events[-1] == ("memory", {"project": "mem-forget"})
    code, page = await browser.get("/memory?project=mem-forget")
    assert f"Forgot {doomed} of project &#39;mem-forget&#39; (saved " in page
    assert items_on(page) == [kept]
    assert memory_refs(world, "mem-forget") == {kept}

    # The same form again: the CLI's answer, and nothing else goes.
    code, page, _ = await browser.post(action, {"back": back})
    assert code == 404
    assert f"There is no memory item &#39;{doomed}&#39; in project" in _error(page)
    assert memory_refs(world, "mem-forget") == {kept}
    assert memory_refs(world, "mem-other") == {other}
    [row] = forgotten(world, doomed)
    assert (row["project"], row["by"], row["via"]) == ("mem-forget", "operator", "console")
    assert forgotten(world, other) == []


async def test_an_items_markup_shows_as_its_text_in_a_real_browser_and_forget_works_once(
    world: ConsoleWorld,
) -> None:
    """Item text comes from chats: in chromium it is text, no script of it runs; Forget
    clicked removes it once, and the same button in a tab still showing it answers no item.
    The project's name holds a "/" (a binding's session), as the action's path does."""
    project = "desk/ops"
    text = "<script>alert(1)</script> and <b>bold</b>"
    marked, kept = await remember(world, project, text, "A plain note.")
    where = "/memory?project=desk/ops"
    async with launched_chromium() as chromium:
        tab = await open_tab(chromium)
        try:
            dialogs: list[str] = []

            async def dialog(d: Dialog) -> None:
                dialogs.append(d.message)
                await d.dismiss()

            tab.context.on("dialog", dialog)
            page = tab.page
            # Two tabs without the live updates, so both keep showing the button.
            stale = [await tab.context.new_page() for _ in range(2)]
            for other in stale:
                await other.route("**/static/console.js", lambda route: route.abort())
            for opened in (page, *stale):
                response = await opened.goto(world.base + where)
                assert response is not None
                assert response.status == 200
            # Escaped, never markup.
            html = await response.text()
            assert "&lt;script&gt;alert(1)&lt;/script&gt; and &lt;b&gt;bold&lt;/b&gt;" in html
            assert "<script>alert" not in html
            await expect(page.locator("#live-state")).to_have_attribute("data-live-state", "on")
            item = page.locator(f'article[data-ref="{marked}"]')
            await expect(item.locator('[data-field="text"]')).to_have_text(text)
            await expect(item.locator("script, b")).to_have_count(0)
            assert await page.evaluate("[...document.scripts].map((s) => s.src)") == [
                world.base + "/static/console.js"
            ]

            button = f'article[data-ref="{marked}"] button[data-action="forget"]'
            async with stale[0].expect_response(lambda r: r.request.method == "POST") as posted:
                await stale[0].locator(button).click()
            assert (await posted.value).status == 303
            await stale[0].wait_for_load_state("domcontentloaded")
            assert stale[0].url == world.base + where
            await expect(stale[0].locator("#flash")).to_contain_text(f"Forgot {marked} of project")
            await expect(stale[0].locator(f'article[data-ref="{marked}"]')).to_have_count(0)
            # The open page with live updates drops it without a reload.
            await expect(item).to_have_count(0)
            await expect(page.locator(f'article[data-ref="{kept}"]')).to_have_count(1)

            async with stale[1].expect_response(lambda r: r.request.method == "POST") as posted:
                await stale[1].locator(button).click()
            assert (await posted.value).status == 404
            await expect(stale[1].locator("#error")).to_contain_text(
                f"There is no memory item '{marked}' in project '{project}'."
            )
            assert dialogs == []
        finally:
            await tab.context.close()
        tab.check()
    assert memory_refs(world, project) == {kept}
    assert len(forgotten(world, marked)) == 1


async def test_computer_use_is_switched_with_a_reason_and_a_duration(
    world: ConsoleWorld, browser: Browser
) -> None:
    await browser.get("/operator")
    before = world.switches()
    code, page, _ = await browser.post("/operator/computer-use", {"state": "on", "reason": ""})
    assert code == 400
    code, page, _ = await browser.post(
        "/operator/computer-use", {"state": "on", "reason": "demo", "duration": "soon"}
    )
    assert code == 400
    assert "is not a duration" in page
    assert world.switches() == before
    code, _, _ = await browser.post(
        "/operator/computer-use", {"state": "on", "reason": "demo <b>now</b>", "duration": "2h"}
    )
    assert code == 303
    code, page = await browser.get("/operator")
    assert 'data-switch="on"' in page
    assert "Computer use switched on, until " in page
    assert "demo &lt;b&gt;now&lt;/b&gt;" in page  # escaped, never markup
    code, text = await browser.get("/healthz")
    assert json.loads(text)["components"]["computer_use"]["enabled"] is True
    code, _, _ = await browser.post("/operator/computer-use", {"state": "off", "reason": "done"})
    assert code == 303
    code, page = await browser.get("/operator")
    assert 'data-switch="off"' in page
    assert page.count('data-switch-set="on"') == 1
    assert world.switches() == before + 2


async def test_open_pages_hear_of_runs_as_they_happen(
    world: ConsoleWorld, browser: Browser
) -> None:
    async with browser.session.get(world.base + "/events") as stream:
        assert stream.status == 200
        assert stream.content_type == "text/event-stream"
        assert await stream.content.readline() == b"retry: 3000\n"
        world.model.script("live run:", Reply("live answer"))
        world.ask(LIVE, "live run: hello")
        events = await _read_events(stream, lambda topic, data: data.get("kind") == "turn_finished")
        kinds = [(topic, data.get("kind")) for topic, data in events]
        assert ("runs", "turn_started") in kinds
        assert ("runs", "turn_finished") in kinds
        assert all(data.get("session") == session(LIVE) for _, data in events)

        # A call that waits for a person: the pages that list approvals hear of it.
        ask_to_note(world, LIVE, "live note", "Live note done.")
        await _read_events(stream, lambda topic, data: topic == "approvals")
        approval = await world.until_pending(session(LIVE))
        await browser.get("/approvals")
        code, _, _ = await browser.post(f"/approvals/{approval}/approve")
        assert code == 303
        events = await _read_events(stream, lambda topic, data: data.get("kind") == "turn_finished")
        assert ("approvals", session(LIVE)) in [(t, d.get("session")) for t, d in events]
    await world.showing(LIVE, "Live note done.")
    assert world.notes_written("live note") == 1


async def test_a_run_without_tool_calls_shows_while_it_runs_and_is_gone_once_committed(
    world: ConsoleWorld, browser: Browser
) -> None:
    """Such a turn commits its timeline only at its end: its thread shows the message it
    answers as running now, from the turn's start, and /work shows the thread running."""
    thread = f"/threads/{session(LIVE)}"
    async with browser.session.get(world.base + "/events") as stream:
        assert await stream.content.readline() == b"retry: 3000\n"
        world.model.script("slow run:", Delay(4, Reply("slow answer")))
        world.ask(LIVE, "slow run: take your time")
        # What an open page fetches when it hears the turn start shows it running.
        await _read_events(stream, lambda topic, data: data.get("kind") == "turn_started")
        code, page = await browser.get(thread)
        assert code == 200
        [(inbox_id, entry)] = re.findall(
            r'<article class="run-now" data-running="(\d+)">(.*?)</article>', page, re.S
        )
        [(received,)] = world.query("SELECT received_at FROM inbox WHERE id = ?", int(inbox_id))
        assert "Running now" in entry
        assert time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(received)) in entry
        runs = page.split('id="runs"')[1]
        assert '<article class="run"' not in runs.split('class="run-now"')[0]  # first
        code, work = await browser.get("/work")
        [row] = re.findall(rf'<tr data-session="{session(LIVE)}".*?</tr>', work, re.S)
        assert 'data-state="running"' in row
        await _read_events(stream, lambda topic, data: data.get("kind") == "turn_finished")
        # Fetched on its end: the run, committed, and nothing running.
        code, page = await browser.get(thread)
    assert 'class="run-now"' not in page
    newest = page.split('<article class="run"')[1]
    assert 'data-outcome="completed"' in newest.split(">")[0]
    code, work = await browser.get("/work")
    [row] = re.findall(rf'<tr data-session="{session(LIVE)}".*?</tr>', work, re.S)
    assert 'data-state="idle"' in row
    await world.showing(LIVE, "slow answer")


async def _read_events(
    stream: aiohttp.ClientResponse,
    until: Callable[[str, dict[str, Any]], bool],
    timeout: float = 30.0,
) -> list[tuple[str, dict[str, Any]]]:
    """The events read until one for which ``until(topic, data)`` holds, that one last."""
    events: list[tuple[str, dict[str, Any]]] = []
    topic = ""
    async with asyncio.timeout(timeout):
        while True:
            line = (await stream.content.readline()).decode().rstrip("\n")
            if line.startswith("event: "):
                topic = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                events.append((topic, data))
                if until(topic, data):
                    return events


def _error(page: str) -> str:
    start = page.index('id="error"')
    return page[page.index(">", start) + 1 : page.index("</p>", start)]


# -- with a bearer token ----------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="module")
async def guarded(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ConsoleWorld]:
    async with token_world(tmp_path_factory.mktemp("console-token"), JOBS, TOKEN) as world:
        yield world


async def test_with_a_token_the_console_asks_for_it_once_and_refuses_without_it(
    guarded: ConsoleWorld,
) -> None:
    world = guarded
    async with Browser.open(world.base) as browser:
        code, page = await browser.get("/jobs")
        assert code == 401
        assert 'action="/login"' in page
        assert JOB not in page
        # Health and metrics keep their bearer header, and only it.
        assert (await browser.get("/healthz"))[0] == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert (await browser.get("/healthz", headers=bearer))[0] == 200
        assert (await browser.get("/metrics", headers=bearer))[0] == 200
        # The bearer header opens the pages too.
        code, page = await browser.get("/jobs", headers=bearer)
        assert code == 200
        assert f'data-job-id="{JOB}"' in page
        # A form of the page, posted without the token: refused, nothing changes.
        code, page, _ = await browser.post(f"/jobs/{JOB}/pause")
        assert code == 403
        assert "The console&#39;s token is needed for this." in page
        assert not world.job_paused()
        # The login form: from another origin, or with a wrong token, it sets nothing.
        login = {"token": TOKEN, "next": "/jobs"}
        code, _, _ = await browser.post(
            "/login", login, csrf=None, headers={"Origin": "http://evil.example"}
        )
        assert code == 403
        code, _, _ = await browser.post("/login", {"token": "wrong", "next": "/jobs"}, csrf=None)
        assert code == 403
        assert (await browser.get("/jobs"))[0] == 401
        code, _, response = await browser.post("/login", login, csrf=None)
        assert code == 303
        assert response.headers["Location"] == "/jobs"
        cookie = response.cookies["geodebot_token"]
        assert cookie["httponly"]
        assert cookie["samesite"] == "Strict"
        assert cookie["path"] == "/"
        code, page = await browser.get("/jobs")
        assert code == 200
        code, _, _ = await browser.post(f"/jobs/{JOB}/pause")
        assert code == 303
        assert world.job_paused()
        # The cookie is no bearer header: health stays closed to it.
        assert (await browser.get("/healthz"))[0] == 401
        # The console session's cookie is HttpOnly and SameSite=Strict as well.
        [console] = [c for c in browser.session.cookie_jar if c.key == "geodebot_console"]
        assert (console["httponly"], console["samesite"], console["path"]) == (
            True,
            "Strict",
            "/",
        )
