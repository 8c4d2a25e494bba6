"""DM pairing: how a person no binding allows comes to talk to the bot.

A direct message from a sender no binding has, on a platform with pairing on, meets the
gate's "unbound" and comes here instead of being dropped without a word: it gets one reply
with a one-time code and what to tell the operator, and nothing else happens (no session, no
model call, nothing of the text kept but the request's first 200 characters). Only an
operator approves a code (``geodebot pairing approve``, or the console), which stores a
binding for the chat; the daemons see it within a second (chat/stored_bindings.py) and the
person's next message is answered.

Pairing changes who may talk to the bot, never what a session may do: what an approval grants
is the ``[pairing]`` table's (no tools by default), unless the operator gives more there.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from geodebot.channels.base import Inbound
from geodebot.config.schema import BindingConfig, PairingConfig
from geodebot.engine.ledger import EvidenceLedger
from geodebot.engine.modes import Mode, denied_tools
from geodebot.store.pairing import BINDINGS_TOPIC, PairingStore
from geodebot.store.protocol import WakeStore
from geodebot.store.records import (
    NewOutbound,
    OutboxRow,
    PairingAnswer,
    PairingAsk,
    PairingRecord,
    StoredBinding,
)

__all__ = [
    "CODE_ALPHABET",
    "CODE_LENGTH",
    "FIRST_TEXT_CHARS",
    "NOTICE_EVERY_S",
    "PairingDecisions",
    "PairingDesk",
    "format_code",
    "grant",
    "new_code",
    "normalise_code",
    "pairing_session",
]

log = logging.getLogger(__name__)

# Crockford's base32: no I, L, O or U to misread. 10 characters are 50 bits: a guess at one
# of max_pending live codes is a 1 in 10^14 chance, and only an operator can use one anyway.
CODE_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
CODE_LENGTH = 10
FIRST_TEXT_CHARS = 200
# A sender whose request waits is told so again at most this often.
NOTICE_EVERY_S = 60.0
_MISREAD = str.maketrans({"O": "0", "I": "1", "L": "1"})


def new_code() -> str:
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def format_code(code: str) -> str:
    """As shown to people: ``ABCDE-FGHJK``."""
    half = len(code) // 2
    return f"{code[:half]}-{code[half:]}"


def normalise_code(text: str) -> str:
    """A code as typed (any case, with or without the dash, O for 0): as stored. Raises
    ValueError if it cannot be a code."""
    code = "".join(text.split()).replace("-", "").upper().translate(_MISREAD)
    if len(code) != CODE_LENGTH or any(c not in CODE_ALPHABET for c in code):
        raise ValueError(f"{text!r} is not a pairing code (10 letters and digits, as ABCDE-12345)")
    return code


def pairing_session(platform: str, record: PairingRecord) -> str:
    """The session an approved pairing runs on: the person's own for a direct message, the
    chat's for a group."""
    if record.is_dm:
        return f"dm:{platform}:{record.user}"
    return f"group:{platform}:{record.channel}"


def grant(
    config: PairingConfig,
    record: PairingRecord,
    *,
    tools: Sequence[str] | None = None,
    session: str | None = None,
) -> dict[str, Any]:
    """The binding an approval of ``record`` stores: the ``[pairing]`` table's grant (or the
    operator's ``tools``), the person alone allowed, validated as a config binding is."""
    data: dict[str, Any] = {
        "platform": record.platform,
        "channel": record.channel,
        "session": session or pairing_session(record.platform, record),
        "allowed_users": [record.user],
        # In a group the bot answers the person paired only when they mention it.
        "require_mention": not record.is_dm,
        "tools": list(config.tools if tools is None else tools),
        "preapproved": [t for t in config.preapproved if tools is None or t in tools],
        "approvers": [record.user if a == "self" else a for a in config.approvers],
    }
    if config.time_budget_s is not None:
        data["time_budget_s"] = config.time_budget_s
    if config.daily_tokens is not None:
        data["daily_tokens"] = config.daily_tokens
    if config.project is not None:
        data["project"] = config.project
    BindingConfig.model_validate(data)
    return data


def welcome(record: PairingRecord, session: str) -> NewOutbound:
    return NewOutbound(
        session_id=session,
        platform=record.platform,
        channel=record.channel,
        thread=record.thread,
        reply_to=None,
        text="You are paired: the operator approved your request. Write to me any time.",
        kind="notice",
    )


def _minutes(seconds: float) -> str:
    minutes = max(1, round(seconds / 60))
    return "1 minute" if minutes == 1 else f"{minutes} minutes"


