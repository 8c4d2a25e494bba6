"""The store's record types: what every Store method takes and returns.

Plain frozen dataclasses and literal types, no behaviour and no I/O, so the protocols
(protocol.py, jobs.py) and every layer above can share them without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast, get_args

MessageKind = Literal["message", "summary"]
BatchStatus = Literal["proposed", "done", "abandoned"]
ReceiptStatus = Literal["admitted", "committed", "failed", "uncertain"]
FinishStatus = Literal["committed", "failed", "uncertain"]
Resolution = Literal["done", "failed"]
InboxStatus = Literal["pending", "running", "done", "failed", "dropped"]
InboxFinish = Literal["done", "failed", "dropped"]
OutboxStatus = Literal["pending", "sent", "failed"]
OutboxFinish = Literal["sent", "failed"]


class StoreError(Exception):
    """A store operation failed; nothing of that operation was written."""


class Fenced(StoreError):
    """A write refused because the lease it was made under is no longer its writer's: another
    replica holds it now (see store/leases.py). Nothing was written."""


class OutboxRowFinished(StoreError):
    """A write to an outbox row that is no longer pending: another delivery finished it."""

    def __init__(self, message: str, row: OutboxRow) -> None:
        super().__init__(message)
        self.row = row


@dataclass(frozen=True, slots=True)
class SessionRecord:
    id: str
    mode: str
    created_at: float
    updated_at: float
    # Bumped by reset; messages of an older generation are never loaded again.
    generation: int
    # Free-form cognitive state of the loop (token totals, last turn id, ...).
    state: Mapping[str, Any] = field(default_factory=dict)
    # Guard counters survive restarts (rounds, repairs, consecutive failures, ...).
    guards: Mapping[str, Any] = field(default_factory=dict)
    # The seq the next appended message gets: it changes with every append, so a copy of
    # the context taken at one value is still the context while the value is unchanged.
    next_seq: int = 1


@dataclass(frozen=True, slots=True)
class NewMessage:
    """A message to append. ``content`` is the JSON of an engine ``Message``."""

    role: str
    content: Mapping[str, Any]
    turn_id: str
    kind: MessageKind = "message"
    # For summaries: the inclusive range of message seqs this summary replaces.
    covers_from: int | None = None
    covers_to: int | None = None


@dataclass(frozen=True, slots=True)
class MessageRecord:
    session_id: str
    seq: int  # strictly increasing per session, assigned by the store
    generation: int
    role: str
    content: Mapping[str, Any]
    turn_id: str
    kind: MessageKind
    covers_from: int | None
    covers_to: int | None
    created_at: float


class ContextRow(NamedTuple):
    """A message of a session's context as :meth:`Store.load_context_json` returns it.

    ``content`` is the message's JSON as the store holds it (compact, UTF-8: what
    ``json.dumps(content, ensure_ascii=False, separators=(",", ":"))`` writes), for a reader
    that decodes a long history in one pass rather than through dicts. A tuple, not a
    dataclass: one is made per message of every history read whole."""

    seq: int
    kind: MessageKind
    covers_from: int | None
    content: str


@dataclass(frozen=True, slots=True)
class ToolBatchRecord:
    """A tool batch the model proposed, saved before any of its tools runs."""

    id: str
    session_id: str
    turn_id: str
    round: int
    status: BatchStatus
    # JSON of the proposed ToolUseBlocks, in order.
    calls: Sequence[Mapping[str, Any]]
    # JSON of the ToolResultBlocks once the batch is done; empty while proposed.
    results: Sequence[Mapping[str, Any]]
    created_at: float
    finished_at: float | None


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    id: int  # strictly increasing over the whole store
    session_id: str
    turn_id: str | None
    ts: float
    kind: str
    data: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class EffectReceipt:
    """The durable trace of one effectful tool call, written before the call is dispatched.

    ``admitted`` means the call may be running. A receipt still ``admitted`` when its call can
    no longer be running (crash, deadline) becomes ``uncertain``: whether the effect happened is
    unknown, so it is never re-run; an operator looks and records a ``resolution``. The status
    stays ``uncertain`` after that, so the history keeps saying the outcome was once unknown.
    """

    id: str  # caller-assigned, unique
    # Idempotency key, unique over the store: sha256 of (session, turn, tool, canonical
    # arguments), computed by the caller.
    key: str
    session_id: str
    turn_id: str
    call_id: str  # the model's tool_use id
    tool: str
    effect: str  # "mutate" | "communicate" | "administrative"
    arguments_sha256: str
    status: ReceiptStatus
    admitted_at: float
    finished_at: float | None = None
    # committed/failed: {"result": str, "is_error": bool}; uncertain: {"reason": str}.
    outcome: Mapping[str, Any] = field(default_factory=dict)
    resolution: Resolution | None = None
    resolved_by: str | None = None
    resolved_at: float | None = None
    # The person's decision it was admitted under (an approval request's id), if any.
    approval_id: str | None = None


@dataclass(frozen=True, slots=True)
class OperatorSwitch:
    """An operator-controlled feature switch (e.g. ``computer_use``) with who set it and when."""

    name: str
    enabled: bool
    set_by: str
    set_at: float
    expires_at: float | None = None
    reason: str = ""

    def active(self, now: float) -> bool:
        """Enabled and not yet expired at ``now``; an expired switch reads as off."""
        return self.enabled and (self.expires_at is None or now < self.expires_at)


ApprovalStatus = Literal["pending", "approved", "denied", "expired"]


@dataclass(frozen=True, slots=True)
class ApprovalRecord:
    """A tool call waiting for a person's decision, asked where the call's binding lives.

    Decided once: ``pending`` moves to ``approved`` or ``denied`` (by whom, through what) or,
    past ``expires_at``, to ``expired``, which the turn treats as a denial.
    """

    id: str  # caller-assigned and unguessable: a card's buttons carry it
    session_id: str
    turn_id: str
    call_id: str  # the model's tool_use id
    tool: str
    safety: str
    # sha256 of (plan digest, tool, canonical arguments): the decision is for exactly this call.
    call_sha256: str
    summary: str  # the arguments as shown: redacted and shortened
    origin: str  # binding key (platform:channel) whose approvers decide
    approvers: Sequence[str]
    status: ApprovalStatus
    created_at: float
    expires_at: float
    decided_by: str | None = None
    decided_via: str | None = None  # "chat" | "console"
    decided_at: float | None = None
    # Where the card went: {"platform": ..., "channel": ..., "message_id": ...}; {} until sent.
    card: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OpenedSession:
    """What a turn needs before it starts, read in one transaction (:meth:`Store.open_session`)."""

    record: SessionRecord
    switch: OperatorSwitch | None
    pending: list[ToolBatchRecord]


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A file in the state directory's file store: its bytes live under their SHA-256."""

    sha256: str
    name: str
    media_type: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256,
            "name": self.name,
            "media_type": self.media_type,
            "size": self.size,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> StoredFile:
        return StoredFile(
            str(data["sha256"]), str(data["name"]), str(data["media_type"]), int(data["size"])
        )


