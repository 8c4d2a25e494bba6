"""discord.py's client for one adapter: pointed at the configured endpoints, with the intents
and caches geodebot needs, and its gateway events handed to the adapter's ingest.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import discord
import yarl
from discord.gateway import DiscordWebSocket
from discord.http import HTTPClient, Route

from geodebot.config.schema import DiscordConfig

MAX_RATELIMIT_WAIT_S = 30.0  # discord.py raises it to 30 anyway
# discord.py waits this long after the last GUILD_CREATE before it calls the client ready.
# Nothing here needs the guild cache whole: a message from a guild not cached yet arrives on
# a partial channel (still not a DM), and sends go through partial channels or a fetch. So a
# short wait only makes READY sooner (its default is 2 s).
GUILD_READY_TIMEOUT_S = 0.1


class GatewayEvents(Protocol):
    """Who the client hands its gateway events to (the adapter's ingest)."""

    def connected(self) -> None: ...
    def disconnected(self) -> None: ...
    def malformed(self, event: str, data: Any, exc: Exception) -> None: ...
    async def on_message(self, message: discord.Message) -> None: ...
    async def on_interaction(self, interaction: discord.Interaction) -> None: ...


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


class GatewayClient(discord.Client):
    def __init__(self, ingest: GatewayEvents, config: DiscordConfig) -> None:
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
        self._ingest = ingest
        # discord.py lets an exception from a dispatch parser escape Client.connect, which
        # ends the gateway for good: one MESSAGE_CREATE lacking a field would silence the
        # bot until a restart. The gateway reads this very dict, so each parser is guarded.
        parsers = self._connection.parsers
        for event, parse in list(parsers.items()):
            parsers[event] = _guarded(event, parse, ingest.malformed)

    async def on_ready(self) -> None:
        self._ingest.connected()

    async def on_resumed(self) -> None:
        self._ingest.connected()

    async def on_disconnect(self) -> None:
        self._ingest.disconnected()

    async def on_message(self, message: discord.Message) -> None:
        await self._ingest.on_message(message)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        await self._ingest.on_interaction(interaction)
