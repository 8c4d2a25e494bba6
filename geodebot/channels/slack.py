"""Slack over Socket Mode: slack-bolt's AsyncApp behind slack_sdk's aiohttp Socket Mode client.

Acknowledgement: Bolt runs with ``process_before_response=True``, so the envelope is acked only
after our listener returned, i.e. after the sink committed the event. A sink that raises makes
the listener raise; Bolt turns that into a 500 and its Socket Mode handler sends no ack, so
Slack delivers the event again (``retry_attempt`` > 0, same ``event_id``). Dropping repeats of
one event id is the daemon's job.

``message`` and ``app_mention``: a mention in a channel the bot is in arrives twice, as two
events with different ids but the same (channel, ts). Both are listened to (a workspace may
subscribe to only one of them); the first event to claim a message delivers it and the other
is acked and dropped. A claim is released when the sink fails, so a redelivery can still win.
The claims live in memory: a restart between the two events can let both through.

Sending: the client has no retry handlers; the outbox decides about retries, and a blind SDK
retry after a timeout could post a message twice. Every message carries the part's key as
message metadata, which ``find_sent`` looks for after an unknown outcome.

Streamed replies: a part with ``edit_of`` edits that message (``chat.update``) instead of
posting one. chat.update's ``parse`` defaults to ``client``, unlike chat.postMessage's, and an
edit without it overwrites the message's own setting, so every edit says ``none``: else the
links of the final answer would be escaped into text. A message that is gone (a person
deleted the preview) cannot be edited; the part is then posted as a new message, after a
look for an earlier such post of it, so that it still arrives exactly once. A ``plain`` part
(a preview of an answer still arriving) is sent as text with &, < and > escaped, no blocks:
what the model wrote so far shows as written, never as a mention or a link.

Approval cards: a section block (the card's lines, escaped; the untrusted summary in a code
block, where Slack applies no formatting) and an actions block with an Approve and a Deny
button, whose values are the press payloads. A press arrives as a ``block_actions``
interaction. Slack shows the presser an error unless it is acked within 3 s, and it never
redelivers one, so the envelope is acked at once and the press is decided afterwards, in a
task of its own; an answer that did not count goes to the presser alone, as an ephemeral
message. The outcome shows on the card when the core edits it (the buttons go then).

Files in: a message event with ``files`` (subtype ``file_share``, or none) lists each file
with its private URL; ``to_inbound`` keeps the URL as the file's ref and downloads nothing.
``download`` fetches it with the bot token, which goes only to Slack's own file host
(``https://files.slack.com``) or to the configured API host; a redirect must stay on those
hosts too. Slack answers a token that may not read the file with its HTML sign-in page and
status 200, so an HTML answer for a file that is not HTML is an error, not the file.

Files out: the external upload, in its three steps (files.getUploadURLExternal, a POST of
the bytes to the upload URL, files.completeUploadExternal), done here step by step rather
than through the SDK's ``files_upload_v2``: the bytes stream from disk instead of being read
whole, and only the last step can have shared anything, so only its failures can be of
unknown outcome (a file uploaded but never completed is never shown). Nothing in a shared
file carries the part's key, so ``find_sent`` cannot look a file part up.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import yarl
from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
from slack_bolt.async_app import AsyncAck, AsyncApp
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from geodebot.channels.base import (
    CHAT_COMMANDS,
    ApprovalCard,
    ChannelError,
    ChannelStatus,
    Destination,
    Inbound,
    InboundFile,
    InboundSink,
    OutboundFile,
    OutboundPart,
    Platform,
    Press,
    PressSink,
    SendUnknown,
    SentPart,
    parse_press_data,
    press_data,
)
from geodebot.channels.download import platform_host, read_capped
from geodebot.channels.render import render_for
from geodebot.config.schema import SlackConfig

log = logging.getLogger(__name__)

METADATA_EVENT_TYPE = "geodebot_outbox"
# Subtypes that are a person (or bot) saying something; edits, deletions, joins and the
# like are acked and dropped.
_CONVERSATIONAL_SUBTYPES = frozenset(
    {"bot_message", "thread_broadcast", "file_share", "me_message"}
)
# fmt: off
_PERMANENT_ERRORS = frozenset({
    "channel_not_found", "not_in_channel", "is_archived", "msg_too_long", "no_text",
    "invalid_auth", "not_authed", "account_inactive", "token_revoked", "token_expired",
    "missing_scope", "no_permission", "restricted_action", "restricted_action_read_only_channel",
    "restricted_action_thread_only_channel", "restricted_action_non_threadable_channel",
    "cannot_reply_to_message", "invalid_metadata_format", "invalid_metadata_schema",
    "metadata_too_large", "team_access_not_granted", "ekm_access_denied", "invalid_arguments",
    "invalid_blocks", "invalid_blocks_format", "message_not_found", "cant_update_message",
    "edit_window_closed",
})
# fmt: on
# chat.update's answers for a message that is no longer there: deleted messages get either
# (a message we edit is always our own, so cant_update_message means it is gone too).
_GONE_ERRORS = frozenset({"message_not_found", "cant_update_message"})
# Slack documents these as "some aspect of the operation may have succeeded".
_MAYBE_DONE_ERRORS = frozenset({"internal_error", "fatal_error"})
_HISTORY_PAGES, _HISTORY_LIMIT = 2, 100
# Replies come oldest first, so the newest reply of a long thread is on the last page.
_REPLIES_PAGES, _REPLIES_LIMIT = 10, 200
_CLAIMS_KEPT = 4096
COMMAND_NAMES = frozenset(c.name for c in CHAT_COMMANDS)
APPROVE_ACTION, DENY_ACTION = "geodebot_approve", "geodebot_deny"
NOT_VALID = "This button is not valid."
SECTION_CHARS = 3000  # Slack refuses a section block whose text is longer
PRESS_FAILED = "That did not work; please try again."
# Slack's file host: url_private(_download) points there, and only there (or at the configured
# API host) does the bot token go.
FILES_HOST = "files.slack.com"
# Files Slack lists without their content: deleted ones, and ones beyond a free workspace's
# history limit.
_CONTENTLESS_MODES = frozenset({"tombstone", "hidden_by_limit"})
_MAX_REDIRECTS = 3


def to_inbound(
    body: Mapping[str, Any], bot_user_id: str, bot_id: str | None = None
) -> Inbound | None:
    """An Events API ``event_callback`` body as an Inbound, or None for events we do not act on."""
    event = body.get("event")
    if not isinstance(event, Mapping) or event.get("type") not in ("message", "app_mention"):
        return None
    subtype = event.get("subtype")
    if (subtype is not None and subtype not in _CONVERSATIONAL_SUBTYPES) or event.get("hidden"):
        return None
    channel, ts = event.get("channel"), event.get("ts")
    if not channel or not ts or not _strings(event, "channel", "ts", "text", "thread_ts"):
        return None
    if not _strings(event, "user", "bot_id"):
        return None  # a sender we cannot name is not let through as "nobody"
    text = str(event.get("text") or "")
    sender_bot = event.get("bot_id")
    user = str(event.get("user") or sender_bot or "")
    profile = event.get("user_profile")
    name = ""
    if isinstance(profile, Mapping):
        name = str(profile.get("display_name") or profile.get("real_name") or "")
    mention = f"<@{bot_user_id}>"
    return Inbound(
        platform="slack",
        event_id=str(body.get("event_id") or f"{channel}:{ts}"),
        channel=str(channel),
        thread=str(event["thread_ts"]) if event.get("thread_ts") else None,
        user=user,
        text=text,
        message_id=str(ts),
        user_name=name or str(event.get("username") or ""),
        is_bot=bool(sender_bot) or subtype == "bot_message",
        is_self=(bool(bot_user_id) and user == bot_user_id)
        or (bot_id is not None and sender_bot == bot_id),
        mentions_bot=event.get("type") == "app_mention"
        or mention in text
        or f"<@{bot_user_id}|" in text,
        is_dm=event.get("channel_type") == "im",
        ts=_float(ts),
        files=files_of(event),
    )


def files_of(event: Mapping[str, Any]) -> tuple[InboundFile, ...]:
    """The downloadable files of a message event, as Slack describes them: the ref is the
    private download URL (else the private URL); a file without either, or deleted, or
    hidden by a workspace limit, is left out."""
    files = event.get("files")
    if not isinstance(files, list):
        return ()
    found: list[InboundFile] = []
    for item in files:
        if not isinstance(item, Mapping) or item.get("mode") in _CONTENTLESS_MODES:
            continue
        url = item.get("url_private_download") or item.get("url_private")
        if not isinstance(url, str) or not url:
            continue
        name = next(
            (v for k in ("name", "title", "id") if isinstance(v := item.get(k), str) and v),
            "file",
        )
        media_type = item.get("mimetype")
        size = item.get("size")
        found.append(
            InboundFile(
                ref=url,
                name=name,
                media_type=media_type if isinstance(media_type, str) else "",
                size=size
                if isinstance(size, int) and not isinstance(size, bool) and size > 0
                else 0,
            )
        )
    return tuple(found)


def _strings(event: Mapping[str, Any], *keys: str) -> bool:
    """Whether each of ``keys`` is absent or a string: a broken payload (a list for a ts, an
    object for the text) is dropped, not turned into text by str()."""
    return all(isinstance(event.get(key), str | None) for key in keys)


def command_to_inbound(body: Mapping[str, Any]) -> Inbound | None:
    """A slash command payload as an Inbound addressed to the bot, or None for one not ours.

    The commands (``/help``, ``/status``, ``/stop``, ``/reset``) are declared in the Slack app's
    manifest; Socket Mode delivers them like events. A command has no message to reply to, so
    the answer goes to the channel, and its ``trigger_id`` is the event id.
    """
    name = str(body.get("command") or "").lstrip("/")
    channel, user, trigger = body.get("channel_id"), body.get("user_id"), body.get("trigger_id")
    if name not in COMMAND_NAMES or not channel or not user or not trigger:
        return None
    text = f"/{name} {body.get('text') or ''}".strip()
    return Inbound(
        platform="slack",
        event_id=f"command:{trigger}",
        channel=str(channel),
        thread=None,
        user=str(user),
        text=text,
        message_id="",
        user_name=str(body.get("user_name") or ""),
        mentions_bot=True,
        is_dm=str(channel).startswith("D"),
    )


@dataclass(frozen=True, slots=True)
class Presser:
    """Who pressed a button, and where a private answer to them goes."""

    channel: str
    user: str
    thread: str | None  # the card's thread: an ephemeral answer shows next to the card


def presser_of(body: Mapping[str, Any]) -> Presser | None:
    """The presser of a ``block_actions`` payload, or None when it names no user or channel."""
    container, message = _member(body, "container"), _member(body, "message")
    user_id = _member(body, "user").get("id")
    channel_id = _member(body, "channel").get("id") or container.get("channel_id")
    if not (isinstance(user_id, str) and user_id and isinstance(channel_id, str) and channel_id):
        return None
    thread = container.get("thread_ts") or message.get("thread_ts")
    return Presser(channel_id, user_id, thread if isinstance(thread, str) and thread else None)


def _member(body: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = body.get(key)
    return value if isinstance(value, Mapping) else {}


def to_press(body: Mapping[str, Any]) -> Press | None:
    """A ``block_actions`` payload as a Press, or None for a button that is not a card's."""
    presser = presser_of(body)
    actions = body.get("actions")
    action = actions[0] if isinstance(actions, list) and actions else None
    if presser is None or not isinstance(action, Mapping):
        return None
    value = action.get("value")
    parsed = parse_press_data(value) if isinstance(value, str) else None
    if parsed is None:
        return None
    approval_id, approve = parsed
    # The value decides, but only on the button that says the same: a layout mix-up must not
    # turn a press on Deny into an approval.
    if action.get("action_id") != (APPROVE_ACTION if approve else DENY_ACTION):
        return None
    ts = _member(body, "container").get("message_ts") or _member(body, "message").get("ts")
    return Press(
        platform="slack",
        channel=presser.channel,
        user=presser.user,
        approval_id=approval_id,
        approve=approve,
        message_id=ts if isinstance(ts, str) else "",
    )


