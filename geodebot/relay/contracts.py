"""The four versioned contracts of Thread Relay, as pydantic models with exported JSON Schema.

* :class:`ThreadLocatorV1` names a thread: where it lives (source type, adapter), whose it is
  (project), which one (session id plus thread key), what the caller may do there, and the
  capability revision the answer was given under.
* :class:`ThreadReadProjectionV1` is what a read shows of a thread: user and assistant text
  only, bounded, with what was left out said so.
* :class:`ThreadMessageEnvelopeV1` is one message sent into a thread, with everything its
  delivery is checked against (revision, active turn, idempotency key, expiry, depth).
* :class:`ThreadDeliveryReceiptV1` says how a delivery went. It holds a checksum of the text,
  never the text: the text stays in the source session (and, once delivered, in the target).

Every model is frozen and refuses unknown fields; ``schema_version`` is part of each, so a
reader can tell a future version from this one. ``geodebot relay schema`` prints the schemas.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "CONTRACTS",
    "SOURCE_TYPE",
    "DeliveryState",
    "ExcludedItem",
    "Intent",
    "ReceiptReferences",
    "SendMode",
    "ThreadDeliveryReceiptV1",
    "ThreadId",
    "ThreadLocatorV1",
    "ThreadMessageEnvelopeV1",
    "ThreadReadProjectionV1",
    "VisibleFile",
    "VisibleMessage",
    "content_sha256",
    "schemas",
]

SOURCE_TYPE = "geodebot"
Intent = Literal["notify", "ask"]
SendMode = Literal["user_authored", "agent_proposed_user_approved"]
DeliveryState = Literal["delivered", "refused", "stale", "expired", "failed", "cancelled"]
Adapter = Literal["telegram", "slack", "discord", "terminal"]

_Id = Annotated[str, Field(min_length=1, max_length=300)]
_Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class _Contract(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def content_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class ThreadId(_Contract):
    session_id: _Id
    # Where the thread is on its platform: ``platform:channel``, plus ``/thread`` for a
    # thread of a thread-scoped binding.
    thread_key: _Id


class ThreadLocatorV1(_Contract):
    schema_version: Literal[1] = 1
    # Only geodebot's own threads; a locator of any other source is refused as unsupported.
    source_type: Annotated[str, Field(min_length=1, max_length=64)] = SOURCE_TYPE
    adapter: Adapter
    project: _Id
    thread: ThreadId
    # What the caller may do there: read it, or read it and send into it.
    access_scope: Literal["read", "read_send"]
    # Changes whenever what the relay may do with the thread changes (its bindings, its
    # project, the relay's settings). A send under an older one is blocked until the thread
    # is read again.
    capability_revision: Annotated[str, Field(min_length=8, max_length=64)]
    workspace_ref: _Id | None = None
    provider_ref: _Id | None = None


class VisibleFile(_Contract):
    """A file a message carried: a reference, never the bytes."""

    sha256: _Sha256
    name: Annotated[str, Field(max_length=300)]
    media_type: Annotated[str, Field(max_length=200)]
    size: Annotated[int, Field(ge=0)]


class VisibleMessage(_Contract):
    seq: Annotated[int, Field(ge=1)]
    role: Literal["user", "assistant"]
    text: str
    # The text was cut to keep the read within its character bound.
    truncated: bool = False
    files: tuple[VisibleFile, ...] = ()
    at: float


class ExcludedItem(_Contract):
    seq: Annotated[int, Field(ge=1)]
    # tool_call, tool_result, summary, system, ...
    kind: Annotated[str, Field(max_length=64)]
    reason: Annotated[str, Field(max_length=300)]


class ThreadReadProjectionV1(_Contract):
    schema_version: Literal[1] = 1
    locator: ThreadLocatorV1
    title: Annotated[str, Field(max_length=300)]
    # idle: nothing running; running: a turn is active (see active_turn); queued: messages
    # wait behind it.
    state: Literal["idle", "running", "queued"]
    created_at: float | None
    updated_at: float | None
    active_turn: _Id | None
    # The target's last message sequence: a send based on this read expects it unchanged.
    revision: Annotated[int, Field(ge=0)]
    route: dict[str, str | None]
    model: Annotated[str, Field(max_length=300)]
    # The places the thread is bound to (binding keys).
    links: tuple[str, ...]
    # Oldest first, newest last.
    messages: tuple[VisibleMessage, ...]
    # Pass it back to read the messages before these; None: nothing older in the context.
    cursor: str | None
    excluded: tuple[ExcludedItem, ...]
    unsupported: tuple[ExcludedItem, ...]
    editing_rules: tuple[str, ...]


class ThreadMessageEnvelopeV1(_Contract):
    schema_version: Literal[1] = 1
    id: _Id
    source: ThreadLocatorV1
    target: ThreadLocatorV1
    project: _Id
    user: _Id
    role: Literal["user"] = "user"
    mode: SendMode
    text: Annotated[str, Field(min_length=1, max_length=16_000)]
    # user_authored: the source message whose exact text this is (its inbox id).
    message_ref: _Id | None = None
    attachment_refs: tuple[_Sha256, ...] = ()
    intent: Intent
    expected_revision: Annotated[int, Field(ge=0)]
    # To interject into the target's active turn, that turn's exact id.
    active_turn: _Id | None = None
    idempotency_key: Annotated[str, Field(min_length=1, max_length=128)]
    expires_at: float
    depth: Annotated[int, Field(ge=0, le=1)]

    @property
    def content_sha256(self) -> str:
        return content_sha256(self.text)

    @model_validator(mode="after")
    def _geodebot_threads_only(self) -> ThreadMessageEnvelopeV1:
        for end, locator in (("source", self.source), ("target", self.target)):
            if locator.source_type != SOURCE_TYPE:
                raise ValueError(
                    f"{end}: source type {locator.source_type!r} is not supported "
                    f"(only {SOURCE_TYPE!r})"
                )
        return self


class ReceiptReferences(_Contract):
    envelope_id: _Id
    idempotency_key: Annotated[str, Field(max_length=128)]
    message_ref: _Id | None = None
    attachment_refs: tuple[_Sha256, ...] = ()
    # Where the delivery went in the target: its inbox row (the recorded message or the
    # asked turn) and its outbox row (the attributed post).
    target_inbox: int | None = None
    target_outbox: int | None = None


class ThreadDeliveryReceiptV1(_Contract):
    schema_version: Literal[1] = 1
    id: _Id
    source: ThreadLocatorV1 | None
    target: ThreadLocatorV1 | None
    action: Intent
    state: DeliveryState
    at: float
    references: ReceiptReferences
    capability_revision: Annotated[str, Field(max_length=64)]
    content_sha256: _Sha256
    reason: Annotated[str, Field(max_length=300)] = ""


CONTRACTS: tuple[type[_Contract], ...] = (
    ThreadLocatorV1,
    ThreadReadProjectionV1,
    ThreadMessageEnvelopeV1,
    ThreadDeliveryReceiptV1,
)


def schemas() -> dict[str, Any]:
    """The JSON Schema of each contract, by name."""
    return {model.__name__: model.model_json_schema() for model in CONTRACTS}
