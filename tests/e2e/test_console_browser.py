"""The Work console in a real headless browser (Debian's chromium through Playwright, see
tests/support/browser.py) against a real ``geodebot serve`` on the fake Telegram Bot API and
the fake model server, as tests/support/console_world.py starts it.

Each page renders the daemon's own data and is pictured (into ``docs/console/``, the
README's "Console" pictures, with GEODEBOT_SCREENSHOTS=docs/console; see
tests/support/browser.py); an approval clicked in the page runs its call once; a job paused
from the page does not fire until it is resumed; a run shows up on an open thread page
without a reload; a reply the platform refused for good is listed as a dead letter, and a
Replay clicked in the page sends it once (a second click, from a tab still showing the
button, is refused); every action without the page's CSRF token, from a page of another origin,
or without the bearer token where one is configured is refused and changes
nothing in the store; every tab of one browser follows the live updates on one stream, which
another tab takes over when the tab holding it closes.

One daemon serves the module; a second one, with a bearer token configured, serves the token
test alone. The store is read beside the running daemon (read-only; WAL) to see what an
action did or did not change.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import Locator, Page, expect

from geodebot.store.records import FINAL_OUTCOMES, EffectReceipt
from tests.support.browser import VIEWPORT, Tab
from tests.support.chat_e2e_telegram import (
    BLOCKED,
    BOB,
    WRITE_NOTE,
    Chat,
    RefusingTelegram,
)
from tests.support.config import TEST_KEY
from tests.support.console_world import (
    JOB,
    JOB_PROMPT,
    ConsoleWorld,
    seed_admitted_receipt,
    token_world,
    until,
)
from tests.support.console_world import Browser as HttpClient
from tests.support.control import CONTROL_ANSWER
from tests.support.fakes.llm_server import Call, Delay, FakeLLMServer, Reply

pytestmark = pytest.mark.asyncio(loop_scope="module")

PICTURED, WAITING, CLICKED, LIVE, TICKS, TOCKS = -7101, -7102, -7103, -7104, -7105, -7106
# The chat whose reply the platform refuses for good while the dead letter test says so.
REFUSING = -7107
UNDECLARED = "mcp__fake__undeclared"  # listed on a binding; its MCP server declares no policy
CHATS = (
    Chat(PICTURED, 'project = "ops"\ndaily_tokens = 50000\n', tools=(WRITE_NOTE, UNDECLARED)),
    Chat(WAITING, 'project = "ops"\n'),
    Chat(CLICKED, 'project = "ops"\n'),
    Chat(LIVE, 'project = "support"\n', tools=("get_time",)),
    Chat(TICKS, 'project = "reports"\n', tools=()),
    Chat(TOCKS, 'project = "reports"\n', tools=()),
    # Not streamed: its reply is one message, refused whole.
    Chat(REFUSING, 'project = "support"\n', stream=False, tools=()),
)
# Two jobs on the same short period: "tick" is paused and resumed from the page; "tock" keeps
# firing meanwhile, the witness that the scheduler went on past tick's fire times.
PERIOD_S = 3
TICK, TOCK = "tick", "tock"
TICK_ANSWER = f"{TICK}: all quiet"  # what each fire of tick posts
DIGEST_ANSWER = "digest: nothing new"
RECEIPT = "receipt-browser-1"
TOKEN = "console-browser-token-0123456789"
_POSITIVE = re.compile(r"[1-9][0-9]*")
PAGES = ("work", "thread", "jobs", "receipts", "approvals", "operator", "deadletters")


def session(chat: int) -> str:
    return f"chat{-chat}"


class BrowserWorld(ConsoleWorld):
    """The console world plus the two short-period jobs, each posting in its own chat."""

    def write_config(self) -> Path:
        path = super().write_config()
        jobs = "".join(
            f'[[jobs]]\nid = "{job}"\nevery = "{PERIOD_S}s"\nprompt = "{job} prompt"\n'
            f'deliver_to = "{session(chat)}"\n'
            for job, chat in ((TICK, TICKS), (TOCK, TOCKS))
        )
        path.write_text(path.read_text() + jobs)
        return path

    def job_fires(self, job: str) -> list[tuple[int, int, str, str]]:
        """(id, scheduled_ms, cause, outcome) of every fire of ``job``, oldest first."""
        rows = self.query(
            "SELECT id, scheduled_ms, cause, outcome FROM job_fires WHERE job_id = ? ORDER BY id",
            job,
        )
        return [(int(r[0]), int(r[1]), str(r[2]), str(r[3])) for r in rows]

    def finished_fires(self, job: str) -> list[tuple[int, int, str, str]]:
        return [f for f in self.job_fires(job) if f[3] in FINAL_OUTCOMES]

    def ok_fires(self, job: str) -> int:
        return len([f for f in self.job_fires(job) if f[3] == "ok"])

    def paused(self, job: str) -> bool:
        [(paused,)] = self.query("SELECT paused FROM scheduled_jobs WHERE id = ?", job)
        return bool(paused)

    def posts(self, chat: int, text: str) -> int:
        """How many of the bot's messages in ``chat`` show ``text``."""
        return len([m for m in self.messages(chat) if text in m.shows[0]])

    def given_up(self, chat: int) -> list[tuple[int, str]]:
        """(id, error) of each reply to ``chat`` that the sender gave up on."""
        rows = self.query(
            "SELECT id, error FROM outbox WHERE channel = ? AND status = 'failed'", str(chat)
        )
        return [(int(r[0]), str(r[1])) for r in rows]

    def outbox_status(self, row_id: int) -> str:
        [(status,)] = self.query("SELECT status FROM outbox WHERE id = ?", row_id)
        return str(status)

    def deadletter_decisions(self, row_id: int) -> list[tuple[str, str, str]]:
        """(action, by, via) of every decision on the outbox row."""
        rows = self.query(
            "SELECT action, decided_by, via FROM deadletter_decisions "
            "WHERE kind = 'outbox' AND row_id = ?",
            row_id,
        )
        return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]

    def unchanged(self) -> tuple[object, ...]:
        """What a refused action could have changed, as the store holds it now."""
        return (
            self.query("SELECT id, status, decided_by FROM approval_requests ORDER BY id"),
            self.query("SELECT id, paused, since_ms FROM scheduled_jobs ORDER BY id"),
            self.query("SELECT id, outcome FROM job_fires WHERE job_id = ? ORDER BY id", JOB),
            self.query("SELECT resolution FROM effect_receipts WHERE id = ?", RECEIPT),
            self.switches(),
            self.query("SELECT COUNT(*) FROM relay_deliveries"),
        )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[BrowserWorld]:
    async with RefusingTelegram() as telegram, FakeLLMServer() as llm:
        root = tmp_path_factory.mktemp("console-browser")
        world = BrowserWorld(telegram, llm, root, CHATS, job_chat=TICKS)
        world.model.script(JOB_PROMPT, Reply(DIGEST_ANSWER))
        for job in (TICK, TOCK):
            world.model.script(f"{job} prompt", Reply(f"{job}: all quiet"))
        # An effect cut off by a restart: the daemon finds it admitted and marks it uncertain.
        await seed_admitted_receipt(
            root,
            EffectReceipt(
                id=RECEIPT,
                key="browser-receipt-key",
                session_id=session(PICTURED),
                turn_id="turn-before-the-crash",
                call_id="toolu_cut_off",
                tool=WRITE_NOTE,
                effect="mutate",
                arguments_sha256="cd" * 32,
                status="admitted",
                admitted_at=time.time(),
            ),
        )
        await world.start()
        try:
            # The short-period jobs wait paused for the test that needs them: firing every
            # few seconds all along, they would refresh every open page of every test.
            async with HttpClient.open(world.base) as client:
                await client.get("/jobs")
                for job in (TICK, TOCK):
                    assert (await client.post(f"/jobs/{job}/pause"))[0] == 303
            yield world
        finally:
            assert world.daemon is not None
            code = await world.daemon.stop()
            logged = world.logged()
            assert code == 0, logged[-3000:]
            assert "Traceback" not in logged, logged[-3000:]
            assert TEST_KEY not in logged


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def finished(world: BrowserWorld) -> None:
    """A finished run with a refused call and a call Bob approved in the chat."""
    prompt = "pictured run:"
    world.model.script(
        prompt,
        Reply(tool_calls=[Call(UNDECLARED, {"what": "anything"}, id="toolu_refused")]),
        Reply(tool_calls=[Call(WRITE_NOTE, {"text": "pictured note"}, id="toolu_noted")]),
        Reply("Noted for the pictures."),
    )
    world.ask(PICTURED, f"{prompt} note it, please")
    card = await world.card(PICTURED)
    world.telegram.press_button(PICTURED, card.message_id, "Approve", user_id=BOB)
    # The answer ends with a note of the refused call.
    refused = f"Not allowed here, so not run: {UNDECLARED}"
    answer = await world.showing(PICTURED, refused, part=True)
    assert answer.shows[0].startswith("Noted for the pictures.")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def waiting(world: BrowserWorld) -> str:
    """A call left waiting for a person (the refusal test decides it); its request's id."""
    ask_to_note(world, WAITING, "left waiting", "Not noted.")
    return await world.until_pending(session(WAITING))