@dataclass(frozen=True, slots=True)
class AttachedFile:
    """What became of one file a message carried: stored (``file``) or refused (``refusal``
    says why, in words for the sender and the model)."""

    name: str
    media_type: str
    size: int
    file: StoredFile | None = None
    refusal: str = ""
    # Audio that was heard (chat/voice.py): its transcript, the seconds transcribed, and
    # whether it was a voice note recorded in the app rather than an audio file.
    transcript: str = ""
    seconds: float = 0.0
    voice: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "media_type": self.media_type, "size": self.size}
        if self.file is not None:
            out["file"] = self.file.to_json()
        if self.refusal:
            out["refusal"] = self.refusal
        if self.transcript:
            out["transcript"] = self.transcript
            out["seconds"] = self.seconds
        if self.voice:
            out["voice"] = True
        return out

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> AttachedFile:
        stored = data.get("file")
        return AttachedFile(
            str(data.get("name", "")),
            str(data.get("media_type", "")),
            int(data.get("size", 0) or 0),
            StoredFile.from_json(stored) if stored else None,
            str(data.get("refusal", "")),
            str(data.get("transcript", "")),
            float(data.get("seconds", 0) or 0),
            bool(data.get("voice", False)),
        )


@dataclass(frozen=True, slots=True)
class InboxRow:
    """One accepted platform event, committed before the platform is acknowledged.

    ``pending`` and ``running`` rows are what a restart must still answer; a ``running`` row
    found after a restart had its turn cut short and is started again.
    """

    id: int  # store-assigned, increasing: arrival order
    platform: str
    event_id: str  # unique per platform; a redelivery carries the same id
    session_id: str
    channel: str
    thread: str | None
    user: str
    text: str
    message_id: str
    received_at: float
    status: InboxStatus
    attempts: int  # how many times a turn was started for it
    detail: str = ""
    finished_at: float | None = None
    # The streamed preview's platform message id ("" until one was shown).
    preview: str = ""
    # The files the platform said the message carried, as the channel described them (JSON
    # objects of channels.base.InboundFile: the store does not know that type).
    files: tuple[Mapping[str, Any], ...] = ()
    # What became of them once checked; None until then (see Store.inbox_attached).
    attached: tuple[AttachedFile, ...] | None = None
    # A message Thread Relay delivered into this session: its delivery id and intent
    # ("notify": recorded only; "ask": answered too). None for a platform's event.
    relay_id: str | None = None
    relay_intent: str | None = None
    # With replicas, the one that took it in (the session's holder answers it); None for a
    # single process, a relayed message and a replay.
    pickup: str | None = None

    @property
    def turn_id(self) -> str:
        """The turn that answers the row: named after it, so a turn a crash cut short is
        continued under the same id, and another thread can tell which turn is running."""
        return f"t-inbox-{self.id}"


