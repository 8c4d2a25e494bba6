"""What every chat platform adapter is, in geodebot's own types.

An adapter owns one platform SDK client and nothing else: it turns SDK events into
:class:`Inbound` (``to_inbound``), hands them to an :data:`InboundSink` that commits them to
the inbox, acknowledges the platform only after the sink returned, and sends
:class:`OutboundPart` s it is given (``render`` turns our markdown into the platform's format
and splits it at the platform's limit). The engine never sees an SDK type.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

Platform = Literal["telegram", "slack", "discord"]

# The largest file a bot may upload, per platform: Telegram's Bot API takes 50 MB through
# sendDocument, Discord 10 MiB per message for a bot without boosts, Slack 1 GB.
UPLOAD_LIMITS: Mapping[str, int] = {
    "telegram": 50 * 1000 * 1000,
    "discord": 10 * 1024 * 1024,
    "slack": 1000 * 1000 * 1000,
}
# Telegram's photos (sendPhoto) are smaller still; a larger image goes as a document.
TELEGRAM_PHOTO_LIMIT = 10 * 1000 * 1000


@dataclass(frozen=True, slots=True)
class InboundFile:
    """A file or image a user sent with a message, as the platform describes it: nothing of
    it is downloaded yet, and nothing of it is trusted (name, type and size are the sender's
    word until the bytes are checked)."""

    # What the adapter needs to download it (see Files.download): Telegram's file_id, Slack's
    # url_private_download, Discord's attachment URL.
    ref: str
    name: str
    media_type: str = ""  # as the platform says; "" unknown
    size: int = 0  # bytes as the platform says; 0 unknown
    # Audio: its length in seconds as the platform announced it (0 unknown), checked against
    # [voice] max_seconds before anything is downloaded.
    duration: float = 0.0
    # A voice note recorded in the app (Telegram voice, Slack audio clip, Discord voice
    # message), not an audio file that was attached; both are transcribed.
    voice: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ref": self.ref,
            "name": self.name,
            "media_type": self.media_type,
            "size": self.size,
        }
        if self.duration:
            out["duration"] = self.duration
        if self.voice:
            out["voice"] = True
        return out

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> InboundFile:
        return InboundFile(
            str(data["ref"]),
            str(data.get("name", "")),
            str(data.get("media_type", "")),
            int(data.get("size", 0) or 0),
            float(data.get("duration", 0) or 0),
            bool(data.get("voice", False)),
        )


@dataclass(frozen=True, slots=True)
class OutboundFile:
    """A file to upload with a message (``send_file``): the bytes are at ``path``, a copy in
    the state directory's file store that nothing changes after it was queued."""

    path: Path
    name: str
    media_type: str
    size: int
    # A spoken answer: sent as the platform's voice message where it has one (Telegram
    # sendVoice, OGG/Opus), else as an audio file.
    voice: bool = False


class FileTooLarge(Exception):
    """A download stopped because the file is larger than the limit it was given."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        super().__init__(f"larger than {limit} bytes" + (f" ({size} bytes)" if size else ""))
        self.limit = limit
        self.size = size


@dataclass(frozen=True, slots=True)
class Inbound:
    """One chat message (or slash command) as geodebot sees it."""

    platform: Platform
    # Unique per platform for this delivery: Telegram update_id, Slack event_id, Discord
    # message id (or interaction id). Redeliveries carry the same id.
    event_id: str
    channel: str  # Telegram chat id, Slack channel id, Discord channel id
    # Slack thread_ts, Telegram message_thread_id (forum topic); None outside threads.
    thread: str | None
    user: str  # the sender's platform user id
    text: str
    message_id: str  # the platform's id of the message, to reply to it
    user_name: str = ""
    is_bot: bool = False  # sent by a bot (any bot, this one included)
    is_self: bool = False  # sent by this bot
    mentions_bot: bool = False
    is_dm: bool = False
    ts: float = 0.0
    # Files and images sent with the message (the text is then their caption, maybe empty).
    files: tuple[InboundFile, ...] = ()


@dataclass(frozen=True, slots=True)
class Destination:
    platform: Platform
    channel: str
    thread: str | None = None
    reply_to: str | None = None  # message id to answer (Telegram reply, Slack thread root)


@dataclass(frozen=True, slots=True)
class OutboundPart:
    """One platform message of a reply: already rendered and within the platform's limit."""

    destination: Destination
    text: str
    # Stable across retries and restarts: the idempotency handle for reconciliation
    # (Discord nonce, Slack message metadata). Unique per (outbox row, part index).
    key: str
    index: int = 0
    count: int = 1
    # The message this part replaces (a streamed preview): that message is edited to this
    # text instead of a new one being sent; an edit repeated is harmless. If the message is
    # gone, the part is sent as a new message.
    edit_of: str | None = None
    # Plain text, shown as is (no markup): a preview of an answer still arriving, whose
    # markup may be cut anywhere.
    plain: bool = False
    # A file uploaded with this part, ``text`` (one rendered part, maybe empty) its caption.
    # Such a part is always the only part of its message and never an edit.
    file: OutboundFile | None = None