def card_blocks(card: ApprovalCard) -> list[dict[str, Any]]:
    """The card as Block Kit blocks: its text, and the two buttons while it is undecided."""
    # verbatim: no auto-linking of URLs, channel names or mentions in what the model wrote.
    section = {"type": "mrkdwn", "text": card_mrkdwn(card), "verbatim": True}
    blocks: list[dict[str, Any]] = [{"type": "section", "text": section}]
    if card.outcome is None:
        buttons = [
            _button(APPROVE_ACTION, "Approve", press_data(card.approval_id, True), "primary"),
            _button(DENY_ACTION, "Deny", press_data(card.approval_id, False), "danger"),
        ]
        blocks.append({"type": "actions", "block_id": "geodebot_card", "elements": buttons})
    return blocks


def card_mrkdwn(card: ApprovalCard) -> str:
    """The card's lines as a section's mrkdwn, within Slack's limit for one (else the whole
    card is refused): a summary that escaping made too long is shortened."""
    shown = card.summary
    text = _mrkdwn_lines(card)
    while len(text) > SECTION_CHARS and shown:
        shown = shown[: len(shown) // 2]
        text = _mrkdwn_lines(replace(card, summary=shown + "…"))
    return text[:SECTION_CHARS]


def _mrkdwn_lines(card: ApprovalCard) -> str:
    # lines() writes the summary as "Arguments: ..."; that line shows it as code instead.
    summary_line = f"Arguments: {card.summary}"
    return "\n".join(
        f"Arguments:\n{_code_block(card.summary)}" if line == summary_line else _escape(line)
        for line in card.lines()
    )


def card_text(card: ApprovalCard) -> str:
    """The card's fallback text, shown in notifications and by clients without blocks."""
    return "\n".join(_escape(line) for line in card.lines())


def _button(action_id: str, label: str, value: str, style: str) -> dict[str, Any]:
    text = {"type": "plain_text", "text": label, "emoji": False}
    return {"type": "button", "action_id": action_id, "text": text, "value": value, "style": style}


def _escape(text: str) -> str:
    """&, < and > as Slack wants them in any text it parses (else ``<!here>`` pings)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _code_block(text: str) -> str:
    # Slack has no longer fences: a ``` inside gets zero-width spaces or it would end the block.
    text = re.sub(r"`{3,}", lambda m: "\u200b".join(m[0]), text)
    return f"```\n{_escape(text)}\n```"


class SlackChannel:
    """The Slack adapter; tokens are resolved by the caller (``config.*_env`` name them)."""

    def __init__(
        self,
        config: SlackConfig,
        *,
        bot_token: str,
        app_token: str,
        ping_interval_s: float = 10.0,
        request_timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        stop_grace_s: float = 2.0,
    ) -> None:
        self._config = config
        self._bot_token = bot_token
        self._app_token = app_token
        self._ping_interval = ping_interval_s
        self._request_timeout = request_timeout_s
        self._connect_timeout = connect_timeout_s
        self._stop_grace = stop_grace_s
        self._session: aiohttp.ClientSession | None = None
        self._client: AsyncWebClient | None = None
        self._handler: AsyncSocketModeHandler | None = None
        self._sink: InboundSink | None = None
        self._presses: PressSink | None = None
        self._bot_user_id = ""
        self._bot_id: str | None = None
        self._claims: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._inflight: set[asyncio.Task[Any]] = set()
        self._stopping = False
        names = (
            "received delivered ignored duplicates sink_errors errors sent send_errors"
            " presses press_errors edited edits_gone downloads download_errors uploads"
        )
        self._counters: dict[str, int] = dict.fromkeys(names.split(), 0)

    @property
    def platform(self) -> Platform:
        return "slack"

    @property
    def bot_user_id(self) -> str:
        return self._bot_user_id

    @property
    def ingesting(self) -> bool:
        """Whenever started: Slack spreads events over every replica's connection."""
        return self._handler is not None

    async def start_ingest(self) -> None:
        """Nothing to add: ``start`` already opened the Socket Mode connection."""

    async def start(self, sink: InboundSink, presses: PressSink | None = None) -> None:
        if self._handler is not None:
            raise RuntimeError("SlackChannel already started")
        self._sink = sink
        self._presses = presses
        self._stopping = False
        # Both SDK clients need a running loop at construction (aiohttp sessions, and the
        # Socket Mode client starts its message processor task in __init__).
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._request_timeout)
        )
        self._client = AsyncWebClient(
            token=self._bot_token,
            base_url=self._config.api_base_url,
            session=self._session,
            retry_handlers=[],
        )
        try:
            auth = await self._client.auth_test()
            self._bot_user_id = str(auth.get("user_id") or "")
            self._bot_id = auth.get("bot_id")
            self._handler = AsyncSocketModeHandler(
                self._build_app(self._client), self._app_token, ping_interval=self._ping_interval
            )
            # Asking for the URL ourselves turns a bad app token into an error here; the SDK's
            # connect() would retry it forever.
            self._handler.client.wss_uri = await self._handler.client.issue_new_wss_url()
            async with asyncio.timeout(self._connect_timeout):
                await self._handler.connect_async()  # type: ignore[no-untyped-call]  # slack-bolt
        except BaseException as exc:
            await self._close()
            if isinstance(exc, TimeoutError):
                raise ChannelError("Slack: Socket Mode did not connect in time") from exc
            if isinstance(exc, SlackClientError | aiohttp.ClientError):
                raise _to_channel_error(exc, "start") from exc
            raise
        log.info("slack: connected as %s", self._bot_user_id)

    def _build_app(self, client: AsyncWebClient) -> AsyncApp:
        app = AsyncApp(
            name="geodebot.slack",
            client=client,  # carries the bot token; passing token= too only earns a warning
            process_before_response=True,
            # Socket Mode has no signatures, url_verification or ssl_check requests.
            request_verification_enabled=False,
            url_verification_enabled=False,
            ssl_check_enabled=False,
            attaching_function_token_enabled=False,
            attaching_conversation_kwargs_enabled=False,
        )

        async def on_message(body: dict[str, Any]) -> None:
            await self._deliver(body)

        async def on_command(ack: AsyncAck, body: dict[str, Any]) -> None:
            # Acked only once committed; a failed commit shows the user Slack's own error.
            await self._deliver_command(body)
            await ack()

        async def on_press(ack: AsyncAck, body: dict[str, Any]) -> None:
            # Acked before deciding: Slack never redelivers an interaction, and the presser
            # gets an answer either way (see _answer_press).
            await ack()
            self._spawn(self._answer_press(body))

        async def on_other(body: dict[str, Any]) -> None:
            # An unhandled event is answered 404 by Bolt, i.e. never acked and redelivered.
            self._counters["ignored"] += 1

        async def on_error(error: Exception, body: dict[str, Any]) -> None:
            # A failed commit, or a payload Bolt itself cannot read (Slack gives up on those
            # after its three retries).
            self._counters["errors"] += 1
            event_id = body.get("event_id") if isinstance(body, dict) else None
            log.warning(
                "slack: event %s not acknowledged, Slack will redeliver: %r", event_id, error
            )

        app.event("message")(on_message)
        app.event("app_mention")(on_message)
        app.event(re.compile(".*"))(on_other)
        app.command(re.compile(".*"))(on_command)
        for action_id in (APPROVE_ACTION, DENY_ACTION):
            app.action({"type": "block_actions", "action_id": action_id})(on_press)
        app.error(on_error)
        return app

    async def _deliver(self, body: dict[str, Any]) -> None:
        self._counters["received"] += 1
        if self._stopping or self._sink is None:
            # Raising (not returning) keeps Bolt from acking what was never committed.
            raise ChannelError("Slack channel is stopping")
        inbound = to_inbound(body, self._bot_user_id, self._bot_id)
        if inbound is None:
            self._counters["ignored"] += 1
            return
        key = (inbound.channel, inbound.message_id)
        owner = self._claims.get(key)
        if owner is not None and owner != inbound.event_id:
            self._counters["duplicates"] += 1
            return
        self._claims[key] = inbound.event_id
        self._claims.move_to_end(key)
        while len(self._claims) > _CLAIMS_KEPT:
            self._claims.popitem(last=False)
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            await self._sink(inbound)
        except BaseException:
            if self._claims.get(key) == inbound.event_id:
                del self._claims[key]
            self._counters["sink_errors"] += 1
            raise
        finally:
            self._inflight.discard(task)
        self._counters["delivered"] += 1

    async def _deliver_command(self, body: dict[str, Any]) -> None:
        self._counters["received"] += 1
        if self._stopping or self._sink is None:
            raise ChannelError("Slack channel is stopping")
        inbound = command_to_inbound(body)
        if inbound is None:
            self._counters["ignored"] += 1
            return
        try:
            await self._sink(inbound)
        except BaseException:
            self._counters["sink_errors"] += 1
            raise
        self._counters["delivered"] += 1

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        # Kept until done: the loop holds tasks weakly, and stop() waits for these too.
        self._inflight.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._counters["press_errors"] += 1
            log.error("slack: a button press was not answered", exc_info=task.exception())

    async def _answer_press(self, body: dict[str, Any]) -> None:
        """Decide a press and answer the presser; nothing here reaches the receive loop."""
        self._counters["presses"] += 1
        presser = presser_of(body)
        if presser is None:
            self._counters["ignored"] += 1
            log.warning("slack: a button press without a user or channel was dropped")
            return
        text = await self._decide(to_press(body))
        if text is not None:
            await self._tell(presser, text)

    async def _decide(self, press: Press | None) -> str | None:
        """What the presser is told privately; None when the press counted (the card's edit
        shows it to everyone)."""
        if press is None or self._presses is None:
            return NOT_VALID
        if self._stopping:
            return PRESS_FAILED
        try:
            answer = await self._presses(press)
        except Exception:
            # The press sink is not supposed to raise: this is its one catch-all.
            self._counters["press_errors"] += 1
            log.exception("slack: the press on approval %s failed", press.approval_id)
            return PRESS_FAILED
        return None if answer.counted else answer.text

    async def _tell(self, presser: Presser, text: str) -> None:
        client = self._client
        if client is None:
            return
        try:
            await client.chat_postEphemeral(
                channel=presser.channel,
                user=presser.user,
                text=_escape(text),
                thread_ts=presser.thread,
            )
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            # Nothing to retry for: the presser may press again.
            self._counters["press_errors"] += 1
            log.warning(
                "slack: the answer to a press was not sent: %s",
                _to_channel_error(exc, "chat.postEphemeral"),
            )

    async def stop(self) -> None:
        # In-flight sink calls get a moment to commit and be acked over the still-open socket;
        # whatever is cut off is not acked and comes again after a restart.
        self._stopping = True
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=self._stop_grace)
        late = set(self._inflight)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        await self._close()

    async def _close(self) -> None:
        handler, self._handler = self._handler, None
        if handler is not None:
            await handler.close_async()  # type: ignore[no-untyped-call]  # slack-bolt lacks a hint
            sm = handler.client
            # close() only cancels the client's tasks; awaiting them keeps teardown quiet.
            tasks = [t for t in (sm.message_processor, sm.current_session_monitor) if t]
            if sm.message_receiver is not None:
                tasks.append(sm.message_receiver)
            await asyncio.gather(*tasks, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        self._client = None

    def render(self, markdown: str) -> list[str]:
        return render_for("slack", markdown)

    async def send(self, part: OutboundPart) -> SentPart:
        if part.file is not None:
            return await self._upload(part, part.file)
        if part.edit_of is not None:
            if await self._edit(part, part.edit_of):
                return SentPart(part.edit_of)
            # An outcome unknown earlier may have posted it already: found, it is not posted
            # again (the outbox repeats an edit without looking, as an edit is harmless).
            found = await self.find_sent(part)
            if found is not None:
                return found
        return await self._post(part)

    async def _post(self, part: OutboundPart) -> SentPart:
        client = self._require_client()
        dest = part.destination
        response = await self._call(
            "chat.postMessage",
            client.chat_postMessage(
                channel=dest.channel,
                text=_part_text(part),
                thread_ts=_thread_ts(dest),
                # Left on for a plain part too: its message becomes the final answer by an
                # edit, and chat.update has no way to switch mrkdwn back on.
                mrkdwn=True,
                metadata=_part_metadata(part),
            ),
        )
        return SentPart(str(response["ts"]))

    async def _edit(self, part: OutboundPart, ts: str) -> bool:
        """Edit message ``ts`` to the part; False when Slack says the message is gone."""
        client = self._require_client()
        try:
            await self._call(
                "chat.update",
                client.chat_update(
                    channel=part.destination.channel,
                    ts=ts,
                    text=_part_text(part),
                    parse="none",
                    # The message now carries this part's key: find_sent finds it by that.
                    metadata=_part_metadata(part),
                ),
            )
        except ChannelError as exc:
            cause = exc.__cause__
            if isinstance(cause, SlackApiError) and _error_code(cause) in _GONE_ERRORS:
                self._counters["edits_gone"] += 1
                log.info("slack: message %s is gone; part %s is posted anew", ts, part.key)
                return False
            raise
        self._counters["edited"] += 1
        return True

    async def _upload(self, part: OutboundPart, file: OutboundFile) -> SentPart:
        """Upload ``file`` and share it in the part's chat with the part's text as its comment.

        Until the last step nothing is shown to anyone, so a failure before it is a plain
        ChannelError (worth retrying unless permanent) and never an unknown outcome.
        """
        client, session = self._require_client(), self._require_session()
        dest = part.destination
        try:
            length = file.path.stat().st_size
        except OSError as exc:
            raise ChannelError(
                f"Slack upload: cannot read the file: {exc}", permanent=True
            ) from exc
        try:
            ticket = await client.files_getUploadURLExternal(filename=file.name, length=length)
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            self._counters["send_errors"] += 1
            raise _not_sent(_to_channel_error(exc, "files.getUploadURLExternal")) from exc
        file_id, upload_url = ticket.get("file_id"), ticket.get("upload_url")
        if not isinstance(file_id, str) or not isinstance(upload_url, str):
            self._counters["send_errors"] += 1
            raise ChannelError("Slack files.getUploadURLExternal: no upload URL in the answer")
        await self._post_bytes(session, upload_url, file, length)
        response = await self._call(
            "files.completeUploadExternal",
            client.files_completeUploadExternal(
                files=[{"id": file_id, "title": file.name}],
                channel_id=dest.channel,
                thread_ts=_thread_ts(dest),
                initial_comment=part.text or None,
            ),
        )
        self._counters["uploads"] += 1
        return SentPart(_share_ts(response.get("files"), dest.channel) or file_id)

    async def _post_bytes(
        self, session: aiohttp.ClientSession, url: str, file: OutboundFile, length: int
    ) -> None:
        """Step two of an upload: the bytes, streamed from disk, to the URL Slack gave."""
        # The whole request may take long for a large file; each read may not.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._request_timeout, sock_read=self._request_timeout
        )
        try:
            body = file.path.open("rb")
        except OSError as exc:
            self._counters["send_errors"] += 1
            raise ChannelError(
                f"Slack upload: cannot read the file: {exc}", permanent=True
            ) from exc
        headers = {"Content-Type": "application/octet-stream"}
        try:
            with body:
                async with session.post(url, data=body, headers=headers, timeout=timeout) as resp:
                    status = resp.status
                    retry_after = resp.headers.get("Retry-After")
                    await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._counters["send_errors"] += 1
            raise ChannelError(f"Slack file upload: {type(exc).__name__}: {exc}") from exc
        if status == 200:
            return
        self._counters["send_errors"] += 1
        message = f"Slack file upload: HTTP {status}"
        if status == 429:
            raise ChannelError(message, retry_after=_float(retry_after, default=1.0))
        raise ChannelError(message, permanent=400 <= status < 500 and status != 408)

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        session = self._require_session()
        api = yarl.URL(self._config.api_base_url)
        try:
            url = yarl.URL(file.ref)
        except (TypeError, ValueError) as exc:
            raise ChannelError("Slack file download: not a URL", permanent=True) from exc
        # The token travels in a header, never in the URL, so the URL may be logged.
        auth = {"Authorization": f"Bearer {self._bot_token}"}
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._request_timeout, sock_read=self._request_timeout
        )
        try:
            for _ in range(_MAX_REDIRECTS + 1):
                if not file_host_allowed(url, api):
                    self._counters["download_errors"] += 1
                    raise ChannelError(
                        f"Slack file download: {url.host or url} is not Slack's file host",
                        permanent=True,
                    )
                async with session.get(
                    url, headers=auth, allow_redirects=False, timeout=timeout
                ) as resp:
                    location = resp.headers.get("Location")
                    if resp.status in (301, 302, 303, 307, 308) and location:
                        url = url.join(yarl.URL(location))
                        continue
                    data = await self._read_file(resp, file, max_bytes)
                    self._counters["downloads"] += 1
                    return data
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._counters["download_errors"] += 1
            raise ChannelError(f"Slack file download: {type(exc).__name__}: {exc}") from exc
        self._counters["download_errors"] += 1
        raise ChannelError("Slack file download: too many redirects", permanent=True)

    async def _read_file(
        self, resp: aiohttp.ClientResponse, file: InboundFile, max_bytes: int
    ) -> bytes:
        """The body of a file's answer, read no further than ``max_bytes``."""
        status = resp.status
        if status != 200:
            self._counters["download_errors"] += 1
            message = f"Slack file download: HTTP {status}"
            if status == 429:
                retry_after = _float(resp.headers.get("Retry-After"), default=1.0)
                raise ChannelError(message, retry_after=retry_after)
            raise ChannelError(message, permanent=status < 500 and status != 408)
        if resp.content_type == "text/html" and not file.media_type.startswith("text/html"):
            self._counters["download_errors"] += 1
            raise ChannelError(
                "Slack file download: Slack answered with a web page, not the file"
                " (does the bot token have the files:read scope?)",
                permanent=True,
            )
        return await read_capped(resp, max_bytes)

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        client = self._require_client()
        response = await self._call(
            "chat.postMessage",
            client.chat_postMessage(
                channel=destination.channel,
                text=card_text(card),
                blocks=card_blocks(card),
                thread_ts=_thread_ts(destination),
            ),
        )
        return SentPart(str(response["ts"]))

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        client = self._require_client()
        # The blocks replace the message's blocks as a whole, so an outcome's card has no
        # actions block left: its buttons are gone for everyone.
        await self._call(
            "chat.update",
            client.chat_update(
                channel=destination.channel,
                ts=message_id,
                text=card_text(card),
                blocks=card_blocks(card),
                parse="none",  # as posted (see the module docstring)
            ),
        )

    async def delete(self, destination: Destination, message_id: str) -> None:
        client = self._require_client()
        try:
            await client.chat_delete(channel=destination.channel, ts=message_id)
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            self._counters["send_errors"] += 1
            raise _to_channel_error(exc, "chat.delete") from exc

    async def _call(self, what: str, request: Awaitable[AsyncSlackResponse]) -> AsyncSlackResponse:
        """One request that posts or changes a message, with Slack's errors as ours."""
        try:
            response = await request
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            self._counters["send_errors"] += 1
            raise _to_channel_error(exc, what) from exc
        self._counters["sent"] += 1
        return response

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        if part.file is not None:
            # completeUploadExternal takes no metadata, and nothing else in a share may carry
            # the key without showing it to the chat.
            raise NotImplementedError("Slack cannot look up a shared file by its key")
        client = self._require_client()
        dest = part.destination
        thread = _thread_ts(dest)
        pages, limit = (
            (_REPLIES_PAGES, _REPLIES_LIMIT) if thread else (_HISTORY_PAGES, _HISTORY_LIMIT)
        )
        cursor: str | None = None
        try:
            for _ in range(pages):
                if thread:
                    response = await client.conversations_replies(
                        channel=dest.channel,
                        ts=thread,
                        include_all_metadata=True,
                        limit=limit,
                        cursor=cursor,
                    )
                else:
                    response = await client.conversations_history(
                        channel=dest.channel, include_all_metadata=True, limit=limit, cursor=cursor
                    )
                for message in response.get("messages") or []:
                    if self._carries_key(message, part.key):
                        return SentPart(str(message["ts"]))
                cursor = (response.get("response_metadata") or {}).get("next_cursor")
                if not cursor:
                    break
        except SlackApiError as exc:
            if _error_code(exc) == "thread_not_found":
                return None
            raise _to_channel_error(exc, "find_sent") from exc
        except (SlackClientError, aiohttp.ClientError, TimeoutError) as exc:
            raise _to_channel_error(exc, "find_sent") from exc
        return None

    def _carries_key(self, message: Mapping[str, Any], key: str) -> bool:
        sender = message.get("bot_id")
        if sender is not None and self._bot_id is not None and sender != self._bot_id:
            return False  # metadata is app-written, but only ours counts
        metadata = message.get("metadata")
        if not isinstance(metadata, Mapping) or metadata.get("event_type") != METADATA_EVENT_TYPE:
            return False
        payload = metadata.get("event_payload")
        return isinstance(payload, Mapping) and payload.get("key") == key

    async def typing(self, destination: Destination) -> None:
        # Slack offers bots no typing indicator outside RTM (retired, and not Socket Mode);
        # assistant.threads.setStatus needs the AI-app feature and an assistant thread.
        return None

    def status(self) -> ChannelStatus:
        sm = self._handler.client if self._handler is not None else None
        ws = sm.current_session if sm is not None else None
        connected = sm is not None and not sm.closed and ws is not None and not ws.closed
        detail = f"bot {self._bot_user_id}" if self._bot_user_id else "not started"
        return ChannelStatus("slack", connected, detail, dict(self._counters))

    def _require_client(self) -> AsyncWebClient:
        if self._client is None:
            raise ChannelError("Slack channel is not started")
        return self._client

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise ChannelError("Slack channel is not started")
        return self._session


