"""No secret leaks: a whole daemon session at debug level with tokens in the environment, a
model that echoes its key in 401 and 429 errors, a platform 401 and 429, an update that makes
the SDK raise, and wrong bearer tokens at the health endpoint. Then every log line, the
timeline and the evidence ledger are searched for each secret value."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path

import aiohttp

from geodebot.config.schema import DB_FILE, LEDGER_FILE
from tests.support.config import TEST_KEY, TEST_KEY_ENV
from tests.support.daemon import DaemonProcess
from tests.support.fakes.llm_server import Error, FakeLLMServer, Reply
from tests.support.fakes.telegram_server import FakeTelegram
from tests.support.ports import free_port

GROUP, ALICE = -1001, 4242
HTTP_TOKEN = "leak-test-bearer-0123456789abcdef"


async def test_no_secret_reaches_logs_timeline_or_ledger(
    tmp_path: Path, llm_server: FakeLLMServer
) -> None:
    port = free_port()
    async with FakeTelegram() as telegram, aiohttp.ClientSession() as http:
        secrets = [TEST_KEY, telegram.token, HTTP_TOKEN]
        config = tmp_path / "config.toml"
        config.write_text(
            f'[daemon]\nstate_dir = "{tmp_path / "var"}"\nlog_level = "debug"\n'
            f'http = "127.0.0.1:{port}"\nhttp_token_env = "LEAK_HTTP_TOKEN"\n'
            f'[model]\nprovider = "anthropic"\nname = "leak-model"\nbase_url = "{llm_server.url}"\n'
            f'api_key_env = "{TEST_KEY_ENV}"\nmax_retries = 0\n'
            '[tools]\nipc_tools = ["get_time"]\n'
            f'[channels.telegram]\ntoken_env = "LEAK_TG_TOKEN"\n'
            f'api_base_url = "{telegram.api_base_url}"\npoll_timeout_s = 1\n'
            f'[[bindings]]\nplatform = "telegram"\nchannel = "{GROUP}"\nsession = "ops"\n'
            f'allowed_users = ["{ALICE}"]\n'
        )
        env = dict(os.environ, LEAK_TG_TOKEN=telegram.token, LEAK_HTTP_TOKEN=HTTP_TOKEN)
        env[TEST_KEY_ENV] = TEST_KEY
        llm_server.script(
            Error(401, "authentication_error", f"Incorrect API key provided: {TEST_KEY}"),
            Error(
                429, "rate_limit_error", f"key {TEST_KEY} is over its limit", {"retry-after": "0"}
            ),
            Reply("third time lucky"),
            Reply("after the platform said no"),
        )
        daemon = DaemonProcess(config, env)
        await daemon.start()
        try:
            for text in ("one", "two"):
                telegram.push_message(GROUP, text, user_id=ALICE)
                await telegram.wait_for_sent(GROUP, len(telegram.sent[GROUP]) + 1, timeout=20)
            # A platform 429 on the reply, then the reply.
            telegram.fail_next("sendMessage", 429, "Too Many Requests: retry after 1", 1)
            telegram.push_message(GROUP, "three", user_id=ALICE)
            await telegram.wait_for_sent(GROUP, 3, timeout=20)
            # A platform 401 on the reply: PTB raises InvalidToken; the outbox tries again.
            telegram.fail_next("sendMessage", 401, "Unauthorized")
            telegram.push_message(GROUP, "four", user_id=ALICE)
            await telegram.wait_for_sent(GROUP, 4, timeout=20)
            # An update PTB cannot read, carrying the token: the SDK raises, we log it.
            last = telegram.push_update(
                {"message": {"message_id": "x", "chat": f"bot{telegram.token}", "text": 5}}
            )
            await telegram.wait_for_confirmed(last + 1, timeout=20)
            for token in (None, "wrong", HTTP_TOKEN):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                async with http.get(f"http://127.0.0.1:{port}/metrics", headers=headers) as r:
                    assert r.status == (200 if token == HTTP_TOKEN else 401)
        finally:
            assert await daemon.stop() == 0

    log = daemon.text()
    assert "Unauthorized" in log  # the platform 401 on a reply was logged, and retried
    assert "Traceback" in log  # the unreadable update was logged with its trace
    assert len(llm_server.requests) == 4
    state = tmp_path / "var"
    ledger = (state / LEDGER_FILE).read_text()
    with closing(sqlite3.connect(state / DB_FILE)) as db:
        timeline = "\n".join(
            f"{kind} {data}" for kind, data in db.execute("SELECT kind, data FROM timeline")
        )
    assert "llm_error" in timeline
    assert "model_call" in ledger
    for secret in secrets:
        assert secret not in log
        assert secret not in timeline
        assert secret not in ledger