@dataclass(frozen=True, slots=True)
class SentPart:
    message_id: str


@dataclass(frozen=True, slots=True)
class ApprovalCard:
    """A request for a person's decision on one tool call, as a chat message with two buttons
    (Approve and Deny, neither the default). Each platform renders it in its own markup;
    ``outcome`` set means it was decided (or expired): shown instead of the buttons."""

    approval_id: str  # unguessable; the buttons carry it (see press_data)
    tool: str
    safety: str
    summary: str  # the arguments, redacted and shortened
    approvers: tuple[str, ...]  # platform user ids
    expires_at: float  # epoch seconds
    outcome: str | None = None

    def lines(self) -> list[str]:
        """The card's text, plain (each adapter may format it further)."""
        head = f"Approval needed: {self.tool} ({self.safety})"
        lines = [head, f"Arguments: {self.summary}"]
        lines.append("May decide: " + ", ".join(self.approvers))
        if self.outcome is None:
            lines.append("Expires: " + utc_minute(self.expires_at))
        else:
            lines.append(self.outcome)
        return lines


# Button payloads: "gb:a:<id>" approves, "gb:d:<id>" denies. Telegram's callback_data holds
# 64 bytes, Slack's value and Discord's custom_id 100: an id of up to 40 characters fits all.
_PRESS_PREFIX = "gb:"


def press_data(approval_id: str, approve: bool) -> str:
    return f"{_PRESS_PREFIX}{'a' if approve else 'd'}:{approval_id}"


def parse_press_data(data: str) -> tuple[str, bool] | None:
    """(approval id, approve) from a button's payload; None for anything that is not ours."""
    if not data.startswith(_PRESS_PREFIX):
        return None
    choice, _, approval_id = data[len(_PRESS_PREFIX) :].partition(":")
    if choice not in ("a", "d") or not 1 <= len(approval_id) <= 40:
        return None
    return approval_id, choice == "a"


@dataclass(frozen=True, slots=True)
class Press:
    """Somebody pressed a card's button. Nothing about it is trusted: the id may be forged,
    the card expired, the presser not an approver (see chat/approvals.py)."""

    platform: Platform
    channel: str
    user: str
    approval_id: str
    approve: bool
    message_id: str = ""  # the card's message, as the platform reports it


@dataclass(frozen=True, slots=True)
class PressAnswer:
    """What the presser alone is told. ``counted``: the press decided the request (the card
    is edited for everyone); otherwise nothing changed and the text says why, privately
    (Telegram callback alert, Slack ephemeral message, Discord ephemeral response)."""

    counted: bool
    text: str


# Decides what a press means. Adapters call it for each button press on a card and answer
# the presser with its PressAnswer; it never raises for a bad press.
PressSink = Callable[[Press], Awaitable[PressAnswer]]