def ask_to_note(world: ConsoleWorld, chat: int, note: str, answer: str) -> str:
    """Alice asks ``chat`` for a note: the model calls write_note, which waits for a person."""
    prompt = f"asked in {chat}:"
    call = Call(WRITE_NOTE, {"text": note}, id=f"toolu_{-chat}")
    world.model.script(prompt, Reply(tool_calls=[call]), Reply(answer))
    world.ask(chat, f"{prompt} please note {note!r}")
    return prompt


async def live(page: Page) -> None:
    """Until the page follows the live feed and has fetched what changed since its load."""
    await expect(page.locator("#live-state")).to_have_attribute("data-live-state", "on")
    await expect(page.locator("body")).to_have_attribute("data-refreshed", _POSITIVE)


async def without_live(page: Page) -> None:
    """The page without its script, so without live updates: a tab left as it was loaded
    (with the script it would follow the stream another tab of the browser shares)."""
    await page.route("**/static/console.js", lambda route: route.abort())


async def submit(page: Page, button: Locator) -> int:
    """Clicks a form's button; the status the POST was answered with."""
    async with page.expect_response(lambda r: r.request.method == "POST") as posted:
        await button.click()
    response = await posted.value
    await page.wait_for_load_state("domcontentloaded")
    return response.status


async def visit(world: ConsoleWorld, page: Page, path: str, *, follow: bool = True) -> None:
    """Opens a page of the console; with ``follow``, until it follows the live feed."""
    response = await page.goto(world.base + path)
    assert response is not None
    assert response.status == 200, (path, response.status)
    if follow:
        await live(page)