@dataclass(frozen=True, slots=True)
class Speech:
    """A reply's text as it is to be spoken: plain, within ``[voice] max_speech_chars``;
    ``cut``: the answer was longer (the voice message says so)."""

    text: str
    cut: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "cut": self.cut}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Speech:
        return Speech(str(data.get("text", "")), bool(data.get("cut", False)))


@dataclass(frozen=True, slots=True)
class NewOutbound:
    """A message to deliver: the reply to an inbox row, a job result or a notice."""

    session_id: str
    platform: str
    channel: str
    thread: str | None
    reply_to: str | None
    text: str  # the whole reply, markdown; split into parts only when sent
    kind: str = "reply"  # reply | notice | job | file  (free text, for reports)
    # A file uploaded as the message, ``text`` its caption.
    file: StoredFile | None = None
    # The reply spoken too: one more part after the text (chat/voice.py).
    speech: Speech | None = None


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A message written before it is sent, with the progress of its parts."""

    id: int
    inbox_id: int | None  # the inbox row this answers, if any; at most one reply per row
    session_id: str
    platform: str
    channel: str
    thread: str | None
    reply_to: str | None
    text: str
    kind: str
    status: OutboxStatus
    # index -> platform message id, for parts already confirmed sent
    sent_parts: Mapping[int, str]
    # The part being sent when the outcome became unknown (crash, timeout), else None: its
    # message may exist, so it is looked up before it is sent again.
    in_flight: int | None
    attempts: int  # send attempts over all parts
    created_at: float
    updated_at: float
    error: str = ""
    # The streamed preview this reply replaces: part 0 edits that message ("" for none).
    preview: str = ""
    # Times an in-flight part the platform could not look up was sent again regardless; kept
    # so that a crash loop cannot turn "resend at most once" into "resend on every restart".
    blind_resends: int = 0
    # A file uploaded as the message (its only part), ``text`` its caption.
    file: StoredFile | None = None
    # What is to be spoken after the text parts, and the audio once it was made.
    speech: Speech | None = None
    spoken: StoredFile | None = None


@dataclass(frozen=True, slots=True)
class InboxEnding:
    """An inbox row's finish and reply, as :meth:`Store.inbox_finish` takes them, for
    :meth:`Store.checkpoint_ending` to write with the last checkpoint of the row's turn."""

    inbox_id: int
    status: InboxFinish
    detail: str = ""
    reply: NewOutbound | None = None
    begin_first_part: bool = False


# What finishing an inbox row wrote: the finished row and its reply, if it has one.
InboxFinished = tuple[InboxRow, OutboxRow | None]


DeadLetterKind = Literal["inbox", "outbox"]
DeadLetterAction = Literal["replay", "discard"]
DecisionVia = Literal["cli", "console"]
# What deciding on a dead letter came to: the decision was made (and, for a replay, the row
# reset to pending); an earlier decision stands; the row is no dead letter; there is no row.
DecideResult = Literal["decided", "already_decided", "not_dead", "unknown"]