class PairingDesk:
    """Answers strangers' messages with codes (see the module's docstring); one per daemon,
    beside the router, which hands it what the gate found unbound."""

    def __init__(
        self,
        store: PairingStore,
        config: PairingConfig,
        *,
        submit: Callable[[OutboxRow], None],
        refresh: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._submit = submit
        # Reads the stored bindings in again: one is there that this process has not read.
        self._refresh = refresh

    @property
    def config(self) -> PairingConfig:
        return self._config

    def reconfigure(self, config: PairingConfig) -> None:
        self._config = config

    def takes(self, inbound: Inbound) -> bool:
        """Whether an unbound message may ask to pair: pairing is on for its platform, it is
        a person's, and it is a direct message (or groups pair too)."""
        if not self._config.on_for(inbound.platform) or inbound.is_bot or inbound.is_self:
            return False
        if not inbound.is_dm and not (self._config.groups and inbound.mentions_bot):
            return False
        return bool(inbound.text.strip() or inbound.files)

    async def ask(self, inbound: Inbound) -> PairingAnswer:
        """The store's answer to an unbound message :meth:`takes`, its reply handed to the
        outbox."""
        answer = await self._store.pairing_request(self._asking(inbound))
        if answer.outcome == "code" and answer.pairing is not None:
            log.info(
                "pairing: %s user %s asked to pair (code %s); approve with: "
                "geodebot pairing approve %s %s",
                inbound.platform,
                inbound.user,
                format_code(answer.pairing.code),
                inbound.platform,
                format_code(answer.pairing.code),
            )
        elif answer.outcome == "bound" and self._refresh is not None:
            await self._refresh()
        elif answer.outcome == "full":
            log.warning(
                "pairing: %d requests wait on %s already (max_pending); user %s got no code",
                self._config.max_pending,
                inbound.platform,
                inbound.user,
            )
        if answer.outbound is not None:
            self._submit(answer.outbound)
        return answer

    def _asking(self, inbound: Inbound) -> PairingAsk:
        platform = inbound.platform

        def say_code(code: str, expires_at: float) -> str:
            shown = format_code(code)
            ttl = _minutes(self._config.code_ttl_s)
            return (
                "Hello! I only talk to people my operator has approved. To ask for access, "
                f"send the operator this code: **{shown}**\n\n"
                f"They approve it with `geodebot pairing approve {platform} {shown}`. "
                f"The code is valid for {ttl}."
            )

        def say_waiting(code: str, expires_at: float) -> str:
            return (
                f"Your request ({format_code(code)}) is waiting for the operator's approval. "
                "I will tell you when it is approved."
            )

        return PairingAsk(
            platform=platform,
            channel=inbound.channel,
            thread=inbound.thread,
            user=inbound.user,
            user_name=inbound.user_name[:200],
            is_dm=inbound.is_dm,
            first_text=inbound.text[:FIRST_TEXT_CHARS],
            event_id=inbound.event_id,
            message_id=inbound.message_id,
            code=new_code(),
            ttl_s=self._config.code_ttl_s,
            max_pending=self._config.max_pending,
            notice_every_s=NOTICE_EVERY_S,
            session_id=f"pairing:{platform}:{inbound.user}",
            say_code=say_code,
            say_waiting=say_waiting,
        )


class PairingDecisionsStore(PairingStore, WakeStore, Protocol):
    """Requests and stored bindings, and the wake-ups that tell the daemons of a change."""


class PairingDecisions:
    """The operator's side, for the CLI and the console alike: approve or deny a code,
    remove a stored binding. Each is one store transaction, then the ledger's record and a
    wake-up for the daemons (which also look by themselves every second)."""

    def __init__(
        self,
        store: PairingDecisionsStore,
        config: PairingConfig,
        *,
        ledger: EvidenceLedger | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._ledger = ledger

    async def approve(
        self,
        platform: str,
        code: str,
        *,
        by: str,
        via: str,
        tools: Sequence[str] | None = None,
        session: str | None = None,
    ) -> tuple[PairingRecord, StoredBinding]:
        """Raises ValueError for a code or grant that cannot be, PairingRefused for a code
        that is not pending (decided, expired, unknown)."""
        code = normalise_code(code)
        if tools is not None:
            never = sorted(set(tools) & denied_tools(Mode.DAEMON) - {"computer"})
            if never:
                raise ValueError(f"never available to a chat: {', '.join(never)}")

        def granting(record: PairingRecord) -> tuple[dict[str, Any], NewOutbound]:
            data = grant(self._config, record, tools=tools, session=session)
            return data, welcome(record, str(data["session"]))

        record, binding, _ = await self._store.pairing_approve(
            platform, code, grant=granting, by=by
        )
        await self._store.wake(BINDINGS_TOPIC)
        self._record(
            "pairing_approved",
            platform=platform,
            code=code,
            user=record.user,
            binding=binding.key,
            session=binding.data.get("session"),
            tools=list(binding.data.get("tools", ())),
            by=by,
            via=via,
        )
        return record, binding

    async def deny(self, platform: str, code: str, *, by: str, via: str) -> PairingRecord:
        code = normalise_code(code)
        record = await self._store.pairing_deny(platform, code, by=by)
        self._record(
            "pairing_denied", platform=platform, code=code, user=record.user, by=by, via=via
        )
        return record

    async def remove_binding(self, key: str, *, by: str, via: str) -> StoredBinding | None:
        removed = await self._store.binding_remove(key, by=by)
        if removed is not None:
            await self._store.wake(BINDINGS_TOPIC)
            self._record("binding_removed", binding=key, origin=removed.origin, by=by, via=via)
        return removed

    def _record(self, kind: str, **fields: Any) -> None:
        if self._ledger is not None:
            self._ledger.record(kind, **fields)