# -- 1. every page, with real data, pictured -------------------------------------------------
async def test_every_page_renders_the_daemons_data_and_is_pictured(
    world: BrowserWorld, finished: None, waiting: str, tab: Tab
) -> None:
    page = tab.page
    await visit(world, page, "/work")
    projects = page.locator("#projects")
    await expect(projects.locator("[data-project]")).to_have_count(3)
    for chat in CHATS:
        await expect(projects.locator(f'tr[data-session="{session(chat.id)}"]')).to_be_visible()
    row = projects.locator(f'tr[data-session="{session(PICTURED)}"]')
    await expect(row.locator(".outcome")).to_have_text("completed")
    row = projects.locator(f'tr[data-session="{session(WAITING)}"]')
    await expect(row.locator("[data-state]")).to_have_attribute("data-state", "waiting")
    await expect(page.locator(f'[data-budget="binding:telegram:{PICTURED}"]')).to_be_visible()
    await picture(tab, "work")

    await visit(world, page, f"/threads/{session(PICTURED)}")
    run = page.locator("#runs article.run").first
    await expect(run).to_have_attribute("data-outcome", "completed")
    await expect(run.locator(f'[data-tool-call="{UNDECLARED}"]')).to_have_attribute(
        "data-status", "refused"
    )
    await expect(run.locator(".refusals")).to_contain_text(UNDECLARED)
    await expect(run.locator(f'[data-tool-call="{WRITE_NOTE}"]')).to_have_attribute(
        "data-status", "ok"
    )
    await expect(run.locator('[data-approval-event="approval_decided"]')).to_be_visible()
    target = page.locator("#target")
    await expect(target.locator('[data-field="project"]')).to_have_text("ops")
    await expect(target.locator('[data-field="route"]')).to_have_text(
        f"telegram · channel {PICTURED}"
    )
    await expect(target.locator(f'[data-tool="{WRITE_NOTE}"]')).to_be_visible()
    await expect(target.locator(f'[data-refused-tool="{UNDECLARED}"]')).to_be_visible()
    await expect(run.locator("form.send select option")).to_have_text(
        [session(WAITING), session(CLICKED)]
    )
    await picture(tab, "thread")

    # A job with history: run now, from its button.
    await visit(world, page, "/jobs")
    digest = page.locator(f'[data-job-id="{JOB}"]')
    await expect(digest).to_contain_text("cron 0 3 * * *")
    await expect(digest).to_contain_text("Never fired.")
    assert await submit(page, digest.locator('button[data-action="run now"]')) == 303
    await expect(page.locator("#flash")).to_contain_text(f"Run of job {JOB} requested")
    await until(lambda: [f[:2] for f in world.fires()] == [("manual", "ok")])
    await world.showing(TICKS, DIGEST_ANSWER, part=True)
    # The fire's end, settled once its delivery went out, shows on the open page.
    await expect(digest.locator('tr[data-outcome="ok"]')).to_contain_text("manual")
    tick = page.locator(f'[data-job-id="{TICK}"]')
    await expect(tick).to_have_attribute("data-paused", "true")
    await expect(tick.locator('[data-field="next-fire"]')).to_have_text("paused")
    await expect(digest.locator('[data-field="next-fire"]')).not_to_have_text("paused")
    await picture(tab, "jobs")

    await visit(world, page, "/receipts")
    receipt = page.locator(f'[data-receipt-id="{RECEIPT}"]')
    await expect(receipt).to_contain_text("geodebot restarted while the call ran")
    await picture(tab, "receipts")

    await visit(world, page, "/approvals")
    approval = page.locator(f'[data-approval-id="{waiting}"]')
    await expect(approval.locator('[data-field="call"]')).to_contain_text("left waiting")
    await expect(approval).to_have_attribute("data-session", session(WAITING))
    await picture(tab, "approvals")

    # The switch, set from its form.
    await visit(world, page, "/operator")
    await expect(page.locator("#computer-use")).to_have_attribute("data-switch", "off")
    form = page.locator("#computer-use-form")
    await form.locator('input[name="state"][value="on"]').check()
    await form.get_by_label("Reason").fill("a desktop task for the pictures")
    await form.get_by_label("For").fill("1h")
    assert await submit(page, form.locator('button[data-action="switch"]')) == 303
    await expect(page.locator("#flash")).to_contain_text("Computer use switched on, until ")
    await live(page)
    await expect(page.locator("#computer-use")).to_have_attribute("data-switch", "on")
    await expect(page.locator('tr[data-switch-set="on"]')).to_contain_text(
        "a desktop task for the pictures"
    )
    await picture(tab, "operator")