@dataclass(frozen=True, slots=True)
class DeadLetterDecision:
    """An operator's one decision on a dead letter (see migration 0012)."""

    seq: int  # increasing: a daemon picks up replays after the last one it saw
    kind: DeadLetterKind
    row_id: int
    action: DeadLetterAction
    by: str
    via: DecisionVia
    at: float
    # The row's error (outbox) or detail (inbox) when it was decided.
    detail: str = ""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An inbox or outbox row as a dead letter: ``dead`` says whether it is one now (a row
    replayed and answered since is not), ``decision`` what the operator decided, if anything."""

    row: InboxRow | OutboxRow
    dead: bool
    decision: DeadLetterDecision | None = None

    @property
    def kind(self) -> DeadLetterKind:
        return "inbox" if isinstance(self.row, InboxRow) else "outbox"

    @property
    def id(self) -> str:
        """``in-<inbox id>`` or ``out-<outbox id>``: what the CLI and the console take."""
        return f"{'in' if self.kind == 'inbox' else 'out'}-{self.row.id}"

    @property
    def error(self) -> str:
        """Why it is dead: the sender's error, or the inbox row's detail."""
        return self.row.error if isinstance(self.row, OutboxRow) else self.row.detail

    @property
    def at(self) -> float:
        """When it died: the outbox row's last change, or the inbox row's finish."""
        if isinstance(self.row, OutboxRow):
            return self.row.updated_at
        return self.row.finished_at if self.row.finished_at is not None else self.row.received_at


@dataclass(frozen=True, slots=True)
class DeadLetterDecided:
    """What :meth:`Store.deadletter_replay` and ``deadletter_discard`` did. ``decision``: the
    new one (``decided``) or the one that stands (``already_decided``); ``row``: the row as
    it is after the call (None for ``unknown``)."""

    result: DecideResult
    decision: DeadLetterDecision | None
    row: InboxRow | OutboxRow | None


@dataclass(frozen=True, slots=True)
class Unanswered:
    """Accepted messages still without a reply (inbox rows pending or running, their turn not
    waiting for an approval) received more than a given time ago: how many, and the age of
    the oldest in seconds (None if none)."""

    count: int
    oldest_age_s: float | None


JobOrigin = Literal["config", "chat", "cli"]
CatchUp = Literal["latest", "skip", "all"]
FireCause = Literal["schedule", "catch-up", "manual"]
FireOutcome = Literal[
    "requested",
    "running",
    "delivering",
    "ok",
    "failed",
    "budget",
    "skipped-overlap",
    "skipped-missed",
    "delivery-failed",
]
FireEnd = Literal["failed", "budget"]
NoticeStatus = Literal["", "pending", "delivered", "delivery-failed"]
# Outcomes that are final; "requested", "running" and "delivering" are not yet.
FINAL_OUTCOMES: frozenset[str] = frozenset(
    {"ok", "failed", "budget", "skipped-overlap", "skipped-missed", "delivery-failed"}
)


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    origin: JobOrigin
    schedule_kind: Literal["cron", "every", "at"]
    schedule: str
    timezone: str
    anchor_ms: int
    prompt: str
    # The session of the binding it posts in; with ``deliver_binding`` informative only.
    deliver_to: str
    # The job's own session: unique to this job's life for chat- and CLI-made jobs.
    session_id: str
    tools: tuple[str, ...]
    time_budget_s: float | None
    catch_up: CatchUp
    notify_on_failure: bool
    # "" for config jobs; who made it otherwise: "binding:<platform>:<channel>" for a chat
    # ("binding:<session>" in rows written before chats were named by key), "cli:<user>".
    creator: str
    paused: bool
    since_ms: int
    created_at: float
    updated_at: float
    # The key (``platform:channel``) of the binding it posts in: a session may be shared by
    # several bindings, a key names one chat. "" in rows written before it was recorded:
    # they post in the one binding whose session is ``deliver_to``, and fail if several
    # share it (see scheduler/definitions.py, ``delivery_binding``).
    deliver_binding: str = ""

    def definition(self) -> tuple[object, ...]:
        """What decides when and how the job runs (not its pause state or bookkeeping)."""
        return (
            self.schedule_kind,
            self.schedule,
            self.timezone,
            self.anchor_ms,
            self.prompt,
            self.deliver_to,
            self.session_id,
            self.tools,
            self.time_budget_s,
            self.catch_up,
            self.notify_on_failure,
            self.deliver_binding,
        )


@dataclass(frozen=True, slots=True)
class FireRecord:
    id: int
    job_id: str
    scheduled_ms: int
    cause: FireCause
    outcome: FireOutcome
    reason: str
    claimed_at: float
    started_at: float | None
    ended_at: float | None
    outbox_id: int | None
    notice: NoticeStatus
    # The replica that started the run (with replicas; see JobStore.fire_claim).
    replica: str = ""

    @property
    def final(self) -> bool:
        return self.outcome in FINAL_OUTCOMES


@dataclass(frozen=True, slots=True)
class RelayDelivery:
    """One Thread Relay delivery attempt and its receipt (see relay/contracts.py)."""

    id: str
    source_session: str
    target_session: str
    project: str
    user: str
    source_turn: str
    # The sender's idempotency key; None for an attempt that was refused.
    idem_key: str | None
    intent: str
    mode: str
    state: str
    reason: str
    content_sha256: str
    # ThreadDeliveryReceiptV1 as JSON.
    receipt: Mapping[str, Any]
    created_at: float
    inbox_id: int | None = None
    outbox_id: int | None = None
    # ThreadMessageEnvelopeV1 as JSON without its text; empty for an attempt refused before
    # it had one.
    envelope: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RelayRead:
    """What a session last read of another thread; a send is checked against it."""

    source_session: str
    target_session: str
    revision: int
    capability: str
    active_turn: str | None
    adapter: str
    read_at: float


@dataclass(frozen=True, slots=True)
class RelayedMessage:
    """A delivery's message as its target's inbox keeps it."""

    platform: str
    channel: str
    thread: str | None
    user: str
    text: str


class RelayInFlight(StoreError):
    """A delivery was refused: its source has as many deliveries in flight as it may."""

    def __init__(self, in_flight: int) -> None:
        super().__init__(f"{in_flight} deliveries from this thread are still in flight")
        self.in_flight = in_flight


# -- token and spend budgets -------------------------------------------------------------
SpendUnit = Literal["tokens", "usd"]
UsageGrouping = Literal["all", "binding", "job", "day"]
ModelCallState = Literal["reserved", "settled", "failed"]


@dataclass(frozen=True, slots=True)
class SpendCharge:
    """One budget a model call counts against: its counter ``(scope, period)``, in tokens or
    US dollars, and its limit (None: counted, not limited)."""

    scope: str
    period: str
    unit: SpendUnit
    limit: float | None = None


@dataclass(frozen=True, slots=True)
class SpendRefusal:
    """The budget a reservation did not fit: what it had used, and what the call needed."""

    charge: SpendCharge
    used: float
    needed: float


@dataclass(frozen=True, slots=True)
class ModelCall:
    """One model call's row (see migration 0011): reserved, then settled."""

    id: str
    day: str
    created_at: float
    session_id: str
    turn_id: str | None
    binding: str | None
    job: str | None
    run: str | None
    state: ModelCallState
    reserved_tokens: int = 0
    reserved_usd: float = 0.0
    provider: str = ""
    model: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    # None: no prices configured for the model that answered.
    cost_usd: float | None = None
    settled_at: float | None = None
    # An audio service's call (provider "audio"): the seconds it transcribed, the
    # characters it spoke.
    audio_seconds: float = 0.0
    spoken_chars: int = 0