def utc_minute(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


class ChannelError(Exception):
    """Sending failed. ``retry_after`` is set for rate limits (seconds to wait)."""

    def __init__(
        self, message: str, *, retry_after: float | None = None, permanent: bool = False
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        # True when retrying cannot help (chat gone, bot removed, message rejected).
        self.permanent = permanent


class SendUnknown(ChannelError):
    """The request may or may not have reached the platform (timeout, connection cut)."""


# Commits the event to the inbox. When it returns, the platform may be acknowledged; when it
# raises, the adapter must not acknowledge, so the platform delivers the event again.
InboundSink = Callable[[Inbound], Awaitable[None]]


class CursorStore(Protocol):
    """Small named values a channel keeps across restarts (the store implements it):
    Telegram's next update offset, Discord's last seen message per channel."""

    async def get_cursor(self, name: str) -> str | None: ...

    async def set_cursor(self, name: str, value: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ChatCommand:
    name: str  # without the slash
    description: str


CHAT_COMMANDS: tuple[ChatCommand, ...] = (
    ChatCommand("help", "What this bot can do"),
    ChatCommand("status", "Session, model, queue and budget"),
    ChatCommand("stop", "Cancel the running turn"),
    ChatCommand("reset", "Start a fresh context (history is kept)"),
)


@dataclass(frozen=True, slots=True)
class ChannelStatus:
    platform: Platform
    connected: bool
    detail: str = ""
    counters: dict[str, int] = field(default_factory=dict)


# A channel's health detail while it can send but another replica takes in for it.
SENDING_ONLY = "sending only: another replica takes in"


class Channel(Protocol):
    """A platform connection: what every adapter has. ``start`` returns once connected and
    receiving (see :class:`DeferredIngest` for a channel made to take in later).

    What only some platforms can do is a capability protocol of its own, checked with
    ``isinstance`` by the one part that uses it: :class:`Cards` (approval cards),
    :class:`Edits` (a part's ``edit_of`` honoured, messages deleted), :class:`Lookups` (a sent
    part found by its key), :class:`Files` (user files downloaded), :class:`Typing`.
    """

    @property
    def platform(self) -> Platform: ...

    async def start(self, sink: InboundSink, presses: PressSink | None = None) -> None:
        """Connect and deliver messages to ``sink`` and card button presses to ``presses``
        (without one, presses are answered as not valid)."""

    async def stop(self) -> None: ...

    def render(self, markdown: str) -> list[str]:
        """Our markdown in the platform's format, split at the platform's limit."""

    async def send(self, part: OutboundPart) -> SentPart:
        """Send one part (uploading ``part.file`` with it, if set). Raises ChannelError (with
        retry_after on 429) or SendUnknown."""

    def status(self) -> ChannelStatus: ...


@runtime_checkable
class DeferredIngest(Protocol):
    """A channel that can be made to take in later: what only one replica at a time may do
    (Telegram's poller or webhook registration, Discord's gateway). Made so, ``start``
    returns able to send, and it receives once ``start_ingest`` returned."""

    @property
    def ingesting(self) -> bool:
        """True while this channel takes in what the platform brings (False while sending
        only, or stopped)."""

    async def start_ingest(self) -> None:
        """After ``start``: begin taking in what ``start`` left for later; does nothing if it
        takes in already. Raises ChannelError (as ``start``) when it cannot; the channel can
        still send then, and this may be called again."""


@runtime_checkable
class Edits(Protocol):
    """A platform whose messages can be changed after they were sent: ``send`` edits the
    message a part's ``edit_of`` names, and a message can be deleted (streamed previews)."""

    async def delete(self, destination: Destination, message_id: str) -> None:
        """Delete a message this bot posted. Raises ChannelError."""


@runtime_checkable
class Lookups(Protocol):
    """A platform that can say whether a part arrived, after an unknown outcome."""

    async def find_sent(self, part: OutboundPart) -> SentPart | None:
        """The part's message if the platform can tell, else None. Raises
        NotImplementedError for a part of a kind it cannot look up (a file, say)."""


@runtime_checkable
class Cards(Protocol):
    """A platform that shows approval cards with buttons."""

    async def send_card(self, destination: Destination, card: ApprovalCard) -> SentPart:
        """Post an approval card. Raises ChannelError (with retry_after on 429) or SendUnknown."""

    async def edit_card(
        self, destination: Destination, message_id: str, card: ApprovalCard
    ) -> None:
        """Replace a posted card (its outcome set: the buttons go). Raises ChannelError."""


@runtime_checkable
class Files(Protocol):
    """A platform users can send files through."""

    async def download(self, file: InboundFile, max_bytes: int) -> bytes:
        """The bytes of a file a user sent, fetched through the platform (with the bot's
        credentials where the platform needs them, and only from the platform's own hosts).

        Raises FileTooLarge as soon as more than ``max_bytes`` arrive (or are announced), so
        an oversized file is never held whole; ChannelError when the platform refuses or the
        file is gone.
        """


@runtime_checkable
class Typing(Protocol):
    """A platform that shows that the bot is typing."""

    async def typing(self, destination: Destination) -> None: ...


def command_of(text: str, bot_username: str | None = None) -> str | None:
    """``/status`` or ``/status@ThisBot`` -> ``status``; anything else -> None."""
    if not text.startswith("/"):
        return None
    head = text[1:].split(maxsplit=1)[0] if len(text) > 1 else ""
    name, _, target = head.partition("@")
    if target and bot_username and target.lower() != bot_username.lower():
        return None
    known = {c.name for c in CHAT_COMMANDS}
    return name.lower() if name.lower() in known else None


def commands_help(commands: Sequence[ChatCommand] = CHAT_COMMANDS) -> str:
    return "\n".join(f"/{c.name} - {c.description}" for c in commands)
