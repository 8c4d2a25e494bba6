"""``geodebot serve`` with its Work console, on the fake Telegram Bot API and model server, for
tests/e2e/test_console.py: the chat world of tests/support/chat_e2e_telegram.py (chats with
approvers, the fake MCP server's ``write_note`` that needs approval) plus ``[daemon] http``
on a free port, a scheduled job, and a browser-like client that keeps the console's cookies
and reads each page's CSRF token.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from geodebot.config.schema import DB_FILE
from geodebot.store.records import EffectReceipt
from geodebot.store.sqlite import SQLiteStore
from tests.support.chat_e2e_telegram import CardKillingTelegram, Chat, ChatWorld
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import FakeLLMServer
from tests.support.ports import free_port

JOB = "digest"
JOB_PROMPT = "job digest prompt"
TOKEN_ENV = "CONSOLE_E2E_TOKEN"
_CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')


@dataclass
class ConsoleWorld(ChatWorld):
    """``job_chat``: the chat the job posts in; ``token``: the console's bearer token, if
    one is configured."""

    job_chat: int = 0
    token: str | None = None
    base: str = ""
    port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = super().env()
        if self.token is not None:
            env[TOKEN_ENV] = self.token
        return env

    def write_config(self) -> Path:
        path = super().write_config()
        # The config takes no port 0: a free one is asked for, as tests/e2e/test_health.py does.
        self.port = self.port or free_port()
        http = f'http = "127.0.0.1:{self.port}"\n'
        if self.token is not None:
            http += f'http_token_env = "{TOKEN_ENV}"\n'
        text = path.read_text().replace("[daemon]\n", "[daemon]\n" + http, 1)
        text += (
            f'[[jobs]]\nid = "{JOB}"\ncron = "0 3 * * *"\nprompt = "{JOB_PROMPT}"\n'
            f'deliver_to = "chat{-self.job_chat}"\n'
            "[pairing]\nenabled = true\n"
        )
        path.write_text(text)
        return path

    async def start(self) -> DaemonProcess:
        daemon = await super().start()
        self.base = f"http://127.0.0.1:{self.port}"
        return daemon

    # -- reading the store beside the running daemon (read-only; WAL) ---------------------
    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        uri = f"file:{self.root / 'var' / DB_FILE}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
            return list(db.execute(sql, params).fetchall())

    def approval(self, approval_id: str) -> tuple[str, str | None, str | None]:
        """(status, decided_by, decided_via) of a request."""
        [row] = self.query(
            "SELECT status, decided_by, decided_via FROM approval_requests WHERE id = ?",
            approval_id,
        )
        return row[0], row[1], row[2]

    def pending_approvals(self, session: str) -> list[str]:
        rows = self.query(
            "SELECT id FROM approval_requests WHERE session_id = ? AND status = 'pending'",
            session,
        )
        return [row[0] for row in rows]

    async def until_pending(self, session: str, timeout: float = 30.0) -> str:
        """Until ``session`` has a pending approval request; its id."""
        await until(lambda: bool(self.pending_approvals(session)), timeout)
        return self.pending_approvals(session)[0]

    def job_paused(self) -> bool:
        [(paused,)] = self.query("SELECT paused FROM scheduled_jobs WHERE id = ?", JOB)
        return bool(paused)

    def fires(self) -> list[tuple[str, str, str]]:
        """(cause, outcome, reason) of every fire of the job, oldest first."""
        rows = self.query(
            "SELECT cause, outcome, reason FROM job_fires WHERE job_id = ? ORDER BY id", JOB
        )
        return [(r[0], r[1], r[2]) for r in rows]

    def switches(self) -> int:
        return len(self.query("SELECT 1 FROM operator_switch_history"))

    def receipt_resolution(self, receipt_id: str) -> str | None:
        [(resolution,)] = self.query(
            "SELECT resolution FROM effect_receipts WHERE id = ?", receipt_id
        )
        return str(resolution) if resolution is not None else None


@contextlib.asynccontextmanager
async def token_world(root: Path, chat: int, token: str) -> AsyncIterator[ConsoleWorld]:
    """A console daemon with a bearer token configured and one chat, which also runs its
    jobs; stopped cleanly afterwards, with the token never in its log."""
    async with CardKillingTelegram() as telegram, FakeLLMServer() as llm:
        world = ConsoleWorld(
            telegram, llm, root, (Chat(chat, tools=()),), job_chat=chat, token=token
        )
        await world.start()
        try:
            yield world
        finally:
            assert world.daemon is not None
            assert await world.daemon.stop() == 0
            assert token not in world.logged()


async def until(done: Callable[[], bool], timeout: float = 30.0) -> None:
    """Until ``done()``: the store tells nobody, so it is looked at until it holds it."""
    async with asyncio.timeout(timeout):
        while True:
            if done():
                return
            await asyncio.sleep(0.05)


async def seed_admitted_receipt(root: Path, receipt: EffectReceipt) -> None:
    """A receipt left ``admitted`` as by a daemon killed while its call ran: the next
    daemon's start finds it and marks it uncertain."""
    (root / "var").mkdir(parents=True, exist_ok=True)
    store = SQLiteStore(root / "var" / DB_FILE)
    await store.open()
    try:
        await store.ensure_session(receipt.session_id, "daemon")
        await store.admit_receipt(receipt)
    finally:
        await store.close()


class Browser:
    """A client that keeps cookies like a browser (also for 127.0.0.1) and posts forms the
    way the console's pages do: with the page's CSRF token and this origin."""

    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base = base
        self.session = session
        self.csrf = ""

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, base: str) -> Any:
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as session:
            yield cls(base, session)

    async def get(
        self, path: str, *, headers: Mapping[str, str] | None = None, redirects: bool = True
    ) -> tuple[int, str]:
        async with self.session.get(
            self.base + path, headers=headers or {}, allow_redirects=redirects
        ) as response:
            text = await response.text()
            found = _CSRF.search(text)
            if found is not None:
                self.csrf = found.group(1)
            return response.status, text

    async def post(
        self,
        path: str,
        data: Mapping[str, str] | None = None,
        *,
        csrf: str | None = "page",
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, str, aiohttp.ClientResponse]:
        """POST a form; ``csrf="page"`` sends the last page's token, None sends none.
        Without ``headers`` the request carries this console's Origin, as a browser does."""
        form = dict(data or {})
        if csrf is not None:
            form["csrf"] = self.csrf if csrf == "page" else csrf
        sent = {"Origin": self.base} if headers is None else dict(headers)
        async with self.session.post(
            self.base + path, data=form, headers=sent, allow_redirects=False
        ) as response:
            return response.status, await response.text(), response