async def picture(tab: Tab, name: str) -> None:
    """The page's screenshot, one of the README's PAGES: the viewport's width, and at least
    half its height (a page that rendered)."""
    assert name in PAGES, name
    width, height = _png_size(await tab.screenshot(name))
    assert width == VIEWPORT["width"]
    assert height >= VIEWPORT["height"] // 2


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# -- 2. an approval clicked in the page ------------------------------------------------------
async def test_an_approval_clicked_in_the_page_runs_the_call_once(
    world: BrowserWorld, tab: Tab
) -> None:
    prompt = ask_to_note(world, CLICKED, "clicked", "Noted from the page.")
    card = await world.card(CLICKED)
    approval = await world.until_pending(session(CLICKED))
    page = tab.page
    # Another tab on the approvals, live; and one whose live feed is down, which still shows
    # the buttons after the decision.
    watching = await tab.context.new_page()
    stale = [await tab.context.new_page() for _ in ("approve", "deny")]
    for opened in (page, watching):
        await visit(world, opened, "/approvals")
    item = f'[data-approval-id="{approval}"]'
    for old in stale:
        await without_live(old)
        await old.goto(world.base + "/approvals")
        await expect(old.locator(item)).to_be_visible()

    assert await submit(page, page.locator(f'{item} button[data-action="approve"]')) == 303
    assert page.url == world.base + "/approvals"
    await expect(page.locator("#flash")).to_have_text(
        f"Approved {WRITE_NOTE} for {session(CLICKED)}."
    )
    await expect(page.locator(item)).to_have_count(0)
    await expect(watching.locator(item)).to_have_count(0)  # without a reload
    assert world.approval(approval) == ("approved", "operator", "console")

    await world.showing(CLICKED, "Noted from the page.")
    outcome = await world.card_outcome(CLICKED, card.message_id)
    assert outcome[3].startswith("Approved by operator, ")
    assert world.notes_written("clicked") == 1
    assert world.model.rounds(prompt) == [0, 1]

    # The second decision, from the tabs that still show the buttons: refused, nothing runs.
    for old, label in zip(stale, ("approve", "deny"), strict=True):
        assert await submit(old, old.locator(f'{item} button[data-action="{label}"]')) == 409
        await expect(old.locator("#error")).to_contain_text(
            "Already decided: approved by operator (via console)"
        )
    assert world.approval(approval) == ("approved", "operator", "console")
    await world.control(CLICKED)
    assert world.notes_written("clicked") == 1

    await visit(world, page, f"/threads/{session(CLICKED)}", follow=False)
    run = page.locator("#runs article.run").filter(has_text="approval decided")
    await expect(run.locator(f'[data-tool-call="{WRITE_NOTE}"]')).to_have_attribute(
        "data-status", "ok"
    )
    await expect(run.locator('[data-approval-event="approval_decided"]')).to_contain_text(
        "by operator via console"
    )


# -- 3. a job paused from the page -----------------------------------------------------------
async def test_a_job_paused_from_the_page_does_not_fire_until_resumed(
    world: BrowserWorld, tab: Tab
) -> None:
    page = tab.page
    await visit(world, page, "/jobs")
    job, witness = (page.locator(f'[data-job-id="{name}"]') for name in (TICK, TOCK))
    # Both wait paused (see the world); tock, on the same period, is the witness that the
    # scheduler goes on firing while tick is paused.
    for locator, name in ((witness, TOCK), (job, TICK)):
        assert await submit(page, locator.locator('button[data-action="resume"]')) == 303
        await expect(page.locator("#flash")).to_have_text(f"Job {name} resumed.")
        await live(page)
    # Paused right after a fire is claimed, so that the pause is in long before the next one.
    seen = len(world.job_fires(TICK))
    await until(lambda: len(world.job_fires(TICK)) > seen, PERIOD_S + 20)
    assert await submit(page, job.locator('button[data-action="pause"]')) == 303
    await expect(page.locator("#flash")).to_have_text(f"Job {TICK} paused.")
    await expect(job).to_have_attribute("data-paused", "true")
    await expect(job.locator('[data-field="next-fire"]')).to_have_text("paused")
    assert world.paused(TICK)
    # The fire claimed before the pause ends as it would have.
    await until(lambda: all(f[3] in FINAL_OUTCOMES for f in world.job_fires(TICK)))
    fires = world.job_fires(TICK)
    assert fires[-1][3] == "ok"
    await world.showing(TICKS, TICK_ANSWER, part=True)
    posts = world.posts(TICKS, TICK_ANSWER)
    assert posts == world.ok_fires(TICK)
    # Tick's next two fire times pass: tock fired (and finished) after both.
    past = fires[-1][1] + 2 * PERIOD_S * 1000

    def witnessed() -> bool:
        return any(f[1] > past and f[3] == "ok" for f in world.job_fires(TOCK))

    await until(witnessed, 3 * PERIOD_S + 20)
    assert world.job_fires(TICK) == fires
    await world.control(TICKS)  # whatever the daemon sent there has arrived by now
    assert world.posts(TICKS, TICK_ANSWER) == posts
    await expect(job).to_have_attribute("data-paused", "true")

    assert await submit(page, job.locator('button[data-action="resume"]')) == 303
    await expect(page.locator("#flash")).to_have_text(f"Job {TICK} resumed.")
    await expect(job).to_have_attribute("data-paused", "false")
    assert not world.paused(TICK)
    await live(page)

    def fired_again() -> list[tuple[int, int, str, str]]:
        return [f for f in world.finished_fires(TICK) if f[0] > fires[-1][0]]

    await until(lambda: bool(fired_again()), PERIOD_S + 20)
    [(fire_id, _, cause, outcome), *_] = fired_again()
    assert (cause, outcome) == ("schedule", "ok")
    await until(lambda: world.posts(TICKS, TICK_ANSWER) > posts)
    # The open page shows the new fire and its outcome, settled by its delivery, without a
    # reload.
    await expect(job.locator(f'tr[data-fire-id="{fire_id}"]')).to_have_attribute(
        "data-outcome", "ok"
    )

    # Both paused again: the rest of the module is quiet.
    for locator, name in ((job, TICK), (witness, TOCK)):
        assert await submit(page, locator.locator('button[data-action="pause"]')) == 303
        await expect(page.locator("#flash")).to_have_text(f"Job {name} paused.")
        await live(page)