def file_host_allowed(url: yarl.URL, api_base: yarl.URL) -> bool:
    """Whether the bot token may go to ``url``: Slack's file host over https, or the host of
    the configured API (the same scheme, host and port: a proxy or a test's fake)."""
    return platform_host(url, (FILES_HOST,), api_base)


def _share_ts(files: object, channel: str) -> str | None:
    """The ts of the message that shared the (one) uploaded file in ``channel``, when the
    answer already lists it (Slack shares asynchronously, so it may not)."""
    if not isinstance(files, list) or not files or not isinstance(files[0], Mapping):
        return None
    shares = files[0].get("shares")
    if not isinstance(shares, Mapping):
        return None
    for scope in ("public", "private"):
        in_scope = shares.get(scope)
        places = in_scope.get(channel) if isinstance(in_scope, Mapping) else None
        if isinstance(places, list) and places and isinstance(places[0], Mapping):
            ts = places[0].get("ts")
            if isinstance(ts, str) and ts:
                return ts
    return None


def _not_sent(error: ChannelError) -> ChannelError:
    """An error of a step before anything was shown: never an unknown outcome."""
    if not isinstance(error, SendUnknown):
        return error
    return ChannelError(str(error), retry_after=error.retry_after, permanent=error.permanent)


def _part_text(part: OutboundPart) -> str:
    # A plain part is not rendered: escaping alone keeps its text from being parsed.
    return _escape(part.text) if part.plain else part.text


