"""A fake Discord (REST v10 + gateway) on 127.0.0.1, for tests that run the real discord.py.

Usage::

    async with FakeDiscord(token="t") as fake:
        # point the client at fake.api_base_url (Route.BASE meaning) and fake.gateway_url
        mid = fake.push_message(fake.channel_id, "hi", author_id="42")
        assert fake.posted[fake.channel_id][0]["content"] == "answer"

Close to the real service where discord.py can tell:

* REST needs ``Authorization: Bot <token>`` and answers ``Content-Type: application/json``
  exactly (discord.py parses nothing else). Message create dedups ``nonce`` + ``enforce_nonce``
  for ``nonce_window_s`` (the first message comes back), rejects content over 2000 chars with
  400/50035 and answers failures queued by :meth:`fail_next_post`: 429 with ``Retry-After``,
  ``X-RateLimit-*``, ``Via`` (without it discord.py assumes a Cloudflare ban) and
  ``retry_after`` in the body (what discord.py actually reads); 5xx; status 0 cuts the
  connection. ``created=True`` creates the message first, like an answer lost on the way back.
* History is newest-first like Discord; ``nonce`` shows for ``nonce_visible_s`` only.
* The gateway speaks the transport compression the client asks for (``zlib-stream``: one
  compressobj per socket, Z_SYNC_FLUSH per frame; ``zstd-stream`` if a zstd module imports).
  Sessions keep their events so RESUME replays what a dropped socket missed.
  ``gateway_connects`` counts the sockets opened (identified or not); ``refuse_identifies``
  closes that many next IDENTIFYs with 4004 Authentication failed, as for a wrong token.
* Without the MESSAGE_CONTENT intent, unmentioned guild text arrives empty, as on Discord.
* Components: created messages keep their ``components`` (and ``flags``); PATCH of a message
  replaces the fields it names and dispatches MESSAGE_UPDATE. :meth:`push_press` dispatches
  a button press (INTERACTION_CREATE type 3 carrying the stored message). Each interaction
  takes one response (a second is 400/40060, as on Discord), recorded in ``responses``; a
  followup (``POST /webhooks/{app}/{token}``) needs that response first and is recorded in
  ``followups``, and only a non-ephemeral one appears in the channel.
* Edits (streamed previews): every text a message had is kept in order in ``revisions``
  (created, then each edit, with the time it was stored), so a test can see "one message,
  edited N times, ending as X" (:meth:`texts`). :meth:`fail_edits` answers the next edits
  with Discord's 429 for that route (same headers and body as a create's), and
  :meth:`delete_message` removes a message as a moderator would (MESSAGE_DELETE); editing it
  then is 404/10008 Unknown Message, as on Discord.
* Attachments in: :meth:`attachment` stores a file and returns its attachment object (``id``,
  ``filename``, ``size``, ``url``, ``proxy_url``, ``content_type``) for
  ``push_message(..., attachments=[...])``. Its ``url`` is signed like Discord's
  (``ex``/``is``/``hm``) and points at the fake CDN on this server (``/attachments/...``,
  ``proxy_url`` at ``/media/attachments/...``), which needs no token, answers 404 for a bad
  signature, counts each download in ``downloads`` (attachment id -> count) and records the
  ``Authorization`` header of each CDN request in ``cdn_authorization`` (a client must send
  none). The declared ``size`` may differ from the bytes, so an oversized file needs no big
  body; ``chunked=True`` serves it without Content-Length.
* Voice in: ``attachment(..., duration_secs=..., waveform=...)`` adds those fields (any
  value, a malformed one too) as Discord gives them on audio; ``push_message(..., flags=)``
  sets the message's flags. :meth:`push_voice_message` is both at once, as the app records
  one: content "", flags ``VOICE_MESSAGE`` (1 << 13) and one ``voice-message.ogg``
  attachment (audio/ogg, ``duration_secs``, base64 ``waveform``) served by the fake CDN.
* Attachments out: message create also takes Discord's multipart form (``payload_json`` and
  ``files[n]``), as discord.py sends it with a file; each file is recorded in ``uploads``
  (:class:`Upload`: channel, message, name, bytes, content, nonce, reference, the
  attachment's ``content_type`` and the ``sent_type`` of its form part; ``size``) and the
  message carries it as an attachment, downloadable from the fake CDN. Like Discord, the
  attachment's type comes from the file's name (discord.py sends every file as
  application/octet-stream). A request over
  ``upload_limit`` is 413/40005 Request entity too large, as on Discord.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import itertools
import json
import mimetypes
import secrets
import time
import zlib
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

from aiohttp import WSMsgType, web

DISCORD_EPOCH_MS = 1_420_070_400_000
MESSAGE_CONTENT_INTENT = 1 << 15
EPHEMERAL = 1 << 6  # message flag
VOICE_MESSAGE = 1 << 13  # message flag IS_VOICE_MESSAGE
UPLOAD_LIMIT = 10 * 1024 * 1024  # a bot's per-message upload limit without boosts
_SAME_GUILD: Any = object()
Json = dict[str, Any]


@dataclass(frozen=True)
class Revision:
    """A text a message had: at its creation, or after an edit."""

    text: str
    at: float  # time.monotonic() when the fake stored it


@dataclass(frozen=True)
class Upload:
    """A file the client uploaded with a message create."""

    channel_id: str
    message_id: str
    name: str
    data: bytes
    content: str | None  # the caption; None when the message had none
    nonce: str | None
    reference: Json | None  # message_reference, ids as strings
    content_type: str = ""  # the attachment's, from the name as Discord types it
    sent_type: str = ""  # the Content-Type of the file's form part, as the client sent it

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class _Stored:
    """A file the fake CDN serves."""

    data: bytes
    name: str
    content_type: str
    chunked: bool = False
    extra: Json = field(default_factory=dict)  # more attachment fields (duration_secs, ...)


@dataclass
class _Session:
    session_id: str
    seq: int = 0
    events: list[Json] = field(default_factory=list)


@dataclass(eq=False)
class _Conn:
    ws: web.WebSocketResponse
    compress: Callable[[bytes], bytes] | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    session: _Session | None = None

    async def send(self, payload: Json) -> None:
        raw = json.dumps(payload).encode()
        async with self.lock:  # compressor state and frame order must agree
            if self.compress is None:
                await self.ws.send_str(raw.decode())
            else:
                await self.ws.send_bytes(self.compress(raw))


def _compressor(kind: str | None) -> Callable[[bytes], bytes] | None:
    if kind == "zlib-stream":
        zobj = zlib.compressobj()
        return lambda raw: zobj.compress(raw) + zobj.flush(zlib.Z_SYNC_FLUSH)
    if kind != "zstd-stream":
        raise ValueError(f"unknown compression {kind!r}")
    try:
        import zstandard  # type: ignore[import-not-found]  # optional, untyped
    except ImportError:
        from compression import zstd  # type: ignore[import-not-found]  # 3.14+ only

        comp = zstd.ZstdCompressor()
        return lambda raw: bytes(comp.compress(raw, zstd.ZstdCompressor.FLUSH_BLOCK))
    cobj = zstandard.ZstdCompressor().compressobj()
    return lambda raw: bytes(cobj.compress(raw) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))


class FakeDiscord:
    def __init__(
        self,
        *,
        token: str = "fake-bot-token",
        bot_id: str = "900000000000000001",
        app_id: str = "900000000000000002",
        guild_id: str = "900000000000000010",
        channel_id: str = "900000000000000011",
        thread_id: str = "900000000000000012",
        nonce_window_s: float = 300.0,
        nonce_visible_s: float = 300.0,
        upload_limit: int = UPLOAD_LIMIT,
    ) -> None:
        self.token, self.bot_id, self.app_id = token, bot_id, app_id
        self.guild_id, self.channel_id, self.thread_id = guild_id, channel_id, thread_id
        self.nonce_window_s, self.nonce_visible_s = nonce_window_s, nonce_visible_s
        self.upload_limit = upload_limit
        self.uploads: list[Upload] = []
        self.downloads: dict[str, int] = defaultdict(int)  # attachment id -> CDN downloads
        self.cdn_authorization: list[str | None] = []  # each CDN request's Authorization
        self._files: dict[str, _Stored] = {}  # attachment id -> what the CDN serves
        self._cdn_key = secrets.token_bytes(16)
        self.posted: dict[str, list[Json]] = defaultdict(list)  # what the bot created
        self.deleted: list[str] = []  # ids of its messages the bot deleted (still in posted)
        self.history: dict[str, list[Json]] = defaultdict(list)  # everything, oldest first
        self.typing: list[str] = []
        self.commands: list[list[Json]] = []  # each bulk overwrite
        self.callbacks: list[tuple[str, int]] = []  # (interaction id, response type)
        # interaction id -> its one response: {"type", "data", "flags"}
        self.responses: dict[str, Json] = {}
        self.followups: dict[str, list[Json]] = defaultdict(list)  # interaction id -> bodies
        self.edits: list[Json] = []  # each message PATCH: {"id", "channel_id", "body"}
        self.interaction_replies: dict[str, str] = {}  # interaction id -> @original content
        self.revisions: dict[str, list[Revision]] = defaultdict(list)  # message id -> texts
        self.limited_edits: list[str] = []  # message id of each edit answered 429
        self._edit_failures: list[float] = []  # Retry-After of each edit still to fail
        self.identify_count = self.resume_count = self.gateway_connects = 0
        self.refuse_identifies = 0
        self.intents: int | None = None
        self._failures: list[tuple[int, float | None, bool]] = []
        self._nonces: dict[tuple[str, str], tuple[float, Json]] = {}
        self._created: dict[str, float] = {}
        self._interactions: dict[str, tuple[str, str]] = {}  # token -> (id, channel)
        self._changed = asyncio.Condition()  # notified when a response or followup arrives
        self._sessions: dict[str, _Session] = {}
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_id, self._counter = 0, itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> Self:
        # Uploads are read whole (a fake may): room for one over the limit, to refuse it.
        app = web.Application(middlewares=[self._auth], client_max_size=self.upload_limit * 2)
        app.router.add_get("/gateway", self._gateway)
        for prefix in ("", "/media"):  # url (cdn.discordapp.com), proxy_url (media.discordapp.net)
            app.router.add_get(prefix + "/attachments/{cid}/{aid}/{name}", self._cdn)
        for method, path, handler in (
            ("GET", "/users/@me", self._me),
            ("GET", "/oauth2/applications/@me", self._app_info),
            ("GET", "/gateway", self._gateway_info),
            ("GET", "/gateway/bot", self._gateway_info),
            ("GET", "/channels/{cid}", self._get_channel),
            ("POST", "/channels/{cid}/messages", self._create_message),
            ("GET", "/channels/{cid}/messages", self._list_messages),
            ("PATCH", "/channels/{cid}/messages/{mid}", self._edit_message),
            ("DELETE", "/channels/{cid}/messages/{mid}", self._delete_message),
            ("POST", "/channels/{cid}/typing", self._typing),
            ("PUT", "/applications/{app}/commands", self._put_commands),
            ("POST", "/interactions/{iid}/{tok}/callback", self._callback),
            ("PATCH", "/webhooks/{app}/{tok}/messages/@original", self._edit_original),
            ("POST", "/webhooks/{app}/{tok}", self._followup),
        ):
            app.router.add_route(method, "/api/v10" + path, handler)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.drop_gateway(code=1001)
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def api_base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v10"

    @property
    def gateway_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/gateway"

    @property
    def cdn_url(self) -> str:
        """The fake CDN: the same scheme, host and port as :attr:`api_base_url`."""
        return f"http://127.0.0.1:{self.port}"

    # ---- test helpers ----------------------------------------------------------------------

    def fail_next_post(
        self,
        status: int,
        retry_after: float | None = None,
        times: int = 1,
        *,
        created: bool = False,
    ) -> None:
        """The next ``times`` message creates fail; status 0 cuts the connection instead."""
        self._failures.extend([(status, retry_after, created)] * times)

    def fail_edits(self, count: int, retry_after: float = 1.0) -> None:
        """The next ``count`` message edits are answered 429 (discord.py itself retries a
        429 up to 5 times, sleeping ``retry_after`` between tries, unless it is over its
        ``max_ratelimit_timeout``)."""
        self._edit_failures.extend([retry_after] * count)

    def texts(self, message_id: str) -> list[str]:
        """Every text the message had, oldest first: as created, then after each edit."""
        return [r.text for r in self.revisions.get(message_id, [])]

    def attachment(
        self,
        channel_id: str,
        name: str,
        data: bytes,
        *,
        content_type: str | None = None,
        size: int | None = None,
        chunked: bool = False,
        duration_secs: Any = None,
        waveform: Any = None,
    ) -> Json:
        """A file a user uploads into ``channel_id``: its attachment object, for
        :meth:`push_message`. ``content_type`` defaults to the guess from the name, as
        Discord's ("" for none); ``size`` (what Discord declares) to the length of ``data``.
        ``duration_secs`` and ``waveform`` (base64), left out when None, go in as given."""
        kind = content_type if content_type is not None else _guess_type(name)
        extra = {"duration_secs": duration_secs, "waveform": waveform}
        aid = self._next_id()
        self._files[aid] = _Stored(
            data, name, kind, chunked, {k: v for k, v in extra.items() if v is not None}
        )
        return self._attachment_json(channel_id, aid, len(data) if size is None else size)

    def voice_attachment(
        self,
        channel_id: str,
        data: bytes,
        *,
        duration_secs: Any = 2.5,
        waveform: Any = None,
        size: int | None = None,
    ) -> Json:
        """The attachment of a voice message recorded in the app: ``voice-message.ogg``,
        audio/ogg, ``duration_secs`` and a ``waveform`` (a flat one, base64, by default)."""
        if waveform is None:
            waveform = base64.b64encode(bytes([128]) * 64).decode()
        return self.attachment(
            channel_id,
            "voice-message.ogg",
            data,
            content_type="audio/ogg",
            size=size,
            duration_secs=duration_secs,
            waveform=waveform,
        )

    def push_voice_message(
        self,
        channel_id: str,
        data: bytes,
        *,
        author_id: str,
        duration_secs: Any = 2.5,
        waveform: Any = None,
        size: int | None = None,
        **push: Any,
    ) -> str:
        """A voice message recorded in the app (flags VOICE_MESSAGE, no text, the one
        attachment of :meth:`voice_attachment`), dispatched like :meth:`push_message` (which
        takes ``push``); returns its id. ``message(id)["attachments"][0]`` is the attachment."""
        voice = self.voice_attachment(
            channel_id, data, duration_secs=duration_secs, waveform=waveform, size=size
        )
        flags = VOICE_MESSAGE | int(push.pop("flags", 0))
        return self.push_message(
            channel_id, "", author_id=author_id, attachments=[voice], flags=flags, **push
        )

    def delete_message(self, channel_id: str, message_id: str) -> None:
        """Somebody deleted the message: gone from history, MESSAGE_DELETE dispatched."""
        self.history[channel_id] = [m for m in self.history[channel_id] if m["id"] != message_id]
        event: Json = {"id": message_id, "channel_id": channel_id}
        if self._in_guild(channel_id):
            event["guild_id"] = self.guild_id
        self._dispatch("MESSAGE_DELETE", event)

    async def drop_gateway(self, code: int = 4000) -> None:
        """Close every gateway socket; 4000 is resumable, as after a network blip."""
        conns, self._conns = list(self._conns), set()
        await asyncio.gather(*(c.ws.close(code=code) for c in conns), return_exceptions=True)

    def user(self, user_id: str, *, bot: bool = False, name: str = "") -> Json:
        name = name or f"user{user_id[-4:]}"
        user = {"id": user_id, "username": name, "discriminator": "0", "global_name": None}
        return user | {"avatar": None, "bot": bot}

    def bot_user(self) -> Json:
        return self.user(self.bot_id, bot=True, name="geodebot")

    def push_message(
        self,
        channel_id: str,
        content: str,
        *,
        author_id: str,
        bot: bool = False,
        guild_id: str | None = _SAME_GUILD,
        mentions_bot: bool = False,
        message_id: str | None = None,
        attachments: list[Json] | None = None,
        flags: int = 0,
    ) -> str:
        """A message stored in history and dispatched as MESSAGE_CREATE; returns its id.

        ``guild_id`` defaults to the fake's guild for its channel and thread, else a DM.
        ``attachments``: objects from :meth:`attachment`. ``flags``: the message's flags
        (``VOICE_MESSAGE`` for a voice message).
        """
        if guild_id is _SAME_GUILD:
            guild_id = self.guild_id if self._in_guild(channel_id) else None
        author = self.bot_user() if author_id == self.bot_id else self.user(author_id, bot=bot)
        mentions = [self.bot_user()] if mentions_bot else []
        msg = self._store(
            channel_id,
            guild_id,
            author,
            content,
            mentions=mentions,
            mid=message_id,
            attachments=attachments,
            flags=flags,
        )
        event = dict(msg)
        blind = self.intents is not None and not self.intents & MESSAGE_CONTENT_INTENT
        if blind and guild_id and not mentions_bot and author_id != self.bot_id:
            event["content"] = ""
        self._dispatch("MESSAGE_CREATE", event)
        return str(msg["id"])

    def push_interaction(self, channel_id: str, name: str, *, user_id: str) -> str:
        """The slash command ``/name`` used in ``channel_id``; returns the interaction id."""
        inner = {"id": self._next_id(), "name": name, "type": 1}
        return self._push_interaction(channel_id, user_id, {"type": 2, "data": inner})

    def push_press(self, message_id: str, custom_id: str, *, user_id: str) -> str:
        """``user_id`` presses the button ``custom_id`` on the stored message ``message_id``
        (any custom_id: a forged one too); returns the interaction id."""
        msg = self.message(message_id)
        inner = {"custom_id": custom_id, "component_type": 2}
        event = {"type": 3, "data": inner, "message": dict(msg)}
        return self._push_interaction(msg["channel_id"], user_id, event)

    def message(self, message_id: str) -> Json:
        """The stored message as it is now (edits applied); KeyError if there is none."""
        for msgs in self.history.values():
            for msg in msgs:
                if msg["id"] == message_id:
                    return msg
        raise KeyError(message_id)

    async def wait_callback(self, interaction_id: str, within: float = 5.0) -> Json:
        """The interaction's response once the client sent it: ``{"type", "data", "flags"}``."""
        return await self._wait(lambda: self.responses.get(interaction_id), within)

    async def wait_followup(self, interaction_id: str, within: float = 5.0) -> Json:
        """The interaction's first followup body (``content``, ``flags``, ...) once sent."""
        return await self._wait(lambda: next(iter(self.followups[interaction_id]), None), within)

    # ---- internals -------------------------------------------------------------------------

    async def _wait(self, probe: Callable[[], Json | None], within: float) -> Json:
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: probe() is not None)
            found = probe()
        assert found is not None
        return found

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _push_interaction(self, channel_id: str, user_id: str, event: Json) -> str:
        iid, token = self._next_id(), "itok-" + secrets.token_hex(8)
        self._interactions[token] = (iid, channel_id)
        data: Json = event | {
            "id": iid,
            "application_id": self.app_id,
            "channel_id": channel_id,
            "channel": self._channel(channel_id, user_id),
            "token": token,
            "version": 1,
            "app_permissions": "0",
            "attachment_size_limit": 8_388_608,
            "context": 0 if self._in_guild(channel_id) else 1,
        }
        if self._in_guild(channel_id):
            member = {"user": self.user(user_id), "roles": [], "joined_at": _now(), "flags": 0}
            data |= {"guild_id": self.guild_id, "member": member | {"permissions": "0"}}
        else:
            data["user"] = self.user(user_id)
        self._dispatch("INTERACTION_CREATE", data)
        return iid

    def _in_guild(self, channel_id: str) -> bool:
        return channel_id in (self.channel_id, self.thread_id)

    def _signature(self, aid: str, expires: str, issued: str) -> str:
        message = f"{aid}:{expires}:{issued}".encode()
        return hmac.new(self._cdn_key, message, hashlib.sha256).hexdigest()

    def _attachment_json(self, channel_id: str, aid: str, size: int) -> Json:
        stored = self._files[aid]
        issued = f"{int(time.time()):x}"
        expires = f"{int(time.time()) + 86_400:x}"
        path = f"/attachments/{channel_id}/{aid}/{quote(stored.name, safe='')}"
        query = f"?ex={expires}&is={issued}&hm={self._signature(aid, expires, issued)}&"
        attachment: Json = {
            "id": aid,
            "filename": stored.name,
            "size": size,
            "url": self.cdn_url + path + query,
            "proxy_url": self.cdn_url + "/media" + path + query,
        }
        if stored.content_type:  # Discord leaves out a type it does not know
            attachment["content_type"] = stored.content_type
        return attachment | stored.extra

    def _next_id(self) -> str:
        snow = (int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22 | next(self._counter) % 4096
        self._last_id = max(self._last_id + 1, snow)
        return str(self._last_id)

    def _store(
        self, cid: str, guild_id: str | None, author: Json, content: str, **extra: Any
    ) -> Json:
        msg: Json = {
            "id": extra.get("mid") or self._next_id(),
            "channel_id": cid,
            "author": author,
            "content": content,
            "timestamp": _now(),
            "edited_timestamp": None,
            "mentions": extra.get("mentions") or [],
            "mention_roles": [],
            "attachments": list(extra.get("attachments") or []),
            "embeds": [],
            "type": 19 if extra.get("reference") else 0,
            "components": extra.get("components") or [],
            "flags": int(extra.get("flags") or 0),
        }
        if guild_id:
            msg["guild_id"] = guild_id
        if extra.get("nonce") is not None:
            msg["nonce"] = extra["nonce"]
        if extra.get("reference"):
            msg["message_reference"] = extra["reference"]
        self.history[cid].append(msg)
        self._created[msg["id"]] = time.monotonic()
        self.revisions[msg["id"]].append(Revision(content, self._created[msg["id"]]))
        return msg

    def _dispatch(self, event: str, data: Json) -> None:
        for session in self._sessions.values():
            session.seq += 1
            payload = {"op": 0, "t": event, "s": session.seq, "d": data}
            session.events.append(payload)
            for conn in [c for c in self._conns if c.session is session]:
                task = asyncio.get_running_loop().create_task(self._send_quietly(conn, payload))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _send_quietly(self, conn: _Conn, payload: Json) -> None:
        # A socket closing under a dispatch loses the event, which RESUME replays.
        with contextlib.suppress(ConnectionError, RuntimeError):
            await conn.send(payload)

    def _channel(self, channel_id: str, peer_id: str) -> Json:
        guild = self._guild()
        for chan in guild["channels"] + guild["threads"]:
            if chan["id"] == channel_id:
                return dict(chan)
        return {"id": channel_id, "type": 1, "recipients": [self.user(peer_id)]}

    def _guild(self) -> Json:
        g = self.guild_id
        base: Json = {"guild_id": g, "permission_overwrites": [], "nsfw": False, "position": 0}
        channel = base | {"id": self.channel_id, "type": 0, "name": "ops", "parent_id": None}
        thread = base | {"id": self.thread_id, "type": 11, "name": "incident"}
        thread |= {"parent_id": self.channel_id, "owner_id": "1", "message_count": 0}
        thread |= {"member_count": 1, "rate_limit_per_user": 0}
        meta = {"archived": False, "locked": False, "auto_archive_duration": 1440}
        thread["thread_metadata"] = meta | {"archive_timestamp": _now()}
        everyone: Json = {
            "id": g,
            "name": "@everyone",
            "permissions": "0",
            "position": 0,
            "color": 0,
        }
        everyone |= {"hoist": False, "managed": False, "mentionable": False}
        return {
            "id": g,
            "name": "fake guild",
            "icon": None,
            "owner_id": "900000000000000099",
            "roles": [everyone],
            "emojis": [],
            "stickers": [],
            "features": [],
            "member_count": 2,
            "members": [],
            "channels": [channel],
            "threads": [thread],
            "unavailable": False,
            "large": False,
            "joined_at": _now(),
        }

    # ---- REST ------------------------------------------------------------------------------

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # Interaction callbacks and webhooks authenticate by their token in the path;
        # attachment URLs are signed instead (the CDN takes no token).
        open_paths = (
            "/api/v10/interactions/",
            "/api/v10/webhooks/",
            "/gateway",
            "/attachments/",
            "/media/attachments/",
        )
        auth = request.headers.get("Authorization")
        if request.path.startswith(open_paths) or auth == f"Bot {self.token}":
            return await handler(request)
        return _error(401, 0, "401: Unauthorized")

    async def _me(self, request: web.Request) -> web.StreamResponse:
        return _json(self.bot_user() | {"verified": True, "mfa_enabled": False})

    async def _app_info(self, request: web.Request) -> web.StreamResponse:
        info: Json = {"id": self.app_id, "name": "geodebot", "description": "", "icon": None}
        info |= {"bot_public": False, "bot_require_code_grant": False, "flags": 0}
        return _json(info | {"owner": self.user("900000000000000099"), "verify_key": "0" * 64})

    async def _gateway_info(self, request: web.Request) -> web.StreamResponse:
        limit = {"total": 1000, "remaining": 999, "reset_after": 0, "max_concurrency": 1}
        return _json({"url": self.gateway_url, "shards": 1, "session_start_limit": limit})

    async def _get_channel(self, request: web.Request) -> web.StreamResponse:
        return _json(self._channel(request.match_info["cid"], "1"))

    async def _create_message(self, request: web.Request) -> web.StreamResponse:
        cid = request.match_info["cid"]
        body, files = await _message_body(request)
        if sum(len(data) for _, data, _ in files) > self.upload_limit:
            return _error(413, 40005, "Request entity too large")
        failure = self._failures.pop(0) if self._failures else None
        if failure is not None and not failure[2]:
            return await _failure(request, failure[0], failure[1])
        content, nonce = str(body.get("content") or ""), body.get("nonce")
        if len(content) > 2000:
            return _error(400, 50035, "Invalid Form Body")
        seen = self._nonces.get((cid, str(nonce))) if body.get("enforce_nonce") else None
        if seen and time.monotonic() - seen[0] < self.nonce_window_s:
            msg = seen[1]
        else:
            ref = body.get("message_reference")
            if ref:  # clients may send ids as numbers; Discord answers with strings
                ref = {k: str(v) if k.endswith("_id") else v for k, v in ref.items()}
            guild = self.guild_id if self._in_guild(cid) else None
            components, flags = body.get("components") or [], int(body.get("flags") or 0)
            attachments = []
            for name, data, _ in files:
                aid = self._next_id()
                self._files[aid] = _Stored(data, name, _guess_type(name))
                attachments.append(self._attachment_json(cid, aid, len(data)))
            msg = self._store(
                cid,
                guild,
                self.bot_user(),
                content,
                nonce=nonce,
                reference=ref,
                components=components,
                flags=flags,
                attachments=attachments,
            )
            self.posted[cid].append(
                {"id": msg["id"], "content": content, "nonce": nonce, "message_reference": ref}
                | {"allowed_mentions": body.get("allowed_mentions")}
                | {"components": components, "flags": flags, "attachments": attachments}
            )
            caption = body.get("content")
            for name, data, sent_type in files:
                self.uploads.append(
                    Upload(
                        cid,
                        msg["id"],
                        name,
                        data,
                        caption,
                        _text(nonce),
                        ref or None,
                        content_type=_guess_type(name),
                        sent_type=sent_type,
                    )
                )
            if nonce is not None:
                self._nonces[(cid, str(nonce))] = (time.monotonic(), msg)
            self._dispatch("MESSAGE_CREATE", msg)
        if failure is not None:
            return await _failure(request, failure[0], failure[1])
        return _json(msg)

    async def _list_messages(self, request: web.Request) -> web.StreamResponse:
        q, now = request.query, time.monotonic()
        limit = min(int(q.get("limit", "50")), 100)
        msgs = sorted(self.history[request.match_info["cid"]], key=lambda m: int(m["id"]))
        if "after" in q:  # the oldest ``limit`` after it, like Discord
            msgs = [m for m in msgs if int(m["id"]) > int(q["after"])][:limit]
        else:
            before = int(q.get("before", 1 << 64))
            msgs = [m for m in msgs if int(m["id"]) < before][-limit:]
        shown = [dict(m) for m in reversed(msgs)]
        for m in shown:
            if now - self._created[m["id"]] > self.nonce_visible_s:
                m.pop("nonce", None)
        return _json(shown)

    async def _delete_message(self, request: web.Request) -> web.StreamResponse:
        cid, mid = request.match_info["cid"], request.match_info["mid"]
        msg = next((m for m in self.history[cid] if m["id"] == mid), None)
        if msg is None:
            return _error(404, 10008, "Unknown Message")
        if msg["author"]["id"] != self.bot_id:
            return _error(403, 50013, "Missing Permissions")
        self.deleted.append(mid)
        self.delete_message(cid, mid)
        return web.Response(status=204)

    async def _edit_message(self, request: web.Request) -> web.StreamResponse:
        cid, mid = request.match_info["cid"], request.match_info["mid"]
        if self._edit_failures:  # Discord checks the rate limit before the message
            self.limited_edits.append(mid)
            return await _failure(request, 429, self._edit_failures.pop(0))
        msg = next((m for m in self.history[cid] if m["id"] == mid), None)
        if msg is None:
            return _error(404, 10008, "Unknown Message")
        if msg["author"]["id"] != self.bot_id:
            return _error(403, 50005, "Cannot edit a message authored by another user")
        body = await request.json()
        if len(str(body.get("content") or "")) > 2000:
            return _error(400, 50035, "Invalid Form Body")
        for key in ("content", "components", "flags"):
            if key in body:  # fields left out stay as they were, like Discord
                msg[key] = body[key] if key != "flags" else int(body[key] or 0)
        msg["edited_timestamp"] = _now()
        self.edits.append({"id": mid, "channel_id": cid, "body": body})
        self.revisions[mid].append(Revision(str(msg.get("content") or ""), time.monotonic()))
        self._dispatch("MESSAGE_UPDATE", dict(msg))
        return _json(msg)

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        self.cdn_authorization.append(request.headers.get("Authorization"))
        aid, q = request.match_info["aid"], request.query
        stored = self._files.get(aid)
        signed = self._signature(aid, q.get("ex", ""), q.get("is", ""))
        if stored is None or not hmac.compare_digest(signed, q.get("hm", "")):
            # What Discord's CDN says for an unsigned, expired or unknown attachment URL.
            return web.Response(status=404, text="This content is no longer available.")
        self.downloads[aid] += 1
        headers = {"Content-Type": stored.content_type or "application/octet-stream"}
        if not stored.chunked:
            return web.Response(body=stored.data, headers=headers)
        response = web.StreamResponse(headers=headers)
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(stored.data), 16 * 1024):
            await response.write(stored.data[start : start + 16 * 1024])
        await response.write_eof()
        return response

    async def _typing(self, request: web.Request) -> web.StreamResponse:
        self.typing.append(request.match_info["cid"])
        return web.Response(status=204)

    async def _put_commands(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.commands.append(body)
        extra = {"application_id": request.match_info["app"], "version": "1"}
        return _json([c | extra | {"id": self._next_id()} for c in body])

    async def _callback(self, request: web.Request) -> web.StreamResponse:
        iid, token = request.match_info["iid"], request.match_info["tok"]
        if self._interactions.get(token, ("",))[0] != iid:
            return _error(404, 10062, "Unknown interaction")
        if iid in self.responses:
            return _error(400, 40060, "Interaction has already been acknowledged.")
        body = await request.json()
        data = body.get("data")
        flags = int((data or {}).get("flags") or 0)
        self.responses[iid] = {"type": int(body["type"]), "data": data, "flags": flags}
        self.callbacks.append((iid, int(body["type"])))
        await self._notify()
        return web.Response(status=204)

    async def _followup(self, request: web.Request) -> web.StreamResponse:
        known = self._interactions.get(request.match_info["tok"])
        if request.match_info["app"] != self.app_id or known is None:
            return _error(404, 10015, "Unknown Webhook")
        if known[0] not in self.responses:  # a followup needs the interaction answered first
            return _error(404, 10015, "Unknown Webhook")
        body = await request.json()
        content, flags = str(body.get("content") or ""), int(body.get("flags") or 0)
        guild = self.guild_id if self._in_guild(known[1]) else None
        if flags & EPHEMERAL:  # only the presser sees it: not in the channel's history
            msg: Json = {"id": self._next_id(), "channel_id": known[1], "content": content}
            msg |= {"author": self.bot_user(), "timestamp": _now(), "flags": flags, "type": 0}
            msg |= {"mentions": [], "attachments": [], "embeds": [], "edited_timestamp": None}
        else:
            msg = self._store(known[1], guild, self.bot_user(), content)
            self.posted[known[1]].append({"id": msg["id"], "content": content})
            self._dispatch("MESSAGE_CREATE", msg)
        self.followups[known[0]].append(body)
        await self._notify()
        return _json(msg)

    async def _edit_original(self, request: web.Request) -> web.StreamResponse:
        known = self._interactions.get(request.match_info["tok"])
        if known is None:
            return _error(404, 10015, "Unknown Webhook")
        content = str((await request.json()).get("content") or "")
        self.interaction_replies[known[0]] = content
        msg = {"id": known[0], "channel_id": known[1], "content": content, "type": 20}
        return _json(msg | {"author": self.bot_user(), "timestamp": _now(), "mentions": []})

    # ---- gateway ---------------------------------------------------------------------------

    async def _gateway(self, request: web.Request) -> web.StreamResponse:
        self.gateway_connects += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        kind = request.query.get("compress")
        try:
            conn = _Conn(ws, _compressor(kind) if kind else None)
        except (ValueError, ImportError):
            await ws.close(code=4000, message=b"unsupported compression")
            return ws
        await conn.send({"op": 10, "d": {"heartbeat_interval": 41_250}})
        async for msg in ws:
            if msg.type is WSMsgType.TEXT:
                frame = json.loads(msg.data)
                op, data = frame.get("op"), frame.get("d")
                if op == 1:
                    await conn.send({"op": 11})
                elif op == 2:
                    await self._identify(conn, data)
                elif op == 6:
                    await self._resume(conn, data)
        self._conns.discard(conn)
        return ws

    async def _identify(self, conn: _Conn, data: Json) -> None:
        self.identify_count += 1
        refused = self.refuse_identifies > 0
        self.refuse_identifies -= refused
        if refused or data.get("token") != self.token:
            await conn.ws.close(code=4004, message=b"Authentication failed.")
            return
        self.intents = int(data.get("intents") or 0)
        session = conn.session = _Session(secrets.token_hex(16))
        self._sessions[session.session_id] = session
        self._conns.add(conn)
        ready = {
            "v": 10,
            "user": self.bot_user() | {"verified": True, "mfa_enabled": False},
            "guilds": [{"id": self.guild_id, "unavailable": True}],
            "session_id": session.session_id,
            "resume_gateway_url": self.gateway_url,
            "application": {"id": self.app_id, "flags": 0},
        }
        for event, payload in (("READY", ready), ("GUILD_CREATE", self._guild())):
            session.seq += 1
            session.events.append({"op": 0, "t": event, "s": session.seq, "d": payload})
            await conn.send(session.events[-1])

    async def _resume(self, conn: _Conn, data: Json) -> None:
        self.resume_count += 1
        session = self._sessions.get(str(data.get("session_id")))
        if session is None or data.get("token") != self.token:
            await conn.send({"op": 9, "d": False})
            return
        conn.session = session
        self._conns.add(conn)
        for frame in [e for e in session.events if e["s"] > int(data.get("seq") or 0)]:
            await conn.send(frame)
        session.seq += 1
        await conn.send({"op": 0, "t": "RESUMED", "s": session.seq, "d": {}})


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    # Exactly "application/json": discord.py parses nothing else (aiohttp would add a charset).
    headers = {**(headers or {}), "Content-Type": "application/json"}
    return web.Response(body=json.dumps(data).encode(), status=status, headers=headers)


# Types Discord gives that Python knows only from the host's mime.types, which a test host
# may lack: the fake's answer must not depend on it.
_KNOWN_TYPES = {".ogg": "audio/ogg"}


def _guess_type(name: str) -> str:
    suffix = name[name.rfind(".") :].lower() if "." in name else ""
    return _KNOWN_TYPES.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


async def _message_body(request: web.Request) -> tuple[Json, list[tuple[str, bytes, str]]]:
    """A message create's JSON body, and its files (name, bytes, the part's Content-Type)
    when it came as multipart: ``payload_json`` carries the JSON, ``files[n]`` the files
    (discord.py's field names)."""
    if request.content_type != "multipart/form-data":
        return await request.json(), []
    form = await request.post()
    body = json.loads(str(form["payload_json"]))
    files = []
    for key, value in form.items():
        if key.startswith("files[") and isinstance(value, web.FileField):
            files.append((value.filename, value.file.read(), value.content_type))
    return body, files


def _error(status: int, code: int, message: str) -> web.Response:
    return _json({"message": message, "code": code}, status=status)


async def _failure(request: web.Request, status: int, retry_after: float | None) -> web.Response:
    if status == 0:  # the request arrived; its answer never makes it back
        assert request.transport is not None
        request.transport.close()
        return web.Response(status=500)
    if status != 429:
        return _error(status, 0, f"{status}: fake failure")
    wait = 1.0 if retry_after is None else retry_after
    headers = {
        "Retry-After": str(max(1, round(wait))),
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": f"{time.time() + wait:.3f}",
        "X-RateLimit-Reset-After": f"{wait:.3f}",
        "X-RateLimit-Bucket": "fakebucket",
        "X-RateLimit-Scope": "user",
        "Via": "1.1 google",
    }
    body = {"message": "You are being rate limited.", "retry_after": wait, "global": False}
    return _json(body, status=429, headers=headers)