# -- 4. a live run on an open page ------------------------------------------------------------
async def test_a_run_appears_on_open_pages_as_it_goes_without_a_reload(
    world: BrowserWorld, tab: Tab
) -> None:
    thread = tab.page
    work = await tab.context.new_page()
    await visit(world, thread, f"/threads/{session(LIVE)}")
    await visit(world, work, "/work")
    runs = thread.locator("#runs article.run")
    await expect(runs).to_have_count(0)
    row = work.locator(f'#projects tr[data-session="{session(LIVE)}"]')
    await expect(row.locator("[data-state]")).to_have_attribute("data-state", "idle")
    for page in (thread, work):
        await page.evaluate("window.marker = 'loaded once'")
    # A run without tool calls saves its events only at its end: until then the thread shows
    # the message it answers as running now, and /work the thread running.
    world.model.script("quiet run:", Delay(3, Reply("The quiet answer.")))
    world.ask(LIVE, "quiet run: no tool needed")
    running = thread.locator("#runs article.run-now")
    await expect(running).to_have_count(1)
    await expect(running).to_contain_text("Running now")
    await expect(row.locator("[data-state]")).to_have_attribute("data-state", "running")
    await expect(runs).to_have_count(0)
    await expect(running).to_have_count(0, timeout=20_000)
    await expect(runs).to_have_count(1)
    await expect(runs.first).to_have_attribute("data-outcome", "completed")
    await expect(row.locator("[data-state]")).to_have_attribute("data-state", "idle")
    await world.showing(LIVE, "The quiet answer.")
    # A run of two rounds whose second model call takes a while: it shows while it is open
    # (its first round is saved with its tool call), then finished.
    world.model.script(
        "live run:",
        Reply(tool_calls=[Call("get_time", {}, id="toolu_live")]),
        Delay(2, Reply("The live answer.")),
    )
    world.ask(LIVE, "live run: what time is it?")
    await expect(runs).to_have_count(2)
    await expect(runs.first).to_have_attribute("data-outcome", "open")
    # Its steps on the timeline are the running turn: shown once.
    await expect(running).to_have_count(0)
    await expect(runs.first.locator('[data-tool-call="get_time"]')).to_have_attribute(
        "data-status", "ok"
    )
    await expect(row.locator("[data-state]")).to_have_attribute("data-state", "running")
    await expect(runs.first).to_have_attribute("data-outcome", "completed", timeout=20_000)
    await expect(row.locator(".outcome")).to_have_text("completed")
    await expect(row.locator("[data-state]")).to_have_attribute("data-state", "idle")
    await world.showing(LIVE, "The live answer.")
    for page, path in ((thread, f"/threads/{session(LIVE)}"), (work, "/work")):
        assert page.url == world.base + path
        assert await page.evaluate("window.marker") == "loaded once"
        navigations = await page.evaluate(
            "performance.getEntriesByType('navigation').map((n) => n.type)"
        )
        assert navigations == ["navigate"]


# The same form as it is, the action made absolute, for a page of another origin.
COPY = """(button) => {
  const copy = button.form.cloneNode(true);
  copy.setAttribute("action", button.form.action);
  const reason = copy.querySelector("input[name=reason]");
  if (reason) reason.setAttribute("value", "forged");
  return copy.outerHTML;
}"""


