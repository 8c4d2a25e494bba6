"""The HTTP server Telegram's webhook POSTs land on (webhook mode of the Telegram channel).

A POST carries one Update as JSON and the ``X-Telegram-Bot-Api-Secret-Token`` header that
setWebhook registered. It is answered 200 only once the update was handed over (committed by
the sink, or skipped as unreadable, as the poller skips it): Telegram delivers again whatever
got anything else, so the answer is what confirms it, like the poller's next offset. A wrong
secret (401), a body that is no update (400) or too large (413) is refused before anything is
committed. Telegram's retries of an update already committed are duplicates that the inbox
recognises by event id (the update_id, as when polling) and the sink takes without effect.

The server listens on plain HTTP: a reverse proxy in front of it ends TLS.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from geodebot.config.schema import split_host_port

log = logging.getLogger(__name__)

SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
# Telegram's updates are a few kilobytes at most (a message holds 4096 characters, a file is
# only described); anything far larger is no update.
MAX_BODY = 1024 * 1024

# Hands the update (its JSON object) over; True once it is committed (or skipped for good).
Deliver = Callable[[dict[str, Any]], Awaitable[bool]]


class WebhookServer:
    """``POST <path>`` with an Update: 200 once ``deliver`` took it; see the module doc."""

    def __init__(
        self, listen: str, path: str, secret: str, deliver: Deliver, *, stop_grace_s: float
    ) -> None:
        self._host, self._port = split_host_port(listen)
        self._path = path
        self._secret = secret.encode()
        self._deliver = deliver
        self._grace = stop_grace_s
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.counters = dict.fromkeys(
            ("posts", "taken", "refused_secret", "refused_body", "too_large", "not_taken"), 0
        )

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post(self._path, self._post)
        # Not handler_cancellation: a commit under way finishes even if Telegram hung up (its
        # retry is then a duplicate), rather than being cut off half-way.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=self._grace)
        await runner.setup()
        try:
            await web.TCPSite(runner, self._host, self._port).start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                exc.errno, f"cannot listen on {self._host}:{self._port}: {exc.strerror}"
            ) from None
        self._runner = runner
        self.port = int(runner.addresses[0][1]) if runner.addresses else self._port

    async def stop(self) -> None:
        """Stop listening; POSTs under way get the grace to finish their commits."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _post(self, request: web.Request) -> web.Response:
        self.counters["posts"] += 1
        given = request.headers.get(SECRET_HEADER, "")
        # aiohttp keeps undecodable header bytes as surrogates: they must fail the compare
        # like any other wrong secret, not raise.
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._secret):
            self.counters["refused_secret"] += 1
            log.warning("telegram webhook: refused a POST with a wrong or missing secret")
            return web.Response(status=401, text="unauthorized")
        if request.content_length is not None and request.content_length > MAX_BODY:
            self.counters["too_large"] += 1
            return web.Response(status=413, text="too large")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:  # no Content-Length, but over the limit
            self.counters["too_large"] += 1
            return web.Response(status=413, text="too large")
        update = _update_of(body)
        if update is None:
            self.counters["refused_body"] += 1
            log.warning("telegram webhook: refused a POST that is no update")
            return web.Response(status=400, text="not an update")
        if not await self._deliver(update):
            # Telegram delivers it again (the channel logged why it was not committed).
            self.counters["not_taken"] += 1
            return web.Response(status=503, text="not committed; deliver again")
        self.counters["taken"] += 1
        return web.Response(status=200)


def _update_of(body: bytes) -> dict[str, Any] | None:
    """The body as an update's JSON object (one with an integer update_id), else None."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (or not UTF-8); nested beyond reason
        return None
    if not isinstance(data, dict):
        return None
    update_id = data.get("update_id")
    if not isinstance(update_id, int) or isinstance(update_id, bool):
        return None
    return data
