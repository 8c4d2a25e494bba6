"""Taking Telegram's updates in: python-telegram-bot's ``Bot`` with a polling loop of our own.

Not ``Application``/``Updater``: their updater asks for the next batch (which confirms the
previous one to Telegram) before the handlers ran, so a crash loses messages. Here an update is
confirmed only after the sink committed it: the next ``getUpdates`` offset moves past it then,
and the offset is persisted so a restart resumes right after the last committed update.
Anything not committed is simply delivered again by Telegram. A press of an approval card's
button (a callback query) goes the same way: handed to the press sink, answered, then confirmed.

Webhook mode (``webhook_url`` set) replaces the poller: Telegram POSTs each update to the
channel's own server (webhook.py), which answers 200 only once the update went the
same way as a polled one (committed, or a press handled), so Telegram delivers again what was
not. The channel registers its address with setWebhook when it starts. Going back to
polling removes the webhook first (deleteWebhook), since Telegram refuses getUpdates while one
is set.

Taking in later (``ingest_later=True``, for a replica while another one takes in): ``start``
only initializes the bot (getMe), so it can send, edit, upload, download and answer presses;
in webhook mode it listens too (every replica behind the proxy commits what it is sent).
Nothing is registered, removed or polled until :meth:`TelegramIngest.start_ingest`: the
poller (one per token) or setWebhook, and the commands, are one replica's at a time.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from telegram import BotCommand, CallbackQuery, Update
from telegram import error as tg

from geodebot.channels.base import (
    CHAT_COMMANDS,
    SENDING_ONLY,
    ChannelError,
    InboundSink,
    PressSink,
)
from geodebot.channels.telegram.cursor import load_offset, save_offset
from geodebot.channels.telegram.inbound import to_inbound
from geodebot.channels.telegram.state import TelegramState, retry_seconds
from geodebot.store.records import StoreError

if TYPE_CHECKING:
    from geodebot.channels.telegram.webhook import WebhookServer

log = logging.getLogger(__name__)

# Channel posts count as messages; edits would re-run a turn for an old message. Callback
# queries are presses of an approval card's buttons.
ALLOWED_UPDATES: tuple[str, ...] = ("message", "channel_post", "callback_query")
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0
_RAW_TIMEOUT_S = 15.0
_STOP_GRACE_S = 5.0

# Hands a button press (the update's callback query) on; the update is confirmed after it.
OnPress = Callable[[int, CallbackQuery], Awaitable[None]]


class TelegramIngest:
    """Starts and stops the adapter, and takes its updates in (by polling or the webhook)."""

    def __init__(
        self, state: TelegramState, *, on_press: OnPress, ingest_later: bool = False
    ) -> None:
        config = state.config
        self._state = state
        self._on_press = on_press
        self._ingest_later = ingest_later
        self._started = False
        self._ingesting = False
        self._ingest_lock = asyncio.Lock()
        self._webhook: WebhookServer | None = None
        if config.webhook_url is not None and state.webhook_secret:
            listen = config.webhook_listen
            assert listen is not None  # the config requires it with webhook_url
            # Imported only in webhook mode: its aiohttp.web server is a megabyte of a
            # long-polling daemon's memory otherwise.
            from geodebot.channels.telegram.webhook import WebhookServer

            self._webhook = WebhookServer(
                listen,
                config.webhook_path,
                state.webhook_secret,
                self._webhook_update,
                stop_grace_s=_STOP_GRACE_S,
            )
        self._sink: InboundSink | None = None
        self._task: asyncio.Task[None] | None = None
        self._first_poll = asyncio.Event()
        self._offset: int | None = None
        self._delivering = False
        self._sink_failures = 0

    @property
    def ingesting(self) -> bool:
        """Polling, or registered as the webhook's address (not only listening)."""
        return self._ingesting

    @property
    def webhook(self) -> WebhookServer | None:
        return self._webhook

    async def start(self, sink: InboundSink, presses: PressSink | None = None) -> None:
        if self._started:
            raise RuntimeError("TelegramChannel already started")
        self._sink, self._state.presses, self._state.stopping = sink, presses, False
        self._started = True
        try:
            await self._connect()
            if self._webhook is not None:
                await self._listen(self._webhook)
            if self._ingest_later:
                self._state.connected, self._state.detail = True, self._sending_only()
                log.info(
                    "telegram: connected as @%s, %s", self._state.bot_username, self._state.detail
                )
                return
            await self._take_in()
        except BaseException as exc:
            await self.stop()
            if isinstance(exc, ChannelError):
                self._state.detail = str(exc)
            raise

    async def start_ingest(self) -> None:
        """Poll (or register the webhook) and register the commands; see the module doc."""
        async with self._ingest_lock:
            if self._ingesting:
                return
            if not self._started or self._state.stopping:
                raise RuntimeError("TelegramChannel not started")
            try:
                await self._take_in()
            except BaseException as exc:
                await self._stop_polling()
                if isinstance(exc, ChannelError):
                    self._state.detail = str(exc)
                raise

    async def _connect(self) -> None:
        try:
            await self._state.bot.initialize()
            self._state.me = self._state.bot.bot
        except tg.InvalidToken:
            # PTB puts the token itself into this message: never pass it on.
            raise ChannelError("telegram: the bot token was rejected", permanent=True) from None
        except tg.TelegramError as exc:
            raise ChannelError(f"telegram: cannot connect: {self._state.safe(exc)}") from None

    async def _take_in(self) -> None:
        if self._webhook is not None:
            await self._register_commands()
            await self._register_webhook()
        else:
            try:
                # A webhook left behind (webhook mode before) makes every getUpdates fail
                # with 409; what it had not delivered yet is kept for the poller.
                await self._state.bot.delete_webhook(drop_pending_updates=False)
            except tg.TelegramError as exc:
                raise ChannelError(f"telegram: cannot connect: {self._state.safe(exc)}") from None
            await self._register_commands()
            self._offset = await load_offset(self._state.cursors)
            self._task = asyncio.create_task(self._poll_loop(), name="telegram-poll")
            await self._wait_first_poll(self._task)
        self._ingesting = True
        if self._webhook is not None:
            self._state.connected, self._state.detail = True, ""

    async def _register_commands(self) -> None:
        try:
            await self._state.bot.set_my_commands(
                [BotCommand(c.name, c.description) for c in CHAT_COMMANDS]
            )
        except tg.TelegramError as exc:
            log.warning("telegram: could not register commands: %s", self._state.safe(exc))

    def _sending_only(self) -> str:
        if self._webhook is None:
            return SENDING_ONLY
        return "receiving webhooks: another replica registers them"

    async def _listen(self, server: WebhookServer) -> None:
        """Listen before registering the address: Telegram may POST at once."""
        try:
            await server.start()
        except OSError as exc:
            raise ChannelError(f"telegram: webhook server: {exc.strerror}") from None
        self._state.connected, self._state.detail = True, ""
        log.info(
            "telegram: receiving webhooks as @%s on port %s", self._state.bot_username, server.port
        )

    async def _register_webhook(self) -> None:
        try:
            await self._state.bot.set_webhook(
                str(self._state.config.webhook_url),
                allowed_updates=ALLOWED_UPDATES,
                drop_pending_updates=False,
                secret_token=self._state.webhook_secret,
            )
        except tg.TelegramError as exc:
            raise ChannelError(f"telegram: setWebhook failed: {self._state.safe(exc)}") from None
        log.info("telegram: webhook registered as %s", self._state.config.webhook_url)

    async def _webhook_update(self, data: dict[str, object]) -> bool:
        """A POSTed update, handed over as a polled one is; True once it may be confirmed."""
        if self._state.stopping or self._state.me is None:
            return False  # not ready, or going: Telegram delivers it again
        try:
            update = Update.de_json(data, self._state.bot)
        except Exception:
            # As when polling: an update that cannot be read would come back forever.
            self._state.counters["skipped"] += 1
            log.exception("telegram: update %s cannot be read; skipped", data.get("update_id"))
            return True
        return await self._hand_over(update)

    async def _wait_first_poll(self, task: asyncio.Task[None]) -> None:
        first = asyncio.ensure_future(self._first_poll.wait())
        try:
            await asyncio.wait({task, first}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            first.cancel()
        if not self._first_poll.is_set():
            raise ChannelError("telegram: polling ended before it connected")

    async def stop(self) -> None:
        self._state.stopping = True
        if self._webhook is not None:
            # The webhook stays registered: Telegram keeps what comes meanwhile for the next
            # start (or another replica's listener). POSTs under way get a grace to commit.
            await self._webhook.stop()
        await self._stop_polling()
        await self._state.bot.shutdown()
        # Bot.shutdown skips clients it did not initialize (a send before start uses them).
        await asyncio.gather(*(request.shutdown() for request in self._state.requests))
        self._state.connected, self._state.detail = False, "stopped"
        self._started = self._ingesting = False

    async def _stop_polling(self) -> None:
        task, self._task = self._task, None
        self._first_poll.clear()
        if task is not None:
            # A long poll can go at once (its updates are not confirmed); a running sink gets
            # a moment to commit, so the update it holds is not delivered twice.
            if not self._delivering:
                task.cancel()
            done, _ = await asyncio.wait({task}, timeout=_STOP_GRACE_S)
            if not done:
                task.cancel()
                await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                log.error("telegram: poller failed: %s", self._state.safe(task.exception()))

    # -- receiving ------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        backoff = _BACKOFF_FIRST_S
        while not self._state.stopping:
            # Short poll until one answered, so start and status learn of it at once.
            answered = self._state.connected and self._first_poll.is_set()
            try:
                updates = await self._state.bot.get_updates(
                    offset=self._offset,
                    timeout=self._state.config.poll_timeout_s if answered else 0,
                    allowed_updates=ALLOWED_UPDATES,
                )
            except tg.RetryAfter as exc:
                delay = self._poll_failed(exc, retry_seconds(exc))
            except tg.InvalidToken as exc:
                delay = self._poll_failed(exc, _BACKOFF_MAX_S)
            except tg.TelegramError as exc:  # network, 5xx, 409 (another poller with our token)
                delay, backoff = self._poll_failed(exc, backoff), min(backoff * 2, _BACKOFF_MAX_S)
            except Exception as exc:
                # PTB could not parse the answer: one malformed update fails the whole batch,
                # and would come back forever. Take the batch apart and skip what cannot be read.
                log.exception("telegram: unreadable getUpdates answer")
                delay, backoff = self._poll_failed(exc, backoff), min(backoff * 2, _BACKOFF_MAX_S)
                if await self._skip_unreadable():
                    delay = 0.0
            else:
                if not answered:
                    log.info("telegram: polling as @%s", self._state.bot_username)
                self._state.connected, self._state.detail, backoff = True, "", _BACKOFF_FIRST_S
                self._first_poll.set()
                delay = await self._deliver(updates)
            if delay > 0 and not self._state.stopping:
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))

    async def _skip_unreadable(self) -> bool:
        """Fetch the pending updates raw, deliver the readable ones in order and step over
        the rest; True if the offset moved."""
        # PTB refuses getUpdates through do_api_request and would parse the batch whole
        # again, so this one request goes out as plain HTTP on the poll's connection.
        params = {"offset": self._offset, "timeout": 0, "allowed_updates": list(ALLOWED_UPDATES)}
        try:
            answer = await self._state.poll_request.post_json(
                f"{self._state.bot.base_url}/getUpdates", params, _RAW_TIMEOUT_S
            )
            raw = answer.get("result") if isinstance(answer, dict) else None
        except tg.TelegramError as exc:
            log.warning("telegram: cannot fetch the raw updates: %s", self._state.safe(exc))
            return False
        if not isinstance(raw, list):
            return False
        before = self._offset
        for item in raw:
            update_id = item.get("update_id") if isinstance(item, dict) else None
            if not isinstance(update_id, int):
                return self._offset != before
            try:
                update = Update.de_json(item, self._state.bot)
            except Exception:
                self._state.counters["skipped"] += 1
                log.exception("telegram: update %s cannot be read; skipped", update_id)
                self._offset = update_id + 1
                await save_offset(self._state.cursors, self._offset)
                continue
            if await self._deliver([update]) > 0:
                break  # the sink failed; the poll loop retries this update
        return self._offset != before

    def _poll_failed(self, exc: Exception, delay: float) -> float:
        self._state.counters["poll_errors"] += 1
        self._state.connected = False
        self._state.detail = f"{type(exc).__name__}: {self._state.safe(exc)}"
        log.warning("telegram: polling failed (%s); retrying in %.1f s", self._state.detail, delay)
        return delay

    async def _deliver(self, updates: Sequence[Update]) -> float:
        """Hand the batch to the sink, confirming each update only once it and every update
        before it were taken; the backoff on a failure.

        Chats are handed over side by side and each chat's updates one after the other, so
        a chat's messages keep their order while the commits of different chats share the
        store's transactions. One at a time, a busy batch waited for a sync per message.
        """
        self._delivering = True  # stop() lets the updates in hand finish
        confirmed = self._offset
        taken: set[int] = set()

        async def hand_over_in_order(chat_updates: list[Update]) -> None:
            for update in chat_updates:
                if self._state.stopping or not await self._hand_over(update):
                    return  # this chat's later updates come again with the failed one
                taken.add(update.update_id)

        by_chat: dict[object, list[Update]] = {}
        for update in updates:
            chat = update.effective_chat
            by_chat.setdefault(update.update_id if chat is None else chat.id, []).append(update)
        try:
            await asyncio.gather(*(hand_over_in_order(u) for u in by_chat.values()))
            for update in updates:
                if update.update_id not in taken:
                    break
                self._offset = update.update_id + 1
        finally:
            self._delivering = False
            # Once per batch: a crash before it costs only redeliveries, which the inbox
            # recognises.
            if self._offset != confirmed and self._offset is not None:
                await save_offset(self._state.cursors, self._offset)
        if len(taken) < len(updates) and not self._state.stopping:
            # The offset stays at the first update not taken: getUpdates returns it again
            # (and any taken after it, which the inbox recognises).
            self._sink_failures += 1
            return min(_BACKOFF_FIRST_S * 2.0 ** (self._sink_failures - 1), _BACKOFF_MAX_S)
        self._sink_failures = 0
        return 0.0

    async def _hand_over(self, update: Update) -> bool:
        assert self._state.me is not None
        assert self._sink is not None
        self._state.counters["received"] += 1
        if update.callback_query is not None:
            # Handled here and then confirmed like a message: a press is answered once and
            # never reaches the inbox.
            await self._on_press(update.update_id, update.callback_query)
            return True
        try:
            inbound = to_inbound(update, self._state.me)
        except Exception:
            # A malformed update would otherwise block every later one forever.
            log.exception("telegram: update %s cannot be read; skipped", update.update_id)
            inbound = None
        if inbound is None:
            self._state.counters["skipped"] += 1
            return True
        try:
            await self._sink(inbound)
        except StoreError as exc:
            self._state.counters["sink_errors"] += 1
            log.error(
                "telegram: update %s not committed (%s); it will come again", update.update_id, exc
            )
            return False
        except Exception:
            self._state.counters["sink_errors"] += 1
            log.exception("telegram: update %s not committed; it will come again", update.update_id)
            return False
        self._state.counters["delivered"] += 1
        return True