# -- 5. refused actions -----------------------------------------------------------------------
class Elsewhere:
    """A site of another origin on 127.0.0.1 (another port): it serves the forms it is given,
    posting to the console."""

    def __init__(self) -> None:
        self.forms: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/forged/{index}", self._page)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._runner = runner
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def serve(self, form: str) -> str:
        self.forms.append(form)
        return f"{self.url}/forged/{len(self.forms) - 1}"

    async def _page(self, request: web.Request) -> web.Response:
        form = self.forms[int(request.match_info["index"])]
        body = f"<!doctype html><html><head><title>Elsewhere</title></head><body>{form}</body>"
        return web.Response(text=body + "</html>", content_type="text/html")


@pytest_asyncio.fixture(loop_scope="module")
async def elsewhere() -> AsyncIterator[Elsewhere]:
    site = Elsewhere()
    await site.start()
    try:
        yield site
    finally:
        await site.close()


async def test_actions_without_the_csrf_token_or_from_another_origin_change_nothing(
    world: BrowserWorld, finished: None, waiting: str, tab: Tab, elsewhere: Elsewhere
) -> None:
    approval = f'[data-approval-id="{waiting}"]'
    # Every action of the console, as the button of its page.
    buttons = [
        ("/approvals", f'{approval} button[data-action="approve"]'),
        ("/approvals", f'{approval} button[data-action="deny"]'),
        ("/jobs", f'[data-job-id="{JOB}"] button[data-action="pause"]'),
        ("/jobs", f'[data-job-id="{JOB}"] button[data-action="run now"]'),
        ("/receipts", f'[data-receipt-id="{RECEIPT}"] button[data-action="done"]'),
        ("/receipts", f'[data-receipt-id="{RECEIPT}"] button[data-action="failed"]'),
        ("/operator", 'button[data-action="switch"]'),
        (f"/threads/{session(PICTURED)}", 'form.send button[data-action="send"]'),
    ]
    before = world.unchanged()

    async def refused(path: str, selector: str) -> None:
        page = await tab.context.new_page()
        # Without live updates: a section fetched again would bring back the token removed
        # below.
        await without_live(page)
        await visit(world, page, path, follow=False)
        button = page.locator(selector).first
        # The page's own form, valid token and all, for a page of another origin.
        copied = await button.evaluate(COPY)
        assert 'name="csrf"' in copied
        # Sent here without its token.
        form = button.locator("xpath=ancestor::form")
        if await form.locator('input[name="reason"]').count():
            await form.locator('input[name="reason"]').fill("forged")
        await form.locator('input[name="csrf"]').evaluate("(input) => input.remove()")
        assert await submit(page, button) == 403, (path, selector)
        await expect(page.locator("#error")).to_have_text(
            "The form's security token is missing or out of date: reload the page."
        )
        await page.goto(elsewhere.serve(copied))
        assert await submit(page, page.locator("button[type=submit]")) == 403, (path, selector)
        assert page.url.startswith(world.base)
        await expect(page.locator("#error")).to_have_text(
            "The request did not come from a page of this console."
        )
        await page.close()

    # Each action in a tab of its own, side by side.
    await asyncio.gather(*(refused(path, selector) for path, selector in buttons))
    assert world.unchanged() == before
    assert world.approval(waiting) == ("pending", None, None)
    assert world.notes_written("left waiting") == 0

    # The page's own form is accepted: the turn goes on, the call refused.
    page = tab.page
    await visit(world, page, "/approvals", follow=False)
    assert await submit(page, page.locator(f'{approval} button[data-action="deny"]')) == 303
    assert world.approval(waiting) == ("denied", "operator", "console")
    await world.showing(WAITING, "Not noted.", part=True)
    assert world.notes_written("left waiting") == 0


