"""A fake Telegram Bot API on 127.0.0.1, speaking HTTP the way python-telegram-bot uses it.

``POST /bot<token>/<method>`` with form (what PTB sends: strings, JSON for lists and objects),
multipart or JSON bodies; answers ``{"ok": true, "result": ...}`` or the real error shape
``{"ok": false, "error_code", "description", "parameters": {"retry_after"}}``.

Behaviour worth knowing in tests:

* getUpdates confirms every update below ``offset`` (they are gone for good, like Telegram);
  ``confirmed_offset`` is the highest offset any call confirmed. A long poll that is still
  waiting when another getUpdates arrives is ended with 409 "terminated by other getUpdates
  request", as Telegram does (the newcomer is served); ``conflicts`` counts those 409s.
* A message in a forum topic carries, as Telegram sends it, ``reply_to_message`` pointing at
  the topic's creation message; here the bot created every topic, the case where a naive
  "reply to the bot" check treats every topic message as addressed to the bot.
* sendMessage with ``parse_mode=HTML`` rejects unknown or unbalanced tags and bare ``<``/``&``
  with Telegram's "can't parse entities" error; length is counted in UTF-16 code units of
  the visible text (never fewer than code points, so at least as strict as Telegram). A bare
  ``>`` is accepted.
* ``fail_next`` answers the next calls of a method with an error before anything else;
  ``answer_next`` answers the next call with ``ok: true`` and the given result, unexecuted.
* Inline keyboards: sendMessage and editMessageText take ``reply_markup``
  (``{"inline_keyboard": [[{"text", "callback_data"}]]}``), refusing buttons without an action
  or with callback_data outside 1-64 bytes as Telegram does; the message keeps the keyboard
  until an edit replaces it (an edit without one, or with an empty one, removes it). An edit
  that changes nothing is refused with Telegram's "message is not modified": Telegram compares
  what the message shows (``SentMessage.shows``), so plain ``a & b`` and HTML ``a &amp; b``
  are the same.
* Presses: ``push_callback_query`` (or ``press_button``, by the button's label) queues a
  ``callback_query`` update on a stored message and returns the query's id; Telegram lets each
  query be answered once, so answerCallbackQuery refuses an unknown or answered id with
  "query is too old and response timeout expired or query ID is invalid". The answers are in
  ``callback_answers`` (and ``wait_for_callback_answer``).
* Edits: ``history(chat_id, message_id)`` is every state of a bot's message, oldest first (as
  sent, then after each edit that changed it), each stamped with when it was made; ``edits``
  is every edit of every message in order. ``delete_message`` plays someone deleting a message
  (an edit of it then fails with "message to edit not found"), and ``fail_edits`` answers the
  next editMessageText calls with Telegram's 429 for that method.
* Files in: ``push_file`` queues a user's document or photo (a photo in two sizes, a small
  thumbnail first, as Telegram sends them) with the given bytes and caption; ``size``
  overrides the size Telegram declares (in the message and in getFile), so an oversized file
  is faked without its bytes. getFile answers ``file_path`` and ``file_size``, and refuses a
  declared size over 20 MB with the cloud Bot API's "file is too big"; the bytes are served at
  ``GET /file/bot<token>/<file_path>`` (``file_base_url``), each fetch counted in
  ``downloads`` by file_id. ``forget_file`` makes a file gone (getFile refuses it, its path
  answers 404); ``chunked`` serves it without a Content-Length.
  ``voice`` and ``audio`` push a voice note or an audio file with its announced duration.
* Files out: sendPhoto, sendDocument and sendVoice take PTB's multipart upload (the file in
  the ``photo``/``document``/``voice`` part, caption at most 1024 characters, HTML checked as
  for text); sendPhoto refuses bytes that are no image with "IMAGE_PROCESS_FAILED", sendVoice
  bytes that are not OGG. Each upload is in
  ``uploads`` and shows in the chat as a message (``sent``) whose text is its caption; an
  uploaded file can be fetched back with getFile like a user's.
* Webhooks: setWebhook (``webhook`` holds what it registered), deleteWebhook and
  getWebhookInfo. While a webhook is set, getUpdates is refused with 409 as Telegram refuses
  it, and the queued updates are POSTed one at a time, oldest first, to the webhook's URL as
  JSON with the ``X-Telegram-Bot-Api-Secret-Token`` header; one not answered 2xx (or not
  answered at all) is POSTed again after ``webhook_retry_s``, as Telegram retries, and only a
  2xx confirms it. ``webhook_targets`` (``host:port``, each in turn) play a load balancer in
  front of several listeners: each attempt goes to the next, on the URL's path. Every answer
  is in ``webhook_answers`` (0: no answer, the connection failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import itertools
import json
import re
import time
import urllib.parse
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Self

import aiohttp
from aiohttp import web

DEFAULT_TOKEN = "7000001234:AAHfake-token_for-tests-0123456789abcdef"
WEBHOOK_SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
_WEBHOOK_SECRET = re.compile(r"[A-Za-z0-9_-]{1,256}")
MAX_TEXT = 4096
MAX_CAPTION = 1024
# The cloud Bot API's limits: getFile serves 20 MB at most, uploads take 50 MB (photos 10 MB).
DOWNLOAD_LIMIT = 20 * 1000 * 1000
UPLOAD_LIMIT = 50 * 1000 * 1000
PHOTO_LIMIT = 10 * 1000 * 1000
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"RIFF")

_PATH = re.compile(r"^/bot(?P<token>[^/]+)/(?P<method>[A-Za-z]+)$")
_JSON_PARAMS = {
    "allowed_updates", "commands", "entities", "reply_parameters", "scope", "reply_markup",
    "link_preview_options",
}  # fmt: skip
_INT_PARAMS = {
    "offset", "limit", "timeout", "message_thread_id", "reply_to_message_id", "message_id",
}  # fmt: skip
MAX_CALLBACK_DATA = 64  # bytes
MAX_ANSWER_TEXT = 200
_QUERY_INVALID = "Bad Request: query is too old and response timeout expired or query ID is invalid"
_NOT_MODIFIED = (
    "Bad Request: message is not modified: specified new message content and reply markup are "
    "exactly the same as a content and reply markup of the current content and reply markup "
    "of the message"
)
_TAGS = {
    "b", "strong", "i", "em", "u", "ins", "s", "strike", "del", "span", "tg-spoiler",
    "a", "code", "pre", "blockquote", "tg-emoji",
}  # fmt: skip
_TAG = re.compile(
    r"<(/?)([A-Za-z][A-Za-z0-9-]*)((?:\s+[A-Za-z-]+(?:=(?:\"[^\"]*\"|'[^']*'|[^\s>]+))?)*)\s*>"
)
_ENTITY = re.compile(r"&(?:lt|gt|amp|quot|#\d{1,7}|#x[0-9A-Fa-f]{1,6});")
_AUTO_ENTITIES = re.compile(
    r"(?P<cmd>^/[A-Za-z0-9_]+(?:@[A-Za-z0-9_]+)?)|(?P<at>@[A-Za-z0-9_]{5,32})"
)


@dataclass(frozen=True)
class SentMessage:
    chat_id: int
    message_id: int
    text: str  # as sent (HTML source when parse_mode is HTML)
    parse_mode: str | None
    reply_to_message_id: int | None
    allow_sending_without_reply: bool | None
    thread_id: int | None
    # As the bot sent it, {"inline_keyboard": [[button, ...], ...]}; None without a keyboard.
    reply_markup: dict[str, Any] | None = None
    # As the bot sent it ({"is_disabled": true}, say); None when the request had none.
    link_preview_options: dict[str, Any] | None = None
    # time.monotonic() when the fake made the message read like this (sent or edited).
    at: float = field(default=0.0, compare=False)
    # A photo or document the bot uploaded (``text`` is then its caption).
    upload: Upload | None = None

    @property
    def shows(self) -> tuple[str, str]:
        """What the message shows, as Telegram compares it: see :func:`shown_content`."""
        return shown_content(self.text, self.parse_mode)

    @property
    def buttons(self) -> list[tuple[str, str]]:
        """Every inline button's (label, callback_data), row by row; [] without a keyboard."""
        rows = (self.reply_markup or {}).get("inline_keyboard", [])
        return [(str(b["text"]), str(b.get("callback_data", ""))) for row in rows for b in row]


