"""Discord adapter: one ``discord.Client`` behind geodebot's :class:`Channel` port.

* Endpoints. discord.py reads REST URLs from the class attribute ``Route.BASE`` and a plain
  Client dials the class attribute ``DiscordWebSocket.DEFAULT_GATEWAY`` (it never asks
  ``/gateway/bot``). Setting those would redirect every discord.py client in the process, so
  they stay untouched: *our* client's own ``HTTPClient`` rebases ``request`` (every REST call;
  interaction callbacks go through it too) and ``ws_connect`` (first connect, re-identify).
  Resumes use READY's ``resume_gateway_url``. discord.py's ``Webhook``/``InteractionResponse``
  helpers bypass ``request`` and would reach discord.com; we do not use them.
* Compression. ``Client.connect`` always asks for zlib-stream (zstd-stream when ``zstandard``
  or ``compression.zstd`` imports); ``from_client(compress=False)`` exists but connect never
  passes it. Real Discord and the fake both speak it, so nothing is patched.
* Threads are threads of their parent (``channel`` = parent id, ``thread`` = thread id), like
  Slack: a binding on a channel covers its threads. Replies go to the thread.
* Catch-up. Discord never redelivers. After each (re)connect, every bound channel's history
  after the cursor ``discord:last:<channel>`` (the newest ``CATCH_UP_LIMIT``) goes through the
  sink again, oldest first (the daemon drops duplicates by ``event_id``). Until that pass
  succeeds live messages do not move the cursor, so it never skips a gap; deliveries per
  channel are serialised so it only moves forward. The first run (no cursor) saves the
  channel's newest message id as the cursor before the gateway connects, i.e. before the bot
  shows as online: a crash at any point after loses nothing sent to the online bot.
* Taking in later (``ingest_later=True``, for a replica while another one owns the gateway):
  ``start`` only logs in over REST (sends, edits, history reads, uploads work); marking first
  runs, the gateway and the slash commands wait for ``start_ingest``, whose READY catches up
  from history as after a restart. discord.py cannot drop a gateway and keep its REST
  session, so a ``start_ingest`` that fails replaces the client with a fresh logged-in one.
* Sending. ``Messageable.send`` has no ``enforce_nonce`` keyword: discord.py sends
  ``enforce_nonce: true`` with every nonce. The nonce hashes the part key, so a resend of a
  part within Discord's window returns the first message. discord.py sleeps through 429s
  (one wait is capped by ``max_ratelimit_timeout``, beyond that ``RateLimited``) and retries
  500/502/504 itself; ``SEND_TIMEOUT_S`` bounds the whole call.
* Streamed previews. A part with ``edit_of`` edits that message (its content only: a
  preview carries no components) instead of sending a new one; a repeated edit is harmless,
  so it needs no nonce. If Discord says the message is gone (10008, deleted by someone), the
  part is sent as a new message under its own nonce: the final answer must arrive, once. A
  ``plain`` part is a preview of an answer still arriving: sent as is (our markdown is
  Discord's, so there is nothing to convert) as a reply that pings nobody, not even the
  asker: the final answer edits it later, and an edit notifies nobody. A preview over the
  limit is refused before any request, like any part: cutting it instead would repeat the
  same 2000 characters in an edit per interval for the rest of a long answer.
* Approval cards. A card is a message with one action row of two buttons whose custom_id
  is ``press_data(...)``; its text is escaped (the summary is the model's words). A press is
  a component interaction, handled in ``on_interaction`` and decided by the press sink
  against the durable request, so it still works after a restart, which a view kept in
  memory would not. The view that builds the buttons is therefore stopped before it is sent:
  discord.py's view store never holds it (nor grows by one view per card) and, holding
  none, answers no press itself, so each press gets exactly one response. Discord drops an
  interaction not answered within 3 s: a sink slower than ``PRESS_ANSWER_S`` gets a deferred
  update first, and a not counted answer then comes as an ephemeral followup.
* Files in. A message's attachments become ``Inbound.files`` (ref = the attachment URL;
  catch-up reads them from history the same way). Attachment URLs are signed and the CDN
  takes no token, so ``download`` sends none: it fetches only https URLs on Discord's CDN
  hosts (or on the configured API's own scheme, host and port: a local proxy or a test
  fake), follows no redirect, and stops at the cap (the declared size, Content-Length, or
  the bytes as they arrive). discord.py's own session is private to its ``HTTPClient``, so
  downloads go through one session of the adapter's, opened on first use.
* Files out. A part with ``file`` is one multipart message create (``payload_json`` and
  ``files[0]``, discord.py's ``send(file=...)``), caption, nonce and reply reference as for
  text; discord.py re-reads the file for each of its own retries. Its outcome is looked up
  by nonce like any part's. Discord answers an upload over the limit with 413/40005.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp
import yarl

with warnings.catch_warnings():
    # discord.py imports audioop for voice (deprecated since 3.11); we never use voice.
    warnings.filterwarnings("ignore", "'audioop' is deprecated", DeprecationWarning)
    import discord
    from discord.gateway import DiscordWebSocket
    from discord.http import HTTPClient, Route

from geodebot.channels.base import (
    CHAT_COMMANDS,
    SENDING_ONLY,
    ApprovalCard,
    ChannelError,
    ChannelStatus,
    CursorStore,
    Destination,
    FileTooLarge,
    Inbound,
    InboundFile,
    InboundSink,
    OutboundFile,
    OutboundPart,
    Platform,
    Press,
    PressAnswer,
    PressSink,
    SendUnknown,
    SentPart,
    parse_press_data,
    press_data,
)
from geodebot.channels.download import platform_host, read_capped
from geodebot.channels.render import render_for
from geodebot.config.schema import DiscordConfig
from geodebot.store.records import StoreError

log = logging.getLogger(__name__)

MAX_CHARS = 2000
START_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 90.0
MAX_RATELIMIT_WAIT_S = 30.0  # discord.py raises it to 30 anyway
NONCE_WINDOW_S = 120.0  # Discord dedups nonces for "a few minutes": stay well inside
# discord.py waits this long after the last GUILD_CREATE before it calls the client ready.
# Nothing here needs the guild cache whole: a message from a guild not cached yet arrives on
# a partial channel (still not a DM), and sends go through partial channels or a fetch. So a
# short wait only makes READY sooner (its default is 2 s).
GUILD_READY_TIMEOUT_S = 0.1
CATCH_UP_LIMIT = 100
FIND_SENT_LOOKBACK = 50
INTERACTION_TTL_S = 14 * 60.0  # interaction tokens live 15 minutes
PRESS_ANSWER_S = 2.5  # Discord drops an interaction not answered within 3 s
_CURSOR = "discord:last:{}"
_NET_ERRORS = (discord.DiscordException, aiohttp.ClientError, OSError, TimeoutError)
_CALLBACK = "/interactions/{interaction_id}/{interaction_token}/callback"
_NOT_VALID = "This button is not valid."
_RETRY = "That did not work; please try again."
_EPHEMERAL = 64  # message flag: only the presser sees it
_UNKNOWN_MESSAGE = 10008  # Discord's JSON error code for a message that no longer exists
_TOO_LARGE = 40005  # Discord's JSON error code for an upload over the limit (HTTP 413)
# Where attachment URLs point: the CDN and its media proxy (``url`` and ``proxy_url``).
CDN_HOSTS = frozenset({"cdn.discordapp.com", "media.discordapp.net"})
DOWNLOAD_TIMEOUT_S = 300.0  # a whole download, 20 MB over a slow link included
# Discord renders a backslash before any ASCII punctuation as that character alone, so
# escaping more than strictly needed loses nothing. "<" covers mentions, channels,
# timestamps, custom emoji and <url> links; "[" masked links; the rest inline styles.
_MARKUP = re.compile(r"([\\*_~|`<@\[])")
# Block syntax counts only at the start of a line: quotes, headings, subtext, lists.
_LINE_MARKUP = re.compile(r"^(\s*)([>#+-])", re.MULTILINE)
_NUMBERED = re.compile(r"^(\s*\d+)\.", re.MULTILINE)
_T = TypeVar("_T")


def nonce_for(key: str) -> str:
    """24 hex chars (Discord allows 25), stable for the part key."""
    return hashlib.blake2b(key.encode(), digest_size=12).hexdigest()


def escape_markup(text: str) -> str:
    """``text`` shown literally by Discord, whatever markup it carries."""
    text = _LINE_MARKUP.sub(r"\1\\\2", _MARKUP.sub(r"\\\1", text))
    return _NUMBERED.sub(r"\1\\.", text)


def card_text(card: ApprovalCard) -> str:
    """The card as message content: its head in bold, every line escaped, within MAX_CHARS
    (the longest line after the head gives way)."""
    head, *rest = [escape_markup(line) for line in card.lines()]
    lines = [f"**{head}**", *rest]
    excess = sum(map(len, lines)) + len(lines) - 1 - MAX_CHARS
    if excess > 0 and len(lines) > 1:
        longest = max(range(1, len(lines)), key=lambda n: len(lines[n]))
        cut = lines[longest][: max(0, len(lines[longest]) - excess - 1)]
        if (len(cut) - len(cut.rstrip("\\"))) % 2:  # never leave half an escape behind
            cut = cut[:-1]
        lines[longest] = cut + "…"
    return "\n".join(lines)


def card_view(card: ApprovalCard) -> discord.ui.View | None:
    """Approve and Deny (neither the default) while the card is open; None once decided."""
    if card.outcome is not None:
        return None
    view = discord.ui.View(timeout=None)
    for label, style, approve in (
        ("Approve", discord.ButtonStyle.success, True),
        ("Deny", discord.ButtonStyle.danger, False),
    ):
        custom_id = press_data(card.approval_id, approve)
        view.add_item(discord.ui.Button(label=label, style=style, custom_id=custom_id))
    view.stop()  # never stored in discord.py's view store (see the module docstring)
    return view


def _place(channel: object) -> tuple[str, str | None]:
    if isinstance(channel, discord.Thread) and channel.parent_id is not None:
        return str(channel.parent_id), str(channel.id)
    return str(getattr(channel, "id", "")), None


def to_inbound(message: discord.Message, bot_user_id: int | None) -> Inbound | None:
    """A user-visible chat message as an Inbound; system messages (joins, pins) are None."""
    if message.type not in (discord.MessageType.default, discord.MessageType.reply):
        return None
    channel, thread = _place(message.channel)
    author = message.author
    return Inbound(
        platform="discord",
        event_id=str(message.id),
        channel=channel,
        thread=thread,
        user=str(author.id),
        text=message.content or "",
        message_id=str(message.id),
        user_name=author.name,
        # A webhook's author is no account, and Discord need not mark it as a bot; a webhook
        # (another integration relaying, or a bot posting through one) is never a person.
        is_bot=author.bot or author.system or message.webhook_id is not None,
        is_self=author.id == bot_user_id,
        mentions_bot=any(u.id == bot_user_id for u in message.mentions),
        is_dm=isinstance(message.channel, discord.DMChannel),
        ts=message.created_at.timestamp(),
        files=tuple(
            InboundFile(a.url, a.filename, a.content_type or "", a.size or 0)
            for a in message.attachments
        ),
    )


def interaction_to_inbound(interaction: discord.Interaction) -> Inbound | None:
    """A slash command from CHAT_COMMANDS as the text ``/name``; anything else is None."""
    name = dict(interaction.data or {}).get("name")
    slash = interaction.type == discord.InteractionType.application_command
    if not slash or not any(c.name == name for c in CHAT_COMMANDS):
        return None
    channel, thread = _place(interaction.channel)
    return Inbound(
        platform="discord",
        event_id=str(interaction.id),
        channel=channel or str(interaction.channel_id),
        thread=thread,
        user=str(interaction.user.id),
        text=f"/{name}",
        message_id=str(interaction.id),
        user_name=interaction.user.name,
        mentions_bot=True,  # a slash command is addressed to this bot by construction
        is_dm=interaction.guild_id is None,
        ts=interaction.created_at.timestamp(),
    )


class _RebasedHTTP(HTTPClient):
    def __init__(self, config: DiscordConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._api_base = config.api_base_url.rstrip("/")
        self._gateway = yarl.URL(config.gateway_url)

    async def request(self, route: Route, **kwargs: Any) -> Any:
        if route.url.startswith(Route.BASE):
            route.url = self._api_base + route.url[len(Route.BASE) :]
        return await super().request(route, **kwargs)

    async def ws_connect(self, url: str, *, compress: int = 0) -> Any:
        if url.startswith(str(DiscordWebSocket.DEFAULT_GATEWAY)):
            url = str(self._gateway.with_query(yarl.URL(url).query))
        return await super().ws_connect(url, compress=compress)


def _guarded(
    event: str, parse: Callable[[Any], None], on_error: Callable[[str, Any, Exception], None]
) -> Callable[[Any], None]:
    def run(data: Any) -> None:
        try:
            parse(data)
        except Exception as exc:  # noqa: BLE001 - the unit of work is one dispatch: skip it
            on_error(event, data, exc)

    return run


class _Client(discord.Client):
    def __init__(self, adapter: DiscordChannel, config: DiscordConfig) -> None:
        intents = discord.Intents.none()
        intents.guilds = intents.guild_messages = intents.dm_messages = True
        intents.message_content = True  # without it guild text is empty unless we are mentioned
        super().__init__(
            intents=intents,
            max_messages=None,
            chunk_guilds_at_startup=False,
            member_cache_flags=discord.MemberCacheFlags.none(),
            guild_ready_timeout=GUILD_READY_TIMEOUT_S,
            max_ratelimit_timeout=MAX_RATELIMIT_WAIT_S,
            allowed_mentions=discord.AllowedMentions.none(),
        )
        # Swapped before login opens the session; the connection state holds the same object.
        self.http = _RebasedHTTP(config, loop=self.loop, max_ratelimit_timeout=MAX_RATELIMIT_WAIT_S)
        self._connection.http = self.http
        self._adapter = adapter
        # discord.py lets an exception from a dispatch parser escape Client.connect, which
        # ends the gateway for good: one MESSAGE_CREATE lacking a field would silence the
        # bot until a restart. The gateway reads this very dict, so each parser is guarded.
        parsers = self._connection.parsers
        for event, parse in list(parsers.items()):
            parsers[event] = _guarded(event, parse, adapter._malformed)

    async def on_ready(self) -> None:
        self._adapter._connected()

    async def on_resumed(self) -> None:
        self._adapter._connected()

    async def on_disconnect(self) -> None:
        self._adapter._stale |= self._adapter._bound  # a gap may start here

    async def on_message(self, message: discord.Message) -> None:
        await self._adapter._on_message(message)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        await self._adapter._on_interaction(interaction)


class DiscordChannel:
    def __init__(
        self,
        config: DiscordConfig,
        token: str,
        *,
        bound_channels: Sequence[str] = (),
        cursor_store: CursorStore | None = None,
        ingest_later: bool = False,
    ) -> None:
        """``ingest_later``: ``start`` only logs in; see the module doc."""
        self._config, self._token = config, token
        self._ingest_later = ingest_later
        self._started = self._ingesting = False
        self._ingest_lock = asyncio.Lock()
        self._bound = frozenset(bound_channels)
        self._cursors = cursor_store
        self._client: _Client | None = None
        self._sink: InboundSink | None = None
        self._presses: PressSink | None = None
        self._runner: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._cursor: dict[str, int] = {}
        self._stale: set[str] = set(self._bound)
        self._attempted: dict[str, float] = {}  # part key -> first send, for find_sent
        # interaction id -> (token, when, acknowledged)
        self._interactions: dict[str, tuple[str, float, asyncio.Future[bool]]] = {}
        self._last_error = ""
        self._downloads: aiohttp.ClientSession | None = None  # opened on the first download
        self.counters: dict[str, int] = {
            "received": 0,
            "sent": 0,
            "downloaded": 0,
            "caught_up": 0,
            "malformed": 0,
            "presses": 0,
        }

    @property
    def platform(self) -> Platform:
        return "discord"

    @property
    def ingesting(self) -> bool:
        """The gateway is this channel's (connected once, and kept by discord.py)."""
        return self._ingesting

    async def start(self, sink: InboundSink, presses: PressSink | None = None) -> None:
        if self._started:
            raise RuntimeError("discord channel already started")
        self._sink, self._presses = sink, presses
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
            if self._ingesting:
                return
            if not self._started:
                raise RuntimeError("discord channel not started")
            try:
                if self._client is None:  # a failed attempt before left none
                    await self._login()
                await self._take_in()
            except BaseException as exc:
                await self._close_client()
                if isinstance(exc, ChannelError):
                    self._last_error = str(exc)
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
        client = self._client = _Client(self, self._config)
        try:
            await client.login(self._token)
        except discord.LoginFailure as exc:
            raise ChannelError("discord: the bot token was rejected", permanent=True) from exc
        except _NET_ERRORS as exc:
            raise ChannelError(f"discord: login failed: {exc!r}") from exc

    async def _take_in(self) -> None:
        client = self._client
        assert client is not None
        self._stale = set(self._bound)
        await self._connect(client)
        self._ingesting = True
        commands = [
            {"name": c.name, "description": c.description, "type": 1} for c in CHAT_COMMANDS
        ]
        try:
            await client.http.bulk_upsert_global_commands(client.application_id or 0, commands)
        except _NET_ERRORS as exc:
            log.warning("discord: slash commands not registered (typed ones still work): %s", exc)

    async def _connect(self, client: _Client) -> None:
        await self._mark_first_runs()
        self._runner = asyncio.create_task(client.connect(reconnect=True))
        self._runner.add_done_callback(self._runner_done)
        ready = asyncio.create_task(self._ready.wait())
        await asyncio.wait(
            {ready, self._runner}, timeout=START_TIMEOUT_S, return_when="FIRST_COMPLETED"
        )
        ready.cancel()
        await asyncio.gather(ready, return_exceptions=True)
        if not self._ready.is_set():
            why = self._last_error or f"no READY within {START_TIMEOUT_S:g}s"
            raise ChannelError(f"discord: gateway did not become ready: {why}")

    async def stop(self) -> None:
        downloads, self._downloads = self._downloads, None
        if downloads is not None:
            await downloads.close()
        await self._close_client()
        self._started = False

    async def _close_client(self) -> None:
        """Close the client (gateway and REST session) and end the work it started."""
        self._ingesting = False
        client, self._client = self._client, None
        if client is not None:
            await client.close()  # closes the socket, the HTTP session and its connector
        if self._runner is not None:
            await asyncio.wait({self._runner}, timeout=10)
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
            self._runner = None
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ready.clear()

    def _runner_done(self, task: asyncio.Task[None]) -> None:
        # After close() discord.py's loop may end any which way; only a live client's end counts.
        if not task.cancelled() and self._client is not None and task.exception() is not None:
            self._last_error = f"gateway stopped: {task.exception()!r}"
            log.error("discord: %s", self._last_error)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _connected(self) -> None:
        self._last_error = ""
        self._ready.set()
        for channel in self._bound:
            self._spawn(self._catch_up_until_done(channel))

    def _malformed(self, event: str, data: Any, exc: Exception) -> None:
        self.counters["malformed"] += 1
        # The payload is not logged: it is someone's message text.
        ident = data.get("id") if isinstance(data, dict) else None
        log.warning(
            "discord: %s dispatch %s cannot be read (%s: %s); skipped",
            event,
            str(ident)[:32],
            type(exc).__name__,
            str(exc)[:200],
        )

    def _bot_id(self) -> int | None:
        user = self._client.user if self._client is not None else None
        return user.id if user is not None else None

    async def _on_message(self, message: discord.Message) -> None:
        channel, task = str(message.channel.id), asyncio.current_task()
        if task is not None:  # discord.py's event task: stop() must be able to end it
            self._tasks.add(task)
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
            self._last_error = f"inbound not committed: {exc}"
            if channel in self._bound:
                # Without a cursor yet, catch-up would not know to start before this one.
                self._cursor.setdefault(channel, message.id - 1)
            if channel in self._bound and channel not in self._stale:
                self._stale.add(channel)
                self._spawn(self._catch_up_until_done(channel, delay=1.0))
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _deliver(self, message: discord.Message, channel: str, *, advance: bool) -> None:
        inbound = to_inbound(message, self._bot_id())
        if inbound is not None and self._sink is not None:
            await self._sink(inbound)
            self.counters["received"] += 1
        store = self._cursors if advance and channel in self._bound else None
        if store is not None and message.id > self._cursor.get(channel, 0):
            await store.set_cursor(_CURSOR.format(channel), str(message.id))
            self._cursor[channel] = message.id

    async def _mark_first_runs(self) -> None:
        """Each bound channel read for the first time gets its place (the newest message
        now) saved before the gateway connects. Once the bot shows as online, a message sent
        to it is owed an answer; saved only after the connect (as catch-up would), a crash
        in between would leave the next start no place, and it would skip what came since.
        A channel that cannot be read now is left to catch-up's own first run."""
        if self._cursors is None:
            return
        for channel in sorted(self._bound):
            try:
                if await self._cursors.get_cursor(_CURSOR.format(channel)):
                    continue
                target = await self._messageable(channel)
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
        if self._cursors is not None:
            await self._cursors.set_cursor(_CURSOR.format(channel), str(message_id))
        self._cursor[channel] = message_id

    async def _catch_up_until_done(self, channel: str, delay: float = 0.0) -> None:
        while True:
            await asyncio.sleep(delay)
            try:
                await self._catch_up(channel)
                return
            except Exception as exc:
                log.warning("discord: catch-up of %s failed: %s", channel, exc, exc_info=True)
                self._last_error = f"catch-up failed: {exc}"
                delay = min(max(delay * 2, 1.0), 60.0)

    async def _catch_up(self, channel: str) -> None:
        async with self._locks.setdefault(channel, asyncio.Lock()):
            last = self._cursor.get(channel)
            if last is None and self._cursors is not None:
                stored = await self._cursors.get_cursor(_CURSOR.format(channel))
                last = int(stored) if stored else None
            target = await self._messageable(channel)
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
            self.counters["caught_up"] += len(missed)
            self._stale.discard(channel)

    async def _on_interaction(self, interaction: discord.Interaction) -> None:
        if interaction.type == discord.InteractionType.component:
            await self._on_press(interaction)
            return
        inbound = interaction_to_inbound(interaction)
        if inbound is None or self._client is None or self._sink is None:
            return
        # Registered before the sink: the reply may be ready before the ack is done.
        acked = asyncio.get_running_loop().create_future()
        now, key = time.monotonic(), str(interaction.id)
        self._interactions = {
            k: v for k, v in self._interactions.items() if now - v[1] < INTERACTION_TTL_S
        }
        self._interactions[key] = (interaction.token, now, acked)
        try:
            await self._sink(inbound)
            # Deferred ("thinking…") until the reply edits the original response.
            route = Route(
                "POST", _CALLBACK, interaction_id=key, interaction_token=interaction.token
            )
            await self._client.http.request(route, json={"type": 5})
            acked.set_result(True)
            self.counters["received"] += 1
        except Exception as exc:
            log.warning("discord: interaction %s not handled: %s", key, exc, exc_info=True)
        finally:
            if not acked.done():  # failed, or cancelled by stop()
                acked.set_result(False)

    async def _on_press(self, interaction: discord.Interaction) -> None:
        """A card's button: decided by the press sink, answered to the presser alone."""
        press = self._press_of(interaction)
        if press is None or self._presses is None:
            await self._respond(interaction, _private(_NOT_VALID))
            return
        self.counters["presses"] += 1
        task = asyncio.current_task()
        if task is not None:  # discord.py's event task: stop() must be able to end it
            self._tasks.add(task)
        decided = asyncio.ensure_future(self._decide(self._presses, press))
        try:
            done, _ = await asyncio.wait({decided}, timeout=PRESS_ANSWER_S)
            if decided in done:
                answer = decided.result()
                await self._respond(
                    interaction, {"type": 6} if answer.counted else _private(answer.text)
                )
                return
            # Past Discord's window the interaction would fail for the presser: acknowledge
            # now, tell them later if the press did not count.
            await self._respond(interaction, {"type": 6})
            answer = await decided
            if not answer.counted:
                await self._follow_up(interaction, answer.text)
        finally:
            decided.cancel()  # done by now, unless stop() ended this task
            if task is not None:
                self._tasks.discard(task)

    @staticmethod
    def _press_of(interaction: discord.Interaction) -> Press | None:
        parsed = parse_press_data(str(dict(interaction.data or {}).get("custom_id", "")))
        user = getattr(interaction.user, "id", None)  # MISSING when Discord sent no user
        if parsed is None or user is None:
            return None
        channel, _ = _place(interaction.channel)
        message = interaction.message
        return Press(
            platform="discord",
            channel=channel or str(interaction.channel_id),
            user=str(user),
            approval_id=parsed[0],
            approve=parsed[1],
            message_id=str(message.id) if message is not None else "",
        )

    @staticmethod
    async def _decide(presses: PressSink, press: Press) -> PressAnswer:
        try:
            return await presses(press)
        except Exception:
            log.exception("discord: press on approval %s not decided", press.approval_id)
            return PressAnswer(False, _RETRY)

    async def _respond(self, interaction: discord.Interaction, body: dict[str, Any]) -> None:
        """The interaction's one response; a failure is logged, the gateway goes on."""
        if self._client is None:
            return
        route = Route(
            "POST", _CALLBACK, interaction_id=interaction.id, interaction_token=interaction.token
        )
        try:
            await self._client.http.request(route, json=body)
        except _NET_ERRORS as exc:
            log.warning("discord: press %s not answered: %s", interaction.id, exc)

    async def _follow_up(self, interaction: discord.Interaction, text: str) -> None:
        if self._client is None:
            return
        path = "/webhooks/{webhook_id}/{webhook_token}"
        route = Route(
            "POST", path, webhook_id=interaction.application_id, webhook_token=interaction.token
        )
        try:
            await self._client.http.request(route, json=_private(text)["data"])
        except _NET_ERRORS as exc:
            log.warning("discord: press %s answer not sent: %s", interaction.id, exc)

    def render(self, markdown: str) -> list[str]:
        return render_for("discord", markdown)

    async def _messageable(self, channel: str) -> Any:
        if self._client is None:
            raise ChannelError("discord channel is not started")
        found = self._client.get_channel(int(channel))
        # Uncached (a DM): fetched, so that history knows it is a DM.
        return found if found is not None else await self._client.fetch_channel(int(channel))

    async def _interaction_token(self, part: OutboundPart) -> str | None:
        """The token whose deferred response this part should fill in, if any."""
        entry = self._interactions.get(part.destination.reply_to or "")
        if part.index != 0 or entry is None or time.monotonic() - entry[1] >= INTERACTION_TTL_S:
            return None
        if part.file is not None:  # goes to the channel; the answer fills in the response
            return None
        with contextlib.suppress(TimeoutError):
            if await asyncio.wait_for(asyncio.shield(entry[2]), 10):
                return entry[0]
        return None  # never acknowledged: answer as a plain message

    async def send(self, part: OutboundPart) -> SentPart:
        if len(part.text) > MAX_CHARS:
            raise ChannelError(f"part is {len(part.text)} chars, over {MAX_CHARS}", permanent=True)
        now = time.monotonic()
        self._attempted = {k: v for k, v in self._attempted.items() if now - v < NONCE_WINDOW_S}
        self._attempted.setdefault(part.key, now)
        sent = await _bounded(self._send(part))
        self.counters["sent"] += 1
        return sent

    async def _send(self, part: OutboundPart) -> SentPart:
        if part.file is not None:  # never an edit, never an interaction's response
            return await self._send_file(part, part.file)
        if part.edit_of is not None and await self._edited(part, part.edit_of):
            return SentPart(part.edit_of)
        dest, token = part.destination, await self._interaction_token(part)
        if token is not None and self._client is not None:
            # Editing the deferred response is idempotent, which a webhook followup is not.
            path = "/webhooks/{webhook_id}/{webhook_token}/messages/@original"
            route = Route(
                "PATCH", path, webhook_id=self._client.application_id, webhook_token=token
            )
            body = {"content": part.text, "allowed_mentions": {"parse": []}}
            return SentPart(str((await self._client.http.request(route, json=body))["id"]))
        target = await self._messageable(dest.thread or dest.channel)
        reference = self._reference(part)
        message = await target.send(
            part.text,
            nonce=nonce_for(part.key),
            reference=reference,
            allowed_mentions=discord.AllowedMentions.none(),
            # The one ping a reply is allowed; a preview pings nobody.
            mention_author=reference is not None and not part.plain,
        )
        return SentPart(str(message.id))

    def _reference(self, part: OutboundPart) -> discord.MessageReference | None:
        """The message the part answers, for its first part (an interaction is no message)."""
        dest = part.destination
        if not dest.reply_to or part.index != 0 or dest.reply_to in self._interactions:
            return None
        return discord.MessageReference(
            message_id=int(dest.reply_to),
            channel_id=int(dest.thread or dest.channel),
            fail_if_not_exists=False,
        )

    async def _send_file(self, part: OutboundPart, file: OutboundFile) -> SentPart:
        target = await self._messageable(part.destination.thread or part.destination.channel)
        reference = self._reference(part)
        try:
            upload = discord.File(file.path, filename=file.name)
        except OSError as exc:  # gone from the file store: a resend would not find it either
            raise ChannelError(
                f"discord: {file.name} cannot be read: {exc}", permanent=True
            ) from exc
        try:
            message = await target.send(
                content=part.text or None,
                file=upload,
                nonce=nonce_for(part.key),
                reference=reference,
                allowed_mentions=discord.AllowedMentions.none(),
                mention_author=reference is not None,
            )
        finally:
            upload.close()  # send closes it too, unless it failed before the request
        return SentPart(str(message.id))

    async def _edited(self, part: OutboundPart, message_id: str) -> bool:
        """Edit our message ``message_id`` to the part's text; False if it no longer exists."""
        if self._client is None:
            raise ChannelError("discord channel is not started")
        dest = part.destination
        target = self._client.get_partial_messageable(int(dest.thread or dest.channel))
        try:
            await target.get_partial_message(int(message_id)).edit(
                content=part.text, allowed_mentions=discord.AllowedMentions.none()
            )
        except discord.NotFound as exc:
            if exc.code != _UNKNOWN_MESSAGE:
                raise
            log.info("discord: message %s is gone; part %s goes as a new one", message_id, part.key)
            return False
        return True

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        """Our message carrying the part's nonce in recent history, else an idempotent resend.

        Discord returns ``nonce`` on fetched messages only for a while after creation, so
        history can miss it. A resend under the same nonce is deduplicated by Discord within
        its window, so it is done only while this process knows the first attempt is recent;
        otherwise None, and the outbox's blind-resend budget decides.
        """
        if await self._interaction_token(part) is not None:
            return await self.send(part)
        nonce, me = nonce_for(part.key), self._bot_id()
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                target = await self._messageable(
                    part.destination.thread or part.destination.channel
                )
                async for message in target.history(limit=FIND_SENT_LOOKBACK):
                    if message.author.id == me and str(message.nonce) == nonce:
                        return SentPart(str(message.id))
        except Exception as exc:
            raise _translate(exc) from exc
        first = self._attempted.get(part.key)
        if first is not None and time.monotonic() - first < NONCE_WINDOW_S:
            log.info("discord: part %s not in history; resending under its nonce", part.key)
            return await self.send(part)
        return None

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        """The attachment's bytes from Discord's CDN, without a token (the URL is signed)."""
        url = self._download_url(file)
        if file.size > max_bytes:
            raise FileTooLarge(max_bytes, file.size)
        if self._client is None:
            raise ChannelError("discord channel is not started")
        if self._downloads is None:
            self._downloads = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=60),
            )
        try:
            async with (
                asyncio.timeout(DOWNLOAD_TIMEOUT_S),
                self._downloads.get(url, allow_redirects=False) as response,
            ):
                if response.status != 200:
                    raise _download_refused(file, response)
                body = await read_capped(response, max_bytes)
        except (FileTooLarge, ChannelError):
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # Not the exception's text: aiohttp's may carry the signed URL.
            raise ChannelError(
                f"discord: download of {file.name} failed: {type(exc).__name__}"
            ) from exc
        self.counters["downloaded"] += 1
        return body

    def _download_url(self, file: InboundFile) -> yarl.URL:
        """The attachment's URL, exactly as Discord gave it, if it is Discord's to serve."""
        try:
            url = yarl.URL(file.ref, encoded=True)
            allowed = platform_host(url, CDN_HOSTS, yarl.URL(self._config.api_base_url))
        except (TypeError, ValueError) as exc:
            raise ChannelError(f"discord: {file.name}: not a URL", permanent=True) from exc
        if not allowed:
            host = str(url.host or "")[:100]
            raise ChannelError(f"discord: {file.name}: {host!r} is not Discord's", permanent=True)
        return url

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        return await _bounded(self._send_card(destination, card))

    async def _send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        target = await self._messageable(destination.thread or destination.channel)
        message = await target.send(
            card_text(card),
            view=card_view(card),
            # A resend after an unknown outcome returns the first card, not a second one.
            nonce=nonce_for(f"card:{card.approval_id}"),
            allowed_mentions=discord.AllowedMentions.none(),
            suppress_embeds=True,  # a link in the summary must not unfurl a preview
        )
        return SentPart(str(message.id))

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        await _bounded(self._edit_card(destination, message_id, card))

    async def _edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        if self._client is None:
            raise ChannelError("discord channel is not started")
        target = self._client.get_partial_messageable(
            int(destination.thread or destination.channel)
        )
        # view=None sends an empty components list: the buttons go.
        await target.get_partial_message(int(message_id)).edit(
            content=card_text(card),
            view=card_view(card),
            allowed_mentions=discord.AllowedMentions.none(),
        )

    async def delete(self, destination: Destination, message_id: str) -> None:
        await _bounded(self._delete(destination, message_id))

    async def _delete(self, destination: Destination, message_id: str) -> None:
        if self._client is None:
            raise ChannelError("discord channel is not started")
        target = self._client.get_partial_messageable(
            int(destination.thread or destination.channel)
        )
        await target.get_partial_message(int(message_id)).delete()

    async def typing(self, destination: Destination) -> None:
        with contextlib.suppress(*_NET_ERRORS, ChannelError):
            async with asyncio.timeout(10):
                await (await self._messageable(destination.thread or destination.channel)).typing()

    def status(self) -> ChannelStatus:
        client = self._client
        up = client is not None and not client.is_closed()
        if self._ingesting or self._runner is not None:
            connected = up and client is not None and client.is_ready()
            detail = self._last_error
        else:  # logged in over REST only
            connected = up and client is not None and client.user is not None
            detail = self._last_error or (SENDING_ONLY if connected else "")
        return ChannelStatus("discord", connected, detail, dict(self.counters))