@dataclass(frozen=True, slots=True)
class UsageRow:
    """``geodebot usage``: the calls of one group (a binding, a job, a day, or all)."""

    key: str
    calls: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    # Calls a crash left reserved, counted in their budgets at their worst case.
    unsettled: int
    unsettled_tokens: int
    cost_usd: float
    # Calls whose model had no prices: their cost is not in cost_usd.
    unpriced: int
    # Of the audio services' calls: seconds transcribed and characters spoken.
    audio_seconds: float = 0.0
    spoken_chars: int = 0


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease as the store holds it (see store/leases.py). Times are the database's clock:
    compare them with each other, never with a replica's."""

    name: str
    holder: str
    epoch: int
    expires_at: float
    acquired_at: float
    # The database's clock when this copy was read.
    read_at: float

    @property
    def remaining_s(self) -> float:
        """How long the lease had left when it was read (negative: expired)."""
        return self.expires_at - self.read_at


@dataclass(frozen=True, slots=True)
class ReplicaRecord:
    """A replica as it last said it was there (see store/replicas.py). Times are the
    database's clock."""

    replica_id: str
    # "leader" (holds the daemon's lease) or "member"
    role: str
    host: str
    pid: int
    started_at: float
    seen_at: float
    # The database's clock when this copy was read.
    read_at: float

    @property
    def seen_s_ago(self) -> float:
        return max(0.0, self.read_at - self.seen_at)


# -- pairing and stored bindings ---------------------------------------------------------
PairingStatus = Literal["pending", "approved", "denied", "expired"]
PairingOutcome = Literal["code", "waiting", "quiet", "full", "bound"]