@dataclass(frozen=True)
class StoredFile:
    """A file the fake Bot API holds: sent by a user (push_file) or uploaded by the bot."""

    file_id: str
    file_unique_id: str
    file_path: str
    data: bytes
    # What Telegram declares (file_size); None: not declared.
    size: int | None
    chunked: bool = False  # served without a Content-Length


@dataclass(frozen=True)
class UploadedFile:
    """A file part of a multipart request, as it arrived."""

    filename: str
    data: bytes
    content_type: str


@dataclass(frozen=True)
class Upload:
    """A photo or document the bot sent (sendPhoto / sendDocument)."""

    chat_id: int
    message_id: int
    kind: str  # "photo", "document" or "voice"
    name: str  # the multipart filename
    data: bytes
    content_type: str
    caption: str  # as sent (HTML source when parse_mode is HTML)
    parse_mode: str | None
    reply_to_message_id: int | None
    thread_id: int | None


@dataclass(frozen=True)
class CallbackAnswer:
    query_id: str
    text: str | None
    show_alert: bool


@dataclass(frozen=True)
class SentAction:
    chat_id: int
    action: str
    thread_id: int | None


@dataclass(frozen=True)
class WebhookAnswer:
    """One POST of an update to the webhook: where it went and the status (0: no answer)."""

    update_id: int
    target: str  # host:port
    status: int


@dataclass
class _Failure:
    status: int
    description: str
    retry_after: float | None
    times: int


class _Poll:
    terminated = False


class ApiError(Exception):
    def __init__(self, status: int, description: str) -> None:
        super().__init__(description)
        self.status = status
        self.description = description


def html_visible(text: str) -> str:
    """The text Telegram would show for ``text`` in HTML mode; raises ApiError(400) if invalid."""
    out: list[str] = []
    stack: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        at = f"at byte offset {len(text[:i].encode())}" if ch in "<&" else ""
        if ch == "<":
            tag = _TAG.match(text, i)
            if tag is None:
                raise _entities_error(f"Unexpected end of name token {at}")
            closing, name = tag.group(1) == "/", tag.group(2).lower()
            if name not in _TAGS:
                raise _entities_error(f'Unsupported start tag "{name}" {at}')
            if closing and (not stack or stack.pop() != name):
                raise _entities_error(f"Unmatched end tag {at}")
            if not closing:
                stack.append(name)
            i = tag.end()
        elif ch == "&":
            entity = _ENTITY.match(text, i)
            if entity is None:
                raise _entities_error(f"Can't find end of the entity {at}")
            out.append(html.unescape(entity.group()))
            i = entity.end()
        else:
            out.append(ch)
            i += 1
    if stack:
        raise _entities_error(f'Can\'t find end tag corresponding to start tag "{stack[-1]}"')
    return "".join(out)


def shown_content(text: str, parse_mode: str | None) -> tuple[str, str]:
    """The visible text and its formatting (the HTML source, when it has any tag): what
    Telegram compares to refuse an edit as "not modified"."""
    if parse_mode != "HTML":
        return text, ""
    return html_visible(text), text if _TAG.search(text) else ""


def _entities_error(detail: str) -> ApiError:
    return ApiError(400, f"Bad Request: can't parse entities: {detail}")


def _utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def auto_entities(text: str) -> list[dict[str, Any]]:
    """Mentions and a leading command, with UTF-16 offsets, as Telegram would add them."""
    return [
        {
            "type": "bot_command" if match.group("cmd") else "mention",
            "offset": _utf16_len(text[: match.start()]),
            "length": _utf16_len(match.group()),
        }
        for match in _AUTO_ENTITIES.finditer(text)
    ]


