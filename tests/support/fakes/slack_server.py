"""A fake Slack (Web API + Socket Mode) on 127.0.0.1, for tests that run the real SDKs.

Point ``AsyncWebClient(base_url=fake.api_base_url)`` at it. ``apps.connections.open`` hands out
``ws://127.0.0.1:PORT/socket?ticket=..``, so slack_sdk's Socket Mode client connects here too.

* Web API: ``POST|GET {root}/api/<method>``; arguments from the query string, a form body or a
  JSON body, like Slack. ``Authorization: Bearer`` must carry the bot token (the app token for
  ``apps.connections.open``), else ``invalid_auth``. Every call lands in ``calls``.
* ``chat.postMessage`` keeps messages per channel (``posted``, and the channel history that
  ``conversations.history`` / ``conversations.replies`` read). Metadata is returned only with
  ``include_all_metadata``, as Slack does.
* ``fail(method, ...)`` queues a :class:`Fault` for the next call(s) of a method: an error code,
  an HTTP status with ``Retry-After``, a delay, or a dropped connection (optionally after the
  message was stored: the "did it arrive?" case).
* ``chat.postMessage`` keeps ``blocks`` too; ``chat.update`` replaces a message's text (and its
  blocks, when given: an empty list or blocks without an actions block remove the buttons;
  metadata, when given). Its ``parse`` defaults to ``client``, unlike chat.postMessage's: as
  Slack does then, a ``<`` or ``>`` in the new text is stored escaped (a link or mention
  written ``<...>`` becomes plain text) unless the call says ``parse=none``. Every text a
  message showed is kept, with when (``Posted.texts`` / ``Posted.shown_at``), so a test can
  tell "one message, edited N times, final text X". ``delete_message`` deletes a message as a
  person would (chat.update then answers ``message_not_found``). ``fail_edits`` makes
  chat.update answer Slack's 429 (``ratelimited`` with ``Retry-After``) for a number of
  calls or for a while;
  ``chat.postEphemeral`` lands in ``ephemeral`` (only that user would see it). ``message``
  and ``buttons`` read a stored message; ``wait_until`` waits for any condition on the fake.
* Socket Mode: ``hello`` on connect; ``push_event`` sends an ``events_api`` envelope and the
  client's ``{"envelope_id"}`` answer is recorded (``acks``, ``wait_for_ack``).
  ``push_action`` presses a button of a stored message: an ``interactive`` envelope with a
  ``block_actions`` payload, as Slack sends it for Block Kit buttons.
  ``disconnect_clients`` closes the sockets; ``send_disconnect`` asks for a refresh.
* Files in: ``add_file`` keeps a file's bytes and returns its Slack file object, whose
  ``url_private`` / ``url_private_download`` point here (``/files-pri/<team>-<id>/...``);
  ``file_message_event`` wraps such objects in a ``file_share`` message. A file's URL answers
  only the bot token in ``Authorization: Bearer``; any other request gets Slack's HTML sign-in
  page with status 200, as does every request while ``files_readable`` is off (a token
  without ``files:read``). Every request for a file is counted (``downloads``) and kept with
  the token it carried (``file_requests``). A file's declared ``size`` may differ from its
  bytes (an oversized file needs no big bytes); ``chunked`` serves it without a
  Content-Length. Audio: ``add_audio_clip`` (``add_file`` with ``subtype="slack_audio"``) is
  a clip recorded in Slack's app, listed with ``duration_ms`` and ``media_display_type:
  "audio"`` as Slack lists one; ``add_file(..., duration_ms=...)`` on an ``audio/...`` file
  is an uploaded one that announces its length. ``duration_ms`` goes into the file object
  as given, so a test can send garbage.
* Files out: ``files.getUploadURLExternal`` hands out ``/upload/v1/<id>``, which takes the
  bytes (raw or as multipart, answered ``OK - <length>`` in text/plain as Slack does);
  ``files.completeUploadExternal`` shares the uploaded files: each share is an
  :class:`Upload` in ``uploads`` and a message in the channel (``posted``, with ``files``).
  Its answer lists the share's ts under ``shares`` unless ``upload_shares_in_answer`` is off
  (Slack shares asynchronously and often answers before). ``fail("upload", ...)`` makes the
  upload URL fail. No step takes a media type; like Slack, the fake types a shared file by
  its name (``Upload.filetype`` / ``Upload.mimetype``, ``answer.ogg`` -> ``ogg`` /
  ``audio/ogg``) and keeps the Content-Type the bytes were posted with
  (``Upload.content_type``); ``Upload.size`` is the length of the bytes received.
* Redelivery (``redeliver_after_s``): like Slack, an events envelope not acked within that
  time is sent again (``retry_attempt`` + 1, a new envelope id, the same event id), up to
  ``max_redeliveries`` times, over whichever socket is open then; with no socket open it
  waits for one. ``acked`` is true once any attempt was acked. Off by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import mimetypes
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

from aiohttp import BodyPartReader, WSMsgType, web

MAX_TEXT = 40_000
MAX_SECTION_TEXT = 3000  # Slack answers invalid_blocks for a longer section text
# How Slack types a shared file by its extension: (filetype, mimetype), the filetypes as
# api.slack.com/types/file names them. Fixed here for the types tests send, since the
# mimetypes module's answers depend on the machine's tables.
_FILE_TYPES = {
    "ogg": ("ogg", "audio/ogg"),
    "mp3": ("mp3", "audio/mpeg"),
    "m4a": ("m4a", "audio/mp4"),
    "wav": ("wav", "audio/wav"),
    "pdf": ("pdf", "application/pdf"),
    "png": ("png", "image/png"),
    "txt": ("text", "text/plain"),
}


@dataclass
class Fault:
    error: str | None = None  # Slack error code in an ok=false body
    status: int = 200
    retry_after: float | None = None
    delay: float = 0.0
    drop: bool = False  # cut the connection instead of answering
    after_commit: bool = False  # chat.postMessage: store the message before failing


@dataclass
class Call:
    method: str
    args: dict[str, Any]
    token: str


@dataclass
class Posted:
    channel: str
    ts: str
    text: str
    thread_ts: str | None
    metadata: dict[str, Any] | None
    blocks: list[dict[str, Any]] | None = None
    files: list[dict[str, Any]] | None = None  # a file share's files
    edits: int = 0  # chat.update calls on it; text and blocks are the latest
    # Every text it showed, the posted one first, and when each began (time.monotonic()).
    texts: list[str] = field(default_factory=list)
    shown_at: list[float] = field(default_factory=list)
    deleted: bool = False

    def __post_init__(self) -> None:
        if not self.texts:
            self.texts.append(self.text)
            self.shown_at.append(time.monotonic())


@dataclass
class StoredFile:
    """A file a user shared, as the fake serves it."""

    id: str
    name: str
    data: bytes
    mimetype: str
    size: int  # as declared in events (may differ from len(data))
    chunked: bool = False  # served without a Content-Length
    redirect_to: str | None = None  # answered with a 302 to there instead


@dataclass
class FileRequest:
    file_id: str
    token: str  # the bearer token it carried ("" none)


@dataclass
class Upload:
    """One file shared through files.completeUploadExternal."""

    file_id: str
    name: str  # filename given to files.getUploadURLExternal
    title: str
    data: bytes
    channel: str
    thread_ts: str | None
    initial_comment: str | None
    ts: str  # the share's message
    filetype: str = "binary"  # as Slack types it by its name
    mimetype: str = "application/octet-stream"  # likewise
    content_type: str = ""  # of the POST (or multipart part) that carried the bytes

    @property
    def size(self) -> int:
        """The length of the bytes received."""
        return len(self.data)


@dataclass
class _PendingUpload:
    name: str
    length: int
    data: bytes | None = None
    content_type: str = ""


SIGN_IN_PAGE = "<!DOCTYPE html><html><head><title>Slack</title></head><body>Sign in</body></html>"


@dataclass
class Ephemeral:
    channel: str
    user: str  # the only one who sees it
    text: str
    thread_ts: str | None
    blocks: list[dict[str, Any]] | None = None


@dataclass
class Ack:
    envelope_id: str
    at: float  # time.monotonic()
    payload: Any = None


@dataclass
class _EditLimit:
    """chat.update answers 429 while ``left`` calls remain and ``until`` has not passed."""

    left: float
    until: float  # time.monotonic()
    retry_after: float


@dataclass
class _Envelope:
    ack: Ack | None = None
    acked: asyncio.Event = field(default_factory=asyncio.Event)
    attempts: int = 1


class FakeSlack:
    def __init__(
        self,
        *,
        bot_token: str = "xoxb-fake-0000000000-bot-token-for-tests",
        app_token: str = "xapp-1-fake-app-token-for-tests-0000000000",
        bot_user_id: str = "UBOT00001",
        bot_id: str = "BBOT00001",
        team_id: str = "TFAKE0001",
        redeliver_after_s: float | None = None,
        max_redeliveries: int = 3,
        spread: bool = False,
    ) -> None:
        self.bot_token = bot_token
        self.app_token = app_token
        self.bot_user_id = bot_user_id
        self.bot_id = bot_id
        self.team_id = team_id
        self.calls: list[Call] = []
        self.posted: dict[str, list[Posted]] = defaultdict(list)
        self.ephemeral: list[Ephemeral] = []
        self.acks: dict[str, Ack] = {}
        self.connections = 0  # websockets accepted so far
        self.files: dict[str, StoredFile] = {}
        self.downloads: Counter[str] = Counter()  # requests per file id, whatever the answer
        self.file_requests: list[FileRequest] = []
        self.files_readable = True
        self.uploads: list[Upload] = []
        self.upload_posts = 0  # requests to upload URLs
        self.upload_shares_in_answer = True
        self._pending_uploads: dict[str, _PendingUpload] = {}
        self._file_ids = itertools.count(1)
        self.redeliver_after_s = redeliver_after_s
        self.max_redeliveries = max_redeliveries
        # As Slack does with an app's several Socket Mode connections: each envelope goes to
        # the next open one in turn. Off: the newest open connection gets everything.
        self.spread = spread
        self._turn = 0
        self._redeliveries: set[asyncio.Task[None]] = set()
        self._history: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._faults: dict[str, deque[Fault]] = defaultdict(deque)
        self._edit_limit: _EditLimit | None = None
        self._limited_edits = 0
        self._tickets: set[str] = set()
        self._sockets: list[web.WebSocketResponse] = []
        self._requests: dict[web.WebSocketResponse, web.Request] = {}
        self._envelopes: dict[str, _Envelope] = {}
        self._event_ids = itertools.count(1)
        self._last_ts = 0.0
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._port = 0

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def api_base_url(self) -> str:
        return f"{self.root}/api/"

    async def start(self) -> Self:
        app = web.Application()
        app.router.add_route("*", "/api/{method}", self._api)
        app.router.add_get("/socket", self._socket)
        app.router.add_get("/files-pri/{team_file}/{rest:.+}", self._file)
        app.router.add_post("/upload/v1/{file_id}", self._upload)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._port = runner.addresses[0][1]
        self._runner = runner
        return self

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for task in list(self._redeliveries):
            task.cancel()
        await asyncio.gather(*self._redeliveries, return_exceptions=True)
        await self.disconnect_clients()
        await runner.cleanup()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- test controls ----------------------------------------------------------------------
    def fail(self, method: str, fault: Fault | None = None, *, times: int = 1, **kw: Any) -> None:
        """The next ``times`` calls of ``method`` get ``fault`` (or ``Fault(**kw)``)."""
        for _ in range(times):
            self._faults[method].append(fault or Fault(**kw))

    def fail_edits(
        self, count: int | None = None, retry_after: float = 1.0, *, for_s: float | None = None
    ) -> None:
        """chat.update answers 429 ``ratelimited`` with ``Retry-After: retry_after``, as Slack
        does for a method over its rate tier: the next ``count`` calls, or every call for the
        next ``for_s`` seconds (both given: whichever ends first). Without either: one call;
        ``fail_edits(0)`` ends it."""
        if count is None and for_s is None:
            count = 1
        self._edit_limit = _EditLimit(
            left=float("inf") if count is None else count,
            until=time.monotonic() + (float("inf") if for_s is None else for_s),
            retry_after=retry_after,
        )

    def edits_limited(self) -> int:
        """How many chat.update calls were answered 429 so far."""
        return self._limited_edits

    def delete_message(self, channel: str, ts: str) -> None:
        """A person deletes a message: it leaves the history; ``Posted.deleted`` is set."""
        self._history[channel] = [m for m in self._history[channel] if m["ts"] != ts]
        for posted in self.posted[channel]:
            if posted.ts == ts:
                posted.deleted = True

    def calls_to(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    @property
    def open_sockets(self) -> int:
        return sum(1 for ws in self._sockets if not ws.closed)

    # Waits take a timeout (ASYNC109) so that a broken adapter fails a test instead of hanging it.
    async def wait_for_connections(self, count: int, timeout: float = 5.0) -> None:
        """Until ``count`` websockets were accepted in total and one of them is open."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self.connections >= count and self.open_sockets)

    async def wait_for_no_sockets(self, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self.open_sockets == 0)

    async def wait_until(self, check: Callable[[], bool], timeout: float = 5.0) -> None:
        """Until ``check()`` holds; it is tried again after every Web API call and socket
        change (a post, an update, an ephemeral message, an ack)."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(check)

    async def wait_for_ephemeral(self, count: int, timeout: float = 5.0) -> list[Ephemeral]:
        """Until ``count`` ephemeral messages were posted in total; all of them."""
        await self.wait_until(lambda: len(self.ephemeral) >= count, timeout)
        return list(self.ephemeral)

    def message(self, channel: str, ts: str) -> dict[str, Any] | None:
        """The stored message ``ts`` of ``channel`` as conversations.history returns it."""
        return next((m for m in self._history.get(channel, []) if m["ts"] == ts), None)

    def buttons(self, channel: str, ts: str) -> list[dict[str, Any]]:
        """The button elements of a stored message's actions blocks, in order."""
        message = self.message(channel, ts) or {}
        return [
            element
            for block in message.get("blocks") or []
            if block.get("type") == "actions"
            for element in block.get("elements") or []
            if element.get("type") == "button"
        ]

    async def disconnect_clients(self, *, abort: bool = False) -> None:
        """Close every socket; ``abort`` cuts the TCP connection without a close frame."""
        sockets, self._sockets = self._sockets, []
        for ws in sockets:
            request = self._requests.pop(ws, None)
            with contextlib.suppress(Exception):
                if abort and request is not None and request.transport is not None:
                    request.transport.abort()
                else:
                    await ws.close(code=1001, message=b"going away")

    async def send_disconnect(self, reason: str = "refresh_requested") -> None:
        await self._send({"type": "disconnect", "reason": reason, "debug_info": {"host": "fake"}})

    @staticmethod
    def message_event(
        channel: str,
        user: str,
        text: str,
        *,
        ts: str | None = None,
        thread_ts: str | None = None,
        bot_id: str | None = None,
        subtype: str | None = None,
        channel_type: str = "channel",
    ) -> dict[str, Any]:
        event: dict[str, Any] = {
            "type": "message",
            "channel": channel,
            "user": user,
            "text": text,
            "ts": ts or f"{time.time():.6f}",
            "event_ts": ts or f"{time.time():.6f}",
            "channel_type": channel_type,
        }
        if thread_ts is not None:
            event["thread_ts"] = thread_ts
        if bot_id is not None:
            event["bot_id"] = bot_id
        if subtype is not None:
            event["subtype"] = subtype
        return event

    def add_file(
        self,
        data: bytes,
        name: str,
        mimetype: str,
        *,
        size: int | None = None,
        chunked: bool = False,
        redirect_to: str | None = None,
        subtype: str | None = None,
        duration_ms: Any = None,
        media_display_type: str | None = None,
    ) -> dict[str, Any]:
        """Keep a file a user shares; its Slack file object (as in a message event).
        ``size`` is what the object declares (default: the length of ``data``);
        ``redirect_to`` answers an authorised request with a redirect there.
        ``subtype`` (``slack_audio``: a clip recorded in Slack, which then has
        ``media_display_type: "audio"`` unless another is given), ``duration_ms`` and
        ``media_display_type`` are listed when given, ``duration_ms`` as it is."""
        file_id = f"F{next(self._file_ids):010d}"
        declared = len(data) if size is None else size
        self.files[file_id] = StoredFile(
            file_id, name, data, mimetype, declared, chunked, redirect_to
        )
        base = f"{self.root}/files-pri/{self.team_id}-{file_id}"
        file: dict[str, Any] = {
            "id": file_id,
            "created": int(time.time()),
            "timestamp": int(time.time()),
            "name": name,
            "title": name,
            "mimetype": mimetype,
            "filetype": name.rpartition(".")[2] if "." in name else "binary",
            "pretty_type": mimetype,
            "user": "",
            "mode": "hosted",
            "editable": False,
            "is_external": False,
            "external_type": "",
            "is_public": True,
            "public_url_shared": False,
            "display_as_bot": False,
            "size": declared,
            "url_private": f"{base}/{quote(name)}",
            "url_private_download": f"{base}/download/{quote(name)}",
            "permalink": f"https://fake.slack.com/files/U0/{file_id}/{quote(name)}",
        }
        if subtype == "slack_audio" and media_display_type is None:
            media_display_type = "audio"
        if subtype is not None:
            file["subtype"] = subtype
        if duration_ms is not None:
            file["duration_ms"] = duration_ms
        if media_display_type is not None:
            file["media_display_type"] = media_display_type
        return file

    def add_audio_clip(
        self,
        data: bytes,
        duration_ms: Any,
        *,
        name: str = "audio_message.webm",
        mimetype: str = "audio/webm",
        **kw: Any,
    ) -> dict[str, Any]:
        """An audio clip a user recorded in Slack's app (a voice note): ``add_file`` with
        ``subtype="slack_audio"``, by default named and typed as a clip from Slack's
        web client has been seen to be (a phone's is ``audio_message.m4a``, ``audio/mp4``)."""
        return self.add_file(
            data, name, mimetype, subtype="slack_audio", duration_ms=duration_ms, **kw
        )

    @staticmethod
    def file_message_event(
        channel: str,
        user: str,
        text: str,
        files: list[dict[str, Any]],
        *,
        ts: str | None = None,
        thread_ts: str | None = None,
        channel_type: str = "channel",
    ) -> dict[str, Any]:
        """A message sharing ``files`` (objects from ``add_file``), as Slack sends it."""
        event = FakeSlack.message_event(
            channel,
            user,
            text,
            ts=ts,
            thread_ts=thread_ts,
            subtype="file_share",
            channel_type=channel_type,
        )
        event["files"] = [dict(f, user=user) for f in files]
        event["upload"] = True
        event["display_as_bot"] = False
        return event

    def downloads_of(self, file: dict[str, Any]) -> int:
        """Requests so far for a file object's URLs."""
        return self.downloads[str(file["id"])]

    async def push_event(
        self, event: dict[str, Any], *, event_id: str | None = None, retry_attempt: int = 0
    ) -> str:
        """Deliver ``event`` over the newest open socket (each in turn with ``spread``);
        returns the envelope id."""
        event_id = event_id or f"Ev{next(self._event_ids):08d}"
        envelope_id = str(uuid.uuid4())
        if event.get("type") == "message" and "subtype" not in event:
            self._history[event["channel"]].append(dict(event))
        envelope = {
            "envelope_id": envelope_id,
            "type": "events_api",
            "accepts_response_payload": False,
            "retry_attempt": retry_attempt,
            "retry_reason": "timeout" if retry_attempt else "",
            "payload": {
                "token": "fake-verification-token",
                "team_id": self.team_id,
                "api_app_id": "AFAKE0001",
                "type": "event_callback",
                "event_id": event_id,
                "event_time": int(time.time()),
                "event": event,
                "authorizations": [
                    {"team_id": self.team_id, "user_id": self.bot_user_id, "is_bot": True}
                ],
            },
        }
        self._envelopes[envelope_id] = _Envelope()
        if self.redeliver_after_s is None:
            await self._send(envelope)
        else:
            task = asyncio.create_task(self._deliver_until_acked(envelope))
            self._redeliveries.add(task)
            task.add_done_callback(self._redeliveries.discard)
        return envelope_id

    async def _deliver_until_acked(self, frame: dict[str, Any]) -> None:
        assert self.redeliver_after_s is not None
        envelope = self._envelopes[frame["envelope_id"]]
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self.open_sockets > 0)
            ws = self._socket_for_next()
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(json.dumps(frame))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.redeliver_after_s):
                    await envelope.acked.wait()
                return
            if envelope.attempts > self.max_redeliveries:
                return  # Slack gives up on the event
            # A retry is a new envelope of the same event, as Slack sends it.
            frame = dict(frame, envelope_id=str(uuid.uuid4()), retry_attempt=envelope.attempts)
            frame["retry_reason"] = "timeout"
            envelope.attempts += 1
            self._envelopes[frame["envelope_id"]] = envelope

    async def push_command(
        self, command: str, text: str = "", *, channel: str, user: str, trigger_id: str = ""
    ) -> str:
        """Deliver a slash command as Socket Mode does (a ``slash_commands`` envelope)."""
        envelope_id = str(uuid.uuid4())
        envelope = {
            "envelope_id": envelope_id,
            "type": "slash_commands",
            "accepts_response_payload": True,
            "payload": {
                "token": "fake-verification-token",
                "team_id": self.team_id,
                "api_app_id": "AFAKE0001",
                "channel_id": channel,
                "user_id": user,
                "user_name": "someone",
                "command": command,
                "text": text,
                "response_url": f"{self.root}/commands/{envelope_id}",
                "trigger_id": trigger_id or f"{next(self._event_ids)}.{envelope_id[:8]}",
            },
        }
        self._envelopes[envelope_id] = _Envelope()
        await self._send(envelope)
        return envelope_id

    async def push_action(
        self,
        channel: str,
        message_ts: str,
        user: str,
        *,
        action_id: str | None = None,
        value: str | None = None,
        timeout: float = 5.0,
    ) -> Ack:
        """``user`` presses a button of the stored message ``message_ts``; waits for the ack.

        The button is the one with ``action_id`` (or, without one, the one whose value is
        ``value``); its value is sent unless ``value`` says otherwise (a forged payload).
        A button the message does not have (any more: an edited card) can still be pressed
        with both given, as a client showing the old message would.
        """
        message = self.message(channel, message_ts)
        if message is None:
            raise LookupError(f"no message {message_ts} in {channel}")
        button = next(
            (
                b
                for b in self.buttons(channel, message_ts)
                if b.get("action_id") == action_id or (action_id is None and b["value"] == value)
            ),
            None,
        )
        if button is None and (action_id is None or value is None):
            raise LookupError(f"message {message_ts} has no such button")
        action = dict(button or {"type": "button", "action_id": action_id})
        action.update(block_id="fake-block", action_ts=f"{time.time():.6f}")
        if value is not None:
            action["value"] = value
        envelope_id = str(uuid.uuid4())
        envelope = {
            "envelope_id": envelope_id,
            "type": "interactive",
            "accepts_response_payload": False,
            "payload": self._block_actions(channel, message, user, action, envelope_id),
        }
        self._envelopes[envelope_id] = _Envelope()
        await self._send(envelope)
        return await self.wait_for_ack(envelope_id, timeout)

    def _block_actions(
        self,
        channel: str,
        message: dict[str, Any],
        user: str,
        action: dict[str, Any],
        envelope_id: str,
    ) -> dict[str, Any]:
        container: dict[str, Any] = {
            "type": "message",
            "message_ts": message["ts"],
            "channel_id": channel,
            "is_ephemeral": False,
        }
        if message.get("thread_ts"):
            container["thread_ts"] = message["thread_ts"]
        return {
            "type": "block_actions",
            "user": {"id": user, "username": "someone", "name": "someone", "team_id": self.team_id},
            "api_app_id": "AFAKE0001",
            "token": "fake-verification-token",
            "container": container,
            "trigger_id": f"{next(self._event_ids)}.{envelope_id[:8]}",
            "team": {"id": self.team_id, "domain": "fake"},
            "enterprise": None,
            "is_enterprise_install": False,
            "channel": {"id": channel, "name": "fake-channel"},
            "message": dict(message),
            "state": {"values": {}},
            "response_url": f"{self.root}/actions/{envelope_id}",
            "actions": [action],
        }

    def acked(self, envelope_id: str) -> bool:
        envelope = self._envelopes.get(envelope_id)
        return envelope is not None and envelope.ack is not None

    async def wait_for_ack(self, envelope_id: str, timeout: float = 5.0) -> Ack:
        envelope = self._envelopes[envelope_id]
        async with asyncio.timeout(timeout):
            await envelope.acked.wait()
        assert envelope.ack is not None
        return envelope.ack

    # -- Socket Mode --------------------------------------------------------------------------
    async def _send(self, frame: dict[str, Any]) -> None:
        async with asyncio.timeout(5.0), self._changed:
            await self._changed.wait_for(lambda: self.open_sockets > 0)
        await self._socket_for_next().send_str(json.dumps(frame))

    def _socket_for_next(self) -> web.WebSocketResponse:
        sockets = [w for w in self._sockets if not w.closed]
        if not self.spread:
            return sockets[-1]
        self._turn += 1
        return sockets[self._turn % len(sockets)]

    async def _socket(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("ticket") not in self._tickets:
            return web.Response(status=401, text="invalid ticket")
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        hello = {
            "type": "hello",
            "num_connections": 1,
            "connection_info": {"app_id": "AFAKE0001"},
            "debug_info": {"host": "fake", "approximate_connection_time": 18060},
        }
        await ws.send_str(json.dumps(hello))
        async with self._changed:
            self._sockets.append(ws)
            self._requests[ws] = request
            self.connections += 1
            self._changed.notify_all()
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    self._record_ack(msg.data)
                    await self._notify()
        finally:
            self._requests.pop(ws, None)
            async with self._changed:
                self._changed.notify_all()
        return ws

    def _record_ack(self, data: str) -> None:
        with contextlib.suppress(ValueError):
            frame = json.loads(data)
            envelope = self._envelopes.get(frame.get("envelope_id", ""))
            if envelope is not None and envelope.ack is None:
                envelope.ack = Ack(frame["envelope_id"], time.monotonic(), frame.get("payload"))
                self.acks[envelope.ack.envelope_id] = envelope.ack
                envelope.acked.set()

    # -- files --------------------------------------------------------------------------------
    async def _file(self, request: web.Request) -> web.StreamResponse:
        _, _, file_id = request.match_info["team_file"].partition("-")
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
        self.downloads[file_id] += 1
        self.file_requests.append(FileRequest(file_id, token))
        await self._notify()
        stored = self.files.get(file_id)
        if token != self.bot_token or not self.files_readable:
            # Slack's answer to a request it will not serve a file to: its sign-in page.
            return web.Response(text=SIGN_IN_PAGE, content_type="text/html")
        if stored is None:
            return web.Response(status=404, text="file not found")
        if stored.redirect_to is not None:
            raise web.HTTPFound(stored.redirect_to)
        headers = {"Content-Disposition": f'attachment; filename="{quote(stored.name)}"'}
        if not stored.chunked:
            return web.Response(body=stored.data, content_type=stored.mimetype, headers=headers)
        response = web.StreamResponse(headers=headers)
        response.content_type = stored.mimetype
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(stored.data), 16 * 1024):
            await response.write(stored.data[start : start + 16 * 1024])
        await response.write_eof()
        return response

    async def _upload(self, request: web.Request) -> web.StreamResponse:
        self.upload_posts += 1
        file_id = request.match_info["file_id"]
        fault = self._faults["upload"].popleft() if self._faults["upload"] else None
        if fault is not None:
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.drop and request.transport is not None:
                request.transport.abort()
            headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after else {}
            status = fault.status if fault.status != 200 else 500
            return web.Response(status=status, text="upload failed", headers=headers)
        pending = self._pending_uploads.get(file_id)
        if pending is None:
            return web.Response(status=404, text="no such upload")
        content_type = request.headers.get("Content-Type", "")
        if request.content_type.startswith("multipart/"):
            reader = await request.multipart()
            data = b""
            async for field_ in reader:
                if isinstance(field_, BodyPartReader) and field_.filename is not None:
                    data = bytes(await field_.read())
                    content_type = field_.headers.get("Content-Type", "")
                    break
        else:
            data = await request.read()
        pending.data = data
        pending.content_type = content_type
        await self._notify()
        return web.Response(text=f"OK - {len(data)}", content_type="text/plain")

    def _m_files_getUploadURLExternal(self, args: dict[str, Any]) -> web.Response:
        name, length = str(args.get("filename") or ""), str(args.get("length") or "")
        if not name or not length.isdigit():
            return _error("invalid_arguments")
        file_id = f"F{next(self._file_ids):010d}"
        self._pending_uploads[file_id] = _PendingUpload(name, int(length))
        return _ok(upload_url=f"{self.root}/upload/v1/{file_id}", file_id=file_id)

    def _m_files_completeUploadExternal(self, args: dict[str, Any]) -> web.Response:
        try:
            listed = json.loads(str(args.get("files") or "[]"))
        except ValueError:
            return _error("invalid_arguments")
        channel = str(args.get("channel_id") or "")
        thread_ts = str(args.get("thread_ts") or "") or None
        comment = str(args.get("initial_comment") or "") or None
        if not listed:
            return _error("invalid_arguments")
        items: list[tuple[str, str, _PendingUpload]] = []
        for item in listed:
            pending = self._pending_uploads.get(str(item.get("id")))
            if pending is None or pending.data is None:
                return _error("file_not_found")
            items.append((str(item["id"]), str(item.get("title") or pending.name), pending))
        if not channel:
            return _ok(files=[{"id": fid, "title": title} for fid, title, _ in items])
        files: list[dict[str, Any]] = [
            {
                "id": fid,
                "name": p.name,
                "title": title,
                "filetype": _file_type(p.name)[0],
                "mimetype": _file_type(p.name)[1],
                "size": len(p.data or b""),
                "mode": "hosted",
            }
            for fid, title, p in items
        ]
        message = self._post(
            {"channel": channel, "text": comment or "", "thread_ts": thread_ts}, files=files
        )
        for (fid, title, pending), file in zip(items, files, strict=True):
            del self._pending_uploads[fid]
            self.uploads.append(
                Upload(
                    fid,
                    pending.name,
                    title,
                    pending.data or b"",
                    channel,
                    thread_ts,
                    comment,
                    message["ts"],
                    file["filetype"],
                    file["mimetype"],
                    pending.content_type,
                )
            )
        if self.upload_shares_in_answer:
            scope = "public" if channel.startswith("C") else "private"
            share = {"ts": message["ts"], "channel_name": "fake-channel", "team_id": self.team_id}
            if thread_ts:
                share["thread_ts"] = thread_ts
            for f in files:
                f["shares"] = {scope: {channel: [share]}}
        return _ok(files=files)

    # -- Web API ------------------------------------------------------------------------------
    async def _api(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        args: dict[str, Any] = dict(request.query)
        if request.content_type == "application/json":
            args.update(await request.json())
        elif request.can_read_body:
            args.update(await request.post())
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
        self.calls.append(Call(method, args, token))
        wanted = self.app_token if method == "apps.connections.open" else self.bot_token
        if token != wanted:
            return _error("invalid_auth" if token else "not_authed")
        fault = self._faults[method].popleft() if self._faults[method] else None
        if fault is None and method == "chat.update":
            fault = self._edit_fault()
        if fault is not None:
            if fault.after_commit and method == "chat.postMessage":
                self._post(args)
            return await self._fault(request, fault)
        handler = getattr(self, "_m_" + method.replace(".", "_"), None)
        if handler is None:
            return _error("unknown_method", status=404)
        result: web.StreamResponse = handler(args)
        await self._notify()
        return result

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _edit_fault(self) -> Fault | None:
        limit = self._edit_limit
        if limit is None:
            return None
        if limit.left <= 0 or time.monotonic() >= limit.until:
            self._edit_limit = None
            return None
        limit.left -= 1
        self._limited_edits += 1
        return Fault("ratelimited", status=429, retry_after=limit.retry_after)

    async def _fault(self, request: web.Request, fault: Fault) -> web.StreamResponse:
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if fault.drop:
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)
        headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else {}
        return _error(fault.error or "ratelimited", status=fault.status, headers=headers)

    def _m_auth_test(self, args: dict[str, Any]) -> web.Response:
        return _ok(
            url="https://fake.slack.com/",
            team="Fake Team",
            user="geodebot",
            team_id=self.team_id,
            user_id=self.bot_user_id,
            bot_id=self.bot_id,
            is_enterprise_install=False,
        )

    def _m_apps_connections_open(self, args: dict[str, Any]) -> web.Response:
        ticket = uuid.uuid4().hex
        self._tickets.add(ticket)
        return _ok(url=f"ws://127.0.0.1:{self._port}/socket?ticket={ticket}")

    def _m_chat_postMessage(self, args: dict[str, Any]) -> web.Response:
        if not args.get("channel"):
            return _error("channel_not_found")
        refused = _refused_content(args)
        if refused is not None:
            return refused
        message = self._post(args)
        return _ok(channel=args["channel"], ts=message["ts"], message=message)

    def _own_message(
        self, args: dict[str, Any], refusal: str
    ) -> tuple[str, str, dict[str, Any]] | web.Response:
        """(channel, ts, message) of the bot's message the call names, or Slack's error."""
        channel, ts = str(args.get("channel") or ""), str(args.get("ts") or "")
        message = self.message(channel, ts)
        if message is None:
            return _error("message_not_found")
        if message.get("bot_id") != self.bot_id:
            return _error(refusal)
        return channel, ts, message

    def _m_chat_delete(self, args: dict[str, Any]) -> web.Response:
        found = self._own_message(args, "cant_delete_message")
        if isinstance(found, web.Response):
            return found
        channel, ts, _ = found
        self.delete_message(channel, ts)
        return _ok(channel=channel, ts=ts)

    def _m_chat_update(self, args: dict[str, Any]) -> web.Response:
        found = self._own_message(args, "cant_update_message")
        if isinstance(found, web.Response):
            return found
        channel, ts, message = found
        refused = _refused_content(args)
        if refused is not None:
            return refused
        text = str(args.get("text") or "")
        if args.get("parse") != "none":
            # parse=client: Slack treats the text as a client would, and escapes what a
            # person cannot type as markup (entities already written stay as they are).
            text = text.replace("<", "&lt;").replace(">", "&gt;")
        message["text"] = text
        message["edited"] = {"user": self.bot_user_id, "ts": f"{time.time():.6f}"}
        # As Slack does: blocks left out of the call stay, blocks given replace them all.
        if "blocks" in args:
            message["blocks"] = _blocks(args)
        metadata = _metadata(args)
        if metadata:
            message["metadata"] = metadata
        posted = next(p for p in self.posted[channel] if p.ts == ts)
        posted.text, posted.blocks = message["text"], message.get("blocks")
        posted.metadata = message.get("metadata")
        posted.edits += 1
        posted.texts.append(text)
        posted.shown_at.append(time.monotonic())
        return _ok(channel=channel, ts=ts, text=message["text"], message=message)

    def _m_chat_postEphemeral(self, args: dict[str, Any]) -> web.Response:
        if not args.get("channel"):
            return _error("channel_not_found")
        if not args.get("user"):
            return _error("user_not_found")
        refused = _refused_content(args)
        if refused is not None:
            return refused
        thread_ts = args.get("thread_ts") or None
        self.ephemeral.append(
            Ephemeral(
                str(args["channel"]),
                str(args["user"]),
                str(args.get("text") or ""),
                thread_ts,
                _blocks(args),
            )
        )
        self._last_ts = max(time.time(), self._last_ts + 0.000001)
        return _ok(message_ts=f"{self._last_ts:.6f}")

    def _m_conversations_history(self, args: dict[str, Any]) -> web.Response:
        channel = str(args.get("channel", ""))
        oldest = float(args.get("oldest") or 0)
        found = [
            m
            for m in reversed(self._history.get(channel, []))
            if m.get("thread_ts", m["ts"]) == m["ts"] and float(m["ts"]) > oldest
        ]
        return self._page(found, args)

    def _m_conversations_replies(self, args: dict[str, Any]) -> web.Response:
        channel, ts = str(args.get("channel", "")), str(args.get("ts", ""))
        messages = self._history.get(channel, [])
        found = [m for m in messages if m["ts"] == ts or m.get("thread_ts") == ts]
        if not found:
            return _error("thread_not_found")
        return self._page(found, args)

    def _page(self, found: list[dict[str, Any]], args: dict[str, Any]) -> web.Response:
        start = int(args.get("cursor") or 0)
        limit = min(int(args.get("limit") or 100), 999)
        page = found[start : start + limit]
        if str(args.get("include_all_metadata", "")).lower() not in ("1", "true"):
            page = [{k: v for k, v in m.items() if k != "metadata"} for m in page]
        more = start + limit < len(found)
        cursor = str(start + limit) if more else ""
        return _ok(messages=page, has_more=more, response_metadata={"next_cursor": cursor})

    def _post(
        self, args: dict[str, Any], files: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        self._last_ts = max(time.time(), self._last_ts + 0.000001)
        ts = f"{self._last_ts:.6f}"
        metadata = _metadata(args)
        thread_ts = args.get("thread_ts") or None
        channel = str(args["channel"])
        blocks = _blocks(args)
        message: dict[str, Any] = {
            "type": "message",
            "ts": ts,
            "text": str(args.get("text") or ""),
            "user": self.bot_user_id,
            "bot_id": self.bot_id,
            "team": self.team_id,
        }
        if thread_ts:
            message["thread_ts"] = thread_ts
        if metadata:
            message["metadata"] = metadata
        if blocks is not None:
            message["blocks"] = blocks
        if files is not None:
            message["files"] = files
            message["upload"] = True
        self._history[channel].append(message)
        self.posted[channel].append(
            Posted(channel, ts, message["text"], thread_ts, metadata, blocks, files)
        )
        return message


def _file_type(name: str) -> tuple[str, str]:
    """(filetype, mimetype) of a shared file as Slack types it by its name."""
    ext = name.rpartition(".")[2].lower() if "." in name else ""
    if ext in _FILE_TYPES:
        return _FILE_TYPES[ext]
    guessed = mimetypes.guess_type(name)[0]
    return (ext or "binary", guessed) if guessed else ("binary", "application/octet-stream")


def _metadata(args: dict[str, Any]) -> dict[str, Any] | None:
    """The call's message metadata: a JSON body carries an object, a form body a string."""
    metadata = args.get("metadata")
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    return dict(metadata) if isinstance(metadata, dict) else None


def _blocks(args: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The call's blocks: a JSON body carries a list, a form body a JSON string."""
    blocks = args.get("blocks")
    if isinstance(blocks, str):
        blocks = json.loads(blocks)
    return list(blocks) if blocks is not None else None


def _refused_content(args: dict[str, Any]) -> web.Response | None:
    """The error Slack answers for a message's text and blocks, or None when they are fine."""
    text = str(args.get("text") or "")
    try:
        blocks = _blocks(args)
    except ValueError:
        return _error("invalid_blocks_format")
    if not text and not blocks:
        return _error("no_text")
    if len(text) > MAX_TEXT:
        return _error("msg_too_long")
    if blocks is not None and not _valid_blocks(blocks):
        return _error("invalid_blocks")
    return None


def _valid_blocks(blocks: list[Any]) -> bool:
    """The Block Kit rules a card meets or breaks: section text within 3000 characters,
    buttons with a plain_text label, unique action ids and values of at most 2000."""
    if not all(isinstance(block, dict) for block in blocks):
        return False
    sections = [
        str((b.get("text") or {}).get("text") or "") for b in blocks if b["type"] == "section"
    ]
    buttons = [e for b in blocks if b["type"] == "actions" for e in b.get("elements") or []]
    action_ids = [str(e.get("action_id") or "") for e in buttons]
    return (
        all(len(text) <= MAX_SECTION_TEXT for text in sections)
        and all((e.get("text") or {}).get("type") == "plain_text" for e in buttons)
        and all(len(str(e.get("value", ""))) <= 2000 for e in buttons)
        and len(action_ids) == len(set(action_ids))
    )


def _ok(**data: Any) -> web.Response:
    return web.json_response({"ok": True, **data})


def _error(code: str, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"ok": False, "error": code}, status=status, headers=headers)