# -- 6. a dead letter replayed from the page --------------------------------------------------
async def test_a_dead_letter_is_listed_and_replayed_from_the_page_once(
    world: BrowserWorld, tab: Tab
) -> None:
    telegram = world.telegram
    assert isinstance(telegram, RefusingTelegram)
    # The platform refuses the chat's reply for good: the sender gives up on it.
    answer = "Backups finished: 14 volumes, none failed."
    prompt = "refused reply:"
    world.model.script(prompt, Reply(answer))
    telegram.blocked.add(REFUSING)
    world.ask(REFUSING, f"{prompt} how did the backups go?")
    await until(lambda: bool(world.given_up(REFUSING)))
    [(row_id, error)] = world.given_up(REFUSING)
    assert BLOCKED in error
    letter = f"out-{row_id}"

    page = tab.page
    # A second tab on the list whose live feed is down: it still shows the buttons after the
    # decision.
    stale = await tab.context.new_page()
    await without_live(stale)
    await visit(world, page, "/deadletters")
    await visit(world, stale, "/deadletters", follow=False)
    item = f'[data-deadletter-id="{letter}"]'
    listed = page.locator(item)
    await expect(listed).to_have_attribute("data-kind", "outbox")
    await expect(listed).to_have_attribute("data-session", session(REFUSING))
    await expect(listed.locator("h2 small")).to_have_text("reply (outbox)")
    await expect(listed.locator('[data-field="chat"]')).to_have_text(
        f"telegram · channel {REFUSING} · {session(REFUSING)}"
    )
    await expect(listed.locator('[data-field="error"]')).to_contain_text(BLOCKED)
    await expect(listed.locator('[data-field="text"]')).to_have_text(answer)
    await expect(listed.locator('button[data-action="discard"]')).to_be_visible()
    await expect(stale.locator(f'{item} button[data-action="replay"]')).to_be_visible()
    await picture(tab, "deadletters")
    assert world.posts(REFUSING, answer) == 0

    # The platform takes the chat's messages again; the replay from the page sends it once.
    telegram.blocked.discard(REFUSING)
    assert await submit(page, listed.locator('button[data-action="replay"]')) == 303
    assert page.url == world.base + "/deadletters"
    await expect(page.locator("#flash")).to_have_text(f"{letter} replayed: it is sent again.")
    await expect(listed).to_have_count(0)
    decided = page.locator(f'tr[data-decision="{letter}"]')
    await expect(decided).to_have_attribute("data-decided", "replay")
    await expect(decided).to_have_attribute("data-via", "console")
    await expect(decided).to_contain_text("operator via console")
    await world.showing(REFUSING, answer)
    assert world.deadletter_decisions(row_id) == [("replay", "operator", "console")]
    # What became of the row, as the list's decisions show it: the open page hears of the
    # row sent at last.
    await expect(decided.locator('[data-field="status"]')).to_have_text("sent")

    # The second click, from the tab that still shows the button: refused, nothing sent.
    button = stale.locator(f'{item} button[data-action="replay"]')
    assert await submit(stale, button) == 409
    await expect(stale.locator("#error")).to_have_text(
        re.compile(rf"{letter} was already replayed by operator via console at [-\d: ]+ UTC\.")
    )
    messages = await world.control(REFUSING)
    assert [m.shows[0] for m in messages] == [answer, CONTROL_ANSWER]
    assert world.deadletter_decisions(row_id) == [("replay", "operator", "console")]
    assert world.outbox_status(row_id) == "sent"


# -- 7. every tab of a browser on one stream --------------------------------------------------
TABS = 8  # more than the six connections chromium opens to one host


async def live_clients(client: HttpClient) -> int:
    """The daemon's open live streams, as /metrics says."""
    code, text = await client.get("/metrics")
    assert code == 200
    [value] = re.findall(r"^geodebot_console_live_clients ([0-9.]+)$", text, re.M)
    return int(float(value))


async def roles(pages: list[Page]) -> list[str | None]:
    """What each page does for the live updates: lead (follows the stream for all), follow
    (hears it from the lead), own (follows a stream of its own)."""
    return [await page.locator("body").get_attribute("data-live-role") for page in pages]


async def until_clients(client: HttpClient, count: int, timeout: float = 40.0) -> None:
    """Until the daemon has ``count`` live streams (a closed one is noticed within a
    second)."""
    async with asyncio.timeout(timeout):
        while True:
            if await live_clients(client) == count:
                return
            await asyncio.sleep(0.2)


async def test_every_tab_of_a_browser_shares_one_stream_and_another_takes_it_over(
    world: BrowserWorld, tab: Tab
) -> None:
    pages = [tab.page, *[await tab.context.new_page() for _ in range(TABS - 1)]]
    paths = ["/jobs", "/work", "/jobs", "/approvals", "/jobs", "/deadletters", "/jobs", "/jobs"]
    jobs = [page for page, path in zip(pages, paths, strict=True) if path == "/jobs"]
    async with HttpClient.open(world.base) as client:
        await until_clients(client, 0)  # the streams of the pages of earlier tests are gone
        # A stream per tab would leave the seventh no connection to load with.
        for page, path in zip(pages, paths, strict=True):
            await visit(world, page, path)
        assert sorted(map(str, await roles(pages))) == ["follow"] * (TABS - 1) + ["lead"]
        assert await live_clients(client) == 1
        for page in pages:
            await page.evaluate("window.marker = 'loaded once'")
        await expect(jobs[0].locator(f'[data-job-id="{JOB}"]')).to_have_attribute(
            "data-paused", "false"
        )

        # A change made elsewhere (another client of the console) shows in every tab.
        await client.get("/jobs")
        assert (await client.post(f"/jobs/{JOB}/pause"))[0] == 303
        for page in jobs:
            await expect(page.locator(f'[data-job-id="{JOB}"]')).to_have_attribute(
                "data-paused", "true"
            )

        rest = await lead_leaves(pages)
        await until_clients(client, 1)
        assert (await client.post(f"/jobs/{JOB}/resume"))[0] == 303
        jobs = [page for page in jobs if page in rest]
        for page in jobs:
            await expect(page.locator(f'[data-job-id="{JOB}"]')).to_have_attribute(
                "data-paused", "false"
            )

        # Without Web Locks or BroadcastChannel a tab follows a stream of its own, as before.
        alone = await tab.context.new_page()
        await alone.add_init_script("delete window.BroadcastChannel;")
        await visit(world, alone, "/jobs")
        assert await roles([alone]) == ["own"]
        assert await live_clients(client) == 2
        assert (await client.post(f"/jobs/{JOB}/pause"))[0] == 303
        for page in (alone, *jobs):
            await expect(page.locator(f'[data-job-id="{JOB}"]')).to_have_attribute(
                "data-paused", "true"
            )
        assert (await client.post(f"/jobs/{JOB}/resume"))[0] == 303
        await expect(alone.locator(f'[data-job-id="{JOB}"]')).to_have_attribute(
            "data-paused", "false"
        )
        await alone.close()
        for page in rest:
            assert await page.evaluate("window.marker") == "loaded once"
            navigations = await page.evaluate(
                "performance.getEntriesByType('navigation').map((n) => n.type)"
            )
            assert navigations == ["navigate"]
            await page.close()
        await until_clients(client, 0)