class FakeTelegram:
    def __init__(self, token: str = DEFAULT_TOKEN, *, bot_username: str = "geode_test_bot") -> None:
        self.token = token
        self.bot_id = int(token.split(":", 1)[0])
        self.bot_user: dict[str, Any] = {"id": self.bot_id, "is_bot": True, "first_name": "Geode"}
        self.bot_user.update(username=bot_username, can_read_all_group_messages=False)
        self.sent: defaultdict[int, list[SentMessage]] = defaultdict(list)
        self.edits: list[SentMessage] = []  # each edit: the message as it was made to read
        # Edits refused as "not modified" (the message showed that already): (chat, message,
        # parse mode), so a test can tell an answer that edited nothing from one never sent.
        self.unmodified: list[tuple[int, int, str | None]] = []
        # Messages the bot deleted (deleteMessage): (chat, message). They stay in ``sent``
        # and ``shown`` reads them as they were, so a test can tell what was taken back.
        self.deleted: list[tuple[int, int]] = []
        self.callback_answers: dict[str, CallbackAnswer] = {}
        self.actions: list[SentAction] = []
        self.commands: list[dict[str, str]] | None = None
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.webhook_deletes = 0
        # What setWebhook registered (url, secret_token, allowed_updates); None: polling.
        self.webhook: dict[str, Any] | None = None
        self.webhook_sets = 0
        self.webhook_targets: list[str] = []
        self.webhook_retry_s = 0.05
        self.webhook_answers: list[WebhookAnswer] = []
        self._delivery: asyncio.Task[None] | None = None
        self._turns = itertools.count()
        self.confirmed_offset = 0
        self.conflicts = 0  # long polls ended by a newer getUpdates (409)
        self.pushed: dict[int, dict[str, Any]] = {}  # every update queued, by update_id
        self.files: dict[str, StoredFile] = {}  # by file_id
        self.pushed_files: dict[int, StoredFile] = {}  # the file of each push_file, by update_id
        self.downloads: Counter[str] = Counter()  # fetches of each file's URL, by file_id
        self.uploads: list[Upload] = []
        self._file_ids = itertools.count(1)
        self._gone: set[str] = set()
        self._updates: list[dict[str, Any]] = []
        self._update_ids = itertools.count(1000)
        self._message_ids: defaultdict[int, itertools.count[int]] = defaultdict(
            lambda: itertools.count(1)
        )
        self._messages: dict[tuple[int, int], dict[str, Any]] = {}
        self._shown: dict[tuple[int, int], SentMessage] = {}  # the bot's, as they read now
        self._history: defaultdict[tuple[int, int], list[SentMessage]] = defaultdict(list)
        self._query_ids = itertools.count(1)
        self._open_queries: set[str] = set()
        self._allowed: set[str] = set()
        self._failures: defaultdict[str, deque[_Failure]] = defaultdict(deque)
        self._canned: defaultdict[str, deque[Any]] = defaultdict(deque)
        self._poll: _Poll | None = None
        # Replaced on every change: waiters hold the old one, so a change wakes them all.
        self._changed = asyncio.Event()
        self._closing = False
        self._runner: web.AppRunner | None = None
        self._port = 0

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def api_base_url(self) -> str:
        if self._runner is None:
            raise RuntimeError("FakeTelegram is not running")
        return f"http://127.0.0.1:{self._port}/bot"

    @property
    def file_base_url(self) -> str:
        """PTB's ``base_file_url`` for this fake (the token is appended to it)."""
        return self.api_base_url.removesuffix("/bot") + "/file/bot"

    async def start(self) -> Self:
        # Uploads arrive whole in one multipart body, up to the Bot API's 50 MB.
        app = web.Application(client_max_size=UPLOAD_LIMIT + 1024 * 1024)
        app.router.add_get("/file/bot{token}/{path:.+}", self._download)
        app.router.add_post("/{tail:.*}", self._handle)
        # handler_cancellation: a client that gives up its long poll frees it at once.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._port = runner.addresses[0][1]
        self._closing = False
        self._runner = runner
        return self

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._closing = True
        self._notify()
        await self._stop_delivery()
        await runner.cleanup()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- test controls --------------------------------------------------------------------
    def push_message(
        self,
        chat_id: int,
        text: str,
        *,
        user_id: int,
        is_bot: bool = False,
        username: str | None = None,
        first_name: str = "Test",
        chat_type: str = "group",
        thread_id: int | None = None,
        entities: list[dict[str, Any]] | None = None,
        reply_to: int | None = None,
        caption: bool = False,
        update_id: int | None = None,
    ) -> int:
        """Queue a user's message as an update; returns its update_id.

        ``entities=None`` adds mentions and a leading command like Telegram; ``reply_to`` is
        the message_id of an earlier message in the chat (sent or pushed); ``caption`` sends
        the text as a photo caption. A given ``update_id`` simulates a redelivery."""
        sender: dict[str, Any] = {"id": user_id, "is_bot": is_bot, "first_name": first_name}
        if username:
            sender["username"] = username
        message = self._new_message(chat_id, chat_type, thread_id, reply_to)
        message["from"] = sender
        found = auto_entities(text) if entities is None else entities
        if caption:
            message["photo"] = [{"file_id": "p1", "file_unique_id": "u1", "width": 1, "height": 1}]
            message["caption"] = text
            if found:
                message["caption_entities"] = found
        else:
            message["text"] = text
            if found:
                message["entities"] = found
        return self.push_update({"message": message}, update_id=update_id)

    def push_file(
        self,
        chat_id: int,
        data: bytes,
        *,
        user_id: int,
        name: str = "file.bin",
        mime_type: str = "application/octet-stream",
        caption: str = "",
        photo: bool = False,
        size: int | None = None,
        hide_size: bool = False,
        chunked: bool = False,
        username: str | None = None,
        chat_type: str = "group",
        thread_id: int | None = None,
        voice: bool = False,
        audio: bool = False,
        duration: int | None = None,
    ) -> int:
        """Queue a user's message with a file of ``data``: a document (``name``,
        ``mime_type``), with ``photo`` a photo (Telegram's: no name, JPEG, sizes smallest
        first), with ``voice`` a voice note (OGG/Opus, no name) or with ``audio`` an audio
        file (``name``, ``mime_type``), each with the ``duration`` in seconds Telegram
        announces. ``size`` is the size Telegram declares instead of ``len(data)``;
        ``hide_size`` declares none; ``chunked`` serves the bytes without a Content-Length.
        The caption gets entities like a text. Returns the update_id;
        ``pushed_files[update_id]`` is the file."""
        sender: dict[str, Any] = {"id": user_id, "is_bot": False, "first_name": "Test"}
        if username:
            sender["username"] = username
        message = self._new_message(chat_id, chat_type, thread_id, None)
        message["from"] = sender
        declared = None if hide_size else (len(data) if size is None else size)
        folder = "photos" if photo else "voice" if voice else "music" if audio else "documents"
        stored = self.add_file(data, folder, size=declared)
        if chunked:
            stored = self.files[stored.file_id] = replace(stored, chunked=True)
        described: dict[str, Any] = {"file_id": stored.file_id}
        described["file_unique_id"] = stored.file_unique_id
        if declared is not None:
            described["file_size"] = declared
        if photo:
            thumb = self.add_file(b"thumbnail", "photos")
            message["photo"] = [
                {
                    "file_id": thumb.file_id,
                    "file_unique_id": thumb.file_unique_id,
                    "width": 90,
                    "height": 60,
                    "file_size": len(thumb.data),
                },
                {**described, "width": 1280, "height": 853},
            ]
        elif voice or audio:
            media = {**described, "duration": 1 if duration is None else duration}
            if voice:
                message["voice"] = {**media, "mime_type": "audio/ogg"}
            else:
                message["audio"] = {**media, "file_name": name, "mime_type": mime_type}
        else:
            message["document"] = {**described, "file_name": name, "mime_type": mime_type}
        if caption:
            message["caption"] = caption
            if found := auto_entities(caption):
                message["caption_entities"] = found
        update_id = self.push_update({"message": message})
        self.pushed_files[update_id] = stored
        return update_id

    def add_file(self, data: bytes, folder: str, *, size: int | None = None) -> StoredFile:
        """Hold ``data`` as Telegram would hold a file: a file_id and a path to fetch it by."""
        number = next(self._file_ids)
        file_id = f"BQACAgIAAx{number:06d}"
        path = f"{folder}/file_{number}{'.jpg' if folder == 'photos' else ''}"
        stored = StoredFile(file_id, f"AgAD{number:04d}", path, data, size)
        self.files[file_id] = stored
        return stored

    def forget_file(self, file_id: str) -> None:
        """The file is gone: getFile refuses its id and its URL answers 404."""
        self._gone.add(file_id)

    def uploads_to(self, chat_id: int) -> list[Upload]:
        return [u for u in self.uploads if u.chat_id == chat_id]

    def push_channel_post(self, chat_id: int, text: str) -> int:
        message = self._new_message(chat_id, "channel", None, None)
        message["sender_chat"] = message["chat"]
        message["text"] = text
        return self.push_update({"channel_post": message})

    def push_update(self, payload: Mapping[str, Any], *, update_id: int | None = None) -> int:
        """Queue any update (``{"message": {...}}``); update_ids keep increasing."""
        if update_id is None:
            update_id = next(self._update_ids)
        else:
            self._update_ids = itertools.count(max(update_id + 1, next(self._update_ids)))
        update = {"update_id": update_id, **payload}
        self.pushed[update_id] = update
        self._updates.append(update)
        self._updates.sort(key=lambda u: int(u["update_id"]))
        self._notify()
        return update_id

    def push_callback_query(
        self,
        chat_id: int,
        message_id: int,
        data: str,
        *,
        user_id: int,
        username: str | None = None,
        first_name: str = "Test",
        inaccessible: bool = False,
        update_id: int | None = None,
    ) -> str:
        """Queue a press of a button with ``data`` on stored message ``message_id``; returns
        the callback query's id. Telegram passes whatever data a client sends, so ``data`` need
        not be on the message. ``inaccessible`` sends the message as Telegram does once the
        bot can no longer see it (deleted, say): only chat, id and date 0."""
        stored = self._messages.get((chat_id, message_id))
        if stored is None:
            raise KeyError(f"no message {message_id} in chat {chat_id}")
        if inaccessible:
            message = {"chat": stored["chat"], "message_id": message_id, "date": 0}
        else:
            message = dict(stored)
        sender: dict[str, Any] = {"id": user_id, "is_bot": False, "first_name": first_name}
        if username:
            sender["username"] = username
        query_id = f"{self.bot_id}{next(self._query_ids):08d}"
        self._open_queries.add(query_id)
        query = {"id": query_id, "from": sender, "message": message, "data": data}
        query["chat_instance"] = f"instance{chat_id}"
        self.push_update({"callback_query": query}, update_id=update_id)
        return query_id

    def press_button(self, chat_id: int, message_id: int, label: str, *, user_id: int) -> str:
        """Press the button labelled ``label`` on the bot's message as it reads now; returns
        the callback query's id."""
        found = [data for text, data in self.shown(chat_id, message_id).buttons if text == label]
        if not found:
            raise KeyError(f"message {message_id} in chat {chat_id} has no button {label!r}")
        return self.push_callback_query(chat_id, message_id, found[0], user_id=user_id)

    def shown(self, chat_id: int, message_id: int) -> SentMessage:
        """The bot's message ``message_id`` as it reads now: as sent, or as last edited."""
        return self._shown[(chat_id, message_id)]

    def history(self, chat_id: int, message_id: int) -> list[SentMessage]:
        """Every state of the bot's message ``message_id``, oldest first: as sent, then after
        each edit (an edit Telegram refused, "not modified" say, is not one)."""
        return list(self._history.get((chat_id, message_id), ()))

    def delete_message(self, chat_id: int, message_id: int) -> None:
        """Someone deleted the message: it is gone for edits, presses and replies."""
        if self._messages.pop((chat_id, message_id), None) is None:
            raise KeyError(f"no message {message_id} in chat {chat_id}")
        self._shown.pop((chat_id, message_id), None)
        self._notify()

    def fail_edits(self, count: int, retry_after: int) -> None:
        """Answer the next ``count`` editMessageText calls as Telegram rate-limits a chat's
        edits: 429 with ``parameters.retry_after`` (whole seconds, as Telegram sends them)."""
        description = f"Too Many Requests: retry after {retry_after}"
        self.fail_next("editMessageText", 429, description, retry_after, times=count)

    def fail_next(
        self,
        method: str,
        status: int,
        description: str,
        retry_after: float | None = None,
        times: int = 1,
    ) -> None:
        self._failures[method.lower()].append(_Failure(status, description, retry_after, times))

    def answer_next(self, method: str, result: Any) -> None:
        self._canned[method.lower()].append(result)

    # The waits take their own timeout (ASYNC109): a test always wants one, and inline.
    async def wait_until(self, predicate: Callable[[], object], timeout: float = 5.0) -> None:
        """Until ``predicate()`` is true, checked after every request and every change."""
        await self._wait(lambda: bool(predicate()), timeout)

    async def wait_for_sent(
        self,
        chat_id: int,
        n: int,
        timeout: float = 5.0,
    ) -> list[SentMessage]:
        await self._wait(lambda: len(self.sent[chat_id]) >= n, timeout)
        return list(self.sent[chat_id])

    async def wait_for_edit(
        self,
        chat_id: int,
        message_id: int,
        n: int = 1,
        timeout: float = 5.0,
    ) -> SentMessage:
        """Until the bot's message was edited ``n`` times in total; how it reads then."""

        def edited() -> int:
            return sum(1 for e in self.edits if (e.chat_id, e.message_id) == (chat_id, message_id))

        await self._wait(lambda: edited() >= n, timeout)
        return self.shown(chat_id, message_id)

    async def wait_for_callback_answer(
        self,
        query_id: str,
        timeout: float = 5.0,
    ) -> CallbackAnswer:
        """Until the callback query ``query_id`` was answered; that answer."""
        await self._wait(lambda: query_id in self.callback_answers, timeout)
        return self.callback_answers[query_id]

    async def wait_for_confirmed(self, offset: int, timeout: float = 5.0) -> None:
        await self._wait(lambda: self.confirmed_offset >= offset, timeout)

    async def wait_for_reply_to(self, update_id: int, timeout: float = 5.0) -> SentMessage:
        """Until a message sent to the chat of update ``update_id`` replies to its message;
        that reply (a control message's answer, say: see tests/support/control.py)."""
        message = self.pushed[update_id]["message"]
        chat_id, message_id = int(message["chat"]["id"]), int(message["message_id"])

        def reply() -> SentMessage | None:
            found = [m for m in self.sent[chat_id] if m.reply_to_message_id == message_id]
            return found[0] if found else None

        await self._wait(lambda: reply() is not None, timeout)
        answer = reply()
        assert answer is not None
        return answer

    async def wait_for_uploads(
        self,
        chat_id: int,
        n: int = 1,
        timeout: float = 5.0,
    ) -> list[Upload]:
        """Until the bot uploaded ``n`` files to the chat in total; those uploads."""
        await self._wait(lambda: len(self.uploads_to(chat_id)) >= n, timeout)
        return self.uploads_to(chat_id)

    async def wait_for_request(
        self,
        method: str,
        n: int = 1,
        timeout: float = 5.0,
    ) -> None:
        """Until ``n`` calls of ``method`` arrived in total (failed ones included)."""
        await self._wait(lambda: self.count(method) >= n, timeout)

    def count(self, method: str, chat_id: int | None = None) -> int:
        """Calls of ``method`` that arrived (failed ones included); with ``chat_id``, those
        for that chat."""
        return sum(
            1
            for name, params in self.requests
            if name == method.lower()
            and (chat_id is None or str(params.get("chat_id")) == str(chat_id))
        )

    # -- plumbing -------------------------------------------------------------------------
    def _new_message(
        self, chat_id: int, chat_type: str, thread_id: int | None, reply_to: int | None
    ) -> dict[str, Any]:
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        if chat_type != "private":
            chat["title"] = f"Chat {chat_id}"
        if thread_id is not None:
            chat["is_forum"] = True
        message_id = next(self._message_ids[chat_id])
        message: dict[str, Any] = {"message_id": message_id, "date": int(time.time()), "chat": chat}
        if thread_id is not None:
            message["message_thread_id"] = thread_id
            message["is_topic_message"] = True
            if reply_to is None:
                message["reply_to_message"] = {
                    "message_id": thread_id,
                    "date": int(time.time()),
                    "chat": chat,
                    "from": self.bot_user,
                    "message_thread_id": thread_id,
                    "forum_topic_created": {"name": f"topic {thread_id}", "icon_color": 7322096},
                }
        if reply_to is not None:
            message["reply_to_message"] = self._messages[(chat_id, reply_to)]
        self._messages[(chat_id, message_id)] = {
            k: v for k, v in message.items() if k != "reply_to_message"
        }
        return message

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, predicate: Callable[[], bool], limit_s: float) -> None:
        async with asyncio.timeout(limit_s):
            while not predicate():
                await self._changed.wait()

    async def _handle(self, request: web.Request) -> web.Response:
        match = _PATH.match(request.path)
        if match is None or match.group("token") != self.token:
            return _error(401 if match else 404, "Unauthorized" if match else "Not Found")
        method = match.group("method").lower()
        params = await _params(request)
        self.requests.append((method, params))
        self._notify()
        failures = self._failures[method]
        if failures:
            failure = failures[0]
            failure.times -= 1
            if failure.times <= 0:
                failures.popleft()
            return _error(failure.status, failure.description, failure.retry_after)
        if self._canned[method]:
            return web.json_response({"ok": True, "result": self._canned[method].popleft()})
        handler = getattr(self, f"_m_{method.lower()}", None)
        if handler is None:
            return _error(404, "Not Found")
        try:
            result = await handler(params)
        except ApiError as exc:
            return _error(exc.status, exc.description)
        self._notify()
        return web.json_response({"ok": True, "result": result})

    async def _m_getme(self, params: dict[str, Any]) -> Any:
        return self.bot_user

    async def _m_deletewebhook(self, params: dict[str, Any]) -> Any:
        self.webhook_deletes += 1
        self.webhook = None
        if _flag(params.get("drop_pending_updates")):
            self._updates.clear()
        await self._stop_delivery()
        return True

    async def _m_setwebhook(self, params: dict[str, Any]) -> Any:
        url = str(params.get("url") or "")
        if not url:  # an empty url is how the Bot API removes a webhook too
            return await self._m_deletewebhook(params)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "https" and parts.hostname not in ("127.0.0.1", "localhost"):
            raise ApiError(400, "Bad Request: bad webhook: An HTTPS URL must be provided")
        secret = params.get("secret_token")
        if secret is not None and not _WEBHOOK_SECRET.fullmatch(str(secret)):
            raise ApiError(400, "Bad Request: secret token contains unallowed characters")
        if _flag(params.get("drop_pending_updates")):
            self._updates.clear()
        if "allowed_updates" in params:
            self._allowed = set(params["allowed_updates"] or ())
        self.webhook = {
            "url": url,
            "secret_token": secret,
            "allowed_updates": sorted(self._allowed),
        }
        self.webhook_sets += 1
        if self._delivery is None or self._delivery.done():
            self._delivery = asyncio.create_task(self._deliver_webhooks())
        return True

    async def _m_getwebhookinfo(self, params: dict[str, Any]) -> Any:
        info: dict[str, Any] = {"url": "", "has_custom_certificate": False}
        info["pending_update_count"] = len(self._deliverable(len(self._updates)))
        if self.webhook is not None:
            info["url"] = self.webhook["url"]
            info["allowed_updates"] = self.webhook["allowed_updates"]
            failed = [a for a in self.webhook_answers if not 200 <= a.status < 300]
            if failed:
                info["last_error_message"] = f"Wrong response from the webhook: {failed[-1].status}"
        return info

    async def _stop_delivery(self) -> None:
        task, self._delivery = self._delivery, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _deliver_webhooks(self) -> None:
        """POST the queued updates to the webhook, oldest first, until each got a 2xx."""
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while self.webhook is not None and not self._closing:
                batch = self._deliverable(1)
                if not batch:
                    changed = self._changed
                    await changed.wait()
                    continue
                update = batch[0]
                status = await self._post_update(session, self.webhook, update)
                if 200 <= status < 300:
                    if update in self._updates:
                        self._updates.remove(update)
                    self._notify()
                else:
                    await asyncio.sleep(self.webhook_retry_s)

    async def _post_update(
        self, session: aiohttp.ClientSession, webhook: Mapping[str, Any], update: dict[str, Any]
    ) -> int:
        parts = urllib.parse.urlsplit(str(webhook["url"]))
        target = parts.netloc
        if self.webhook_targets:
            target = self.webhook_targets[next(self._turns) % len(self.webhook_targets)]
        url = urllib.parse.urlunsplit((parts.scheme, target, parts.path or "/", "", ""))
        headers = {}
        if webhook.get("secret_token"):
            headers[WEBHOOK_SECRET_HEADER] = str(webhook["secret_token"])
        try:
            async with session.post(url, json=update, headers=headers) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        self.webhook_answers.append(WebhookAnswer(int(update["update_id"]), target, status))
        self._notify()
        return status

    def webhook_statuses(self, update_id: int) -> list[int]:
        """Every answer the webhook gave to POSTs of update ``update_id``, in order."""
        return [a.status for a in self.webhook_answers if a.update_id == update_id]

    async def wait_for_webhook_ok(self, update_id: int, timeout: float = 5.0) -> None:
        """Until a POST of update ``update_id`` was answered 2xx (it is confirmed then)."""
        await self._wait(
            lambda: any(200 <= s < 300 for s in self.webhook_statuses(update_id)), timeout
        )

    async def _m_setmycommands(self, params: dict[str, Any]) -> Any:
        commands = params.get("commands")
        if not isinstance(commands, list) or not all(
            re.fullmatch(r"[a-z0-9_]{1,32}", str(c.get("command", ""))) for c in commands
        ):
            raise ApiError(400, "Bad Request: BOT_COMMAND_INVALID")
        self.commands = commands
        return True

    async def _m_sendchataction(self, params: dict[str, Any]) -> Any:
        thread = params.get("message_thread_id")
        self.actions.append(SentAction(int(params["chat_id"]), str(params["action"]), thread))
        return True

    async def _m_getupdates(self, params: dict[str, Any]) -> Any:
        if self.webhook is not None:
            raise ApiError(
                409,
                "Conflict: can't use getUpdates method while webhook is active; "
                "use deleteWebhook to delete the webhook first",
            )
        offset = int(params.get("offset") or 0)
        limit = int(params.get("limit") or 100)
        timeout = float(params.get("timeout") or 0)
        if "allowed_updates" in params:
            self._allowed = set(params["allowed_updates"] or ())
        if offset > 0:
            self._updates = [u for u in self._updates if int(u["update_id"]) >= offset]
            self.confirmed_offset = max(self.confirmed_offset, offset)
        if self._poll is not None:
            self._poll.terminated = True
        poll = self._poll = _Poll()
        self._notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                if poll.terminated:
                    self.conflicts += 1
                    raise ApiError(
                        409,
                        "Conflict: terminated by other getUpdates request; "
                        "make sure that only one bot instance is running",
                    )
                batch = self._deliverable(limit)
                remaining = deadline - loop.time()
                if batch or remaining <= 0 or self._closing:
                    return batch
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._changed.wait()
        finally:
            if self._poll is poll:
                self._poll = None

    def _deliverable(self, limit: int) -> list[dict[str, Any]]:
        if self._allowed:
            # Telegram never creates updates of types the bot did not ask for.
            self._updates = [u for u in self._updates if self._allowed & u.keys()]
        return self._updates[:limit]

    async def _m_sendmessage(self, params: dict[str, Any]) -> Any:
        chat_id = int(params["chat_id"])
        text = str(params.get("text", ""))
        parse_mode = params.get("parse_mode")
        visible = html_visible(text) if parse_mode == "HTML" else text
        if not visible.strip():
            raise ApiError(400, "Bad Request: message text is empty")
        if _utf16_len(visible) > MAX_TEXT:
            raise ApiError(400, "Bad Request: message is too long")
        reply_to, allow_flag, replied = self._reply_of(chat_id, params)
        keyboard = _inline_keyboard(params.get("reply_markup"))
        thread = params.get("message_thread_id")
        message = self._bot_message(chat_id, thread, text=visible)
        message_id = int(message["message_id"])
        if keyboard is not None:
            message["reply_markup"] = keyboard
        self._messages[(chat_id, message_id)] = dict(message)
        if replied is not None:
            message["reply_to_message"] = replied
        sent = SentMessage(
            chat_id,
            message_id,
            text,
            parse_mode,
            reply_to,
            allow_flag,
            thread,
            keyboard,
            params.get("link_preview_options"),
            time.monotonic(),
        )
        self._record_sent(sent)
        return message

    def _reply_of(
        self, chat_id: int, params: dict[str, Any]
    ) -> tuple[int | None, bool | None, dict[str, Any] | None]:
        """A send's reply: the id replied to, allow_sending_without_reply, the message."""
        reply = params.get("reply_parameters") or {}
        reply_id = reply.get("message_id", params.get("reply_to_message_id"))
        allow = reply.get("allow_sending_without_reply", params.get("allow_sending_without_reply"))
        allow_flag = None if allow is None else allow in (True, "true", "True")
        replied = self._messages.get((chat_id, int(reply_id))) if reply_id is not None else None
        if reply_id is not None and replied is None and not allow_flag:
            raise ApiError(400, "Bad Request: message to be replied not found")
        return (None if reply_id is None else int(reply_id)), allow_flag, replied

    def _bot_message(self, chat_id: int, thread: int | None, **content: Any) -> dict[str, Any]:
        """A new message of the bot in the chat, as the Bot API answers a send."""
        message_id = next(self._message_ids[chat_id])
        chat = {"id": chat_id, "type": "private" if chat_id > 0 else "supergroup"}
        message: dict[str, Any] = {"message_id": message_id, "date": int(time.time())}
        message.update(chat=chat, **{"from": self.bot_user}, **content)
        if thread is not None:
            message.update(message_thread_id=thread, is_topic_message=True)
        return message

    def _record_sent(self, sent: SentMessage) -> None:
        self.sent[sent.chat_id].append(sent)
        self._shown[(sent.chat_id, sent.message_id)] = sent
        self._history[(sent.chat_id, sent.message_id)].append(sent)

    async def _m_sendphoto(self, params: dict[str, Any]) -> Any:
        return self._media_message(params, "photo")

    async def _m_senddocument(self, params: dict[str, Any]) -> Any:
        return self._media_message(params, "document")

    async def _m_sendvoice(self, params: dict[str, Any]) -> Any:
        return self._media_message(params, "voice")

    def _media_message(self, params: dict[str, Any], kind: str) -> dict[str, Any]:
        chat_id = int(params["chat_id"])
        upload = params.get(kind)
        if not isinstance(upload, UploadedFile):
            # A file_id or URL to send again: this fake takes uploads only.
            raise ApiError(400, f"Bad Request: there is no {kind} in the request")
        _check_upload(upload.data, kind)
        caption = str(params.get("caption", ""))
        parse_mode = params.get("parse_mode")
        visible = html_visible(caption) if parse_mode == "HTML" else caption
        if _utf16_len(visible) > MAX_CAPTION:
            raise ApiError(400, "Bad Request: message caption is too long")
        reply_to, allow_flag, replied = self._reply_of(chat_id, params)
        thread = params.get("message_thread_id")
        stored = self.add_file(upload.data, "photos" if kind == "photo" else "documents")
        stored = replace(stored, size=len(upload.data))
        self.files[stored.file_id] = stored
        described: dict[str, Any] = {"file_id": stored.file_id, "file_size": len(upload.data)}
        described["file_unique_id"] = stored.file_unique_id
        if kind == "photo":
            content: dict[str, Any] = {"photo": [{**described, "width": 1, "height": 1}]}
        elif kind == "voice":
            content = {"voice": {**described, "duration": 1, "mime_type": "audio/ogg"}}
        else:
            content = {"document": {**described, "file_name": upload.filename}}
            content["document"]["mime_type"] = upload.content_type
        if visible:
            content["caption"] = visible
        message = self._bot_message(chat_id, thread, **content)
        message_id = int(message["message_id"])
        self._messages[(chat_id, message_id)] = dict(message)
        if replied is not None:
            message["reply_to_message"] = replied
        record = Upload(
            chat_id,
            message_id,
            kind,
            upload.filename,
            upload.data,
            upload.content_type,
            caption,
            parse_mode,
            reply_to,
            thread,
        )
        self.uploads.append(record)
        sent = SentMessage(chat_id, message_id, caption, parse_mode, reply_to, allow_flag, thread)
        self._record_sent(replace(sent, at=time.monotonic(), upload=record))
        return message

    async def _m_getfile(self, params: dict[str, Any]) -> Any:
        file_id = str(params.get("file_id", ""))
        stored = self.files.get(file_id)
        if stored is None:
            raise ApiError(400, "Bad Request: invalid file_id")
        if file_id in self._gone:
            raise ApiError(400, "Bad Request: wrong file_id or the file is temporarily unavailable")
        if stored.size is not None and stored.size > DOWNLOAD_LIMIT:
            raise ApiError(400, "Bad Request: file is too big")
        result: dict[str, Any] = {"file_id": file_id, "file_unique_id": stored.file_unique_id}
        if stored.size is not None:
            result["file_size"] = stored.size
        result["file_path"] = stored.file_path
        return result

    async def _download(self, request: web.Request) -> web.StreamResponse:
        """``GET /file/bot<token>/<file_path>``: the file's bytes, each fetch counted."""
        if request.match_info["token"] != self.token:
            return _error(404, "Not Found")
        path = request.match_info["path"]
        found = [f for f in self.files.values() if f.file_path == path]
        if not found:
            return _error(404, "Not Found")
        stored = found[0]
        self.downloads[stored.file_id] += 1
        self._notify()
        if stored.file_id in self._gone:
            return _error(404, "Not Found")
        if not stored.chunked:
            return web.Response(body=stored.data, content_type="application/octet-stream")
        response = web.StreamResponse()
        response.content_type = "application/octet-stream"
        response.enable_chunked_encoding()
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):  # the client may stop reading at its limit
            for start in range(0, len(stored.data), 64 * 1024):
                await response.write(stored.data[start : start + 64 * 1024])
            await response.write_eof()
        return response

    async def _m_deletemessage(self, params: dict[str, Any]) -> Any:
        chat_id, message_id = int(params["chat_id"]), int(params["message_id"])
        if (chat_id, message_id) not in self._messages:
            raise ApiError(400, "Bad Request: message to delete not found")
        if (chat_id, message_id) not in self._shown:  # not one the bot sent
            raise ApiError(400, "Bad Request: message can't be deleted")
        del self._messages[(chat_id, message_id)]
        self.deleted.append((chat_id, message_id))
        self._notify()
        return True

    async def _m_editmessagetext(self, params: dict[str, Any]) -> Any:
        if "inline_message_id" in params:
            raise ApiError(400, "Bad Request: inline messages are not stored here")
        chat_id, message_id = int(params["chat_id"]), int(params["message_id"])
        stored = self._messages.get((chat_id, message_id))
        if stored is None:
            raise ApiError(400, "Bad Request: message to edit not found")
        before = self._shown.get((chat_id, message_id))
        if before is None:  # not one the bot sent
            raise ApiError(400, "Bad Request: message can't be edited")
        if before.upload is not None:
            raise ApiError(400, "Bad Request: there is no text in the message to edit")
        text = str(params.get("text", ""))
        parse_mode = params.get("parse_mode")
        visible = html_visible(text) if parse_mode == "HTML" else text
        if not visible.strip():
            raise ApiError(400, "Bad Request: message text is empty")
        if _utf16_len(visible) > MAX_TEXT:
            raise ApiError(400, "Bad Request: message is too long")
        # Telegram keeps only a keyboard the edit names: none, or an empty one, removes it.
        keyboard = _inline_keyboard(params.get("reply_markup"))
        if (shown_content(text, parse_mode), keyboard) == (before.shows, before.reply_markup):
            self.unmodified.append((chat_id, message_id, parse_mode))
            self._notify()
            raise ApiError(400, _NOT_MODIFIED)
        message = {k: v for k, v in stored.items() if k != "reply_markup"}
        message.update(text=visible, edit_date=int(time.time()))
        if keyboard is not None:
            message["reply_markup"] = keyboard
        self._messages[(chat_id, message_id)] = message
        shown = replace(
            before,
            text=text,
            parse_mode=parse_mode,
            reply_markup=keyboard,
            link_preview_options=params.get("link_preview_options"),
            at=time.monotonic(),
        )
        self._shown[(chat_id, message_id)] = shown
        self._history[(chat_id, message_id)].append(shown)
        self.edits.append(shown)
        return message

    async def _m_answercallbackquery(self, params: dict[str, Any]) -> Any:
        query_id = str(params.get("callback_query_id", ""))
        if query_id not in self._open_queries:
            raise ApiError(400, _QUERY_INVALID)
        text = params.get("text")
        if text is not None and len(str(text)) > MAX_ANSWER_TEXT:
            raise ApiError(400, "Bad Request: MESSAGE_TOO_LONG")
        self._open_queries.discard(query_id)
        alert = params.get("show_alert") in (True, "true", "True")
        answer = CallbackAnswer(query_id, None if text is None else str(text), alert)
        self.callback_answers[query_id] = answer
        return True