def _private(text: str) -> dict[str, Any]:
    """An ephemeral interaction response: only the presser sees it."""
    data = {"content": text, "flags": _EPHEMERAL, "allowed_mentions": {"parse": []}}
    return {"type": 4, "data": data}


async def _bounded(call: Awaitable[_T]) -> _T:
    """One platform call under SEND_TIMEOUT_S, its failure as a ChannelError."""
    try:
        async with asyncio.timeout(SEND_TIMEOUT_S):
            return await call
    except Exception as exc:
        raise _translate(exc) from exc


def _download_refused(file: InboundFile, response: aiohttp.ClientResponse) -> ChannelError:
    status = response.status
    what = f"discord: download of {file.name} answered {status}"
    if status == 429 or status >= 500:
        retry = response.headers.get("Retry-After")
        try:
            after = float(retry) if retry else None
        except ValueError:
            after = None
        return ChannelError(what, retry_after=after if status == 429 else None)
    # Expired or unknown (404), forbidden, a redirect we do not follow: asking again is the same.
    return ChannelError(what, permanent=True)


def _translate(exc: Exception) -> ChannelError:
    if isinstance(exc, ChannelError):
        return exc
    if isinstance(exc, discord.RateLimited):
        return ChannelError(f"discord rate limit: {exc}", retry_after=exc.retry_after)
    if isinstance(exc, discord.HTTPException):
        if exc.status == 429:  # answered without Via: discord.py takes it for a Cloudflare ban
            retry = exc.response.headers.get("Retry-After")
            return ChannelError(f"discord 429: {exc}", retry_after=float(retry or 60))
        if exc.status == 413 or exc.code == _TOO_LARGE:
            return ChannelError(
                f"discord: the file is over the upload limit: {exc}", permanent=True
            )
        if 400 <= exc.status < 500:
            return ChannelError(f"discord rejected the message: {exc}", permanent=True)
        return ChannelError(f"discord server error: {exc}")
    if isinstance(exc, ValueError):  # a destination id that is no snowflake; nothing sent
        return ChannelError(f"discord: bad destination: {exc}", permanent=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ChannelError(f"discord unreachable: {exc}")  # never connected: nothing was sent
    return SendUnknown(f"discord request outcome unknown: {exc!r}")