def _part_metadata(part: OutboundPart) -> dict[str, Any]:
    return {"event_type": METADATA_EVENT_TYPE, "event_payload": {"key": part.key}}


def _thread_ts(dest: Destination) -> str | None:
    """Replies go into the thread of the message they answer, except top-level DM messages.

    Slack DM channel ids start with D; a DM is a one-to-one chat where a thread per answer
    only hides the reply.
    """
    if dest.thread:
        return dest.thread
    if dest.reply_to and not dest.channel.startswith("D"):
        return dest.reply_to
    return None


def _error_code(exc: SlackApiError) -> str:
    data = getattr(exc.response, "data", None)
    return str(data.get("error") or "") if isinstance(data, dict) else ""


def _to_channel_error(exc: BaseException, what: str) -> ChannelError:
    if isinstance(exc, SlackApiError):
        resp = exc.response
        status = int(getattr(resp, "status_code", None) or getattr(resp, "status", 0) or 0)
        code = _error_code(exc)
        message = f"Slack {what}: {code or 'HTTP ' + str(status)}"
        if status == 429 or code == "ratelimited":
            headers = getattr(resp, "headers", None) or {}
            retry_after = _float(headers.get("Retry-After"), default=1.0)
            return ChannelError(message, retry_after=retry_after)
        if code in _MAYBE_DONE_ERRORS or (status >= 500 and not code):
            return SendUnknown(message)
        return ChannelError(message, permanent=code in _PERMANENT_ERRORS)
    if isinstance(exc, aiohttp.ClientConnectorError):
        # No connection was made, so nothing reached Slack.
        return ChannelError(f"Slack {what}: cannot connect: {exc}")
    if isinstance(exc, aiohttp.ClientError | TimeoutError):
        return SendUnknown(f"Slack {what}: {type(exc).__name__}: {exc}")
    return ChannelError(f"Slack {what}: {type(exc).__name__}: {exc}", permanent=True)


def _float(value: object, default: float = 0.0) -> float:
    try:
        return float(str(value))
    except ValueError:
        return default