def _check_upload(data: bytes, kind: str) -> None:
    """What the Bot API refuses of an upload's bytes."""
    if not data:
        raise ApiError(400, "Bad Request: file must be non-empty")
    if len(data) > (PHOTO_LIMIT if kind == "photo" else UPLOAD_LIMIT):
        raise ApiError(400, "Bad Request: file is too big")
    if kind == "photo" and not data.startswith(_IMAGE_MAGIC):
        raise ApiError(400, "Bad Request: IMAGE_PROCESS_FAILED")
    if kind == "voice" and not data.startswith(b"OggS"):
        # A voice message is OGG/Opus (the Bot API takes MP3 and M4A too; not this fake).
        raise ApiError(400, "Bad Request: wrong file type of the voice message")


def _inline_keyboard(markup: Any) -> dict[str, Any] | None:
    """A reply_markup's inline keyboard, checked as Telegram checks it; None when it has no
    buttons (Telegram then shows, and returns, no keyboard)."""
    if markup is None:
        return None
    rows = markup.get("inline_keyboard") if isinstance(markup, dict) else None
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise ApiError(400, "Bad Request: can't parse reply keyboard markup JSON object")
    for button in (b for row in rows for b in row):
        if not isinstance(button, dict) or not str(button.get("text", "")).strip():
            raise ApiError(400, "Bad Request: can't parse inline keyboard button: text is empty")
        actions = button.keys() - {"text"}
        if not actions:
            raise ApiError(
                400,
                "Bad Request: can't parse inline keyboard button: "
                "Text buttons are unallowed in the inline keyboard",
            )
        data = button.get("callback_data")
        if data is not None and not 1 <= len(str(data).encode()) <= MAX_CALLBACK_DATA:
            raise ApiError(400, "Bad Request: BUTTON_DATA_INVALID")
    return {"inline_keyboard": rows} if any(rows) else None


async def _params(request: web.Request) -> dict[str, Any]:
    if request.content_type == "application/json":
        body = await request.json()
        return dict(body) if isinstance(body, dict) else {}
    form = await request.post()
    params: dict[str, Any] = {}
    for key, value in form.items():
        if isinstance(value, web.FileField):
            params[key] = UploadedFile(value.filename, value.file.read(), value.content_type)
            continue
        if key in _JSON_PARAMS:
            params[key] = json.loads(value)
        elif key in _INT_PARAMS:
            params[key] = int(value)
        else:
            params[key] = value
    return params


def _flag(value: object) -> bool:
    """A boolean parameter as PTB's form or a JSON body carries it."""
    return value is True or str(value).lower() == "true"


def _error(status: int, description: str, retry_after: float | None = None) -> web.Response:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if retry_after is not None:
        body["parameters"] = {"retry_after": retry_after}
    return web.json_response(body, status=status)
