"""Discord's messages in: the login, the gateway, the catch-up of every bound channel after a
(re)connect, and slash commands, each handed to the sink before its cursor moves or its
interaction is acknowledged.

* Catch-up. Discord never redelivers. After each (re)connect, every bound channel's history
  after the cursor ``discord:last:<channel>`` (the newest ``CATCH_UP_LIMIT``) goes through the
  sink again, oldest first (the daemon drops duplicates by ``event_id``). Until that pass
  succeeds live messages do not move the cursor, so it never skips a gap; deliveries per
  channel are serialised so it only moves forward. The first run (no cursor) saves the
  channel's newest message id as the cursor before the gateway connects, i.e. before the bot
  shows as online: a crash at any point after loses nothing sent to the online bot. Catch-up
  reads attachments from history the same way as live messages.
* Taking in later (``ingest_later=True``, for a replica while another one owns the gateway):
  ``start`` only logs in over REST (sends, edits, history reads, uploads work); marking first
  runs, the gateway and the slash commands wait for ``start_ingest``, whose READY catches up
  from history as after a restart. discord.py cannot drop a gateway and keep its REST
  session, so a ``start_ingest`` that fails replaces the client with a fresh logged-in one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import discord
from discord.http import Route

from geodebot.channels.base import (
    CHAT_COMMANDS,
    SENDING_ONLY,
    ChannelError,
    InboundSink,
    PressSink,
)
from geodebot.channels.discord.cards import CALLBACK
from geodebot.channels.discord.client import GatewayClient
from geodebot.channels.discord.inbound import interaction_to_inbound, to_inbound
from geodebot.channels.discord.send import INTERACTION_TTL_S, NET_ERRORS
from geodebot.channels.discord.state import DiscordState
from geodebot.store.records import StoreError

# One logger for the whole adapter, under the name its operators know it by.
log = logging.getLogger("geodebot.channels.discord")

START_TIMEOUT_S = 30.0
CATCH_UP_LIMIT = 100
_CURSOR = "discord:last:{}"


class DiscordIngest:
    """The client's lifecycle and what arrives over its gateway; ``on_press`` answers a
    card's button."""

    def __init__(
        self,
        state: DiscordState,
        *,
        on_press: Callable[[discord.Interaction], Awaitable[None]],
        ingest_later: bool,
    ) -> None:
        self._state = state
        self._on_press = on_press
        self._ingest_later = ingest_later
        self._started = False
        self._ingest_lock = asyncio.Lock()
        self._sink: InboundSink | None = None
        self._ready = asyncio.Event()
        self._locks: dict[str, asyncio.Lock] = {}
        self._cursor: dict[str, int] = {}
        self._stale: set[str] = set(state.bound)

    async def start(self, sink: InboundSink, presses: PressSink | None = None) -> None:
        if self._started:
            raise RuntimeError("discord channel already started")
        self._sink, self._state.presses = sink, presses
        self._started = True
        try:
            await self._login()
            if self._ingest_later:
                log.info("discord: logged in, %s", SENDING_ONLY)
                return
            await self._take_in()
        except BaseException:
            await self.stop()
            raise

    async def start_ingest(self) -> None:
        """Mark first runs, connect the gateway, wait for READY, register slash commands."""
        async with self._ingest_lock:
            if self._state.ingesting:
                return
            if not self._started:
                raise RuntimeError("discord channel not started")
            try:
                if self._state.client is None:  # a failed attempt before left none
                    await self._login()
                await self._take_in()
            except BaseException as exc:
                await self._close_client()
                if isinstance(exc, ChannelError):
                    self._state.last_error = str(exc)
                if isinstance(exc, Exception):
                    await self._login_again()
                raise

    async def _login_again(self) -> None:
        """A fresh client logged in over REST, so sending goes on after a failed attempt
        to take in; if that fails too, the next attempt logs in first."""
        try:
            await self._login()
        except ChannelError as exc:
            log.warning("discord: cannot log in again to send: %s", exc)
            await self._close_client()

    async def _login(self) -> None:
        client = self._state.client = GatewayClient(self, self._state.config)
        try:
            await client.login(self._state.token)
        except discord.LoginFailure as exc:
            raise ChannelError("discord: the bot token was rejected", permanent=True) from exc
        except NET_ERRORS as exc:
            raise ChannelError(f"discord: login failed: {exc!r}") from exc

    async def _take_in(self) -> None:
        client = self._state.client
        assert client is not None
        self._stale = set(self._state.bound)
        await self._connect(client)
        self._state.ingesting = True
        commands = [
            {"name": c.name, "description": c.description, "type": 1} for c in CHAT_COMMANDS
        ]
        try:
            await client.http.bulk_upsert_global_commands(client.application_id or 0, commands)
        except NET_ERRORS as exc:
            log.warning("discord: slash commands not registered (typed ones still work): %s", exc)

    async def _connect(self, client: discord.Client) -> None:
        await self._mark_first_runs()
        self._state.runner = asyncio.create_task(client.connect(reconnect=True))
        self._state.runner.add_done_callback(self._runner_done)
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait(
            {ready, self._state.runner}, timeout=START_TIMEOUT_S, return_when="FIRST_COMPLETED"
        )
        ready.cancel()
        await asyncio.gather(ready, return_exceptions=True)
        if not self._ready.is_set():
            why = self._state.last_error or f"no READY within {START_TIMEOUT_S:g}s"
            raise ChannelError(f"discord: gateway did not become ready: {why}")

    async def stop(self) -> None:
        downloads, self._state.downloads = self._state.downloads, None
        if downloads is not None:
            await downloads.close()
        await self._close_client()
        self._started = False

    async def _close_client(self) -> None:
        """Close the client (gateway and REST session) and end the work it started."""
        self._state.ingesting = False
        client, self._state.client = self._state.client, None
        if client is not None:
            await client.close()  # closes the socket, the HTTP session and its connector
        if self._state.runner is not None:
            await asyncio.wait({self._state.runner}, timeout=10)
            self._state.runner.cancel()
            await asyncio.gather(self._state.runner, return_exceptions=True)
            self._state.runner = None
        tasks = [t for t in self._state.tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ready.clear()

    def _runner_done(self, task: asyncio.Task[None]) -> None:
        # After close() discord.py's loop may end any which way; only a live client's end counts.
        if not task.cancelled() and self._state.client is not None and task.exception() is not None:
            self._state.last_error = f"gateway stopped: {task.exception()!r}"
            log.error("discord: %s", self._state.last_error)

    def connected(self) -> None:
        self._state.last_error = ""
        self._ready.set()
        for channel in self._state.bound:
            self._state.spawn(self._catch_up_until_done(channel))

    def malformed(self, event: str, data: Any, exc: Exception) -> None:
        self._state.counters["malformed"] += 1
        # The payload is not logged: it is someone's message text.
        ident = data.get("id") if isinstance(data, dict) else None
        log.warning(
            "discord: %s dispatch %s cannot be read (%s: %s); skipped",
            event,
            str(ident)[:32],
            type(exc).__name__,
            str(exc)[:200],
        )

    async def on_message(self, message: discord.Message) -> None:
        channel, task = str(message.channel.id), asyncio.current_task()
        if task is not None:  # discord.py's event task: stop() must be able to end it
            self._state.tasks.add(task)
        try:
            async with self._locks.setdefault(channel, asyncio.Lock()):
                await self._deliver(message, channel, advance=channel not in self._stale)
        except Exception as exc:
            # The store refusing (unwell, or this replica's lease gone) says all in its
            # message; anything else is a bug to trace.
            log.warning(
                "discord: inbound %s not committed: %s",
                message.id,
                exc,
                exc_info=not isinstance(exc, StoreError),
            )
            self._state.last_error = f"inbound not committed: {exc}"
            if channel in self._state.bound:
                # Without a cursor yet, catch-up would not know to start before this one.
                self._cursor.setdefault(channel, message.id - 1)
            if channel in self._state.bound and channel not in self._stale:
                self._stale.add(channel)
                self._state.spawn(self._catch_up_until_done(channel, delay=1.0))
        finally:
            if task is not None:
                self._state.tasks.discard(task)

    async def _deliver(self, message: discord.Message, channel: str, *, advance: bool) -> None:
        inbound = to_inbound(message, self._state.bot_id())
        if inbound is not None and self._sink is not None:
            await self._sink(inbound)
            self._state.counters["received"] += 1
        store = self._state.cursors if advance and channel in self._state.bound else None
        if store is not None and message.id > self._cursor.get(channel, 0):
            await store.set_cursor(_CURSOR.format(channel), str(message.id))
            self._cursor[channel] = message.id

    async def _mark_first_runs(self) -> None:
        """Each bound channel read for the first time gets its place (the newest message
        now) saved before the gateway connects. Once the bot shows as online, a message sent
        to it is owed an answer; saved only after the connect (as catch-up would), a crash
        in between would leave the next start no place, and it would skip what came since.
        A channel that cannot be read now is left to catch-up's own first run."""
        if self._state.cursors is None:
            return
        for channel in sorted(self._state.bound):
            try:
                if await self._state.cursors.get_cursor(_CURSOR.format(channel)):
                    continue
                target = await self._state.messageable(channel)
                newest = [m async for m in target.history(limit=1)]
                await self._save_cursor(channel, newest[0].id if newest else 0)
            except Exception as exc:
                log.warning(
                    "discord: %s: first place not saved before connecting: %s",
                    channel,
                    exc,
                    exc_info=True,
                )

    async def _save_cursor(self, channel: str, message_id: int) -> None:
        if self._state.cursors is not None:
            await self._state.cursors.set_cursor(_CURSOR.format(channel), str(message_id))
        self._cursor[channel] = message_id

    async def _catch_up_until_done(self, channel: str, delay: float = 0.0) -> None:
        while True:
            await asyncio.sleep(delay)
            try:
                await self._catch_up(channel)
                return
            except Exception as exc:
                log.warning("discord: catch-up of %s failed: %s", channel, exc, exc_info=True)
                self._state.last_error = f"catch-up failed: {exc}"
                delay = min(max(delay * 2, 1.0), 60.0)

    async def _catch_up(self, channel: str) -> None:
        async with self._locks.setdefault(channel, asyncio.Lock()):
            last = self._cursor.get(channel)
            if last is None and self._state.cursors is not None:
                stored = await self._state.cursors.get_cursor(_CURSOR.format(channel))
                last = int(stored) if stored else None
            target = await self._state.messageable(channel)
            if last is None:
                # First run: older history is not a gap, but everything after this point is
                # owed an answer, so the point is saved before any message moves it: a crash
                # before the first message was committed must not lose that message.
                newest = [m async for m in target.history(limit=1)]
                await self._save_cursor(channel, newest[0].id if newest else 0)
                self._stale.discard(channel)
                return
            self._cursor[channel] = max(last, self._cursor.get(channel, 0))
            # Newest first, so a backlog over the limit loses its oldest part, not its newest.
            pages = target.history(
                limit=CATCH_UP_LIMIT, after=discord.Object(last), oldest_first=False
            )
            missed = [m async for m in pages]
            if len(missed) == CATCH_UP_LIMIT:
                log.warning("discord: %s: only the newest %d missed messages", channel, len(missed))
            for message in reversed(missed):
                await self._deliver(message, channel, advance=True)
            self._state.counters["caught_up"] += len(missed)
            self._stale.discard(channel)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        if interaction.type == discord.InteractionType.component:
            await self._on_press(interaction)
            return
        inbound = interaction_to_inbound(interaction)
        if inbound is None or self._state.client is None or self._sink is None:
            return
        # Registered before the sink: the reply may be ready before the ack is done.
        acked = asyncio.get_running_loop().create_future()
        now, key = time.monotonic(), str(interaction.id)
        self._state.interactions = {
            k: v for k, v in self._state.interactions.items() if now - v[1] < INTERACTION_TTL_S
        }
        self._state.interactions[key] = (interaction.token, now, acked)
        try:
            await self._sink(inbound)
            # Deferred ("thinking…") until the reply edits the original response.
            route = Route("POST", CALLBACK, interaction_id=key, interaction_token=interaction.token)
            await self._state.client.http.request(route, json={"type": 5})
            acked.set_result(True)
            self._state.counters["received"] += 1
        except Exception as exc:
            log.warning("discord: interaction %s not handled: %s", key, exc, exc_info=True)
        finally:
            if not acked.done():  # failed, or cancelled by stop()
                acked.set_result(False)

    def disconnected(self) -> None:
        self._stale |= self._state.bound  # a gap may start here