async def lead_leaves(pages: list[Page]) -> list[Page]:
    """Closes the tab that follows the stream for the others: the next in line takes it
    over, and every tab fetches what it shows once (what changed meanwhile told nobody).
    The tabs left."""
    lead = pages[(await roles(pages)).index("lead")]
    rest = [page for page in pages if page is not lead]
    fetched = [int(await page.evaluate("document.body.dataset.refreshed")) for page in rest]
    await lead.close()
    async with asyncio.timeout(20):
        while True:
            if "lead" in await roles(rest):
                break
            await asyncio.sleep(0.1)
    assert sorted(map(str, await roles(rest))) == ["follow"] * (len(rest) - 1) + ["lead"]
    for page, before in zip(rest, fetched, strict=True):
        await page.wait_for_function(
            "(before) => Number(document.body.dataset.refreshed) > before", arg=before
        )
        await expect(page.locator("#live-state")).to_have_attribute("data-live-state", "on")
    return rest


# -- with a bearer token ----------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="module")
async def guarded(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ConsoleWorld]:
    async with token_world(tmp_path_factory.mktemp("console-browser-token"), TICKS, TOKEN) as world:
        yield world


async def test_with_a_token_the_page_asks_for_it_once_and_no_action_works_without_it(
    guarded: ConsoleWorld, tab: Tab
) -> None:
    world, page = guarded, tab.page
    response = await page.goto(world.base + "/jobs")
    assert response is not None
    assert response.status == 401
    await expect(page.locator("h1")).to_have_text("Console token")
    await expect(page.locator(f'[data-job-id="{JOB}"]')).to_have_count(0)
    await page.get_by_label("Token").fill("not the token")
    assert await submit(page, page.get_by_role("button", name="Open the console")) == 403
    await expect(page.get_by_role("alert")).to_have_text("That is not the token.")
    await page.get_by_label("Token").fill(TOKEN)
    assert await submit(page, page.get_by_role("button", name="Open the console")) == 303
    assert page.url == world.base + "/jobs"
    await live(page)
    job = page.locator(f'[data-job-id="{JOB}"]')
    await expect(job).to_be_visible()
    # Asked once: every page opens now.
    for path in ("/work", "/approvals", "/receipts", "/operator", "/jobs"):
        await visit(world, page, path, follow=path == "/jobs")
        await expect(page.locator("#login")).to_have_count(0)

    cookies = {c["name"]: c for c in await tab.context.cookies(world.base)}
    for name in ("geodebot_token", "geodebot_console"):
        assert cookies[name]["httpOnly"] is True, name
        assert cookies[name]["sameSite"] == "Strict", name
        assert cookies[name]["path"] == "/", name
    assert cookies["geodebot_token"]["value"] == TOKEN
    assert await page.evaluate("document.cookie") == ""  # no script of the page reads them

    assert await submit(page, job.locator('button[data-action="pause"]')) == 303
    await expect(job).to_have_attribute("data-paused", "true")
    assert world.job_paused()

    # The token gone from the browser, the page's forms (their CSRF token intact) are refused.
    before = (world.job_paused(), world.fires(), world.switches())
    buttons = [
        ("/jobs", f'[data-job-id="{JOB}"] button[data-action="resume"]'),
        ("/jobs", f'[data-job-id="{JOB}"] button[data-action="run now"]'),
        ("/operator", 'button[data-action="switch"]'),
    ]
    opened = []
    for path, selector in buttons:
        other = await tab.context.new_page()
        # Nothing may swap the form while the test fills it (the live feed is not wanted here).
        await without_live(other)
        await visit(world, other, path, follow=False)
        opened.append((other, other.locator(selector)))
    await tab.context.clear_cookies(name="geodebot_token")
    for other, button in opened:
        reason = button.locator("xpath=ancestor::form").locator('input[name="reason"]')
        if await reason.count():
            await reason.fill("no token")
        assert await submit(other, button) == 403
        await expect(other.locator("#error")).to_have_text(
            "The console's token is needed for this."
        )
    assert (world.job_paused(), world.fires(), world.switches()) == before
    # And the next page asks for it again.
    response = await page.goto(world.base + "/jobs")
    assert response is not None
    assert response.status == 401
    await expect(page.locator("#login")).to_be_visible()