@dataclass(frozen=True, slots=True)
class PairingRecord:
    """A stranger's request to talk to the bot (see store/pairing.py)."""

    id: int
    platform: str
    code: str
    user: str
    user_name: str
    channel: str
    thread: str | None
    is_dm: bool
    # The first 200 characters of what they wrote, for the operator: nothing more is kept.
    first_text: str
    event_id: str
    created_at: float
    expires_at: float
    noticed_at: float
    # As stored: a pending request past its expiry reads "pending" here; see ``state``.
    status: PairingStatus
    decided_at: float | None
    decided_by: str
    binding_key: str

    def state(self, now: float) -> PairingStatus:
        """The status as of ``now``: a pending request past its expiry is expired."""
        if self.status == "pending" and self.expires_at <= now:
            return "expired"
        return self.status


@dataclass(frozen=True, slots=True)
class PairingAsk:
    """What :meth:`~geodebot.store.pairing.PairingStore.pairing_request` is asked: a
    message from a sender no binding allows, and what to answer it with. The texts are made
    inside the transaction, from the code and expiry it decided on."""

    platform: str
    channel: str
    thread: str | None
    user: str
    user_name: str
    is_dm: bool
    first_text: str
    event_id: str
    message_id: str
    # The code to give if a new request is made (the caller's random one).
    code: str
    ttl_s: float
    max_pending: int
    # A sender whose request waits is told so at most this often.
    notice_every_s: float
    # The session the answers' outbox rows are written under.
    session_id: str
    # (code, expires_at) -> the answer giving a new code; the notice that one waits.
    say_code: Callable[[str, float], str]
    say_waiting: Callable[[str, float], str]


@dataclass(frozen=True, slots=True)
class PairingAnswer:
    """What a stranger's message came to: ``code`` (a new request, answered with its code),
    ``waiting`` (theirs waits: told so again), ``quiet`` (told already, or denied: nothing),
    ``full`` (too many waiting on the platform: nothing), ``bound`` (a stored binding has
    the chat now: the message is for it)."""

    outcome: PairingOutcome
    pairing: PairingRecord | None = None
    outbound: OutboxRow | None = None
    binding: StoredBinding | None = None


@dataclass(frozen=True, slots=True)
class StoredBinding:
    """A binding made at run time (see store/pairing.py): its table as a config binding's,
    not yet validated (the chat layer does that when it reads it)."""

    key: str
    platform: str
    channel: str
    data: Mapping[str, Any]
    # What made it: "pairing:<code>", or "cli".
    origin: str
    created_at: float
    created_by: str


MemoryOrigin = Literal["chat", "relay", "job", "terminal", "import"]


@dataclass(frozen=True, slots=True)
class MemoryItem:
    """One thing the agent saved for a project (see store/memory.py), with its provenance:
    the session, turn and person it was saved for, and how the turn's message came."""

    ref: str
    project: str
    text: str
    tags: tuple[str, ...] = ()
    session_id: str = ""
    turn_id: str = ""
    user: str = ""
    origin: MemoryOrigin = "chat"
    # The turn's message came through Thread Relay (a relayed ask).
    forwarded: bool = False
    created_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.ref,
            "project": self.project,
            "text": self.text,
            "tags": list(self.tags),
            "session": self.session_id,
            "turn": self.turn_id,
            "user": self.user,
            "origin": self.origin,
            "forwarded": self.forwarded,
            "created_at": self.created_at,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> MemoryItem:
        """An exported item; raises ValueError (naming the field) for one that is not."""
        try:
            tags = data.get("tags", [])
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise ValueError("tags must be a list of strings")
            origin = str(data.get("origin", "import"))
            if origin not in get_args(MemoryOrigin):
                raise ValueError(f"origin must be one of {', '.join(get_args(MemoryOrigin))}")
            return MemoryItem(
                ref=_text(data, "id"),
                project=_text(data, "project"),
                text=_text(data, "text"),
                tags=tuple(tags),
                session_id=str(data.get("session", "")),
                turn_id=str(data.get("turn", "")),
                user=str(data.get("user", "")),
                origin=cast(MemoryOrigin, origin),
                forwarded=bool(data.get("forwarded", False)),
                created_at=float(data.get("created_at", 0.0)),
            )
        except (TypeError, KeyError) as exc:
            raise ValueError(f"not a memory item: {exc}") from None


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string")
    return value


@dataclass(frozen=True, slots=True)
class MemoryHit:
    """A search's result: the item and its rank (higher is better, comparable only within
    one search)."""

    item: MemoryItem
    score: float
