"""The inbound gate: which chat messages may start a turn at all.

One small check per step, in order; the first that says no decides. Deny by default: an
unbound channel, a sender not on the binding's list, any bot (this one included) and an
unmentioned message where a mention is required are dropped without a model call.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from geodebot.channels.base import Inbound
from geodebot.chat.bindings import BindingIndex
from geodebot.config.schema import BindingConfig
from geodebot.store.protocol import InboxOutboxStore
from geodebot.store.records import InboxRow

DropReason = Literal["unbound", "self", "bot", "user_not_allowed", "no_mention", "empty"]


@dataclass(frozen=True, slots=True)
class Accepted:
    binding: BindingConfig
    session_id: str
    # Set when the message is too long to run: it gets this short refusal, no model call.
    refusal: str | None = None


@dataclass(frozen=True, slots=True)
class Dropped:
    reason: DropReason


Decision = Accepted | Dropped
Check = Callable[[Inbound, BindingConfig], DropReason | None]


def _self(inbound: Inbound, binding: BindingConfig) -> DropReason | None:
    return "self" if inbound.is_self else None


def _bot(inbound: Inbound, binding: BindingConfig) -> DropReason | None:
    # Other bots are never answered: two bots answering each other loop forever.
    return "bot" if inbound.is_bot else None


def _sender(inbound: Inbound, binding: BindingConfig) -> DropReason | None:
    allowed = binding.allowed_users
    return None if "*" in allowed or inbound.user in allowed else "user_not_allowed"


def _mention(inbound: Inbound, binding: BindingConfig) -> DropReason | None:
    if binding.require_mention and not inbound.mentions_bot and not inbound.is_dm:
        return "no_mention"
    return None


def _empty(inbound: Inbound, binding: BindingConfig) -> DropReason | None:
    # Files alone are a message (a screenshot sent without a word).
    return "empty" if not inbound.text.strip() and not inbound.files else None


CHECKS: tuple[Check, ...] = (_self, _bot, _sender, _mention, _empty)


def session_for(binding: BindingConfig, inbound: Inbound) -> str:
    if binding.scope == "thread" and inbound.thread:
        return f"{binding.session}/{inbound.thread}"
    return binding.session


def decide(inbound: Inbound, index: BindingIndex, max_chars: int) -> Decision:
    binding = index.find(inbound.platform, inbound.channel)
    if binding is None:
        return Dropped("unbound")
    for check in CHECKS:
        reason = check(inbound, binding)
        if reason is not None:
            return Dropped(reason)
    return Accepted(binding, session_for(binding, inbound), too_long(inbound.text, max_chars))


def too_long(text: str, max_chars: int) -> str | None:
    """The refusal for a message too long to run, or None."""
    if len(text) <= max_chars:
        return None
    return (
        f"That message is {len(text):,} characters long; the limit here is {max_chars:,}. "
        "Please send something shorter."
    )


async def commit(
    store: InboxOutboxStore,
    index: BindingIndex,
    max_chars: Mapping[str, int],
    inbound: Inbound,
    counters: collections.Counter[str],
    *,
    pickup: str | None = None,
) -> tuple[Accepted, InboxRow, bool] | Dropped:
    """The gate, then the inbox: ``(decision, row, new)`` once committed, not yet synced
    (the platform may be acknowledged once ``store.sync()`` has returned too), or what the
    gate dropped it for (counted in ``counters``)."""
    counters["received"] += 1
    decision = decide(inbound, index, max_chars.get(inbound.platform, 16_000))
    if not isinstance(decision, Accepted):
        counters[f"dropped:{decision.reason}"] += 1
        return decision
    row, new = await store.inbox_add(
        platform=inbound.platform,
        event_id=inbound.event_id,
        session_id=decision.session_id,
        channel=inbound.channel,
        thread=inbound.thread,
        user=inbound.user,
        text=inbound.text,
        message_id=inbound.message_id,
        files=[f.to_json() for f in inbound.files],
        pickup=pickup,
        durable=False,
    )
    return decision, row, new
